"""The pytree decorator: one namespace for optree, torch.utils._pytree, torch.func and torch.compile."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import fspec
from fspec.core.pytree import pytree_dataclass, static_field


@pytree_dataclass
class _Toy:
    """A toy state with a static field between two leaves."""

    a: torch.Tensor
    scale: int = static_field()
    b: torch.Tensor = None  # type: ignore[assignment]


def _state(cfg: fspec.DraftConfig, b: int = 3) -> fspec.DraftState:
    positions = torch.arange(b, dtype=torch.int64) + 5
    block_table = torch.arange(b * 8, dtype=torch.int32).view(b, 8)
    meta = fspec.decode_metadata(positions, block_table, block_size=cfg.block_size)
    hidden = torch.randn(b, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
    return fspec.init_draft_state(
        torch.arange(b, dtype=torch.int64) + 1, hidden, meta, cfg=cfg, temperature=0.5, seed=7
    )


def test_both_registries_flatten_a_state_to_the_same_leaves_in_the_same_order(tiny_draft_cfg):
    """optree (namespace fspec) and torch's pytree see identical leaves, in field order."""
    state = _state(tiny_draft_cfg)
    ours = fspec.tree.tree_leaves(state)
    theirs = torch_pytree.tree_leaves(state)
    assert len(ours) == len(theirs) == 17
    assert all(x is y for x, y in zip(ours, theirs))
    assert (
        ours[0] is state.input_ids
        and ours[2] is state.attn.positions
        and ours[-1] is state.sampling.suppress_until
    )
    # Without the namespace optree sees an opaque leaf: the registration really is namespaced.
    assert optree.tree_leaves(state) == [state]


def test_unflatten_round_trips_through_both_registries(tiny_draft_cfg):
    """flatten then unflatten rebuilds an equal state in both registries."""
    state = _state(tiny_draft_cfg)
    leaves, spec = fspec.tree.tree_flatten(state)
    again = fspec.tree.tree_unflatten(spec, leaves)
    assert isinstance(again, fspec.DraftState) and again.attn.slot_mapping is state.attn.slot_mapping
    leaves2, spec2 = torch_pytree.tree_flatten(state)
    again2 = torch_pytree.tree_unflatten(leaves2, spec2)
    assert isinstance(again2.attn, fspec.AttnMetadata) and again2.sampling.seed is state.sampling.seed


def test_static_fields_are_structure_not_leaves():
    """A static field lives in the treespec; changing it changes the structure."""
    x = _Toy(a=torch.ones(2), scale=3, b=torch.zeros(2))
    assert fspec.tree.tree_leaves(x) == [x.a, x.b]
    assert torch_pytree.tree_leaves(x) == [x.a, x.b]
    y = fspec.tree.tree_map(lambda t: t + 1, x)
    assert y.scale == 3 and torch.equal(y.a, torch.full((2,), 2.0))
    assert fspec.tree.tree_structure(x) != fspec.tree.tree_structure(_Toy(a=x.a, scale=4, b=x.b))
    assert torch_pytree.tree_structure(x) != torch_pytree.tree_structure(_Toy(a=x.a, scale=4, b=x.b))


def test_assignment_to_a_field_raises(tiny_draft_cfg):
    """States are frozen: updates go through replace."""
    state = _state(tiny_draft_cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = torch.ones((), dtype=torch.int64)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.attn.positions = state.attn.positions + 1  # type: ignore[misc]
    new = fspec.replace(state, step=state.step + 1)
    assert int(new.step) == 1 and int(state.step) == 0


def test_vmap_over_a_state(tiny_draft_cfg):
    """torch.func.vmap maps over a batch of states and returns a batched state."""
    states = [_state(tiny_draft_cfg) for _ in range(4)]
    stacked = torch_pytree.tree_map(lambda *xs: torch.stack(xs), *states)
    stacked = fspec.replace(stacked, hidden=stacked.hidden * torch.arange(4.0).view(4, 1, 1))

    def f(s: fspec.DraftState) -> fspec.DraftState:
        return fspec.replace(
            s, hidden=s.hidden.sum(-1, keepdim=True) * s.sampling.temperature[:, None], step=s.step + 1
        )

    out = torch.func.vmap(f)(stacked)
    assert isinstance(out, fspec.DraftState)
    assert out.step.tolist() == [1, 1, 1, 1]
    for i in range(4):
        expected = f(torch_pytree.tree_map(lambda x, i=i: x[i], stacked))
        torch.testing.assert_close(out.hidden[i], expected.hidden)


def test_compile_fullgraph_of_a_function_that_replaces_fields(tiny_draft_cfg):
    """torch.compile(fullgraph=True) traces replace on nested states and matches eager."""
    state = _state(tiny_draft_cfg)

    def step(s: fspec.DraftState) -> fspec.DraftState:
        attn = fspec.advance(s.attn, block_size=4, max_model_len=32)
        return fspec.replace(s, attn=attn, step=s.step + 1, hidden=torch.tanh(s.hidden))

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got, want = compiled(state), step(state)
    for x, y in zip(fspec.tree.tree_leaves(got), fspec.tree.tree_leaves(want)):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.is_floating_point():  # inductor's tanh may differ from eager's in the last bit
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(x, y)
    assert int(state.step) == 0  # the input is untouched
