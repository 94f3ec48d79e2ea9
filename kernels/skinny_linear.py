"""Skinny linear layer: y = x @ w.T for a few rows of x (decode, verification, draft steps), reading w once.

    skinny_linear(x [M, K], w [N, K]) -> y [M, N]      M <= MAX_ROWS, y in x's dtype, fp32 accumulation
    skinny_linear(x, w, norm_weight=g, eps=e)           RMSNorm(x) * g first (a layer's input norm)
    skinny_linear(x, [w_gate; w_up], silu_mul=True)     -> [M, N/2]: silu(x @ w_gate.T) * (x @ w_up.T)
    skinny_linear(x, w, residual=r)                     r + y (the residual add after o / down)

Why: at batch 1 a projection is a matrix-vector product bound by reading w. On the H200 cuBLAS picks tiles of
64 output columns for the decode-step projections of a 1B-shaped model (q/k/v: 3072 x 2048, o: 2048 x 2048),
which launches only 32-48 programs on 132 SMs and reads their weights at ~1.8 TB/s of the ~4.2 TB/s a copy
reaches (benchmarks/results/generate_profile_b1.txt: 5.9 us per call against a ~2-3 us floor).

Design: grid (cdiv(N, BLOCK_N),); a program owns BLOCK_N output columns for all M rows and streams their
[BLOCK_N, K] slice of w in [BLOCK_N, BLOCK_K] tiles (each row contiguous in K: coalesced 16-byte loads),
multiplying by the [M_PAD, BLOCK_K] tile of x on the tensor cores (M padded to 16, the smallest tl.dot
shape; the padding rows are masked loads, no memory traffic). Small BLOCK_N (16) spreads a 2048-column
weight over 128 programs; a large BLOCK_K (512) keeps 16 KB of w per pipeline stage in flight per program,
which is what a memory-bound stream needs per SM. One row (batch-1 decode and draft steps) goes to
`_skinny_gemv_kernel` on the CUDA cores instead (no 16-row tensor-core tile); its optional split reduction
(`SkinnyConfig.split_k`, combined in the same launch) won no shape of the H200 sweep and stays off. A few
rows can take the CUDA cores too, with an explicit config: `_skinny_rows_tile_kernel` (the one-tile product,
the weight tile loaded once for every row) and `_skinny_rows_kernel` (a [rows, BLOCK_N, BLOCK_K] product).
Launch parameters depend on static shapes only (CUDA-graph safe). Under the
Triton interpreter everything is cast to float32 after loading (its bf16 arithmetic is not IEEE).

The fusions exist for the decode step of a Llama layer, where each of RMSNorm, SiLU * up and the residual add
is otherwise a launch of its own (~1.5 us plus a gap on the H200) around a GEMV: the norm is applied to each x
tile as it is loaded (it needs the row's RMS first: one more pass over the M rows of x, from L2); SwiGLU is
an epilogue: a program streams the rows n of the gate half and n + N/2 of the up half into two accumulators
and writes silu(gate) * up, so the [M, N] gate/up product never leaves the registers; the residual is added
before the store. Each step rounds to x's dtype where the unfused ops would. (SwiGLU as a prologue of the down
projection, silu(gate) * up applied to each x tile as loaded, measured ~140 us instead of ~13 on the H200 at
1B shapes: every program recomputed it over all of x, in registers replicated across its warps.)
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from . import pdl
from .pdl import pdl_enter

MAX_ROWS = 16  # rows of x one program handles (one tl.dot tile); callers fall back to F.linear above it
NORM_MAX_BLOCK_K = 256  # BLOCK_K cap with the RMSNorm prologue (sm_90 compile: 512 spills registers)
# `_skinny_gemv_kernel` keeps a [BLOCK_N, BLOCK_K] float32 partial sum and two weight tiles in registers
# (twice that with SiLU * up): at most this many tile elements per thread (sm_90: 64 fits, 128 spills)
GEMV_ELEMS_PER_THREAD = 64
# with the whole reduction in one tile (no next tile, no loop) twice that fits (sm_90: 16 x 2048 at 8 warps
# compiles without spills, with the norm or the residual too; 16 x 2048 at 4 warps and SiLU * up spill)
GEMV_ONE_TILE_ELEMS_PER_THREAD = 128
MAX_SPLIT_K = 64  # programs one column block's reduction may be cut into (`SkinnyConfig.split_k`)
NORM_VALUES_PER_THREAD = 32  # the one-row kernel's RMS pass: x values per thread per load (`norm_block`)
FMA_MAX_ROWS = 8  # rows of x the CUDA-core kernels take (`_skinny_rows_kernel` from 2 rows); more: the tile
# `_skinny_rows_kernel` keeps a [M_POW2, BLOCK_N, BLOCK_K] float32 product per tile: at most this many of its
# elements per thread (twice the tiles with SiLU * up; sm_90 compile without spills: tests/kernels)
ROWS_ELEMS_PER_THREAD = 128


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters: output columns and reduction depth per tile, warps, pipeline stages; `fma` runs a
    one-row product on the CUDA cores (`_skinny_gemv_kernel`) instead of a 16-row tensor-core tile;
    `one_tile` (with `fma`) makes its tile the whole reduction (BLOCK_K = K's next power of two, every
    weight load issued at once) where that fits in registers (GEMV_ONE_TILE_ELEMS_PER_THREAD), else it
    keeps the loop; `split_k` (with `fma`, a power of two) cuts a one-row reduction into that many programs
    per column block, combined in the same launch (see `_skinny_gemv_kernel`). `fma` with `one_tile` (no
    split) at 2..MAX_ROWS rows runs `_skinny_rows_tile_kernel` where its tile fits (`rows_tile_fits`);
    `fma` alone at 2..FMA_MAX_ROWS rows `_skinny_rows_kernel`."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    fma: bool = False
    one_tile: bool = False
    split_k: int = 1


def default_config(n: int, k: int, *, one_row: bool = False) -> SkinnyConfig:
    """Launch parameters from the shapes alone, from the sweeps on the H200 (`bench_skinny_linear.py
    --sweep`, benchmarks/results/skinny_linear.json and, for one row, skinny_linear_one_row.json).
    Several rows: the tensor-core tile, 16 output columns per program up to N = 2048, 32 up to 4096, 64
    beyond; BLOCK_K 512 up to N = 4096, 256 up to 8192, 128 beyond (at most K's next power of two); four
    pipeline stages. One row (`one_row`): the CUDA-core `_skinny_gemv_kernel`, 16 output columns per
    program: up to N = 2048 (at most 128 programs, one per SM) BLOCK_K 1024 and eight warps, so a program
    has its whole 2048-deep reduction in flight at once (1B o 4.1 -> 3.3 us, down 12.3 -> 9.4); up to 4096
    BLOCK_K 512, eight warps; up to 8192 four warps; up to 16384 BLOCK_K 256, eight warps; wider four warps,
    BLOCK_K 256 over deep reductions (the 8B head's gate/up) and 512 over K <= 2048 (a 32000-token draft LM
    head). Up to N = 2048 the whole reduction is one tile where it fits in registers (`one_tile`: a 1B o
    projection, 16 x 2048 at eight warps; deeper ones keep the loop): alone it measured no faster (3.6
    against 3.3 us), but in place, launched while the attention before it still runs (`early_release`),
    its every weight load is in flight before its wait (target-only decoding +0.8%, docs/ops-and-kernels.md).
    The split reduction (`split_k`) won no shape of the sweep: it stays off. Several rows keep the
    tile kernel: `_skinny_rows_kernel` (2..FMA_MAX_ROWS rows on the CUDA cores, an explicit `fma` config)
    measured slower than cuBLAS for a first draft step's K + 1 rows (docs/ops-and-kernels.md)."""
    kmax = max(16, triton.next_power_of_2(k))
    if one_row:
        block_k, warps = (
            (1024, 8) if n <= 2048
            else (512, 8) if n <= 4096
            else (512, 4) if n <= 8192
            else (256, 8) if n <= 16384
            else (256 if k > 2048 else 512, 4)
        )  # fmt: skip
        return SkinnyConfig(
            block_n=16,
            block_k=min(block_k, kmax),
            num_warps=warps,
            num_stages=1,
            fma=True,
            one_tile=n <= 2048,
        )
    block_n = 16 if n <= 2048 else 32 if n <= 4096 else 64
    block_k = min(512 if n <= 4096 else 256 if n <= 8192 else 128, kmax)
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_stages=4)


