"""Attention behind one pure signature, with two backends that need no custom kernel.

    attention(q [T, N, D], k [T, Nkv, D], v [T, Nkv, D], meta, cache, *, layer, backend)
        -> (out [T, N, D], cache)

* ``"reference"`` (paged): writes this call's K/V into `cache` at `meta.slot_mapping` (slot -1 = padding, not
  written; see `fspec.core.cache.write_kv`), gathers each request's blocks from `meta.block_table` up to a
  static context length, and runs masked SDPA where the query at position p of request b sees cache positions
  <= p of b. The cache is donated: written in place and returned (the same object). Run eagerly on the CPU it
  reads only what the longest request reaches (`context_blocks`), and a lone request's blocks where they lie
  (`_first_block_in_place`; the blocks that hold its keys, copied into a zeroed buffer, where its context runs
  past the cache's end); a model's forward derives the gather indices and masks once for all its layers
  (`reference_plan`).
* ``"paged"``: the same contract through the Triton kernels of kernels/paged_attention.py (registered ops;
  on a CPU tensor they run their own PyTorch reference). ``"auto"`` (the default everywhere) picks "paged"
  for a CUDA cache and "reference" otherwise.
* ``"dense"``: attention among this call's T tokens only (same request, key position <= query position), no
  cache read or write; differentiable. `dense_attention` is the batched `[B, S]` form for training.

Model layers reach attention through `bind` (or `causal`, or fspec/ops/dense_cache.py's): an `Attend` that
takes q and k *before* RoPE, with the cos/sin of their positions, so a backend can fuse the rotation into work
it does anyway. The "paged" one rotates q and k inside its cache-write kernel (`fspec::rope_kv_write`: one
launch per layer instead of the write plus the pointwise kernels Inductor emitted around it); the others call
`apply_rope` first, the ops the layers ran before. `attention` itself takes rotated q and k.

GQA everywhere: query head n reads KV head n // (N / Nkv), as HF's `repeat_kv`. Padding queries (position -1)
return zeros. Compile-friendly: fixed shapes, integer gathers, no `.item()`, no boolean-mask indexing, no
Python branch on tensor values (the eager CPU reference reads lengths on the host, where that is free; traced,
it keeps the table's static width).

Why queries are padded to [B, max_query_len]: gathering the context once per *request* costs B·C·Nkv·D
elements, once per *token* T·C·Nkv·D (a 2k-token prefill at C = 2k, 8 KV heads of 128 in bf16 would gather
8.6 GB). Decode passes max_query_len = 1, the first draft step K + 1, a prefill its bucket.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange

from fspec.core.cache import CONTEXT_QUANTUM, DECODE_CONTEXT_QUANTUM, KVCache
from fspec.core.metadata import token_requests
from fspec.core.state import AttnMetadata, _expect, check_positive_int, validate_attn_metadata
from fspec.kernels import ops as kops
from fspec.kernels.qkv_rope_write import supports as qkv_rope_supports

BACKENDS = ("auto", "paged", "reference", "dense")

#: attend(q [..., N, D], k [..., Nkv, D], v [..., Nkv, D], layer, cos [..., D], sin [..., D]) -> [..., N, D]:
#: what a model's layers call. q and k are NOT rotated yet: the attend applies RoPE with cos/sin
#: (rotate-half), itself or fused into a kernel.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., heads, D] by cos/sin [..., D] (rotate-half convention), in x's and cos's dtypes."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by cos/sin: what an `Attend` that does not fuse RoPE runs first."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for this device type (False where autocast does not exist, e.g. "meta")."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A context with autocast off for this device type (a no-op where autocast does not exist)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [B, N, Q, D], k/v [B, Nkv, C, D], visible [B, 1, Q, C] bool -> [B, N, Q, D]; blind rows give 0.

    A row with no visible key would give NaN (softmax of all -inf), and NaN leaks into gradients even through
    `where`; such rows are allowed key 0 and their output is zeroed afterwards.
    """
    row_live = visible.any(dim=-1, keepdim=True)  # [B, 1, Q, 1]
    first = torch.arange(visible.shape[-1], device=visible.device) == 0
    safe = visible | (~row_live & first)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, enable_gqa=True)
    return torch.where(row_live, out, torch.zeros_like(out))


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Differentiable attention over explicit q [B, S, N, D], k/v [B, Sk, Nkv, D] -> [B, S, N, D].

    mask: bool, True = may attend, broadcastable to [B, S, Sk]; None = causal (S == Sk). Rows with no
    visible key return zeros. Eager calls check shapes, dtypes and devices (no value checks).
    """
    if not torch.compiler.is_compiling():
        _check_dense(q, k, v, mask)
    qh = rearrange(q, "b s n d -> b n s d")
    kh = rearrange(k, "b s n d -> b n s d")
    vh = rearrange(v, "b s n d -> b n s d")
    if mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        visible = mask.expand(q.shape[0], q.shape[1], k.shape[1])[:, None]  # [B, 1, S, Sk]
        out = _sdpa(qh, kh, vh, visible)
    return rearrange(out, "b n s d -> b s n d")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttnMetadata,
    cache: KVCache | None,
    *,
    layer: int,
    backend: str = "auto",
    max_query_len: int | None = None,
    max_context: int | None = None,
) -> tuple[torch.Tensor, KVCache | None]:
    """Attention of T query tokens of B requests; see the module docstring. Returns (out [T, N, D], cache).

    max_query_len: static bound on any request's query count (default T). max_context: static bound on any
    request's seq_len (default: the block table's capacity); keys beyond it are not read (a smaller value is
    allowed and documented: it truncates the context).

    Eager calls validate (ValueError naming the argument): q [T, N, D], k/v [T, Nkv, D] with N % Nkv == 0,
    one float dtype and device; for the cached backends a KVCache of that head shape, `layer` in [0, L),
    `meta` valid for the cache (`validate_attn_metadata` with its block size and block count), and
    max_query_len >= every request's query count. The model layers call `_attention`, unvalidated.
    """
    if not torch.compiler.is_compiling():
        _check_attention(q, k, v, meta, cache, layer, backend, max_query_len, max_context)
    return _attention(
        q,
        k,
        v,
        meta,
        cache,
        layer=layer,
        backend=backend,
        max_query_len=max_query_len,
        max_context=max_context,
    )


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttnMetadata,
    cache: KVCache | None,
    *,
    layer: int,
    backend: str = "auto",
    max_query_len: int | None = None,
    max_context: int | None = None,
) -> tuple[torch.Tensor, KVCache | None]:
    """`attention` without validation (what the models' layers call, once per layer)."""
    backend = resolve_backend(backend, cache)
    if backend == "paged":
        return _paged_kernels(q, k, v, meta, cache, layer=layer, max_query_len=max_query_len), cache
    if backend == "reference":
        return paged_attention(
            q, k, v, meta, cache, layer=layer, max_query_len=max_query_len, max_context=max_context
        )
    if backend == "dense":
        return _dense_over_tokens(q, k, v, meta), cache
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, cache: KVCache | None) -> str:
    """ "auto" is the Triton "paged" kernels for a CUDA cache and the PyTorch "reference" otherwise."""
    if backend == "auto":
        return "paged" if isinstance(cache, KVCache) and cache.k.is_cuda else "reference"
    return backend


