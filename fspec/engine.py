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

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fspec.checkpoint import Draft, Target
from fspec.pytree import tree
from fspec.runner import Resources, Run


@dataclasses.dataclass
class GenerateResult:
    """What `generate` returns.

    Attributes:
        tokens: new tokens per prompt (the EOS token included when one ended the request).
        text: the decoded new tokens per prompt, or None when the target has no tokenizer.
        stats: acceptance_length (mean tokens per target verification forward), acceptance_rate_per_position
            (P(draft k accepted) over request-rounds, k = 1..K), conditional_acceptance_per_position
            (P(draft k accepted | draft k-1 accepted)), target_forwards, rounds, new_tokens, seconds,
            tokens_per_second, num_speculative_steps.
    """

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict[str, Any]


class Generator:
    """What `generate` keeps between calls, in one object the caller holds: KV caches and the rounds' static
    input buffers (compiled CUDA graphs record their addresses) and the compiled round functions, so that
    warm compiled calls replay their graphs instead of recording them anew.

    `fspec.generate(...)` is `fspec.default_generator().generate(...)`. A `Generator()` of one's own keeps its
    graphs and buffers apart from the default's (for example one per model in a notebook) and frees them with
    `clear()` or when dropped. Nothing else in fspec keeps state between calls.

    max_shapes: how many KV-cache shapes and buffer shapes it keeps (the most recent ones)."""

    def __init__(self, *, max_shapes: int = 4) -> None:
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes: expected an int >= 1, got {max_shapes!r}")
        self.resources = Resources(max_shapes=max_shapes)

    def clear(self) -> None:
        """Drop every kept cache, buffer and compiled function (their memory goes back on the next
        collection; torch's own compile caches are torch's)."""
        self.resources = Resources(max_shapes=self.resources.max_shapes)

    def generate(
        self,
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
        """`fspec.generate` with this generator's caches, buffers and compiled rounds."""
        k = num_speculative_steps
        ids, temps, seeds, k, draft = _validate(
            target, draft, prompts, max_new_tokens, temperature, seed, k, compile, progress
        )
        start = time.perf_counter()
        tokens: list[list[int]] = []
        stats = Stats(k if draft is not None else 0)
        for lo in range(0, len(ids), 256):  # the largest batch bucket
            run = Run(
                target,
                draft,
                ids[lo : lo + 256],
                temps[lo : lo + 256],
                seeds[lo : lo + 256],
                max_new_tokens=max_new_tokens,
                compile=compile,
                stats=stats,
                progress=progress,
                resources=self.resources,
            )
            tokens.extend(run.go())
        seconds = time.perf_counter() - start
        text = None
        if target.tokenizer is not None:
            text = [target.tokenizer.decode(t) for t in tokens]
        return GenerateResult(tokens=tokens, text=text, stats=stats.summary(sum(map(len, tokens)), seconds))


_DEFAULT = Generator()  # the one instance `generate` uses; `default_generator()` hands it out


def default_generator() -> Generator:
    """The `Generator` behind `fspec.generate`: hold it to reach (or `clear()`) what the calls kept."""
    return _DEFAULT


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


MIN_TEMPERATURE = 1e-6  # smallest positive temperature `generate` accepts (see `_validate`)


def max_model_len(target: Target, draft: Draft | None) -> int:
    """The longest sequence a run may reach: the target's positions, and the head's cache if any."""
    n = target.cfg.max_position_embeddings
    return n if draft is None else min(n, draft.cfg.max_model_len)


def _validate(target, draft, prompts, max_new_tokens, temperature, seed, k, compile=False, progress=False):
    if not isinstance(target, Target):
        raise ValueError(f"target: expected a fspec.Target, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, Draft):
        raise ValueError(f"draft: expected a fspec.Draft or None, got {type(draft).__name__}")
    device = target.params["embed"].device
    if draft is not None:
        devices = {x.device for x in tree.tree_leaves(draft.params) if isinstance(x, torch.Tensor)}
        if devices - {device}:
            raise ValueError(
                f"draft: expected parameters on the target's device {device}, got {sorted(map(str, devices))}"
            )
        if draft.cfg.kind == "eagle3" and any(
            i > target.cfg.num_hidden_layers for i in draft.cfg.target_layer_ids
        ):
            raise ValueError(
                f"draft: expected target_layer_ids in [0, {target.cfg.num_hidden_layers}] (target layers; "
                f"{target.cfg.num_hidden_layers}: the final normed hidden), "
                f"got {draft.cfg.target_layer_ids}"
            )
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
        raise ValueError(f"num_speculative_steps: expected an int in [1, 16], got {k!r}")
    if draft is not None:
        if draft.cfg.model.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"draft: expected a head over the target's vocabulary of {target.cfg.vocab_size}, "
                f"got {draft.cfg.model.vocab_size}"
            )
        if draft.cfg.target_hidden_size != target.cfg.hidden_size:
            raise ValueError(
                f"draft: expected target_hidden_size {target.cfg.hidden_size}, "
                f"got {draft.cfg.target_hidden_size}"
            )
        if draft.cfg.num_speculative_steps != k:
            draft = dataclasses.replace(draft, cfg=dataclasses.replace(draft.cfg, num_speculative_steps=k))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    for name, flag in (("compile", compile), ("progress", progress)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts: expected a non-empty list of strings or token lists, got {prompts!r:.80}")
    ids = [_prompt_ids(target, p, i) for i, p in enumerate(prompts)]
    limit = max_model_len(target, draft)
    for i, p in enumerate(ids):
        if len(p) >= limit:
            raise ValueError(
                f"prompts[{i}]: expected at most {limit - 1} tokens (max_model_len={limit} minus one new "
                f"token), got {len(p)}"
            )
    temps = _per_request("temperature", temperature, len(ids), float)
    for i, t in enumerate(temps):
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature[{i}]: expected a finite value >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            # The samplers divide logits by T: at T = 1e-38 a logit of 1000 overflows to inf, the softmax
            # turns NaN and the kernels return token 0. Below 1e-6 sampling is greedy for sane logits anyway.
            raise ValueError(
                f"temperature[{i}]: expected 0 (greedy) or a value >= {MIN_TEMPERATURE} "
                f"(smaller ones overflow logits / temperature), got {t!r}"
            )
    seeds = _per_request("seed", seed, len(ids), int)
    for i, s in enumerate(seeds):
        if not -(2**63) <= s < 2**63:
            raise ValueError(f"seed[{i}]: expected a 64-bit int, got {s!r}")
    return ids, temps, seeds, k, draft


def _prompt_ids(target: Target, prompt, i: int) -> list[int]:
    if isinstance(prompt, str):
        if target.tokenizer is None:
            raise ValueError(f"prompts[{i}]: expected token ids (the target has no tokenizer), got a string")
        ids = target.tokenizer.encode(prompt).ids
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(
                f"prompts[{i}]: expected a 1-D tensor of token ids, got shape {tuple(prompt.shape)}"
            )
        ids = prompt.tolist()
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, dict)):
        ids = list(prompt)
    else:
        raise ValueError(
            f"prompts[{i}]: expected a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
    v = target.cfg.vocab_size
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < v]
    if bad:
        raise ValueError(f"prompts[{i}]: expected token ids in [0, {v}), got {bad[:4]}")
    return ids


