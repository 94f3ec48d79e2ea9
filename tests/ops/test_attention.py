"""Attention backends against a naive per-token loop, and the dense backend's gradients."""

from __future__ import annotations

import math

import pytest
import torch

import fspec
from fspec.core.cache import CONTEXT_QUANTUM, KVCache
from fspec.core.metadata import _first_step_metadata, _slot_mapping
from fspec.ops import attention as attention_module
from fspec.ops.attention import attention, dense_attention, reference_plan


def _cfg(kv_heads: int, head_dim: int) -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=11,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )


def _naive(q, k_cache, v_cache, layer, tables, positions, requests, block_size):
    """Loop over tokens and context positions in float64; GQA as HF's repeat_kv (head n reads n // G)."""
    t, n, d = q.shape
    group = n // k_cache.shape[3]
    out = torch.zeros(t, n, d, dtype=torch.float64)
    for i in range(t):
        p, b = int(positions[i]), int(requests[i])
        if p < 0:
            continue
        slots = [int(tables[b][j // block_size]) * block_size + j % block_size for j in range(p + 1)]
        keys = torch.stack([k_cache[layer].flatten(0, 1)[s] for s in slots]).double()  # [p+1, Nkv, D]
        vals = torch.stack([v_cache[layer].flatten(0, 1)[s] for s in slots]).double()
        for h in range(n):
            scores = keys[:, h // group] @ q[i, h].double() / math.sqrt(d)
            out[i, h] = torch.softmax(scores, 0) @ vals[:, h // group]
    return out


@pytest.mark.parametrize(
    ("seed", "kv_heads", "head_dim", "block_size"), [(0, 3, 4, 3), (1, 1, 6, 5), (2, 2, 8, 1)]
)
@pytest.mark.parametrize("max_query_len", [None, 6])
@pytest.mark.parametrize("backend", ["reference", "paged"])
def test_paged_backends_match_naive_loop(seed, kv_heads, head_dim, block_size, max_query_len, backend):
    """Ragged queries (continuing histories of 5, 0, 10 tokens; a padding request) over scattered blocks with
    GQA: outputs equal the naive loop, new K/V land at their slots, padding rows are zero. "paged" runs the
    registered kernel ops (their PyTorch fallback here; the Triton kernels in tests/kernels)."""
    gen = torch.Generator().manual_seed(seed)
    cfg, layer = _cfg(kv_heads, head_dim), 1
    num_blocks, max_blocks = 60, 12
    cache = KVCache.create(cfg, num_blocks=num_blocks, block_size=block_size)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))  # history (and garbage elsewhere)
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    history, new = [5, 0, 0, 10], [3, 6, 0, 1]
    positions = [h + j for h, n in zip(history, new) for j in range(n)]
    positions = positions[:9] + [-1, -1] + positions[9:]  # two padding tokens in the padding request
    counts = [3, 6, 2, 1]
    tables = torch.randperm(num_blocks, generator=gen)[: 4 * max_blocks].view(4, max_blocks).to(torch.int32)
    used = [-(-(h + n) // block_size) for h, n in zip(history, new)]
    for b in range(4):
        tables[b, used[b] :] = -1  # unallocated tail
    pos = torch.tensor(positions)
    requests = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    meta = fspec.AttnMetadata(
        positions=pos,
        query_start_loc=torch.tensor([0, 3, 9, 11, 12], dtype=torch.int32),
        seq_lens=torch.tensor([h + n for h, n in zip(history, new)], dtype=torch.int32),
        block_table=tables,
        slot_mapping=_slot_mapping(tables, pos, block_size, requests),
    )
    t, n = pos.shape[0], 2 * kv_heads
    q = torch.randn(t, n, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    live_blocks_before = cache.k[:, :num_blocks].clone()
    out, out_cache = attention(
        q, k, v, meta, cache, layer=layer, max_query_len=max_query_len, backend=backend
    )
    assert out_cache is cache and out.shape == (t, n, head_dim)
    flat_k = cache.k[layer].flatten(0, 1)
    for i, s in enumerate(meta.slot_mapping.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[i])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[meta.slot_mapping[meta.slot_mapping >= 0]] = True
    untouched = ~written.view(num_blocks, block_size)
    assert torch.equal(cache.k[layer, :num_blocks][untouched], live_blocks_before[layer][untouched])
    assert torch.equal(cache.k[0, :num_blocks], live_blocks_before[0])  # other layers untouched
    want = _naive(q, cache.k, cache.v, layer, tables.tolist(), pos, requests, block_size)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[9:11], torch.zeros(2, n, head_dim))


def test_reference_backend_max_context_reads_only_what_it_needs():
    """A static max_context >= every seq_len gives the same result as the full table capacity."""
    gen = torch.Generator().manual_seed(4)
    cfg = _cfg(2, 4)
    cache = KVCache.create(cfg, num_blocks=16, block_size=2)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    tables = torch.arange(16, dtype=torch.int32).view(2, 8)
    meta = fspec.decode_metadata(torch.tensor([4, 6]), tables, block_size=2)
    q = torch.randn(2, 4, 4, generator=gen)
    kv = torch.randn(2, 2, 4, generator=gen)
    full, _ = attention(q, kv, kv, meta, cache, layer=0, max_query_len=1)
    short, _ = attention(q, kv, kv, meta, cache, layer=0, max_query_len=1, max_context=7)
    torch.testing.assert_close(full, short)
    cut, _ = attention(q, kv, kv, meta, cache, layer=0, max_query_len=1, max_context=4)  # too short: differs
    assert not torch.allclose(full, cut)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "history", "live"), [(3, 64, 50, 6), (2, 8, 9, 4), (1, 4, 0, 1)]
)
def test_lone_request_context_past_the_cache_end_equals_the_gather(
    monkeypatch, dtype, kv_heads, head_dim, history, live
):
    """Several query rows of one request read a 512-key context over a cache of few blocks: the plan reads
    the blocks holding its keys into zeroed buffers instead of gathering 32 blocks (most of them the scratch
    block, holding garbage here), and the output and the cache equal the gather's bit for bit (padding rows
    past `live` included). The plan's float mask is SDPA's own conversion of the bool one."""
    gen = torch.Generator().manual_seed(history + kv_heads)
    cfg, layer, bs, q_rows = _cfg(kv_heads, head_dim), 1, 16, 6
    cache = KVCache.create(cfg, num_blocks=6, block_size=bs, dtype=dtype)  # 96 positions, table of 512
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))  # history, and garbage in the scratch block
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    width = CONTEXT_QUANTUM // bs
    table = torch.full((1, width), -1, dtype=torch.int32)
    table[0, :5] = torch.arange(5, dtype=torch.int32)  # blocks 0..4, in order, as the allocator hands them
    meta = _first_step_metadata(
        torch.tensor([history]), torch.tensor([live]), table, num_query=q_rows, block_size=bs
    )
    n = 3 * kv_heads
    q = torch.randn(q_rows, n, head_dim, generator=gen).to(dtype)
    k = torch.randn(q_rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(q_rows, kv_heads, head_dim, generator=gen).to(dtype)
    plan = reference_plan(meta, cache, max_query_len=q_rows)
    assert plan.first_block == 0 and plan.context is not None and plan.visible.shape[-1] == CONTEXT_QUANTUM
    assert plan.context[2] == -(-(history + live) // bs)  # the blocks up to the last query's position
    fast_cache = KVCache(k=cache.k.clone(), v=cache.v.clone())
    fast, _ = attention(q, k, v, meta, fast_cache, layer=layer, max_query_len=q_rows)
    monkeypatch.setattr(attention_module, "_first_block_in_place", lambda *args: None)
    assert reference_plan(meta, cache, max_query_len=q_rows).first_block is None
    gathered, _ = attention(q, k, v, meta, cache, layer=layer, max_query_len=q_rows)
    assert torch.equal(fast, gathered)
    assert torch.equal(fast_cache.k, cache.k) and torch.equal(fast_cache.v, cache.v)
    assert torch.equal(fast[live:], torch.zeros_like(fast[live:]))
    # the additive mask gives SDPA's result with the bool mask, padding rows (key 0 opened) included
    qh = q.view(1, q_rows, n, head_dim).transpose(1, 2)
    kh = torch.randn(1, kv_heads, CONTEXT_QUANTUM, head_dim, generator=gen).to(dtype)
    vh = torch.randn(1, kv_heads, CONTEXT_QUANTUM, head_dim, generator=gen).to(dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with_bool = sdpa(qh, kh, vh, attn_mask=plan.visible, enable_gqa=True)
    assert torch.equal(sdpa(qh, kh, vh, attn_mask=plan.mask, enable_gqa=True), with_bool)


def test_dense_attention_matches_naive_and_masks_rows_to_zero():
    """GQA dense attention with an explicit mask equals the naive softmax; a row that sees nothing is 0."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 5, 6, 4, generator=gen),
        torch.randn(2, 7, 3, 4, generator=gen),
        torch.randn(2, 7, 3, 4),
    )
    mask = torch.rand(2, 5, 7, generator=gen) > 0.4
    mask[1, 2] = False
    out = dense_attention(q, k, v, mask=mask)
    scores = torch.einsum("bsnd,btnd->bnst", q, k.repeat_interleave(2, dim=2)) / 2.0
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1).nan_to_num(0.0)
    want = torch.einsum("bnst,btnd->bsnd", probs, v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, 2], torch.zeros(6, 4))


def test_dense_attention_takes_mixed_dtypes_under_autocast_only():
    """bf16 autocast gives bf16 v with fp32 q/k (RoPE promotes them): accepted inside autocast, where SDPA
    casts them (the TTT loss trains this way on CUDA), and a ValueError naming v outside it."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 4, 8, generator=gen), torch.randn(2, 5, 2, 8, generator=gen)
    v = torch.randn(2, 5, 2, 8, generator=gen).bfloat16()
    mask = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="^v: expected q's dtype torch.float32"):
        dense_attention(q, k, v)
    want = dense_attention(q, k, v.float())
    for m in (None, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = dense_attention(q, k, v, mask=m)
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


def test_dense_backend_gradients_flow_and_stay_finite():
    """Gradients reach q, k and v through the dense path, finite even with a fully masked row."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 4, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 4, 2, 8, generator=gen, requires_grad=True)
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    mask[0] = False
    (dense_attention(q, k, v, mask=mask[None]) ** 2).sum().backward()
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(x.grad).all(), name
        assert x.grad.abs().sum() > 0, name
    assert torch.equal(q.grad[0, 0], torch.zeros(4, 8))  # the masked row contributes nothing
    causal = dense_attention(q, k, v)
    torch.testing.assert_close(
        causal[:, 1:], dense_attention(q, k, v, mask=torch.tril(torch.ones(4, 4)).bool())[:, 1:]
    )


def test_dense_flat_backend_is_differentiable_and_leaves_cache_alone():
    """backend="dense" over flat tokens gives gradients and returns the cache it was given, unread."""
    gen = torch.Generator().manual_seed(2)
    meta = fspec.decode_metadata(torch.tensor([0, 3]), torch.zeros(2, 1, dtype=torch.int32), block_size=4)
    q = torch.randn(2, 2, 4, generator=gen, requires_grad=True)
    kv = torch.randn(2, 1, 4, generator=gen, requires_grad=True)
    sentinel = object()
    out, cache = attention(q, kv, kv, meta, sentinel, layer=0, backend="dense")
    assert cache is sentinel
    out.sum().backward()
    assert torch.isfinite(kv.grad).all() and kv.grad.abs().sum() > 0
    torch.testing.assert_close(out, kv.expand(2, 2, 4))  # one visible key each: its own value
