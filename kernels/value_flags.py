"""The value checks of the public sampling and verification functions, as one kernel launch.

    value_flags(logits, temperature, positions, span, ...) -> int32 [1]: a bit per failed check (FLAG_*)

Why: an eager `fspec.gumbel_sample` or `fspec.rejection_sample` must refuse bad values (a negative
temperature, a +inf logit, a position outside the Philox field, a draft token outside the vocabulary, a NaN
probability) with a ValueError naming the argument, and that means reading values on the device. Written as
PyTorch ops the checks are ~25 small kernels (isfinite, abs, amax, comparisons, any, stack) and two passes
over the logits before the one sync: ~900 µs of host time per call on the H200 host
(benchmarks/results/host_overhead.json, `validate`), ten times the sampling launches themselves. Here every
check is one program of one grid over (rows, vocabulary blocks): a program reads one tile of logits (or of
draft probabilities) once, the first program of a request row also checks that request's temperature,
position and draft tokens, and every failed check sets its bit in one int32 word with an atomic OR. The
caller reads the word (the one sync) and, only when a bit is set, runs the detailed PyTorch checks that
name the argument and the bad values (fspec/ops/sampling.py, fspec/ops/verify.py).

Semantics (`value_flags_ref` is the same in plain PyTorch; tests compare them bit for bit):
    FLAG_TEMPERATURE  a temperature NaN, +-inf or < 0
    FLAG_LOGITS       a +inf logit, or a sampled row (T > 0) whose largest finite |logit| times
                      `inv_temperature(T)` is not finite (logits / T would overflow)
    FLAG_POSITIONS    a position < -1 or > POSITION_MASK - span (span: the slots used after it, K for a
                      verification)
    FLAG_COL          the column tensor outside [0, ncols)
    FLAG_DRAFTS       a draft token outside [0, V)
    FLAG_PROBS        a draft probability NaN, +-inf or < 0
    FLAG_D2T          a draft-to-target offset with t + d2t[t] < 0
Logits are [R, V] rows with `rows_per_request` consecutive rows per request (1 for sampling, K + 1 for
verification: row r belongs to request r // rows_per_request), addressed by request and slot strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .gumbel import inv_temperature, inv_temperature_ref, launch_block, vocab_blocks
from .pdl import pdl_enter
from .philox import POSITION_MASK

FLAG_TEMPERATURE = 1
FLAG_LOGITS = 2
FLAG_POSITIONS = 4
FLAG_COL = 8
FLAG_DRAFTS = 16
FLAG_PROBS = 32
FLAG_D2T = 64
FLAG_NAMES = {  # the argument behind each bit (verification calls the logits target_logits)
    FLAG_TEMPERATURE: "temperature",
    FLAG_LOGITS: "logits",
    FLAG_POSITIONS: "positions",
    FLAG_COL: "col",
    FLAG_DRAFTS: "draft_tokens",
    FLAG_PROBS: "draft_probs",
    FLAG_D2T: "d2t",
}
_POSITION_MASK: tl.constexpr = tl.constexpr(POSITION_MASK)
# the bits as the kernel sees them (a @triton.jit function reads only constexpr globals)
_FLAG_TEMPERATURE: tl.constexpr = tl.constexpr(FLAG_TEMPERATURE)
_FLAG_LOGITS: tl.constexpr = tl.constexpr(FLAG_LOGITS)
_FLAG_POSITIONS: tl.constexpr = tl.constexpr(FLAG_POSITIONS)
_FLAG_COL: tl.constexpr = tl.constexpr(FLAG_COL)
_FLAG_DRAFTS: tl.constexpr = tl.constexpr(FLAG_DRAFTS)
_FLAG_PROBS: tl.constexpr = tl.constexpr(FLAG_PROBS)
_FLAG_D2T: tl.constexpr = tl.constexpr(FLAG_D2T)
_INF: tl.constexpr = tl.constexpr(float("inf"))
MAX_DRAFTS_PER_LOAD = 64  # K_POW2: a request's draft tokens checked per load (more loop)


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) != _INF)


@triton.jit
def _value_flags_kernel(
    logits_ptr,  # [B, S, V] rows: request stride, slot stride, vocabulary stride 1
    stride_b,
    stride_s,
    temperature_ptr,  # [B] float32
    positions_ptr,  # [B] int64
    span,  # slots used after a request's position
    col_ptr,  # 0-d int64 (HAS_COL)
    ncols,
    drafts_ptr,  # [B, K] int64, contiguous (HAS_DRAFTS)
    K,
    probs_ptr,  # [B * K, V] float32, contiguous (HAS_PROBS)
    d2t_ptr,  # [V] int (HAS_D2T)
    flags_ptr,  # [1] int32, zero before the launch
    V,
    S,  # rows per request
    logit_rows,  # B * S
    BLOCK: tl.constexpr,
    K_POW2: tl.constexpr,  # drafts per load (`draft_block`)
    HAS_COL: tl.constexpr,
    HAS_DRAFTS: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_D2T: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # grid (logit rows + probability rows, cdiv(V, BLOCK)): one tile per program, bits OR-ed into flags
    pdl_enter(PDL)
    r = tl.program_id(0)
    j = tl.program_id(1)
    v = j * BLOCK + tl.arange(0, BLOCK)
    v_ok = v < V
    flags = tl.full([], 0, tl.int32)
    if r < logit_rows:
        b = r // S
        row = logits_ptr + b.to(tl.int64) * stride_b + (r % S).to(tl.int64) * stride_s
        x = tl.load(row + v, mask=v_ok, other=0.0).to(tl.float32)
        t = tl.load(temperature_ptr + b)
        big = tl.max(tl.where(_finite(x), tl.abs(x), 0.0), axis=0)
        posinf = tl.max((x == _INF).to(tl.int32), axis=0)
        overflow = (t > 0) & ~_finite(big * inv_temperature(t))
        flags |= tl.where((posinf > 0) | overflow, _FLAG_LOGITS, 0)
        if (j == 0) & (r % S == 0):  # the request's own values, once
            flags |= tl.where(~_finite(t) | (t < 0), _FLAG_TEMPERATURE, 0)
            p = tl.load(positions_ptr + b)
            flags |= tl.where((p < -1) | (p > _POSITION_MASK - span), _FLAG_POSITIONS, 0)
            if HAS_DRAFTS:  # K_POW2 drafts per load (one load for every config's K <= 16)
                for k0 in range(0, K, K_POW2):
                    k = k0 + tl.arange(0, K_POW2)
                    d = tl.load(drafts_ptr + b.to(tl.int64) * K + k, mask=k < K, other=0)
                    bad = tl.max(((d < 0) | (d >= V)).to(tl.int32), axis=0)
                    flags |= tl.where(bad > 0, _FLAG_DRAFTS, 0)
        if HAS_COL:
            if (r == 0) & (j == 0):
                c = tl.load(col_ptr)
                flags |= tl.where((c < 0) | (c >= ncols), _FLAG_COL, 0)
        if HAS_D2T:
            if r == 0:
                e = v + tl.load(d2t_ptr + v, mask=v_ok, other=0)
                bad = tl.max(((e < 0) & v_ok).to(tl.int32), axis=0)
                flags |= tl.where(bad > 0, _FLAG_D2T, 0)
    else:
        if HAS_PROBS:
            q = tl.load(probs_ptr + (r - logit_rows).to(tl.int64) * V + v, mask=v_ok, other=0.0)
            bad = tl.max((~_finite(q) | (q < 0)).to(tl.int32), axis=0)
            flags |= tl.where(bad > 0, _FLAG_PROBS, 0)
    if flags != 0:
        tl.atomic_or(flags_ptr, flags)


def _rows(logits: Tensor) -> tuple[Tensor, int, int, int, int]:
    """(logits with vocabulary stride 1, requests B, rows per request S, request stride, slot stride)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() == 2:
        return logits, logits.shape[0], 1, logits.stride(0), 0
    return logits, logits.shape[0], logits.shape[1], logits.stride(0), logits.stride(1)