@triton.jit
def _skinny_linear_kernel(
    x_ptr,  # [M, K] rows of the input, K-stride 1
    w_ptr,  # [N, K] weight (nn.Linear layout), K-stride 1 ([2N, K]: gate rows, then up rows, when SILU)
    y_ptr,  # [M, N] out, N-stride 1
    norm_ptr,  # [K] (NORM): RMSNorm weight applied to x first
    res_ptr,  # [M, N] (RESIDUAL): added to the product, N-stride 1
    M,  # rows (<= M_PAD)
    N,  # output features (SILU: of the product silu(gate) * up, half of w's rows)
    K,  # input features (of the product)
    eps,  # (NORM) RMSNorm epsilon
    stride_xm,  # elements between rows of x
    stride_wn,  # elements between rows of w
    stride_ym,  # elements between rows of y
    stride_rm,  # (RESIDUAL) elements between rows of the residual
    positions_ptr,  # (ROPE_HEAD_DIM) [M] int: each row's position (negative: padding, rotated as position 0)
    inv_freq_ptr,  # (ROPE_HEAD_DIM) [D/2] float32: RoPE's inverse frequencies
    slot_ptr,  # (ROPE_HEAD_DIM) [M] int64: each row's cache slot; negative: nothing written
    k_cache_ptr,  # (ROPE_HEAD_DIM) [num_blocks, block_size, Nkv, D] this layer's K cache (written)
    v_cache_ptr,  # (ROPE_HEAD_DIM) this layer's V cache, same layout (written)
    q_cols,  # (ROPE_HEAD_DIM) N * D: the output's q columns, then Nkv * D of k, then Nkv * D of v
    kv_cols,  # (ROPE_HEAD_DIM) Nkv * D
    M_PAD: tl.constexpr,  # rows per tile, a power of two >= 16
    BLOCK_N: tl.constexpr,  # output columns per program, a power of two >= 16
    BLOCK_K: tl.constexpr,  # reduction depth per tile, a power of two >= 16
    UPCAST: tl.constexpr,  # cast loads to float32 (interpreter, or float32 inputs: exact "ieee" dots)
    NORM: tl.constexpr = False,  # prologue: x <- RMSNorm(x) * norm weight (fspec.models.layers.rms_norm)
    SILU: tl.constexpr = False,  # epilogue: y <- silu(x @ w[:N].T) * (x @ w[N:].T) (SwiGLU's gate and up)
    RESIDUAL: tl.constexpr = False,  # epilogue: y <- residual + y
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    ROPE_HEAD_DIM: tl.constexpr = 0,  # D > 0: a fused q/k/v product; RoPE and the cache write as epilogue
    TABLE_DTYPE: tl.constexpr = tl.float32,  # (ROPE_HEAD_DIM) the dtype RoPE's cos / sin tables would have
):
    """ROPE_HEAD_DIM = D > 0: the fused q/k/v product of several rows with RoPE and the cache write as its
    epilogue (`_rope_kv_rows_epilogue`; kernels/qkv_rope_write.py), as `_skinny_gemv_kernel` for one."""
    pid_n = tl.program_id(0)
    n = _columns(pid_n, BLOCK_N, ROPE_HEAD_DIM)
    m = tl.arange(0, M_PAD)
    n_ok = n < N
    m_ok = m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    # the first weight tile is read before waiting on the kernel ahead (weights are constant): under PDL that
    # load overlaps the previous kernel's tail
    k = tl.arange(0, BLOCK_K)
    w_ok = n_ok[:, None] & (k < K)[None, :]
    w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0)
    if SILU:
        u_rows = w_rows + N.to(tl.int64) * stride_wn  # the up half's rows n
        u = tl.load(u_rows + k[None, :], mask=w_ok, other=0.0)
    pdl_enter(PDL)
    x_rows = x_ptr + m[:, None] * stride_xm
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if NORM:  # every program reads the M rows of x once more for their RMS (K values each, from L2)
        ss = tl.zeros([M_PAD], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            xs = xs.to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    x = _x_tile(x_rows, norm_ptr, k, m_ok, K, rstd, NORM)
    acc = _tile_dot(tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32), x, w, UPCAST)
    acc_up = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    if SILU:
        acc_up = _tile_dot(acc_up, x, u, UPCAST)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_rows, norm_ptr, k, m_ok, K, rstd, NORM)
        w_ok = n_ok[:, None] & (k < K)[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0)
        acc = _tile_dot(acc, x, w, UPCAST)
        if SILU:
            u = tl.load(u_rows + k[None, :], mask=w_ok, other=0.0)
            acc_up = _tile_dot(acc_up, x, u, UPCAST)
    if ROPE_HEAD_DIM > 0:  # (no SiLU, no residual: the launcher's contract)
        _rope_kv_rows_epilogue(
            acc, m, m_ok, n, pid_n, y_ptr, stride_ym, positions_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr,
            v_cache_ptr, q_cols, kv_cols, BLOCK_N, ROPE_HEAD_DIM, TABLE_DTYPE,
        )  # fmt: skip
    else:
        out_ok = m_ok[:, None] & n_ok[None, :]
        y = acc.to(y_ptr.dtype.element_ty)
        if SILU:  # as F.silu(gate) * up on the rounded gate and up: silu in float32, rounded, times up
            g = y.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(y.dtype)
            y = (silu.to(tl.float32) * acc_up.to(y.dtype).to(tl.float32)).to(y.dtype)
        if RESIDUAL:  # as `residual + linear(...)`: the product rounded to the output dtype, then the sum
            r = tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=out_ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y, mask=out_ok)


