"""Memory-lean attention for the unrolled TTT steps: the causal block plus diagonals, chunked, recomputed.

At unrolled step j >= 1, row i attends to the step-0 keys at positions <= i (causal) and to its own keys of
steps 1..j (one per step: the diagonal of each later block; `fspec.train.ttt.ttt_mask`). As a dense masked
attention this materialises [B, N, S, (j + 1)·S] scores and keeps them for the backward pass: at
Llama-3.2-1B shapes (16 x 1024 tokens, 32 heads) that is 2.1 GB per block, 60 GB over seven unrolled steps,
most of what a TTT step keeps (benchmarks/bench_ttt_memory.py).

Here the diagonal blocks are j scores per row (elementwise products), the causal block is computed in chunks
of query rows, and the backward pass recomputes the probabilities from the saved log-sum-exp per row
(FlashAttention's recomputation, in plain PyTorch): what is kept is q, the keys and values, the output and
one log-sum-exp per (row, head), O(S·j) instead of O(S²·j). Exact (same softmax, fp32 accumulation), a
`torch.autograd.Function` that composes with `torch.func.grad` and `vmap`.

GQA: q has N = Nkv·G heads; head n reads KV head n // G (as `enable_gqa` in SDPA), without expanding K/V.
"""

from __future__ import annotations

import math

import torch

from fspec.ops.attention import autocast_off

# Scores per chunk: B·N·chunk·S fp32 values; 2^26 of them (256 MB) per live chunk tensor.
_CHUNK_ELEMENTS = 1 << 26


def _split_heads(q: torch.Tensor, nkv: int) -> torch.Tensor:
    """[B, S, N, D] -> [B, Nkv, G, S, D] (head n = kv·G + g)."""
    b, s, n, d = q.shape
    return q.reshape(b, s, nkv, n // nkv, d).permute(0, 2, 3, 1, 4)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, Nkv, G, S, D] -> [B, S, N, D]."""
    b, nkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, nkv * g, d)


def _heads_first(q, k0, v0, kd, vd, acc: torch.dtype):
    """The inputs in the compute layout and dtype: q [B, Nkv, G, S, D], k0/v0 [B, Nkv, 1, S, D],
    kd/vd [B, Nkv, 1, S, J, D]."""
    nkv = k0.shape[2]
    return (
        _split_heads(q, nkv).to(acc),
        k0.permute(0, 2, 1, 3).to(acc)[:, :, None],
        v0.permute(0, 2, 1, 3).to(acc)[:, :, None],
        kd.permute(0, 3, 1, 2, 4).to(acc)[:, :, None],
        vd.permute(0, 3, 1, 2, 4).to(acc)[:, :, None],
    )


