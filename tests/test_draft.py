"""The draft loop: draft_step and propose against a naive host-side reference; purity; shapes; padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fspec
from fspec.compile import pad_to_bucket, unpad
from fspec.draft import last_live_rows

from draft_setup import BLOCK, MAX_LEN, leaves_snapshot, naive_propose, scenario, tiny_draft, tiny_target

TARGET = tiny_target()

# K = 1..7, each head kind, sampled and greedy drafts; contexts chosen so drafting crosses block boundaries.
CASES = [
    (1, "eagle3", False),
    (2, "eagle", False),
    (3, "mtp", False),
    (4, "eagle3", False),
    (5, "eagle", True),
    (6, "mtp", False),
    (7, "eagle3", False),
    (3, "eagle3", True),
]


@pytest.mark.parametrize(("k", "kind", "greedy"), CASES)
def test_propose_equals_a_naive_reference_that_rebuilds_everything_each_step(k, kind, greedy):
    """Ragged contexts, ragged live rows, mixed temperatures: tokens equal exactly, q to float tolerance."""
    draft = tiny_draft(TARGET, kind=kind, k=k, greedy=greedy)
    sc = scenario(
        draft,
        context_lens=[3, 6, 9, 14],
        live=[1, k + 1, max(1, k // 2), 2][:4],
        temperature=[0.0, 1.0, 0.7, 1.3],
        seed=k,
    )
    state, cache = fspec.propose(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    want_tokens, want_probs = naive_propose(sc)
    assert torch.equal(state.draft_tokens, want_tokens), (state.draft_tokens, want_tokens)
    torch.testing.assert_close(state.draft_probs, want_probs, rtol=1e-4, atol=1e-5)
    assert int(state.step) == k and cache is sc.cache
    if not greedy:
        # q is a distribution on sampled rows and one-hot at the greedy row (temperature 0).
        torch.testing.assert_close(state.draft_probs.sum(-1), torch.ones(4, k), rtol=1e-5, atol=1e-5)
        col = (
            fspec.draft_to_target(state.draft_probs[0].argmax(-1), draft.params["d2t"])
            if kind == "eagle3"
            else state.draft_probs[0].argmax(-1)
        )
        assert torch.equal(col, state.draft_tokens[0])


def test_draft_step_metadata_equals_metadata_rebuilt_on_the_host_at_every_step():
    """After each step the state's metadata equals decode metadata built from scratch at the next position."""
    k = 7
    draft = tiny_draft(TARGET, kind="eagle3", k=k)
    sc = scenario(draft, context_lens=[2, 7, 13], live=[3, 1, 8], temperature=[1.0, 0.0, 0.5])
    state, cache = sc.state, sc.cache
    next_pos = torch.tensor([2 + 3, 7 + 1, 13 + 8])  # first decode position = context + live
    for step in range(k):
        state, cache = fspec.draft_step(draft.params, state, cache, cfg=draft.cfg)
        fresh = fspec.decode_metadata(next_pos + step, sc.state.attn.block_table, block_size=BLOCK)
        for got, want in zip(fspec.tree.tree_leaves(state.attn), fspec.tree.tree_leaves(fresh)):
            assert torch.equal(got, want), f"stale metadata after step {step}"
        assert int(state.step) == step + 1
    again, _ = fspec.propose(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    assert torch.equal(again.draft_tokens, state.draft_tokens), "propose differs from K draft_steps"


def test_propose_and_draft_step_leave_their_input_state_untouched():
    """Purity: every leaf of the input state is bit-identical afterwards (the cache is donated)."""
    draft = tiny_draft(TARGET, kind="eagle", k=3)
    sc = scenario(draft, context_lens=[4, 5], live=[2, 4], temperature=[0.9, 0.0])
    before = leaves_snapshot(sc.state)
    state, cache = fspec.propose(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    one, cache = fspec.draft_step(draft.params, sc.state, cache, cfg=draft.cfg)
    for x, y in zip(before, fspec.tree.tree_leaves(sc.state)):
        assert torch.equal(x, y)
    assert one.draft_tokens is not sc.state.draft_tokens and one.draft_probs is not sc.state.draft_probs


def test_decode_steps_keep_every_leaf_shape_dtype_and_device():
    """From step 1 on, each step returns leaves of the same shape, dtype and device (no recompile)."""
    draft = tiny_draft(TARGET, kind="mtp", k=5)
    sc = scenario(draft, context_lens=[3, 9], live=[1, 6], temperature=[1.0, 1.0])
    state, cache = fspec.draft_step(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    shapes = [(x.shape, x.dtype, x.device) for x in fspec.tree.tree_leaves(state)]
    assert state.input_ids.shape == (2,) and state.hidden.shape == (2, 32)
    for _ in range(3):
        state, cache = fspec.draft_step(draft.params, state, cache, cfg=draft.cfg)
        assert [(x.shape, x.dtype, x.device) for x in fspec.tree.tree_leaves(state)] == shapes


def test_padding_rows_change_nothing_in_real_rows():
    """Padding to the batch bucket leaves real rows' drafts and every live cache block as without padding."""
    draft = tiny_draft(TARGET, kind="eagle3", k=4)
    kw = dict(context_lens=[5, 11, 2], live=[2, 5, 1], temperature=[1.0, 0.0, 0.6])
    plain = scenario(draft, **kw)
    padded_sc = scenario(draft, **kw, padding_rows=2)  # same real rows, two padding requests in the table
    padded, b = pad_to_bucket(padded_sc.state, cfg=draft.cfg)  # and three more up to the bucket
    assert padded.attn.num_requests == 8 and b == 5
    want, cache_a = fspec.propose(draft.params, plain.state, plain.cache, cfg=draft.cfg)
    got, cache_b = fspec.propose(draft.params, padded, padded_sc.cache, cfg=draft.cfg)
    got = unpad(got, 3)
    assert torch.equal(got.draft_tokens, want.draft_tokens)
    # Tokens are exact; q may differ in the last bits (BLAS blocks a batch of 8 rows differently from 3).
    torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-5, atol=1e-6)
    table_a = plain.state.attn.block_table.long()
    table_b = padded_sc.state.attn.block_table[:3].long()
    assert not torch.equal(table_a, table_b)  # different blocks, same contents
    torch.testing.assert_close(cache_a.k[:, table_a], cache_b.k[:, table_b], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache_a.v[:, table_a], cache_b.v[:, table_b], rtol=1e-5, atol=1e-6)
    scratch = padded_sc.cache.num_blocks
    untouched = torch.ones(scratch + 1, dtype=torch.bool)
    untouched[table_b.flatten()] = False
    untouched[scratch] = False
    assert bool((cache_b.k[:, untouched] == 0).all()), "a padding row wrote outside the scratch block"


def test_last_live_rows_picks_each_requests_last_live_token():
    """Requests with 2, 0 (padding) and 3 live rows of 3."""
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    meta = fspec.first_step_metadata(
        torch.tensor([4, -1, 0]), torch.tensor([2, 0, 3]), table, num_query=3, block_size=4
    )
    assert last_live_rows(meta).tolist() == [1, 3, 8]


def test_one_row_steps_select_no_rows(monkeypatch):
    """A round's first step (K + 1 rows per request) passes each request's last live row to the head; the
    later steps, one row per request, pass none (that row is the request's own: a gather would be one more
    launch between the attention and the o projection), and their result is the selected rows' exactly."""
    import fspec.draft as D

    draft = tiny_draft(TARGET, kind="eagle3", k=3)
    sc = scenario(draft, context_lens=[4, 5, 7], live=[2, 4, 1], temperature=[0.9, 0.0, 1.3])
    seen = []
    forward = D._head_forward
    monkeypatch.setattr(D, "_head_forward", lambda *a, **k: seen.append(k["logit_rows"]) or forward(*a, **k))
    first, cache = fspec.draft_step(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    assert torch.equal(seen[0], last_live_rows(sc.state.attn))
    assert first.attn.num_tokens == first.attn.num_requests == 3
    second, cache = fspec.draft_step(draft.params, first, cache, cfg=draft.cfg)
    assert seen[1] is None
    # the same step with the rows selected explicitly (arange: one row per request) gives the same state
    explicit = lambda *a, **k: forward(*a, **dict(k, logit_rows=torch.arange(3)))  # noqa: E731
    monkeypatch.setattr(D, "_head_forward", explicit)
    again, _ = fspec.draft_step(draft.params, first, cache, cfg=draft.cfg)  # rewrites the same K/V rows
    assert torch.equal(again.draft_tokens, second.draft_tokens)
    torch.testing.assert_close(again.draft_probs, second.draft_probs, rtol=0, atol=0)
    torch.testing.assert_close(again.hidden, second.hidden, rtol=0, atol=0)


def test_step_rejects_a_state_that_does_not_fit_the_cache_or_config():
    """Eager calls validate: block tables past the cache and a K mismatch are named."""
    draft = tiny_draft(TARGET, kind="eagle", k=3)
    sc = scenario(draft, context_lens=[4], live=[2], temperature=[1.0])
    small = fspec.KVCache.create(draft.cfg.model, num_blocks=2, block_size=BLOCK)
    with pytest.raises(
        ValueError, match=r"state.attn.block_table: expected blocks in use to lie in \[0, num_blocks=2\)"
    ):
        fspec.propose(draft.params, sc.state, small, cfg=draft.cfg)
    other = dataclasses.replace(draft.cfg, num_speculative_steps=4)
    with pytest.raises(ValueError, match="state.draft_tokens: expected shape"):
        fspec.draft_step(draft.params, sc.state, sc.cache, cfg=other)
    assert MAX_LEN // BLOCK == 12