@triton.jit
def _skinny_gemv_kernel(
    x_ptr,  # [1, K] the one row of the input, K-stride 1
    w_ptr,  # [N, K] weight, K-stride 1 ([2N, K]: gate rows, then up rows, when SILU)
    y_ptr,  # [1, N] out
    norm_ptr,  # [K] (NORM): RMSNorm weight applied to x first
    res_ptr,  # [1, N] (RESIDUAL): added to the product
    part_ptr,  # [SPLIT_K, N] float32 ([2, SPLIT_K, N] when SILU), SPLIT_K > 1: each split's partial sums
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero (SPLIT_K > 1): splits of each column block finished
    N,  # output features (SILU: of silu(gate) * up)
    K,  # input features
    K_SPLIT,  # reduction depth of one split, a multiple of BLOCK_K (K when SPLIT_K = 1)
    eps,  # (NORM) RMSNorm epsilon
    stride_wn,  # elements between rows of w
    positions_ptr,  # (ROPE_HEAD_DIM) [1] int: the row's position (negative: padding, rotated as position 0)
    inv_freq_ptr,  # (ROPE_HEAD_DIM) [D/2] float32: RoPE's inverse frequencies
    slot_ptr,  # (ROPE_HEAD_DIM) [1] int64: the row's cache slot; negative: nothing written
    k_cache_ptr,  # (ROPE_HEAD_DIM) [num_blocks, block_size, Nkv, D] this layer's K cache (written)
    v_cache_ptr,  # (ROPE_HEAD_DIM) this layer's V cache, same layout (written)
    q_cols,  # (ROPE_HEAD_DIM) N * D: the output's q columns, then Nkv * D of k, then Nkv * D of v
    kv_cols,  # (ROPE_HEAD_DIM) Nkv * D
    BLOCK_N: tl.constexpr,  # output columns per program, a power of two
    BLOCK_K: tl.constexpr,  # reduction depth per tile, a power of two
    NORM: tl.constexpr = False,
    SILU: tl.constexpr = False,
    RESIDUAL: tl.constexpr = False,
    PDL: tl.constexpr = False,
    ONE_TILE: tl.constexpr = False,  # BLOCK_K >= K_SPLIT: a split's whole reduction is one tile, no loop
    SPLIT_K: tl.constexpr = 1,  # programs per column block, each over K_SPLIT inputs (a power of two)
    NORM_BLOCK: tl.constexpr = 16,  # (NORM) x values per load of the RMS pass (K's next power of two if
    # registers allow: one L2 round trip instead of K / BLOCK_K dependent ones)
    ROPE_HEAD_DIM: tl.constexpr = 0,  # D > 0: a fused q/k/v product; RoPE and the cache write as epilogue
    TABLE_DTYPE: tl.constexpr = tl.float32,  # (ROPE_HEAD_DIM) the dtype RoPE's cos / sin tables would have
):
    """`_skinny_linear_kernel` for one row (a batch-1 decode step) on the CUDA cores: each [BLOCK_N, BLOCK_K]
    weight tile is multiplied by the broadcast x vector into a [BLOCK_N, BLOCK_K] float32 partial sum,
    reduced over K once at the end. No tile of 16 padded rows, no trip of x through shared memory, and the
    prologue touches BLOCK_K values of x per step instead of 16 x BLOCK_K. Same fusions and roundings. The
    one-row default (`default_config`): on the H200 sweep it read the 8B head's q/k/v at 23.9 us (cuBLAS
    29.3, the tile 26.6) and the 1B o at 4.3 (cuBLAS 6.0, the tile 5.0).

    SPLIT_K > 1 cuts the reduction into SPLIT_K programs per column block (grid axis 1), for products with
    few column blocks and a deep reduction (2048 x 8192: 128 programs of 256 KB each on 132 SMs): each
    stores its float32 partial sums, counts itself done on the block's counter (acquire-release, GPU scope,
    after a barrier), and the program that sees the count reach SPLIT_K - 1 sums the SPLIT_K partials in
    one fixed order (deterministic: the same bits whichever split finishes last), resets the counter and
    applies the epilogue.

    ROPE_HEAD_DIM = D > 0 (kernels/qkv_rope_write.py): w is a layer's fused [q; k; v] projection and the
    epilogue does what `rope_pos_kv_write` would do next: q and k rotated (rotate-half RoPE, cos / sin from
    the row's position), k and v written to the cache slot, the output [q_rot, k_rot, v]. A program then owns
    BLOCK_N / 2 rotate-half pairs (d, d + D/2) of one head, so that each pair meets in its registers."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = _columns(pid_n, BLOCK_N, ROPE_HEAD_DIM)
    n_ok = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    kk = tl.arange(0, BLOCK_K)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    w_ok = n_ok[:, None] & (k_lo + kk < k_hi)[None, :]
    w = tl.load(w_rows + (k_lo + kk)[None, :], mask=w_ok, other=0.0)  # weights are constant: before the wait
    if SILU:
        u_rows = w_rows + N.to(tl.int64) * stride_wn
        u = tl.load(u_rows + (k_lo + kk)[None, :], mask=w_ok, other=0.0)
    pdl_enter(PDL)
    x_ok = k_lo + kk < k_hi
    x = tl.load(x_ptr + k_lo + kk, mask=x_ok, other=0.0)  # the first tile of x, raw
    g = x  # (NORM) the norm weight's tile
    if NORM:
        g = tl.load(norm_ptr + k_lo + kk, mask=x_ok, other=0.0)
    rstd = 0.0
    if NORM:  # the row's RMS: every program reads x once more (from L2), NORM_BLOCK values per load
        kr = tl.arange(0, NORM_BLOCK)
        ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            xs = tl.load(x_ptr + k0 + kr, mask=k0 + kr < K, other=0.0).to(tl.float32)
            ss += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if ONE_TILE:  # every weight load was issued before the wait: one memory latency per program
        xv = _normed(x, g, rstd, NORM)
        acc += w.to(tl.float32) * xv[None, :].to(tl.float32)
        if SILU:
            acc_up += u.to(tl.float32) * xv[None, :].to(tl.float32)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            # the next tiles of w and x are requested before this one is used: two tiles in flight per
            # program (the compiler pipelines only loads that feed tl.dot through shared memory), and no
            # iteration waits on its own x (an L2 round trip); past the split it is all masked
            kn = k0 + BLOCK_K + kk
            next_ok = n_ok[:, None] & (kn < k_hi)[None, :]
            w_next = tl.load(w_rows + kn[None, :], mask=next_ok, other=0.0)
            if SILU:
                u_next = tl.load(u_rows + kn[None, :], mask=next_ok, other=0.0)
            x_next = tl.load(x_ptr + kn, mask=kn < k_hi, other=0.0)
            g_next = x_next
            if NORM:
                g_next = tl.load(norm_ptr + kn, mask=kn < k_hi, other=0.0)
            xv = _normed(x, g, rstd, NORM)
            acc += w.to(tl.float32) * xv[None, :].to(tl.float32)
            w = w_next
            x = x_next
            g = g_next
            if SILU:
                acc_up += u.to(tl.float32) * xv[None, :].to(tl.float32)
                u = u_next
    part = tl.sum(acc, axis=1)  # [BLOCK_N] float32
    part_up = tl.sum(acc_up, axis=1)
    if ROPE_HEAD_DIM > 0:  # (SPLIT_K = 1, no SiLU, no residual: the launcher's contract)
        _rope_kv_epilogue(
            part, n, pid_n, y_ptr, positions_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_cols,
            kv_cols, BLOCK_N, ROPE_HEAD_DIM, TABLE_DTYPE,
        )  # fmt: skip
    elif SPLIT_K == 1:
        _gemv_epilogue(part, part_up, n, n_ok, y_ptr, res_ptr, SILU, RESIDUAL)
    else:
        tl.store(part_ptr + split * N + n, part, mask=n_ok)
        if SILU:
            tl.store(part_ptr + (SPLIT_K + split) * N + n, part_up, mask=n_ok)
        tl.debug_barrier()  # every thread's partials stored before the release below
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            s = tl.arange(0, SPLIT_K)
            parts = part_ptr + s[:, None] * N + n[None, :]  # [SPLIT_K, BLOCK_N], one load, summed in order
            part = tl.sum(tl.load(parts, mask=n_ok[None, :], other=0.0, cache_modifier=".cg"), axis=0)
            if SILU:
                ups = tl.load(parts + SPLIT_K * N, mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
                part_up = tl.sum(ups, axis=0)
            _gemv_epilogue(part, part_up, n, n_ok, y_ptr, res_ptr, SILU, RESIDUAL)


@triton.jit
def _skinny_rows_kernel(
    x_ptr,  # [M, K] rows of the input, K-stride 1
    w_ptr,  # [N, K] weight, K-stride 1 ([2N, K]: gate rows, then up rows, when SILU)
    y_ptr,  # [M, N] out, N-stride 1
    norm_ptr,  # [K] (NORM): RMSNorm weight applied to x first
    res_ptr,  # [M, N] (RESIDUAL): added to the product, N-stride 1
    M,  # rows (<= M_POW2)
    N,  # output features (SILU: of silu(gate) * up)
    K,  # input features
    eps,  # (NORM) RMSNorm epsilon
    stride_xm,  # elements between rows of x
    stride_wn,  # elements between rows of w
    stride_ym,  # elements between rows of y
    stride_rm,  # (RESIDUAL) elements between rows of the residual
    positions_ptr,  # (ROPE_HEAD_DIM) [M] int: each row's position (negative: padding, rotated as position 0)
    inv_freq_ptr,  # (ROPE_HEAD_DIM) [D/2] float32: RoPE's inverse frequencies
    slot_ptr,  # (ROPE_HEAD_DIM) [M] int64: each row's cache slot; negative: nothing written
    k_cache_ptr,  # (ROPE_HEAD_DIM) [num_blocks, block_size, Nkv, D] this layer's K cache (written)
    v_cache_ptr,  # (ROPE_HEAD_DIM) this layer's V cache, same layout (written)
    q_cols,  # (ROPE_HEAD_DIM) N * D: the output's q columns, then Nkv * D of k, then Nkv * D of v
    kv_cols,  # (ROPE_HEAD_DIM) Nkv * D
    M_POW2: tl.constexpr,  # next power of two >= M (at most FMA_MAX_ROWS)
    BLOCK_N: tl.constexpr,  # output columns per program, a power of two
    BLOCK_K: tl.constexpr,  # reduction depth per tile, a power of two
    NORM: tl.constexpr = False,
    SILU: tl.constexpr = False,
    RESIDUAL: tl.constexpr = False,
    PDL: tl.constexpr = False,
    NORM_BLOCK: tl.constexpr = 16,  # (NORM) x values per row and load of the RMS pass
    ROPE_HEAD_DIM: tl.constexpr = 0,  # D > 0: a fused q/k/v product; RoPE and the cache write as epilogue
    TABLE_DTYPE: tl.constexpr = tl.float32,  # (ROPE_HEAD_DIM) the dtype RoPE's cos / sin tables would have
):
    """`_skinny_gemv_kernel` for 2..FMA_MAX_ROWS rows (a first draft step's K + 1 rows, verification at
    batch 1) on the CUDA cores: each [BLOCK_N, BLOCK_K] weight tile is loaded once and multiplied by every
    row of the [M_POW2, BLOCK_K] x tile as a [M_POW2, BLOCK_N, BLOCK_K] product reduced over K per tile
    (no 16-row tensor-core tile, no trip of x through shared memory: the tiles are loaded in the product's
    3-d layout, x replicated across the warps that split the columns). Same fusions and roundings. Only with
    an explicit `fma` config: on the H200 it was slower than cuBLAS for a 1B head's first draft step (to keep
    the product in registers BLOCK_K shrinks to 128-256: too few bytes in flight per SM; switches_m, run
    m3). ROPE_HEAD_DIM: as `_skinny_linear_kernel`'s."""
    pid_n = tl.program_id(0)
    n = _columns(pid_n, BLOCK_N, ROPE_HEAD_DIM)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, M_POW2)
    m_ok = m < M
    # 3-d index tiles: rows [M, 1, 1], columns [1, N, 1], depth [1, 1, K]
    n3 = n[None, :, None]
    k3 = kk[None, None, :]
    m3 = m[:, None, None]
    w_rows = w_ptr + n3.to(tl.int64) * stride_wn  # [1, BLOCK_N, 1]
    w_ok = n_ok[None, :, None] & (k3 < K)
    w = tl.load(w_rows + k3, mask=w_ok, other=0.0)  # weights are constant: before the wait
    if SILU:
        u_rows = w_rows + N.to(tl.int64) * stride_wn
        u = tl.load(u_rows + k3, mask=w_ok, other=0.0)
    pdl_enter(PDL)
    x_rows = x_ptr + m3 * stride_xm  # [M_POW2, 1, 1]
    x_ok = m_ok[:, None, None] & (k3 < K)
    x = tl.load(x_rows + k3, mask=x_ok, other=0.0)  # [M_POW2, 1, BLOCK_K]
    g = x
    if NORM:
        g = tl.load(norm_ptr + k3, mask=k3 < K, other=0.0)  # [1, 1, BLOCK_K]
    rstd = tl.zeros([M_POW2, 1, 1], dtype=tl.float32)
    if NORM:  # every program reads the M rows of x once more (from L2), NORM_BLOCK values per row and load
        kr = tl.arange(0, NORM_BLOCK)[None, None, :]
        ss = tl.zeros([M_POW2, 1, NORM_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            xs = tl.load(x_rows + k0 + kr, mask=m_ok[:, None, None] & (k0 + kr < K), other=0.0)
            xs = xs.to(tl.float32)
            ss += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=2, keep_dims=True) / K + eps)
    acc = tl.zeros([M_POW2, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([M_POW2, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # the next tiles are requested before this one is used (two tiles in flight per program)
        kn = k0 + BLOCK_K + k3
        next_ok = n_ok[None, :, None] & (kn < K)
        w_next = tl.load(w_rows + kn, mask=next_ok, other=0.0)
        if SILU:
            u_next = tl.load(u_rows + kn, mask=next_ok, other=0.0)
        x_next = tl.load(x_rows + kn, mask=m_ok[:, None, None] & (kn < K), other=0.0)
        g_next = x_next
        if NORM:
            g_next = tl.load(norm_ptr + kn, mask=kn < K, other=0.0)
        xv = _normed(x, g, rstd, NORM).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xv, axis=2)
        if SILU:
            acc_up += tl.sum(u.to(tl.float32) * xv, axis=2)
            u = u_next
        w = w_next
        x = x_next
        g = g_next
    if ROPE_HEAD_DIM > 0:  # (no SiLU, no residual: the launcher's contract)
        _rope_kv_rows_epilogue(
            acc, m, m_ok, n, pid_n, y_ptr, stride_ym, positions_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr,
            v_cache_ptr, q_cols, kv_cols, BLOCK_N, ROPE_HEAD_DIM, TABLE_DTYPE,
        )  # fmt: skip
    else:
        out_ok = m_ok[:, None] & n_ok[None, :]
        y = acc.to(y_ptr.dtype.element_ty)  # [M_POW2, BLOCK_N]
        if SILU:
            gate = y.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(y.dtype)
            y = (silu.to(tl.float32) * acc_up.to(y.dtype).to(tl.float32)).to(y.dtype)
        if RESIDUAL:
            r = tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=out_ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y, mask=out_ok)


@triton.jit
def _skinny_rows_tile_kernel(
    x_ptr,  # [M, K] rows of the input, K-stride 1
    w_ptr,  # [N, K] weight, K-stride 1 ([2N, K]: gate rows, then up rows, when SILU)
    y_ptr,  # [M, N] out, N-stride 1
    norm_ptr,  # [K] (NORM): RMSNorm weight applied to x first
    res_ptr,  # [M, N] (RESIDUAL): added to the product, N-stride 1
    N,  # output features (SILU: of silu(gate) * up)
    K,  # input features (<= BLOCK_K)
    eps,  # (NORM) RMSNorm epsilon
    stride_xm,  # elements between rows of x
    stride_wn,  # elements between rows of w
    stride_ym,  # elements between rows of y
    stride_rm,  # (RESIDUAL) elements between rows of the residual
    positions_ptr,  # (ROPE_HEAD_DIM) [M] int: each row's position (negative: padding, rotated as position 0)
    inv_freq_ptr,  # (ROPE_HEAD_DIM) [D/2] float32
    slot_ptr,  # (ROPE_HEAD_DIM) [M] int64: each row's cache slot; negative: nothing written
    k_cache_ptr,  # (ROPE_HEAD_DIM) [num_blocks, block_size, Nkv, D] this layer's K cache (written)
    v_cache_ptr,  # (ROPE_HEAD_DIM) this layer's V cache (written)
    q_cols,  # (ROPE_HEAD_DIM) N * D
    kv_cols,  # (ROPE_HEAD_DIM) Nkv * D
    ROWS: tl.constexpr,  # M, unrolled
    BLOCK_N: tl.constexpr,  # output columns per program, a power of two
    BLOCK_K: tl.constexpr,  # K's next power of two: the whole reduction is one tile
    NORM: tl.constexpr = False,
    SILU: tl.constexpr = False,
    RESIDUAL: tl.constexpr = False,
    PDL: tl.constexpr = False,
    ROPE_HEAD_DIM: tl.constexpr = 0,  # D > 0: a fused q/k/v product; RoPE and the cache write as epilogue
    TABLE_DTYPE: tl.constexpr = tl.float32,
):
    """`_skinny_gemv_kernel`'s one-tile product for a few rows (2..MAX_ROWS: a batch-1 round's K + 1
    verification rows, its first draft step) on the CUDA cores: a program loads its [BLOCK_N, K] weight tile
    once, every load issued before the PDL wait, and then reduces each row of x against it in turn (x, the
    norm weight and the rows' RMS come from L2): no 16-row tensor-core tile, no pipeline over K, no
    [rows, BLOCK_N, BLOCK_K] product in registers (`_skinny_rows_kernel` keeps one, which shrinks its tiles).
    Each row's epilogue is the one-row kernel's (`_gemv_epilogue`, or `_rope_kv_epilogue` at the row's
    position and slot), with the same roundings. Why: at SmolLM2's width the tile kernel's six-row products
    cost 5.0-8.1 us against 2.7-5.4 for the one-row kernel on the same weights (H100,
    results/skinny_fused_smollm2_h100.json); launched with an explicit `fma` + `one_tile` config where the
    tile fits (`rows_tile_fits`)."""
    pid_n = tl.program_id(0)
    n = _columns(pid_n, BLOCK_N, ROPE_HEAD_DIM)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    w_ok = n_ok[:, None] & k_ok[None, :]
    w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0)  # weights are constant: before the wait
    u = w
    if SILU:
        u_rows = w_rows + N.to(tl.int64) * stride_wn  # the up half's rows n
        u = tl.load(u_rows + kk[None, :], mask=w_ok, other=0.0)
    pdl_enter(PDL)
    g = kk  # (NORM) the norm weight
    if NORM:
        g = tl.load(norm_ptr + kk, mask=k_ok, other=0.0)
    for r in tl.static_range(ROWS):
        x = tl.load(x_ptr + r * stride_xm + kk, mask=k_ok, other=0.0)
        rstd = 0.0
        if NORM:  # the whole row is in the tile: its RMS without a second pass
            xs = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / K + eps)
        xv = _normed(x, g, rstd, NORM).to(tl.float32)
        part = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)  # [BLOCK_N] float32
        part_up = part
        if SILU:
            part_up = tl.sum(u.to(tl.float32) * xv[None, :], axis=1)
        if ROPE_HEAD_DIM > 0:  # (no SiLU, no residual: the launcher's contract)
            _rope_kv_epilogue(
                part, n, pid_n, y_ptr + r * stride_ym, positions_ptr + r, inv_freq_ptr, slot_ptr + r,
                k_cache_ptr, v_cache_ptr, q_cols, kv_cols, BLOCK_N, ROPE_HEAD_DIM, TABLE_DTYPE,
            )  # fmt: skip
        else:
            _gemv_epilogue(
                part, part_up, n, n_ok, y_ptr + r * stride_ym, res_ptr + r * stride_rm, SILU, RESIDUAL
            )


