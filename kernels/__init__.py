"""Triton kernels of fspec, each beside its plain-PyTorch reference (installed as `fspec.kernels`)."""
