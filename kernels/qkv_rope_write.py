"""A layer's q/k/v projection with RoPE and the K/V cache write as its epilogue: one launch where a layer had
two (`skinny_linear`, then `rope_pos_kv_write`), for one row (a decode or later draft step at batch 1) and for
up to MAX_ROWS rows (a batch-1 round's K + 1 verification rows, its first draft step).

    qkv_rope_write(x [M, K], w [(N + 2·Nkv)·D, K], *, norm_weight=None, eps, positions [M], inv_freq [D/2],
                   table_dtype, k_cache!, v_cache!, slot_mapping [M], layer=0) -> [M, (N + 2·Nkv)·D]

returns [q_rot, k_rot, v] (x's dtype) and writes row i's k_rot and v to cache slot slot_mapping[i] of `layer`
(-1: nothing written): `rope_pos_kv_write` applied to `skinny_linear(x, w, norm_weight=...)` split into q, k,
v, with the same roundings (the product rounded to x's dtype, RoPE in float32 with cos / sin rounded to
`table_dtype`, one rounding of the result), so the two paths give the same bits on the GPU.

Why: in the H200's one-row decode layer the chain from the q/k/v product's last load to the attention's first
is latency, not bytes; the cache-write launch between them is ~1.9 µs of it (RoPE, a wait, an L2 round trip
for q/k/v). Skipping that launch outright (a timing-only experiment, docs/ops-and-kernels.md) took target-only
decoding from 1139 to 1175 tokens/s; this kernel measured 1136-1148 -> 1156-1176 (runs t, u of table
`switches`: a layer 45.0 -> 43.4 µs). The product's programs do that work in registers before they exit:
each owns BLOCK_N / 2 rotate-half pairs (d, d + D/2) of one head (`_columns` in kernels/skinny_linear.py), so
a pair never leaves the program that computed it. At several rows the separate write cost 171 µs of a
~1500 µs batch-1 round of SmolLM2-135M on the H100 (30 launches; BENCHMARKS.md, "Where the B = 1 round goes").
Kernels: one row `_skinny_gemv_kernel`; several rows the several-row products' kernel (`rows_config`): the
tensor-core tile `_skinny_linear_kernel`, or `_skinny_rows_kernel` on the CUDA cores where a head's largest
power-of-two factor is below the tile's 16 columns (up to FMA_MAX_ROWS rows), or `_skinny_rows_tile_kernel`
where the several-row default is an `fma` + `one_tile` config that fits. x's dtype equal to the cache's
and w's.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from . import pdl
from .kv_write import contiguous_layers, kv_write_ref, layer_view
from .rope_cos_sin import rope_cos_sin_ref
from .rope_kv_write import _TL_DTYPES, rope_ref
from .skinny_linear import (
    FMA_MAX_ROWS,
    MAX_ROWS,
    NORM_MAX_BLOCK_K,
    SkinnyConfig,
    _skinny_gemv_kernel,
    _skinny_linear_kernel,
    _skinny_rows_kernel,
    _skinny_rows_tile_kernel,
    check_args,
    default_config,
    gemv_block_k,
    norm_block,
    rows_block_k,
    rows_norm_block,
    rows_tile_fits,
    skinny_linear_ref,
)


def supports(rows: int, head_dim: int) -> bool:
    """Whether `qkv_rope_write` takes `rows` rows of x for heads of `head_dim` (even): one row always; up to
    MAX_ROWS where the head dim is a multiple of 16 (the tile's columns), else up to FMA_MAX_ROWS."""
    if rows == 1:
        return True
    return 2 <= rows <= (MAX_ROWS if head_dim % 16 == 0 else FMA_MAX_ROWS)


def rows_config(out: int, k: int, head_dim: int, *, norm: bool) -> SkinnyConfig:
    """The several-row launch for a fused q/k/v weight of `out` rows and depth k: the several-row
    products' default (`default_config`, the input norm's BLOCK_K cap as `skinny_linear` applies it) with
    BLOCK_N at most the head dim's largest power-of-two factor (a program's pairs stay in one head); below
    16 columns the CUDA-core rows kernel (`fma`) at the one-row tiles."""
    cfg = default_config(out, k)
    if norm and not cfg.fma:  # (the CUDA-core kernels keep x's tile as vectors)
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, NORM_MAX_BLOCK_K))
    block_n = min(cfg.block_n, head_dim & -head_dim)
    if block_n >= 16:
        return dataclasses.replace(cfg, block_n=block_n)
    one = default_config(out, k, one_row=True)
    return dataclasses.replace(one, block_n=block_n, one_tile=False)


