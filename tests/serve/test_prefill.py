"""fspec.prefill: the engine's first step as a function (prompts -> first token + the head's first state)."""

from __future__ import annotations

import pytest
import torch

import fspec
from fspec.models import llama
from fspec.serve.engine import Stats
from fspec.serve.runner import Run

from engine_setup import aligned_pair

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [5, 6], [9]]


def test_prefill_then_propose_gives_the_engines_first_token_and_drafts():
    """Greedy and sampled rows mixed: prefill's first tokens are the ones `generate` emits first, and
    propose from prefill's state drafts exactly what the engine drafts in its first round (tokens and q)."""
    target, draft = aligned_pair(k=3)
    temps, seeds = [0.0, 0.8, 0.0], [11, 12, 13]
    pre = fspec.prefill(target, draft, PROMPTS, temperature=temps, seed=seeds)
    state, _ = fspec.propose(draft.params, pre.state, pre.draft_cache, cfg=pre.draft_cfg)
    first = fspec.generate(target, draft, PROMPTS, max_new_tokens=1, temperature=temps, seed=seeds)
    assert pre.tokens.tolist() == [t[0] for t in first.tokens]
    run = Run(
        target,
        draft,
        PROMPTS,
        dict(temperature=temps, seed=seeds),
        max_new_tokens=8,
        compile=False,
        stats=Stats(3),
        progress=False,
    )
    run._keep = []
    d_tok, d_prob = run._admit(run._device_state())  # the first admission: every request, slots 0, 1, 2
    assert torch.equal(state.draft_tokens, d_tok[: len(PROMPTS)])
    torch.testing.assert_close(state.draft_probs, d_prob[: len(PROMPTS)], rtol=1e-6, atol=1e-7)
    assert (state.draft_tokens >= 0).all() and int(state.step) == 3
    # the state itself, independently of the engine: row i of request b pairs the target's hidden at
    # position i with token i + 1 (the prompt shifted by one, then the new token)
    q = max(map(len, PROMPTS))
    ids = pre.state.input_ids.view(len(PROMPTS), q)
    hid = pre.state.hidden.view(len(PROMPTS), q, -1)
    for b, p in enumerate(PROMPTS):
        assert ids[b, : len(p)].tolist() == p[1:] + [int(pre.tokens[b])]
        _, h = llama.forward_dense(target.params, torch.tensor([p]), cfg=target.cfg)
        want = fspec.project_target_hidden(draft.params, h, cfg=draft.cfg)[0]
        torch.testing.assert_close(hid[b, : len(p)], want, rtol=1e-5, atol=1e-5)


def test_prefill_logits_are_the_targets_last_position_and_target_only_has_no_state():
    target, _ = aligned_pair(k=2)
    pre = fspec.prefill(target, None, PROMPTS, room=5)
    assert pre.state is None and pre.draft_cache is None and pre.draft_cfg is None
    for b, p in enumerate(PROMPTS):
        want, _ = llama.forward_dense(target.params, torch.tensor([p]), cfg=target.cfg)
        torch.testing.assert_close(pre.logits[b], want[0, -1].float(), rtol=1e-5, atol=1e-5)
        assert int(pre.tokens[b]) == int(want[0, -1].argmax())  # greedy
    # each request owns disjoint blocks covering its prompt and the room asked for
    owned = [set(row[row >= 0].tolist()) for row in pre.block_table]
    assert all(not (owned[i] & owned[j]) for i in range(3) for j in range(i + 1, 3))
    bs = pre.target_cache.block_size
    assert all(len(o) * bs >= len(p) + 5 for o, p in zip(owned, PROMPTS))


def test_prefill_bad_inputs_name_the_argument():
    target, draft = aligned_pair(k=2)
    cases = [
        ({"room": 0}, "^room: expected a positive int"),
        ({"prompts": [[]]}, r"^prompts\[0\]: expected at least one token"),
        ({"temperature": -1.0}, r"^temperature\[0\]: expected a finite value >= 0"),
        ({"draft": "head"}, "^draft: expected a fspec.Draft or None"),
        ({"num_speculative_steps": 0}, r"^num_speculative_steps: expected an int in \[1, 16\]"),
    ]
    for change, match in cases:
        kw = {"draft": draft, "prompts": PROMPTS} | change
        with pytest.raises(ValueError, match=match):
            fspec.prefill(target, kw.pop("draft"), kw.pop("prompts"), **kw)
