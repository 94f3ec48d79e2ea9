"""The training-time test through the draft loop's own step (chain cache) equals the unrolled one."""

from __future__ import annotations

import pytest
import torch
from test_distill import batch_for, tiny_draft, tiny_target

import fspec
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
