"""Zeroed int32 counters per device, for kernels whose last program to finish combines the others' partial
results in the same launch (skinny_linear's split reduction, `SkinnyConfig.split_k`).

    zeroed_counters(device) -> Tensor [COUNTER_SLOTS] int32, or None while capturing before they exist

A kernel increments counter i once per program of group i (an acquire-release atomic at GPU scope, after a
barrier) and the program that sees the count reach the group's size combines the partials and sets it back
to zero, so every launch leaves the counters at zero for the next one. Kernels share them: each waits for the
kernel ahead of it in the stream to finish (stream order or its PDL wait) before its first atomic, so two
launches never count at once on one stream (one stream at a time per device).
"""

from __future__ import annotations

import torch
from torch import Tensor

COUNTER_SLOTS = 1 << 16  # groups one launch can count

_COUNTERS: dict[torch.device, Tensor] = {}


def zeroed_counters(device: torch.device) -> Tensor | None:
    """The zeroed int32 counters on `device` (allocated once), or None while a CUDA graph is being captured
    before they exist (no allocation there: the caller launches without them). `KVCache.create` allocates
    them: a first allocation inside a compiled function's CUDA-graph warm-up would come from the graph's
    memory pool, which CUDA-graph trees reject as an untracked live tensor."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return counters
