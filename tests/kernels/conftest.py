"""Kernel tests run the Triton kernels on CPU through the interpreter when there is no GPU.

Triton decides at import time whether `@triton.jit` builds interpreted kernels (its own `tl.randint4x` too),
so TRITON_INTERPRET must be set before anything imports triton: tests/conftest.py does it when CUDA is absent,
and the assertion below fails loudly if it did not take effect. With CUDA the kernels are compiled for the GPU
and these tests compare them with their references on CUDA tensors where they say so.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from fspec.kernels import ops  # noqa: E402

if not torch.cuda.is_available():
    assert ops.kernels_interpreted(), (
        "triton was imported before TRITON_INTERPRET=1 was set, so the kernels were built for a GPU; set it "
        "before the first `import triton` / `import fspec` (top of tests/conftest.py)"
    )
