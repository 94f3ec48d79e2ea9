"""Attention over a `DenseKVCache`, written out of place: the differentiable, vmap-able twin of paged.

    attend = bind_dense(positions [B, Q], cache)        # an `Attend` for a head's layers
    out = head_hidden(params, ids, hidden, positions, attend, cfg=cfg)
    cache = attend.new_cache()                          # a NEW DenseKVCache; the input is untouched

Each layer's call writes its T = B·Q rows' K/V at their positions with `torch.where` over a position
one-hot (row (b, q) at position p lands at k[b, layer, :, p]; padding rows, p = -1, land nowhere), then runs
a masked softmax where the query at position p of request b sees the cache positions j <= p of b (its own
K/V included, as the paged backend's write-then-gather). Plain einsum / where / softmax: no custom op, no
in-place write, no host read, no Python branch on tensor values, so `torch.func.grad`, `vmap` (over the
requests' stack or over stacked params) and `torch.compile` all trace it. Cost: O(B·Q·max_len) per layer for
the write, as much as the attention itself; this path is for training and research, not serving.

Rows with no visible key (padding) would give NaN from softmax over -inf, and NaN leaks into gradients even
through `where`: such rows are allowed key 0 and their output is zeroed afterwards (as `_sdpa` does).
"""

from __future__ import annotations

import torch
from einops import rearrange

from fspec.core.cache import ChainKVCache, DenseKVCache
from fspec.ops.attention import Attend, rope_qk
from fspec.ops.chain_attention import chain_attention


def dense_cache_write(buf: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """buf [B, Nkv, S, D] with rows x [B, Q, Nkv, D] written at positions [B, Q] (-1: not written), out of
    place. Exact: each written position takes one row times 1.0 plus zeros (positions of a request are
    distinct)."""
    hot = positions[:, :, None] == torch.arange(buf.shape[2], device=buf.device)  # [B, Q, S]
    written = torch.einsum("bqs,bqnd->bnsd", hot.to(buf.dtype), x.to(buf.dtype))  # [B, Nkv, S, D]
    hit = hot.any(dim=1)[:, None, :, None]  # [B, 1, S, 1]
    return torch.where(hit, written, buf)


def dense_cache_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """q [B, Q, N, D] over cache rows k/v [B, Nkv, S, D]: the query at position p sees positions j <= p.
    Returns [B, Q, N, D] in q's dtype; padding queries (position -1) give zeros. GQA: query head n reads KV
    head n // (N / Nkv)."""
    b, qn, n, d = q.shape
    nkv, s = k.shape[1], k.shape[2]
    qg = rearrange(q, "b q (k g) d -> b k g q d", k=nkv)
    kc, vc = k.to(q.dtype), v.to(q.dtype)
    scores = torch.einsum("bkgqd,bksd->bkgqs", qg, kc) * d**-0.5  # [B, Nkv, G, Q, S]
    j = torch.arange(s, device=q.device)
    visible = j[None, None, :] <= positions[:, :, None]  # [B, Q, S]
    live = positions >= 0  # [B, Q]
    safe = visible | (~live[:, :, None] & (j == 0))
    scores = torch.where(safe[:, None, None], scores, torch.full_like(scores, float("-inf")))
    out = torch.einsum("bkgqs,bksd->bqkgd", scores.softmax(-1), vc)
    out = rearrange(out, "b q k g d -> b q (k g) d")
    return torch.where(live[:, :, None, None], out, torch.zeros_like(out))


def bind_dense(positions: torch.Tensor, cache: DenseKVCache) -> Attend:
    """An `Attend` over `cache` for B requests' Q query rows each at `positions` [B, Q] (q/k/v arrive laid out
    [T = B·Q, heads, D], not yet rotated). `attend.new_cache()` returns the cache with every called layer's
    K/V written (layers not called keep theirs); the input cache is never modified."""
    b, qn = positions.shape
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k = rope_qk(q, k, cos, sin)
        split = lambda x: x.reshape(b, qn, *x.shape[1:])  # noqa: E731  [T, h, D] -> [B, Q, h, D]
        kc = dense_cache_write(cache.k[:, layer], split(k), positions)
        vc = dense_cache_write(cache.v[:, layer], split(v), positions)
        layers[layer] = (kc, vc)
        out = dense_cache_attention(split(q), kc, vc, positions)  # [B, Q, N, D]
        return out.reshape(b * qn, *out.shape[2:])

    def new_cache() -> DenseKVCache:
        ks = [layers[i][0] if i in layers else cache.k[:, i] for i in range(cache.num_layers)]
        vs = [layers[i][1] if i in layers else cache.v[:, i] for i in range(cache.num_layers)]
        return DenseKVCache(k=torch.stack(ks, dim=1), v=torch.stack(vs, dim=1))

    attend.new_cache = new_cache
    return attend


def bind_chain(step: torch.Tensor, cache: ChainKVCache) -> Attend:
    """An `Attend` over a `ChainKVCache` for its R = B·S one-row requests at draft step `step` (0-d int64):
    step 0 writes the shared K/V and attends causally over them; step j >= 1 writes chain slot j - 1 and
    attends over shared positions <= the chain's start plus chain slots < j (`ttt_mask`, as one softmax:
    `fspec.ops.chain_attention`, which keeps O(S·Kc) for the backward pass instead of [B, N, S, S + Kc]).
    Branch-free in `step` (both writes are formed, `where` keeps one). `attend.new_cache()` as `bind_dense`.
    """
    b, kc = cache.k.shape[0], cache.chain_k.shape[3]
    first = step == 0
    chain_slot = torch.arange(kc, device=cache.k.device)  # [Kc]
    layers: dict[int, tuple[torch.Tensor, ...]] = {}

    def write(shared, chain, x):
        # x [R, Nkv, D]: the shared row of position i of sequence b, or chain slot step - 1 of request r
        new_shared = torch.where(first, rearrange(x, "(b s) n d -> b n s d", b=b).to(shared.dtype), shared)
        hit = (chain_slot == step - 1)[None, None, :, None]  # [1, 1, Kc, 1]
        return new_shared, torch.where(hit, x[:, :, None, :].to(chain.dtype), chain)

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k = rope_qk(q, k, cos, sin)
        ks, kch = write(cache.k[:, layer], cache.chain_k[:, layer], k)
        vs, vch = write(cache.v[:, layer], cache.chain_v[:, layer], v)
        layers[layer] = (ks, vs, kch, vch)
        nkv = ks.shape[1]
        qg = rearrange(q, "(b s) (k g) d -> b k g s d", b=b, k=nkv)  # [B, Nkv, G, S, D]
        kd, vd = (rearrange(x, "(b s) k t d -> b k s t d", b=b) for x in (kch, vch))  # [B, Nkv, S, Kc, D]
        out = chain_attention(qg, ks, vs, kd, vd, chain_slot < step)  # the chain's steps 1..step
        return rearrange(out, "b k g s d -> (b s) (k g) d")

    def new_cache() -> ChainKVCache:
        parts = [[layers[i][n] if i in layers else old[:, i] for i in range(cache.num_layers)]
                 for n, old in enumerate((cache.k, cache.v, cache.chain_k, cache.chain_v))]  # fmt: skip
        return ChainKVCache(*(torch.stack(p, dim=1) for p in parts))

    attend.new_cache = new_cache
    return attend