def _paged_qkv_rope(
    x: torch.Tensor,
    w: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    layer: int,
    table_dtype: torch.dtype,
    *,
    meta: AttnMetadata,
    cache: KVCache,
    rope_params: tuple,
    max_query_len: int | None = None,
) -> torch.Tensor | None:
    """The paged attention of rows whose q/k/v come from `fspec::qkv_rope_write` (x [T, K] through the
    fused projection w, RMSNorm first with norm_weight; one launch fewer per layer than the product then
    `fspec::rope_pos_kv_write`: target-only decoding +2% on the H200, runs t, u of table `switches`): out
    [T, N, D] in x's dtype; None where that path does not apply (rows the kernel does not take,
    kernels/qkv_rope_write.py `supports`; the cache's dtype not x's): the caller then projects and attends
    as usual. A request has at most min(T, max_query_len) query rows (one row: one, whatever the bound). The
    attention loads its old K/V rows before its PDL wait (`early_kv`: the launch right before wrote only q
    and the new rows) and lets the o projection after it start before its own wait (`early_release`), as
    `_paged_kernels` does."""
    d, nkv = cache.k.shape[-1], cache.k.shape[-2]
    if not qkv_rope_supports(x.shape[0], d) or cache.k.dtype != x.dtype:
        return None
    qkv = kops.qkv_rope_write(
        x, w, norm_weight, eps, meta.positions, cache.k, cache.v, meta.slot_mapping,
        table_dtype, rope_params[0], list(rope_params[1]), layer=layer,
    )  # fmt: skip
    t = x.shape[0]
    q = qkv[:, : qkv.shape[1] - 2 * nkv * d].view(t, -1, d)
    return kops.paged_attention(
        q, cache.k, cache.v, meta.block_table, meta.seq_lens, meta.positions,
        meta.query_start_loc, scale=d**-0.5, num_query=t if max_query_len is None else min(t, max_query_len),
        layer=layer, early_kv=True, early_release=True,
    )  # fmt: skip


