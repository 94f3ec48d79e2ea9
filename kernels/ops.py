"""torch.library registrations of fspec's kernels (namespace "fspec"), one section per op.

Each op runs the Triton kernel when its tensors are on CUDA, or when the kernels were built by the Triton
interpreter (`TRITON_INTERPRET=1` before import, e.g. in tests/kernels) and nothing is being traced;
otherwise it runs the plain-PyTorch reference beside the kernel (docs/compile-facts.md, "Triton ops under
torch.compile": `triton_op` cannot trace on a CPU-only machine). Every op has a fake implementation, so
`torch.compile(fullgraph=True)` traces through it; a raw Triton call in compiled code breaks tracing.

Ops never return an alias of an input (custom ops cannot), and `mutates_args` names exactly the buffers a
kernel writes; callers pass whole buffers plus the column tensor, never views (pytorch#198031).

    fspec::gumbel_sample        (logits, temperature, seed, positions, salt, top_k?, top_p?, min_p?)
                                -> tokens [N]
    fspec::gumbel_sample_into   (... , out_tokens!, out_probs!, col, d2t?, position_offset, top_k?, top_p?,
                                min_p?) -> (tokens [N], col + 1) (fresh tensors)
    fspec::rejection_sample     (target_logits, draft_tokens, draft_probs?, temperature, seed, positions,
                                top_k?, top_p?, min_p?) -> (tokens [B, K+1], num_accepted [B])
    fspec::sampling_filter      (logits [N, V] or [B, K+1, V], temperature, top_k, top_p, min_p,
                                rows_per_request) -> (thr [N], cut [N]): the kept prefix of top_k / top_p /
                                min_p (kernels/sampling_filter.py)
    fspec::skinny_linear        (x [M, K], w [N, K], norm_weight?, eps, silu_mul, residual?) -> [M, N]:
                                x @ w.T for M <= 16, RMSNorm / SiLU * up first, + residual (skinny_linear.py)
    fspec::step_metadata        (start, count?, block_table, num_query, block_size, max_model_len, mode,
                                steps) -> (positions, query_start_loc, seq_lens, slot_mapping)
                                (kernels/step_metadata.py)
    fspec::rope_cos_sin         (positions [...], inv_freq [D/2], dtype) -> (cos, sin) [..., D]
                                (kernels/rope_cos_sin.py)
    fspec::rope_tables          (positions [...], dtype, rope parameters) -> (cos, sin) [..., D], the
                                inverse frequencies kept per device by the op
    fspec::rms_norm             (x [..., H], weight [H], eps) -> [..., H]: RMSNorm in one launch, for eager
                                CUDA code (kernels/rms_norm.py)
    fspec::add_rms_norm         (x, residual [..., H], weight [H], eps) -> (x + residual, its RMSNorm), one
                                launch (kernels/rms_norm.py)
    fspec::silu_mul             (gate_up [..., 2I]) -> silu(gate) * up [..., I], one launch
                                (kernels/silu_mul.py)
    fspec::value_flags          (logits, temperature, positions, span, col?, ncols, draft_tokens?,
                                draft_probs?, d2t?) -> int32 [1]: the public functions' value checks, one bit
                                each (kernels/value_flags.py)
"""

import torch
from torch import Tensor

from . import gumbel, rejection
from . import rms_norm as _rn
from . import rope_cos_sin as _rcs
from . import sampling_filter as _sf
from . import silu_mul as _silu
from . import skinny_linear as _sl
from . import step_metadata as _sm
from . import value_flags as _vf
from .attention_ops import (  # noqa: F401  (the attention ops, re-exported: every op is `ops.<name>`)
    kv_write,
    paged_attention,
    qkv_rope_write,
    rope_kv_write,
    rope_pos_kv_write,
)
from .dispatch import kernels_interpreted, register  # noqa: F401  (re-exported)
from .dispatch import use_triton as _use_triton

