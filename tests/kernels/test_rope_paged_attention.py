"""rope_paged_attention (RoPE, the new tokens' cache write and the paged attention in one launch) against the
two launches it replaces and against its PyTorch reference, on irregular shapes under the interpreter."""

from __future__ import annotations

import pytest
import torch

import fspec
from fspec.kernels import attention_ops  # noqa: F401  (registers the ops)
from fspec.kernels.paged_attention import (
    AttentionConfig,
    paged_attention,
    rope_paged_attention,
    rope_paged_attention_ref,
)
from fspec.kernels.rope_kv_write import rope_pos_kv_write
from fspec.models import layers as L


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def _cfg(n: int, nkv: int, d: int) -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=32, hidden_size=n * d, intermediate_size=8, num_hidden_layers=2, num_attention_heads=n,
        num_key_value_heads=nkv, head_dim=d, max_position_embeddings=4096, rope_theta=10000.0,
    )  # fmt: skip


def _case(contexts, num_query, n, nkv, d, block_size, dtype, seed):
    """Requests with `contexts[b]` cached tokens (None: a padding request) and `num_query` new tokens each
    at the following positions; a fused q/k/v buffer whose q, k, v views the ops read."""
    gen = torch.Generator().manual_seed(seed)
    b = len(contexts)
    max_blocks = max(-(-((c or 0) + num_query) // block_size) for c in contexts) + 1
    num_blocks = b * max_blocks + 3
    table = torch.randperm(num_blocks, generator=gen)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    positions, slots, seq_lens = [], [], []
    for r, c in enumerate(contexts):
        seq_lens.append(0 if c is None else c + num_query)
        for i in range(num_query):
            p = -1 if c is None else c + i
            positions.append(p)
            slots.append(-1 if p < 0 else int(table[r, p // block_size]) * block_size + p % block_size)
    t = b * num_query
    qkv = torch.randn(t, (n + 2 * nkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([n * d, nkv * d, nkv * d], dim=1)
    q, k, v = q.view(t, n, d), k.view(t, nkv, d), v.view(t, nkv, d)
    shape = (2, num_blocks + 1, block_size, nkv, d)  # two layers, the scratch block
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    meta = dict(
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32) * num_query,
    )
    return q, k, v, torch.tensor(positions), torch.tensor(slots), k_cache, v_cache, meta


CASES = [
    # contexts (None = padding request), num_query, (n, nkv, d), block_size, config
    ([37], 1, (4, 2, 64), 16, AttentionConfig(block_n=16, partition=16)),
    ([5, None, 63, 16], 1, (8, 2, 32), 8, AttentionConfig(block_n=16, partition=32)),
    ([14, 30, 0], 3, (4, 1, 80), 16, AttentionConfig(block_n=16, partition=16)),
    ([29, 46], 4, (6, 2, 64), 16, None),
    ([3, None, 17], 5, (2, 2, 16), 4, AttentionConfig(block_n=8, partition=8, block_m=4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("contexts", "num_query", "heads", "block_size", "config"), CASES)
def test_fused_launch_equals_the_cache_write_then_attention_and_the_reference(
    contexts, num_query, heads, block_size, config, dtype
):
    """Bit for bit the two launches it replaces (rope_pos_kv_write, then paged_attention with the same
    config): every cache byte and every output; new tokens cross block and split boundaries (so several
    programs write and read them), padding requests write and read nothing, M tiles of a few rows each write
    the same keys. Close to the PyTorch reference."""
    n, nkv, d = heads
    q, k, v, positions, slots, k_cache, v_cache, meta = _case(
        contexts, num_query, n, nkv, d, block_size, dtype, seed=len(contexts) * 7 + num_query
    )
    inv_freq = L.rope_inv_freq(_cfg(n, nkv, d), "cpu")
    scale = d**-0.5
    args = (meta["block_table"], meta["seq_lens"], positions, meta["query_start_loc"])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_rot = rope_pos_kv_write(q, k, v, positions, inv_freq, dtype, want_k, want_v, slots, layer=1)
    want = paged_attention(
        q_rot, want_k, want_v, *args, scale=scale, num_query=num_query, layer=1, config=config
    )
    got_k, got_v = k_cache.clone(), v_cache.clone()
    got = rope_paged_attention(
        q, k, v, positions, inv_freq, dtype, got_k, got_v, slots, meta["block_table"], meta["seq_lens"],
        meta["query_start_loc"], scale=scale, num_query=num_query, layer=1, config=config,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == q.shape
    for a, b in ((got_k, want_k), (got_v, want_v), (got, want)):
        assert torch.equal(_bits(a), _bits(b))
    assert not torch.equal(got_k, k_cache)  # the new keys were written
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = rope_paged_attention_ref(
        q, k, v, positions, inv_freq, dtype, ref_k, ref_v, slots, meta["block_table"], meta["seq_lens"],
        meta["query_start_loc"], scale=scale, num_query=num_query, layer=1,
    )  # fmt: skip
    tol = dict(rtol=2**-6, atol=2**-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    torch.testing.assert_close(got_k.float(), ref_k.float(), **tol)
    assert torch.equal(got_v, ref_v)


def test_op_equals_launcher_passes_opcheck_and_refuses_bad_input():
    """The registered op (inverse frequencies from the rope parameters) equals the launcher; opcheck; bad
    shapes, dtypes and query counts are ValueErrors naming the argument."""
    n, nkv, d = 4, 2, 64
    q, k, v, positions, slots, k_cache, v_cache, meta = _case([9, 20], 2, n, nkv, d, 16, torch.float32, 3)
    cfg = _cfg(n, nkv, d)
    inv_freq = L.rope_inv_freq(cfg, "cpu")
    _, rope_type, rope = L.rope_key(cfg)
    tail = (meta["block_table"], meta["seq_lens"], meta["query_start_loc"])
    kw = dict(scale=0.125, num_query=2, layer=0)
    got_k, got_v = k_cache.clone(), v_cache.clone()
    got = rope_paged_attention(q, k, v, positions, inv_freq, torch.float32, got_k, got_v, slots, *tail, **kw)
    op_k, op_v = k_cache.clone(), v_cache.clone()
    op = torch.ops.fspec.rope_paged_attention(
        q, k, v, positions, op_k, op_v, slots, *tail, torch.float32, rope_type, list(rope), **kw
    )
    assert torch.equal(op, got) and torch.equal(op_k, got_k) and torch.equal(op_v, got_v)
    args = (q, k, v, positions, k_cache.clone(), v_cache.clone(), slots, *tail, torch.float32, rope_type)
    torch.library.opcheck(torch.ops.fspec.rope_paged_attention.default, (*args, list(rope)), kw)
    base = (q, k, v, positions, inv_freq, torch.float32, k_cache, v_cache, slots, *tail)
    with pytest.raises(ValueError, match=r"num_query: expected 1..16, got 17"):
        rope_paged_attention(*base, scale=0.125, num_query=17)
    with pytest.raises(ValueError, match=r"positions/inv_freq: expected shapes \[T\] = \[4\]"):
        rope_paged_attention(q, k, v, positions[:3], *base[4:], **kw)
    with pytest.raises(ValueError, match=r"table_dtype: expected one of"):
        rope_paged_attention(*base[:5], torch.float64, *base[6:], **kw)
    with pytest.raises(ValueError, match=r"k/v: expected shape \[T, Nkv, D\]"):
        rope_paged_attention(q, k[:, :1], v[:, :1], *base[3:], **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("num_query", "context"), [(1, 2000), (1, 150), (4, 2000)])
def test_gpu_fused_launch_matches_the_two_launches_and_replays_deterministically(num_query, context):
    """On the GPU at Llama shapes (32/8 heads of 128, bf16, B = 8, block size 16, the default config: many
    splits): the cache and the output as the two launches give them (RoPE's products may contract into FMAs
    differently in the two kernels: one bf16 ulp), and 20 launches give identical bytes (the write-then-read
    inside a program is ordered by its barrier, never raced)."""
    n, nkv, d, bs = 32, 8, 128, 16
    contexts = [context - 37 * i for i in range(8)]
    case = _case(contexts, num_query, n, nkv, d, bs, torch.bfloat16, seed=num_query)
    q, k, v, positions, slots, k_cache, v_cache, meta = (x.cuda() if torch.is_tensor(x) else x for x in case)
    meta = {name: x.cuda() for name, x in meta.items()}
    inv_freq = L.rope_inv_freq(_cfg(n, nkv, d), "cuda")
    tail = (meta["block_table"], meta["seq_lens"], meta["query_start_loc"])
    kw = dict(scale=d**-0.5, num_query=num_query, layer=1)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_rot = rope_pos_kv_write(q, k, v, positions, inv_freq, torch.bfloat16, want_k, want_v, slots, layer=1)
    want = paged_attention(
        q_rot, want_k, want_v, meta["block_table"], meta["seq_lens"], positions, tail[2], **kw
    )
    outs = []
    for _ in range(20):
        got_k, got_v = k_cache.clone(), v_cache.clone()
        got = rope_paged_attention(
            q, k, v, positions, inv_freq, torch.bfloat16, got_k, got_v, slots, *tail, **kw
        )
        outs.append(got)
    torch.cuda.synchronize()
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(got_v, want_v)
    torch.testing.assert_close(got_k.float(), want_k.float(), rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)