def draft_block(k: int) -> int:
    """K_POW2: drafts per load for K drafts per request, next_pow2(K) in [2, MAX_DRAFTS_PER_LOAD]."""
    return max(2, min(triton.next_power_of_2(max(k, 1)), MAX_DRAFTS_PER_LOAD))


def value_flags(
    logits: Tensor,
    temperature: Tensor,
    positions: Tensor,
    span: int = 0,
    col: Tensor | None = None,
    ncols: int = 0,
    draft_tokens: Tensor | None = None,
    draft_probs: Tensor | None = None,
    d2t: Tensor | None = None,
    *,
    block: int | None = None,
) -> Tensor:
    """The FLAG_* bits of the checks (module docstring) as an int32 [1] tensor, from one launch. logits
    [N, V] (one row per request) or [B, S, V]; temperature and positions [B]; col a 0-d tensor checked
    against [0, ncols); draft_tokens [B, K]; draft_probs [B, K, V]; d2t [V]. Shapes, dtypes and devices are
    the caller's to check first (they are read as given)."""
    logits, b, s, sb, ss = _rows(logits)
    v = logits.shape[-1]
    block, nb, _ = vocab_blocks(v, launch_block(block))  # nb: grid axis 1, at most gumbel.MAX_GRID_Y
    flags = torch.zeros(1, dtype=torch.int32, device=logits.device)
    temperature, positions = temperature.contiguous(), positions.contiguous()
    drafts = draft_tokens.contiguous() if draft_tokens is not None else positions
    k = draft_tokens.shape[1] if draft_tokens is not None else 1
    probs = draft_probs.contiguous() if draft_probs is not None else temperature
    q_rows = draft_probs.shape[0] * draft_probs.shape[1] if draft_probs is not None else 0
    rows = b * s + q_rows
    if rows == 0 or v == 0:
        return flags
    _value_flags_kernel[(rows, nb)](
        logits, sb, ss, temperature, positions, span, col if col is not None else positions, ncols, drafts, k,
        probs, d2t.contiguous() if d2t is not None else positions, flags, v, s, b * s,
        BLOCK=block, K_POW2=draft_block(k), HAS_COL=col is not None,
        HAS_DRAFTS=draft_tokens is not None, HAS_PROBS=draft_probs is not None, HAS_D2T=d2t is not None,
        **pdl.options(logits),
    )  # fmt: skip
    return flags


