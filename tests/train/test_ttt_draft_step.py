"""The training-time test through the draft loop's own step (chain cache) against a plain reference.

tests/train/ttt_reference.py runs the head's layers K times with one dense masked softmax per step and the
plain soft cross-entropy; the library's loss runs K calls of `fspec.draft.dense_step` over a `ChainKVCache`
with the fused lm_head cross-entropy. Equal in fp64 to rounding for every head kind and both feeds, and the
comparison tells a wrong chain attention apart.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
import ttt_reference as R
from test_distill import batch_for, small_cfg, tiny_draft, tiny_target, token_stream

import fspec
import fspec.draft
from fspec.core.cache import ChainKVCache
from fspec.ops.attention import dense_attention
from fspec.train import distill as D
from fspec.train import ttt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TARGET = tiny_target()
K = 4


def _fp64(draft):
    """(params, trainable, frozen, batch) of `draft` and a [2, 9] batch, all floats in fp64."""
    to64 = lambda t: t.double() if t.is_floating_point() else t  # noqa: E731
    params = fspec.tree.tree_map(to64, draft.params)
    batch = {k: to64(v) for k, v in batch_for(TARGET, draft, b=2, s=9).items()}
    trainable, frozen = ttt.split_params(params, draft.shared, dtype=torch.float64)
    return params, trainable, frozen, batch


def _loss_and_grads(loss_fn, draft, trainable, frozen, batch, feed):
    fn = torch.func.grad_and_value(loss_fn, has_aux=True)
    return fn(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=K, step_weight=0.8, feed=feed)


def _assert_equals_reference(draft, feed: str) -> None:
    """ttt_loss (loss, per-step CE, agreement, gradients) equals the reference's, in fp64."""
    _, trainable, frozen, batch = _fp64(draft)
    g_ref, (loss_ref, aux_ref) = _loss_and_grads(R.ttt_loss, draft, trainable, frozen, batch, feed)
    g, (loss, aux) = _loss_and_grads(ttt.ttt_loss, draft, trainable, frozen, batch, feed)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux["loss"], aux_ref["loss"], rtol=1e-10, atol=1e-12)
    assert torch.equal(aux["agreement"], aux_ref["agreement"])
    for a, b in zip(fspec.tree.tree_leaves(g), fspec.tree.tree_leaves(g_ref)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10 * float(b.abs().max()))


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("feed", ["prediction", "data"])
def test_ttt_loss_equals_the_reference_loss_and_gradients(kind, feed):
    """fp64, a sharpened head (a wrong key or position moves its outputs by O(1)): loss and per-step CE to
    1e-10, agreement exactly, every gradient to 1e-8 (seen: ~2e-15 of the largest entry)."""
    _assert_equals_reference(tiny_draft(TARGET, kind=kind, sharpen=True), feed)