def _chunk_rows(b: int, n: int, s: int, chunk: int | None) -> int:
    if chunk is not None:
        return chunk
    return max(1, min(s, _CHUNK_ELEMENTS // max(b * n * s, 1)))


def _stack(diag: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of steps 1..J stacked to [B, S, J, Nkv, D]: transient copies, never saved."""
    j = len(diag) // 2
    return torch.stack(diag[:j], dim=2), torch.stack(diag[j:], dim=2)


class _TTTAttention(torch.autograd.Function):
    """(q [B,S,N,D], k0/v0 [B,S,Nkv,D], chunk, k_1..k_J, v_1..v_J [B,S,Nkv,D]) -> [B,S,N,D]; see the module
    docstring. The per-step keys and values are separate inputs, so what is saved for the backward pass is
    those tensors themselves (alive anyway), not a stacked copy per step."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k0, v0, chunk, *diag):
        # autocast off: the forward pass must compute the scores exactly as the backward pass recomputes them
        # (under bf16 autocast the matmuls would otherwise run in bf16 in the forward pass only)
        with autocast_off(q.device.type):
            return _forward(q, k0, v0, *_stack(diag), chunk)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k0, v0, chunk, *diag = inputs
        out, lse = output
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        with autocast_off(d_out.device.type):
            kd, vd = _stack(tuple(diag))
            dq, dk0, dv0, d_kd, d_vd = _backward((q, k0, v0, kd, vd, out, lse), d_out, ctx.chunk)
        return dq, dk0, dv0, None, *d_kd.unbind(2), *d_vd.unbind(2)


def _forward(q, k0, v0, kd, vd, chunk):
    nkv = k0.shape[2]
    s, d = q.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(d)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulation (fp64 stays fp64)
    qh, k0h, v0h, kdh, vdh = _heads_first(q, k0, v0, kd, vd, acc)
    sd = (qh[..., None, :] * kdh).sum(-1) * scale  # [B, Nkv, G, S, J]
    b, _, g = qh.shape[:3]
    c = _chunk_rows(b, nkv * g, s, chunk)
    keys = torch.arange(s, device=q.device)
    outs, lses = [], []
    for lo in range(0, s, c):
        hi = min(lo + c, s)
        s0 = (qh[:, :, :, lo:hi] @ k0h.transpose(-1, -2)) * scale  # [B, Nkv, G, C, S]
        visible = keys[None, :] <= torch.arange(lo, hi, device=q.device)[:, None]  # [C, S]
        s0 = s0.masked_fill(~visible, float("-inf"))
        sdc = sd[:, :, :, lo:hi]  # [B, Nkv, G, C, J]
        m = torch.maximum(s0.amax(-1), sdc.amax(-1))  # [B, Nkv, G, C]
        e0 = torch.exp(s0 - m[..., None])
        ed = torch.exp(sdc - m[..., None])
        den = e0.sum(-1) + ed.sum(-1)
        num = e0 @ v0h + (ed[..., None] * vdh[:, :, :, lo:hi]).sum(-2)  # [B, Nkv, G, C, D]
        outs.append(num / den[..., None])
        lses.append(m + torch.log(den))
    out = torch.cat(outs, dim=3)  # [B, Nkv, G, S, D]
    return _merge_heads(out).to(q.dtype), torch.cat(lses, dim=3)


def _backward(saved, d_out, chunk):
    q, k0, v0, kd, vd, out, lse = saved
    nkv = k0.shape[2]
    s, d = q.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(d)
    acc = lse.dtype
    qh, k0h, v0h, kdh, vdh = _heads_first(q, k0, v0, kd, vd, acc)
    do = _split_heads(d_out, nkv).to(acc)  # [B, Nkv, G, S, D]
    delta = (do * _split_heads(out, nkv).to(acc)).sum(-1)  # [B, Nkv, G, S]
    sd = (qh[..., None, :] * kdh).sum(-1) * scale  # [B, Nkv, G, S, J]
    pd = torch.exp(sd - lse[..., None])
    dpd = (do[..., None, :] * vdh).sum(-1)  # [B, Nkv, G, S, J]
    dsd = pd * (dpd - delta[..., None])
    # diagonal blocks: per-row products, no chunking needed
    d_kd = ((dsd[..., None] * qh[..., None, :]).sum(2) * scale).permute(0, 2, 3, 1, 4)  # [B,S,J,Nkv,D]
    d_vd = (pd[..., None] * do[..., None, :]).sum(2).permute(0, 2, 3, 1, 4)
    dq_parts = []
    dk0 = torch.zeros_like(k0h[:, :, 0])  # [B, Nkv, S, D]
    dv0 = torch.zeros_like(v0h[:, :, 0])
    b, _, g = qh.shape[:3]
    c = _chunk_rows(b, nkv * g, s, chunk)
    keys = torch.arange(s, device=q.device)
    for lo in range(0, s, c):
        hi = min(lo + c, s)
        qc, doc = qh[:, :, :, lo:hi], do[:, :, :, lo:hi]
        s0 = (qc @ k0h.transpose(-1, -2)) * scale  # [B, Nkv, G, C, S]
        visible = keys[None, :] <= torch.arange(lo, hi, device=q.device)[:, None]
        p0 = torch.exp(s0 - lse[:, :, :, lo:hi, None]).masked_fill(~visible, 0.0)
        dp0 = doc @ v0h.transpose(-1, -2)  # [B, Nkv, G, C, S]
        ds0 = p0 * (dp0 - delta[:, :, :, lo:hi, None])
        dq_parts.append((ds0 @ k0h + (dsd[:, :, :, lo:hi, :, None] * kdh[:, :, :, lo:hi]).sum(-2)) * scale)
        dk0 = dk0 + (ds0.transpose(-1, -2) @ qc).sum(2) * scale  # [B, Nkv, S, D]
        dv0 = dv0 + (p0.transpose(-1, -2) @ doc).sum(2)
    dq = _merge_heads(torch.cat(dq_parts, dim=3))
    return (
        dq.to(q.dtype),
        dk0.permute(0, 2, 1, 3).to(k0.dtype),
        dv0.permute(0, 2, 1, 3).to(v0.dtype),
        d_kd.to(kd.dtype),
        d_vd.to(vd.dtype),
    )


def _check_shapes(q, keys, values) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not q.is_floating_point():
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q: expected a float [B, S, N, D] tensor, got {got}")
    b, s, n, d = q.shape
    for name, xs in (("keys", keys), ("values", values)):
        for i, x in enumerate(xs):
            ok = isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()
            if not ok or x.shape != keys[0].shape or (x.shape[0], x.shape[1], x.shape[3]) != (b, s, d):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"{name}[{i}]: expected a float [B={b}, S={s}, Nkv, D={d}] tensor like keys[0], got {got}"
                )
            if x.device != q.device:
                raise ValueError(f"{name}[{i}]: expected q's device {q.device}, got {x.device}")
    if n % keys[0].shape[2]:
        raise ValueError(f"keys: expected KV heads dividing q's {n} heads (GQA), got {keys[0].shape[2]}")


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of unrolled step j = len(keys) - 1 >= 1 under `fspec.train.ttt.ttt_mask`.

    q [B, S, N, D]; keys/values: j + 1 tensors [B, S, Nkv, D], step 0's first (causal), then steps 1..j
    (diagonal). Returns [B, S, N, D] in q's dtype, equal to `dense_attention(q, cat(keys), cat(values),
    mask=ttt_mask(S, j))` but keeping O(S·j) memory for the backward pass. `chunk`: query rows per chunk of
    the causal block (default: about 2^26 scores per chunk).
    """
    if len(keys) < 2 or len(keys) != len(values):
        raise ValueError(
            f"keys/values: expected the same number (>= 2) of per-step tensors, got {len(keys)}/{len(values)}"
        )
    _check_shapes(q, keys, values)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk: expected a positive int or None, got {chunk!r}")
    return _TTTAttention.apply(q, keys[0], values[0], chunk, *keys[1:], *values[1:])[0]
