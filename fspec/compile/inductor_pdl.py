"""Inductor's programmatic dependent launch with a wait in every kernel, for fspec's own compiles only.

Inductor's own switch (`triton.enable_pdl`) launches its Triton kernels with the PDL attribute and puts
`gdc_wait` before the first access to a buffer that the previous Inductor kernel wrote (or, for a store,
read or wrote), `gdc_launch_dependents` after the last load. A kernel that loads nothing such a kernel
touched and stores only to buffers it did not touch (a fill, say) gets no wait at all: it may be scheduled
when its predecessor triggers and finish before that predecessor does, and the kernel after it, which waits
only on its own predecessor, can then read the first one's output while it is still being written. PDL chains
are only transitive when every kernel in them waits before it finishes (kernels/pdl.py;
docs/draft-and-compile.md).

`always_wait()` makes Inductor's choice "wait": each PDL-launched Inductor kernel then waits for the kernel
ahead of it before its first load or store, as fspec's own kernels do, and keeps the early launch (which is
where the time goes at batch 1: each launch's latency overlaps the previous kernel). Only the loads Inductor
would have issued before the wait are lost. It is a context manager: while it is open, one private method of
Inductor's Triton codegen, `TritonKernel._handle_pdl_before_access`, runs with the scheduler's
`previous_node` unset (Inductor's own code then waits, as it does after any non-Inductor node); on exit the
method is Inductor's again. `fspec.compile.jit` opens it around every call of a function it compiled, which
is where Inductor lowers (compiles are lazy: the first call, and any recompile), so a user's own
`torch.compile` outside fspec's calls is never affected. Where the method is missing (another torch) it
yields False and changes nothing. The patch is not part of Inductor's cache keys, so fspec's compiles run with
the FX graph caches off (per compile, in the options `jit` passes): a graph cached without the waits would
otherwise come back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


def _always_wait(original):
    from torch._inductor.virtualized import V

    @functools.wraps(original)
    def always_wait(self, wait_buffer, *dependencies, consider_reads=False):
        scheduler = getattr(V.graph, "scheduler", None)  # no graph being lowered: a NullHandler
        if scheduler is None or not hasattr(scheduler, "previous_node"):
            return original(self, wait_buffer, *dependencies, consider_reads=consider_reads)
        previous, scheduler.previous_node = scheduler.previous_node, None
        try:  # no previous node: Inductor's own rule writes the wait
            return original(self, wait_buffer, *dependencies, consider_reads=consider_reads)
        finally:
            scheduler.previous_node = previous

    always_wait.fspec_always_wait = True
    return always_wait


def available() -> bool:
    """Whether this torch has the codegen method `always_wait` patches (without it, Inductor's PDL would run
    without the waits: fspec then leaves Inductor's PDL off)."""
    from torch._inductor.codegen import triton as triton_codegen

    return hasattr(getattr(triton_codegen, "TritonKernel", None), "_handle_pdl_before_access")


@contextlib.contextmanager
def always_wait() -> Iterator[bool]:
    """While open, every PDL-launched kernel Inductor generates waits before its first access; yields
    whether the patch is in place (False: this torch has no such method, nothing changed). Re-entrant: a
    nested call (a compiled function calling another) leaves the outer patch as it found it."""
    from torch._inductor.codegen import triton as triton_codegen

    cls = getattr(triton_codegen, "TritonKernel", None)
    original = getattr(cls, "_handle_pdl_before_access", None)
    if original is None:
        yield False
        return
    if getattr(original, "fspec_always_wait", False):  # an outer call holds it
        yield True
        return
    cls._handle_pdl_before_access = _always_wait(original)
    try:
        yield True
    finally:
        cls._handle_pdl_before_access = original
