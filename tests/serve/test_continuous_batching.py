"""Continuous batching inside `generate`: a call of more prompts than its slots runs them `max_batch` at a
time, and a finished request's slot and KV blocks go to the next waiting prompt while the others go on.

What must hold: every request's tokens are what it gets alone (greedy: target-only decoding; sampled: the
same Philox noise, keyed by seed and position, whatever the slot), in both round loops; slots are reused
(more admissions than slots, each after a request ended); the block books balance after every round and
every block is free at the end; and rows of the round launched before an admission never reach the new
request (the pipelined loop launches round r + 1 before it reads round r).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import fspec
from fspec.serve.engine import Stats
from fspec.serve.runner import Run

from engine_setup import aligned_pair, assert_table_matches_blocks


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.choice([1, 2, 5, 9, 14, 22, 30]))] for _ in range(n)]


def _staggered(target, draft, prompts, new: int):
    """(target, draft) with EOS set to the 3 tokens most frequent in target-only answers to `prompts`, so
    requests end at different rounds."""
    counts: dict[int, int] = {}
    for toks in fspec.generate(target, None, prompts, max_new_tokens=new).tokens:
        for t in toks[1:]:
            counts[t] = counts.get(t, 0) + 1
    eos = tuple(sorted(counts, key=lambda t: -counts[t])[:3])
    return dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, eos_token_ids=eos)), draft


class _Books(Run):
    """A Run that checks its slots and the allocator's books after every processed round."""

    def _process(self, record) -> None:
        super()._process(record)
        held = [blk for blocks in self.blocks for blk in blocks]
        pending = [blk for blocks in self.free_at.values() for blk in blocks]
        assert len(set(held)) == len(held) and not set(held) & set(pending)
        assert self.alloc._used == set(held) | set(pending), "allocator and slots disagree: a leak"
        live = [self.req[b] for b in range(self.b) if not self.done[b]]
        assert len(set(live)) == len(live), "a request in two slots"
        assert_table_matches_blocks(self)
        self.checked += 1


@pytest.mark.parametrize("pipeline", [True, False])
def test_more_prompts_than_slots_equal_each_prompt_alone(pipeline):
    """19 prompts of 1..30 tokens through 4 slots (bucket 4), EOS set to frequent tokens so requests end
    at different rounds: greedy speculative output equals target-only decoding of each prompt, sampled
    output equals the all-at-once call's (19 slots); slots are reused, books balance, nothing leaks."""
    prompts = _prompts(19, seed=1)
    target, draft = _staggered(*aligned_pair(k=3), prompts, 12)
    want = fspec.generate(target, None, prompts, max_new_tokens=12).tokens
    assert len({len(t) for t in want}) >= 4, "finishes not staggered"
    temps, seeds = [0.0 if i % 3 == 0 else 0.9 for i in range(19)], list(range(19))
    sampled_all = fspec.generate(target, draft, prompts, max_new_tokens=12, temperature=temps, seed=seeds)
    for options, expect in (
        (dict(temperature=[0.0] * 19, seed=[0] * 19), want),
        (dict(temperature=temps, seed=seeds), sampled_all.tokens),
    ):
        run = _Books(target, draft, prompts, options, max_new_tokens=12, compile=False, stats=Stats(3),
                     progress=False, max_slots=4)  # fmt: skip
        run.pipeline, run.checked = pipeline, 0
        total = run.alloc.num_free
        admissions: list[tuple[int, int]] = []
        admit = run._admissible

        def logged(admit=admit, log=admissions):
            pairs = admit()
            log.extend(pairs)
            return pairs

        run._admissible = logged
        got = run.go()
        assert run.b == 4 and got == expect
        assert len(admissions) == 19 and len({s for s, _ in admissions}) == 4  # every slot reused
        assert run.checked > 0 and run.alloc.num_free == total and not run.alloc._used
        assert all(not b for b in run.blocks)


