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

from collections.abc import Iterator, Sequence

from fspec.models.checkpoint import Draft, Target
from fspec.serve.generator import _DEFAULT, GenerateResult, Generator, Stats, default_generator
from fspec.serve.prefill import MAX_TEMPERATURE, MIN_TEMPERATURE, max_model_len
from fspec.serve.stream import StreamChunk

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "GenerateResult",
    "Generator",
    "Stats",
    "StreamChunk",
    "default_generator",
    "generate",
    "max_model_len",
    "stream",
]


def generate(
    target: Target,
    draft: Draft | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float | Sequence[float] | None = None,
    seed: int | Sequence[int] = 0,
    top_k: int | Sequence[int] | None = None,
    top_p: float | Sequence[float] | None = None,
    min_p: float | Sequence[float] | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int = 0,
    num_speculative_steps: int | None = None,
    compile: bool = False,
    progress: bool = False,
) -> GenerateResult:
    """Generate up to `max_new_tokens` per prompt with speculative decoding (target-only when draft is None).

    prompts: strings (the target needs a tokenizer) or token-id lists. The sampling options, each one for all
    requests or one per prompt, mixed freely in a batch (read by the kernels from tensors: changing them never
    recompiles): temperature (0 = greedy, the default; else in [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-6,
    1e4]), seed (64-bit ints; a 0-d tensor is one value, a [B] tensor one per prompt),
    top_k (keep the k most likely tokens; 0 = off), top_p (the shortest most-likely prefix of mass >= top_p;
    1 = off), min_p (drop tokens less likely than min_p times the most likely; 0 = off), composed as vLLM
    composes them (min_p, top_k, then top_p over what is left). Speculation stays lossless under all of
    them: the draft samples from its own processed distribution q' and verification accepts against the
    target's processed p', so the output is distributed as target-only sampling with the same options.
    num_speculative_steps: K (default: the K the head recorded). Bad arguments raise ValueError naming them
    (see RELIABILITY.md).
    Stop conditions (the same for every request; `fspec.serve.stops`): each request ends at the first of a
    stop string in its new text (`stop`: one string or a list; the target needs a tokenizer; text and
    tokens are cut before the match), a token of `stop_token_ids` (kept, like EOS), an EOS token (kept;
    `eos_token_id` overrides the set, default generation_config.json's, else config.json's; `ignore_eos`
    disables it), max_new_tokens, or its sequence (prompt + new tokens) reaching max_model_len. None of the
    first three ends a request before it has `min_new_tokens` new tokens. `finish_reason` says which:
    "stop", "eos" or "length".
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
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        eos_token_id=eos_token_id,
        min_new_tokens=min_new_tokens,
        num_speculative_steps=num_speculative_steps,
        compile=compile,
        progress=progress,
    )


def stream(
    target: Target,
    draft: Draft | None,
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float | None = None,
    seed: int = 0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int = 0,
    num_speculative_steps: int | None = None,
    compile: bool = False,
    progress: bool = False,
) -> Iterator[StreamChunk]:
    """`generate` for one prompt, as an iterator of `StreamChunk`s (text delta, token ids, finish_reason)
    yielded as rounds finish; the last chunk carries the finish_reason.

        for chunk in fspec.stream(target, draft, "Once upon a time", max_new_tokens=64, stop="\\n\\n"):
            print(chunk.text, end="", flush=True)

    Text that could still begin a stop string is held back until the next tokens decide, so the deltas
    (and the token lists) concatenate to exactly what `generate` returns for the same arguments. Arguments
    are checked when `stream` is called, before the first chunk. A compiled stream uses the default
    generator's caches: run one compiled stream or call at a time per `Generator` (compile=False streams
    are independent).
    """
    return _DEFAULT.stream(
        target,
        draft,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        eos_token_id=eos_token_id,
        min_new_tokens=min_new_tokens,
        num_speculative_steps=num_speculative_steps,
        compile=compile,
        progress=progress,
    )
