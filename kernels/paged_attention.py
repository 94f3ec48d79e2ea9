"""Paged attention over the KV cache, driven by the `AttnMetadata` tensors (fspec/core/state.py).

    paged_attention(q [T, N, D], k_cache, v_cache, block_table, seq_lens, positions, query_start_loc,
                    *, scale, num_query, layer=0, early_kv=False, early_release=False) -> out [T, N, D]

Request b owns query rows query_start_loc[b] : query_start_loc[b+1] (at most `num_query` of them; the usual
layout is exactly num_query rows per request, T = B * num_query: 1 for decode, K + 1 for the first draft step
and for verification). The query at position p of request b attends to cache positions 0..p of b, read through
block_table[b] (its own K/V and those of the other new tokens were written before attention, so this is
causal within the new tokens). Position -1 (padding) outputs 0; seq_lens[b] = 0 reads nothing. Keys at
positions >= seq_lens[b] are never read, so unallocated block-table entries past the context are harmless.
GQA: query head n reads KV head n // (N / Nkv).

Design (flash-decoding with GQA packing):
* grid (B * M_TILES, Nkv, num_splits). One program takes one KV head of one request and ALL its query rows:
  the num_query x group (query, head) pairs form an [M, D] tile (M padded to >= 16 for `tl.dot` on tensor
  cores), so each K/V tile is read once per KV head, not once per query head (4x fewer bytes at 32/8 heads).
* split-K: the context is cut into partitions of `partition` tokens; program `split` covers
  [split * partition, (split + 1) * partition). The number of splits is static (cache capacity / partition),
  so the grid never depends on seq_lens; programs whose partition starts at or past seq_len run no loop
  iteration and write max = -inf, which the reduce kernel weighs by exp2(-inf) = 0. With one split the main
  kernel normalises and writes `out` itself (no reduce launch).
* Everything the launch depends on (B, num_query, max_blocks, block_size, config) is static; block_table,
  seq_lens, positions and query_start_loc are loaded inside the kernels, so the launch is CUDA-graph safe.
* Under PDL (kernels/pdl.py), `early_kv` loads each program's first key tile of rows before the request's
  first query position ahead of the wait, and `early_release` lets the launch after the reduce start before
  the reduce's wait: each is the caller's promise about its neighbours (the launcher's docstring).
* fp32 accumulation and softmax in base 2 (scale * log2(e) folded into the scores). On a GPU the dots run in
  the cache dtype (bf16/fp16 tensor cores, fp32 accumulate; fp32 inputs use "ieee", not tf32); under the
  interpreter everything is cast to fp32 right after loading (its bf16 arithmetic is garbage).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from einops import rearrange
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from . import pdl
from .kv_write import contiguous_layers, layer_view
from .pdl import pdl_enter, pdl_release_then_wait

LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters; None fields are filled by `default_config`'s heuristic.

    Attributes:
        block_n: keys per inner-loop tile (a power of two; >= 16 on a GPU for tl.dot).
        partition: context tokens per program (a multiple of block_n); None = chosen from the grid size.
        num_warps: warps per program of the main kernel.
        num_stages: software-pipelining stages of the key loop (GPU only).
        block_m: (query, head) rows per program, a power of two >= 16; None = num_query * group padded.
    """

    block_n: int = 64
    partition: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    block_m: int | None = None


