"""Inductor's programmatic dependent launch with a wait in every kernel (`FSPEC_INDUCTOR_PDL`, on by default;
`FSPEC_INDUCTOR_PDL=0` turns it off).

Inductor's own switch (`TORCHINDUCTOR_ENABLE_PDL=1`) launches its Triton kernels with the PDL attribute and
puts `gdc_wait` before the first access to a buffer that the previous Inductor kernel wrote (or, for a store,
read or wrote), `gdc_launch_dependents` after the last load. A kernel that loads nothing such a kernel
touched and stores only to buffers it did not touch (a fill, say) gets no wait at all: it may be scheduled
when its predecessor triggers and finish before that predecessor does, and the kernel after it, which waits
only on its own predecessor, can then read the first one's output while it is still being written. PDL chains
are only transitive when every kernel in them waits before it finishes (kernels/pdl.py, DESIGN-NOTES.md).

`install()` makes Inductor's choice always "wait": each PDL-launched Inductor kernel then waits for the
kernel ahead of it before its first load or store, as fspec's own kernels do, and keeps the early launch
(which is where the time goes at batch 1: each launch's latency overlaps the previous kernel). Only the
loads Inductor would have issued before the wait are lost. It patches one private method of Inductor's
Triton codegen, `TritonKernel._handle_pdl_before_access`, by running it with the scheduler's
`previous_node` unset (Inductor's own code then waits, as it does after any non-Inductor node); where that
method or attribute is missing (another torch), `install()` returns False and changes nothing.
The patch is not part of Inductor's cache keys, so `fspec.compile` compiles with the FX graph caches off
under this switch (a graph cached under Inductor's own PDL would otherwise come back without the waits).
"""

from __future__ import annotations

import functools
import os

ENV = "FSPEC_INDUCTOR_PDL"


def requested() -> bool:
    """FSPEC_INDUCTOR_PDL: '1' or unset on (the H200 default: table `switches`, runs h and i), '0' off;
    anything else is a ValueError naming it."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected '0' or '1', got {value!r}")
    return value == "1"


def install() -> bool:
    """Patch Inductor so that every PDL-launched kernel it generates waits before its first access (once per
    process; idempotent). True when the patch is in place."""
    from torch._inductor.codegen import triton as triton_codegen
    from torch._inductor.virtualized import V

    cls = getattr(triton_codegen, "TritonKernel", None)
    original = getattr(cls, "_handle_pdl_before_access", None)
    if original is None:
        return False
    if getattr(original, "fspec_always_wait", False):
        return True

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
    cls._handle_pdl_before_access = always_wait
    return True
