"""`fspec.Generator(prepack=...)`: eager CPU calls on packed weights give the tokens of calls on the caller's
weights, the packed copy follows the weights when they change, and a model too small to pack runs as it is."""

from __future__ import annotations

import gc

import pytest
import torch

import fspec
from fspec.models import llama
from fspec.models import packed as P
from fspec.models.layers import fuse_projections

pytestmark = pytest.mark.skipif(not P.supported(), reason="this PyTorch build has no oneDNN packed linear")

PROMPTS = [[5, 17, 300, 42, 9, 511], [7, 7, 123]]


def packable_target(seed: int = 0) -> fspec.Target:
    """Two layers wide enough that every projection and the tied LM head are packed (>= 2**18 elements),
    q/k/v and gate/up fused as `fspec.load_target` fuses a checkpoint's."""
    cfg = fspec.ModelConfig(
        vocab_size=600, hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    return fspec.Target(cfg=cfg, params=fuse_projections(llama.init(cfg, seed=seed)))


def _run(gen, target, draft, **kw):
    return gen.generate(target, draft, PROMPTS, max_new_tokens=12, ignore_eos=True, **kw).tokens


def test_packed_calls_equal_calls_on_the_callers_weights():
    target = packable_target()
    draft = fspec.init_draft(target, kind="eagle3", seed=3, num_speculative_steps=3)
    packed, plain = fspec.Generator(), fspec.Generator(prepack=False)
    alone = _run(plain, target, None)
    assert _run(packed, target, None) == alone
    assert _run(packed, target, draft) == alone == _run(plain, target, draft)  # greedy: lossless
    sampled = dict(temperature=1.0, seed=[11, 12])
    assert _run(packed, target, draft, **sampled) == _run(plain, target, draft, **sampled)
    kept = packed.resources.packs
    tparams, dparams = kept["target"][1], kept["draft"][1]
    assert P.is_packed(tparams["lm_head"]) and tparams["embed"] is target.params["embed"]
    assert all(P.is_packed(layer[n]) for layer in tparams["layers"] for n in ("qkv", "o", "gate_up", "down"))
    leaves = [t for t in torch.utils._pytree.tree_leaves(dparams) if isinstance(t, torch.Tensor)]
    assert any(P.is_packed(t) for t in leaves)
    assert not plain.resources.packs
    packed.clear()
    assert not packed.resources.packs


def test_the_packed_copy_follows_weight_changes():
    """An in-place write (an optimizer step, a `copy_`) or another tensor in the tree makes the next call pack
    again: its tokens are those of the changed weights, never the stale copy's."""
    target = packable_target(seed=1)
    gen, plain = fspec.Generator(), fspec.Generator(prepack=False)
    before = _run(gen, target, None)
    first = gen.resources.packs["target"][1]
    with torch.no_grad():
        target.params["embed"].mul_(-1.0)  # the tied LM head, written in place
    changed = _run(plain, target, None)
    assert changed != before
    assert _run(gen, target, None) == changed and gen.resources.packs["target"][1] is not first
    again = gen.resources.packs["target"][1]
    assert _run(gen, target, None) == changed
    assert gen.resources.packs["target"][1] is again  # kept while unchanged
    layer = target.params["layers"][1]
    layer["down"] = torch.randn(layer["down"].shape, generator=torch.Generator().manual_seed(5)) * 4.0
    swapped = _run(plain, target, None)
    assert swapped != changed
    assert _run(gen, target, None) == swapped


def test_small_models_compiled_calls_and_gradients_run_unpacked():
    """Weights below MIN_ELEMENTS, or that need gradients, keep F.linear on the caller's tensors."""
    cfg = fspec.ModelConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    small = fspec.Target(cfg=cfg, params=llama.init(cfg, seed=0))
    gen = fspec.Generator()
    gen.generate(small, None, [[1, 2, 3]], max_new_tokens=4)
    assert not gen.resources.packs
    target = packable_target(seed=2)
    for t in torch.utils._pytree.tree_leaves(target.params):
        t.requires_grad_(True)
    gen.generate(target, None, [[1, 2, 3], [4, 5]], max_new_tokens=4)
    assert not gen.resources.packs


def test_one_row_target_steps_keep_the_callers_weights():
    """Target-only decoding of one request runs one-row products, where MKL is as fast: the target stays
    unpacked; with a head (K + 1 verification rows) or a second request it is packed."""
    target = packable_target(seed=3)
    draft = fspec.init_draft(target, kind="eagle3", seed=4, num_speculative_steps=2)
    gen = fspec.Generator()
    gen.generate(target, None, [[1, 2, 3]], max_new_tokens=4)
    assert not gen.resources.packs
    gen.generate(target, draft, [[1, 2, 3]], max_new_tokens=4)
    assert set(gen.resources.packs) == {"target", "draft"}
    gen.clear()
    gen.generate(target, None, [[1, 2, 3], [4]], max_new_tokens=4)
    assert set(gen.resources.packs) == {"target"}


def test_the_packed_copy_goes_with_the_model():
    """A generator keeps no packed copy of a model the caller has dropped (the default generator lives as
    long as the process)."""
    target = packable_target(seed=4)
    draft = fspec.init_draft(target, kind="eagle3", seed=5, num_speculative_steps=2)
    gen = fspec.Generator()
    gen.generate(target, draft, [[1, 2, 3]], max_new_tokens=4)
    assert set(gen.resources.packs) == {"target", "draft"}
    del draft
    gc.collect()
    assert set(gen.resources.packs) == {"target"}
    del target
    gc.collect()
    assert not gen.resources.packs


def test_prepack_must_be_a_bool():
    with pytest.raises(ValueError, match=r"prepack: expected a bool, got 'yes'"):
        fspec.Generator(prepack="yes")
