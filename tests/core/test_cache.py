"""Paged KV cache buffers, the branch-free write, and the engine's block allocator."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import fspec
from fspec.core.cache import BlockAllocator, KVCache, block_table_row, blocks_needed, write_kv


@pytest.fixture
def cfg() -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=11,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
    )


def test_create_allocates_one_scratch_block_and_two_leaves(cfg):
    """[L, num_blocks + 1, block_size, Nkv, D] for K and V; both pytree registries see just those leaves."""
    cache = KVCache.create(cfg, num_blocks=5, block_size=4, dtype=torch.bfloat16)
    assert cache.k.shape == cache.v.shape == (3, 6, 4, 2, 6) and cache.k.dtype == torch.bfloat16
    assert (cache.num_blocks, cache.block_size, cache.num_layers) == (5, 4, 3)
    assert torch_pytree.tree_leaves(cache) == [cache.k, cache.v]
    assert optree.tree_leaves(cache, namespace="fspec") == [cache.k, cache.v]
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache.create(cfg, num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        KVCache.create(cfg, num_blocks=2, block_size=2.0)


def test_write_skips_minus_one_slots_without_touching_live_blocks(cfg):
    """Slots -1 change no live block of any layer; real slots get exactly their rows; writes are in place."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache.create(cfg, num_blocks=4, block_size=3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    ptr = cache.k.data_ptr()
    slots = torch.tensor([-1, 7, -1, 0, 11, -1])
    k, v = torch.randn(6, 2, 6, generator=gen), torch.randn(6, 2, 6, generator=gen)
    out = write_kv(cache, 1, k, v, slots)
    assert out is cache and cache.k.data_ptr() == ptr
    live_k = cache.k[:, :4].flatten(1, 2)  # [L, 12 slots, Nkv, D]
    want_k = before_k[:, :4].flatten(1, 2).clone()
    want_v = before_v[:, :4].flatten(1, 2).clone()
    want_k[1, [7, 0, 11]] = k[[1, 3, 4]]
    want_v[1, [7, 0, 11]] = v[[1, 3, 4]]
    assert torch.equal(live_k, want_k) and torch.equal(cache.v[:, :4].flatten(1, 2), want_v)
    assert not torch.equal(cache.k[1, 4], before_k[1, 4])  # the -1 rows went to the scratch block


def test_write_of_only_padding_changes_no_live_block(cfg):
    """A batch of all-padding tokens leaves every live block bit-identical."""
    cache = KVCache.create(cfg, num_blocks=2, block_size=2)
    cache.k.normal_()
    live = cache.k[:, :2].clone()
    write_kv(cache, 0, torch.ones(3, 2, 6), torch.ones(3, 2, 6), torch.full((3,), -1))
    assert torch.equal(cache.k[:, :2], live)


def test_allocator_hands_out_every_block_once_and_never_the_scratch_block():
    """allocate/free bookkeeping: all ids in [0, num_blocks), none twice, reuse after free."""
    alloc = BlockAllocator(5)
    first = alloc.allocate(3)
    rest = alloc.allocate(2)
    assert sorted(first + rest) == [0, 1, 2, 3, 4] and alloc.num_free == 0
    alloc.free(first[:2])
    assert alloc.num_free == 2 and sorted(alloc.allocate(2)) == sorted(first[:2])
    assert alloc.allocate(0) == []


def test_allocator_errors_on_exhaustion_and_double_free():
    """Out of blocks and double or foreign frees raise ValueError and change nothing."""
    alloc = BlockAllocator(3)
    ids = alloc.allocate(2)
    with pytest.raises(ValueError, match="out of blocks"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.free([ids[0]])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([ids[0]])
    with pytest.raises(ValueError, match="listed twice"):
        alloc.free([ids[1], ids[1]])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([3])  # the scratch block's index is never a valid id
    assert alloc.num_free == 2
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    with pytest.raises(ValueError, match="n: expected"):
        alloc.allocate(-1)


def test_block_table_row_pads_with_minus_one():
    """A request's row lists its blocks in order, then -1; too many blocks raise ValueError."""
    row = block_table_row([4, 0, 2], max_blocks=5)
    assert row.dtype == torch.int32 and row.tolist() == [4, 0, 2, -1, -1]
    assert blocks_needed(9, 4) == 3 and blocks_needed(8, 4) == 2 and blocks_needed(0, 4) == 0
    with pytest.raises(ValueError, match="max_blocks=2"):
        block_table_row([1, 2, 3], max_blocks=2)


@pytest.mark.parametrize("kind", ["paged", "dense", "chain"])
def test_every_cache_constructor_refuses_bad_sizes_and_non_float_dtypes(kind, tiny_model_cfg):
    """KVCache, DenseKVCache and ChainKVCache share their checks: a non-config, a size that is not a positive
    int, and an integer dtype are refused by name (ChainKVCache used to take an integer dtype)."""
    from fspec.core.cache import ChainKVCache, DenseKVCache, KVCache

    make = {
        "paged": lambda cfg, n=2, **kw: KVCache.create(cfg, num_blocks=n, block_size=4, **kw),
        "dense": lambda cfg, n=2, **kw: DenseKVCache.create(cfg, batch_size=n, max_len=8, **kw),
        "chain": lambda cfg, n=2, **kw: ChainKVCache.create(cfg, batch_size=n, seq_len=8, chain_len=3, **kw),
    }[kind]
    assert make(tiny_model_cfg).k.dtype == torch.float32
    with pytest.raises(ValueError, match=r"^cfg: expected a ModelConfig, got dict"):
        make({})
    with pytest.raises(ValueError, match=r"expected a positive int, got 0"):
        make(tiny_model_cfg, n=0)
    with pytest.raises(
        ValueError, match=r"^dtype: expected a floating-point torch.dtype for K/V, got torch.int8"
    ):  # noqa: E501
        make(tiny_model_cfg, dtype=torch.int8)
