"""L2 prefetch of weights a later kernel reads, issued where the memory would otherwise sit idle.

    prefetch_l2(ptr, nbytes, pid, nprog, CHUNK)   @triton.jit helper: program pid of nprog asks the L2 for
                                                  its share of [ptr, ptr + nbytes) in CHUNK-byte bulk requests
    l2_prefetch(regions)                          a launch of its own (benchmarks, tests): each region whole
    enabled(t) -> bool                            prefetches are issued on t's device (sm_90+, CUDA 12.3+)
    check_regions(regions, device, name)          ValueError unless every region is a contiguous tensor on the
                                                  device, 16-byte aligned, a multiple of 16 bytes long

Why: a one-row decode step is a chain of weight-bound products separated by latency-bound kernels (RoPE and
the cache write, the paged attention and its reduce, the sampling), during which the HBM moves almost
nothing: in a 1B-shaped decode layer the chain from q/k/v's last load to o's first is ~9 µs, ~38 MB of
bandwidth left unused (DESIGN-NOTES.md, "What is left"). A kernel that ends right before such a chain asks the
L2 for the weights read after it, so that they stream in while the chain runs; the products then read them at
L2 speed. The idea is the one of PRESERVE (Yüzügüler et al., 2025, arXiv:2501.08192: prefetching weights and
KV cache into L2 while collective communication runs); here the idle time is the attention's and the
sampling's latency chain, and the request is `cp.async.bulk.prefetch.L2.global` (PTX ISA 8.0, sm_90): one
instruction asks for a whole 16-byte-aligned range, non-blocking, a hint the hardware may drop. Nothing is
written and no result depends on it: a prefetch changes timing only.

The helper issues its requests from one thread per program (a uniform instruction: the others would repeat
it), chunks pid, pid + nprog, ... of the range, so that a launch of many programs spreads the requests. It is
placed after a program's last store: a kernel's tail, when its own loads are done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl

CHUNK = 32768  # bytes per bulk prefetch request (a multiple of 16)
CHUNK_CONSTEXPR = tl.constexpr(CHUNK)  # the same, for the kernels that call `prefetch_regions`
MAX_REGIONS = 3  # ranges one `skinny_linear` launch prefetches (o, and the gate and up rows of gate/up)
ALIGN = 16  # cp.async.bulk: address and size multiples of 16 bytes


def enabled(t: Tensor) -> bool:
    """Prefetches are issued for kernels on t's device: CUDA, compute capability 9.0 or later (the bulk
    prefetch instruction is sm_90's), CUDA 12.3 or later; never under the interpreter (CPU tensors)."""
    return t.is_cuda and pdl._hopper_or_later(t.device.index or 0)


def check_regions(regions: Sequence[Tensor], device: torch.device, name: str = "prefetch") -> None:
    """ValueError naming `name` unless regions is a list or tuple of at most MAX_REGIONS contiguous tensors on
    `device`, each starting at a 16-byte-aligned address (checked for real tensors: a fake tensor has none)
    and ALIGN-byte multiples long."""
    if not isinstance(regions, (list, tuple)) or len(regions) > MAX_REGIONS:
        raise ValueError(f"{name}: expected a list of at most {MAX_REGIONS} tensors, got {regions!r}")
    for i, t in enumerate(regions):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}[{i}]: expected a tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name}[{i}]: expected a tensor on {device}, got one on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}]: expected a contiguous tensor, got strides {tuple(t.stride())}")
        nbytes = t.numel() * t.element_size()
        if nbytes % ALIGN:
            raise ValueError(f"{name}[{i}]: expected a multiple of {ALIGN} bytes, got {nbytes}")
        fake = isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta"
        if not fake and t.data_ptr() % ALIGN:
            raise ValueError(f"{name}[{i}]: expected a {ALIGN}-byte-aligned address, got {t.data_ptr():#x}")


def region_args(regions: Sequence[Tensor], fallback: Tensor) -> list:
    """The kernel arguments of MAX_REGIONS (pointer, bytes) pairs: the regions, then `fallback`, 0 bytes."""
    args = []
    for i in range(MAX_REGIONS):
        t = regions[i] if i < len(regions) else None
        args += [fallback, 0] if t is None else [t, t.numel() * t.element_size()]
    return args


@triton.jit
def prefetch_l2(ptr, nbytes, pid, nprog, CHUNK: tl.constexpr):
    """Ask the L2 for chunks pid, pid + nprog, ... of the nbytes bytes at ptr (CHUNK bytes each, the last
    shorter; ptr 16-byte aligned, nbytes a multiple of 16), from the program's thread 0."""
    base = ptr.to(tl.pointer_type(tl.int8))
    for off in range(pid * CHUNK, nbytes, nprog * CHUNK):
        size = tl.minimum(nbytes - off, CHUNK)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + off, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_regions(p0, n0, p1, n1, p2, n2, pid, nprog, REGIONS: tl.constexpr, CHUNK: tl.constexpr):
    """`prefetch_l2` over the first REGIONS of three (pointer, bytes) pairs (REGIONS = 0: nothing)."""
    if REGIONS >= 1:
        prefetch_l2(p0, n0, pid, nprog, CHUNK)
    if REGIONS >= 2:
        prefetch_l2(p1, n1, pid, nprog, CHUNK)
    if REGIONS >= 3:
        prefetch_l2(p2, n2, pid, nprog, CHUNK)


@triton.jit
def _l2_prefetch_kernel(p0, n0, p1, n1, p2, n2, REGIONS: tl.constexpr, CHUNK: tl.constexpr):
    prefetch_regions(p0, n0, p1, n1, p2, n2, tl.program_id(0), tl.num_programs(0), REGIONS, CHUNK)


def l2_prefetch(regions: Sequence[Tensor], *, programs: int = 32) -> None:
    """Ask the L2 for every byte of each region (at most MAX_REGIONS contiguous tensors on one CUDA device)
    from a launch of its own of `programs` programs; nothing where `enabled` is false. Returns at once: the
    requests are asynchronous hints."""
    if not regions:
        return
    check_regions(regions, regions[0].device, "regions")
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs: expected an int >= 1, got {programs!r}")
    if not enabled(regions[0]):
        return
    args = region_args(regions, regions[0])
    _l2_prefetch_kernel[(programs,)](*args, REGIONS=len(regions), CHUNK=CHUNK, num_warps=1)