def _per_request(name: str, value, n: int, kind: type) -> list:
    if isinstance(value, (list, tuple, torch.Tensor)):
        values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
        if len(values) != n:
            raise ValueError(f"{name}: expected one value or {n} (one per prompt), got {len(values)}")
    else:
        values = [value] * n
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise ValueError(f"{name}[{i}]: expected {'an int' if kind is int else 'a number'}, got {v!r}")
        out.append(kind(v))
    return out


class Stats:
    """Counters over all request-rounds of a `generate` call."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.request_rounds = 0
        self.emitted = 0
        self.accepted_at = [0] * k  # request-rounds where draft k+1 was accepted
        self.target_forwards = 0
        self.rounds = 0

    def record(self, accepted: list[int]) -> None:
        self.rounds += 1
        for a in accepted:
            self.request_rounds += 1
            self.emitted += a + 1
            for j in range(a):
                self.accepted_at[j] += 1

    def summary(self, new_tokens: int, seconds: float) -> dict[str, Any]:
        n = max(self.request_rounds, 1)
        rates = [c / n for c in self.accepted_at]
        cond = [rates[0]] if rates else []
        cond += [rates[j] / rates[j - 1] if rates[j - 1] > 0 else 0.0 for j in range(1, len(rates))]
        return {
            "acceptance_length": self.emitted / n if self.request_rounds else 1.0,
            "acceptance_rate_per_position": rates,
            "conditional_acceptance_per_position": cond,
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "new_tokens": new_tokens,
            "seconds": seconds,
            "tokens_per_second": new_tokens / seconds if seconds > 0 else float("inf"),
            "num_speculative_steps": self.k,
        }
