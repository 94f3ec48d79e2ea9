"""Write this step's K/V rows into the paged cache at `slot_mapping`, skipping slot -1 (padding).

Cache layout (per layer): [num_blocks, block_size, Nkv, D], contiguous; slot s = block * block_size + offset
names the [Nkv, D] row `cache.view(-1, Nkv, D)[s]`. A stacked [L, num_blocks, block_size, Nkv, D] buffer is
passed whole with `layer` (a Python int: static), never as the view `cache[layer]`, so a compiled caller hands
the op the buffer it donates (pytorch#198031: a view of a cloned buffer can be rewritten to the original).

The cache is donated: written in place, nothing returned. Only live slots change; every other byte of the
cache (other slots, other layers) stays bit-identical. Values are copied without arithmetic, so the kernel and
the reference agree bit for bit.
"""

import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .pdl import pdl_enter


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [T, Nkv, D] keys of this step, same dtype as the cache, head-dim stride 1
    v_ptr,  # [T, Nkv, D] values of this step
    k_cache_ptr,  # [num_blocks, block_size, Nkv, D] this layer's K cache, contiguous (written)
    v_cache_ptr,  # [num_blocks, block_size, Nkv, D] this layer's V cache, contiguous (written)
    slot_mapping_ptr,  # [T] int64 cache slot of each token; -1 = do not write
    stride_kt,  # elements between consecutive tokens of k
    stride_kh,  # elements between consecutive heads of k
    stride_vt,  # elements between consecutive tokens of v
    stride_vh,  # elements between consecutive heads of v
    KV_HEADS: tl.constexpr,  # Nkv
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_H: tl.constexpr,  # next power of two >= Nkv
    BLOCK_D: tl.constexpr,  # next power of two >= D
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot < 0: every lane masked, the program reads and writes nothing
    ok = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    row = slot * (KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]  # [BLOCK_H, BLOCK_D] int64
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(k_cache_ptr + row, k, mask=ok)
    tl.store(v_cache_ptr + row, v, mask=ok)


def layer_view(cache: Tensor, layer: int) -> Tensor:
    """This layer's [num_blocks, block_size, Nkv, D] buffer of a 4-D (one layer) or 5-D (stacked) cache."""
    if cache.dim() == 4:
        if layer != 0:
            raise ValueError(
                f"layer: expected 0 for a single-layer [num_blocks, block_size, Nkv, D] cache, got {layer}"
            )
        return cache
    if cache.dim() == 5:
        if not 0 <= layer < cache.shape[0]:
            raise ValueError(f"layer: expected a value in [0, {cache.shape[0]}), got {layer}")
        return cache[layer]
    raise ValueError(
        f"cache: expected [num_blocks, block_size, Nkv, D] or [L, ...], got {tuple(cache.shape)}"
    )


def contiguous_layers(k_cache: Tensor, v_cache: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """`layer_view` of both caches, each a contiguous [num_blocks, block_size, Nkv, D] buffer (the kernels
    address slots as slot * Nkv * D): a ValueError naming the strides otherwise."""
    kc, vc = layer_view(k_cache, layer), layer_view(v_cache, layer)
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError(
            "k_cache/v_cache: expected contiguous layers [num_blocks, block_size, Nkv, D], got strides "
            f"{kc.stride()} and {vc.stride()} for shapes {tuple(kc.shape)} and {tuple(vc.shape)}"
        )
    return kc, vc


def kv_write(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *, layer: int = 0
) -> None:
    """Launch the write: k/v [T, Nkv, D] go to `layer` of k_cache/v_cache at slot_mapping [T] (-1 skipped)."""
    kc, vc = contiguous_layers(k_cache, v_cache, layer)
    t, nkv, d = k.shape
    if t == 0:
        return
    # cast on the host: the interpreter's float32 -> bfloat16 rounding differs from torch's
    k = k.to(kc.dtype)
    v = v.to(vc.dtype)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.contiguous()  # read at ptr + t
    _kv_write_kernel[(t,)](
        k, v, kc, vc, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=nkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(nkv), BLOCK_D=triton.next_power_of_2(d),
        **pdl.options(kc),
    )  # fmt: skip


def kv_write_ref(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *, layer: int = 0
) -> None:
    """Plain PyTorch: `index_copy_` of the live rows only, so no other slot is written, even with its value.

    Eager only (the live rows are selected with a boolean mask, a data-dependent shape); compiled callers go
    through the `fspec::kv_write` op, which is opaque to the compiler.
    """
    kc, vc = layer_view(k_cache, layer), layer_view(v_cache, layer)
    nkv, d = kc.shape[-2:]
    live = slot_mapping >= 0  # [T]
    slots = slot_mapping[live]
    kc.view(-1, nkv, d).index_copy_(0, slots, k[live].to(kc.dtype))
    vc.view(-1, nkv, d).index_copy_(0, slots, v[live].to(vc.dtype))