# (max head_dim, max num_query, block_n, num_warps, num_stages); the first row that fits wins. Starting
# points from shared-memory arithmetic (K and V tiles of block_n x D per stage: 64 x 128 bf16 = 16 KB each,
# 3 stages = 96 KB of the H200's 228 KB per SM); to be tuned on the H200 with bench_attention.py --sweep.
_TILE_TABLE = (
    (64, 1, 64, 4, 3),
    (64, 1 << 30, 64, 4, 2),
    (128, 1, 64, 4, 3),
    (128, 1 << 30, 64, 4, 2),
    (256, 1 << 30, 32, 4, 2),
)
# Context tokens per split: at least MIN_PARTITION (64: at B = 1 on the H200, 64-token splits beat 256-token
# ones in the draft step at context 2k and in a short-context decode step, table `switches` run g; shorter
# ones only add partials and reduce work), at most MAX_PARTITION (many short programs balance the SMs, no
# half-empty last wave, for partials of 4 * (D + 2) bytes per head and split: under 1% of the K/V bytes of
# these shapes).
MIN_PARTITION, MAX_PARTITION = 64, 2048
MAX_BLOCK_M = 64  # (query, head) rows per program; more rows go to further programs (prefill-sized num_query)
PROGRAMS_PER_SM = 4  # split until the grid has about this many programs per SM (memory-level parallelism)
MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2 (axis 0: 2^31 - 1); splits sit on axis 2
# Query rows of a request whose positions an EARLY_KV program scans in one [NQ_POW2] load for its first new
# position: every decode, draft and verification step (K + 1 <= 17). Beyond it (a prefill) the launch drops
# the early loads: they hide one launch's latency, which a prefill's attention does not notice, and the scan
# is a tile of next_pow2(prompt) positions per program, 8192 int64 for SmolLM2's longest prompt, read by
# each of its ~10^5 programs (sm_90 compile at 9/3 heads of 64: 208 bytes of stack at 22 rows, 280 at 64).
MAX_EARLY_KV_QUERY = 32
REDUCE_WARPS = 4  # warps of the split-K reduce kernel
# float32 partial outputs the reduce kernel loads at once ([SPLITS_POW2, BLOCK_D], 128 per thread at 4
# warps): it used to load all S splits of a row at once, S x BLOCK_D growing with the context
# (`reduce_chunk`). The cap is the largest tile the heuristic made up to 8192-token contexts (128 splits x
# 128 dims): those keep their one load (a second, dependent chunk cost the H200 +2 us at B = 1, 128 splits
# of D = 64); longer contexts loop instead of growing the tile (512 splits at 32k: 512 x 128 per program).
REDUCE_TILE = 16384


