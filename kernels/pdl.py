"""Programmatic dependent launch (PDL) for fspec's kernels: on wherever the device has it (Hopper or later).

A kernel launched with the PDL attribute may be scheduled before the kernel ahead of it in the stream has
finished: once every program of the earlier kernel has executed `griddepcontrol.launch_dependents` (or
exited). It then waits in `griddepcontrol.wait` until that kernel has completed and its writes are visible.
What overlaps is the launch latency, the program start-up and whatever a program does before its wait;
in a CUDA graph of a decode step (~25 launches of 1-30 us with ~0.5 us idle gaps between them) that is the
fixed cost per launch that the bytes-over-bandwidth floor does not see.

The contract every fspec kernel keeps when it takes `PDL: tl.constexpr`: `pdl_enter(PDL)` comes before its
first read of anything another kernel writes and before its first write. Then no kernel of the chain can
finish before the one ahead of it has, so the ordering is transitive: a PDL kernel that starts early never
sees a write of any earlier kernel still in flight. Reads of weights (constant during a forward) may come
before it; `skinny_linear` loads its first weight tile there. Kernels launched without the attribute (cuBLAS,
Inductor's kernels unless TORCHINDUCTOR_ENABLE_PDL=1) keep plain stream order.

Two relaxations, each a flag its caller sets because only the caller knows the neighbours (the layers of
fspec/ops/attention.py do): when a PDL kernel starts, the kernel ahead has passed its wait, so every launch
before that one has completed and only what the kernel ahead writes is unsafe to read. The paged attention
with `early_kv` reads before its wait what older launches wrote (metadata, block table, the cache rows
before the forward's own tokens): the kernel ahead must write nothing of that. Its reduce with
`early_release` lets its successor launch before its own wait (`pdl_release_then_wait`): the successor must
read nothing before its wait but constants (a `skinny_linear` o projection). A grid releases its successor
only once all its programs run, so an early successor never holds the SMs a predecessor still needs.

    options(t) -> {"PDL": True, "launch_pdl": True} or {}      keyword arguments for a launch
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later under CUDA 12.3 or later, whose CUDA graphs keep
    programmatic launches as graph edges (ROCm devices report capabilities too, but have no
    griddepcontrol)."""
    if torch.version.hip is not None or torch.version.cuda is None:
        return False
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    return cuda >= (12, 3) and torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: Tensor) -> bool:
    """`t` on a CUDA device of compute capability 9.0 or later (never the interpreter: its tensors are on
    the CPU)."""
    return t.is_cuda and _hopper_or_later(t.device.index or 0)


def options(t: Tensor) -> dict:
    """The launch keywords of a kernel taking `PDL: tl.constexpr`: its constexpr and Triton's launch flag."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel ahead in the stream, then let the next one launch (both no-ops unless PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release_then_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the one ahead: for a kernel whose successor reads nothing
    before its own wait but constants (weights), so that successor's pre-wait loads start earlier."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