# ----------------------------------------------------------------------------------------------------------
# fspec::gumbel_sample, fspec::gumbel_sample_into (kernels/gumbel.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::gumbel_sample", mutates_args=())
def gumbel_sample(
    logits: Tensor,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    salt: int,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    """Gumbel-max sample per row of logits [N, V] -> int64 [N]; with the options ([N] each, all three or
    none), from p' (kernels/sampling_filter.py)."""
    impl = gumbel.gumbel_sample if _use_triton(logits) else gumbel.gumbel_sample_ref
    return impl(logits, temperature, seed, positions, salt=salt, top_k=top_k, top_p=top_p, min_p=min_p)


@gumbel_sample.register_fake
def _(
    logits: Tensor,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    salt: int,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@register("fspec::gumbel_sample_into", mutates_args=("out_tokens", "out_probs"))
def gumbel_sample_into(
    logits: Tensor,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    salt: int,
    out_tokens: Tensor,
    out_probs: Tensor,
    col: Tensor,
    d2t: Tensor | None = None,
    position_offset: int = 0,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Gumbel-max sample, also written to out_tokens[:, col] and out_probs[:, col, :]; fresh (tokens [N],
    col + 1) (with d2t: ids t + d2t[t], in the tokens and out_tokens). Row r's Philox counter is
    positions[r] + position_offset (positions of any integer dtype: a draft step passes its seq_lens and 1,
    no kernel of its own for the sum); col + 1 is a draft step's next step counter, written by the same
    launch. With the options ([N] each, all three or none) the token is drawn from p' over the given
    (draft) vocabulary and out_probs receives p'."""
    impl = gumbel.gumbel_sample if _use_triton(logits) else gumbel.gumbel_sample_ref
    next_col = torch.empty_like(col)
    tokens = impl(
        logits, temperature, seed, positions, salt=salt, out_tokens=out_tokens, out_probs=out_probs, col=col,
        d2t=d2t, position_offset=position_offset, next_col=next_col, top_k=top_k, top_p=top_p, min_p=min_p,
    )  # fmt: skip
    return tokens, next_col


@gumbel_sample_into.register_fake
def _(
    logits: Tensor,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    salt: int,
    out_tokens: Tensor,
    out_probs: Tensor,
    col: Tensor,
    d2t: Tensor | None = None,
    position_offset: int = 0,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    return logits.new_empty(logits.shape[0], dtype=torch.int64), torch.empty_like(col)


# ----------------------------------------------------------------------------------------------------------
# fspec::rejection_sample (kernels/rejection.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::rejection_sample", mutates_args=())
def rejection_sample(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Lossless rejection sampling -> (tokens [B, K+1] int64, num_accepted [B] int64); with the options
    ([B] each, all three or none), against the target's p' at every slot."""
    impl = rejection.rejection_sample if _use_triton(target_logits) else rejection.rejection_sample_ref
    return impl(target_logits, draft_tokens, draft_probs, temperature, seed, positions, top_k, top_p, min_p)


@rejection_sample.register_fake
def _(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    b, k1, _ = target_logits.shape
    return target_logits.new_empty((b, k1), dtype=torch.int64), target_logits.new_empty(b, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------
# fspec::sampling_filter (kernels/sampling_filter.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::sampling_filter", mutates_args=())
def sampling_filter(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    rows_per_request: int = 1,
) -> tuple[Tensor, Tensor]:
    """The kept prefix of top_k / top_p / min_p per row of logits [N, V] (or [B, K+1, V]) -> (thr [N]
    float32, cut [N] int32); row n uses the options of request n // rows_per_request."""
    impl = _sf.sampling_filter if _use_triton(logits) else _sf.sampling_filter_ref
    return impl(logits, temperature, top_k, top_p, min_p, rows_per_request)


@sampling_filter.register_fake
def _(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    rows_per_request: int = 1,
) -> tuple[Tensor, Tensor]:
    n = logits.numel() // logits.shape[-1]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------------
# fspec::skinny_linear (kernels/skinny_linear.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::skinny_linear", mutates_args=())
def skinny_linear(
    x: Tensor,
    w: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: Tensor | None = None,
) -> Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype (M <= 16; fspec.models.layers.linear routes to it), with
    the optional RMSNorm prologue and SiLU * up (w = [w_gate; w_up] -> [M, N/2]) and residual epilogues of
    kernels/skinny_linear.py."""
    impl = _sl.skinny_linear if _use_triton(x) else _sl.skinny_linear_ref
    return impl(x, w, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual)


@skinny_linear.register_fake
def _(
    x: Tensor,
    w: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: Tensor | None = None,
) -> Tensor:
    _sl.check_args(x, w, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual)
    return x.new_empty((x.shape[0], w.shape[0] // 2 if silu_mul else w.shape[0]))


# ----------------------------------------------------------------------------------------------------------
# fspec::step_metadata (kernels/step_metadata.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::step_metadata", mutates_args=())
def step_metadata(
    start: Tensor,
    count: Tensor | None,
    block_table: Tensor,
    num_query: int,
    block_size: int,
    max_model_len: int,
    mode: int,
    steps: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A step's (positions, query_start_loc, seq_lens, slot_mapping) in one launch; `steps` > 1 (MODE_AFTER):
    that many decode steps in a row, stacked."""
    impl = _sm.step_metadata if _use_triton(start) else _sm.step_metadata_ref
    return impl(
        start, count, block_table, num_query=num_query, block_size=block_size, max_model_len=max_model_len,
        mode=mode, steps=steps,
    )  # fmt: skip


@step_metadata.register_fake
def _(
    start: Tensor,
    count: Tensor | None,
    block_table: Tensor,
    num_query: int,
    block_size: int,
    max_model_len: int,
    mode: int,
    steps: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _sm.check_steps(steps, mode)
    return _sm._outputs(start.shape[0], num_query if mode == _sm.MODE_FIRST else 1, start.device, steps)


def _step_metadata_vmap(
    info, in_dims, start, count, block_table, num_query, block_size, max_model_len, mode, steps=1
):
    """Batched inputs (metadata stacked over a leading dim): the reference per batch entry, stacked."""

    def entry(x, dim, i):
        return x if dim is None else x.select(dim, i)

    outs = [
        _sm.step_metadata_ref(
            entry(start, in_dims[0], i),
            count if count is None else entry(count, in_dims[1], i),
            entry(block_table, in_dims[2], i),
            num_query=num_query,
            block_size=block_size,
            max_model_len=max_model_len,
            mode=mode,
            steps=steps,
        )  # fmt: skip
        for i in range(info.batch_size)
    ]
    return tuple(torch.stack(field) for field in zip(*outs)), (0, 0, 0, 0)


step_metadata.register_vmap(_step_metadata_vmap)


# ----------------------------------------------------------------------------------------------------------
# fspec::rope_cos_sin (kernels/rope_cos_sin.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::rope_cos_sin", mutates_args=())
def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """RoPE's (cos, sin) [..., D] of integer positions [...] in one launch."""
    impl = _rcs.rope_cos_sin if _use_triton(positions) else _rcs.rope_cos_sin_ref
    return impl(positions, inv_freq, dtype)


@rope_cos_sin.register_fake
def _(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    shape = (*positions.shape, 2 * inv_freq.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


def _rope_cos_sin_vmap(info, in_dims, positions, inv_freq, dtype):
    """Batched positions broadcast through the reference (leading dims); batched inv_freq, per entry."""
    pos_dim, freq_dim = in_dims[:2]  # dtype has no batch dim
    if freq_dim is None:
        positions = positions if pos_dim is None else positions.movedim(pos_dim, 0)
        if pos_dim is None:
            positions = positions.expand(info.batch_size, *positions.shape)
        return _rcs.rope_cos_sin_ref(positions, inv_freq, dtype), (0, 0)
    outs = [
        _rcs.rope_cos_sin_ref(
            positions if pos_dim is None else positions.select(pos_dim, i),
            inv_freq.select(freq_dim, i),
            dtype,
        )
        for i in range(info.batch_size)
    ]
    return tuple(torch.stack(field) for field in zip(*outs)), (0, 0)


rope_cos_sin.register_vmap(_rope_cos_sin_vmap)


@register("fspec::rope_tables", mutates_args=())
def rope_tables(
    positions: Tensor, dtype: torch.dtype, head_dim: int, rope_type: str, rope: list[float]
) -> tuple[Tensor, Tensor]:
    """`rope_cos_sin` with the inverse frequencies of the rope parameters (`rope_cos_sin.inv_freq`; rope =
    [theta, factor, low_freq_factor, high_freq_factor, original_max]), kept per device by the op
    (`cached_inv_freq`): a compiled graph holds no kernel that computes them."""
    key = (head_dim, rope_type, tuple(rope))
    impl = _rcs.rope_cos_sin if _use_triton(positions) else _rcs.rope_cos_sin_ref
    return impl(positions, _rcs.cached_inv_freq(key, positions.device), dtype)


@rope_tables.register_fake
def _(
    positions: Tensor, dtype: torch.dtype, head_dim: int, rope_type: str, rope: list[float]
) -> tuple[Tensor, Tensor]:
    shape = (*positions.shape, 2 * (head_dim // 2))
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


def _rope_tables_vmap(info, in_dims, positions, dtype, head_dim, rope_type, rope):
    """Batched positions (the only tensor) through the reference, batch dim first."""
    positions = positions.movedim(in_dims[0], 0)
    freq = _rcs.cached_inv_freq((head_dim, rope_type, tuple(rope)), positions.device)
    return _rcs.rope_cos_sin_ref(positions, freq, dtype), (0, 0)


rope_tables.register_vmap(_rope_tables_vmap)


# ----------------------------------------------------------------------------------------------------------
# fspec::value_flags (kernels/value_flags.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::value_flags", mutates_args=())
def value_flags(
    logits: Tensor,
    temperature: Tensor,
    positions: Tensor,
    span: int,
    col: Tensor | None,
    ncols: int,
    draft_tokens: Tensor | None,
    draft_probs: Tensor | None,
    d2t: Tensor | None,
) -> Tensor:
    """The FLAG_* bits of the public functions' value checks -> int32 [1]."""
    impl = _vf.value_flags if _use_triton(logits) else _vf.value_flags_ref
    return impl(logits, temperature, positions, span, col, ncols, draft_tokens, draft_probs, d2t)


@value_flags.register_fake
def _(
    logits: Tensor,
    temperature: Tensor,
    positions: Tensor,
    span: int,
    col: Tensor | None,
    ncols: int,
    draft_tokens: Tensor | None,
    draft_probs: Tensor | None,
    d2t: Tensor | None,
) -> Tensor:
    return logits.new_empty(1, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------------
# fspec::rms_norm (kernels/rms_norm.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x's last axis times weight, in one launch (kernels/rms_norm.py)."""
    impl = _rn.rms_norm if _use_triton(x) else _rn.rms_norm_ref
    return impl(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@register("fspec::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, its RMSNorm times weight), in one launch (kernels/rms_norm.py)."""
    impl = _rn.add_rms_norm if _use_triton(x) else _rn.add_rms_norm_ref
    return impl(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


# ----------------------------------------------------------------------------------------------------------
# fspec::silu_mul (kernels/silu_mul.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of a fused gate/up projection's output [..., 2I], one launch (kernels/silu_mul.py)."""
    impl = _silu.silu_mul if _use_triton(gate_up) else _silu.silu_mul_ref
    return impl(gate_up)


@silu_mul.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
