"""How fspec's kernels are registered and called: a torch.library op while anything traces, the op's own
implementation directly otherwise.

An eager call through `torch.ops.fspec.*` makes a round trip through the dispatcher and torch.library's
Python wrappers: 25-81 µs of host time per call on the H200 host (`benchmarks/bench_dispatch.py`, torch
2.11; most for the ops that mutate buffers), 11-34 µs for a no-op custom op on a CPU with torch 2.13, when a
small kernel runs in 3-7 µs. `call`
skips it when nothing can observe the difference: not under torch.compile, no functorch transform (vmap,
grad), no TorchDispatchMode, and every tensor argument a plain tensor (or parameter) that does not require
grad. Otherwise it calls the op, so fake tensors, tracing, autograd's refusal of these ops and dispatch modes
see exactly what they saw before.

    @register("fspec::name", mutates_args=(...))   # torch.library.custom_op
    def name(x: Tensor, ...) -> Tensor: ...        # the implementation (kernel or reference)
    name(x, ...)                                   # what fspec's code calls: the typed function `register`
                                                   # returns, with the choice above inside it

The returned function keeps the implementation's name, signature and docstring (a reader, an IDE or a type
checker follows a call to its definition); `name.op` is the torch.library op, `name.impl` the
implementation, and `name.register_fake` / `name.register_vmap` are the op's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

import torch
import triton
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode
from triton.runtime.interpreter import InterpretedFunction

_PLAIN = (Tensor, torch.nn.Parameter)


@triton.jit
def _probe():  # built like every kernel: interpreted when TRITON_INTERPRET=1 was set before triton's import
    pass


def kernels_interpreted() -> bool:
    """True when the Triton kernels were built by the interpreter (TRITON_INTERPRET=1 at import time)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(_probe, InterpretedFunction)


def use_triton(t: Tensor) -> bool:
    """Run the Triton kernel (CUDA tensors, or interpreted kernels outside tracing), else the reference."""
    return t.is_cuda or (kernels_interpreted() and not torch.compiler.is_compiling())


def register(qualname: str, *, mutates_args: Iterable[str]) -> Callable:
    """`torch.library.custom_op(qualname, mutates_args=...)`, returned as a typed function that calls the
    implementation directly where `direct` allows and the op otherwise."""
    namespace, name = qualname.split("::")
    if namespace != "fspec":
        raise ValueError(f"qualname: expected an op of the 'fspec' namespace, got {qualname!r}")

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(qualname, mutates_args=tuple(mutates_args))(fn)
        overload = getattr(torch.ops.fspec, name).default

        @functools.wraps(fn)
        def typed(*args, **kwargs):
            if not torch.compiler.is_compiling() and direct((*args, *kwargs.values())):
                return typed.impl(*args, **kwargs)
            return overload(*args, **kwargs)

        typed.op, typed.impl = op, fn
        typed.register_fake, typed.register_vmap = op.register_fake, op.register_vmap
        return typed

    return wrap


def direct(args: Iterable[object]) -> bool:
    """True when calling an op's implementation directly is indistinguishable from calling the op."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    for a in args:
        if isinstance(a, Tensor) and (type(a) not in _PLAIN or a.requires_grad):
            return False
    return True
