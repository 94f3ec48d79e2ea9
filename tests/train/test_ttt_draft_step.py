"""The training-time test through the draft loop's own step (chain cache) equals the unrolled one."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_distill import batch_for, small_cfg, tiny_draft, tiny_target, token_stream

import fspec
from fspec.train import distill as D
from fspec.train import ttt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TARGET = tiny_target()


def _loss_and_grads(draft, batch, *, use_step: bool, feed: str, k: int):
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    fn = torch.func.grad_and_value(ttt.ttt_loss, has_aux=True)
    kw = dict(cfg=draft.cfg, ttt_steps=k, step_weight=0.8, feed=feed, via_draft_step=use_step)
    return fn(trainable, frozen, batch, **kw)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("feed", ["prediction", "data"])
def test_ttt_loss_through_draft_step_equals_the_unrolled_loss_and_gradients(kind, feed):
    """Loss, per-step CE, agreement and gradients of the draft_step path equal the unrolled path (fp32)."""
    draft = tiny_draft(TARGET, kind=kind, sharpen=True)
    batch = batch_for(TARGET, draft, b=2, s=9)
    g_old, (loss_old, aux_old) = _loss_and_grads(draft, batch, use_step=False, feed=feed, k=4)
    g_new, (loss_new, aux_new) = _loss_and_grads(draft, batch, use_step=True, feed=feed, k=4)
    torch.testing.assert_close(loss_new, loss_old, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux_new["loss"], aux_old["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux_new["agreement"], aux_old["agreement"])
    for a, b in zip(torch.utils._pytree.tree_leaves(g_new), torch.utils._pytree.tree_leaves(g_old)):
        # the sharpened head (q, k x6, lm_head x30) amplifies fp32 rounding: 1e-5 of the largest entry
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()) + 1e-7)


def test_k_public_draft_steps_over_the_chain_cache_reproduce_the_unrolled_hiddens():
    """ttt_start, then K calls of fspec.draft_step (validated, public): step j's hidden [B·S, H] equals the
    unrolled head's step-j output at every row, and the drafts are its argmax chain."""
    draft = tiny_draft(TARGET, kind="eagle3", sharpen=True)
    batch = batch_for(TARGET, draft, b=2, s=7)
    k = 3
    logits, hiddens = ttt.unroll(draft.params, batch, cfg=draft.cfg, ttt_steps=k)
    state, cache, cfg = ttt.ttt_start(draft.params, batch, cfg=draft.cfg, ttt_steps=k)
    for j in range(k):
        state, cache = fspec.draft_step(draft.params, state, cache, cfg=cfg)
        torch.testing.assert_close(state.hidden, hiddens[j].flatten(0, 1), rtol=1e-5, atol=1e-5)
        want = fspec.draft_to_target(logits[j].argmax(-1), draft.params["d2t"]).flatten()
        assert torch.equal(state.draft_tokens[:, j], want)


# --- distillation through the draft step (DistillConfig.via_draft_step) ----------------------------------


def test_distill_config_via_draft_step_must_be_a_bool():
    with pytest.raises(ValueError, match=r"DistillConfig\.via_draft_step: expected True or False, got 'yes'"):
        ttt.DistillConfig(via_draft_step="yes")
    with pytest.raises(ValueError, match="via_draft_step"):
        ttt.DistillConfig(via_draft_step=1)
    assert ttt.DistillConfig().via_draft_step is True  # distillation trains through the draft step


@pytest.mark.parametrize("feed", ["prediction", "data"])
def test_train_step_through_draft_step_equals_the_unrolled_train_step(feed):
    """One optimizer step (loss, clipping, AdamW) from the same params and batch: the same loss, metrics
    and updated params (fp32) whichever way the loss is computed."""
    draft = tiny_draft(TARGET, kind="eagle3")
    batch = batch_for(TARGET, draft, b=2, s=9)
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    opt = ttt.adamw_init(trainable)
    out = {}
    for via in (False, True):
        dcfg = small_cfg(ttt_steps=4, feed=feed, warmup_steps=0, via_draft_step=via)
        out[via] = ttt.train_step(trainable, opt, frozen, batch, step=0, cfg=draft.cfg, dcfg=dcfg)
    (old, old_opt, m_old), (new, new_opt, m_new) = out[False], out[True]
    for key in ("loss", "loss_per_step", "grad_norm"):
        torch.testing.assert_close(m_new[key], m_old[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m_new["agreement"], m_old["agreement"])
    lr = m_old["lr"]
    assert m_new["lr"] == lr > 0
    # The AdamW moments are the clipped gradient's images (m linear, v quadratic): fp32 rounding apart.
    for part in ("m", "v"):
        for a, b in zip(fspec.tree.tree_leaves(new_opt[part]), fspec.tree.tree_leaves(old_opt[part])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()) + 1e-12)
    # The first AdamW step moves weight x by lr·g/(|g| + eps): for entries whose gradient is ~1e-9 (near
    # eps, where fp32 rounding is a large part of g) that ratio is ill-conditioned, so the weights agree to
    # 1% of one step (seen: up to 0.3% over seeds and feeds), not to rtol 1e-5.
    moved = 0
    for a, b, x in zip(
        fspec.tree.tree_leaves(new), fspec.tree.tree_leaves(old), fspec.tree.tree_leaves(trainable)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * lr)
        moved += int((b != x).sum())
    assert moved > 0  # it trained


