"""fuse_projections: q/k/v and gate/up as single matmuls compute the same model, round-trip exactly, and
save in the published layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_checkpoint import leaves_equal, tiny_target

import fspec
from fspec.models import llama
from fspec.models.heads import head_forward_dense, project_target_hidden

from draft_setup import tiny_draft


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_target_computes_the_same_logits_and_round_trips(model_type, tmp_path):
    """Biases (Qwen2), per-head q/k norms (Qwen3): the fused target's logits and aux hidden states equal the
    unfused ones; unfuse(fuse(p)) is bit-identical; a fused target saves in HF layout and loads back equal."""
    wide = tiny_target(model_type, dtype=torch.float64)  # fp64: only the matmuls' summation order differs
    fused = fspec.fuse_projections(wide.params)
    layer = fused["layers"][0]
    assert "qkv" in layer and "gate_up" in layer and not {"q", "k", "v", "gate", "up"} & set(layer)
    assert ("qkv_bias" in layer) == (model_type == "qwen2")
    ids = torch.tensor([[3, 17, 5, 40, 2, 9, 33]])
    want, want_h = llama.forward_dense(wide.params, ids, cfg=wide.cfg, aux_layer_ids=(0, 1, 2))
    got, got_h = llama.forward_dense(fused, ids, cfg=wide.cfg, aux_layer_ids=(0, 1, 2))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_h.aux, want_h.aux, rtol=1e-10, atol=1e-10)
    target = tiny_target(model_type)
    fused = fspec.fuse_projections(target.params)
    assert leaves_equal(fspec.unfuse_projections(fused, target.cfg), target.params)
    fspec.save_target(fspec.Target(cfg=target.cfg, params=fused), tmp_path)
    assert leaves_equal(fspec.load_target(tmp_path, fuse=False).params, target.params)
    assert leaves_equal(fspec.load_target(tmp_path).params, fused)  # load_target fuses by default


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_fused_heads_draft_the_same_and_save_in_the_published_layout(kind, tmp_path):
    from draft_setup import tiny_target as engine_target

    target = engine_target()
    draft = tiny_draft(target, kind=kind, k=2)
    fused = fspec.Draft(cfg=draft.cfg, params=fspec.fuse_projections(draft.params), shared=draft.shared)
    ids = torch.tensor([[5, 9, 1, 44, 12]])
    _, th = llama.forward_dense(target.params, ids, cfg=target.cfg, aux_layer_ids=draft.cfg.target_layer_ids)

    def run(params):
        hidden = project_target_hidden(params, th, cfg=draft.cfg)
        return head_forward_dense(params, ids, hidden, cfg=draft.cfg)

    for got, want in zip(run(fused.params), run(draft.params)):  # logits, new hidden
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fspec.save_draft(fused, tmp_path)
    assert leaves_equal(fspec.load_draft(tmp_path, target=target, fuse=False).params, draft.params)
    assert leaves_equal(fspec.load_draft(tmp_path, target=target).params, fused.params)  # fused by default


def test_generate_with_fused_target_and_head_emits_the_same_tokens():
    """Greedy, eager: fusing both models changes no token."""
    from engine_setup import aligned_pair

    target, draft = aligned_pair(k=3)
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12]]
    want = fspec.generate(target, draft, prompts, max_new_tokens=12, num_speculative_steps=3)
    t2 = fspec.Target(cfg=target.cfg, params=fspec.fuse_projections(target.params))
    shared = {n: t2.params["embed"] if n == "embed" else t2.params["lm_head"] for n in draft.shared}
    d2 = fspec.Draft(
        cfg=draft.cfg, params={**fspec.fuse_projections(draft.params), **shared}, shared=draft.shared
    )
    got = fspec.generate(t2, d2, prompts, max_new_tokens=12, num_speculative_steps=3)
    assert got.tokens == want.tokens
    assert got.stats["acceptance_length"] == want.stats["acceptance_length"]


def test_bad_inputs_name_the_argument():
    target = tiny_target("llama")
    fused = fspec.fuse_projections(target.params)
    with pytest.raises(ValueError, match="^params: expected a model's or head's params dict .*got Target"):
        fspec.fuse_projections(target)
    with pytest.raises(ValueError, match=r"^params: expected layers with separate q/k/v .*fused already\?"):
        fspec.fuse_projections(fused)
    other = dataclasses.replace(target.cfg, num_key_value_heads=1)
    with pytest.raises(
        ValueError, match=r"^cfg: expected head counts matching the fused weights \(32 qkv rows\)"
    ):
        fspec.unfuse_projections(fused, other)
    with pytest.raises(ValueError, match="^params: expected a model's or head's params dict"):
        fspec.unfuse_projections([fused], target.cfg)
    assert leaves_equal(fspec.unfuse_projections(target.params, target.cfg), target.params)  # nothing fused


def test_in_place_fusion_equals_fuse_projections_and_releases_the_separate_weights():
    """What load_target / load_draft run: every layer fused in place, equal to the functional version."""
    from fspec.models.layers import fuse_projections_

    target = tiny_target("qwen2")  # with q/k/v biases
    want = fspec.fuse_projections(target.params)
    params = {**target.params, "layers": [dict(p) for p in target.params["layers"]]}  # owned copy
    assert fuse_projections_(params) == target.cfg.num_hidden_layers
    assert leaves_equal(params, want)
    assert all(not {"q", "k", "v", "q_bias", "gate", "up"} & set(p) for p in params["layers"])
    assert fuse_projections_(params) == 0  # already fused: nothing to do
    with pytest.raises(ValueError, match="^params: expected a model's or head's params dict"):
        fuse_projections_(target)
    with pytest.raises(ValueError, match="^fuse: expected True or False, got 'yes'"):
        fspec.load_target("/nonexistent", fuse="yes")  # checked before the path
    with pytest.raises(ValueError, match="^fuse: expected True or False, got 1"):
        fspec.load_draft("/nonexistent", target=target, fuse=1)