def _paged_kernels(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttnMetadata,
    cache: KVCache,
    *,
    layer: int,
    max_query_len: int | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_params: tuple | None = None,
) -> torch.Tensor:
    """The "paged" backend: the registered ops `fspec::kv_write` (or `fspec::rope_kv_write`, given
    rope = (cos, sin) [T, D] and un-rotated q, k; or `fspec::rope_pos_kv_write`, given also
    `rope_params` = (rope_type, rope) of `layers.rope_key`: cos / sin from meta.positions in the
    kernel, so that the tables, read by nothing else, are never computed) and `fspec::paged_attention`
    (kernels/; Triton on CUDA, their PyTorch references elsewhere). The kernels read block_table, seq_lens
    and positions on the device; keys past seq_lens are never read."""
    num_query = q.shape[0] if max_query_len is None else max_query_len
    if rope is not None and rope_params is not None:
        q_cache = kops.rope_pos_kv_write(
            q, k, v, meta.positions, cache.k, cache.v, meta.slot_mapping, rope[0].dtype,
            rope_params[0], list(rope_params[1]), layer=layer,
        )  # fmt: skip
    elif rope is None:
        kops.kv_write(
            k.to(cache.k.dtype),
            v.to(cache.v.dtype),
            cache.k,
            cache.v,
            meta.slot_mapping,
            layer=layer,
        )
        q_cache = q.to(cache.k.dtype)
    else:  # RoPE of q and k in the write's launch; q comes back rotated, in the cache's dtype
        q_cache = kops.rope_kv_write(
            q, k, v, *rope, cache.k, cache.v, meta.slot_mapping, layer=layer
        )  # [T, N, D]
    return kops.paged_attention(
        q_cache,
        cache.k,
        cache.v,
        meta.block_table,
        meta.seq_lens,
        meta.positions,
        meta.query_start_loc,
        scale=q.shape[-1] ** -0.5,
        num_query=num_query,
        layer=layer,
        # the old K/V rows load before the PDL wait: the cache write above is the launch right before
        # (target-only decoding +1.7% on the H200, run v of table `switches`)
        early_kv=True,
        # the layer's o projection, the launch right after, may start before the reduce's wait: it reads
        # only its weight before its own (`skinny_linear`; cuBLAS waits in stream order, an Inductor kernel
        # before its first access)
        early_release=True,
    ).to(q.dtype)


def _dense_over_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    """Attention among the T tokens of this call: same request, key position <= query position, both live."""
    t = q.shape[0]
    req = token_requests(meta.query_start_loc, t)  # [T]
    pos = meta.positions
    mask = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None]) & (pos[None, :] >= 0)  # [Tq, Tk]
    return dense_attention(q[None], k[None], v[None], mask=mask[None])[0]


class ReferencePlan(NamedTuple):
    """What the "reference" backend derives from the metadata, once per forward: the same for every layer.

    Attributes:
        write_slots: [T] int64, the cache slot of each token's K/V (padding: the scratch block's first slot).
        blocks: [B·M] int64, the cache blocks of each request's first M table entries (unallocated entries:
            the scratch block); M·block_size = C is the context the layers gather (`context_blocks`).
        dest: [T] int64, the row of each query token in the padded [B·Q] layout.
        visible: [B, 1, Q, C] bool, the query at position p of request b sees context positions <= p; key 0
            is opened for rows that see nothing (softmax over no key is NaN), which row_live zeroes after.
        mask: `visible` as SDPA's additive float mask (0 where visible, -inf elsewhere) in the cache's dtype:
            the tensor SDPA itself makes of a bool mask on every call, made once per forward instead.
        row_live: [B, 1, Q, 1] bool, whether the row holds a query (position >= 0).
        padded: static, T == B·Q: the tokens already lie in the padded layout (every request's metadata the
            engine builds, `query_start_loc = arange(B + 1)·Q`), so dest is the identity and no scatter runs.
        all_live: static, known on the host (eager CPU) that every row holds a query: nothing to zero.
        first_block: static, the first of one request's M consecutive blocks, read in place
            (`_first_block_in_place`), or None: gather `blocks`.
        context: static, for a lone request whose M blocks run past the cache's end (a multi-row step's
            CONTEXT_QUANTUM keys over a cache sized for one short request), or None: (k, v, n) with k/v
            [M, block_size, Nkv, D] zeroed buffers of the forward, into whose first n blocks each layer
            copies the request's blocks first_block .. + n - 1, the ones holding a visible key; the others
            stay zero, keys masked for every query (the gather put the scratch block's finite values there).
    """

    write_slots: torch.Tensor
    blocks: torch.Tensor
    dest: torch.Tensor
    visible: torch.Tensor
    mask: torch.Tensor
    row_live: torch.Tensor
    padded: bool
    all_live: bool
    first_block: int | None
    context: tuple[torch.Tensor, torch.Tensor, int] | None = None


