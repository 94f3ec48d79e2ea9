"""The chain cache's attention (`fspec.ops.dense_cache.bind_chain`), kept lean for the backward pass.

At draft step j of the training-time test, the query of chain (b, i) sees the shared keys of sequence b at
positions <= i (causal) and its own chain's keys of steps 1..j (`fspec.train.ttt.ttt_mask`), as one softmax.
As a dense masked attention this materialises [B, N, S, S + Kc] scores and keeps the probabilities for the
backward pass at every layer of every step: at Llama-3.2-1B head shapes (16 x 1024 tokens, 32 heads) 2.2 GB
per step, most of what a TTT step kept (a 119.7 GiB peak on the H200, BENCHMARKS.md).

Here the chain keys are Kc scores per row (one small batched product), the causal block is computed in
chunks of query rows, each against the shared keys up to its last row only (a chunk of rows lo..hi-1 reads
keys 0..hi-1, masked on its diagonal block alone), with 1/sqrt(D) folded into q once, and the backward pass
recomputes the probabilities from the saved log-sum-exp per row
(FlashAttention's recomputation, in plain PyTorch): what is kept is q, the keys and values, the output and one
log-sum-exp per (row, head), O(S·Kc) besides the inputs instead of O(S²). Exact (the same softmax, fp32
accumulation; fp64 stays fp64), a `torch.autograd.Function` with a generated vmap rule, so it composes with
`torch.func.grad` and `vmap` as the dense formulation did.

Wherever PyTorch's flash-attention kernel runs (`fused_available`: CUDA in fp16 / bf16, and the CPU), the
causal block goes through it instead of the chunks: the kernel returns its block's output and log-sum-exp
per row, the chain slots' scores are merged in by their own log-sum-exp (the softmax of the union), and the
kernel's backward pass, handed the merged output and log-sum-exp, recomputes the causal block's share of the
merged probabilities, exp(s - lse), and the row term rowsum(dO · O) of the merged attention: the exact
gradients, in the kernel's time. On CUDA its P·V product is in the input's half precision (the chunks keep
fp32). Under vmap the chunks run: the kernel has no batching rule.

The backward pass is `once_differentiable`: it records no graph of its own ops. Under `torch.func.grad`
(how distillation differentiates) an autograd.Function's backward otherwise runs with grad on, over wrapped
tensors, and every chunk's [B, N, C, S] temporaries stayed alive until the backward ended. On an H100 a TTT
step at SmolLM2 head shapes (32 x 512, K = 7, bf16 autocast) then took 0.188 s and peaked at 34.7 GiB,
against 0.153 s and 26.6 GiB for the layer loop this replaced (benchmarks/results/ttt_step_h100.json); on
the CPU, B = 4, the step's peak resident growth went from 5.4 GiB to 2.5 GiB with it (the loop: 4.3 GiB).
A second derivative through this attention is refused (nothing in fspec takes one).

Layout (GQA: query head k·G + g reads KV head k): q [B, Nkv, G, S, D]; shared keys / values [B, Nkv, S, D];
chain keys / values [B, Nkv, S, Kc, D]; `mine` [Kc] bool, the chain slots this step sees (slots < j).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from fspec.ops.attention import autocast_off

# Scores per chunk of the causal block: B·N·chunk·S values, 2^26 of them (256 MB in fp32) per live tensor.
# Fewer, larger chunks: each chunk is ~20 eager ops forward and backward, and a TTT step runs eagerly under
# torch.func.grad, where an op's host cost counts: on an H100, at SmolLM2 head shapes (32 x 512, K = 7),
# four chunks took a train step from 0.184 to 0.199 s (benchmarks/results/ttt_step_h100_after.json).
_CHUNK_ELEMENTS = 1 << 26


def chain_attention(
    q: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    kd: torch.Tensor,
    vd: torch.Tensor,
    mine: torch.Tensor,
    *,
    chunk: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Attention of chain (b, i) over shared positions <= i and its chain slots where `mine` (module
    docstring for the layout): [B, Nkv, G, S, D] in q's dtype. `chunk`: query rows per chunk of the causal
    block (None: as few chunks of equal rows as about 2^26 scores per chunk allow). `fused`: the causal
    block through PyTorch's flash-attention kernel (None: wherever `fused_available` says it runs; False:
    the chunks, as under vmap). Internal (its caller, `bind_chain`, builds every argument)."""
    b, nkv, g, s, _ = q.shape
    if fused is None:
        fused = fused_available(q, ks, vs)
    elif fused and not fused_available(q, ks, vs):
        raise ValueError(f"fused: expected a flash-attention device and dtype, got {q.device.type} {q.dtype}")
    rows = chunk
    if rows is None:  # as few chunks as ~2^26 scores each allow, of equal rows
        chunks = -(-b * nkv * g * s * s // _CHUNK_ELEMENTS)
        rows = max(1, -(-s // max(chunks, 1)))
    return _ChainAttention.apply(q, ks, vs, kd, vd, mine, 0 if fused else rows)[0]


def fused_available(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> bool:
    """Whether the causal block of q's attention over the shared keys `ks` and values `vs` can go through
    PyTorch's flash-attention kernel (`_kernel_dtype`), never when any of them is vmap-batched (the kernel
    has no batching rule, so `vmap` takes the chunks)."""
    if any(_under_vmap(t) for t in (q, ks, vs)):
        return False
    return vs.dtype == ks.dtype and _kernel_dtype(q, ks) is not None


def _kernel_dtype(q: torch.Tensor, ks: torch.Tensor) -> torch.dtype | None:
    """The dtype the flash kernel runs in: on CUDA the shared keys' fp16 / bf16 (the kernel's dtypes there;
    an fp32 q, as bf16 autocast training hands it over with bf16 keys, is cast to it as autocast casts a
    product's inputs), on the CPU the promoted dtype of q and the keys (its CPU kernel takes every float
    dtype); None where it does not run."""
    if q.device.type == "cuda":
        return ks.dtype if ks.dtype in (torch.float16, torch.bfloat16) else None
    if q.device.type == "cpu":
        return torch.promote_types(q.dtype, ks.dtype)
    return None


class _ChainAttention(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q, ks, vs, kd, vd, mine, rows):
        # autocast off: the forward pass must compute the scores exactly as the backward pass recomputes them.
        # rows == 0: the causal block through the flash kernel (its RNG state rides along for its backward)
        with autocast_off(q.device.type):
            if rows == 0:
                return _fused_forward(q, ks, vs, kd, vd, mine)
            none = q.new_empty(0)
            return (*_forward(q, ks, vs, kd, vd, mine, rows), none, none)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, ks, vs, kd, vd, mine, rows = inputs
        out, lse, seed, offset = output
        ctx.save_for_backward(q, ks, vs, kd, vd, mine, out, lse, seed, offset)
        ctx.rows = rows
        ctx.mark_non_differentiable(lse, seed, offset)

    @staticmethod
    @once_differentiable  # module docstring: no graph of its own ops under torch.func.grad
    def backward(ctx, d_out, _d_lse, _d_seed, _d_offset):
        q, ks, vs, kd, vd, mine, out, lse, seed, offset = ctx.saved_tensors
        with autocast_off(d_out.device.type):
            if ctx.rows == 0:
                grads = _fused_backward(q, ks, vs, kd, vd, mine, out, lse, seed, offset, d_out)
            else:
                grads = _backward(q, ks, vs, kd, vd, mine, out, lse, d_out, ctx.rows)
        return (*grads, None, None)


def _acc(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)  # fp32 accumulation (fp64 stays fp64)


def _chain_scores(qs, kdh, mine):
    """[B, Nkv, G, S, Kc]: each row's scores (qs: q already scaled) against its own chain's keys, -inf where
    not `mine`."""
    sd = torch.einsum("bkgsd,bkstd->bkgst", qs, kdh)
    return sd.masked_fill(~mine, float("-inf"))


def _future(lo: int, hi: int, device) -> torch.Tensor:
    """[C, C] bool, C = hi - lo: key lo + j lies after query row lo + c (j > c), within the chunk's diagonal
    block; every key before lo is visible to every row of the chunk, every key from hi on to none."""
    c = torch.arange(hi - lo, device=device)
    return c[None, :] > c[:, None]


def _inputs(q, ks, vs, kd, vd):
    """q scaled by 1/sqrt(D) (once, on the small tensor, not on every score) and the keys and values, in the
    accumulation dtype; shared ones as [B, Nkv, 1, S, D]."""
    acc = _acc(q)
    qs = q.to(acc) * (1.0 / math.sqrt(q.shape[4]))
    return qs, ks.to(acc)[:, :, None], vs.to(acc)[:, :, None], kd.to(acc), vd.to(acc)


def _chunk_scores(qs, ksh, lo: int, hi: int) -> torch.Tensor:
    """[B, Nkv, G, C, hi]: rows lo..hi-1 against the shared keys they can see (0..hi-1), -inf after the
    diagonal. Forward and backward compute them alike, so the recomputed probabilities are the forward's."""
    s0 = qs[:, :, :, lo:hi] @ ksh[:, :, :, :hi].transpose(-1, -2)
    s0[..., lo:hi].masked_fill_(_future(lo, hi, qs.device), float("-inf"))
    return s0


def _add_head(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """total [B, Nkv, S, D] with part [B, Nkv, h, D] added to its first h positions, out of place (under vmap
    either may be the batched one)."""
    h = part.shape[2]
    return total.slice_scatter(total[:, :, :h] + part, dim=2, start=0, end=h)


def _forward(q, ks, vs, kd, vd, mine, rows):
    qs, ksh, vsh, kdh, vdh = _inputs(q, ks, vs, kd, vd)
    s = q.shape[3]
    sd = _chain_scores(qs, kdh, mine)
    outs, lses = [], []
    for lo in range(0, s, rows):
        hi = min(lo + rows, s)
        s0 = _chunk_scores(qs, ksh, lo, hi)  # [B, Nkv, G, C, hi]
        sdc = sd[:, :, :, lo:hi]  # [B, Nkv, G, C, Kc]
        m = torch.maximum(s0.amax(-1), sdc.amax(-1))  # finite: row lo + c sees shared key lo + c
        e0 = torch.exp(s0 - m[..., None])  # out of place, as below: under vmap s0 may be unbatched
        ed = torch.exp(sdc - m[..., None])
        den = e0.sum(-1) + ed.sum(-1)
        num = e0 @ vsh[:, :, :, :hi] + torch.einsum("bkgct,bkctd->bkgcd", ed, vdh[:, :, lo:hi])
        outs.append(num / den[..., None])
        lses.append(m + torch.log(den))
    return torch.cat(outs, dim=3).to(q.dtype), torch.cat(lses, dim=3)


def _chain_backward(qs, kdh, vdh, mine, lse, do, delta, scale):
    """The chain slots' share of the gradients, in the accumulation dtype: (dq's chain term, d_kd, d_vd).
    qs: q already scaled; lse: the merged log-sum-exp; delta: rowsum(dO · O) of the merged output."""
    pd = torch.exp(_chain_scores(qs, kdh, mine) - lse[..., None])  # 0 where not mine
    dsd = pd * (torch.einsum("bkgsd,bkstd->bkgst", do, vdh) - delta[..., None])
    d_kd = torch.einsum("bkgst,bkgsd->bkstd", dsd, qs)
    d_vd = torch.einsum("bkgst,bkgsd->bkstd", pd, do)
    return torch.einsum("bkgst,bkstd->bkgsd", dsd, kdh) * scale, d_kd, d_vd


def _backward(q, ks, vs, kd, vd, mine, out, lse, d_out, rows):
    qs, ksh, vsh, kdh, vdh = _inputs(q, ks, vs, kd, vd)
    s = q.shape[3]
    scale = 1.0 / math.sqrt(q.shape[4])
    do = d_out.to(lse.dtype)  # [B, Nkv, G, S, D]
    delta = (do * out.to(lse.dtype)).sum(-1)  # [B, Nkv, G, S]
    dq, d_kd, d_vd = _chain_backward(qs, kdh, vdh, mine, lse, do, delta, scale)
    d_ks, d_vs = torch.zeros_like(ksh[:, :, 0]), torch.zeros_like(vsh[:, :, 0])  # [B, Nkv, S, D]
    dq_parts = []
    for lo in range(0, s, rows):
        hi = min(lo + rows, s)
        qc, doc = qs[:, :, :, lo:hi], do[:, :, :, lo:hi]
        kc, vc = ksh[:, :, :, :hi], vsh[:, :, :, :hi]
        p0 = torch.exp(_chunk_scores(qs, ksh, lo, hi) - lse[:, :, :, lo:hi, None])  # 0 after the diagonal
        ds0 = (doc @ vc.transpose(-1, -2) - delta[:, :, :, lo:hi, None]) * p0  # [B, Nkv, G, C, hi]
        dq_parts.append(ds0 @ kc)
        d_ks = _add_head(d_ks, torch.einsum("bkgcs,bkgcd->bksd", ds0, qc))
        d_vs = _add_head(d_vs, torch.einsum("bkgcs,bkgcd->bksd", p0, doc))
    dq = dq + torch.cat(dq_parts, dim=3) * scale
    return dq.to(q.dtype), d_ks.to(ks.dtype), d_vs.to(vs.dtype), d_kd.to(kd.dtype), d_vd.to(vd.dtype)


def _under_vmap(x: torch.Tensor) -> bool:
    """Whether any functorch level wrapping x is a vmap level (under grad-of-vmap the outer wrapper is
    grad's)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        if torch._C._functorch.is_batchedtensor(x):
            return True
        x = torch._C._functorch.get_unwrapped(x)
    return False


def _heads(q, ks, vs):
    """q [B, Nkv, G, S, D] -> [B, N, S, D] and the shared keys / values repeated per query head (the flash
    kernel's layout, head k·G + g reading KV head k), all contiguous and in the kernel's dtype."""
    b, nkv, g, s, d = q.shape
    dt = _kernel_dtype(q, ks)
    wide = lambda x: x.to(dt)[:, :, None].expand(b, nkv, g, s, d).reshape(b, nkv * g, s, d)  # noqa: E731
    return q.to(dt).reshape(b, nkv * g, s, d).contiguous(), wide(ks).contiguous(), wide(vs).contiguous()


def _flash(q, k, v, scale):
    """(out, log-sum-exp, seed, offset) of causal attention through PyTorch's flash kernel of q's device."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, q.new_empty(0), q.new_empty(0)
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )
    return out, lse, seed, offset


def _fused_forward(q, ks, vs, kd, vd, mine):
    """The causal block by the flash kernel (its own log-sum-exp per row), the chain slots in the
    accumulation dtype, merged by their log-sum-exps: (out in q's dtype, lse, seed, offset)."""
    b, nkv, g, s, d = q.shape
    scale = 1.0 / math.sqrt(d)
    o0, lse0, seed, offset = _flash(*_heads(q, ks, vs), scale)
    acc = _acc(q)
    o0, lse0 = o0.view(b, nkv, g, s, d).to(acc), lse0.view(b, nkv, g, s).to(acc)
    sd = _chain_scores(q.to(acc) * scale, kd.to(acc), mine)  # [B, Nkv, G, S, Kc]
    lse = torch.logaddexp(lse0, torch.logsumexp(sd, dim=-1))  # the chain part may be empty: -inf
    own = torch.einsum("bkgst,bkstd->bkgsd", torch.exp(sd - lse[..., None]), vd.to(acc))
    out = o0 * torch.exp(lse0 - lse)[..., None] + own
    return out.to(q.dtype), lse, seed, offset


def _fused_backward(q, ks, vs, kd, vd, mine, out, lse, seed, offset, d_out):
    """Gradients of `_fused_forward`. The flash kernel's backward, given the merged output and log-sum-exp,
    recomputes the causal block's probabilities as exp(s - lse) and their row term as rowsum(dO · O): the
    merged softmax's, so its gradients are the causal block's share of the merged attention's."""
    b, nkv, g, s, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qh, kh, vh = _heads(q, ks, vs)
    oh = out.to(qh.dtype).reshape(b, nkv * g, s, d).contiguous()
    doh = d_out.to(qh.dtype).reshape(b, nkv * g, s, d).contiguous()
    lh = lse.reshape(b, nkv * g, s).to(torch.float32 if q.device.type == "cuda" else lse.dtype).contiguous()
    if q.device.type == "cpu":
        dqh, dkh, dvh = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lh, 0.0, True, scale=scale
        )
    else:
        dqh, dkh, dvh = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lh, None, None, s, s, 0.0, True, seed, offset, scale=scale
        )
    acc = _acc(q)
    qs, kdh, vdh = q.to(acc) * scale, kd.to(acc), vd.to(acc)
    do = d_out.to(acc)
    delta = (do * out.to(acc)).sum(-1)  # [B, Nkv, G, S]
    dq, d_kd, d_vd = _chain_backward(qs, kdh, vdh, mine, lse, do, delta, scale)
    dq = dq + dqh.view(b, nkv, g, s, d).to(acc)
    d_ks = dkh.view(b, nkv, g, s, d).to(acc).sum(2)
    d_vs = dvh.view(b, nkv, g, s, d).to(acc).sum(2)
    return dq.to(q.dtype), d_ks.to(ks.dtype), d_vs.to(vs.dtype), d_kd.to(kd.dtype), d_vd.to(vd.dtype)