@triton.jit
def _gemv_epilogue(part, part_up, n, n_ok, y_ptr, res_ptr, SILU: tl.constexpr, RESIDUAL: tl.constexpr):
    """y[n] from the float32 sums: rounded to y's dtype, then SiLU * up and the residual with the unfused
    ops' roundings."""
    y = part.to(y_ptr.dtype.element_ty)  # [BLOCK_N]
    if SILU:
        g = y.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(y.dtype)
        y = (silu.to(tl.float32) * part_up.to(y.dtype).to(tl.float32)).to(y.dtype)
    if RESIDUAL:
        r = tl.load(res_ptr + n, mask=n_ok, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + n, y, mask=n_ok)


@triton.jit
def _columns(pid_n, BLOCK_N: tl.constexpr, ROPE_HEAD_DIM: tl.constexpr):
    """The output columns of program pid_n: BLOCK_N consecutive ones; with ROPE_HEAD_DIM = D > 0, BLOCK_N / 2
    rotate-half pairs (d, d + D/2) of one head, column i holding half i % 2 of pair i // 2 (BLOCK_N divides
    D), so that each pair meets in one program's registers."""
    if ROPE_HEAD_DIM > 0:
        i = tl.arange(0, BLOCK_N)
        programs_per_head = ROPE_HEAD_DIM // BLOCK_N
        first = (pid_n // programs_per_head) * ROPE_HEAD_DIM + (pid_n % programs_per_head) * (BLOCK_N // 2)
        return first + i // 2 + (i % 2) * (ROPE_HEAD_DIM // 2)
    return pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _rotated(y, partner, pos, inv_freq_ptr, pid_n, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             TABLE_DTYPE: tl.constexpr):  # fmt: skip
    """RoPE of the float32 values y [..., BLOCK_N] (columns in pair order, `_columns`; partner: each column's
    other half of its pair) at positions pos (a scalar, or [R, 1] for R rows): first half x1 * cos - x2 *
    sin, second half x2 * cos + x1 * sin (rotate_half(x) = (-x2, x1)), in float32 with cos / sin rounded to
    TABLE_DTYPE (the arithmetic of `_rope_kv_write_kernel`, FROM_POSITIONS)."""
    i = tl.arange(0, BLOCK_N)
    j = (pid_n % (HEAD_DIM // BLOCK_N)) * (BLOCK_N // 2) + i // 2  # each pair's frequency index
    freqs = pos * tl.load(inv_freq_ptr + j)
    cos = tl.cos(freqs).to(TABLE_DTYPE).to(tl.float32)
    sin = tl.sin(freqs).to(TABLE_DTYPE).to(tl.float32)
    return y * cos + tl.where(i % 2 == 0, -partner, partner) * sin


@triton.jit
def _rope_kv_rows_epilogue(
    acc,
    m,
    m_ok,
    n,
    pid_n,
    y_ptr,
    stride_ym,
    positions_ptr,
    inv_freq_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_cols,
    kv_cols,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TABLE_DTYPE: tl.constexpr,
):
    """`_rope_kv_epilogue` for the [R, BLOCK_N] float32 sums of several rows m (R a power of two; rows with
    m_ok false are padding: nothing stored), each rotated at its own position and written to its own slot."""
    y = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    i = tl.arange(0, BLOCK_N)
    partner = tl.gather(y, tl.broadcast_to((i ^ 1)[None, :], y.shape), 1)
    pos = tl.maximum(tl.load(positions_ptr + m, mask=m_ok, other=0), 0).to(tl.float32)
    rotated = _rotated(y, partner, pos[:, None], inv_freq_ptr, pid_n, BLOCK_N, HEAD_DIM, TABLE_DTYPE)
    v_col = n >= q_cols + kv_cols
    is_v = v_col[None, :]
    out = tl.where(is_v, y, rotated).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], out, mask=m_ok[:, None])
    slot = tl.load(slot_ptr + m, mask=m_ok, other=-1)
    live = (m_ok & (slot >= 0))[:, None] & (n >= q_cols)[None, :]
    dst = slot[:, None] * kv_cols + (n - q_cols - tl.where(v_col, kv_cols, 0))[None, :]  # int64: slot is
    tl.store(k_cache_ptr + dst, out.to(k_cache_ptr.dtype.element_ty), mask=live & ~is_v)
    tl.store(v_cache_ptr + dst, out.to(v_cache_ptr.dtype.element_ty), mask=live & is_v)


@triton.jit
def _rope_kv_epilogue(
    part,
    n,
    pid_n,
    y_ptr,
    positions_ptr,
    inv_freq_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_cols,
    kv_cols,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TABLE_DTYPE: tl.constexpr,
):
    """The fused q/k/v product's epilogue (columns n in pair order, see `_skinny_gemv_kernel`): each sum
    rounded to y's dtype as the plain product's output is, then for q and k columns x * cos + rotate_half(x) *
    sin in float32 with cos / sin of the row's position rounded to TABLE_DTYPE (the arithmetic of
    `_rope_kv_write_kernel`, FROM_POSITIONS), rounded once; y <- [q_rot, k_rot, v]; k_rot and v also to the
    cache at the row's slot (none for a negative slot)."""
    y = part.to(y_ptr.dtype.element_ty).to(tl.float32)
    i = tl.arange(0, BLOCK_N)  # column i holds half i % 2 of pair i // 2: its partner is column i ^ 1
    partner = tl.gather(y, i ^ 1, 0)  # (a reshape-split-join here went through local memory on sm_90)
    pos = tl.maximum(tl.load(positions_ptr), 0).to(tl.float32)
    rotated = _rotated(y, partner, pos, inv_freq_ptr, pid_n, BLOCK_N, HEAD_DIM, TABLE_DTYPE)
    is_v = n >= q_cols + kv_cols
    out = tl.where(is_v, y, rotated).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + n, out)
    slot = tl.load(slot_ptr)
    live = (n >= q_cols) & (slot >= 0)
    dst = slot * kv_cols + n - q_cols - tl.where(is_v, kv_cols, 0)  # int64: slot is
    tl.store(k_cache_ptr + dst, out.to(k_cache_ptr.dtype.element_ty), mask=live & ~is_v)
    tl.store(v_cache_ptr + dst, out.to(v_cache_ptr.dtype.element_ty), mask=live & is_v)