def bad_temperature(temperature: Tensor) -> Tensor:
    """FLAG_TEMPERATURE's mask: NaN, +-inf or < 0."""
    return ~torch.isfinite(temperature) | (temperature < 0)


def bad_positions(positions: Tensor, span: int) -> Tensor:
    """FLAG_POSITIONS's mask: outside [-1, POSITION_MASK - span]."""
    return (positions < -1) | (positions > POSITION_MASK - span)


def bad_drafts(draft_tokens: Tensor, v: int) -> Tensor:
    """FLAG_DRAFTS's mask: outside [0, V)."""
    return (draft_tokens < 0) | (draft_tokens >= v)


def bad_probs(draft_probs: Tensor) -> Tensor:
    """FLAG_PROBS's mask: NaN, +-inf or < 0."""
    return ~torch.isfinite(draft_probs) | (draft_probs < 0)


def bad_d2t(d2t: Tensor) -> Tensor:
    """FLAG_D2T's mask over the vocabulary: t + d2t[t] < 0."""
    return (torch.arange(d2t.shape[0], device=d2t.device) + d2t) < 0


def scan_logits(logits: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FLAG_LOGITS's parts for logits [N, V] (one row per request) or [B, S, V]: (any +inf, overflow mask
    [N] or [B, S] of sampled rows whose max finite |logit| times `inv_temperature` is not finite, that max
    per row, the temperature broadcast to it)."""
    x = logits.float()
    big = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1)  # [N] or [B, S]
    t = temperature.view(-1, *([1] * (big.dim() - 1)))  # broadcast over the S slots
    overflow = (t > 0).expand_as(big) & ~torch.isfinite(big * inv_temperature_ref(t))  # the kernels' scaling
    return torch.isposinf(x).any(), overflow, big, t


def value_flags_ref(
    logits: Tensor,
    temperature: Tensor,
    positions: Tensor,
    span: int = 0,
    col: Tensor | None = None,
    ncols: int = 0,
    draft_tokens: Tensor | None = None,
    draft_probs: Tensor | None = None,
    d2t: Tensor | None = None,
) -> Tensor:
    """`value_flags` in plain PyTorch (same bits, same arithmetic; the masks above are also what the public
    functions' detailed checks report)."""
    posinf, overflow, _, _ = scan_logits(logits, temperature)
    bits = [
        (FLAG_TEMPERATURE, bad_temperature(temperature).any()),
        (FLAG_LOGITS, posinf | overflow.any()),
        (FLAG_POSITIONS, bad_positions(positions, span).any()),
    ]
    if col is not None:
        bits.append((FLAG_COL, (col < 0) | (col >= ncols)))
    if draft_tokens is not None:
        bits.append((FLAG_DRAFTS, bad_drafts(draft_tokens, logits.shape[-1]).any()))
    if draft_probs is not None:
        bits.append((FLAG_PROBS, bad_probs(draft_probs).any()))
    if d2t is not None:
        bits.append((FLAG_D2T, bad_d2t(d2t).any()))
    flags = torch.zeros(1, dtype=torch.int32, device=logits.device)
    for bit, bad in bits:
        flags |= bad.to(torch.int32).reshape(1) * bit
    return flags