@functools.cache
@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # an H200; only shapes the (CPU) interpreter's grid, whose results do not depend on it
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(
    *,
    batch: int,
    kv_heads: int,
    group: int,
    num_query: int,
    head_dim: int,
    capacity: int,
    num_sms: int = 132,
    override: AttentionConfig | None = None,
) -> AttentionConfig:
    """A complete config from static sizes only (capacity = max_blocks * block_size); `override` wins."""
    row = next((r for r in _TILE_TABLE if head_dim <= r[0] and num_query <= r[1]), _TILE_TABLE[-1])
    cfg = override or AttentionConfig(block_n=row[2], num_warps=row[3], num_stages=row[4])
    block_m = cfg.block_m or min(max(16, triton.next_power_of_2(num_query * group)), MAX_BLOCK_M)
    partition = cfg.partition
    if partition is None:
        programs = batch * triton.cdiv(num_query * group, block_m) * kv_heads
        want = max(1, triton.cdiv(PROGRAMS_PER_SM * num_sms, programs))
        splits = max(1, min(want, capacity // MIN_PARTITION), triton.cdiv(capacity, MAX_PARTITION))
        partition = triton.cdiv(capacity, splits)
    # splits are grid axis 2: at most MAX_GRID_YZ of them, whatever the capacity or the override
    partition = max(partition, triton.cdiv(capacity, MAX_GRID_YZ))
    partition = max(cfg.block_n, triton.cdiv(partition, cfg.block_n) * cfg.block_n)
    return dataclasses.replace(cfg, block_m=block_m, partition=partition)


def reduce_chunk(splits: int, block_d: int) -> int:
    """Splits the reduce kernel combines per load (SPLITS_POW2): next_pow2(splits), at most
    REDUCE_TILE // block_d (256 at D = 64, 128 at D = 128: every context up to 8192 tokens is one load)."""
    return min(triton.next_power_of_2(splits), max(1, REDUCE_TILE // block_d))


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Grids and size-derived constexprs of one `paged_attention` call (`launch_plan`).

    Attributes:
        config: the complete `AttentionConfig` (`default_config`).
        splits: S, context partitions (grid axis 2), cdiv(capacity, config.partition) <= MAX_GRID_YZ.
        m_tiles: programs per (request, KV head) along the (query, head) rows, cdiv(Q * group, block_m).
        block_d: next power of two >= max(D, 16).
        grid: (B * m_tiles, Nkv, S) of the main kernel.
        reduce_grid: (T, N) of the reduce kernel, or None (one split).
        reduce_chunk: splits the reduce kernel combines per load (SPLITS_POW2; it loops over more).
        early_kv: whether the launch takes the early loads (asked for and Q <= MAX_EARLY_KV_QUERY).
        nq_pow2: NQ_POW2, next power of two >= Q, where the early loads read all Q rows of a request at once
            (Q <= MAX_EARLY_KV_QUERY), else 1.
    """

    config: AttentionConfig
    splits: int
    m_tiles: int
    block_d: int
    grid: tuple[int, int, int]
    reduce_grid: tuple[int, int] | None
    reduce_chunk: int
    early_kv: bool
    nq_pow2: int


@functools.lru_cache(maxsize=1024)  # a pure function of its sizes: an eager step asks for it per layer
def launch_plan(
    *,
    tokens: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_query: int,
    max_blocks: int,
    block_size: int,
    num_sms: int = 132,
    config: AttentionConfig | None = None,
    early_kv: bool = False,
) -> LaunchPlan:
    """Everything `paged_attention` launches from static sizes only: T query tokens of B requests, N / Nkv
    heads of D, num_query rows per request, a block table of max_blocks blocks of block_size tokens."""
    group = heads // kv_heads
    capacity = max_blocks * block_size
    cfg = default_config(
        batch=batch, kv_heads=kv_heads, group=group, num_query=num_query, head_dim=head_dim,
        capacity=capacity, num_sms=num_sms, override=config,
    )  # fmt: skip
    splits = triton.cdiv(capacity, cfg.partition)
    m_tiles = triton.cdiv(num_query * group, cfg.block_m)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16: small heads pad to 16
    early = early_kv and num_query <= MAX_EARLY_KV_QUERY
    return LaunchPlan(
        config=cfg,
        splits=splits,
        m_tiles=m_tiles,
        block_d=block_d,
        grid=(batch * m_tiles, kv_heads, splits),
        reduce_grid=(tokens, heads) if splits > 1 else None,
        reduce_chunk=reduce_chunk(splits, block_d),
        early_kv=early,
        nq_pow2=triton.next_power_of_2(num_query) if early else 1,
    )


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _query_tile(
    q_ptr, tok, head, row_ok, d, d_ok, stride_qt, stride_qn, UPCAST: tl.constexpr,
):  # fmt: skip
    """The program's [BLOCK_M, BLOCK_D] query rows, in the dtype the dots take."""
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qn + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _key_tile(
    block_table_ptr, b, stride_bt, n0, end, kvh, d, d_ok, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Keys n0 .. n0 + BLOCK_N of request b through its block table (one entry per key: any block_size):
    (n, n < end, [BLOCK_N, BLOCK_D] element offsets of KV head kvh in a layer's cache, their mask)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    blk = tl.load(block_table_ptr + b * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + n % BLOCK_SIZE  # [BLOCK_N] int64: caches past 2^31 elements
    kv_off = slot[:, None] * (KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
    if BLOCK_D == HEAD_DIM:
        kv_ok = n_ok[:, None]  # a mask constant along D keeps the loads vectorised
    else:
        kv_ok = n_ok[:, None] & d_ok[None, :]
    return n, n_ok, kv_off, kv_ok


@triton.jit
def _attend_tile(q, k, v, n, n_ok, pos, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """One key tile into the online softmax (base 2): masked scores are -inf and a row with no key yet keeps
    m = -inf. -> (m_i, l_i, acc)."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
    s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) would be NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, N, D] queries, head-dim stride 1
    k_cache_ptr,  # [num_blocks, block_size, Nkv, D] this layer's K cache, contiguous
    v_cache_ptr,  # [num_blocks, block_size, Nkv, D] this layer's V cache, contiguous
    block_table_ptr,  # [B, max_blocks] int32 cache block of each request's j-th block
    seq_lens_ptr,  # [B] int32 tokens of each request in the cache
    positions_ptr,  # [T] int64 position of each query token; -1 = padding
    query_start_loc_ptr,  # [B+1] int32 first query row of each request
    out_ptr,  # [T, N, D] out (one split): normalised attention output, q's dtype
    part_m_ptr,  # [S, T, N] float32 out (splits): running max of the base-2 scores, -inf = no key
    part_l_ptr,  # [S, T, N] float32 out (splits): sum of exp2(score - max)
    part_acc_ptr,  # [S, T, N, D] float32 out (splits): unnormalised sum of exp2(score - max) * v
    stride_qt,  # elements between consecutive tokens of q
    stride_qn,  # elements between consecutive heads of q
    stride_ot,  # elements between consecutive tokens of out
    stride_on,  # elements between consecutive heads of out
    stride_bt,  # elements between consecutive rows of block_table
    T,  # query tokens (rows of q); indexes the partial buffers
    partition,  # context tokens per split (a multiple of BLOCK_N)
    num_splits,  # S
    scale_log2,  # softmax scale * log2(e)
    NUM_QUERY: tl.constexpr,  # static bound on query rows per request
    GROUP: tl.constexpr,  # query heads per KV head
    KV_HEADS: tl.constexpr,  # Nkv
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    SPLIT: tl.constexpr,  # write partials for the reduce kernel (False: write out directly)
    BLOCK_M: tl.constexpr,  # (query, head) rows per program, a power of two
    BLOCK_N: tl.constexpr,  # keys per loop iteration, a power of two
    BLOCK_D: tl.constexpr,  # next power of two >= max(D, 16)
    UPCAST: tl.constexpr,  # cast loaded q/K/V to float32 (interpreter, or float32 caches)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    NQ_POW2: tl.constexpr = 1,  # (EARLY_KV) next power of two >= NUM_QUERY (`launch_plan`)
    EARLY_KV: tl.constexpr = False,  # load the first key tile's old rows before the PDL wait (see below)
    k_early_ptr=None,  # (EARLY_KV) the K cache the pre-wait loads read: k_cache_ptr but in tests
    v_early_ptr=None,  # (EARLY_KV) the V cache the pre-wait loads read: v_cache_ptr but in tests
):
    # EARLY_KV: everything before the wait is read from what kernels older than the one ahead wrote: the
    # metadata, the block table and the cache rows before this forward's own tokens. The kernel ahead
    # (the cache write or the q/k/v product with it in its epilogue) writes only q and those new rows, so
    # they are loaded after the wait, over the early tile. The caller vouches for that order.
    if not EARLY_KV:
        pdl_enter(PDL)
    M_TILES: tl.constexpr = (NUM_QUERY * GROUP + BLOCK_M - 1) // BLOCK_M
    b = tl.program_id(0) // M_TILES
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # 1. Rows r = (query i, head g) of this program: GQA packing, all query heads of the KV head together.
    r = (tl.program_id(0) % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = r // GROUP
    head = kvh * GROUP + r % GROUP  # [BLOCK_M] query head
    q_start = tl.load(query_start_loc_ptr + b)
    q_count = tl.load(query_start_loc_ptr + b + 1) - q_start
    row_ok = (r < NUM_QUERY * GROUP) & (qi < q_count)
    tok = (q_start + qi).to(tl.int64)  # [BLOCK_M] query row in q
    pos = tl.load(positions_ptr + tok, mask=row_ok, other=-1).to(tl.int32)  # -1: sees nothing
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # 2. Keys [start, end) of this split: never past seq_len, nor past the last row's position.
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * partition
    end = tl.minimum(tl.minimum(start + partition, seq_len), tl.max(pos, axis=0) + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if EARLY_KV:
        # The first tile's keys before the request's first new position, then the wait, then the new ones.
        j = tl.arange(0, NQ_POW2)
        jpos = tl.load(positions_ptr + (q_start + j).to(tl.int64), mask=j < q_count, other=-1)
        first_new = tl.min(tl.where(jpos >= 0, jpos, 2147483647), axis=0)  # rows at -1 write nothing
        n, n_ok, kv_off, kv_ok = _key_tile(
            block_table_ptr, b, stride_bt, start, end, kvh, d, d_ok, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            BLOCK_D,
        )  # fmt: skip
        old = kv_ok & (n < first_new)[:, None]
        k = tl.load(k_early_ptr + kv_off, mask=old, other=0.0)
        v = tl.load(v_early_ptr + kv_off, mask=old, other=0.0)
        pdl_enter(PDL)
    q = _query_tile(q_ptr, tok, head, row_ok, d, d_ok, stride_qt, stride_qn, UPCAST)
    first = start
    if EARLY_KV:
        new = kv_ok & (n >= first_new)[:, None]
        k = tl.load(k_cache_ptr + kv_off, mask=new, other=k)
        v = tl.load(v_cache_ptr + kv_off, mask=new, other=v)
        if start < end:
            m_i, l_i, acc = _attend_tile(q, k, v, n, n_ok, pos, m_i, l_i, acc, scale_log2, UPCAST)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        # 3. Gather BLOCK_N keys through the block table (one table entry per key: any block_size works).
        n, n_ok, kv_off, kv_ok = _key_tile(
            block_table_ptr, b, stride_bt, n0, end, kvh, d, d_ok, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            BLOCK_D,
        )  # fmt: skip
        k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, n, n_ok, pos, m_i, l_i, acc, scale_log2, UPCAST)
    # 5. One split: normalise and write out (rows without keys: acc = 0, l = 0 -> 0). Several: partials.
    if SPLIT:
        part = (split * T + tok) * (KV_HEADS * GROUP) + head  # [BLOCK_M] int64
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        live = row_ok & (m_i > float("-inf"))  # empty partitions skip the acc store; the reduce masks them
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=live[:, None] & d_ok[None, :]
        )
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_on + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _paged_attention_reduce_kernel(
    part_m_ptr,  # [S, T, N] float32: per-split max of the base-2 scores (-inf = split saw no key)
    part_l_ptr,  # [S, T, N] float32: per-split sum of exp2(score - max)
    part_acc_ptr,  # [S, T, N, D] float32: per-split unnormalised output (unwritten where max = -inf)
    out_ptr,  # [T, N, D] out: attention output, q's dtype
    stride_ot,  # elements between consecutive tokens of out
    stride_on,  # elements between consecutive heads of out
    T,  # query tokens
    num_splits,  # S
    NUM_HEADS: tl.constexpr,  # N
    HEAD_DIM: tl.constexpr,  # D
    SPLITS_POW2: tl.constexpr,  # splits combined per load, a power of two (`LaunchPlan.reduce_chunk`)
    BLOCK_D: tl.constexpr,  # next power of two >= max(D, 16)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    EARLY_RELEASE: tl.constexpr = False,  # let the next kernel launch before the wait (see the launcher)
):
    if EARLY_RELEASE:
        pdl_release_then_wait(PDL)
    else:
        pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    # SPLITS_POW2 splits per load, the running max rescaled per chunk: the [S, D]
    # tile of all splits at once grew with the context (a 128k-token cache has up to 528 splits: 528 x 128
    # float32 per program). With S <= SPLITS_POW2 (every context up to 8192 tokens) it is one iteration with
    # the arithmetic and the bits of the single load it replaces (alpha = 0 times zeros).
    m_run = tl.full([], float("-inf"), dtype=tl.float32)
    num = tl.zeros([BLOCK_D], dtype=tl.float32)
    den = tl.zeros([], dtype=tl.float32)
    for c0 in range(0, num_splits, SPLITS_POW2):
        s = c0 + tl.arange(0, SPLITS_POW2)
        part = (s * T + t) * NUM_HEADS + h  # [SPLITS_POW2] int64
        s_ok = s < num_splits
        m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
        live = s_ok & (m > float("-inf"))
        acc = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
            mask=live[:, None] & (d < HEAD_DIM)[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_ref)  # 0 while nothing was combined
        w = tl.exp2(m - m_ref)  # 0 for splits without keys
        num = num * alpha + tl.sum(acc * w[:, None], axis=0)  # [BLOCK_D]
        den = den * alpha + tl.sum(l_s * w, axis=0)
        m_run = m_new
    o = num / tl.where(den > 0, den, 1.0)  # a row that saw no key (padding) -> 0
    tl.store(out_ptr + t * stride_ot + h * stride_on + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


def check_config(cfg: AttentionConfig, *, cuda: bool) -> None:
    """ValueError naming the field unless the set fields are usable: block_n and block_m powers of two (at
    least 16 on a GPU, where they are tl.dot sizes), partition >= 1, num_warps a power of two <= 16,
    num_stages >= 1."""
    if not isinstance(cfg, AttentionConfig):
        raise ValueError(f"config: expected an AttentionConfig, got {type(cfg).__name__}")
    least = 16 if cuda else 1
    for name in ("block_n", "block_m"):
        v = getattr(cfg, name)
        if v is None and name == "block_m":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < least or v & (v - 1):
            raise ValueError(f"config.{name}: expected a power of two >= {least}, got {v!r}")
    checks = (
        ("partition", cfg.partition is None or _positive_int(cfg.partition), "None or an int >= 1"),
        ("num_warps", cfg.num_warps in (1, 2, 4, 8, 16) and _positive_int(cfg.num_warps), "1, 2, 4, 8 or 16"),
        ("num_stages", _positive_int(cfg.num_stages), "an int >= 1"),
    )
    for name, ok, expected in checks:
        if not ok:
            raise ValueError(f"config.{name}: expected {expected}, got {getattr(cfg, name)!r}")


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    num_query: int,
    layer: int = 0,
    config: AttentionConfig | None = None,
    early_kv: bool = False,
    early_release: bool = False,
    _early_cache: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Launch the kernels (see the module docstring) -> out [T, N, D] in q's dtype.

    Inputs are assumed validated (fspec.validate_attn_metadata); `config` overrides the heuristic (the
    benchmark's sweep). Grid and launch arguments depend on static sizes only.

    `early_kv`: each program loads its first key tile's rows before the request's first query position
    ahead of its PDL wait (`EARLY_KV`), so their round trips overlap the kernel ahead. The caller vouches
    that the kernel ahead in the stream writes nothing this launch reads but q and the cache rows of the
    query tokens' positions (a layer's cache write or q/k/v product right before; fspec/ops/attention.py).
    Ignored above MAX_EARLY_KV_QUERY query rows per request (a prefill): the same result, no early loads.
    `early_release`: the reduce kernel lets the launch after it start before its own wait, so that launch's
    pre-wait loads (the o projection's weight tiles) overlap the attention. The caller vouches that the
    launch after reads nothing before its PDL wait but constants (`skinny_linear`: weights; Inductor's
    kernels, which wait before any access inside fspec's compiled calls: nothing). Without PDL, or with one
    split (no reduce), it changes nothing. `_early_cache` (tests only): other (k_cache, v_cache) layers for
    those early loads, so a test can tell which rows came from which load.
    """
    if config is not None:
        check_config(config, cuda=q.is_cuda)
    kc, vc = contiguous_layers(k_cache, v_cache, layer)
    t, n, d = q.shape
    _, block_size, nkv, _ = kc.shape
    b, max_blocks = block_table.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    # per-request / per-token metadata is read at ptr + index
    seq_lens, positions = seq_lens.contiguous(), positions.contiguous()
    query_start_loc = query_start_loc.contiguous()
    group = n // nkv
    sizes = dict(
        tokens=t, batch=b, heads=n, kv_heads=nkv, head_dim=d, num_query=num_query, max_blocks=max_blocks,
        block_size=block_size, num_sms=_num_sms(q.device.index if q.is_cuda else None), config=config,
        early_kv=early_kv,
    )  # fmt: skip
    plan = launch_plan(**sizes)
    cfg, splits = plan.config, plan.splits
    f32 = dict(dtype=torch.float32, device=q.device)
    part_m = torch.empty((splits, t, n), **f32) if splits > 1 else out
    part_l = torch.empty((splits, t, n), **f32) if splits > 1 else out
    part_acc = torch.empty((splits, t, n, d), **f32) if splits > 1 else out
    # tl.dot needs one input dtype; the interpreter's bf16 arithmetic is garbage
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    upcast = interpreted or out.dtype != kc.dtype or torch.float32 in (out.dtype, kc.dtype, vc.dtype)
    launch = pdl.options(q)  # one device check for the call's launches
    early = {}
    if plan.early_kv:
        ke, ve = (kc, vc) if _early_cache is None else (layer_view(c, layer) for c in _early_cache)
        early = dict(EARLY_KV=True, NQ_POW2=plan.nq_pow2, k_early_ptr=ke, v_early_ptr=ve)
    _paged_attention_kernel[plan.grid](
        q, kc, vc, block_table, seq_lens, positions, query_start_loc, out, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        t, cfg.partition, splits, scale * LOG2E,
        NUM_QUERY=num_query, GROUP=group, KV_HEADS=nkv, HEAD_DIM=d, BLOCK_SIZE=block_size, SPLIT=splits > 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=plan.block_d,
        UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch, **early,
    )  # fmt: skip
    if plan.reduce_grid is not None:
        _paged_attention_reduce_kernel[plan.reduce_grid](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), t, splits,
            NUM_HEADS=n, HEAD_DIM=d, SPLITS_POW2=plan.reduce_chunk, BLOCK_D=plan.block_d,
            EARLY_RELEASE=early_release,
            num_warps=REDUCE_WARPS,
            **launch,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------
# PyTorch reference
# ----------------------------------------------------------------------------------------------------------


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    num_query: int,
    layer: int = 0,
) -> Tensor:
    """Plain PyTorch, same contract: gather each request's whole table once, mask, softmax in float32.

    Branch-free with static shapes (B, num_query, max_blocks * block_size), so it also traces under
    torch.compile. Keys at positions >= seq_len are zeroed before use, so garbage (even NaN) in blocks a
    request does not own never reaches the output.
    """
    kc, vc = layer_view(k_cache, layer), layer_view(v_cache, layer)
    t, n, d = q.shape
    num_blocks, block_size, nkv, _ = kc.shape
    b = block_table.shape[0]
    # 1. Queries into [B, num_query] rows: token t -> (request, t - query_start_loc[request]).
    tokens = torch.arange(t, device=q.device)
    req = torch.searchsorted(query_start_loc[1:].long(), tokens, right=True).clamp(max=b - 1)  # [T]
    local = (tokens - query_start_loc.long()[req]).clamp(0, num_query - 1)
    dest = req * num_query + local  # [T]
    qp = q.new_zeros(b * num_query, n, d).index_copy(0, dest, q)
    pos = torch.full((b * num_query,), -1, dtype=torch.int64, device=q.device).index_copy(0, dest, positions)
    # 2. Context [B, C, Nkv, D], C = max_blocks * block_size; entries past seq_len clamp to block 0 and are
    #    zeroed (an unallocated block-table entry may hold -1 or garbage).
    j = torch.arange(block_table.shape[1] * block_size, device=q.device)  # [C]
    in_ctx = j[None, :] < seq_lens.long()[:, None]  # [B, C]
    blk = block_table.long()[:, j // block_size].clamp(0, num_blocks - 1)
    slots = blk * block_size + j % block_size  # [B, C]
    zero = torch.zeros((), dtype=torch.float32, device=q.device)
    kctx = torch.where(in_ctx[..., None, None], kc.reshape(-1, nkv, d)[slots].float(), zero)
    vctx = torch.where(in_ctx[..., None, None], vc.reshape(-1, nkv, d)[slots].float(), zero)
    # 3. Scores [B, Nkv, G, Q, C]; the query at position p sees keys j <= p inside the context.
    qg = rearrange(qp.float(), "(b s) (h g) d -> b h g s d", b=b, h=nkv)
    scores = torch.einsum("bhgsd,bchd->bhgsc", qg, kctx) * scale
    pos = rearrange(pos, "(b s) -> b s", b=b)  # [B, Q]
    visible = (j[None, None, :] <= pos[:, :, None]) & in_ctx[:, None, :]  # [B, Q, C]
    visible = visible[:, None, None]  # [B, 1, 1, Q, C]
    scores = torch.where(visible, scores, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - torch.where(row_max == float("-inf"), 0.0, row_max))  # 0 where not visible
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgsc,bchd->bhgsd", p, vctx) / torch.where(denom > 0, denom, 1.0)
    out = rearrange(out, "b h g s d -> (b s) (h g) d")[dest]  # [T, N, D]
    return out.to(q.dtype)