@pytest.mark.parametrize("kind,feed", [("eagle3", "data"), ("eagle", "prediction")])
def test_ttt_loss_with_a_loss_mask_equals_the_reference(kind, feed):
    """With batch["loss_mask"] (answer positions only), loss, per-step CE, agreement and gradients equal the
    reference's mean over the kept rows (fp64); the masked loss differs from the unmasked one, so a loss
    that ignored the mask fails; an all-True mask gives the unmasked loss."""
    draft = tiny_draft(TARGET, kind=kind, sharpen=True)
    _, trainable, frozen, batch = _fp64(draft)
    mask = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    mask[0, 2:7], mask[1, 4:] = True, True  # a prompt, then an answer; the second row's answer runs on
    masked = {**batch, "loss_mask": mask}
    g_ref, (loss_ref, aux_ref) = _loss_and_grads(R.ttt_loss, draft, trainable, frozen, masked, feed)
    g, (loss, aux) = _loss_and_grads(ttt.ttt_loss, draft, trainable, frozen, masked, feed)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux["loss"], aux_ref["loss"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux["agreement"], aux_ref["agreement"], rtol=1e-12, atol=1e-12)
    for a, b in zip(fspec.tree.tree_leaves(g), fspec.tree.tree_leaves(g_ref)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10 * float(b.abs().max()))
    _, (plain, _) = _loss_and_grads(ttt.ttt_loss, draft, trainable, frozen, batch, feed)
    # ignoring the mask would fail the comparison above: the kept rows' mean is 1e4 tolerances away
    assert abs(float(plain - loss_ref)) > 1e-6 * abs(float(plain)), "the mask must change the loss"
    everything = {**batch, "loss_mask": torch.ones_like(mask)}
    _, (full, _) = _loss_and_grads(ttt.ttt_loss, draft, trainable, frozen, everything, feed)
    torch.testing.assert_close(full, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_unroll_gives_the_reference_logits_and_hiddens(kind):
    """`ttt.unroll` (the draft step's K logits and hiddens) equals the reference's at every row and step."""
    draft = tiny_draft(TARGET, kind=kind, sharpen=True)
    params, _, _, batch = _fp64(draft)
    logits, hiddens = ttt.unroll(params, batch, cfg=draft.cfg, ttt_steps=K)
    ref_logits, ref_hiddens = R.unroll(params, batch, cfg=draft.cfg, ttt_steps=K)
    assert len(logits) == len(hiddens) == K
    for got, want in zip(logits + hiddens, ref_logits + ref_hiddens):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _later_steps_attend_like_step_0(step, cache):
    """Steps >= 1 write the shared K/V and attend causally over them: row i sees the other rows' drafts of
    this step instead of the step-0 keys and its own chain."""
    return _REAL_BIND_CHAIN(torch.zeros_like(step), cache)


def _chains_forget_their_drafts(step, cache):
    """Each step starts from empty chain slots: step j >= 2 no longer sees its chain's steps 1..j-1."""
    empty = ChainKVCache(cache.k, cache.v, torch.zeros_like(cache.chain_k), torch.zeros_like(cache.chain_v))
    return _REAL_BIND_CHAIN(step, empty)


_REAL_BIND_CHAIN = fspec.draft.bind_chain


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("wrong", [_later_steps_attend_like_step_0, _chains_forget_their_drafts])
def test_the_comparison_fails_for_a_wrong_draft_step(kind, wrong, monkeypatch):
    """The equality above is not vacuous: a draft step whose chain attention is wrong (later steps seeing
    other rows' drafts; chains losing their earlier drafts) fails it, its gradients off by far more than the
    tolerance (seen: 1.7% to 210% of the largest entry, against 1e-8). The loss alone moves little for the
    heads that share the target's lm_head (EAGLE-1, MTP: 3e-9 to 1e-5 relative): the gradients show it."""
    draft = tiny_draft(TARGET, kind=kind, sharpen=True)
    _, trainable, frozen, batch = _fp64(draft)
    g_ref, _ = _loss_and_grads(R.ttt_loss, draft, trainable, frozen, batch, "prediction")
    monkeypatch.setattr(fspec.draft, "bind_chain", wrong)
    with pytest.raises(AssertionError):
        _assert_equals_reference(draft, "prediction")
    g, _ = _loss_and_grads(ttt.ttt_loss, draft, trainable, frozen, batch, "prediction")
    gap = max(
        float((a - b).abs().max() / b.abs().max())
        for a, b in zip(fspec.tree.tree_leaves(g), fspec.tree.tree_leaves(g_ref))
    )
    assert gap > 1e-3


@pytest.mark.parametrize(
    "b,s,n,nkv,d,steps",
    [(1, 1, 2, 2, 4, 0), (2, 13, 4, 2, 8, 1), (3, 7, 6, 2, 5, 3), (2, 9, 4, 1, 16, 6)],
)
def test_the_reference_attention_equals_library_dense_attention_under_ttt_mask(b, s, n, nkv, d, steps):
    """The reference's own attention (einsum, masked softmax) against `dense_attention(mask=ttt_mask)`:
    S of 1 and primes, GQA groups 1 to 4, values and gradients to fp64 rounding."""
    gen = torch.Generator().manual_seed(s)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v = rand(b, s, n, d), rand(b, (steps + 1) * s, nkv, d), rand(b, (steps + 1) * s, nkv, d)
    mask = ttt.ttt_mask(s, steps)
    got = R.masked_attention(q, k, v, mask)
    want = dense_attention(q, k, v, mask=mask[None])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weight = torch.randn(b, s, n, d, generator=gen, dtype=torch.float64)
    for x, y in zip(
        torch.autograd.grad((got * weight).sum(), (q, k, v)),
        torch.autograd.grad((want * weight).sum(), (q, k, v)),
    ):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_k_public_draft_steps_over_the_chain_cache_reproduce_the_reference_hiddens():
    """ttt_start, then K calls of fspec.draft_step (validated, public): step j's hidden [B·S, H] equals the
    reference's step-j output at every row, and the drafts are its argmax chain."""
    draft = tiny_draft(TARGET, kind="eagle3", sharpen=True)
    batch = batch_for(TARGET, draft, b=2, s=7)
    k = 3
    logits, hiddens = R.unroll(draft.params, batch, cfg=draft.cfg, ttt_steps=k)
    state, cache, cfg = ttt.ttt_start(draft.params, batch, cfg=draft.cfg, ttt_steps=k)
    for j in range(k):
        state, cache = fspec.draft_step(draft.params, state, cache, cfg=cfg)
        torch.testing.assert_close(state.hidden, hiddens[j].flatten(0, 1), rtol=1e-5, atol=1e-5)
        want = fspec.draft_to_target(logits[j].argmax(-1), draft.params["d2t"]).flatten()
        assert torch.equal(state.draft_tokens[:, j], want)


# --- the optimizer step and the loop on the reference loss --------------------------------------------------


@pytest.mark.parametrize("feed", ["prediction", "data"])
def test_train_step_equals_the_train_step_on_the_reference_loss(feed, monkeypatch):
    """One optimizer step (loss, clipping, AdamW) from the same params and batch (fp32): the same loss,
    metrics and updated params as the same step with the reference loss in its place."""
    draft = tiny_draft(TARGET, kind="eagle3")
    batch = batch_for(TARGET, draft, b=2, s=9)
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    opt = ttt.adamw_init(trainable)
    dcfg = small_cfg(ttt_steps=K, feed=feed, warmup_steps=0)
    new, new_opt, m_new = ttt.train_step(trainable, opt, frozen, batch, step=0, cfg=draft.cfg, dcfg=dcfg)
    monkeypatch.setattr(ttt, "ttt_loss", R.ttt_loss)
    old, old_opt, m_old = ttt.train_step(trainable, opt, frozen, batch, step=0, cfg=draft.cfg, dcfg=dcfg)
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
    # 1% of one step, not to rtol 1e-5.
    moved = 0
    for a, b, x in zip(
        fspec.tree.tree_leaves(new), fspec.tree.tree_leaves(old), fspec.tree.tree_leaves(trainable)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * lr)
        moved += int((b != x).sum())
    assert moved > 0  # it trained


def test_distill_head_records_the_losses_of_the_reference_loss(monkeypatch):
    """distill_head: 2 steps on the CPU; its recorded losses equal those of the same run on the reference."""
    draft = tiny_draft(TARGET)
    cfg = small_cfg(steps=2)
    runs = {}
    for name in ("draft step", "reference"):
        if name == "reference":
            monkeypatch.setattr(ttt, "ttt_loss", R.ttt_loss)
        batches = D.online_batches(TARGET, draft, token_stream(), cfg=cfg)
        runs[name] = D.distill_head(draft, batches, cfg=cfg, progress=False)
    head, hist = runs["draft step"]
    assert [h["step"] for h in hist] == [1, 2]
    assert not torch.equal(head.params["fc"], draft.params["fc"])  # it trained
    assert [h["loss"] for h in hist] == pytest.approx([h["loss"] for h in runs["reference"][1]], rel=1e-5)


# --- checkpoints and command lines of earlier releases (DistillConfig.via_draft_step) -----------------------


def test_resuming_settings_with_via_draft_step_true_or_absent_is_silent():
    """The obsolete key, True (the draft step, as now) or absent (settings from before it), changes nothing
    and says nothing; another changed setting is still reported."""
    now = dataclasses.asdict(small_cfg())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        D._warn_if_changed({**now, "via_draft_step": True}, now)
        D._warn_if_changed(now, now)
    with pytest.warns(UserWarning, match=r"settings differ from the checkpoint's: \['lr'\]"):
        D._warn_if_changed({**now, "via_draft_step": True, "lr": 0.5}, now)


def test_resuming_a_checkpoint_saved_with_via_draft_step_false_warns_once_and_replays(tmp_path: Path):
    """A checkpoint whose settings say via_draft_step=False (the reference loop of earlier releases): resuming
    warns once that the loop is gone, not that the settings differ, and continues bit-exactly through the
    draft step (the two loops gave the same loss and gradients)."""
    cfg = small_cfg(steps=4)
    draft = tiny_draft(TARGET)
    batches = D.online_batches(TARGET, draft, token_stream(), cfg=cfg)
    _, straight = D.distill_head(draft, batches, cfg=cfg, out=tmp_path / "a", progress=False)
    D.distill_head(draft, batches, cfg=cfg, out=tmp_path / "b", until=2, progress=False)
    file = tmp_path / "b" / D.STATE_FILE
    state = torch.load(file)
    state["config"]["via_draft_step"] = False
    torch.save(state, file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed = D.distill_head(draft, batches, cfg=cfg, resume=tmp_path / "b", progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "via_draft_step=False" in messages[0] and "continues through the draft step" in messages[0]
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in straight[2:]], abs=1e-6)


def test_the_via_draft_step_switch_is_gone():
    """DistillConfig has no such field, and neither command line takes the flag."""
    assert "via_draft_step" not in {f.name for f in dataclasses.fields(ttt.DistillConfig)}
    with pytest.raises(TypeError, match="via_draft_step"):
        ttt.DistillConfig(via_draft_step=True)
    args = ["train", "--target", "t", "--out", "o", "--no-via-draft-step"]
    with pytest.raises(SystemExit) as exit_:
        D.main(args)
    assert exit_.value.code == 2
    from fspec.cli import _distill_parsers

    for parser in _distill_parsers():
        assert not any("--via-draft-step" in a.option_strings for a in parser._actions)
