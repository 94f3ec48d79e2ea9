"""Training: the TTT loss and step (ttt.py), distillation (distill.py), its data and prompt sets, the shipped
default model's recipe (default_model.py) and the toy model (toy_model.py)."""
