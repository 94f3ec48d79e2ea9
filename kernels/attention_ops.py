"""torch.library registrations of the paged-attention kernels (namespace "fspec").

    fspec::kv_write        (k, v, k_cache!, v_cache!, slot_mapping, *, layer=0) -> ()
    fspec::rope_kv_write   (q, k, v, cos, sin, k_cache!, v_cache!, slot_mapping, *, layer=0)
                           -> q_out [T, N, D] (RoPE'd q in the cache's dtype)
    fspec::rope_pos_kv_write (q, k, v, positions, k_cache!, v_cache!, slot_mapping, table_dtype, rope_type,
                           rope, *, layer=0) -> q_out: cos / sin computed in the kernel
    fspec::qkv_rope_write  (x [1, K], w, norm_weight?, eps, positions, k_cache!, v_cache!, slot_mapping,
                           table_dtype, rope_type, rope, *, layer=0) -> [q_rot, k_rot, v] [1, (N + 2·Nkv)·D]:
                           a one-row q/k/v product with rope_pos_kv_write as its epilogue
    fspec::paged_attention (q, k_cache, v_cache, block_table, seq_lens, positions, query_start_loc,
                            *, scale, num_query, layer=0, early_kv=False,
                            early_release=False) -> out [T, N, D]

Each op runs the Triton kernel when its tensors are on CUDA, or when the kernels were built by the Triton
interpreter (TRITON_INTERPRET=1 before import, as in tests/kernels) and nothing is being traced; otherwise
the plain-PyTorch reference beside the kernel (docs/compile-facts.md, "Triton ops under torch.compile").
The fake implementations let `torch.compile(fullgraph=True)` trace through the ops.

Callers pass the whole cache buffers ([num_blocks, block_size, Nkv, D], or the stacked [L, ...] with
`layer`), never views: a view of a buffer that a compiled graph cloned can be rewritten to the original
(pytorch#198031).
`kv_write`, `rope_kv_write`, `rope_pos_kv_write` and `qkv_rope_write` mutate exactly k_cache and v_cache
(the cache is donated; the RoPE ops return a fresh q_out or [q_rot, k_rot, v], never an alias);
`paged_attention` mutates nothing and returns a fresh tensor.
"""

import torch
from torch import Tensor

from . import kv_write as _kv
from . import paged_attention as _pa
from . import qkv_rope_write as _qrw
from . import rope_cos_sin as _rcs
from . import rope_kv_write as _rkv
from .dispatch import kernels_interpreted, register  # noqa: F401  (kernels_interpreted re-exported)
from .dispatch import use_triton as _use_triton


@register("fspec::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *, layer: int = 0
) -> None:
    """Write k/v [T, Nkv, D] into `layer` of the caches at slot_mapping [T] int64; slot -1 is skipped."""
    impl = _kv.kv_write if _use_triton(k_cache) else _kv.kv_write_ref
    impl(k, v, k_cache, v_cache, slot_mapping, layer=layer)


@kv_write.register_fake
def _(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *, layer: int = 0
) -> None:
    return None


@register("fspec::rope_kv_write", mutates_args=("k_cache", "v_cache"))
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
    """RoPE q [T, N, D] and k [T, Nkv, D] by cos/sin [T, D]; write k and v into `layer` of the caches at
    slot_mapping [T] (-1 skipped); return the rotated q in the cache's dtype (kernels/rope_kv_write.py)."""
    impl = _rkv.rope_kv_write if _use_triton(k_cache) else _rkv.rope_kv_write_ref
    return impl(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, layer=layer)


