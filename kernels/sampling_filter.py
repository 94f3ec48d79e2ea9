"""top_k / top_p / min_p as a kept prefix per row: (thr, cut) for the sampling and verification kernels.

The processed distribution p' of a row with temperature T > 0:
1. NaN logits count as -inf. The row's tokens are ordered by (logit descending, token id ascending): a total
   order, so ties are split by id and every filter below keeps a prefix of it.
2. min_p > 0: tokens with w = exp((l - l_max) / T) < min_p are dropped (vLLM applies min_p first).
3. top_k > 0: only the first top_k tokens of the order are kept (top_k >= V keeps all).
4. top_p < 1: of the tokens still kept (set S), token x is kept iff the mass w of the S-tokens strictly before
   x in the order is < top_p * sum_S w: the shortest prefix reaching top_p, never empty.
5. p' = softmax(l / T) over the kept prefix, renormalised. T = 0 rows are argmax (the first token of the
   order) whatever the options.

The kept prefix of row n is the pair (thr[n] float32, cut[n] int32): token v is kept iff clean(l_v) > thr or
(clean(l_v) == thr and v <= cut). Canonical form: thr is the last kept token's logit and cut its id, or
V - 1 when the whole tie group at thr is kept. A row with no active option, T = 0, no finite logit, or
logits / T reaching +inf (decided greedily downstream) gets thr = -inf, cut = V - 1: everything kept.
w uses the sampling kernels' scaling, (l - l_max) * min(1 / T, FLT_MAX) (kernels/gumbel.py's
`inv_temperature`); masses are float32 sums, so a top_p boundary within a few ulps of a prefix mass may fall
on either side of it in the kernel and the reference.

Kernel: one program per row. An option-free row exits after its four option loads (the common case costs
one tiny launch). Otherwise it bisects over the order-preserving int32 key of the float32 logits: the value
of the top_k-th token (count predicate), then the value of top_p's last kept token (mass predicate). Each pass
over the row tests 16 candidate keys at once, so a bisection is at most 8 passes; a bisection over token ids
runs only where the tie group at the boundary is cut. Worst case (all three options, a cut tie group): about
30 passes over the row.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

FLT_MAX = 3.4028234663852886e38  # the largest float32 (the clamp of gumbel.inv_temperature)
_FLT_MAX: tl.constexpr = tl.constexpr(FLT_MAX)
DEFAULT_FILTER_BLOCK = 1024  # tokens per step of a pass: 48 steps at SmolLM2's V = 49152
# candidates per bisection pass: [16, 1024] compares per step, 64 per thread at 8 warps
BISECT_CANDIDATES = 16


@triton.jit
def order_key(x):
    """int32 key of float32 x (no NaN; -0.0 counts as +0.0) with key(a) < key(b) iff a < b."""
    bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def key_value(key):
    """The float32 whose `order_key` is `key` (int32 or int64 holding an int32)."""
    k = key.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def keep_filtered(x, offs, start, thr, cut):
    """x (float32 logits, NaN already -inf) with the tokens start + offs outside the kept prefix (thr, cut)
    set to -inf: kept iff x > thr or (x == thr and token <= cut). A row without options (thr = -inf,
    cut = V - 1) keeps every token."""
    keep = (x > thr) | ((x == thr) & (offs <= (cut - start).to(tl.int32)))
    return tl.where(keep, x, float("-inf"))


@triton.jit
def _tile(row_ptr, start, V, BLOCK: tl.constexpr):
    """(token ids int32, float32 logits, NaN and past-the-end as -inf) of tokens start .. start + BLOCK."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return offs, tl.where(x != x, float("-inf"), x)


@triton.jit
def _count_ge(row_ptr, cands, lmax, inv_t, V, MASS: tl.constexpr, BLOCK: tl.constexpr, NC: tl.constexpr):
    """Per candidate key c of `cands` ([NC] int64): (# tokens with key >= c, MASS: their sum of w), [NC]."""
    c32 = cands.to(tl.int32)[:, None]
    ge = tl.zeros([NC], tl.int32)
    mass = tl.zeros([NC], tl.float32)
    for start in range(0, V, BLOCK):
        offs, x = _tile(row_ptr, start, V, BLOCK)
        hit = (offs < V)[None, :] & (order_key(x)[None, :] >= c32)  # [NC, BLOCK]
        ge += tl.sum(hit.to(tl.int32), axis=1)
        if MASS:
            mass += tl.sum(tl.where(hit, tl.exp((x - lmax) * inv_t)[None, :], 0.0), axis=1)
    return ge, mass


