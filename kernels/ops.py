"""torch.library registrations of fspec's kernels (namespace "fspec"), one section per op.

Each op runs the Triton kernel when its tensors are on CUDA, or when the kernels were built by the Triton
interpreter (`TRITON_INTERPRET=1` before import, e.g. in tests/kernels) and nothing is being traced;
otherwise it runs the plain-PyTorch reference beside the kernel (COMPILE-FACTS.md, "Triton ops under
torch.compile": `triton_op` cannot trace on a CPU-only machine). Every op has a fake implementation, so
`torch.compile(fullgraph=True)` traces through it; a raw Triton call in compiled code breaks tracing.

Ops never return an alias of an input (custom ops cannot), and `mutates_args` names exactly the buffers a
kernel writes; callers pass whole buffers plus the column tensor, never views (pytorch#198031).

    fspec::gumbel_sample        (logits, temperature, seed, positions, salt) -> tokens [N]
    fspec::gumbel_sample_into   (... , out_tokens!, out_probs!, col) -> tokens [N] (fresh tensor)
    fspec::rejection_sample     (target_logits, draft_tokens, draft_probs?, temperature, seed, positions)
                                -> (tokens [B, K+1], num_accepted [B])
    fspec::skinny_linear        (x [M, K], w [N, K]) -> x @ w.T [M, N], M <= 16 (kernels/skinny_linear.py)
"""

import torch
from torch import Tensor

from . import attention_ops, gumbel, rejection  # noqa: F401  (attention_ops registers its ops)
from . import skinny_linear as _sl
from .dispatch import call, kernels_interpreted, register  # noqa: F401  (re-exported)
from .dispatch import use_triton as _use_triton

# ----------------------------------------------------------------------------------------------------------
# fspec::gumbel_sample, fspec::gumbel_sample_into (kernels/gumbel.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::gumbel_sample", mutates_args=())
def gumbel_sample(logits: Tensor, temperature: Tensor, seed: Tensor, positions: Tensor, salt: int) -> Tensor:
    """Gumbel-max sample per row of logits [N, V] -> int64 [N]."""
    impl = gumbel.gumbel_sample if _use_triton(logits) else gumbel.gumbel_sample_ref
    return impl(logits, temperature, seed, positions, salt=salt)


@gumbel_sample.register_fake
def _(logits: Tensor, temperature: Tensor, seed: Tensor, positions: Tensor, salt: int) -> Tensor:
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
) -> Tensor:
    """Gumbel-max sample, also written to out_tokens[:, col] and out_probs[:, col, :]; fresh tokens [N]."""
    impl = gumbel.gumbel_sample if _use_triton(logits) else gumbel.gumbel_sample_ref
    return impl(
        logits, temperature, seed, positions, salt=salt, out_tokens=out_tokens, out_probs=out_probs, col=col
    )


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
) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


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
) -> tuple[Tensor, Tensor]:
    """Lossless rejection sampling -> (tokens [B, K+1] int64, num_accepted [B] int64)."""
    impl = rejection.rejection_sample if _use_triton(target_logits) else rejection.rejection_sample_ref
    return impl(target_logits, draft_tokens, draft_probs, temperature, seed, positions)


@rejection_sample.register_fake
def _(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    b, k1, _ = target_logits.shape
    return target_logits.new_empty((b, k1), dtype=torch.int64), target_logits.new_empty(b, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------
# fspec::skinny_linear (kernels/skinny_linear.py)
# ----------------------------------------------------------------------------------------------------------


@register("fspec::skinny_linear", mutates_args=())
def skinny_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype (M <= 16; fspec.models.layers.linear routes to it)."""
    impl = _sl.skinny_linear if _use_triton(x) else _sl.skinny_linear_ref
    return impl(x, w)


@skinny_linear.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    _sl.check_args(x, w)
    return x.new_empty((x.shape[0], w.shape[0]))