def context_blocks(
    meta: AttnMetadata, block_size: int, *, max_query_len: int, max_context: int | None = None
) -> int:
    """Blocks of each request the reference backend gathers: the block table's width, or fewer with
    `max_context` (a static bound); and, running eagerly on the CPU, only what the longest request reaches
    (its last query position + 1, read on the host, where that is free), rounded up to whole quanta
    (`fspec.core.cache.CONTEXT_QUANTUM`, 512 keys, or `DECODE_CONTEXT_QUANTUM`, 16, for one query row per
    request) that keep PyTorch's CPU attention bit-identical to reading the full table: keys past every
    query's position are invisible to all of them. The cost follows the real length (SmolLM2-135M, one thread,
    a 125-token prompt: reading all 8192 positions of max_position_embeddings in every layer ran target-only
    decoding at 4.15 tok/s, 10.9 with 512). Compiled code and CUDA tensors keep the table's static width (no
    host sync, no data-dependent shape): the engine sizes the table by what a call can need
    (`fspec.core.cache.table_width`)."""
    width = meta.block_table.shape[1]
    ctx = width * block_size if max_context is None else min(max_context, width * block_size)
    pos = meta.positions
    if _host_readable(pos) and pos.numel():
        reach = int(pos.max()) + 1
        quantum = DECODE_CONTEXT_QUANTUM if max_query_len == 1 else CONTEXT_QUANTUM
        ctx = min(ctx, quantum * max(-(-reach // quantum), 1))
    return max(-(-ctx // block_size), 1)


def _first_block_in_place(meta: AttnMetadata, num_blocks: int, cache: KVCache) -> int | None:
    """For one request whose first `num_blocks` table entries are consecutive cache blocks (then -1, and no
    query past them), eager on the CPU: its first block, so that the layers read K/V where they lie instead
    of gathering them; else None. A lone request of the engine has its blocks in order (the allocator hands
    them out ascending): the gather copied 2 x 512 x 3 x 64 floats per layer of a SmolLM2-135M decode step
    (~2.4 ms of a 48 ms step on two threads). The slice may run past the request's allocated blocks, into
    keys masked for every query (finite values: the cache is zeroed at creation and written only with K/V),
    so the result equals the gather's. Where it would run past the cache's end (`_context_buffers`), the
    blocks holding visible keys are copied into a buffer instead."""
    table, pos = meta.block_table, meta.positions
    if table.shape[0] != 1 or not (_host_readable(table) and _host_readable(pos)) or not pos.numel():
        return None
    row = table[0, :num_blocks].tolist()
    owned = next((i for i, x in enumerate(row) if x < 0), len(row))
    first = row[0]
    if owned == 0 or any(x >= 0 for x in row[owned:]) or row[:owned] != list(range(first, first + owned)):
        return None
    if first + owned > cache.k.shape[1] or int(pos.max()) >= owned * cache.block_size:
        return None
    return first


def _context_buffers(
    meta: AttnMetadata, num_blocks: int, first: int, cache: KVCache
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """`ReferencePlan.context` of a lone request read from block `first` on (`_first_block_in_place`): None
    where its `num_blocks` blocks lie inside the cache (slices read them), else zeroed K and V buffers of
    num_blocks blocks and the number of blocks that hold a visible key. Several query rows read a
    CONTEXT_QUANTUM of keys (512; `context_blocks`) whatever the request holds, more than the cache of a
    short request has blocks: the gather copied the 32 blocks, mostly the scratch block, twice per layer;
    the copy is now of the blocks up to the last query's position."""
    if first + num_blocks <= cache.k.shape[1]:
        return None
    reach = -(-(int(meta.positions.max()) + 1) // cache.block_size)  # <= the request's owned blocks
    shape = (num_blocks, *cache.k.shape[2:])
    return cache.k.new_zeros(shape), cache.v.new_zeros(shape), reach


def _host_readable(t: torch.Tensor) -> bool:
    """Whether t's values may be read on the host here: eager (not traced, no torch.func transform) and on
    the CPU, where reading them costs no device sync."""
    return (
        t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
    )


def reference_plan(
    meta: AttnMetadata, cache: KVCache, *, max_query_len: int | None = None, max_context: int | None = None
) -> ReferencePlan:
    """The `ReferencePlan` of `meta` over `cache` (T = meta.positions' length; max_query_len default T)."""
    t = meta.positions.shape[0]
    b = meta.block_table.shape[0]
    bs = cache.block_size
    qmax = t if max_query_len is None else max_query_len
    device = meta.positions.device
    scratch = cache.num_blocks  # also the scratch block's index
    write_slots = meta.slot_mapping
    write_slots = torch.where(write_slots < 0, torch.full_like(write_slots, scratch * bs), write_slots)
    # 1. Each request's context: its first M blocks; unallocated (-1) entries read the scratch block.
    m = context_blocks(meta, bs, max_query_len=qmax, max_context=max_context)
    table = meta.block_table[:, :m].long()  # [B, M]
    blocks = torch.where(table < 0, torch.full_like(table, scratch), table).flatten()
    first_block = _first_block_in_place(meta, m, cache)
    # 2. Token t goes to row (request, t - query_start_loc[request]) of the padded [B, Q] queries.
    padded = t == b * qmax
    if padded:  # valid metadata (at most Q tokens a request) then has query_start_loc = arange(B + 1) * Q
        dest, pos = torch.arange(t, device=device), meta.positions
    else:
        req = token_requests(meta.query_start_loc, t).clamp(max=b - 1)  # [T]
        local = (torch.arange(t, device=device) - meta.query_start_loc.long()[req]).clamp(0, qmax - 1)
        dest = req * qmax + local  # [T]
        pos = torch.full((b * qmax,), -1, dtype=torch.int64, device=device).index_copy(
            0, dest, meta.positions
        )
    # 3. The query at position p sees context positions j <= p (its own K/V is written before the gather).
    j = torch.arange(m * bs, device=device)
    pos = pos.view(b, qmax)  # [B, Q], -1 = no query in that row
    visible = (j[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, Q, C]
    row_live = visible[..., :1]  # key 0 is visible exactly when the row holds a query (pos >= 0)
    all_live = _host_readable(row_live) and bool(row_live.all())
    visible = visible | (j == 0)
    mask = torch.zeros(visible.shape, dtype=cache.k.dtype, device=device).masked_fill_(
        ~visible, float("-inf")
    )
    context = None if first_block is None else _context_buffers(meta, m, first_block, cache)
    return ReferencePlan(
        write_slots, blocks, dest, visible, mask, row_live, padded, all_live, first_block, context
    )


def reference_layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ReferencePlan, cache: KVCache, *, layer: int
) -> torch.Tensor:
    """One layer of the "reference" backend over a `ReferencePlan`: write k/v [T, Nkv, D] (donating the
    cache), gather each request's M blocks, masked SDPA over the padded queries. Returns [T, N, D].

    Plain reshapes and transposes instead of einops here: this runs once per layer of every eager CPU step,
    where each einops call cost ~3 us of Python (about 1 ms of a 30-layer decode step)."""
    kbuf, vbuf = cache.k[layer], cache.v[layer]  # [num_blocks + 1, bs, Nkv, D]
    kbuf.flatten(0, 1).index_copy_(0, plan.write_slots, _as(k, kbuf.dtype))
    vbuf.flatten(0, 1).index_copy_(0, plan.write_slots, _as(v, vbuf.dtype))
    b, _, qmax, ctx = plan.visible.shape
    t, n, d = q.shape
    # [B·M, bs, Nkv, D] -> [B, Nkv, C, D]: whole blocks gathered (index_select), not one slot at a time, or
    # read where they lie
    first = plan.first_block
    if first is None:
        kc, vc = kbuf.index_select(0, plan.blocks), vbuf.index_select(0, plan.blocks)
    elif plan.context is None:
        m = plan.blocks.shape[0]
        kc, vc = kbuf[first : first + m], vbuf[first : first + m]
    else:  # the blocks holding visible keys, copied into the forward's buffers (zero past them)
        kc, vc, held = plan.context
        kc[:held].copy_(kbuf[first : first + held])
        vc[:held].copy_(vbuf[first : first + held])
    kc, vc = kc.view(b, ctx, -1, d).transpose(1, 2), vc.view(b, ctx, -1, d).transpose(1, 2)
    qp = q if plan.padded else q.new_zeros(b * qmax, n, d).index_copy(0, plan.dest, q)
    qp = qp.view(b, qmax, n, d).transpose(1, 2)  # [B, N, Q, D]
    mask = plan.mask if plan.mask.dtype == q.dtype else plan.visible  # (SDPA makes the same of the bool one)
    out = F.scaled_dot_product_attention(
        qp, _as(kc, q.dtype), _as(vc, q.dtype), attn_mask=mask, enable_gqa=True
    )
    if not plan.all_live:
        out = torch.where(plan.row_live, out, torch.zeros_like(out))  # padding rows (position -1) give 0
    out = out.transpose(1, 2).reshape(b * qmax, n, d)  # [B·Q, N, D]
    return out if plan.padded else out[plan.dest]  # [T, N, D]


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype (x itself when it has it: no dispatch, per layer)."""
    return x if x.dtype == dtype else x.to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttnMetadata,
    cache: KVCache,
    *,
    layer: int,
    max_query_len: int | None = None,
    max_context: int | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """The "reference" backend: write K/V at meta.slot_mapping, then attend over each request's blocks
    (`reference_plan` then `reference_layer`; a model's forward builds the plan once for all its layers)."""
    plan = reference_plan(meta, cache, max_query_len=max_query_len, max_context=max_context)
    return reference_layer(q, k, v, plan, cache, layer=layer), cache


def bind(
    meta: AttnMetadata,
    cache: KVCache | None,
    *,
    backend: str = "auto",
    max_query_len: int | None = None,
    max_context: int | None = None,
    rope: tuple | None = None,
) -> Attend:
    """`attend(q, k, v, layer, cos, sin) -> out` over `meta` and `cache`, for a model's layers (q, k not yet
    rotated). The "paged" backend rotates them in its cache-write kernel; the others with `rope_qk` first.
    `rope` (`fspec.models.layers.rope_key` of the model's config, whose cos / sin the layers pass, computed
    from meta.positions): the paged kernel computes cos / sin itself instead of reading the tables.

    The cache is donated (written in place), so the caller returns the `cache` it passed in. With the paged
    backend and `rope`, `attend.qkv_rope(x [T, K], w_qkv, norm_weight, eps, layer, table_dtype)` is the
    same attention for a layer that hands over its rows and fused q/k/v weight instead (`_paged_qkv_rope`:
    None where that path does not apply).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend in ("auto", "paged", "reference") and not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected a KVCache for the {backend!r} backend, got {type(cache).__name__}")
    fused = resolve_backend(backend, cache) == "paged"
    # The reference backend's gather indices and masks depend on the metadata only: built once here, not in
    # each layer (per layer they were ~20 small ops, a few ms of a 30-layer CPU decode step).
    plan = None
    if resolve_backend(backend, cache) == "reference":
        plan = reference_plan(meta, cache, max_query_len=max_query_len, max_context=max_context)

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        if fused:
            return _paged_kernels(
                q, k, v, meta, cache, layer=layer, max_query_len=max_query_len, rope=(cos, sin),
                rope_params=None if rope is None else tuple(rope[1:]),
            )  # fmt: skip
        q, k = rope_qk(q, k, cos, sin)
        if plan is not None:
            return reference_layer(q, k, v, plan, cache, layer=layer)
        return _attention(
            q,
            k,
            v,
            meta,
            cache,
            layer=layer,
            backend=backend,
            max_query_len=max_query_len,
            max_context=max_context,
        )[0]

    if fused and rope is not None:  # a layer may hand over its rows and its q/k/v weight instead
        rope_params = tuple(rope[1:])
        attend.qkv_rope = functools.partial(
            _paged_qkv_rope, meta=meta, cache=cache, rope_params=rope_params, max_query_len=max_query_len
        )
    return attend


def causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """`attend` for the dense [B, S] path: RoPE, then causal attention within each sequence (`layer`
    unused)."""
    q, k = rope_qk(q, k, cos, sin)
    return dense_attention(q, k, v)


# --- validation of the public functions (eager only) --------------------------------------------------------


def _check_qkv(q, k, v, *, ndim: int, layout: str, autocast_ok: bool = False) -> None:
    """q [..., N, D], k/v [..., Nkv, D]: tensors of rank `ndim`, one float dtype and device, N % Nkv == 0.

    autocast_ok: mixed float dtypes pass while autocast is on for q's device (autocast casts them for SDPA;
    under bf16 autocast the projections give bf16 q/k/v and RoPE promotes q and k back to fp32).
    """
    mixed_ok = autocast_ok and autocast_enabled(q.device.type)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != ndim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a {layout} tensor, got {got}")
        if not x.is_floating_point():
            raise ValueError(f"{name}: expected a float dtype, got {x.dtype}")
        if (x.dtype != q.dtype and not mixed_ok) or x.device != q.device:
            raise ValueError(
                f"{name}: expected q's dtype {q.dtype} on {q.device}, got {x.dtype} on {x.device}"
            )
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"k: expected the leading dim and head dim of q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"k: expected KV heads dividing q's {q.shape[-2]} heads (GQA), got {k.shape[-2]}")


def _check_dense(q, k, v, mask) -> None:
    _check_qkv(q, k, v, ndim=4, layout="[B, S, heads, D]", autocast_ok=True)
    b, s, sk = q.shape[0], q.shape[1], k.shape[1]
    if mask is None:
        if s != sk:
            raise ValueError(
                f"mask: expected a mask when S != Sk (causal needs S == Sk), got None with S={s}, Sk={sk}"
            )
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.device != q.device:
        got = f"{mask.dtype} on {mask.device}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask: expected a bool tensor on {q.device}, got {got}")
    try:
        ok = torch.broadcast_shapes(mask.shape, (b, s, sk)) == (b, s, sk)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask: expected a shape broadcastable to [B, S, Sk] = {[b, s, sk]}, got {list(mask.shape)}"
        )


def _check_attention(q, k, v, meta, cache, layer, backend, max_query_len, max_context) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    _check_qkv(q, k, v, ndim=3, layout="[T, heads, D]")
    if not isinstance(meta, AttnMetadata):
        raise ValueError(f"meta: expected an AttnMetadata, got {type(meta).__name__}")
    t = q.shape[0]
    _expect("meta.positions", meta.positions, shape=(t,), dtype=torch.int64, device=q.device)
    _expect("meta.query_start_loc", meta.query_start_loc, shape=(None,), dtype=torch.int32, device=q.device)
    for name, value in (("max_query_len", max_query_len), ("max_context", max_context)):
        if value is not None:
            check_positive_int(name, value)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer: expected an int >= 0, got {layer!r}")
    counts = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    if max_query_len is not None and counts.numel() and int(counts.max()) > max_query_len:
        raise ValueError(
            f"max_query_len: expected at least the largest query count per request, {int(counts.max())}, "
            f"got {max_query_len}"
        )
    if resolve_backend(backend, cache) == "dense":
        return
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected a KVCache for the {backend!r} backend, got {type(cache).__name__}")
    if not 0 <= layer < cache.num_layers:
        raise ValueError(
            f"layer: expected an int in [0, {cache.num_layers}) (the cache's layers), got {layer}"
        )
    n_kv, d = cache.k.shape[3], cache.k.shape[4]
    if tuple(k.shape[1:]) != (n_kv, d):
        raise ValueError(f"k: expected shape [T, {n_kv}, {d}] (the cache's Nkv, D), got {tuple(k.shape)}")
    if cache.k.device != q.device:
        raise ValueError(f"cache: expected device {q.device} (q's), got {cache.k.device}")
    check_positive_int("cache.block_size", cache.block_size)
    capacity = (
        meta.block_table.shape[1] * cache.block_size if isinstance(meta.block_table, torch.Tensor) else 1
    )
    validate_attn_metadata(
        meta,
        block_size=cache.block_size,
        max_model_len=max(capacity, 1),
        num_blocks=cache.num_blocks,
        name="meta",
    )
