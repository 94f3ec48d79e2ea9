"""The fused lm_head + soft cross-entropy of the TTT loss equals the plain formulation (values, argmax,
gradients), keeps no logits for the backward pass, and leaves the whole TTT loss unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_distill import batch_for, tiny_draft, tiny_target

import fspec
from fspec.train import ttt


def _plain(h, w, p_logits):
    q = F.linear(h, w)
    return -(p_logits.softmax(-1) * q.log_softmax(-1)).sum(-1).mean(), q.argmax(-1)


@pytest.mark.parametrize(
    "b,n,hd,v,chunk", [(1, 1, 4, 5, None), (2, 7, 8, 37, 3), (3, 5, 6, 101, 1), (2, 9, 5, 13, 64)]
)
def test_linear_soft_cross_entropy_equals_the_plain_expression(b, n, hd, v, chunk):
    gen = torch.Generator().manual_seed(b * 100 + n)
    h = torch.randn(b, n, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.randn(b, n, v, generator=gen, dtype=torch.float64) * 2
    ce, pred = ttt.linear_soft_cross_entropy(h, w, p, chunk=chunk)
    want, want_pred = _plain(h, w, p)
    torch.testing.assert_close(ce, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(pred, want_pred)
    g = torch.autograd.grad(ce, (h, w))
    g_want = torch.autograd.grad(want, (h, w))
    for x, y in zip(g, g_want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("b,n,hd,v,chunk", [(2, 7, 8, 37, 3), (3, 5, 6, 101, None)])
def test_weighted_linear_soft_cross_entropy_is_the_weighted_mean(b, n, hd, v, chunk):
    """weight [B, n]: sum_r w_r CE_r / sum_r w_r, values and gradients in fp64; all-zero weights give 0 with
    zero gradients (not NaN); a wrong weight shape is a ValueError naming `weight`."""
    gen = torch.Generator().manual_seed(b * 10 + n)
    h = torch.randn(b, n, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.randn(b, n, v, generator=gen, dtype=torch.float64) * 2
    weight = (torch.rand(b, n, generator=gen, dtype=torch.float64) > 0.4).double()
    weight[0, 0] = 1.0
    ce, pred = ttt.linear_soft_cross_entropy(h, w, p, weight=weight, chunk=chunk)
    q = F.linear(h, w)
    rows = -(p.softmax(-1) * q.log_softmax(-1)).sum(-1)
    want = (rows * weight).sum() / weight.sum()
    torch.testing.assert_close(ce, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(pred, q.argmax(-1))
    for x, y in zip(torch.autograd.grad(ce, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    zero, _ = ttt.linear_soft_cross_entropy(h, w, p, weight=torch.zeros(b, n, dtype=torch.float64))
    gz = torch.autograd.grad(zero, (h, w))
    assert float(zero.detach()) == 0.0 and all(float(g.abs().max()) == 0.0 for g in gz)
    with pytest.raises(ValueError, match="weight"):
        ttt.linear_soft_cross_entropy(h, w, p, weight=torch.ones(b, n + 1))


def test_keeps_only_its_inputs_and_skips_frozen_weight_gradients():
    """Saved for backward: h, w and p_logits themselves — no [B, n, V] logits or probabilities. A frozen w
    (EAGLE-1 / MTP share the target's lm_head) gets no gradient computed."""
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 6, 8, generator=gen, requires_grad=True)
    w = torch.randn(40, 8, generator=gen)
    p = torch.randn(2, 6, 40, generator=gen)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ce, _ = ttt.linear_soft_cross_entropy(h, w, p, chunk=2)
    ptrs = {t.data_ptr() for t in saved}
    assert ptrs == {h.data_ptr(), w.data_ptr(), p.data_ptr()}
    (gh,) = torch.autograd.grad(ce, (h,))
    assert gh.shape == h.shape and torch.isfinite(gh).all()


