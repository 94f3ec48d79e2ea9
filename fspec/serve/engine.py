"""End-to-end speculative generation over a batch of requests: `fspec.generate`.

Naming convention: p = target distribution, q = draft distribution.

A run is: target prefill of the prompts (ragged) and the first token; the head's prefill over the prompts
(the first step of `propose`), then rounds of

    target forward over [current token, d_1..d_K] (K + 1 rows per request)
    -> rejection sampling (accepted drafts, then the replacement or bonus token)
    -> `propose` from the accepted rows: its first step runs over those num_accepted + 1 rows, whose target
       hidden states the verification just produced, then K - 1 decode steps.

Positions: the current token t_n sits at position n (not yet in the target cache); the round writes n..n+K;
draft k sits at n + k. EAGLE pairs the target hidden of position i with the token at i + 1, so the head's
rows of a round are positions n..n+a (a = accepted drafts) and the head's cache lags the target's by one.
Rejected drafts' K/V are simply overwritten next round: nothing reads past seq_lens.

The batch is padded once to its bucket; finished requests become padding rows (positions and slots -1) and
their blocks go back to the allocator, so compiled graphs see one shape for the whole run. Host work happens
between rounds only (one sync per round for the accepted counts), never between draft steps.

`acceptance_length` = mean tokens emitted per target verification forward (accepted drafts + the
replacement or bonus token), counted per request and round, before truncation at EOS or max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from fspec.models.checkpoint import Draft, Target
from fspec.serve.prefill import MIN_TEMPERATURE, max_model_len
from fspec.serve.runner import _DEFAULT, GenerateResult, Generator, Stats, default_generator

__all__ = [
    "MIN_TEMPERATURE",
    "GenerateResult",
    "Generator",
    "Stats",
    "default_generator",
    "generate",
    "max_model_len",
]


def generate(
    target: Target,
    draft: Draft | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float | Sequence[float] = 0.0,
    seed: int | Sequence[int] = 0,
    num_speculative_steps: int = 3,
    compile: bool = False,
    progress: bool = False,
) -> GenerateResult:
    """Generate up to `max_new_tokens` per prompt with speculative decoding (target-only when draft is None).

    prompts: strings (the target needs a tokenizer) or token-id lists. temperature and seed: one for all
    requests or one per prompt; temperature 0 = greedy, else >= MIN_TEMPERATURE (1e-6); seeds are 64-bit
    ints. Bad arguments raise ValueError naming them (see RELIABILITY.md). Each request stops at an EOS
    token of the target's config, at max_new_tokens, or when its sequence (prompt + new tokens) reaches
    max_model_len.
    compile=True runs the draft loop and the target's decode/verification forward as CUDA graphs
    (`torch.compile`, reduce-overhead), kept between calls by `default_generator()` (a `fspec.Generator`).
    """
    return _DEFAULT.generate(
        target,
        draft,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        num_speculative_steps=num_speculative_steps,
        compile=compile,
        progress=progress,
    )
