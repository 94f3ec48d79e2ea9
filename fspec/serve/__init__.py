"""Generation. Imports: rounds.py (the device functions of a round) <- prefill.py (`fspec.prefill`, and the
checks of the public boundary) <- runner.py (`Run`: one batch's host loop; `Generator`, `GenerateResult`) <-
engine.py (`fspec.generate`)."""