@triton.jit
def _normed(x, g, rstd, NORM: tl.constexpr):
    """A tile x of the one row after the norm (weights g), in x's dtype (the roundings of `_x_tile`); x
    itself without NORM."""
    if NORM:
        normed = (x.to(tl.float32) * rstd).to(x.dtype)
        x = (g.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _x_tile(x_rows, norm_ptr, k, m_ok, K, rstd, NORM: tl.constexpr):
    """The [M_PAD, BLOCK_K] tile of the product's input at columns k, after the norm, in x's dtype; each
    step rounds to that dtype where the unfused PyTorch ops would (their results are tensors of it)."""
    mask = m_ok[:, None] & (k < K)[None, :]
    x = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
    if NORM:
        weight = tl.load(norm_ptr + k, mask=k < K, other=0.0)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (weight[None, :].to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _tile_dot(acc, x, w, UPCAST: tl.constexpr):
    """acc + x [M_PAD, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T on the tensor cores (fp32 "ieee" when UPCAST)."""
    if UPCAST:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


def check_config(cfg: SkinnyConfig) -> None:
    """ValueError unless the tiles are powers of two >= 16, num_warps a power of two in [1, 16] and
    num_stages >= 1 (Triton would otherwise fail to build the kernel, or build one that misses columns)."""
    if not isinstance(cfg, SkinnyConfig):
        raise ValueError(f"config: expected a SkinnyConfig, got {type(cfg).__name__}")
    for name in ("block_n", "block_k"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"config.{name}: expected a power of two >= 16, got {v!r}")
    w = cfg.num_warps
    if isinstance(w, bool) or not isinstance(w, int) or w not in (1, 2, 4, 8, 16):
        raise ValueError(f"config.num_warps: expected a power of two in [1, 16], got {w!r}")
    if isinstance(cfg.num_stages, bool) or not isinstance(cfg.num_stages, int) or cfg.num_stages < 1:
        raise ValueError(f"config.num_stages: expected an int >= 1, got {cfg.num_stages!r}")
    for name in ("fma", "one_tile"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"config.{name}: expected a bool, got {getattr(cfg, name)!r}")
    s = cfg.split_k
    if isinstance(s, bool) or not isinstance(s, int) or s < 1 or s > MAX_SPLIT_K or s & (s - 1):
        raise ValueError(f"config.split_k: expected a power of two in [1, {MAX_SPLIT_K}], got {s!r}")


def check_args(
    x: Tensor,
    w: Tensor,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: Tensor | None = None,
) -> None:
    """ValueError unless x is [M, K] with 1 <= M <= MAX_ROWS, w is [N, K] ([2N, K], gate rows then up rows,
    with silu_mul), the norm weight [K] and the residual [M, N], all of one floating dtype on one device (a
    mismatched K would make the kernel read past x's rows), and eps a finite number >= 0 (a negative one
    makes the RMS of a zero row NaN)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x: expected a [M, K] tensor with 1 <= M <= {MAX_ROWS}, got shape {tuple(x.shape)}")
    k = x.shape[1]
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"w: expected a [N, {k}] tensor (x's K), got shape {tuple(w.shape)}")
    if silu_mul and w.shape[0] % 2:
        raise ValueError(
            f"w: expected [2N, K] (gate rows, then up rows) with silu_mul, got shape {tuple(w.shape)}"
        )
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    if w.dtype != x.dtype or not x.dtype.is_floating_point:
        raise ValueError(f"w: expected x's floating dtype {x.dtype}, got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: expected x's device {x.device}, got {w.device}")
    for name, t, shape in (
        ("norm_weight", norm_weight, (k,)),
        ("residual", residual, (x.shape[0], n)),
    ):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{name}: expected a {list(shape)} tensor of x's dtype {x.dtype} on {x.device}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )


def norm_block(k: int, num_warps: int) -> int:
    """x values per load of `_skinny_gemv_kernel`'s RMS pass: K's next power of two, at most
    NORM_VALUES_PER_THREAD per thread (beyond that the pass loops)."""
    return max(16, min(triton.next_power_of_2(k), NORM_VALUES_PER_THREAD * 32 * num_warps))


def gemv_block_k(cfg: SkinnyConfig, k: int, *, silu_mul: bool = False) -> tuple[int, bool, int]:
    """(BLOCK_K, ONE_TILE, K_SPLIT) of `_skinny_gemv_kernel` for a config and a reduction depth k cut into
    cfg.split_k splits of K_SPLIT inputs each (a multiple of 16, and of BLOCK_K when the split loops): the
    whole split in one tile when `cfg.one_tile` asks and it fits (GEMV_ONE_TILE_ELEMS_PER_THREAD, twice the
    tiles with SiLU * up), else cfg.block_k shrunk until the loop's tiles fit (GEMV_ELEMS_PER_THREAD)."""
    tiles = 2 if silu_mul else 1
    threads = 32 * cfg.num_warps
    depth = -(-k // cfg.split_k)
    whole = max(16, triton.next_power_of_2(depth))
    if cfg.one_tile and cfg.block_n * whole * tiles <= GEMV_ONE_TILE_ELEMS_PER_THREAD * threads:
        return whole, True, -(-depth // 16) * 16
    block_k = cfg.block_k
    while cfg.block_n * block_k * tiles > GEMV_ELEMS_PER_THREAD * threads and block_k > 16:
        block_k //= 2
    return block_k, False, -(-depth // block_k) * block_k


def rows_tile_fits(cfg: SkinnyConfig, k: int, *, silu_mul: bool = False) -> bool:
    """Whether `_skinny_rows_tile_kernel` holds a [block_n, K's next power of two] weight tile (two with
    SiLU * up) within GEMV_ONE_TILE_ELEMS_PER_THREAD per thread, the one-row one-tile kernel's bound."""
    whole = max(16, triton.next_power_of_2(k))
    tiles = 2 if silu_mul else 1
    return cfg.block_n * whole * tiles <= GEMV_ONE_TILE_ELEMS_PER_THREAD * 32 * cfg.num_warps


def rows_block_k(cfg: SkinnyConfig, m: int, k: int, *, silu_mul: bool = False) -> int:
    """BLOCK_K of `_skinny_rows_kernel` for m rows: cfg.block_k (at most K's next power of two) shrunk until
    the [M_POW2, BLOCK_N, BLOCK_K] product fits ROWS_ELEMS_PER_THREAD per thread (twice with SiLU * up)."""
    tiles = 2 if silu_mul else 1
    per_row = cfg.block_n * triton.next_power_of_2(m) * tiles
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    while per_row * block_k > ROWS_ELEMS_PER_THREAD * 32 * cfg.num_warps and block_k > 16:
        block_k //= 2
    return block_k


def rows_norm_block(m: int, k: int, num_warps: int) -> int:
    """x values per row and load of `_skinny_rows_kernel`'s RMS pass: K's next power of two, at most
    NORM_VALUES_PER_THREAD per thread over the rows."""
    cap = NORM_VALUES_PER_THREAD * 32 * num_warps // triton.next_power_of_2(m)
    return max(16, min(triton.next_power_of_2(k), cap))


def skinny_linear(
    x: Tensor,
    w: Tensor,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, M <= MAX_ROWS (`check_args`), with optional fusions:
    `norm_weight` applies RMSNorm (eps) to x first, `silu_mul` takes w = [w_gate; w_up] [2N, K] and returns
    silu(x @ w_gate.T) * (x @ w_up.T) [M, N], `residual` [M, N] is added to the result (see
    `skinny_linear_ref`)."""
    check_args(x, w, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual)
    m = x.shape[0]
    rows, k = w.shape
    n = rows // 2 if silu_mul else rows
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    norm = norm_weight.contiguous() if norm_weight is not None else x
    res = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    if config is not None:
        check_config(config)
    cfg = config or default_config(rows, k, one_row=m == 1)
    if silu_mul and config is None:  # a program reads block_n gate rows and block_n up rows
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    if norm_weight is not None and config is None and not (cfg.fma and m <= FMA_MAX_ROWS):
        # the tile kernel's normalised x tile also lives in registers (the one-row kernel's is a vector)
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, NORM_MAX_BLOCK_K))
    interpreted = isinstance(_skinny_linear_kernel, InterpretedFunction)
    upcast = interpreted or x.dtype == torch.float32
    launch = {} if interpreted else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.fma and cfg.one_tile and cfg.split_k == 1 and m >= 2 and rows_tile_fits(cfg, k, silu_mul=silu_mul):
        _skinny_rows_tile_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, w, y, norm, y if res is None else res, n, k, float(eps), x.stride(0), w.stride(0), y.stride(0),
            0 if res is None else res.stride(0), y, y, y, y, y, 0, 0,
            ROWS=m, BLOCK_N=cfg.block_n, BLOCK_K=max(16, triton.next_power_of_2(k)),
            NORM=norm_weight is not None, SILU=silu_mul, RESIDUAL=res is not None, **launch, **pdl.options(x),
        )  # fmt: skip
        return y
    if cfg.fma and 2 <= m <= FMA_MAX_ROWS:
        block_k = rows_block_k(cfg, m, k, silu_mul=silu_mul)
        _skinny_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, w, y, norm, y if res is None else res, m, n, k, float(eps), x.stride(0), w.stride(0),
            y.stride(0), 0 if res is None else res.stride(0), y, y, y, y, y, 0, 0,
            M_POW2=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=block_k,
            NORM=norm_weight is not None, SILU=silu_mul, RESIDUAL=res is not None,
            NORM_BLOCK=rows_norm_block(m, k, cfg.num_warps) if norm_weight is not None else 16,
            **launch, **pdl.options(x),
        )  # fmt: skip
        return y
    if cfg.fma and m == 1:
        blocks = triton.cdiv(n, cfg.block_n)
        # the split reduction's per-block counters: zeroed for this launch (its last program per block also
        # resets them, so they end at zero), freed after it: no buffer outlives a call
        counters = torch.zeros(blocks, dtype=torch.int32, device=x.device) if cfg.split_k > 1 else None
        block_k, one_tile, k_split = gemv_block_k(cfg, k, silu_mul=silu_mul)
        parts = y
        if cfg.split_k > 1:
            parts = torch.empty(
                (2 if silu_mul else 1) * cfg.split_k * n, dtype=torch.float32, device=x.device
            )
        _skinny_gemv_kernel[(blocks, cfg.split_k)](
            x, w, y, norm, y if res is None else res, parts, y if counters is None else counters, n, k,
            k_split, float(eps), w.stride(0), y, y, y, y, y, 0, 0,
            BLOCK_N=cfg.block_n, BLOCK_K=block_k, NORM=norm_weight is not None, SILU=silu_mul,
            RESIDUAL=res is not None, ONE_TILE=one_tile, SPLIT_K=cfg.split_k,
            NORM_BLOCK=norm_block(k, cfg.num_warps) if norm_weight is not None else 16,
            **launch, **pdl.options(x),
        )  # fmt: skip
        return y
    _skinny_linear_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, y, norm, y if res is None else res, m, n, k, float(eps), x.stride(0), w.stride(0), y.stride(0),
        0 if res is None else res.stride(0), y, y, y, y, y, 0, 0,
        M_PAD=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=upcast,
        NORM=norm_weight is not None, SILU=silu_mul, RESIDUAL=res is not None,
        **launch, **pdl.options(x),
    )  # fmt: skip
    return y


def skinny_linear_ref(
    x: Tensor,
    w: Tensor,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: Tensor | None = None,
) -> Tensor:
    """The reference: the unfused PyTorch ops of a Llama layer (RMSNorm in float32 as
    fspec.models.layers.rms_norm; float32 accumulation of x @ w.T cast to x's dtype; `F.silu(gate) * up` of
    its two halves; `residual + y`)."""
    check_args(x, w, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual)
    if norm_weight is not None:
        x32 = x.float()
        x = norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = (x.float() @ w.float().T).to(x.dtype)
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else residual + y