def check_qkv_rope_args(
    x: Tensor,
    w: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    table_dtype: torch.dtype,
    kc: Tensor,
    slot_mapping: Tensor,
) -> tuple[int, int, int]:
    """Shapes and dtypes only (no host sync), given `layer_view`'s cache layer kc [blocks, block_size, Nkv,
    D]: `skinny_linear.check_args`; w [(N + 2·Nkv)·D, K] with N >= 1; D even; M rows of x that `supports`
    takes at D; x's dtype the cache's; positions and slot_mapping [M] integers, inv_freq [D/2], a table dtype
    the kernel rounds to. Returns (N·D, Nkv·D, D); a ValueError names the argument otherwise."""
    check_args(x, w, norm_weight=norm_weight, eps=eps)
    if kc.dim() != 4:
        raise ValueError(f"k_cache: expected layers [num_blocks, block_size, Nkv, D], got {tuple(kc.shape)}")
    nkv, d = kc.shape[-2:]
    rows = w.shape[0]
    if d % 2 or d < 2:
        raise ValueError(f"k_cache: expected an even head dim D (rotate-half pairs d, d + D/2), got {d}")
    if rows % d or rows <= 2 * nkv * d:
        raise ValueError(
            f"w: expected [(N + 2·Nkv)·D, K] rows with N >= 1, Nkv = {nkv}, D = {d} (the cache's), got {rows}"
        )
    m = x.shape[0]
    if not supports(m, d):
        most = MAX_ROWS if d % 16 == 0 else FMA_MAX_ROWS
        raise ValueError(f"x: expected 1 to {most} rows [M, K] at head dim {d}, got shape {tuple(x.shape)}")
    if kc.dtype != x.dtype:
        raise ValueError(f"k_cache: expected x's dtype {x.dtype}, got {kc.dtype}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tuple(t.shape) != (m,) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(
                f"{name}: expected a [{m}] integer tensor (x's rows), got {tuple(t.shape)} {t.dtype}"
            )
    if tuple(inv_freq.shape) != (d // 2,):
        raise ValueError(f"inv_freq: expected shape [D/2] = [{d // 2}], got {tuple(inv_freq.shape)}")
    if table_dtype not in _TL_DTYPES:
        raise ValueError(f"table_dtype: expected one of {list(_TL_DTYPES)}, got {table_dtype}")
    return rows - 2 * nkv * d, nkv * d, d


def qkv_rope_write(
    x: Tensor,
    w: Tensor,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    positions: Tensor,
    inv_freq: Tensor,
    table_dtype: torch.dtype,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    layer: int = 0,
) -> Tensor:
    """Launch the product with the RoPE / cache-write epilogue (the module docstring)."""
    kc, vc = contiguous_layers(k_cache, v_cache, layer)
    q_cols, kv_cols, d = check_qkv_rope_args(
        x, w, norm_weight, eps, positions, inv_freq, table_dtype, kc, slot_mapping
    )
    rows, k = w.shape
    m = x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty((m, rows), dtype=x.dtype, device=x.device)
    norm = norm_weight.contiguous() if norm_weight is not None else x
    interpreted = isinstance(_skinny_gemv_kernel, InterpretedFunction)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    inv = inv_freq.float().contiguous()
    rope = {"ROPE_HEAD_DIM": d, "TABLE_DTYPE": _TL_DTYPES[table_dtype]}
    if m == 1:
        cfg = default_config(rows, k, one_row=True)
        cfg = dataclasses.replace(
            cfg, block_n=min(cfg.block_n, d & -d), split_k=1
        )  # a power of two dividing D
        block_k, one_tile, k_split = gemv_block_k(cfg, k)
        launch = {} if interpreted else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        _skinny_gemv_kernel[(rows // cfg.block_n, 1)](
            x, w, y, norm, y, y, y, rows, k, k_split, float(eps), w.stride(0),
            positions, inv, slot_mapping, kc, vc, q_cols, kv_cols,
            BLOCK_N=cfg.block_n, BLOCK_K=block_k, NORM=norm_weight is not None, ONE_TILE=one_tile,
            NORM_BLOCK=norm_block(k, cfg.num_warps) if norm_weight is not None else 16,
            **rope, **launch, **pdl.options(x),
        )  # fmt: skip
        return y
    cfg = rows_config(rows, k, d, norm=norm_weight is not None)
    launch = {} if interpreted else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    args = (
        x, w, y, norm, y, m, rows, k, float(eps), x.stride(0), w.stride(0), y.stride(0), 0,
        positions, inv, slot_mapping, kc, vc, q_cols, kv_cols,
    )  # fmt: skip
    if cfg.fma and cfg.one_tile and rows_tile_fits(cfg, k):
        _skinny_rows_tile_kernel[(rows // cfg.block_n,)](
            x, w, y, norm, y, rows, k, float(eps), x.stride(0), w.stride(0), y.stride(0), 0,
            positions, inv, slot_mapping, kc, vc, q_cols, kv_cols,
            ROWS=m, BLOCK_N=cfg.block_n, BLOCK_K=max(16, triton.next_power_of_2(k)),
            NORM=norm_weight is not None, **rope, **launch, **pdl.options(x),
        )  # fmt: skip
    elif cfg.fma:
        _skinny_rows_kernel[(rows // cfg.block_n,)](
            *args, M_POW2=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=rows_block_k(cfg, m, k),
            NORM=norm_weight is not None,
            NORM_BLOCK=rows_norm_block(m, k, cfg.num_warps) if norm_weight is not None else 16,
            **rope, **launch, **pdl.options(x),
        )  # fmt: skip
    else:
        upcast = interpreted or x.dtype == torch.float32
        _skinny_linear_kernel[(rows // cfg.block_n,)](
            *args, M_PAD=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            UPCAST=upcast, NORM=norm_weight is not None, **rope, **launch, **pdl.options(x),
        )  # fmt: skip
    return y


def qkv_rope_write_ref(
    x: Tensor,
    w: Tensor,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    positions: Tensor,
    inv_freq: Tensor,
    table_dtype: torch.dtype,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    layer: int = 0,
) -> Tensor:
    """The reference: `skinny_linear_ref` (the unfused product, rounded to x's dtype), then RoPE of q and k
    in float32 from `rope_cos_sin_ref`'s tables (`rope_ref`) and `kv_write_ref` of k_rot and v, as
    `rope_pos_kv_write_ref` does; returns [q_rot, k_rot, v] rounded to x's dtype."""
    kc = layer_view(k_cache, layer)
    q_cols, kv_cols, d = check_qkv_rope_args(
        x, w, norm_weight, eps, positions, inv_freq, table_dtype, kc, slot_mapping
    )
    y = skinny_linear_ref(x, w, norm_weight=norm_weight, eps=eps)
    m = x.shape[0]
    q, k, v = (t.reshape(m, -1, d) for t in y.split([q_cols, kv_cols, kv_cols], dim=-1))
    cos, sin = rope_cos_sin_ref(positions, inv_freq, table_dtype)
    q_rot, k_rot = rope_ref(q, cos, sin).to(x.dtype), rope_ref(k, cos, sin).to(x.dtype)
    kv_write_ref(k_rot, v, k_cache, v_cache, slot_mapping, layer=layer)
    return torch.cat([q_rot.reshape(m, -1), k_rot.reshape(m, -1), v.reshape(m, -1)], dim=-1)
