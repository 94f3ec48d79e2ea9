"""Paged KV cache: device buffers written in place, and the engine's host-side block allocator.

Layout: one K and one V tensor of shape [L, num_blocks + 1, block_size, Nkv, D]. Stacking the layers gives the
whole cache two leaves (not 2L): allocated once, two `mark_static_address` calls, one handle to donate; a
layer's buffer is the view `k[layer]`, written with `index_copy_` on its flattened view — never a functional
copy of the cache (a full copy per step; docs/compile-facts.md: 129 vs 153 µs/step for a static vs an unmarked
256 MB cache).

The extra block (index `num_blocks`) is scratch: no request owns it (`BlockAllocator` never hands it out).
Tokens whose slot is -1 (padding) are redirected there, so the write is one branch-free `index_copy_` that
never touches a live block; gathers of unallocated block-table entries (-1) also read it.
"""

from __future__ import annotations

import torch

from fspec.core.config import ModelConfig
from fspec.core.pytree import pytree_dataclass


def _zeros_for(cfg: object, dtype: object, device, **sizes: object):
    """The shared checks of the caches' `create` (cfg a ModelConfig, every size a positive int, dtype a
    floating-point torch.dtype), then a function making zeroed K/V buffers of a shape in that dtype on
    `device`."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a ModelConfig, got {type(cfg).__name__}")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point torch.dtype for K/V, got {dtype!r}")
    return lambda shape: torch.zeros(shape, dtype=dtype, device=device)


@pytree_dataclass
class KVCache:
    """K/V buffers of every layer of one model.

    Attributes:
        k: [L, num_blocks + 1, block_size, Nkv, D]; block `num_blocks` is the scratch block.
        v: same shape and dtype as `k`.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the scratch block not counted); also the scratch block's index."""
        return self.k.shape[1] - 1

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """Zeroed buffers for `cfg`'s layers, KV heads and head dim, plus one scratch block."""
        zeros = _zeros_for(cfg, dtype, device, num_blocks=num_blocks, block_size=block_size)
        shape = (cfg.num_hidden_layers, num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        return cls(k=zeros(shape), v=zeros(shape))


@pytree_dataclass
class DenseKVCache:
    """A functional K/V cache: one dense row of `max_len` positions per request, updated out of place.

    The paged `KVCache` is for serving (written in place, donated); this one is for training and research:
    a step returns a NEW cache (`torch.where` over a position one-hot), so `draft_step` / `propose` over it
    are pure functions that compose with `torch.func.grad`, `vmap` and `torch.compile`. Request b's K/V of
    position j lie at `k[b, :, :, j]`; no block table, no slots (the state's metadata still carries them, and
    they are ignored on this path).

    Attributes:
        k: [B, L, Nkv, max_len, D]; position j of request b at k[b, layer, :, j] (zeros before it is written).
        v: same shape and dtype as `k`.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        *,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> DenseKVCache:
        """Zeroed [B, L, Nkv, max_len, D] buffers for `cfg`'s layers, KV heads and head dim."""
        zeros = _zeros_for(cfg, dtype, device, batch_size=batch_size, max_len=max_len)
        shape = (batch_size, cfg.num_hidden_layers, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(k=zeros(shape), v=zeros(shape))


@pytree_dataclass
class ChainKVCache:
    """The dense cache of EAGLE-3's training-time test: B sequences of S positions, each position forking its
    own chain of K drafts, updated out of place like `DenseKVCache`.

    The draft state over it has R = B·S requests of one row each, request r = b·S + i being the chain that
    starts at position i of sequence b. Step 0 writes every request's K/V into the shared `k` / `v` at its
    position and attends causally there; step j >= 1 writes `chain_k[r, :, :, j - 1]` and attends over the
    shared positions <= i plus its own chain's steps 1..j (`fspec.train.ttt.ttt_mask`).

    Attributes:
        k: [B, L, Nkv, S, D], the sequences' step-0 K/V.
        v: same shape and dtype as `k`.
        chain_k: [B·S, L, Nkv, K, D], each chain's own K/V of steps 1..K (slot j - 1 for step j).
        chain_v: same shape and dtype as `chain_k`.
    """

    k: torch.Tensor
    v: torch.Tensor
    chain_k: torch.Tensor
    chain_v: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        *,
        batch_size: int,
        seq_len: int,
        chain_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> ChainKVCache:
        """Zeroed buffers for B = batch_size sequences of seq_len positions and chains of chain_len drafts."""
        sizes = dict(batch_size=batch_size, seq_len=seq_len, chain_len=chain_len)
        zeros = _zeros_for(cfg, dtype, device, **sizes)
        lay, nkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        shared, chain = (batch_size, lay, nkv, seq_len, d), (batch_size * seq_len, lay, nkv, chain_len, d)
        return cls(k=zeros(shared), v=zeros(shared), chain_k=zeros(chain), chain_v=zeros(chain))


def check_dense_cache(
    cache: object, *, cfg: ModelConfig, batch_size: int, device: torch.device, name: str = "cache"
) -> None:
    """ValueError naming `name` unless `cache` is a DenseKVCache of `batch_size` requests laid out for `cfg`
    on `device` (shapes, dtypes and devices only: safe under torch.func transforms)."""
    if not isinstance(cache, DenseKVCache):
        raise ValueError(f"{name}: expected a DenseKVCache, got {type(cache).__name__}")
    k, v = cache.k, cache.v
    if (
        not isinstance(k, torch.Tensor)
        or not isinstance(v, torch.Tensor)
        or k.dim() != 5
        or k.shape != v.shape
    ):
        raise ValueError(f"{name}: expected k and v of one shape [B, L, Nkv, max_len, D]")
    want = (batch_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    got = (k.shape[0], k.shape[1], k.shape[2], k.shape[4])
    if got != want:
        raise ValueError(f"{name}: expected (requests, layers, kv heads, head_dim) = {want}, got {got}")
    if not k.is_floating_point() or k.dtype != v.dtype:
        raise ValueError(f"{name}: expected k and v of one float dtype, got {k.dtype} and {v.dtype}")
    if k.device != device or v.device != device:
        raise ValueError(f"{name}: expected device {device}, got {k.device}")


def check_cache(
    cache: object, *, cfg: ModelConfig, block_size: int, device: torch.device, name: str = "cache"
) -> None:
    """ValueError naming `name` unless `cache` is a KVCache laid out for `cfg` and `block_size` on `device`.

    A cache with another block size would silently take every slot at the wrong place (slots are computed
    with the config's block size, the buffer is indexed with its own).
    """
    if not isinstance(cache, KVCache):
        raise ValueError(f"{name}: expected a KVCache, got {type(cache).__name__}")
    want = (cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)
    k, v = cache.k, cache.v
    if (
        not isinstance(k, torch.Tensor)
        or not isinstance(v, torch.Tensor)
        or k.dim() != 5
        or k.shape != v.shape
    ):
        raise ValueError(f"{name}: expected k and v of one shape [L, num_blocks + 1, block_size, Nkv, D]")
    got = (k.shape[0], k.shape[2], k.shape[3], k.shape[4])
    if got != want:
        raise ValueError(
            f"{name}: expected (layers, block_size, kv heads, head_dim) = {want} (the config's), got {got}"
        )
    if k.device != device or v.device != device:
        raise ValueError(f"{name}: expected device {device}, got {k.device}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"{name}: expected contiguous k and v buffers (written in place), got strided ones")


def mark_static(cache: KVCache) -> KVCache:
    """Give the buffers static addresses, so a CUDA graph that writes them is not skipped. Returns `cache`."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected a KVCache, got {type(cache).__name__}")
    torch._dynamo.mark_static_address(cache.k)
    torch._dynamo.mark_static_address(cache.v)
    return cache


def write_kv(
    cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> KVCache:
    """Write k/v [T, Nkv, D] of `layer` at `slot_mapping` [T] in place; slot -1 goes to the scratch block.

    Donates `cache`: the buffers are mutated and the same object is returned. Eager calls validate (ValueError
    naming the argument): layer in [0, L), k/v of the cache's head shape on its device, int64 slots in
    [-1, num_blocks * block_size), no live slot twice (two writes to one slot race on the GPU).
    """
    if not torch.compiler.is_compiling():
        _check_write(cache, layer, k, v, slot_mapping)
    return _write_kv(cache, layer, k, v, slot_mapping)


def _check_write(cache, layer, k, v, slot_mapping) -> None:
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected a KVCache, got {type(cache).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cache.num_layers:
        raise ValueError(f"layer: expected an int in [0, {cache.num_layers}), got {layer!r}")
    nkv, d = cache.k.shape[3], cache.k.shape[4]
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (nkv, d):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected shape [T, {nkv}, {d}] (the cache's Nkv, D), got {got}")
        if not x.is_floating_point() or x.device != cache.k.device:
            raise ValueError(
                f"{name}: expected a float tensor on {cache.k.device}, got {x.dtype} on {x.device}"
            )
    t = k.shape[0]
    if v.shape[0] != t:
        raise ValueError(f"v: expected {t} rows (k's T), got {v.shape[0]}")
    if (
        not isinstance(slot_mapping, torch.Tensor)
        or tuple(slot_mapping.shape) != (t,)
        or slot_mapping.dtype != torch.int64
        or slot_mapping.device != cache.k.device
    ):
        got = (
            f"shape {tuple(slot_mapping.shape)}, {slot_mapping.dtype} on {slot_mapping.device}"
            if isinstance(slot_mapping, torch.Tensor)
            else type(slot_mapping).__name__
        )
        raise ValueError(f"slot_mapping: expected a [{t}] int64 tensor on {cache.k.device}, got {got}")
    hi = cache.num_blocks * cache.block_size
    bad = (slot_mapping < -1) | (slot_mapping >= hi)
    if bool(bad.any()):
        raise ValueError(
            f"slot_mapping: expected slots in [-1, {hi}) ({cache.num_blocks} blocks of {cache.block_size}), "
            f"got {slot_mapping[bad][:4].tolist()}"
        )
    live = slot_mapping[slot_mapping >= 0]
    if live.unique().numel() != live.numel():
        raise ValueError(
            f"slot_mapping: expected distinct slots for live tokens, got repeats in {live.tolist()[:8]}"
        )


def _write_kv(
    cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> KVCache:
    """`write_kv` without validation (branch-free; inside the attention backends)."""
    scratch = cache.num_blocks * cache.block_size  # first slot of the scratch block
    slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, scratch), slot_mapping)
    cache.k[layer].flatten(0, 1).index_copy_(0, slots, k.to(cache.k.dtype))
    cache.v[layer].flatten(0, 1).index_copy_(0, slots, v.to(cache.v.dtype))
    return cache


class BlockAllocator:
    """Host-side free list of cache blocks for the engine (plain Python, never called in compiled code).

    Hands out ids in [0, num_blocks); the scratch block (`num_blocks`) is never handed out. Freed blocks are
    reused last-freed-first.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n block ids; ValueError (nothing allocated) when fewer than n are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected a non-negative int, got {n!r}")
        if n > len(self._free):
            raise ValueError(
                f"n: expected at most {len(self._free)} free blocks (of {self.num_blocks}), "
                f"got {n}: out of blocks"
            )
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Return blocks; ValueError (nothing freed) on an id not allocated, or listed twice."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(
                f"ids: expected allocated block ids, each once; got {bad or dup} "
                f"({'not allocated (double free?)' if bad else 'listed twice'})"
            )
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))


# Contexts the attention reads are cut in quanta that keep PyTorch's CPU attention (torch 2.13,
# `scaled_dot_product_attention` with a mask) bit-identical to reading the whole table, whose extra keys are
# masked: 512 keys for requests of several query rows (a prefill, a verification, a round's first draft step),
# 16 for one query row (decode and later draft steps). Measured on this CPU: of 176 (rows, length) cases,
# cuts at multiples of 16, 32, 64 and 128 keys changed 30, 20, 20 and 10 of the multi-row outputs by an ulp
# (256 and 512: none); one-row outputs were equal at multiples of 16 in all 348 cases (cut at the exact
# length, in only 36: the vectorised reductions take 16 floats at a time). tests/serve/test_real_length.py
# checks.
CONTEXT_QUANTUM = 512
DECODE_CONTEXT_QUANTUM = 16


def table_width(num_tokens: int, *, block_size: int, max_blocks: int) -> int:
    """Blocks of a block table for requests of at most `num_tokens` tokens: a power-of-two number of
    CONTEXT_QUANTUM-token quanta (whole quanta: compiled attention over the table gives the full table's
    results; a power of two: compiled graphs, one per width, stay few, at most 5 up to 8192 positions), at
    least one, capped at `max_blocks` (what max_model_len allows).

    Attention reads the whole table where it cannot read lengths on the host (compiled code, the GPU
    kernels' launch grid): a table sized for max_model_len made every step of a 125-token request on an
    8192-position model attend over 8192 positions."""
    for name, value, low in (("num_tokens", num_tokens, 0), ("block_size", block_size, 1),
                             ("max_blocks", max_blocks, 1)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    quanta = max(-(-num_tokens // CONTEXT_QUANTUM), 1)
    quanta = 1 << (quanta - 1).bit_length()  # the power of two >= quanta
    return min(-(-quanta * CONTEXT_QUANTUM // block_size), max_blocks)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (num_tokens >= 0, block_size > 0)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    return -(-num_tokens // block_size)


def block_table_row(
    block_ids: list[int], *, max_blocks: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_blocks] int32: a request's blocks in order, then -1 (unallocated)."""
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks <= 0:
        raise ValueError(f"max_blocks: expected a positive int, got {max_blocks!r}")
    block_ids = list(block_ids)
    bad = [i for i in block_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31]
    if bad:
        raise ValueError(f"block_ids: expected block ids in [0, 2^31) (from a BlockAllocator), got {bad[:4]}")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"block_ids: expected each block once, got {block_ids}")
    if len(block_ids) > max_blocks:
        raise ValueError(f"block_ids: expected at most max_blocks={max_blocks} ids, got {len(block_ids)}")
    row = torch.full((max_blocks,), -1, dtype=torch.int32)
    row[: len(block_ids)] = torch.tensor(list(block_ids), dtype=torch.int32)
    return row.to(device)
