"""Lossless rejection sampling of K draft tokens against the target (p = target, q = draft).

For draft k (at position positions[b] + k): accept x_k iff u_k * q(x_k) < p(x_k), i.e. u_k < p/q without a
division (u_k = Philox uniform, salt SALT_ACCEPT; greedy drafts have q one-hot, so accept iff u_k < p(x_k)).
At the first rejection emit a sample of norm(max(p - q, 0)) (Gumbel-max over log of the residual, salt
SALT_RESIDUAL, keyed at the rejected slot's position) and stop; if the residual has no mass (p == q), sample
from p with the same noise instead. If all K are accepted, emit a bonus token from p at slot K (salt
SALT_BONUS, position positions[b] + K). Greedy target (T = 0): accept iff argmax p == x_k, and the
replacement / bonus is argmax p. Output: tokens [B, K+1] = accepted drafts, the replacement or bonus, then -1;
num_accepted [B] in [0, K].

NaN target logits count as -inf; a target row without any finite logit is a one-hot at token 0 (as in
`gumbel_sample`). A slot whose logits / T reach +inf (a +inf logit, or an overflowing temperature) verifies
greedily: p there is the T -> 0 limit, a point mass at the first argmax of the raw logits (no NaN reaches the
comparison). The public `fspec.rejection_sample` refuses such inputs; compiled callers get this instead.
Draft token ids are clamped into [0, V) for memory safety; validation happens upstream.

Four launches, none per k on the host: softmax statistics per (slot, vocabulary block); one program per
request reduces them and walks k with fixed-shape masks to the first rejection n (acceptance needs only
p(x_k) and q(x_k)); the residual / bonus Gumbel block maxima of slot n alone (only that slot is ever emitted,
so one logits row and one q row per request are read a second time, not K + 1 and K); one program per
request picks slot n's token.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .gumbel import (
    block_argmax_offset,
    clean_logits_ref,
    first_argmax_ref,
    inv_temperature,
    inv_temperature_ref,
    launch_block,
    load_logits_tile,
    scratch,
    softmax_ref,
    softmax_shift,
    tile_offsets,
    vocab_blocks,
)
from .pdl import pdl_enter
from .philox import log_abs, philox_gumbel_ref, philox_gumbel_tile, philox_offset, philox_uniform_ref
from .salts import SALT_ACCEPT, SALT_BONUS, SALT_RESIDUAL
from .sampling_filter import filter_logits_ref, keep_filtered, sampling_filter, sampling_filter_ref

# The decide kernel's tiles: slots per load (K1_POW2: next_pow2(K + 1), at most MAX_DECIDE_SLOTS; more slots
# loop) and [K1_POW2, NB_POW2] block partials per load (at most MAX_DECIDE_TILE). A config's K <= 16 and any
# target's vocabulary at the default block fit one load; the public `fspec.rejection_sample` takes any K.
MAX_DECIDE_SLOTS = 32
MAX_DECIDE_TILE = 2048


def decide_tiles(k1: int, nb_load: int) -> tuple[int, int]:
    """(K1_POW2, NB_POW2) of the decide kernel for K + 1 slots, given the per-row reductions' blocks per
    load (`vocab_blocks`' third value)."""
    k1_pow2 = min(triton.next_power_of_2(k1), MAX_DECIDE_SLOTS)
    return k1_pow2, min(nb_load, max(1, MAX_DECIDE_TILE // k1_pow2))


_SALT_ACCEPT: tl.constexpr = tl.constexpr(SALT_ACCEPT)
_SALT_RESIDUAL: tl.constexpr = tl.constexpr(SALT_RESIDUAL)
_SALT_BONUS: tl.constexpr = tl.constexpr(SALT_BONUS)


@triton.jit
def _one_hot_if_degenerate(
    x,  # float32 block: logits / T of one row
    is_token0,  # bool block: x's token id is 0
    m,  # float32 scalar or block: row max of logits / T
    s,  # float32 scalar or block: row sum of exp(logits / T - m)
):
    """A row without any finite logit (max -inf) becomes logits 0 at token 0 and -inf elsewhere."""
    degenerate = m == float("-inf")
    x = tl.where(degenerate, tl.where(is_token0, 0.0, float("-inf")), x)
    return x, tl.where(degenerate, 0.0, m), tl.where(degenerate, 1.0, s)


@triton.jit
def _rejection_stats_kernel(
    logits_ptr,  # [B, K+1, V] float32/bfloat16/float16, vocabulary stride 1
    stride_b,  # elements between requests of logits
    stride_k,  # elements between slots of logits
    temperature_ptr,  # [B] float32, 0 = greedy target
    block_max_ptr,  # [R, NB] float32 out (R = B * (K+1)): block max of logits / T (logits if greedy)
    block_sum_ptr,  # [R, NB] float32 out: sum of exp(logits / T - block max)
    block_token_ptr,  # [R, NB] int64 out: smallest token id attaining the block's max raw logit
    block_raw_ptr,  # [R, NB] float32 out: the block's max raw logit
    thr_ptr,  # [R] float32 (FILTER): the kept prefix's last logit (kernels/sampling_filter.py)
    cut_ptr,  # [R] int32 (FILTER): its last token id
    V,  # vocabulary size
    NB,  # vocabulary blocks, cdiv(V, BLOCK)
    K1,  # K + 1 slots per request
    BLOCK: tl.constexpr,  # tokens per program
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    FILTER: tl.constexpr = False,  # p' of top_k / top_p / min_p: the kept prefix only
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    b = row // K1
    token = blk * BLOCK + tl.arange(0, BLOCK)
    valid = token < V
    raw = tl.load(logits_ptr + b * stride_b + (row % K1) * stride_k + token, mask=valid, other=float("-inf"))
    raw = raw.to(tl.float32)
    raw = tl.where(raw != raw, float("-inf"), raw)
    if FILTER:
        raw = keep_filtered(raw, token, 0, tl.load(thr_ptr + row), tl.load(cut_ptr + row))
    t = tl.load(temperature_ptr + b)
    x = raw * inv_temperature(t)
    m = tl.max(x, axis=0)
    e = tl.exp(x - softmax_shift(m))
    tl.store(block_max_ptr + row * NB + blk, m)
    tl.store(block_sum_ptr + row * NB + blk, tl.sum(e, axis=0))
    # the argmax of the raw logits: what greedy targets, and rows whose logits / T reach +inf, take
    mr = tl.max(raw, axis=0)
    tl.store(block_raw_ptr + row * NB + blk, mr)
    tl.store(block_token_ptr + row * NB + blk, tl.min(tl.where(valid & (raw == mr), token, V), axis=0))


@triton.jit
def _rejection_residual_kernel(
    logits_ptr,  # [B, K+1, V] float32/bfloat16/float16, vocabulary stride 1
    stride_b,  # elements between requests of logits
    stride_k,  # elements between slots of logits
    draft_tokens_ptr,  # [B, K] int64
    draft_probs_ptr,  # [B, K, V] float32 q (HAS_Q; otherwise q is the one-hot of the draft token)
    temperature_ptr,  # [B] float32
    seed_ptr,  # [B] int64
    positions_ptr,  # [B] int64: position of draft 0; slot k sits at positions[b] + k
    row_max_ptr,  # [R] float32: max of logits / T, -inf for a row without finite logits
    row_sum_ptr,  # [R] float32: sum of exp(logits / T - row max)
    num_accepted_ptr,  # [B] int64: n, the one slot of request b that is sampled (decide kernel)
    res_key_ptr,  # [B, NB] float32 out (sampled slots only): block max of log(max(p - q, 0)) + g
    res_token_ptr,  # [B, NB] int64 out: its token id
    res_mass_ptr,  # [B, NB] float32 out: block max of max(p - q, 0); 0 = no residual mass
    p_key_ptr,  # [B, NB] float32 out: block max of logits / T + g (fallback for n < K, bonus for n = K)
    p_token_ptr,  # [B, NB] int64 out: its token id
    thr_ptr,  # [R] float32 (FILTER): the kept prefix's last logit (kernels/sampling_filter.py)
    cut_ptr,  # [R] int32 (FILTER): its last token id
    V,  # vocabulary size
    NB,  # vocabulary blocks
    K,  # draft tokens per request
    HAS_Q: tl.constexpr,  # draft_probs given (sampled drafts)
    BLOCK: tl.constexpr,  # tokens per program, a power of two >= 4
    FAST_LOG: tl.constexpr,  # GPU launch: approximate logs where only absolute error matters, NaN by max.f32
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    FILTER: tl.constexpr = False,  # p' of top_k / top_p / min_p: the kept prefix only
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    # Only slot n = the first rejection (or K: the bonus) is ever emitted, so only its row is read: one
    # logits row and one q row per request instead of K + 1 and K.
    k = tl.load(num_accepted_ptr + b)
    row = b * (K + 1) + k
    GROUPS: tl.constexpr = BLOCK // 4
    start = blk * BLOCK
    offs = tile_offsets(GROUPS)  # [GROUPS, 4] int32: token = start + offs
    is_draft = k < K
    t = tl.load(temperature_ptr + b)
    # Greedy targets (T = 0) need none of this: the finalize kernel takes their argmax, so skip the pass
    # (no logits, q or Philox traffic for greedy verification). So do slots whose logits / T reach +inf:
    # they verify greedily too. The finalize kernel reads this kernel's outputs only where they were written.
    if (t > 0) & (tl.load(row_max_ptr + row) < float("inf")):
        salt = tl.where(is_draft, _SALT_RESIDUAL, _SALT_BONUS).to(tl.int64)
        seed, position = tl.load(seed_ptr + b), tl.load(positions_ptr + b) + k
        noise = philox_gumbel_tile(seed, position, salt, start, GROUPS, FAST_LOG)
        x_ptrs = logits_ptr + b * stride_b + k * stride_k + start + offs
        x = load_logits_tile(x_ptrs, offs, start, V, BLOCK, FAST_LOG)
        if FILTER:
            x = keep_filtered(x, offs, start, tl.load(thr_ptr + row), tl.load(cut_ptr + row))
        x = x * inv_temperature(t)
        row_max, row_sum = tl.load(row_max_ptr + row), tl.load(row_sum_ptr + row)
        x, m, s = _one_hot_if_degenerate(x, (offs == 0) & (start == 0), row_max, row_sum)
        p = tl.exp(x - m) * (1.0 / s)  # [GROUPS, 4]
        if HAS_Q:
            q_ptrs = draft_probs_ptr + (b * K + k) * V + start + offs
            if start + BLOCK <= V:  # every block but the last: no per-token mask
                q = tl.load(q_ptrs, mask=is_draft, other=0.0)
            else:
                q = tl.load(q_ptrs, mask=(offs < (V - start).to(tl.int32)) & is_draft, other=0.0)
        else:
            x_k = tl.load(draft_tokens_ptr + b * K + k, mask=is_draft, other=0)
            q = tl.where(offs == (tl.minimum(tl.maximum(x_k, 0), V - 1) - start).to(tl.int32), 1.0, 0.0)
        r = tl.maximum(p - q, 0.0)  # residual max(p - q, 0); with one-hot q: p without x_k
        res_key = tl.where(r > 0, log_abs(tl.where(r > 0, r, 1.0), FAST_LOG), float("-inf")) + noise
        res_best, res_token = block_argmax_offset(res_key, offs, start, BLOCK)
        p_best, p_token = block_argmax_offset(x + noise, offs, start, BLOCK)
        out = b * NB + blk
        tl.store(res_key_ptr + out, res_best)
        tl.store(res_token_ptr + out, res_token)
        tl.store(res_mass_ptr + out, tl.max(tl.max(r, axis=1), axis=0))
        tl.store(p_key_ptr + out, p_best)
        tl.store(p_token_ptr + out, p_token)


@triton.jit
def _rejection_decide_kernel(
    logits_ptr,  # [B, K+1, V] float32/bfloat16/float16, vocabulary stride 1
    stride_b,  # elements between requests of logits
    stride_k,  # elements between slots of logits
    draft_tokens_ptr,  # [B, K] int64
    draft_probs_ptr,  # [B, K, V] float32 q (HAS_Q)
    temperature_ptr,  # [B] float32
    seed_ptr,  # [B] int64
    positions_ptr,  # [B] int64: position of draft 0
    block_max_ptr,  # [R, NB] float32: block max of logits / T
    block_sum_ptr,  # [R, NB] float32: block sum of exp(logits / T - block max)
    block_token_ptr,  # [R, NB] int64: block argmax of the raw logits
    block_raw_ptr,  # [R, NB] float32: block max of the raw logits
    row_max_ptr,  # [R] float32 out: max of logits / T (-inf for a row without finite logits)
    row_sum_ptr,  # [R] float32 out: sum of exp(logits / T - row max) (0 for such a row)
    greedy_ptr,  # [R] int64 out: argmax of the row's raw logits, smallest id on ties (0 for such a row)
    tokens_ptr,  # [B, K+1] int64 out: accepted drafts, then -1 (slot n is written by the finalize kernel)
    num_accepted_ptr,  # [B] int64 out: n = accepted drafts, 0..K (the slot the residual pass samples)
    thr_ptr,  # [R] float32 (FILTER): the kept prefix's last logit (kernels/sampling_filter.py)
    cut_ptr,  # [R] int32 (FILTER): its last token id
    V,  # vocabulary size (sentinel token id)
    NB,  # vocabulary blocks
    K,  # draft tokens per request
    HAS_Q: tl.constexpr,  # draft_probs given (sampled drafts)
    K1_POW2: tl.constexpr,  # slots per load: next power of two >= K + 1, at most MAX_DECIDE_SLOTS
    NB_POW2: tl.constexpr,  # blocks per load: next power of two >= NB, capped (`decide_tiles`)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    FILTER: tl.constexpr = False,  # p' of top_k / top_p / min_p: p'(x_k) = 0 outside the kept prefix
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature_ptr + b)
    seed, position = tl.load(seed_ptr + b), tl.load(positions_ptr + b)
    # K1_POW2 slots at a time (one iteration for every config's K): slot k is accepted-and-kept iff no
    # rejection comes before it, which only slots of this and earlier chunks decide, so each chunk writes
    # its tokens with the first rejection seen so far.
    n = tl.zeros([], tl.int64) + K  # first rejection so far (K: none)
    for k0 in range(0, K + 1, K1_POW2):
        kk = k0 + tl.arange(0, K1_POW2).to(tl.int64)  # slot index k
        in_row = kk < K + 1
        is_draft = kk < K
        rows = b * (K + 1) + kk  # [K1_POW2]
        # the drafts' own values first: their loads do not wait for the statistics
        x = tl.load(draft_tokens_ptr + b * K + kk, mask=is_draft, other=-1)
        xc = tl.minimum(tl.maximum(x, 0), V - 1)
        lx = tl.load(logits_ptr + b * stride_b + kk * stride_k + xc, mask=is_draft, other=float("-inf"))
        if HAS_Q:
            q_x = tl.load(draft_probs_ptr + (b * K + kk) * V + xc, mask=is_draft, other=1.0)
        else:
            q_x = tl.full([K1_POW2], 1.0, tl.float32)
        # 1. Each slot's softmax statistics and raw argmax, from the stats kernel's block partials.
        m, s, greedy = _slot_stats(
            block_max_ptr, block_sum_ptr, block_token_ptr, block_raw_ptr, rows, in_row, V, NB, K1_POW2,
            NB_POW2,
        )  # fmt: skip
        tl.store(row_max_ptr + rows, m, mask=in_row)
        tl.store(row_sum_ptr + rows, s, mask=in_row)
        tl.store(greedy_ptr + rows, greedy, mask=in_row)
        # a slot whose logits / T reach +inf is a greedy slot (the T -> 0 limit of p: a point mass)
        sampled = ((tl.zeros([K1_POW2], tl.float32) + t) > 0) & (m < float("inf"))  # [K1_POW2]
        # 2. Acceptance: u_k * q(x_k) < p(x_k) (no division); greedy target: argmax p == x_k.
        lx = lx.to(tl.float32)
        lx = tl.where(lx != lx, float("-inf"), lx)
        if FILTER:
            thr = tl.load(thr_ptr + rows, mask=in_row, other=float("-inf"))
            cut = tl.load(cut_ptr + rows, mask=in_row, other=0)
            lx = tl.where((lx > thr) | ((lx == thr) & (xc <= cut)), lx, float("-inf"))
        lx = lx * inv_temperature(t)
        lx, m, s = _one_hot_if_degenerate(lx, xc == 0, m, tl.where(in_row, s, 1.0))
        p_x = tl.exp(lx - m) / s
        u = tl.rand(seed, philox_offset(position + kk, 0, _SALT_ACCEPT))
        accept = tl.where(sampled, u * q_x < p_x, greedy == x)
        # 3. n = index of the first rejection (K if none): drafts before it, -1 after it; slot n comes later.
        n = tl.minimum(n, tl.min(tl.where(is_draft & (accept == 0), kk, K), axis=0))
        tl.store(tokens_ptr + b * (K + 1) + kk, tl.where(kk < n, x, -1), mask=in_row)
    tl.store(num_accepted_ptr + b, n)


@triton.jit
def _slot_partials(block_max_ptr, block_sum_ptr, block_token_ptr, block_raw_ptr, rows, in_row, c0, V, NB,
                   NB_POW2: tl.constexpr):  # fmt: skip
    """Blocks c0 .. c0 + NB_POW2 of slots `rows`: [K1_POW2, NB_POW2] tiles (block max of logits / T, block
    sums, block max raw logit) and [K1_POW2] (raw max, the first block's token attaining it)."""
    nb = c0 + tl.arange(0, NB_POW2)
    at = rows[:, None] * NB + nb[None, :]  # [K1_POW2, NB_POW2]
    live = in_row[:, None] & (nb[None, :] < NB)
    bmax = tl.load(block_max_ptr + at, mask=live, other=float("-inf"))
    bsum = tl.load(block_sum_ptr + at, mask=live, other=0.0)
    braw = tl.load(block_raw_ptr + at, mask=live, other=float("-inf"))
    btok = tl.load(block_token_ptr + at, mask=live, other=V)
    mr = tl.max(braw, axis=1)
    # all blocks -inf: every block matches and block 0 starts at token 0
    greedy = tl.min(tl.where(live & (braw == mr[:, None]), btok, V), axis=1)
    return bmax, bsum, mr, greedy


@triton.jit
def _slot_stats(
    block_max_ptr,  # [R, NB] float32: block max of logits / T
    block_sum_ptr,  # [R, NB] float32: block sum of exp(logits / T - block max)
    block_token_ptr,  # [R, NB] int64: block argmax of the raw logits
    block_raw_ptr,  # [R, NB] float32: block max of the raw logits
    rows,  # [K1_POW2] int64 slots (rows of the partials)
    in_row,  # [K1_POW2] live slots
    V,  # vocabulary size (sentinel token id)
    NB,  # vocabulary blocks
    K1_POW2: tl.constexpr,
    NB_POW2: tl.constexpr,  # blocks per load
):
    """(max of logits / T, sum of exp(logits / T - max), first raw argmax) per slot [K1_POW2], NB_POW2
    blocks per load: the first load straight-line (the whole reduction wherever NB <= NB_POW2), further
    blocks looping with the running sum rescaled and an earlier chunk keeping an argmax tie."""
    bmax, bsum, mr, greedy = _slot_partials(
        block_max_ptr, block_sum_ptr, block_token_ptr, block_raw_ptr, rows, in_row, 0, V, NB, NB_POW2
    )
    m = tl.max(bmax, axis=1)  # [K1_POW2]
    s = tl.sum(bsum * tl.exp(bmax - softmax_shift(m)[:, None]), axis=1)
    for c0 in range(NB_POW2, NB, NB_POW2):
        bmax, bsum, c_mr, c_greedy = _slot_partials(
            block_max_ptr, block_sum_ptr, block_token_ptr, block_raw_ptr, rows, in_row, c0, V, NB, NB_POW2
        )
        m_new = tl.maximum(m, tl.max(bmax, axis=1))
        shift = softmax_shift(m_new)
        s = s * tl.exp(m - shift) + tl.sum(bsum * tl.exp(bmax - shift[:, None]), axis=1)
        m = m_new
        greedy = tl.where(c_mr > mr, c_greedy, greedy)
        mr = tl.maximum(mr, c_mr)
    return m, s, greedy


@triton.jit
def _rejection_finalize_kernel(
    temperature_ptr,  # [B] float32
    row_max_ptr,  # [R] float32: max of logits / T
    greedy_ptr,  # [R] int64: argmax of each row's raw logits
    res_key_ptr,  # [B, NB] float32: residual Gumbel block maxima at slot n
    res_token_ptr,  # [B, NB] int64: their tokens
    res_mass_ptr,  # [B, NB] float32: block max of the residual at slot n
    p_key_ptr,  # [B, NB] float32: block maxima of logits / T + g at slot n
    p_token_ptr,  # [B, NB] int64: their tokens
    tokens_ptr,  # [B, K+1] int64 out: slot n receives the replacement or the bonus
    num_accepted_ptr,  # [B] int64: n
    V,  # vocabulary size (sentinel token id)
    NB,  # vocabulary blocks
    K,  # draft tokens per request
    NB_POW2: tl.constexpr,  # blocks per load: next power of two >= NB, at most gumbel.MAX_REDUCE_BLOCKS
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_accepted_ptr + b)
    row = b * (K + 1) + n
    t = tl.load(temperature_ptr + b)
    greedy = tl.load(greedy_ptr + row)
    token = greedy
    if (t > 0) & (tl.load(row_max_ptr + row) < float("inf")):  # the residual kernel sampled this slot
        # NB_POW2 blocks per load: the first straight-line (all of them at every target's vocabulary), more
        # looping, an earlier chunk keeping a tie
        res_best, res_tok, mass, p_best, p_tok = _sample_chunk(
            res_key_ptr, res_token_ptr, res_mass_ptr, p_key_ptr, p_token_ptr, b, 0, V, NB, NB_POW2
        )
        for c0 in range(NB_POW2, NB, NB_POW2):
            c_res, c_res_tok, c_mass, c_p, c_p_tok = _sample_chunk(
                res_key_ptr, res_token_ptr, res_mass_ptr, p_key_ptr, p_token_ptr, b, c0, V, NB, NB_POW2
            )
            res_tok = tl.where(c_res > res_best, c_res_tok, res_tok)
            res_best = tl.maximum(res_best, c_res)
            mass = tl.maximum(mass, c_mass)
            p_tok = tl.where(c_p > p_best, c_p_tok, p_tok)
            p_best = tl.maximum(p_best, c_p)
        # a rejected draft takes the residual sample (p itself without residual mass); all accepted: bonus
        token = tl.where((n < K) & (mass > 0), res_tok, p_tok)
    tl.store(tokens_ptr + b * (K + 1) + n, token)


@triton.jit
def _sample_chunk(res_key_ptr, res_token_ptr, res_mass_ptr, p_key_ptr, p_token_ptr, b, c0, V, NB,
                  NB_POW2: tl.constexpr):  # fmt: skip
    """Blocks c0 .. c0 + NB_POW2 of request b's slot n: (max residual key, its first token, max residual
    mass, max key of p, its first token)."""
    nb = c0 + tl.arange(0, NB_POW2)
    live = nb < NB
    res_key = tl.load(res_key_ptr + b * NB + nb, mask=live, other=float("-inf"))
    res_tok = tl.load(res_token_ptr + b * NB + nb, mask=live, other=V)
    mass = tl.max(tl.load(res_mass_ptr + b * NB + nb, mask=live, other=0.0), axis=0)
    p_key = tl.load(p_key_ptr + b * NB + nb, mask=live, other=float("-inf"))
    p_tok = tl.load(p_token_ptr + b * NB + nb, mask=live, other=V)
    res_best = tl.max(res_key, axis=0)
    p_best = tl.max(p_key, axis=0)
    res_tok = tl.min(tl.where(live & (res_key == res_best), res_tok, V), axis=0)
    p_tok = tl.min(tl.where(live & (p_key == p_best), p_tok, V), axis=0)
    return res_best, res_tok, mass, p_best, p_tok


def rejection_sample(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    *,
    block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the rejection-sampling kernels: (tokens [B, K+1] int64, num_accepted [B] int64).

    Inputs are assumed validated (fspec.ops.verify.rejection_sample checks them). `block` is a power of two >=
    4 (None: `launch_block`). With `top_k`, `top_p`, `min_p` ([B] each, all three or none) a
    `sampling_filter` launch first, and every slot verifies against the target's processed p' (q' is
    draft_probs as given, or the one-hot of a greedy draft).
    """
    b, k1, v = target_logits.shape
    block, nb, nb_load = vocab_blocks(v, launch_block(block))
    k = k1 - 1
    dev = target_logits.device
    if target_logits.stride(-1) != 1:
        target_logits = target_logits.contiguous()
    draft_tokens = draft_tokens.contiguous()
    temperature, seed, positions = temperature.contiguous(), seed.contiguous(), positions.contiguous()
    has_q = draft_probs is not None
    draft_probs = draft_probs.contiguous() if has_q else draft_tokens  # dummy pointer when q is one-hot
    tokens = torch.empty((b, k1), dtype=torch.int64, device=dev)
    num_accepted = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0:
        return tokens, num_accepted
    r = b * k1
    k1_pow2, decide_nb = decide_tiles(k1, nb_load)
    # scratch: per (slot, block) statistics; per (request, block) results of the one sampled slot; per slot
    block_max, block_sum, block_raw, res_key, res_mass, p_key, row_max, row_sum = scratch(
        torch.float32, dev, *[(r, nb)] * 3, *[(b, nb)] * 3, (r,), (r,)
    )
    block_token, res_token, p_token, greedy = scratch(torch.int64, dev, (r, nb), (b, nb), (b, nb), (r,))
    sb, sk = target_logits.stride(0), target_logits.stride(1)
    launch = pdl.options(target_logits)  # one device check for the call's launches
    filtered = top_k is not None
    thr, cut = (tokens, tokens)  # dummy pointers without options
    if filtered:
        thr, cut = sampling_filter(target_logits, temperature, top_k, top_p, min_p, k1)
    _rejection_stats_kernel[(r, nb)](
        target_logits, sb, sk, temperature, block_max, block_sum, block_token, block_raw, thr, cut, v, nb,
        k1, BLOCK=block, FILTER=filtered,
        **launch,
    )  # fmt: skip
    _rejection_decide_kernel[(b,)](
        target_logits, sb, sk, draft_tokens, draft_probs, temperature, seed, positions, block_max, block_sum,
        block_token, block_raw, row_max, row_sum, greedy, tokens, num_accepted, thr, cut, v, nb, k,
        HAS_Q=has_q, K1_POW2=k1_pow2, NB_POW2=decide_nb, FILTER=filtered,
        **launch,
    )  # fmt: skip
    _rejection_residual_kernel[(b, nb)](
        target_logits, sb, sk, draft_tokens, draft_probs, temperature, seed, positions, row_max, row_sum,
        num_accepted, res_key, res_token, res_mass, p_key, p_token, thr, cut, v, nb, k, HAS_Q=has_q,
        BLOCK=block, FAST_LOG=target_logits.is_cuda, FILTER=filtered,
        **launch,
    )  # fmt: skip
    _rejection_finalize_kernel[(b,)](
        temperature, row_max, greedy, res_key, res_token, res_mass, p_key, p_token, tokens, num_accepted,
        v, nb, k, NB_POW2=nb_load,
        **launch,
    )  # fmt: skip
    return tokens, num_accepted


# ----------------------------------------------------------------------------------------------------------
# PyTorch reference (same Philox streams: agrees with the kernels token for token on the same logits)
# ----------------------------------------------------------------------------------------------------------


def rejection_sample_ref(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch twin of `rejection_sample`: (tokens [B, K+1] int64, num_accepted [B] int64).

    A batch without a sampled request (no temperature > 0), known on the host for free (eager, on the CPU),
    verifies by `greedy_rejection_ref`: the tokens every temperature-0 request gets here anyway, without the
    softmax, the Philox noise and the filters, which such a request never reads (its filters keep every
    token: `sampling_filter_ref` marks a temperature-0 row inactive). Any other batch runs every request
    through the general path, the arithmetic of the kernels (one call, so a sampled request's values do not
    depend on which other requests are greedy)."""
    if _no_sampled_request(temperature):
        return greedy_rejection_ref(target_logits, draft_tokens)
    return _rejection_sample_general_ref(
        target_logits, draft_tokens, draft_probs, temperature, seed, positions, top_k, top_p, min_p
    )


def _no_sampled_request(temperature: Tensor) -> bool:
    """Whether no temperature is > 0, where reading that on the host costs no device sync and nothing
    traces (eager CPU tensors outside torch.compile and torch.func transforms); False elsewhere."""
    if temperature.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return not bool((temperature > 0).any())


def greedy_rejection_ref(target_logits: Tensor, draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """`rejection_sample_ref` of a batch whose every temperature is 0: draft k is accepted iff it is slot k's
    first argmax (NaN as -inf; a slot without a finite logit gives 0), and slot n = num_accepted emits its
    argmax. (tokens [B, K+1] int64, num_accepted [B] int64)."""
    k = target_logits.shape[1] - 1
    greedy = first_argmax_ref(clean_logits_ref(target_logits))  # [B, K+1]
    n = (greedy[:, :k] == draft_tokens).long().cumprod(dim=-1).sum(dim=-1)  # [B]
    return _assemble(draft_tokens, greedy, n), n


def _assemble(draft_tokens: Tensor, final: Tensor, n: Tensor) -> Tensor:
    """tokens [B, K+1]: the drafts before slot n, final[:, n] at n, -1 after."""
    k1 = final.shape[1]
    slot = torch.arange(k1, device=draft_tokens.device)
    drafts = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)  # [B, K+1]
    return torch.where(
        slot < n[:, None], drafts, torch.where(slot == n[:, None], final.gather(1, n[:, None]), -1)
    )


def _rejection_sample_general_ref(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`rejection_sample_ref` of any batch: softmax, noise and (with options) filters at every slot."""
    b, k1, v = target_logits.shape
    k = k1 - 1
    ids = torch.arange(v, device=target_logits.device)
    if top_k is None:
        raw = clean_logits_ref(target_logits)  # [B, K+1, V]
    else:  # p' at every slot: the tokens outside the kept prefix are -inf
        thr, cut = sampling_filter_ref(target_logits, temperature, top_k, top_p, min_p, k1)  # [B * (K+1)]
        raw = filter_logits_ref(target_logits, thr.view(b, k1), cut.view(b, k1))
    x = raw * inv_temperature_ref(temperature)[:, None, None]
    # slots whose logits / T reach +inf verify greedily (the T -> 0 limit of p is a point mass)
    sampled = (temperature > 0)[:, None] & (x.amax(-1) < float("inf"))  # [B, K+1]
    # a row without any finite logit becomes a one-hot at token 0
    x = torch.where(x.amax(-1, keepdim=True) == float("-inf"), torch.where(ids == 0, 0.0, float("-inf")), x)
    p, _, _ = softmax_ref(x)  # [B, K+1, V]
    greedy = first_argmax_ref(raw)  # [B, K+1]: the raw logits' argmax (0 for a row without finite logits)
    slot_pos = positions[:, None] + torch.arange(k1, device=positions.device)  # [B, K+1]
    # 1. Acceptance: u_k * q(x_k) < p(x_k); greedy target: argmax p == x_k.
    xc = draft_tokens.clamp(0, v - 1)  # [B, K]
    p_x = p[:, :k].gather(-1, xc[..., None]).squeeze(-1)  # [B, K]
    q = draft_probs if draft_probs is not None else torch.nn.functional.one_hot(xc, v).float()  # [B, K, V]
    q_x = q.gather(-1, xc[..., None]).squeeze(-1)
    u = philox_uniform_ref(seed[:, None], slot_pos[:, :k], torch.zeros_like(xc), SALT_ACCEPT)  # [B, K]
    accept = torch.where(sampled[:, :k], u * q_x < p_x, greedy[:, :k] == draft_tokens)
    n = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    # 2. Candidates: residual sample norm(max(p - q, 0)) (p itself if no mass), bonus from p, or argmax.
    r = (p[:, :k] - q).clamp_min(0.0)  # [B, K, V]
    noise = philox_gumbel_ref(seed[:, None], slot_pos[:, :k], v, SALT_RESIDUAL)  # [B, K, V]
    log_r = torch.where(r > 0, torch.log(torch.where(r > 0, r, 1.0)), float("-inf"))
    residual = torch.where(
        r.amax(-1) > 0, first_argmax_ref(log_r + noise), first_argmax_ref(x[:, :k] + noise)
    )  # [B, K]
    bonus = first_argmax_ref(x[:, k] + philox_gumbel_ref(seed, slot_pos[:, k], v, SALT_BONUS))  # [B]
    final = torch.where(sampled, torch.cat([residual, bonus[:, None]], dim=1), greedy)  # [B, K+1]
    # 3. Assemble: drafts before n, the candidate at n, -1 after.
    return _assemble(draft_tokens, final, n), n