@pytest.mark.parametrize("pipeline", [True, False])
def test_requests_that_end_at_their_first_token_free_their_slot_for_the_next(pipeline):
    """An admitted request's first token is emitted with the next processed round (the host does not wait
    for the prefill); one that ends right there (its first token is EOS) has run one ignored round. 12
    prompts through 2 slots, EOS the first token of every third: tokens equal each prompt alone, the
    EOS-first requests end with one token, books balance after every round."""
    prompts = _prompts(12, seed=4)
    target, draft = aligned_pair(k=3)
    firsts = [t[0] for t in fspec.generate(target, None, prompts, max_new_tokens=1).tokens]
    eos = tuple(sorted({firsts[i] for i in range(0, 12, 3)}))
    target = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, eos_token_ids=eos))
    want = [fspec.generate(target, None, [p], max_new_tokens=9).tokens[0] for p in prompts]
    assert sum(len(t) == 1 for t in want) >= 4 and any(len(t) > 1 for t in want)
    run = _Books(target, draft, prompts, dict(temperature=[0.0] * 12, seed=[0] * 12), max_new_tokens=9,
                 compile=False, stats=Stats(3), progress=False, max_slots=2)  # fmt: skip
    run.pipeline, run.checked = pipeline, 0
    total = run.alloc.num_free
    assert run.go() == want
    assert run.checked > 0 and run.alloc.num_free == total and not run.firsts


