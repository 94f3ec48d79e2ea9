"""State constructors and boundary validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fspec


def _meta(b: int = 3, block_size: int = 4):
    positions = torch.tensor([5, 0, 9][:b], dtype=torch.int64)
    table = torch.arange(b * 8, dtype=torch.int32).view(b, 8)
    return fspec.decode_metadata(positions, table, block_size=block_size)


def _state(cfg, **kw):
    b = 3
    args = dict(temperature=torch.tensor([0.0, 1.0, 0.7]), seed=torch.tensor([1, 2, 3]))
    args.update(kw)
    return fspec.init_draft_state(torch.tensor([4, 5, 6]), torch.zeros(b, 32), _meta(b), cfg=cfg, **args)


def test_init_draft_state_allocates_buffers_of_the_declared_shapes(tiny_draft_cfg):
    """Step 0, drafts -1, probs [B, K, Vd] float32 (or [B, K, 0] for greedy drafts), scalars broadcast."""
    s = _state(tiny_draft_cfg)
    assert s.step.shape == () and s.step.dtype == torch.int64 and int(s.step) == 0
    assert s.draft_tokens.shape == (3, 3) and bool((s.draft_tokens == -1).all())
    assert s.draft_probs.shape == (3, 3, 97) and s.draft_probs.dtype == torch.float32
    s2 = fspec.init_draft_state(
        torch.tensor([4]), torch.zeros(1, 32), _meta(1), cfg=tiny_draft_cfg, temperature=0.5, seed=9
    )
    sp = s2.sampling
    assert sp.temperature.tolist() == [0.5] and sp.seed.dtype == torch.int64 and sp.seed.tolist() == [9]
    greedy = dataclasses.replace(tiny_draft_cfg, greedy_drafts=True)
    assert _state(greedy).draft_probs.shape == (3, 3, 0)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: {"input_ids": s.input_ids.int()}, "state.input_ids: expected dtype torch.int64"),
        (
            lambda s: {"input_ids": torch.tensor([4, 5, 97])},
            r"state.input_ids: expected token ids in \[0, 97\)",
        ),
        (lambda s: {"hidden": torch.zeros(2, 32)}, r"state.hidden: expected shape \[3, \*\]"),
        (lambda s: {"step": torch.tensor(4)}, r"state.step: expected a value in \[0, K=3\]"),
        (lambda s: {"step": torch.tensor([0])}, r"state.step: expected shape \[\]"),
        (
            lambda s: {"sampling": fspec.replace(s.sampling, temperature=torch.tensor([0.0, -1.0, 1.0]))},
            "state.sampling.temperature: expected finite",
        ),
        (
            lambda s: {
                "sampling": fspec.replace(s.sampling, temperature=torch.tensor([0.0, float("nan"), 1.0]))
            },
            "state.sampling.temperature: expected finite",
        ),
        (
            lambda s: {"sampling": fspec.replace(s.sampling, seed=s.sampling.seed.int())},
            r"state.sampling.seed: expected a \[3\] torch.int64 tensor",
        ),
        (
            lambda s: {"draft_tokens": torch.zeros(3, 4, dtype=torch.int64)},
            r"state.draft_tokens: expected shape",
        ),
        (lambda s: {"draft_probs": torch.zeros(3, 3, 96)}, r"state.draft_probs: expected shape \[3, 3, 97\]"),
    ],
)
def test_validate_draft_state_names_the_bad_leaf(tiny_draft_cfg, change, match):
    """Each malformed leaf raises ValueError naming it with expected and actual values."""
    s = _state(tiny_draft_cfg)
    with pytest.raises(ValueError, match=match):
        fspec.validate_draft_state(dataclasses.replace(s, **change(s)), cfg=tiny_draft_cfg)


def test_validate_attn_metadata_catches_stale_or_out_of_range_fields(tiny_draft_cfg):
    """Slot mappings that disagree with the table, positions past max_model_len, blocks past the cache."""
    meta = _meta()
    kw = dict(block_size=4, max_model_len=32)
    fspec.validate_attn_metadata(meta, **kw, num_blocks=24)
    stale = dataclasses.replace(meta, slot_mapping=meta.slot_mapping + 1)
    with pytest.raises(ValueError, match="attn.slot_mapping"):
        fspec.validate_attn_metadata(stale, **kw)
    with pytest.raises(ValueError, match=r"attn.positions: expected values in \[-1, max_model_len=8\)"):
        fspec.validate_attn_metadata(meta, block_size=4, max_model_len=8)
    with pytest.raises(
        ValueError, match=r"attn.block_table: expected blocks in use to lie in \[0, num_blocks=10\)"
    ):
        fspec.validate_attn_metadata(meta, **kw, num_blocks=10)
    with pytest.raises(ValueError, match="attn.seq_lens: expected dtype torch.int32"):
        fspec.validate_attn_metadata(dataclasses.replace(meta, seq_lens=meta.seq_lens.long()), **kw)
    bad_lens = dataclasses.replace(meta, seq_lens=torch.tensor([5, 1, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="positions: expected every live position < its request's seq_lens"):
        fspec.validate_attn_metadata(bad_lens, **kw)


def test_validate_accepts_first_step_states_and_rejects_mismatched_token_counts(tiny_draft_cfg):
    """A first-step state carries T = B·Q tokens; input_ids, hidden and attn must agree on T."""
    s = _state(tiny_draft_cfg)
    table = s.attn.block_table
    first = fspec.first_step_metadata(
        torch.tensor([1, 2, 3]), torch.tensor([2, 1, 2]), table, num_query=2, block_size=4
    )
    ok = dataclasses.replace(s, attn=first, input_ids=torch.arange(6), hidden=torch.zeros(6, 32))
    fspec.validate_draft_state(ok, cfg=tiny_draft_cfg)
    with pytest.raises(ValueError, match="state.attn.positions: expected T=3 query tokens"):
        fspec.validate_draft_state(dataclasses.replace(s, attn=first), cfg=tiny_draft_cfg)
    with pytest.raises(
        ValueError, match=r"state.input_ids: expected T = B·Q tokens for B=3 requests, got T=4"
    ):
        fspec.validate_draft_state(dataclasses.replace(ok, input_ids=torch.arange(4)), cfg=tiny_draft_cfg)


def test_validate_rejects_a_ragged_row_layout(tiny_draft_cfg):
    """Draft states lay rows out uniformly (Q per request); a ragged query_start_loc is named."""
    s = _state(tiny_draft_cfg)
    table = s.attn.block_table
    first = fspec.first_step_metadata(
        torch.tensor([1, 2, 3]), torch.tensor([2, 1, 2]), table, num_query=2, block_size=4
    )
    ragged = dataclasses.replace(first, query_start_loc=torch.tensor([0, 1, 4, 6], dtype=torch.int32))
    bad = dataclasses.replace(s, attn=ragged, input_ids=torch.arange(6), hidden=torch.zeros(6, 32))
    with pytest.raises(ValueError, match=r"state.attn.query_start_loc: expected Q=2 rows per request"):
        fspec.validate_draft_state(bad, cfg=tiny_draft_cfg)