@pytest.mark.parametrize("via", [False, True])
def test_via_draft_step_selects_the_loop_that_train_step_and_agreement_run(via, monkeypatch):
    """The equalities above would hold trivially if the field were ignored: each setting must run its own
    loop (the draft step's `_unroll_steps`, or the reference `_unroll`) and never the other."""
    calls = []
    for name in ("_unroll", "_unroll_steps"):
        real = getattr(ttt, name)
        monkeypatch.setattr(
            ttt, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    draft = tiny_draft(TARGET, kind="eagle3")
    batch = batch_for(TARGET, draft, b=2, s=9)
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    dcfg = small_cfg(ttt_steps=3, warmup_steps=0, via_draft_step=via)
    ttt.train_step(trainable, ttt.adamw_init(trainable), frozen, batch, step=0, cfg=draft.cfg, dcfg=dcfg)
    D.agreement(draft, lambda i: batch, cfg=dcfg, steps=range(1))
    assert calls == ["_unroll_steps" if via else "_unroll"] * 2


def test_distill_head_trains_through_draft_step():
    """distill_head with via_draft_step=True: 2 steps on the CPU, the losses of the unrolled path."""
    draft = tiny_draft(TARGET)
    tokens = token_stream()
    hist = {}
    for via in (False, True):
        cfg = small_cfg(steps=2, via_draft_step=via)
        head, hist[via] = D.distill_head(
            draft, D.online_batches(TARGET, draft, tokens, cfg=cfg), cfg=cfg, progress=False
        )
    assert [h["step"] for h in hist[True]] == [1, 2]
    assert not torch.equal(head.params["fc"], draft.params["fc"])  # it trained
    assert [h["loss"] for h in hist[True]] == pytest.approx([h["loss"] for h in hist[False]], rel=1e-5)


def test_cli_via_draft_step_reaches_the_config(tmp_path: Path):
    """`python -m fspec.train.distill train`: the run's settings record the draft-step path (the default) or
    the reference loop (`--no-via-draft-step`)."""
    fspec.save_target(TARGET, tmp_path / "target")
    np.save(tmp_path / "tokens.npy", token_stream().numpy().astype(np.int32))
    args = ["train", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "out"), "--device", "cpu"]
    args += ["--tokens", str(tmp_path / "tokens.npy"), "--no-progress", "--draft-vocab-size", "61"]
    args += ["--steps", "1", "--batch-size", "2", "--seq-len", "12", "--ttt-steps", "3"]
    assert D.main(args) == 0
    assert torch.load(tmp_path / "out" / D.STATE_FILE)["config"]["via_draft_step"] is True  # the default
    assert D.main([*args[:4], str(tmp_path / "ref"), *args[5:], "--no-via-draft-step"]) == 0
    assert torch.load(tmp_path / "ref" / D.STATE_FILE)["config"]["via_draft_step"] is False


def test_resuming_a_checkpoint_that_predates_via_draft_step_does_not_warn():
    """Settings saved before the field existed trained through the reference loop (False): resuming them
    with False gives no 'settings differ' warning, while the draft-step path is told it is not a replay."""
    ref = dataclasses.asdict(small_cfg(via_draft_step=False))
    saved = {k: v for k, v in ref.items() if k != "via_draft_step"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        D._warn_if_changed(saved, ref)
    with pytest.warns(UserWarning, match="via_draft_step"):
        D._warn_if_changed(saved, dataclasses.asdict(small_cfg(via_draft_step=True)))
