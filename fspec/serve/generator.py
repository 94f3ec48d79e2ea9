"""`fspec.Generator`: what `generate` keeps between calls (caches, buffers, compiled graphs), its warm-up, and
`GenerateResult`. `fspec.generate` (fspec/serve/engine.py) is the default generator's `generate`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

from fspec.core.cache import table_width
from fspec.core.config import BATCH_BUCKETS, bucket_for
from fspec.models.checkpoint import Draft, Target
from fspec.models.generation_config import sampling_defaults
from fspec.serve.prefill import _validate, max_model_len
from fspec.serve.resources import Resources, chunk_sizes
from fspec.serve.runner import _LOOKAHEAD, MAX_SLOTS, Refill, Run, Stats
from fspec.serve.stops import StopTracker, stop_config
from fspec.serve.stream import StreamChunk, stream_chunks


@dataclasses.dataclass
class GenerateResult:
    """What `generate` returns.

    Attributes:
        tokens: new tokens per prompt (the EOS or stop token id included when one ended the request; cut
            like the text at a stop string: the tokens whose text ends at or before the match start).
        text: the decoded new tokens per prompt, or None when the target has no tokenizer; cut exactly
            before a stop string that ended the request (`fspec.serve.stops`).
        finish_reason: why each request ended: "stop" (a stop string or a stop token id), "eos", or
            "length" (max_new_tokens, or the sequence reached max_model_len).
        stats: acceptance_length (mean tokens per target verification forward), acceptance_rate_per_position
            (P(draft k accepted) over request-rounds, k = 1..K), conditional_acceptance_per_position
            (P(draft k accepted | draft k-1 accepted)), target_forwards, rounds, new_tokens, seconds,
            tokens_per_second, num_speculative_steps.
    """

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict[str, Any]
    finish_reason: list[str]


class Generator:
    """What `generate` keeps between calls, in one object the caller holds: KV caches and the rounds' static
    input buffers (compiled CUDA graphs record their addresses) and the compiled round functions, so that
    warm compiled calls replay their graphs instead of recording them anew.

    `fspec.generate(...)` is `fspec.default_generator().generate(...)`. A `Generator()` of one's own keeps its
    graphs and buffers apart from the default's (for example one per model in a notebook) and frees them with
    `clear()` or when dropped. Nothing else in fspec keeps state between calls.

    A call of more prompts than `max_batch` runs them `max_batch` at a time with continuous batching: a
    finished request's slot and KV blocks go to the next waiting prompt. `warmup` records every graph that
    compiled calls within given bounds use, so that afterwards no call records or compiles anything.

    max_batch: the most requests one call runs at once (its batch bucket of slots), at most 256.
    max_shapes: how many buffer shapes of each kind it keeps (the most recent ones).
    prepack: eager calls on the CPU run float32 models' linear weights through oneDNN, reordered once into
    its blocked layout (`fspec.models.packed`), wherever a target step runs several rows (a verification, a
    batch): SmolLM2-135M's products over 6 rows took 59.5 ms packed against 83.4 ms (one row: 41.6 vs 38.6,
    so one request's target-only decoding keeps the caller's weights). The generator keeps the packed copy
    of the latest target and head it ran (about the size of their projection weights, plus a tied LM
    head's) until a weight changes, the model is dropped or `clear()`; False keeps no copy and runs
    `F.linear` on the caller's weights.
    refill: when a call of more prompts than its slots fills the slots its finished requests free
    (`fspec.Refill`: by default in the round each frees)."""

    def __init__(
        self,
        *,
        max_batch: int = MAX_SLOTS,
        max_shapes: int = 4,
        prepack: bool = True,
        refill: Refill = Refill(),
    ) -> None:
        for name, value, hi in (("max_batch", max_batch, MAX_SLOTS), ("max_shapes", max_shapes, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (hi and value > hi):
                want = f"an int in [1, {hi}]" if hi else "an int >= 1"
                raise ValueError(f"{name}: expected {want}, got {value!r}")
        if not isinstance(prepack, bool):
            raise ValueError(f"prepack: expected a bool, got {prepack!r}")
        if not isinstance(refill, Refill):
            raise ValueError(f"refill: expected a fspec.Refill, got {type(refill).__name__}")
        self.refill = refill
        self.max_batch = max_batch
        self.prepack = prepack
        self.resources = Resources(max_shapes=max_shapes)

    @property
    def recorded_graphs(self) -> int:
        """CUDA graphs this generator has recorded so far (its captured rounds and prefill chunks)."""
        return self.resources.recorded_graphs

    def warmup(
        self,
        target: Target,
        draft: Draft | None = None,
        *,
        max_batch: int = 1,
        max_len: int | None = None,
        num_speculative_steps: int | None = None,
        sampled: bool = True,
        filters: bool = True,
    ) -> dict[str, Any]:
        """Record, ahead of use, every graph that compiled calls (`compile=True`) of this generator make for
        batches of up to `max_batch` requests whose prompt and new tokens together stay within `max_len`
        (default: max_model_len): afterwards such calls compile nothing and record no CUDA graph, whatever
        their prompt lengths. It also fixes the KV-cache pool (max_batch worst-case requests) and the
        narrowest block table compiled calls use (what max_len needs), so calls within the bounds keep them.

        Recorded: for each batch bucket up to bucket_for(max_batch), greedy rounds, (sampled=True) sampled
        rounds, (sampled and filters=True) sampled rounds with top_k / top_p / min_p, and prefill chunks of
        every length (`fspec.serve.resources.chunk_sizes`) for each. Not recorded, and so recorded on first
        use: min_new_tokens (one more set per bucket), another K (num_speculative_steps; default the
        head's), the other draft (call warmup again with draft=None for target-only calls, or with another
        head). A greedy request's filters select nothing (`fspec.SamplingParams.filtered`). Returns
        {"seconds", "graphs" (CUDA graphs recorded), "calls" (warm-up generate calls)}."""
        if not isinstance(target, Target):
            raise ValueError(f"target: expected a fspec.Target, got {type(target).__name__}")
        if (
            isinstance(max_batch, bool)
            or not isinstance(max_batch, int)
            or not 0 < max_batch <= self.max_batch
        ):
            raise ValueError(
                f"max_batch: expected an int in [1, {self.max_batch}] (the generator's max_batch), "
                f"got {max_batch!r}"
            )
        if not isinstance(sampled, bool):
            raise ValueError(f"sampled: expected a bool, got {sampled!r}")
        if not isinstance(filters, bool):
            raise ValueError(f"filters: expected a bool, got {filters!r}")
        _, _, k, draft = _validate(target, draft, [[0]], 1, _sampling_options(target, 0.0, 0, 0, 1.0, 0.0),
                                   num_speculative_steps)  # fmt: skip
        limit = max_model_len(target, draft)
        max_len = limit if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 2 <= max_len <= limit:
            raise ValueError(f"max_len: expected an int in [2, {limit}] (max_model_len), got {max_len!r}")
        start, before, calls = time.perf_counter(), self.recorded_graphs, 0
        bs = draft.cfg.block_size if draft is not None else 16
        kk = k if draft is not None else 0
        full = -(-limit // bs)
        worst = min(-(-(max_len + 3 * kk + 2) // bs) + _LOOKAHEAD, full)
        res = self.resources
        key = (target.cfg, bs)
        res.widths[key] = max(res.widths.get(key, 1), table_width(worst * bs, block_size=bs, max_blocks=full))
        device = target.params["embed"].device
        top = bucket_for(max_batch)
        pool = top * worst
        res.cache(target.cfg, pool, bs, target.params["embed"].dtype, device, True)
        if draft is not None:
            res.cache(draft.cfg.model, pool, bs, draft.params["embed"].dtype, device, True)
        res.pinning = True  # what the warm-up makes stays: its graphs read it where it lies
        try:
            vocab = target.cfg.vocab_size
            for b in (x for x in BATCH_BUCKETS if x <= top):
                # a prompt of each chunk length (the longest chunk also covers longer prompts), two new tokens
                lengths = [1]  # off CUDA prefill runs whole prompts: no graph depends on their length
                if device.type == "cuda":
                    lengths = sorted({min(c, max_len - 2) for c in chunk_sizes(b)} - {0})
                filtered = dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)
                kinds = [dict(temperature=0.0)] + ([dict(temperature=1.0)] if sampled else [])
                kinds += [filtered] if sampled and filters else []
                for opts in kinds:
                    for n in lengths:
                        prompt = [(7 * i + 1) % vocab for i in range(n)]
                        self.generate(target, draft, [prompt] * b, max_new_tokens=2, ignore_eos=True,
                                      num_speculative_steps=k if draft is not None else None, compile=True,
                                      **opts)  # fmt: skip
                        calls += 1
        finally:
            res.pinning = False
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "graphs": self.recorded_graphs - before, "calls": calls}

    def _prepacked(self, target: Target, draft: Draft | None, n: int, k: int, compile: bool):
        """(target, draft) as a call of n requests runs them: their packed copies (`prepack`) for an eager
        call on the CPU, with the target packed where its steps run several rows; else as given."""
        if not self.prepack or compile or target.params["embed"].device.type != "cpu":
            return target, draft
        rows = bucket_for(min(n, self.max_batch)) * (k + 1 if draft is not None else 1)
        return self.resources.prepacked(target, draft, target_rows=rows)

    def clear(self) -> None:
        """Drop every kept cache, buffer and compiled function (their memory goes back on the next
        collection; torch's own compile caches are torch's)."""
        self.resources = Resources(max_shapes=self.resources.max_shapes)  # the warm-up's plan goes too

    def generate(
        self,
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
        """`fspec.generate` with this generator's caches, buffers and compiled rounds."""
        start = time.perf_counter()
        run = self._prepare(
            target, draft, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
            top_k=top_k, top_p=top_p, min_p=min_p, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, eos_token_id=eos_token_id, min_new_tokens=min_new_tokens,
            num_speculative_steps=num_speculative_steps, compile=compile, progress=progress,
        )  # fmt: skip
        run.go()
        return self._result(run, start)

    def _prepare(self, target, draft, prompts, *, max_new_tokens, temperature=None, seed=0, top_k=None,
                 top_p=None, min_p=None, num_speculative_steps=None, compile=False, progress=False,
                 detokenize=False, **stops) -> Run:  # fmt: skip
        """The validated `Run` of a `generate` or `stream` call (`stops`: its stop options), not yet run:
        `generate` runs it to the end, `stream` round by round; a caller that drives `Run.rounds()` itself
        (the head recipe's data generation) may stop admitting on its own terms, then hands it to
        `_result`."""
        options = _sampling_options(target, temperature, seed, top_k, top_p, min_p)
        ids, options, k, draft = _validate(
            target, draft, prompts, max_new_tokens, options, num_speculative_steps, compile, progress
        )
        stops = stop_config(target, max_new_tokens=max_new_tokens, **stops)
        stats = Stats(k if draft is not None else 0)
        target, draft = self._prepacked(target, draft, len(ids), k, compile)
        return Run(
            target,
            draft,
            ids,
            options,
            max_new_tokens=max_new_tokens,
            compile=compile,
            stats=stats,
            progress=progress,
            resources=self.resources,
            stops=stops,
            detokenize=detokenize,
            max_slots=self.max_batch,
            refill=self.refill,
        )

    @staticmethod
    def _result(run: Run, start: float) -> GenerateResult:
        """The `GenerateResult` of a run that began (`_prepare`) at perf_counter() time `start`."""
        tracks: list[StopTracker] = run.track
        seconds = time.perf_counter() - start
        tokens = [t.tokens for t in tracks]
        text = None
        if run.target.tokenizer is not None:  # built as the requests grew when there are stop strings
            text = [run.target.tokenizer.decode(t.tokens) if t.text is None else t.text.text for t in tracks]
        return GenerateResult(
            tokens=tokens,
            text=text,
            stats=run.stats.summary(sum(map(len, tokens)), seconds),
            finish_reason=[t.reason for t in tracks],
        )

    def stream(
        self,
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
        """`fspec.stream` with this generator's caches, buffers and compiled rounds. The arguments are checked
        here, before the first chunk is asked for."""
        if not isinstance(prompt, str) and isinstance(prompt, Sequence) and prompt:
            if all(isinstance(p, (str, Sequence)) for p in prompt):
                raise ValueError(
                    "prompt: expected one prompt (a string or a list of token ids), "
                    f"got a list of {len(prompt)} prompts"
                )
        run = self._prepare(
            target, draft, [prompt], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
            top_k=top_k, top_p=top_p, min_p=min_p, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, eos_token_id=eos_token_id, min_new_tokens=min_new_tokens,
            num_speculative_steps=num_speculative_steps, compile=compile, progress=progress, detokenize=True,
        )  # fmt: skip
        return stream_chunks(run)


def _sampling_options(target, temperature, seed, top_k, top_p, min_p) -> dict:
    """The call's sampling options, each given one or, when None, the checkpoint's generation_config.json
    default (`sampling_defaults`: greedy unless it says do_sample)."""
    defaults = sampling_defaults(target)
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return {name: defaults[name] if v is None else v for name, v in given.items()} | {"seed": seed}


_DEFAULT = Generator()  # the one instance `generate` uses; `default_generator()` hands it out


def default_generator() -> Generator:
    """The `Generator` behind `fspec.generate`: hold it to reach (or `clear()`) what the calls kept."""
    return _DEFAULT