@rope_kv_write.register_fake
def _(
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
    return q.new_empty(q.shape, dtype=k_cache.dtype)


@register("fspec::qkv_rope_write", mutates_args=("k_cache", "v_cache"))
def qkv_rope_write(
    x: Tensor,
    w: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    table_dtype: torch.dtype,
    rope_type: str,
    rope: list[float],
    *,
    layer: int = 0,
) -> Tensor:
    """The fused q/k/v product of x's rows (RMSNorm of x first with `norm_weight`) with RoPE and the cache
    write as its epilogue: `rope_pos_kv_write` of `skinny_linear`'s q, k, v in one launch; returns [q_rot,
    k_rot, v] [M, (N + 2·Nkv)·D] in x's dtype (kernels/qkv_rope_write.py; M rows as its `supports`). RoPE's
    inverse frequencies as `rope_pos_kv_write`'s."""
    d = k_cache.shape[-1]
    inv_freq = _rcs.cached_inv_freq((d, rope_type, tuple(rope)), x.device)
    impl = _qrw.qkv_rope_write if _use_triton(k_cache) else _qrw.qkv_rope_write_ref
    return impl(
        x, w, norm_weight=norm_weight, eps=eps, positions=positions, inv_freq=inv_freq,
        table_dtype=table_dtype, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, layer=layer,
    )  # fmt: skip


@qkv_rope_write.register_fake
def _(
    x: Tensor,
    w: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    table_dtype: torch.dtype,
    rope_type: str,
    rope: list[float],
    *,
    layer: int = 0,
) -> Tensor:
    kc = _kv.layer_view(k_cache, layer)
    inv_freq = x.new_empty(kc.shape[-1] // 2, dtype=torch.float32)
    _qrw.check_qkv_rope_args(x, w, norm_weight, eps, positions, inv_freq, table_dtype, kc, slot_mapping)
    return x.new_empty((x.shape[0], w.shape[0]))


@register("fspec::rope_pos_kv_write", mutates_args=("k_cache", "v_cache"))
def rope_pos_kv_write(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    table_dtype: torch.dtype,
    rope_type: str,
    rope: list[float],
    *,
    layer: int = 0,
) -> Tensor:
    """`rope_kv_write` with RoPE's cos / sin computed in the kernel from positions [T] and the rope
    parameters (as `fspec::rope_tables`'s; inverse frequencies kept per device,
    `rope_cos_sin.cached_inv_freq`), rounded to `table_dtype` as the tables would be
    (kernels/rope_kv_write.py)."""
    key = (q.shape[-1], rope_type, tuple(rope))
    inv_freq = _rcs.cached_inv_freq(key, q.device)
    impl = _rkv.rope_pos_kv_write if _use_triton(k_cache) else _rkv.rope_pos_kv_write_ref
    return impl(q, k, v, positions, inv_freq, table_dtype, k_cache, v_cache, slot_mapping, layer=layer)


@rope_pos_kv_write.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, k_cache: Tensor, *rest, layer: int = 0) -> Tensor:
    return q.new_empty(q.shape, dtype=k_cache.dtype)  # as rope_kv_write's: q's shape in the cache's dtype


@register("fspec::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    num_query: int,
    layer: int = 0,
    early_kv: bool = False,
    early_release: bool = False,
) -> Tensor:
    """Attention of q [T, N, D] over each request's cached positions 0..p (kernels/paged_attention.py).
    `early_kv`: the caller vouches that the kernel ahead writes only q and the query tokens' cache rows, so
    the old rows may load before the PDL wait; `early_release`: that the launch after reads only constants
    before its wait, so the reduce lets it start early (`paged_attention`'s docstring). Same result."""
    if _use_triton(q):
        return _pa.paged_attention(
            q, k_cache, v_cache, block_table, seq_lens, positions, query_start_loc,
            scale=scale, num_query=num_query, layer=layer, early_kv=early_kv, early_release=early_release,
        )  # fmt: skip
    return _pa.paged_attention_ref(
        q, k_cache, v_cache, block_table, seq_lens, positions, query_start_loc,
        scale=scale, num_query=num_query, layer=layer,
    )  # fmt: skip


@paged_attention.register_fake
def _(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    num_query: int,
    layer: int = 0,
    early_kv: bool = False,
    early_release: bool = False,
) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