@triton.jit
def _pick(vec, i, NC: tl.constexpr):
    """vec[i] of an [NC] vector."""
    return tl.sum(tl.where(tl.arange(0, NC) == i, vec, 0), axis=0)


@triton.jit
def _at_key(row_ptr, key, lmax, inv_t, V, BLOCK: tl.constexpr, NC: tl.constexpr):
    """(# tokens with key >= `key`, # with key > `key`, sum of w over the latter): one pass."""
    ge, mass = _count_ge(row_ptr, key + tl.minimum(tl.arange(0, NC), 1), lmax, inv_t, V, True, BLOCK, NC)
    return _pick(ge, 0, NC), _pick(ge, 1, NC), _pick(mass, 1, NC)


@triton.jit
def _min_p_set(row_ptr, lmax, inv_t, min_p, V, BLOCK: tl.constexpr):
    """(# tokens with w >= min_p, the smallest key among them): min_p keeps whole tie groups."""
    n = tl.zeros([], tl.int32)
    low = tl.full([], 0x7FFFFFFF, tl.int32)
    for start in range(0, V, BLOCK):
        offs, x = _tile(row_ptr, start, V, BLOCK)
        kept = (offs < V) & (tl.exp((x - lmax) * inv_t) >= min_p)
        n += tl.sum(kept.to(tl.int32), axis=0)
        low = tl.minimum(low, tl.min(tl.where(kept, order_key(x), 0x7FFFFFFF), axis=0))
    return n, low


# The bisections below are NC-ary: a pass over the row evaluates NC candidates spaced evenly over the
# remaining range [lo, hi] (int64 scalars), shrinking it by NC + 1 (8 passes for 2^32 keys at NC = 16); the
# candidates' predicate holds for a prefix of them, so the count of those that hold places the boundary.


@triton.jit
def _top_k_key(row_ptr, lo, hi, k, V, BLOCK: tl.constexpr, NC: tl.constexpr):
    """The key of the k-th token of the order: the largest key c in [lo, hi] with #(key >= c) >= k
    (given for lo)."""
    while lo < hi:
        step = (hi - lo + NC) // (NC + 1)
        cands = lo + step * (1 + tl.arange(0, NC).to(tl.int64))  # ascending
        ge, _ = _count_ge(row_ptr, tl.minimum(cands, hi), 0.0, 1.0, V, False, BLOCK, NC)
        held = tl.sum(((ge >= k) & (cands <= hi)).to(tl.int64), axis=0)
        lo = lo + step * held
        hi = tl.where(held < NC, tl.minimum(hi, lo + step - 1), hi)
    return lo


@triton.jit
def _top_p_key(row_ptr, lo, hi, n_s, p_mass, lmax, inv_t, V, BLOCK: tl.constexpr, NC: tl.constexpr):
    """The key of top_p's last kept token: the smallest c in [lo, hi] (lo = the key of S's last token,
    hi = the row max's) whose first token is kept: fewer than n_s tokens and S-mass < p_mass above it."""
    while lo < hi:
        step = (hi - lo + NC) // (NC + 1)
        cands = hi - step * (1 + tl.arange(0, NC).to(tl.int64))  # descending
        gt, mass = _count_ge(row_ptr, tl.maximum(cands, lo) + 1, lmax, inv_t, V, True, BLOCK, NC)
        held = tl.sum(((mass < p_mass) & (gt < n_s) & (cands >= lo)).to(tl.int64), axis=0)
        hi = hi - step * held
        lo = tl.where(held < NC, tl.maximum(lo, hi - step + 1), lo)
    return lo


@triton.jit
def _group_keep(mass_gt, w, p_mass, g_s):
    """How many of a tie group's g_s tokens in S top_p keeps: #{j < g_s : mass_gt + j * w < p_mass}, at
    least 1. Bisection over j on scalars."""
    lo = tl.full([], 1, tl.int32)
    hi = g_s
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if mass_gt + (mid - 1).to(tl.float32) * w < p_mass:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _tie_cut(row_ptr, key, m, V, BLOCK: tl.constexpr, NC: tl.constexpr):
    """The id of the m-th token (1-based, by id) with key `key`: the smallest c with #{v <= c} >= m."""
    lo = tl.zeros([], tl.int64)
    hi = tl.zeros([], tl.int64) + (V - 1)
    k32 = key.to(tl.int32)
    while lo < hi:
        step = (hi - lo + NC) // (NC + 1)
        cands = hi - step * (1 + tl.arange(0, NC).to(tl.int64))  # descending
        c32 = tl.maximum(cands, lo).to(tl.int32)[:, None]
        n = tl.zeros([NC], tl.int32)
        for start in range(0, V, BLOCK):
            offs, x = _tile(row_ptr, start, V, BLOCK)
            tie = (offs < V) & (order_key(x) == k32)
            n += tl.sum((tie[None, :] & (offs[None, :] <= c32)).to(tl.int32), axis=1)
        held = tl.sum(((n >= m) & (cands >= lo)).to(tl.int64), axis=0)
        hi = hi - step * held
        lo = tl.where(held < NC, tl.maximum(lo, hi - step + 1), lo)
    return lo.to(tl.int32)


