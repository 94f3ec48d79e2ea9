"""Gumbel-max sampling with per-row temperature, writing into a state-driven column.

token = argmax_v (logits[v] / T + g_v), g_v = Philox Gumbel noise at (seed, position, v, salt); T = 0 is a
plain argmax without noise. Greedy and sampled rows mix freely in one batch. NaN logits count as -inf, so
they never win; ties go to the smallest token id; a row without any finite logit returns token 0 (and, with
`out_probs`, a one-hot at token 0). A sampled row whose logits / T reach +inf (a +inf logit, or a temperature
small enough to overflow) is decided as a greedy row: its first raw argmax, and a one-hot in `out_probs` (the
T -> 0 limit, and no NaN). The public `fspec.gumbel_sample` refuses such inputs; compiled callers skip
validation and get this instead.

With `out_tokens [N, K]`, `out_probs [N, K, V]` and `col` (0-d int64 tensor on the device, read inside the
kernel, never a Python int) the token also goes to `out_tokens[:, col]` and the processed probabilities
softmax(logits / T) (one-hot at the token when T = 0) to `out_probs[:, col, :]`; no other column is touched.

Two-stage argmax (vLLM's shape): grid (N, cdiv(V, BLOCK)) computes block maxima, a per-row kernel picks the
first maximal block. One program per row over the vocabulary took 218 us at 8 x 32000 on an H200 versus 41 us
for eager PyTorch (docs/compile-facts.md), so the vocabulary is split over programs. With the out buffers the
second stage is grid (N, cdiv(V, BLOCK)) as well: each program reduces its row's block results (a few dozen
values from L2) and writes its block of probabilities, so a sample into a column is two launches, not three.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .pdl import pdl_enter
from .philox import philox_gumbel_ref, philox_gumbel_tile
from .salts import SALT_DRAFT
from .sampling_filter import filter_logits_ref, keep_filtered, sampling_filter, sampling_filter_ref

DEFAULT_BLOCK = 2048  # tokens per program: 63 blocks at V = 128256, 16 tokens per thread at 4 warps
# Vocabulary blocks a per-row reduction loads at once (NB_POW2, at most this; more blocks loop). Every
# vocabulary of fspec's targets fits one load at DEFAULT_BLOCK (24 blocks at SmolLM2's 49152, 63 at 128256),
# but NB grows with V / block: 2^24 tokens (philox.MAX_VOCAB) at 2048 per block are 8192 blocks, a [8192]
# tile of each of five partials in every program; at a 4-token block 32768.
MAX_REDUCE_BLOCKS = 256
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1 (the vocabulary blocks): the block grows to keep under it


def launch_block(block: int | None) -> int:
    """Tokens per program of the sampling kernels: `block` (a power of two >= 4; benchmarks sweep it through
    the launchers' `block`), else DEFAULT_BLOCK."""
    if block is None:
        return DEFAULT_BLOCK
    if isinstance(block, bool) or not isinstance(block, int) or block < 4 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 4, got {block!r}")
    return block


def vocab_blocks(v: int, block: int) -> tuple[int, int, int]:
    """(BLOCK, NB, NB_POW2) of the sampling launches over V tokens at the asked `block`: the block doubled
    until NB = cdiv(V, BLOCK) fits grid axis 1 (MAX_GRID_Y; only tiny blocks of huge vocabularies need it),
    and the blocks per load of the per-row reductions, next_pow2(NB) capped at MAX_REDUCE_BLOCKS."""
    while triton.cdiv(v, block) > MAX_GRID_Y:
        block *= 2
    nb = triton.cdiv(v, block)
    return block, nb, min(triton.next_power_of_2(max(nb, 1)), MAX_REDUCE_BLOCKS)


def scratch(dtype: torch.dtype, device: torch.device, *shapes: tuple[int, ...]) -> list[Tensor]:
    """Flat buffers with room for the given shapes, carved from one allocation by one `split`: a launcher's
    partial results cost one trip to the caching allocator and one view call instead of one of each per
    buffer (host time that an eager call pays; the kernels see only pointers, so the buffers stay 1-d).
    Each starts on a 16-byte boundary, as Triton's pointer specialisation assumes of a fresh allocation."""
    per = 16 // dtype.itemsize
    sizes = [-(-math.prod(s) // per) * per for s in shapes]
    return list(torch.empty(sum(sizes), dtype=dtype, device=device).split(sizes))


@triton.jit
def softmax_shift(m):
    """The shift for exp(x - shift) given the max m: m itself, or 0 where m is infinite. An all -inf block
    then sums to 0 (exp(-inf - 0)), not NaN; a +inf block's sum is never read (such rows go greedy)."""
    return tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)


FLT_MAX = 3.4028234663852886e38  # the largest float32
_FLT_MAX: tl.constexpr = tl.constexpr(FLT_MAX)


@triton.jit
def inv_temperature(t):
    """The factor logits are scaled by: 1 / T for a sampled row (T > 0), clamped to the largest float32 so
    that a denormal T scales by a finite number, and 1 for a greedy row. Scaling by a product instead of a
    division per token saves ~5 instructions a token (an IEEE division is a short routine on the GPU);
    `inv_temperature_ref` is the same arithmetic, so kernels and references scale identically."""
    return tl.where(t > 0, tl.minimum(1.0 / t, _FLT_MAX), 1.0)


@triton.jit
def block_argmax_offset(
    key,  # float32 [GROUPS, 4] tile: -inf past the vocabulary's end, never NaN
    offs,  # int32 [GROUPS, 4] offsets of key's tokens from the tile's first token (`tile_offsets`)
    start,  # int64 scalar: the tile's first token id (< V: offset 0 is always in the vocabulary)
    BLOCK: tl.constexpr,  # tokens per tile (sentinel offset)
):
    """(max of key, smallest token id attaining it as int64); an all -inf tile gives its first token. The
    search runs over int32 offsets (half the instructions of int64 token ids) and needs no vocabulary mask:
    past the vocabulary keys are -inf, so they can only tie an all -inf tile's maximum, where offset 0 (a
    real token) wins anyway."""
    best = tl.max(tl.max(key, axis=1), axis=0)
    best_off = tl.min(tl.min(tl.where(key == best, offs, BLOCK), axis=1), axis=0)
    return best, start + best_off


@triton.jit
def load_logits_tile(
    ptrs,  # [GROUPS, 4] pointers to the tile's logits (any float dtype)
    offs,  # int32 [GROUPS, 4] offsets from the tile's first token (`tile_offsets`)
    start,  # int64 scalar: the tile's first token id (< V)
    V,  # vocabulary size
    BLOCK: tl.constexpr,  # tokens per tile
    FAST: tl.constexpr,  # GPU launch: NaN masked by max.f32
):
    """float32 logits of a tile, -inf past the vocabulary and for NaN (NaN never wins). Every tile but the
    last loads without a per-token mask; on the GPU max.f32 returns the non-NaN operand (one instruction;
    the interpreter's maximum propagates NaN, so it compares and selects)."""
    if start + BLOCK <= V:
        raw = tl.load(ptrs).to(tl.float32)
    else:
        raw = tl.load(ptrs, mask=offs < (V - start).to(tl.int32), other=float("-inf")).to(tl.float32)
    if FAST:
        return tl.maximum(raw, float("-inf"))
    return tl.where(raw != raw, float("-inf"), raw)


@triton.jit
def tile_offsets(GROUPS: tl.constexpr):
    """int32 [GROUPS, 4] offsets 4 * g + w of a tile's tokens from its first token (four consecutive tokens
    per row, the words of one Philox call). Offsets, not int64 token ids: 32-bit compares, selects and
    reductions cost half the instructions of 64-bit ones."""
    return 4 * tl.arange(0, GROUPS)[:, None] + tl.arange(0, 4)[None, :]


@triton.jit
def _gumbel_block_kernel(
    logits_ptr,  # [N, V] float32/bfloat16/float16, vocabulary stride 1
    stride_row,  # elements between consecutive rows of logits
    temperature_ptr,  # [N] float32, 0 = greedy
    seed_ptr,  # [N] int64 Philox key per row
    positions_ptr,  # [N] int position per row (Philox counter), POS_OFFSET added
    block_key_ptr,  # [N, NB] float32 out: block max of logits / T + noise (logits for greedy rows)
    block_token_ptr,  # [N, NB] int64 out: smallest token id attaining that max
    block_max_ptr,  # [N, NB] float32 out (WITH_STATS): block max of logits / T
    block_sum_ptr,  # [N, NB] float32 out (WITH_STATS): sum of exp(logits / T - block max)
    block_hot_ptr,  # [N, NB] float32 out: the block's max logit if logits / T reaches +inf in it, else -inf
    thr_ptr,  # [N] float32 (FILTER): the kept prefix's last logit (kernels/sampling_filter.py)
    cut_ptr,  # [N] int32 (FILTER): its last token id
    V,  # vocabulary size
    NB,  # number of vocabulary blocks, cdiv(V, BLOCK)
    SALT: tl.constexpr,  # Philox salt of this sampling decision
    WITH_STATS: tl.constexpr,  # also write softmax statistics for the probability write
    BLOCK: tl.constexpr,  # tokens per program, a power of two >= 4
    FAST_LOG: tl.constexpr,  # GPU launch: approximate logs (philox_gumbel_tile), NaN masked by max.f32
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    POS_OFFSET: tl.constexpr = 0,  # added to every position (a draft step passes seq_lens and 1)
    FILTER: tl.constexpr = False,  # drop the tokens outside each row's kept prefix (top_k / top_p / min_p)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    GROUPS: tl.constexpr = BLOCK // 4
    start = blk * BLOCK
    # [GROUPS, 4] tile: four consecutive tokens share one Philox call (kernels/philox.py)
    offs = tile_offsets(GROUPS)
    raw = load_logits_tile(logits_ptr + row * stride_row + start + offs, offs, start, V, BLOCK, FAST_LOG)
    if FILTER:
        raw = keep_filtered(raw, offs, start, tl.load(thr_ptr + row), tl.load(cut_ptr + row))
    t = tl.load(temperature_ptr + row)
    inv_t = inv_temperature(t)  # 1 for greedy rows: their key is the raw logit
    key = raw
    hot = tl.full([], float("-inf"), tl.float32)
    if t > 0:  # greedy rows skip Philox entirely
        seed = tl.load(seed_ptr + row)
        position = tl.load(positions_ptr + row).to(tl.int64) + POS_OFFSET
        key = raw * inv_t + philox_gumbel_tile(seed, position, SALT, start, GROUPS, FAST_LOG)  # one FMA
        # max(logits / T) = max(logits) / T (multiplying by 1 / T > 0 is monotone, rounding included)
        if tl.max(tl.max(raw, axis=1), axis=0) * inv_t == float("inf"):
            # logits / T reaches +inf (a +inf logit, or T small enough to overflow): the row is decided
            # greedily, by its raw logits (the T -> 0 limit); this block competes with its raw maximum
            key = raw
            hot = tl.max(tl.max(raw, axis=1), axis=0)
    best, best_token = block_argmax_offset(key, offs, start, BLOCK)
    tl.store(block_key_ptr + row * NB + blk, best)
    tl.store(block_token_ptr + row * NB + blk, best_token)
    tl.store(block_hot_ptr + row * NB + blk, hot)
    if WITH_STATS:
        x = raw * inv_t
        m = tl.max(tl.max(x, axis=1), axis=0)
        e = tl.exp(x - softmax_shift(m))
        tl.store(block_max_ptr + row * NB + blk, m)
        tl.store(block_sum_ptr + row * NB + blk, tl.sum(tl.sum(e, axis=1), axis=0))


@triton.jit
def _token_chunk(block_key_ptr, block_token_ptr, block_hot_ptr, row, c0, V, NB, NB_POW2: tl.constexpr):
    """Blocks c0 .. c0 + NB_POW2 of a row: (max key, the first maximal block's token, max hot logit, the first
    block's token attaining it). Blocks are ordered, so the smallest id among maximal blocks is the first
    maximal block's token."""
    nb = c0 + tl.arange(0, NB_POW2)
    in_row = nb < NB
    key = tl.load(block_key_ptr + row * NB + nb, mask=in_row, other=float("-inf"))
    tok = tl.load(block_token_ptr + row * NB + nb, mask=in_row, other=V)
    hot = tl.load(block_hot_ptr + row * NB + nb, mask=in_row, other=float("-inf"))
    best = tl.max(key, axis=0)
    token = tl.min(tl.where(in_row & (key == best), tok, V), axis=0)
    hot_best = tl.max(hot, axis=0)
    hot_token = tl.min(tl.where(in_row & (hot == hot_best), tok, V), axis=0)
    return best, token, hot_best, hot_token


@triton.jit
def _row_reduce(
    block_key_ptr, block_token_ptr, block_hot_ptr, block_max_ptr, block_sum_ptr, row, V, NB,
    NB_POW2: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    """(token, m, s) of a row from its blocks' results: the sampled token (int64: the first maximal block's,
    or where logits / T reaches +inf in some block the first raw argmax among those blocks) and, with
    STATS, the max m of logits / T and the sum s of exp(logits / T - m) (else 0, 0).

    NB_POW2 blocks per load. The first load is the whole reduction wherever NB <= NB_POW2 (every target
    vocabulary at the default block), straight-line code with all its loads issued together; further
    blocks (tiny blocks, huge vocabularies) loop, an earlier chunk keeping a tie (its tokens are smaller)
    and the softmax sum rescaled per chunk. (Measured on the H200, B = 1, V = 49152: two loops from the
    first chunk, one per reduction, made a sample into a column 4.0 -> 4.8 us.)"""
    best, token, hot_best, hot_token = _token_chunk(
        block_key_ptr, block_token_ptr, block_hot_ptr, row, 0, V, NB, NB_POW2
    )
    m = tl.zeros([], tl.float32)
    s = tl.zeros([], tl.float32)
    if STATS:
        nb = tl.arange(0, NB_POW2)
        bmax = tl.load(block_max_ptr + row * NB + nb, mask=nb < NB, other=float("-inf"))
        bsum = tl.load(block_sum_ptr + row * NB + nb, mask=nb < NB, other=0.0)
        m = tl.max(bmax, axis=0)
        s = tl.sum(bsum * tl.exp(bmax - softmax_shift(m)), axis=0)
    for c0 in range(NB_POW2, NB, NB_POW2):
        c_best, c_token, c_hot, c_hot_token = _token_chunk(
            block_key_ptr, block_token_ptr, block_hot_ptr, row, c0, V, NB, NB_POW2
        )
        token = tl.where(c_best > best, c_token, token)
        best = tl.maximum(best, c_best)
        hot_token = tl.where(c_hot > hot_best, c_hot_token, hot_token)
        hot_best = tl.maximum(hot_best, c_hot)
        if STATS:
            nb = c0 + tl.arange(0, NB_POW2)
            bmax = tl.load(block_max_ptr + row * NB + nb, mask=nb < NB, other=float("-inf"))
            bsum = tl.load(block_sum_ptr + row * NB + nb, mask=nb < NB, other=0.0)
            m_new = tl.maximum(m, tl.max(bmax, axis=0))
            shift = softmax_shift(m_new)
            s = s * tl.exp(m - shift) + tl.sum(bsum * tl.exp(bmax - shift), axis=0)
            m = m_new
    return tl.where(hot_best > float("-inf"), hot_token, token), m, s


@triton.jit
def _emit(token, row, d2t_ptr, mapped_ptr, MAP: tl.constexpr):
    """The emitted id of `token`: token + d2t[token] (stored to mapped[row]) with MAP, else the token."""
    emitted = token
    if MAP:
        emitted = token + tl.load(d2t_ptr + token).to(tl.int64)
        tl.store(mapped_ptr + row, emitted)
    return emitted


@triton.jit
def _gumbel_reduce_kernel(
    block_key_ptr,  # [N, NB] float32: block maxima of the sampling key
    block_token_ptr,  # [N, NB] int64: their token ids
    block_hot_ptr,  # [N, NB] float32: a block's max logit where logits / T reaches +inf, else -inf
    tokens_ptr,  # [N] int64 out: sampled tokens
    d2t_ptr,  # [V] int32/int64 (MAP): id offsets; the emitted id of token t is t + d2t[t]
    mapped_ptr,  # [N] int64 out (MAP): the emitted ids
    V,  # vocabulary size (sentinel token id)
    NB,  # number of vocabulary blocks
    MAP: tl.constexpr,  # emit t + d2t[t] (EAGLE-3's draft-to-target ids) to mapped
    NB_POW2: tl.constexpr,  # blocks per load: next power of two >= NB, at most MAX_REDUCE_BLOCKS
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    token, _, _ = _row_reduce(
        block_key_ptr, block_token_ptr, block_hot_ptr, block_key_ptr, block_key_ptr, row, V, NB, NB_POW2,
        False,
    )  # fmt: skip
    tl.store(tokens_ptr + row, token)
    _emit(token, row, d2t_ptr, mapped_ptr, MAP)


@triton.jit
def _gumbel_finish_kernel(
    logits_ptr,  # [N, V] float32/bfloat16/float16, vocabulary stride 1
    stride_row,  # elements between consecutive rows of logits
    temperature_ptr,  # [N] float32
    block_key_ptr,  # [N, NB] float32: block maxima of the sampling key
    block_token_ptr,  # [N, NB] int64: their token ids
    block_max_ptr,  # [N, NB] float32: block max of logits / T
    block_sum_ptr,  # [N, NB] float32: block sum of exp(logits / T - block max)
    block_hot_ptr,  # [N, NB] float32: a block's max logit where logits / T reaches +inf, else -inf
    tokens_ptr,  # [N] int64 out: sampled tokens
    out_tokens_ptr,  # [N, K] int64 out: column col receives the (emitted) tokens
    out_probs_ptr,  # [N, K, V] float32 out: column col receives the processed probabilities
    col_ptr,  # [] int64: the column, loaded here, never a Python int
    next_col_ptr,  # [] int64 out (NEXT_COL): col + 1 (a draft step's next step counter)
    d2t_ptr,  # [V] int32/int64 (MAP): id offsets; the emitted id of token t is t + d2t[t]
    mapped_ptr,  # [N] int64 out (MAP): the emitted ids
    thr_ptr,  # [N] float32 (FILTER): the kept prefix's last logit (kernels/sampling_filter.py)
    cut_ptr,  # [N] int32 (FILTER): its last token id
    V,  # vocabulary size
    NB,  # number of vocabulary blocks
    K,  # columns of out_tokens and out_probs
    MAP: tl.constexpr,  # emit t + d2t[t] to mapped and out_tokens
    NEXT_COL: tl.constexpr,  # write col + 1 to next_col
    NB_POW2: tl.constexpr,  # blocks per load: next power of two >= NB, at most MAX_REDUCE_BLOCKS
    BLOCK: tl.constexpr,  # tokens per program
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    FILTER: tl.constexpr = False,  # drop the tokens outside each row's kept prefix: p' is 0 there
):
    pdl_enter(PDL)
    # Reduction and probability write in one launch, grid (N, NB): every program reduces its row's block
    # results itself (NB values from L2: the token, for greedy rows' one-hot, and the softmax statistics)
    # and writes its block of out_probs[:, col]; block 0 also writes the token, and program (0, 0) col + 1.
    # One launch instead of a per-row reduction followed by the probability write: on a draft step's
    # dependent chain each launch costs ~1-1.5 us on the H200 (benchmarks/results/timelines/).
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    # the block's logits first: their load does not wait for the row's reduction
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    t = tl.load(temperature_ptr + row)
    col = tl.load(col_ptr)
    token, m, s = _row_reduce(
        block_key_ptr, block_token_ptr, block_hot_ptr, block_max_ptr, block_sum_ptr, row, V, NB, NB_POW2, True
    )
    if blk == 0:
        tl.store(tokens_ptr + row, token)
        tl.store(out_tokens_ptr + row * K + col, _emit(token, row, d2t_ptr, mapped_ptr, MAP))
        if NEXT_COL and row == 0:
            tl.store(next_col_ptr, col + 1)
    x = tl.where(x != x, float("-inf"), x)
    if FILTER:
        x = keep_filtered(x, offs, 0, tl.load(thr_ptr + row), tl.load(cut_ptr + row))
    one_hot = tl.where(offs == token, 1.0, 0.0)
    # greedy rows, rows without a finite logit, rows whose logits / T reach +inf: the one-hot of their token
    soft = (t > 0) & (m > float("-inf")) & (m < float("inf"))
    # exp(-inf) = 0 where the one-hot is used: no overflow in greedy rows, no -inf - -inf in dead rows
    z = tl.where(soft, x * inv_temperature(t) - tl.where(soft, m, 0.0), float("-inf"))
    p = tl.exp(z) * (1.0 / tl.where(soft, s, 1.0))
    tl.store(out_probs_ptr + (row * K + col) * V + offs, tl.where(soft, p, one_hot), mask=valid)


def gumbel_sample(
    logits: Tensor,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    *,
    salt: int = SALT_DRAFT,
    out_tokens: Tensor | None = None,
    out_probs: Tensor | None = None,
    col: Tensor | None = None,
    d2t: Tensor | None = None,
    block: int | None = None,
    position_offset: int = 0,
    next_col: Tensor | None = None,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    """Launch the Gumbel kernels; returns tokens [N] int64 and, with out buffers, writes column `col`.

    Inputs are assumed validated (fspec.ops.sampling.gumbel_sample checks them); out_tokens [N, K] and
    out_probs [N, K, V] must be contiguous. With `d2t` [V] (int offsets) the returned ids and out_tokens'
    column are t + d2t[t] (EAGLE-3's target ids; out_probs stays over the sampled vocabulary). `block` is a
    power of two >= 4 (None: `launch_block`). The Philox counter of row r is positions[r] + position_offset
    (positions of any integer dtype). With the out buffers, `next_col` (0-d int64, or None: not written)
    receives col + 1. Two launches: the block kernel, then the per-row reduction or, with the out
    buffers, the reduction and probability write in one (`_gumbel_finish_kernel`). With `top_k`, `top_p`,
    `min_p` ([N] each, all three or none) a `sampling_filter` launch first: the tokens are drawn from p' and
    out_probs receives p' (kernels/sampling_filter.py).
    """
    n, v = logits.shape
    block, nb, nb_load = vocab_blocks(v, launch_block(block))
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # per-row inputs are read at ptr + row: a strided or expanded view must become a real [N] tensor
    temperature, seed, positions = temperature.contiguous(), seed.contiguous(), positions.contiguous()
    into = out_tokens is not None
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    mapped = tokens if d2t is None else torch.empty_like(tokens)
    if n == 0:
        if next_col is not None:
            next_col.copy_(col + 1)
        return mapped
    (block_token,) = scratch(torch.int64, logits.device, (n, nb))
    if into:
        block_key, block_hot, block_max, block_sum = scratch(torch.float32, logits.device, *[(n, nb)] * 4)
    else:  # the statistics' pointers are never followed
        block_key, block_hot = scratch(torch.float32, logits.device, (n, nb), (n, nb))
        block_max = block_sum = block_key
    launch = pdl.options(logits)  # one device check for the call's launches
    filtered = top_k is not None
    thr, cut = sampling_filter(logits, temperature, top_k, top_p, min_p) if filtered else (tokens, tokens)
    _gumbel_block_kernel[(n, nb)](
        logits, logits.stride(0), temperature, seed, positions, block_key, block_token, block_max,
        block_sum, block_hot, thr, cut, v, nb, SALT=salt, WITH_STATS=into, BLOCK=block,
        FAST_LOG=logits.is_cuda, POS_OFFSET=position_offset, FILTER=filtered, **launch,
    )  # fmt: skip
    d2t_arg = tokens if d2t is None else d2t.contiguous()
    if into:
        _gumbel_finish_kernel[(n, nb)](
            logits, logits.stride(0), temperature, block_key, block_token, block_max, block_sum, block_hot,
            tokens, out_tokens, out_probs, col, col if next_col is None else next_col, d2t_arg, mapped,
            thr, cut, v, nb, out_tokens.shape[1], MAP=d2t is not None, NEXT_COL=next_col is not None,
            NB_POW2=nb_load, BLOCK=block, FILTER=filtered, **launch,
        )  # fmt: skip
    else:
        _gumbel_reduce_kernel[(n,)](
            block_key, block_token, block_hot, tokens, d2t_arg, mapped, v, nb, MAP=d2t is not None,
            NB_POW2=nb_load, **launch,
        )  # fmt: skip
    return mapped


# ----------------------------------------------------------------------------------------------------------
# PyTorch reference (same Philox noise: CPU and GPU agree token for token on the same fp32 logits)
# ----------------------------------------------------------------------------------------------------------


def inv_temperature_ref(temperature: Tensor) -> Tensor:
    """`inv_temperature` of float32 temperatures [...]: 1 / T (at most the largest float32) where T > 0,
    else 1."""
    return torch.where(temperature > 0, (1.0 / temperature).clamp(max=FLT_MAX), 1.0)


def clean_logits_ref(logits: Tensor) -> Tensor:
    """float32 copy of `logits` with NaN replaced by -inf."""
    x = logits.float()
    return torch.where(torch.isnan(x), float("-inf"), x)


def first_argmax_ref(x: Tensor) -> Tensor:
    """Index of the maximum over the last dim, smallest index on ties (all -inf -> 0). int64 [...]."""
    ids = torch.arange(x.shape[-1], device=x.device)
    hit = x == x.amax(dim=-1, keepdim=True)
    return torch.where(hit, ids, x.shape[-1]).amin(dim=-1)


def softmax_ref(scaled: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(probs, row max, row sum) of softmax over the last dim; an all -inf row: max -inf, sum 0, NaN."""
    m = scaled.amax(dim=-1, keepdim=True)
    e = torch.exp(scaled - torch.where(m == float("-inf"), 0.0, m))
    s = e.sum(dim=-1, keepdim=True)
    return e * (1.0 / s), m.squeeze(-1), s.squeeze(-1)  # one reciprocal per row, as the kernels do


def gumbel_sample_ref(
    logits: Tensor,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    *,
    salt: int = SALT_DRAFT,
    out_tokens: Tensor | None = None,
    out_probs: Tensor | None = None,
    col: Tensor | None = None,
    d2t: Tensor | None = None,
    position_offset: int = 0,
    next_col: Tensor | None = None,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    """Plain-PyTorch twin of `gumbel_sample` (same noise, ties, NaN handling, id map, column write, position
    offset, col + 1 into `next_col`, and the options' kept prefix)."""
    positions = positions.to(torch.int64) + position_offset
    if top_k is None:
        x = clean_logits_ref(logits)  # [N, V]
    else:  # the tokens outside the kept prefix are -inf: p' and its samples
        x = filter_logits_ref(logits, *sampling_filter_ref(logits, temperature, top_k, top_p, min_p))
    scaled = x * inv_temperature_ref(temperature)[:, None]
    # rows whose logits / T reach +inf are decided greedily, by the raw logits (the T -> 0 limit)
    sampled = ((temperature > 0) & (scaled.amax(-1) < float("inf")))[:, None]  # [N, 1]
    noise = philox_gumbel_ref(seed, positions, x.shape[-1], salt)  # [N, V]
    tokens = first_argmax_ref(torch.where(sampled, scaled + noise, x))  # [N]
    emitted = tokens if d2t is None else tokens + d2t[tokens].to(torch.int64)
    if out_tokens is not None:
        probs, m, _ = softmax_ref(scaled)
        one_hot = torch.nn.functional.one_hot(tokens, x.shape[-1]).float()
        probs = torch.where(sampled & (m > float("-inf"))[:, None], probs, one_hot)  # [N, V]
        out_tokens.index_copy_(1, col.view(1), emitted[:, None])
        out_probs.index_copy_(1, col.view(1), probs[:, None, :])
        if next_col is not None:
            next_col.copy_(col + 1)
    return emitted
