"""Functional models: params dicts in, tensors out.

`fspec.models.llama` is the target (`fspec.models.layers` its building blocks); the draft heads and their
dispatch (`head_forward`, `head_init`, ...) live in `fspec.models.heads`; `fspec.models.checkpoint` loads and
saves both (`fspec.models.gguf` reads GGUF files).
"""