@triton.jit
def _sampling_filter_kernel(
    logits_ptr,  # [N, V] float32/bfloat16/float16 logits rows, vocabulary stride 1
    stride_req,  # elements between the first rows of consecutive requests
    stride_row,  # elements between rows of one request
    temperature_ptr,  # [R] float32 per request, 0 = greedy
    top_k_ptr,  # [R] int32/int64, 0 = off
    top_p_ptr,  # [R] float32 in (0, 1], 1 = off
    min_p_ptr,  # [R] float32 in [0, 1), 0 = off
    thr_ptr,  # [N] float32 out: the last kept token's logit (-inf: all kept)
    cut_ptr,  # [N] int32 out: the last kept token's id, V - 1 when its whole tie group is kept
    V,  # vocabulary size
    RPR,  # rows per request: row n uses request n // RPR
    BLOCK: tl.constexpr,  # tokens per step of a pass
    NC: tl.constexpr,  # candidates per bisection pass
):
    n = tl.program_id(0).to(tl.int64)
    req = n // RPR
    row_ptr = logits_ptr + req * stride_req + (n % RPR) * stride_row
    t = tl.load(temperature_ptr + req)
    top_k = tl.minimum(tl.load(top_k_ptr + req), V).to(tl.int32)  # int64 top_k >= 2^31 stays >= V
    top_p = tl.load(top_p_ptr + req)
    min_p = tl.load(min_p_ptr + req)
    thr = tl.full([], float("-inf"), tl.float32)
    cut = tl.zeros([], tl.int32) + (V - 1)
    if (t > 0) & (((top_k > 0) & (top_k < V)) | (top_p < 1.0) | (min_p > 0.0)):
        lmax = tl.full([], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            _, x = _tile(row_ptr, start, V, BLOCK)
            lmax = tl.maximum(lmax, tl.max(x, axis=0))
        inv_t = tl.minimum(1.0 / t, _FLT_MAX)
        if (lmax > float("-inf")) & (lmax * inv_t < float("inf")):
            # 1. min_p: S0 = {w >= min_p}, n0 tokens down to key0 (every token when min_p is off)
            n0 = tl.zeros([], tl.int32) + V
            key0 = order_key(tl.full([], float("-inf"), tl.float32))
            if min_p > 0.0:
                n0, key0 = _min_p_set(row_ptr, lmax, inv_t, min_p, V, BLOCK)
            # 2. top_k: S = the first n_s = min(top_k, n0) tokens, the last one's key key_s
            n_s = n0
            key_s = key0.to(tl.int64)
            key_max = order_key(lmax).to(tl.int64)
            if (top_k > 0) & (top_k < n0):
                n_s = top_k
                key_s = _top_k_key(row_ptr, key_s, key_max, n_s, V, BLOCK, NC)
            ge, gt, mass_gt = _at_key(row_ptr, key_s, lmax, inv_t, V, BLOCK, NC)
            key_last = key_s
            keep = n_s - gt  # tokens of the tie group at key_last kept
            # 3. top_p over S: total mass, the last kept value, how much of its tie group stays
            if top_p < 1.0:
                w_s = tl.exp((key_value(key_s) - lmax) * inv_t)
                p_mass = top_p * (mass_gt + (n_s - gt).to(tl.float32) * w_s)
                key_last = _top_p_key(row_ptr, key_s, key_max, n_s, p_mass, lmax, inv_t, V, BLOCK, NC)
                ge, gt, mass_gt = _at_key(row_ptr, key_last, lmax, inv_t, V, BLOCK, NC)
                w_last = tl.exp((key_value(key_last) - lmax) * inv_t)
                keep = _group_keep(mass_gt, w_last, p_mass, tl.minimum(ge - gt, n_s - gt))
            # 4. (thr, cut): the id bisection only where the tie group at thr is cut
            thr = key_value(key_last)
            if keep < ge - gt:
                cut = _tie_cut(row_ptr, key_last, keep, V, BLOCK, NC)
    tl.store(thr_ptr + n, thr)
    tl.store(cut_ptr + n, cut)


def filter_block(v: int, block: int | None) -> int:
    """Tokens per step of the filter's passes: `block` (a power of two >= 16), else DEFAULT_FILTER_BLOCK
    shrunk to the vocabulary."""
    if block is None:
        return min(DEFAULT_FILTER_BLOCK, max(16, triton.next_power_of_2(v)))
    if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 16, got {block!r}")
    return block


def sampling_filter(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    rows_per_request: int = 1,
    *,
    block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the filter: (thr [N] float32, cut [N] int32) of logits [N, V] (or [B, K+1, V]: N = B * (K+1)
    rows, rows_per_request = K + 1), options [R] per request (row n uses request n // rows_per_request).

    Inputs are assumed validated (the public sampling and verification functions check them)."""
    v = logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() == 3:
        if rows_per_request != logits.shape[1]:
            raise ValueError(
                f"rows_per_request: expected {logits.shape[1]} (logits' dim 1), got {rows_per_request}"
            )
        stride_req, stride_row = logits.stride(0), logits.stride(1)
    else:
        stride_req, stride_row = logits.stride(0) * rows_per_request, logits.stride(0)
    n = logits.numel() // v if v else 0
    thr = torch.empty(n, dtype=torch.float32, device=logits.device)
    cut = torch.empty(n, dtype=torch.int32, device=logits.device)
    if n == 0:
        return thr, cut
    temperature, top_k, top_p, min_p = (x.contiguous() for x in (temperature, top_k, top_p, min_p))
    _sampling_filter_kernel[(n,)](
        logits, stride_req, stride_row, temperature, top_k, top_p, min_p, thr, cut, v, rows_per_request,
        BLOCK=filter_block(v, block), NC=BISECT_CANDIDATES, num_warps=8,
    )  # fmt: skip
    return thr, cut


# ----------------------------------------------------------------------------------------------------------
# PyTorch reference (a sort of each row)
# ----------------------------------------------------------------------------------------------------------


def sampling_filter_ref(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    rows_per_request: int = 1,
) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch twin of `sampling_filter`: (thr [N] float32, cut [N] int32), same canonical form."""
    v = logits.shape[-1]
    x = logits.float().reshape(-1, v)
    x = torch.where(torch.isnan(x), float("-inf"), x)  # [N, V]
    x = torch.where(x == 0, 0.0, x)
    t, k, p, mp = (o.repeat_interleave(rows_per_request) for o in (temperature, top_k, top_p, min_p))
    k = k.long()
    xs, ids = torch.sort(x, dim=-1, descending=True, stable=True)  # the order: ties by ascending id
    lmax = xs[:, :1]
    inv_t = torch.where(t > 0, (1.0 / t).clamp(max=FLT_MAX), 1.0)[:, None]
    w = torch.exp((xs - lmax) * inv_t)  # [N, V] in order
    rank = torch.arange(v, device=x.device)
    keep = (mp[:, None] <= 0) | (w >= mp[:, None])
    keep &= (k[:, None] <= 0) | (rank < k[:, None])
    ws = torch.where(keep, w, 0.0)
    before = torch.nn.functional.pad(torch.cumsum(ws, dim=-1)[:, :-1], (1, 0))  # S-mass strictly before
    keep &= (p[:, None] >= 1) | (before < (p * ws.sum(-1))[:, None]) | (rank == 0)
    last = (keep.sum(-1) - 1).clamp(min=0)[:, None]  # [N, 1]: the kept prefix's last position
    thr = xs.gather(1, last).squeeze(1)
    nxt = xs.gather(1, (last + 1).clamp(max=v - 1)).squeeze(1)
    whole = (last.squeeze(1) == v - 1) | (nxt != thr)  # the tie group at thr is kept whole
    cut = torch.where(whole, v - 1, ids.gather(1, last).squeeze(1))
    active = (t > 0) & (((k > 0) & (k < v)) | (p < 1) | (mp > 0))
    active &= (lmax.squeeze(1) > float("-inf")) & ((lmax * inv_t).squeeze(1) < float("inf"))
    thr = torch.where(active, thr, float("-inf"))
    return thr, torch.where(active, cut, v - 1).to(torch.int32)


def filter_logits_ref(logits: Tensor, thr: Tensor, cut: Tensor) -> Tensor:
    """float32 logits [..., V] (NaN as -inf) with the tokens outside each row's kept prefix (thr, cut [...])
    set to -inf."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    ids = torch.arange(x.shape[-1], device=x.device)
    thr, cut = thr[..., None], cut[..., None]
    return torch.where((x > thr) | ((x == thr) & (ids <= cut)), x, float("-inf"))
