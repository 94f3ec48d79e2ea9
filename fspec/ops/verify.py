"""Verification of draft tokens by lossless rejection sampling.

Convention, everywhere in fspec: **p = target distribution, q = draft distribution** (gpt-fast uses the
opposite names).

For draft k (Leviathan et al. 2023; Chen et al. 2023): accept x_k iff u_k < p(x_k) / q(x_k), computed as
u_k * q(x_k) < p(x_k) (no division); greedy drafts have q = one-hot(x_k), so accept iff u_k < p(x_k). At the
first rejection emit a sample of norm(max(p - q, 0)) (one-hot q: p without x_k) and stop; if all K drafts are
accepted, emit a bonus token sampled from p at slot K. If the residual has no mass (p == q exactly, reachable
only when q(x_k) = 0), the replacement is sampled from p. Greedy target (temperature 0): accept iff
argmax p == x_k; the replacement / bonus is argmax p. The emitted tokens are distributed exactly as sampling
from p token by token. Expected tokens per target call: (1 - a^(K+1)) / (1 - a), a = sum_x min(p(x), q(x)).

Randomness: u_k, the residual noise and the bonus noise are Philox streams keyed by (seed, position, token,
salt) with salts SALT_ACCEPT, SALT_RESIDUAL, SALT_BONUS, all distinct from the draft's SALT_DRAFT. Reusing
the draft's noise for the residual biases the output (vLLM issue #47386); tests/ops/test_verify.py shows it.
"""

import torch
from torch import Tensor

from fspec.kernels import ops as kops
from fspec.kernels.philox import MAX_VOCAB
from fspec.kernels.value_flags import (
    FLAG_DRAFTS,
    FLAG_LOGITS,
    FLAG_POSITIONS,
    FLAG_PROBS,
    FLAG_TEMPERATURE,
    bad_drafts,
    bad_probs,
)
from fspec.ops.sampling import (
    FLOAT_DTYPES,
    argument_error,
    check_logits,
    check_options,
    check_positions,
    check_temperature,
    check_tensor,
    raise_flagged,
    unit_stride,
)

__all__ = ["rejection_sample"]


def _validate_rejection(
    target_logits, draft_tokens, draft_probs, temperature, seed, positions, options=(None,) * 3
) -> None:
    check_tensor("target_logits", target_logits, ndim=3, dtypes=FLOAT_DTYPES)
    b, k1, v = target_logits.shape
    if k1 < 2:
        raise argument_error(
            "target_logits", "shape [B, K+1, V] with K >= 1", f"shape {tuple(target_logits.shape)}"
        )
    if not 1 <= v < MAX_VOCAB:
        raise argument_error("target_logits", f"a vocabulary size in [1, {MAX_VOCAB})", v)
    k, dev = k1 - 1, target_logits.device
    check_tensor("draft_tokens", draft_tokens, shape=(b, k), dtypes=(torch.int64,), device=dev)
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, shape=(b, k, v), dtypes=(torch.float32,), device=dev)
    check_tensor("temperature", temperature, shape=(b,), dtypes=(torch.float32,), device=dev)
    check_tensor("seed", seed, shape=(b,), dtypes=(torch.int64,), device=dev)
    check_tensor("positions", positions, shape=(b,), dtypes=(torch.int64,), device=dev)
    option_bits, option_checks = check_options(*options, n=b, device=dev)

    def check_q() -> (
        None
    ):  # q enters the test u * q(x) < p(x): a NaN or negative q accepts or rejects at will
        bad = bad_probs(draft_probs)
        if bool(bad.any()):
            raise argument_error(
                "draft_probs",
                "finite probabilities >= 0",
                f"{draft_probs[bad][:4].tolist()} (first bad values)",
            )

    def check_drafts() -> None:
        bad = bad_drafts(draft_tokens, v)
        if bool(bad.any()):
            raise argument_error(
                "draft_tokens", f"token ids in [0, {v})", f"{draft_tokens[bad][:4].tolist()}"
            )

    flags = kops.value_flags(
        target_logits, temperature, positions, k, None, 0, draft_tokens, draft_probs, None
    )
    raise_flagged(
        int(flags if option_bits is None else flags | option_bits),
        (FLAG_PROBS, check_q),
        (FLAG_DRAFTS, check_drafts),
        (FLAG_TEMPERATURE, lambda: check_temperature(temperature)),
        (FLAG_LOGITS, lambda: check_logits("target_logits", target_logits, temperature)),
        (FLAG_POSITIONS, lambda: check_positions(positions, span=k)),
        *option_checks,
    )


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
    """Verify K draft tokens per request against the target; lossless for sampled and greedy drafts.

    Args:
        target_logits: [B, K+1, V] float32 / bfloat16 / float16 (computed in float32): the target's logits
            at the K draft slots and the bonus slot. NaN counts as -inf; a slot without a finite logit is a
            one-hot at token 0. +inf, or a temperature that overflows logits / temperature, is refused.
            A vocabulary stride other than 1 costs a contiguous copy.
        draft_tokens: [B, K] int64 in [0, V).
        draft_probs: [B, K, V] float32, the draft's processed probabilities q (what `gumbel_sample` writes
            to `out_probs`; finite, >= 0), or None for greedy drafts (q = one-hot of the draft token).
        temperature: [B] float32, finite, >= 0: the target's temperature (0 = greedy verification).
        seed: [B] int64 Philox key per request (the same seed the draft sampled with).
        positions: [B] int64: position of each request's first draft token; draft k sits at
            positions[b] + k and the bonus token at positions[b] + K. -1 marks a padding row.
            Any stride is fine for every argument (temperature, seed and positions are copied to unit
            stride when they are not). B = 0 gives empty outputs.
        top_k: [B] int32 / int64 >= 0, top_p: [B] float32 in (0, 1], min_p: [B] float32 in [0, 1): the
            target's sampling options per request (0, 1, 0 = off; all three tensors or all three None). Every
            slot then verifies against the target's processed p' (kernels/sampling_filter.py): accept x with
            min(1, p'(x) / q'(x)), q' = draft_probs as given (the draft's own processed q'), residual
            norm(max(0, p' - q')), bonus from p'. The output is distributed as sampling from p'.

    Returns:
        tokens [B, K+1] int64: accepted drafts, then the replacement or bonus token, then -1;
        num_accepted [B] int64 in [0, K] (tokens emitted = num_accepted + 1).

    Raises:
        ValueError naming the argument (eager calls only; skipped under torch.compile).
    """
    if not torch.compiler.is_compiling():
        options = (top_k, top_p, min_p)
        _validate_rejection(target_logits, draft_tokens, draft_probs, temperature, seed, positions, options)
    temperature, seed, positions = unit_stride(temperature, seed, positions)
    return kops.rejection_sample(
        target_logits, draft_tokens, draft_probs, temperature, seed, positions, top_k, top_p, min_p
    )
