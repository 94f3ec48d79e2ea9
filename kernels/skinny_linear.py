"""Skinny linear layer: y = x @ w.T for a few rows of x (decode, verification, draft steps), reading w once.

    skinny_linear(x [M, K], w [N, K]) -> y [M, N]      M <= MAX_ROWS, y in x's dtype, fp32 accumulation

Why: at batch 1 a projection is a matrix-vector product bound by reading w. On the H200 cuBLAS picks tiles of
64 output columns for the decode-step projections of a 1B-shaped model (q/k/v: 3072 x 2048, o: 2048 x 2048),
which launches only 32-48 programs on 132 SMs and reads their weights at ~1.8 TB/s of the ~4.2 TB/s a copy
reaches (benchmarks/results/generate_profile_b1.txt: 5.9 us per call against a ~2-3 us floor).

Design: grid (cdiv(N, BLOCK_N),); a program owns BLOCK_N output columns for all M rows and streams their
[BLOCK_N, K] slice of w in [BLOCK_N, BLOCK_K] tiles (each row contiguous in K: coalesced 16-byte loads),
multiplying by the [M_PAD, BLOCK_K] tile of x on the tensor cores (M padded to 16, the smallest tl.dot
shape; the padding rows are masked loads, no memory traffic). Small BLOCK_N (16) spreads a 2048-column
weight over 128 programs; a large BLOCK_K (512) keeps 16 KB of w per pipeline stage in flight per program,
which is what a memory-bound stream needs per SM. No split-K: its second (reduce) launch would cost as much
as it saves at these sizes. Launch parameters depend on static shapes only (CUDA-graph safe). Under the
Triton interpreter everything is cast to float32 after loading (its bf16 arithmetic is not IEEE).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from . import pdl
from .pdl import pdl_enter

MAX_ROWS = 16  # rows of x one program handles (one tl.dot tile); callers fall back to F.linear above it


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters: output columns and reduction depth per tile, warps, pipeline stages."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


def default_config(n: int, k: int) -> SkinnyConfig:
    """Launch parameters from the shapes alone, from the sweep on the H200 (`bench_skinny_linear.py --sweep`,
    benchmarks/results/skinny_linear.json): 16 output columns per program up to N = 2048, 32 up to 4096, 64
    beyond; BLOCK_K 512 up to N = 4096, 256 up to 8192, 128 beyond (at most K's next power of two); four
    pipeline stages."""
    block_n = 16 if n <= 2048 else 32 if n <= 4096 else 64
    block_k = min(512 if n <= 4096 else 256 if n <= 8192 else 128, max(16, triton.next_power_of_2(k)))
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_stages=4)


@triton.jit
def _skinny_linear_kernel(
    x_ptr,  # [M, K] rows of the input, K-stride 1
    w_ptr,  # [N, K] weight (nn.Linear layout), K-stride 1
    y_ptr,  # [M, N] out, N-stride 1
    M,  # rows (<= M_PAD)
    N,  # output features
    K,  # input features
    stride_xm,  # elements between rows of x
    stride_wn,  # elements between rows of w
    stride_ym,  # elements between rows of y
    M_PAD: tl.constexpr,  # rows per tile, a power of two >= 16
    BLOCK_N: tl.constexpr,  # output columns per program, a power of two >= 16
    BLOCK_K: tl.constexpr,  # reduction depth per tile, a power of two >= 16
    UPCAST: tl.constexpr,  # cast loads to float32 (interpreter, or float32 inputs: exact "ieee" dots)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    n_ok = n < N
    m_ok = m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    # the first weight tile is read before waiting on the kernel ahead (weights are constant): under PDL that
    # load overlaps the previous kernel's tail
    k = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    pdl_enter(PDL)
    x_rows = x_ptr + m[:, None] * stride_xm
    x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
    acc = _tile_dot(tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32), x, w, UPCAST)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _tile_dot(acc, x, w, UPCAST)
    tl.store(
        y_ptr + m[:, None] * stride_ym + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _tile_dot(acc, x, w, UPCAST: tl.constexpr):
    """acc + x [M_PAD, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T on the tensor cores (fp32 "ieee" when UPCAST)."""
    if UPCAST:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


def check_args(x: Tensor, w: Tensor) -> None:
    """ValueError unless x is [M, K] with 1 <= M <= MAX_ROWS, w is [N, K], both of one floating dtype on one
    device (a mismatched K would make the kernel read past x's rows)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x: expected a [M, K] tensor with 1 <= M <= {MAX_ROWS}, got shape {tuple(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected a [N, {x.shape[1]}] tensor (x's K), got shape {tuple(w.shape)}")
    if w.dtype != x.dtype or not x.dtype.is_floating_point:
        raise ValueError(f"w: expected x's floating dtype {x.dtype}, got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: expected x's device {x.device}, got {w.device}")


def skinny_linear(x: Tensor, w: Tensor, *, config: SkinnyConfig | None = None) -> Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, M <= MAX_ROWS (`check_args`)."""
    check_args(x, w)
    m, k = x.shape
    n = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    cfg = config or default_config(n, k)
    interpreted = isinstance(_skinny_linear_kernel, InterpretedFunction)
    upcast = interpreted or x.dtype == torch.float32
    launch = {} if interpreted else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _skinny_linear_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        M_PAD=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=upcast,
        **launch, **pdl.options(x),
    )  # fmt: skip
    return y


def skinny_linear_ref(x: Tensor, w: Tensor) -> Tensor:
    """The reference: float32 accumulation of x @ w.T, cast to x's dtype."""
    check_args(x, w)
    return (x.float() @ w.float().T).to(x.dtype)