def test_under_autocast_the_matmuls_run_in_bf16_in_both_passes():
    """Under bf16 autocast the loss and gradients stay within bf16 rounding of fp32, as F.linear would."""
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, requires_grad=True)
    p = torch.randn(2, 5, 50, generator=gen)
    want, _ = _plain(h, w, p)
    g_want = torch.autograd.grad(want, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _ = ttt.linear_soft_cross_entropy(h, w, p, chunk=2)
        g = torch.autograd.grad(ce, (h, w))
    assert ce.dtype == torch.float32 and g[0].dtype == h.dtype and g[1].dtype == w.dtype
    torch.testing.assert_close(ce, want, rtol=3e-2, atol=3e-2)
    for x, y in zip(g, g_want):
        torch.testing.assert_close(x, y, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("kind,feed", [("eagle3", "prediction"), ("eagle", "data"), ("mtp", "prediction")])
def test_ttt_loss_equals_the_unfused_formulation(kind, feed):
    """The whole loss, per-step losses, agreement and gradients equal the formulation that materialises each
    step's logits from `unroll` (fp64)."""
    target = tiny_target()
    draft = tiny_draft(target, kind=kind)
    to64 = lambda t: t.double() if t.is_floating_point() else t  # noqa: E731
    params = fspec.tree.tree_map(to64, draft.params)
    batch = {k: to64(v) for k, v in batch_for(target, draft, b=2, s=9).items()}
    trainable, frozen = ttt.split_params(params, draft.shared, dtype=torch.float64)
    k, w = 4, 0.8

    def unfused(tr):
        logits, _ = ttt.unroll(ttt.merge_params(tr, frozen), batch, cfg=draft.cfg, ttt_steps=k, feed=feed)
        s = batch["input_ids"].shape[1]
        terms, agree = [], []
        for j, q in enumerate(logits):
            n = s - 1 - j
            p_j, q_j = batch["target_logits"][:, j + 1 :], q[:, :n]
            terms.append(-(p_j.softmax(-1) * q_j.log_softmax(-1)).sum(-1).mean())
            agree.append((q_j.argmax(-1) == p_j.argmax(-1)).double().mean())
        return sum(w**j * t for j, t in enumerate(terms)), torch.stack(terms), torch.stack(agree)

    loss, m = ttt.ttt_loss(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=k, step_weight=w, feed=feed)
    want, want_steps, want_agree = unfused(trainable)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m["loss"], want_steps, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m["agreement"].double(), want_agree)
    g = torch.func.grad(lambda tr: ttt.ttt_loss(tr, frozen, batch, cfg=draft.cfg, ttt_steps=k, feed=feed)[0])
    g_want = torch.func.grad(lambda tr: unfused(tr)[0])
    for x, y in zip(fspec.tree.tree_leaves(g(trainable)), fspec.tree.tree_leaves(g_want(trainable))):
        torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-10)


def test_bad_inputs_name_the_argument():
    h, w, p = torch.zeros(2, 3, 4), torch.zeros(7, 4), torch.zeros(2, 3, 7)
    cases = [
        ((h[0], w, p), {}, r"^h: expected a float 3-d tensor, got \(3, 4\)"),
        ((h, w.long(), p), {}, "^w: expected a float 2-d tensor"),
        ((h, w, p[:, :2]), {}, r"^w: expected h \[B, n, H\], w \[V, H\], p_logits \[B, n, V\] with matching"),
        ((h, w[:, :3], p), {}, "^w: expected h"),
        ((h, w, p), {"chunk": 0}, "^chunk: expected a positive int or None, got 0"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            ttt.linear_soft_cross_entropy(*args, **kw)


def test_the_fused_cross_entropy_backward_is_once_differentiable():
    """Its chunked backward records no graph of its own ops (`once_differentiable`; under `torch.func.grad`
    it would otherwise keep every chunk's [B, c, V] temporaries until the backward ended): a second
    derivative is refused, not computed."""
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(2, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.randn(2, 6, 40, generator=gen, dtype=torch.float64)
    ce, _ = ttt.linear_soft_cross_entropy(h, w, p, chunk=2)
    (dh,) = torch.autograd.grad(ce, (h,), create_graph=True)
    with pytest.raises(RuntimeError):  # "does not require grad" or "not used in the graph"
        torch.autograd.grad(dh.sum(), (h,))
