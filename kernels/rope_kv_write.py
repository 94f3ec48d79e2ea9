"""RoPE of q and k and the K/V cache write in one launch: what a paged-attention layer does between its
q/k/v projection and the attention kernel.

    rope_kv_write(q [T, N, D], k [T, Nkv, D], v [T, Nkv, D], cos [T, D], sin [T, D], k_cache!, v_cache!,
                  slot_mapping [T], *, layer=0) -> q_out [T, N, D] in the cache's dtype

RoPE is the rotate-half convention (the HF checkpoint layout): x' = x * cos + rotate_half(x) * sin with
rotate_half(x) = cat(-x[D/2:], x[:D/2]). The rotated k and the (unrotated) v of token t go to cache slot
slot_mapping[t] of `layer`, addressed exactly as kernels/kv_write.py does (slot -1 = padding: nothing
written; every other byte of the cache stays bit-identical); the rotated q is returned for the attention
kernel. q, k and v may be strided views of one fused projection output [T, (N + 2·Nkv)·D] (any token and head
stride, head-dim stride 1), so a compiled caller hands the matmul's buffer straight to the op.

Why: per layer of a compiled decode step on an H200, Inductor emitted about five pointwise kernels of
~1.0-1.3 µs around the custom ops (RoPE of q and of k, each recomputing cos/sin, and copies that realise q, k,
v as op inputs), then `fspec::kv_write` took 1.4 µs. A custom op is a fusion barrier, so the only way to lose
those launches is to do RoPE inside the op.

Numerics: every product and sum in fp32, rounded once to the output dtype (the eager model path rounds after
each op in the activation dtype). v is cast to the cache dtype on the host and copied without arithmetic.
The Triton interpreter rounds fp32 -> bf16 by truncation, torch to nearest even: under the interpreter bf16
results may differ from the reference by one bf16 ulp, fp32 and fp16 results are identical.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .kv_write import contiguous_layers, kv_write_ref, layer_view
from .pdl import pdl_enter
from .rope_cos_sin import rope_cos_sin_ref


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,  # [T, N, D] un-rotated queries, head-dim stride 1
    k_ptr,  # [T, Nkv, D] un-rotated keys, head-dim stride 1
    v_ptr,  # [T, Nkv, D] values in the cache's dtype, head-dim stride 1
    cos_ptr,  # [T, D] cos of each token's position (rotate-half layout), dim stride 1
    sin_ptr,  # [T, D] sin of each token's position
    positions_ptr,  # [T] int (FROM_POSITIONS): each token's position, negative = padding (position 0)
    inv_freq_ptr,  # [D/2] float32 (FROM_POSITIONS): RoPE's inverse frequencies
    q_out_ptr,  # [T, N, D] rotated queries, contiguous, the cache's dtype (written)
    k_cache_ptr,  # [num_blocks, block_size, Nkv, D] this layer's K cache, contiguous (written)
    v_cache_ptr,  # [num_blocks, block_size, Nkv, D] this layer's V cache, contiguous (written)
    slot_mapping_ptr,  # [T] int64 cache slot of each token; -1 = do not write
    stride_qt,  # elements between consecutive tokens of q
    stride_qh,  # elements between consecutive heads of q
    stride_kt,  # elements between consecutive tokens of k
    stride_kh,  # elements between consecutive heads of k
    stride_vt,  # elements between consecutive tokens of v
    stride_vh,  # elements between consecutive heads of v
    stride_ct,  # elements between consecutive tokens of cos
    stride_st,  # elements between consecutive tokens of sin
    NUM_HEADS: tl.constexpr,  # N
    KV_HEADS: tl.constexpr,  # Nkv
    HALF: tl.constexpr,  # D / 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= D / 2
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    FROM_POSITIONS: tl.constexpr = False,  # cos / sin from positions and inv_freq instead of the tables
    TABLE_DTYPE: tl.constexpr = tl.float32,  # (FROM_POSITIONS) the dtype the tables would have
):
    pdl_enter(PDL)
    # grid (T, N + Nkv): program (t, h) rotates query head h (h < N) or rotates KV head h - N and writes it
    # and its value to the cache. One head per program: at decode T is the batch, and T * (N + Nkv) programs
    # keep every SM busy where one program per token would leave most of them idle.
    t = tl.program_id(0).to(tl.int64)  # int64: every offset below that involves t or a slot is int64
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_HALF)  # index into each half of the head dim
    ok = j < HALF
    if FROM_POSITIONS:  # the tables' arithmetic (kernels/rope_cos_sin.py), rounded to their dtype
        pos = tl.maximum(tl.load(positions_ptr + t), 0).to(tl.float32)
        freqs = pos * tl.load(inv_freq_ptr + j, mask=ok, other=0.0)
        cos1 = tl.cos(freqs).to(TABLE_DTYPE).to(tl.float32)
        sin1 = tl.sin(freqs).to(TABLE_DTYPE).to(tl.float32)
        cos2 = cos1  # the tables repeat their first half
        sin2 = sin1
    else:
        cos1 = tl.load(cos_ptr + t * stride_ct + j, mask=ok).to(tl.float32)
        cos2 = tl.load(cos_ptr + t * stride_ct + HALF + j, mask=ok).to(tl.float32)
        sin1 = tl.load(sin_ptr + t * stride_st + j, mask=ok).to(tl.float32)
        sin2 = tl.load(sin_ptr + t * stride_st + HALF + j, mask=ok).to(tl.float32)
    if h < NUM_HEADS:
        src = q_ptr + t * stride_qt + h * stride_qh
        x1 = tl.load(src + j, mask=ok).to(tl.float32)
        x2 = tl.load(src + HALF + j, mask=ok).to(tl.float32)
        # x * cos + rotate_half(x) * sin, per half: rotate_half(x) = (-x2, x1)
        dst = q_out_ptr + (t * NUM_HEADS + h) * (2 * HALF)
        tl.store(dst + j, (x1 * cos1 - x2 * sin1).to(q_out_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + j, (x2 * cos2 + x1 * sin2).to(q_out_ptr.dtype.element_ty), mask=ok)
    else:
        kh = h - NUM_HEADS
        slot = tl.load(slot_mapping_ptr + t)
        live = ok & (slot >= 0)  # slot < 0: every lane masked, the program reads and writes nothing
        src = k_ptr + t * stride_kt + kh * stride_kh
        x1 = tl.load(src + j, mask=live).to(tl.float32)
        x2 = tl.load(src + HALF + j, mask=live).to(tl.float32)
        row = slot * (KV_HEADS * 2 * HALF) + kh * (2 * HALF)  # int64: caches may exceed 2^31 elements
        tl.store(k_cache_ptr + row + j, (x1 * cos1 - x2 * sin1).to(k_cache_ptr.dtype.element_ty), mask=live)
        tl.store(
            k_cache_ptr + row + HALF + j, (x2 * cos2 + x1 * sin2).to(k_cache_ptr.dtype.element_ty), mask=live
        )
        vsrc = v_ptr + t * stride_vt + kh * stride_vh
        tl.store(v_cache_ptr + row + j, tl.load(vsrc + j, mask=live), mask=live)
        tl.store(v_cache_ptr + row + HALF + j, tl.load(vsrc + HALF + j, mask=live), mask=live)


def _check(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, slot_mapping: Tensor
) -> None:
    """Shapes only (no host sync): `_check_qkv`, and cos/sin [T, D]."""
    _check_qkv(q, k, v, kc, slot_mapping)
    t, _, d = q.shape
    for name, x in (("cos", cos), ("sin", sin)):
        if tuple(x.shape) != (t, d):
            raise ValueError(f"{name}: expected shape [T, D] = {[t, d]}, got {tuple(x.shape)}")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, kc: Tensor, slot_mapping: Tensor) -> None:
    """Shapes only (no host sync): q [T, N, D], k/v [T, Nkv, D] matching the cache, slot_mapping [T], D
    even."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q/k: expected [T, heads, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, _, d = q.shape
    if d % 2 or d != kc.shape[-1]:
        raise ValueError(
            f"q: expected an even head dim D equal to the cache's {kc.shape[-1]} (rotate-half RoPE pairs d "
            f"with d + D/2), got {d}"
        )
    if tuple(k.shape) != (t, *kc.shape[-2:]) or v.shape != k.shape:
        raise ValueError(
            f"k/v: expected shape [T, Nkv, D] = {[t, *kc.shape[-2:]]} (q's T, the cache's Nkv and D), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if tuple(slot_mapping.shape) != (t,):
        raise ValueError(f"slot_mapping: expected shape [T] = [{t}], got {tuple(slot_mapping.shape)}")


def _unit_stride(x: Tensor) -> Tensor:
    """x itself when its last axis is dense (the kernel reads it at ptr + d), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_kv_write(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    layer: int = 0,
) -> Tensor:
    """Launch the kernel (see the module docstring): rotated k and v to `layer` of the caches at slot_mapping
    [T] (-1 skipped); returns the rotated q [T, N, D] in the cache's dtype."""
    kc, vc = contiguous_layers(k_cache, v_cache, layer)
    _check(q, k, v, cos, sin, kc, slot_mapping)
    t, n, d = q.shape
    nkv = k.shape[1]
    q_out = torch.empty((t, n, d), dtype=kc.dtype, device=q.device)
    if t == 0:
        return q_out
    q, k, cos, sin = (_unit_stride(x) for x in (q, k, cos, sin))
    v = _unit_stride(v.to(vc.dtype))  # cast on the host: the interpreter truncates fp32 -> bf16
    slot_mapping = slot_mapping.contiguous()  # read at ptr + t
    _rope_kv_write_kernel[(t, n + nkv)](
        q, k, v, cos, sin, cos, sin, q_out, kc, vc, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        sin.stride(0),
        NUM_HEADS=n, KV_HEADS=nkv, HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=1,
        **pdl.options(q),
    )  # fmt: skip
    return q_out


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def check_rope_positions(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kc: Tensor,
    slot_mapping: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    table_dtype: torch.dtype,
) -> None:
    """Shapes and dtypes only (no host sync): `_check_qkv`, positions [T], inv_freq [D/2], and a table dtype
    the kernels can round to."""
    _check_qkv(q, k, v, kc, slot_mapping)
    t, _, d = q.shape
    if tuple(positions.shape) != (t,) or tuple(inv_freq.shape) != (d // 2,):
        raise ValueError(
            f"positions/inv_freq: expected shapes [T] = [{t}] and [D/2] = [{d // 2}], got "
            f"{tuple(positions.shape)} and {tuple(inv_freq.shape)}"
        )
    if table_dtype not in _TL_DTYPES:
        raise ValueError(f"table_dtype: expected one of {list(_TL_DTYPES)}, got {table_dtype}")


def rope_pos_kv_write(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    table_dtype: torch.dtype,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    layer: int = 0,
) -> Tensor:
    """`rope_kv_write` with cos / sin computed in the kernel from positions [T] and inv_freq [D/2], rounded to
    `table_dtype` as `rope_cos_sin`'s tables are: the same bits, without the tables' launch (a paged decode
    step's RoPE tables then have no other reader and are not computed at all)."""
    kc, vc = contiguous_layers(k_cache, v_cache, layer)
    check_rope_positions(q, k, v, kc, slot_mapping, positions, inv_freq, table_dtype)
    t, n, d = q.shape
    nkv = k.shape[1]
    q_out = torch.empty((t, n, d), dtype=kc.dtype, device=q.device)
    if t == 0:
        return q_out
    q, k = _unit_stride(q), _unit_stride(k)
    v = _unit_stride(v.to(vc.dtype))
    positions, inv_freq = positions.contiguous(), inv_freq.float().contiguous()
    slot_mapping = slot_mapping.contiguous()
    _rope_kv_write_kernel[(t, n + nkv)](
        q, k, v, q, q, positions, inv_freq, q_out, kc, vc, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), 0, 0,
        NUM_HEADS=n, KV_HEADS=nkv, HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=1,
        FROM_POSITIONS=True, TABLE_DTYPE=_TL_DTYPES[table_dtype], **pdl.options(q),
    )  # fmt: skip
    return q_out


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """fp32 x [T, heads, D] rotated by cos/sin [T, D] (rotate-half), every op in fp32."""
    x, cos, sin = x.float(), cos.float()[:, None], sin.float()[:, None]  # broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_kv_write_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    layer: int = 0,
) -> Tensor:
    """Plain PyTorch, same contract: `rope_ref` of q and k in fp32, `kv_write_ref` of the rotated k and v
    (each rounded once to the cache's dtype). Eager only, as kv_write_ref (boolean-mask indexing)."""
    kc = layer_view(k_cache, layer)
    _check(q, k, v, cos, sin, kc, slot_mapping)
    kv_write_ref(rope_ref(k, cos, sin), v, k_cache, v_cache, slot_mapping, layer=layer)
    return rope_ref(q, cos, sin).to(kc.dtype)


def rope_pos_kv_write_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    table_dtype: torch.dtype,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    layer: int = 0,
) -> Tensor:
    """The reference of `rope_pos_kv_write`: the tables (`rope_cos_sin_ref`), then `rope_kv_write_ref`."""
    cos, sin = rope_cos_sin_ref(positions, inv_freq, table_dtype)
    return rope_kv_write_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, layer=layer)
