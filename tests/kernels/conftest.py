"""Kernel tests run the Triton kernels on CPU through the interpreter.

Triton decides at import time whether `@triton.jit` builds interpreted kernels (its own `tl.randint4x` too),
so TRITON_INTERPRET must be set before anything imports triton; the assertion below fails loudly otherwise.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from fspec.kernels import ops  # noqa: E402

assert ops.kernels_interpreted(), (
    "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so the kernels were "
    "built for a GPU; set it before the first `import triton` / `import fspec` (top of tests/conftest.py)"
)