def test_a_generator_with_max_batch_runs_a_large_call_in_a_full_batch():
    """`fspec.Generator(max_batch=8)`: 40 prompts run 8 at a time; the tokens are those of the default
    generator (all 40 in one bucket of 64) and of target-only decoding; stats count every request-round."""
    target, draft = aligned_pair(k=2)
    prompts = _prompts(40, seed=2)
    gen = fspec.Generator(max_batch=8)
    got = gen.generate(target, draft, prompts, max_new_tokens=7, num_speculative_steps=2)
    assert got.tokens == fspec.generate(target, None, prompts, max_new_tokens=7).tokens
    assert got.stats["new_tokens"] == sum(map(len, got.tokens))
    assert got.stats["rounds"] >= 40 * 6 / (3 * 8)  # at most 8 requests per round, at most 3 tokens each
    for bad in (0, 257, 2.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            fspec.Generator(max_batch=bad)


def test_an_admitted_request_ignores_the_round_launched_before_it():
    """Pipelined: after round r ends a request, round r + 1 is already queued with that slot's old
    request. A request admitted into the slot must not take that round's row: with 1 slot and two prompts,
    the second prompt's tokens are its own (equal to running it alone), and its first round is the first
    one launched after its admission."""
    target, draft = aligned_pair(k=3)
    prompts = [[5, 6, 7, 8], [40, 41]]
    alone = [fspec.generate(target, draft, [p], max_new_tokens=9).tokens[0] for p in prompts]
    run = Run(target, draft, prompts, dict(temperature=[0.0, 0.0], seed=[0, 0]), max_new_tokens=9,
              compile=False, stats=Stats(3), progress=False, max_slots=1)  # fmt: skip
    assert run.go() == alone and run.rounds_launched >= 2 * 2
    assert run.admitted_at[0] > 0


def test_compiled_continuous_batching_equals_eager():
    """compile=True with 10 prompts through 4 slots: the same tokens as the eager engine, greedy and
    sampled, and the second such call compiles nothing new."""
    from torch._dynamo.utils import counters

    target, draft = aligned_pair(k=3)
    prompts = _prompts(10, seed=3)
    gen = fspec.Generator(max_batch=4)
    temps, seeds = [0.8] * 10, list(range(10))
    kw = dict(max_new_tokens=8, num_speculative_steps=3)
    want = fspec.generate(target, None, prompts, max_new_tokens=8).tokens
    assert gen.generate(target, draft, prompts, compile=True, **kw).tokens == want
    torch._dynamo.reset()
    counters.clear()
    eager = fspec.generate(target, draft, prompts, temperature=temps, seed=seeds, **kw).tokens
    got = gen.generate(target, draft, prompts, temperature=temps, seed=seeds, compile=True, **kw).tokens
    assert got == eager
    graphs = counters["stats"]["unique_graphs"]
    again = gen.generate(target, draft, prompts[::-1], temperature=temps, seed=seeds, compile=True, **kw)
    assert (
        again.tokens
        == fspec.generate(target, draft, prompts[::-1], temperature=temps, seed=seeds, **kw).tokens
    )
    assert counters["stats"]["unique_graphs"] == graphs


def test_refill_admits_free_slots_together_and_never_lets_one_wait_past_max_wait():
    """`fspec.Refill`: 40 prompts through 16 slots. share = 0 (the default) admits in the round a slot frees;
    share = 1/8 (2 slots here) admits in groups, so fewer prefills run; share = 1 with max_wait = 3
    admits when every slot is free or a slot has been free 3 rounds. The tokens are target-only decoding's
    in every case, and no admission finds a slot free for longer than max_wait rounds."""
    target, draft = _staggered(*aligned_pair(k=2), _prompts(40, seed=4), 10)
    prompts = _prompts(40, seed=4)
    want = fspec.generate(target, None, prompts, max_new_tokens=10).tokens
    assert len({len(t) for t in want}) >= 4, "finishes not staggered"
    prefills = {}
    for name, refill in (
        ("at_once", fspec.Refill()),
        ("grouped", fspec.Refill(share=0.125)),
        ("wait", fspec.Refill(share=1.0, max_wait=3)),
    ):
        run = Run(target, draft, prompts, dict(temperature=[0.0] * 40, seed=[0] * 40), max_new_tokens=10,
                  compile=False, stats=Stats(2), progress=False, max_slots=16, refill=refill)  # fmt: skip
        waits = []
        admit = run._admissible

        def logged(admit=admit, run=run, waits=waits):
            free = [b for b in range(run.b) if run.done[b] and run.req[b] >= 0]  # freed, not never used
            pairs = admit()
            if pairs and free:
                waits.append(max(run.rounds_launched - run.freed_at[b] for b in free))
            return pairs

        run._admissible = logged
        assert run.go() == want, name
        prefills[name] = run.stats.target_forwards - run.stats.rounds
        assert max(waits, default=0) <= refill.max_wait, name
    assert prefills["grouped"] < prefills["at_once"]
    assert prefills["wait"] < prefills["at_once"]


def test_refill_rejects_bad_settings():
    for kw, name in ((dict(share=-0.1), "share"), (dict(share=1.5), "share"), (dict(share=True), "share"),
                     (dict(max_wait=0), "max_wait"), (dict(max_wait=2.0), "max_wait")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            fspec.Refill(**kw)
    with pytest.raises(ValueError, match="refill"):
        fspec.Generator(refill=0.5)
    due = fspec.Refill(share=0.25, max_wait=4).due
    assert due(free=2, slots=8, live=True, waited=0)  # ceil(0.25 * 8) = 2 free
    assert not due(free=1, slots=8, live=True, waited=3)
    assert due(free=1, slots=8, live=True, waited=4)  # free for max_wait rounds
    assert due(free=1, slots=8, live=False, waited=0)  # nothing live: never idle the whole batch
    assert not due(free=0, slots=8, live=False, waited=9)
    assert fspec.Refill().due(free=1, slots=256, live=True, waited=0)  # the default: admit at once


def test_cpu_prefill_computes_no_padding_request(monkeypatch):
    """Off CUDA a prefill runs whole prompts eagerly: admitting 3 requests into a bucket of 4 slots prefills
    3 rows, not a padding 4th (a prompt's worth of rows for nothing); the tokens are each prompt's alone."""
    import fspec.serve.runner as runner

    target, draft = aligned_pair(k=2)
    prompts = _prompts(3, seed=5)
    rows = []
    real = runner.prefill_batch

    def counted(target, draft, ids, *args, **kwargs):
        rows.append(ids.shape[0])
        return real(target, draft, ids, *args, **kwargs)

    monkeypatch.setattr(runner, "prefill_batch", counted)
    run = Run(target, draft, prompts, dict(temperature=[0.0] * 3, seed=[0] * 3), max_new_tokens=6,
              compile=False, stats=Stats(2), progress=False, max_slots=4)  # fmt: skip
    assert run.b == 4
    got = run.go()
    monkeypatch.setattr(runner, "prefill_batch", real)
    assert rows == [3]
    assert got == [fspec.generate(target, None, [p], max_new_tokens=6).tokens[0] for p in prompts]
