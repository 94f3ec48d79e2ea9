"""The draft loop run through the interpreted kernels (paged attention, RoPE + cache write, step metadata, the
Gumbel kernels with their EAGLE-3 id map) equals the naive host-side reference, as the reference ops do in
tests/test_draft.py: the kernels' glue inside `draft_step` (which column, which ids) is checked on the CPU."""

from __future__ import annotations

import pytest
import torch

import fspec
from fspec.kernels import gumbel, ops

from draft_setup import naive_propose, scenario, tiny_draft, tiny_target


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_propose_through_the_kernels_equals_the_naive_reference(kind, monkeypatch):
    assert ops.kernels_interpreted() or torch.cuda.is_available()
    maps = []  # the Gumbel kernels run, and they get EAGLE-3's id map
    launch = gumbel.gumbel_sample

    def spy(*args, d2t=None, **kwargs):
        maps.append(d2t is not None)
        return launch(*args, d2t=d2t, **kwargs)

    monkeypatch.setattr(gumbel, "gumbel_sample", spy)
    k = 3
    draft = tiny_draft(tiny_target(), kind=kind, k=k)
    sc = scenario(draft, context_lens=[3, 9, 14], live=[1, k + 1, 2], temperature=[0.0, 1.0, 0.7], seed=5)
    state, _ = fspec.propose(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    assert maps == [kind == "eagle3"] * k
    want_tokens, want_probs = naive_propose(sc)
    assert torch.equal(state.draft_tokens, want_tokens), (state.draft_tokens, want_tokens)
    torch.testing.assert_close(state.draft_probs, want_probs, rtol=1e-4, atol=1e-5)
    if kind == "eagle3":  # target ids in the token buffer, q over the draft vocabulary
        draft_ids = state.draft_probs[0].argmax(-1)  # row 0 is greedy: q is one-hot at the draft id
        assert torch.equal(state.draft_tokens[0], fspec.draft_to_target(draft_ids, draft.params["d2t"]))
