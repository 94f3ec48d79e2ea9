"""The fused decode layer (fspec.models.layers.fused_decoder_layer: RMSNorm, SiLU * up and the residual
adds folded into four `fspec::skinny_linear` launches) computes what the unfused layer does; the routing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fspec
from fspec.models import layers as L
from fspec.models import llama


def _fused_target(model_type: str = "llama", seed: int = 0) -> fspec.Target:
    cfg = fspec.ModelConfig(
        vocab_size=53, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, model_type=model_type, qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2", rms_norm_eps=1e-5,
    )  # fmt: skip
    params = llama.init(cfg, seed=seed)
    for i, leaf in enumerate(fspec.tree.tree_leaves(params)):  # norms away from 1: the weights must matter
        leaf.data.copy_(
            torch.randn(leaf.shape, generator=torch.Generator().manual_seed(seed + i)) * 0.5 + 0.2
        )
    return fspec.Target(cfg, fspec.fuse_projections(params))


def _attend(q, k, v, layer, cos, sin):
    """A stand-in for attention that uses q, k, v and the layer (the plumbing is what is under test)."""
    group = q.shape[-2] // k.shape[-2]
    return q * (layer + 0.5) + (k * v).repeat_interleave(group, dim=-2)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fused_layer_equals_norm_then_decoder_layer(rows):
    target = _fused_target()
    p, cfg = target.params["layers"][1], target.cfg
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows)) * 2
    cos = sin = torch.zeros(rows, cfg.head_dim)
    want = L.decoder_layer(
        p, L.rms_norm(x, p["input_norm"], cfg.rms_norm_eps), x, cos, sin, _attend, cfg=cfg, layer=1
    )
    got = L.fused_decoder_layer(p, x, cos, sin, _attend, cfg=cfg, layer=1)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # leading dims are kept: [B, Q, H] in, [B, Q, H] out
    got3 = L.fused_decoder_layer(p, x[None], cos[None], sin[None], _attend, cfg=cfg, layer=1)
    torch.testing.assert_close(got3[0], got, rtol=0, atol=0)


def test_model_through_fused_layers_gives_the_unfused_logits(monkeypatch):
    """A whole forward (dense attention, 7 tokens) with every layer routed to the fused path (forced here:
    on the CPU the routing says no, and for 7 rows so it would on CUDA) equals the unfused forward."""
    target = _fused_target()
    ids = torch.tensor([[3, 17, 5, 40, 2, 9, 33]])
    want, want_h = llama.forward_dense(target.params, ids, cfg=target.cfg, aux_layer_ids=(0, 1))
    routed = _force_routing(monkeypatch)
    got, got_h = llama.forward_dense(target.params, ids, cfg=target.cfg, aux_layer_ids=(0, 1))
    assert routed == [True, True]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_h.aux, want_h.aux, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_h.last, want_h.last, rtol=1e-4, atol=1e-4)


def test_routing_needs_few_rows_of_inference_and_a_fused_unbiased_layer():
    target, row = _fused_target(), torch.randn(1, 48)
    p, cfg = target.params["layers"][0], target.cfg
    assert L.use_fused_layer(p, row, cfg, cuda=True)
    assert L.use_fused_layer(p, torch.randn(1, 1, 48), cfg, cuda=True)
    assert not L.use_fused_layer(p, row, cfg, cuda=False)
    # several rows (verification's K + 1 at B = 1) only up to the kernels' 16 rows and in a narrow model;
    # a wide one keeps the unfused layer for them, and takes the fused one for one row
    for rows in ((4, 48), (2, 48), (1, 2, 48), (16, 48)):
        assert L.use_fused_layer(p, torch.randn(rows), cfg, cuda=True)
    assert not L.use_fused_layer(p, torch.randn(17, 48), cfg, cuda=True)
    wide = dataclasses.replace(cfg, hidden_size=L.FUSED_ROWS_MAX_HIDDEN + 1)
    assert L.use_fused_layer(p, row, wide, cuda=True)
    for rows in ((2, 48), (6, 48), (1, 6, 48)):
        assert not L.use_fused_layer(p, torch.randn(rows), wide, cuda=True)
    assert not L.use_fused_layer(p, row.double(), cfg, cuda=True)
    fp32_norms = {**p, "post_norm": p["post_norm"].double()}  # a checkpoint keeping norms in another dtype
    assert not L.use_fused_layer(fp32_norms, row, cfg, cuda=True)
    unfused = fspec.unfuse_projections(target.params, cfg)["layers"][0]
    assert not L.use_fused_layer(unfused, row, cfg, cuda=True)
    for model_type in ("qwen2", "qwen3"):  # q/k/v biases; per-head q/k norms
        other = _fused_target(model_type)
        assert not L.use_fused_layer(other.params["layers"][0], row, other.cfg, cuda=True)
    with torch.enable_grad():
        assert not L.use_fused_layer(p, row.clone().requires_grad_(), cfg, cuda=True)
    # a layer without an input norm (an EAGLE head's first layer) fuses what follows its attention; one
    # without a post-attention norm or an o projection is not fused (and none is a KeyError)
    assert L.use_fused_layer({k: t for k, t in p.items() if k != "input_norm"}, row, cfg, cuda=True)
    for name in ("post_norm", "o", "down"):
        assert not L.use_fused_layer({k: t for k, t in p.items() if k != name}, row, cfg, cuda=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 6, 16])
def test_fused_layers_on_gpu_give_the_unfused_logits_eager_and_compiled(monkeypatch, tokens):
    """On CUDA the routing takes the fused path by itself for a one-row step and for a narrow model's few
    rows (a B = 1 verification): float32 logits equal the unfused model's, eagerly and inside torch.compile
    (the op's optional tensors traced)."""
    target = _fused_target()
    params = fspec.tree.tree_map(lambda t: t.cuda(), target.params)
    ids = torch.tensor([[17, 3, 40, 8, 22, 5, 1, 9, 30, 2, 11, 7, 50, 4, 19, 6][:tokens]], device="cuda")
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(L, "use_fused_layer", lambda *a, **k: False)
            want, _ = llama.forward_dense(params, ids, cfg=target.cfg)
        x = torch.zeros(1, tokens, 48, device="cuda")
        assert L.use_fused_layer(params["layers"][0], x, target.cfg)
        got, _ = llama.forward_dense(params, ids, cfg=target.cfg)
        compiled = torch.compile(lambda p, i: llama.forward_dense(p, i, cfg=target.cfg)[0], fullgraph=True)
        got_compiled = compiled(params, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_compiled, want, rtol=1e-4, atol=1e-4)


def _force_routing(monkeypatch):
    """Route as on CUDA (the CPU runs the interpreted kernels) for every row count (the routing's other
    conditions checked on x's first row; `fused_decoder_layer` takes up to 16 rows) and count the layers
    routed."""
    routed, use = [], L.use_fused_layer

    def forced(p, x, cfg, *, cuda=None):
        routed.append(use(p, x.reshape(-1, x.shape[-1])[:1], cfg, cuda=True))
        return routed[-1]

    monkeypatch.setattr(L, "use_fused_layer", forced)
    return routed


def test_decoder_layer_fuses_what_follows_the_attention(monkeypatch):
    """decoder_layer with its own normalized input (EAGLE-3 heads build it from two halves): o with the
    residual, the post-attention norm and the MLP go through the fused launches, same result."""
    target = _fused_target(seed=3)
    p, cfg = target.params["layers"][0], target.cfg
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    attn_in = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(10))
    cos = sin = torch.zeros(6, cfg.head_dim)
    want = L.decoder_layer(p, attn_in, x, cos, sin, _attend, cfg=cfg, layer=0)
    routed = _force_routing(monkeypatch)
    got = L.decoder_layer(p, attn_in, x, cos, sin, _attend, cfg=cfg, layer=0)
    assert routed == [True]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp"])
def test_fused_head_proposes_what_the_naive_reference_does(monkeypatch, kind):
    """A whole draft loop with a fused-projection head routed through the fused launches, for every head
    kind (an EAGLE head's first layer has no input norm: it fuses what follows its attention)."""
    from draft_setup import naive_propose, scenario, tiny_draft, tiny_target

    draft = tiny_draft(tiny_target(), kind=kind, k=3)
    sc = scenario(draft, context_lens=[3, 9, 14], live=[1, 4, 2], temperature=[0.0, 1.0, 0.7], seed=5)
    want_tokens, want_probs = naive_propose(sc)
    fused = dataclasses.replace(draft, params={**draft.params, **fspec.fuse_projections(draft.params)})
    routed = _force_routing(monkeypatch)
    state, _ = fspec.propose(fused.params, sc.state, sc.cache, cfg=draft.cfg)
    assert routed and all(routed)
    assert torch.equal(state.draft_tokens, want_tokens)
    torch.testing.assert_close(state.draft_probs, want_probs, rtol=1e-4, atol=1e-5)
