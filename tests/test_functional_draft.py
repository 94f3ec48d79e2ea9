"""The dense KV cache: draft_step / propose as pure functions under torch.func (grad, vmap) and compile."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

import fspec

from draft_setup import MAX_LEN, leaves_snapshot, scenario, tiny_draft, tiny_target

TARGET = tiny_target()
KINDS = ("eagle", "eagle3", "mtp")
ATOL = 1e-5  # fp32: the dense masked softmax vs the paged reference's SDPA differ by a few ulps


def dense_from_paged(sc) -> fspec.DenseKVCache:
    """The scenario's paged cache rearranged into a dense one: request b's blocks in table order."""
    table = sc.state.attn.block_table.long().clamp(min=0)  # [B, M]

    def rows(buf: torch.Tensor) -> torch.Tensor:
        x = buf[:, table]  # [L, B, M, bs, Nkv, D]
        x = x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])  # [L, B, M·bs, Nkv, D]
        return x.permute(1, 0, 3, 2, 4).contiguous()  # [B, L, Nkv, S, D]

    return fspec.DenseKVCache(k=rows(sc.cache.k), v=rows(sc.cache.v))


def make(kind: str, k: int, *, greedy: bool = False, seed: int = 0, temperature=(0.0, 1.0, 0.7)):
    draft = tiny_draft(TARGET, kind=kind, k=k, greedy=greedy)
    sc = scenario(draft, context_lens=[3, 6, 9], live=[1, k + 1, 2], temperature=list(temperature), seed=seed)
    return draft, sc


def stack(trees):
    return pytree.tree_map(lambda *xs: torch.stack(xs), *trees)


def unstack(tree, i):
    return pytree.tree_map(lambda x: x[i], tree)


def assert_states_close(got, want, atol=ATOL):
    assert torch.equal(got.draft_tokens, want.draft_tokens), (got.draft_tokens, want.draft_tokens)
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.step, want.step)
    torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=0, atol=atol)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=0, atol=atol)
    for a, b in zip(fspec.tree.tree_leaves(got.attn), fspec.tree.tree_leaves(want.attn)):
        assert torch.equal(a, b)


def split(params: dict) -> tuple[dict, dict]:
    """(float leaves, the rest): torch.func.grad differentiates the first."""
    float_keys = [k for k, v in params.items() if not isinstance(v, torch.Tensor) or v.is_floating_point()]
    return {k: params[k] for k in float_keys}, {k: v for k, v in params.items() if k not in float_keys}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_dense_and_paged_caches_give_the_same_states(kind, k):
    """propose and each draft_step over a DenseKVCache equal the paged ones: tokens exactly, fp32 to 1e-5."""
    draft, sc = make(kind, k, seed=k)
    dense = dense_from_paged(sc)
    before = leaves_snapshot(dense)
    got, new_dense = fspec.propose(draft.params, sc.state, dense, cfg=draft.cfg)
    want, _ = fspec.propose(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    assert_states_close(got, want)
    assert all(torch.equal(a, b) for a, b in zip(before, fspec.tree.tree_leaves(dense))), (
        "input cache changed"
    )
    assert new_dense is not dense and new_dense.k.shape == dense.k.shape
    # step by step
    _, sc = make(kind, k, seed=k)
    state_d, state_p, cache_d, cache_p = sc.state, sc.state, dense_from_paged(sc), sc.cache
    for _ in range(k):
        state_d, cache_d = fspec.draft_step(draft.params, state_d, cache_d, cfg=draft.cfg)
        state_p, cache_p = fspec.draft_step(draft.params, state_p, cache_p, cfg=draft.cfg)
        assert_states_close(state_d, state_p)


def test_greedy_drafts_over_the_dense_cache_equal_the_paged_ones():
    """greedy_drafts (no q stored): the same tokens and hidden states on both caches."""
    draft, sc = make("eagle3", 3, greedy=True)
    got, _ = fspec.propose(draft.params, sc.state, dense_from_paged(sc), cfg=draft.cfg)
    want, _ = fspec.propose(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    assert_states_close(got, want)


def test_dense_step_keeps_every_leaf_shape_dtype_and_device():
    """A dense decode step keeps the state's and the cache's leaves (no recompile between steps)."""
    draft, sc = make("mtp", 3)
    state, cache = fspec.draft_step(draft.params, sc.state, dense_from_paged(sc), cfg=draft.cfg)
    for _ in range(2):
        new, new_cache = fspec.draft_step(draft.params, state, cache, cfg=draft.cfg)
        for a, b in zip(fspec.tree.tree_leaves((new, new_cache)), fspec.tree.tree_leaves((state, cache))):
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
        state, cache = new, new_cache


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_of_propose_over_stacked_states_and_caches_equals_a_loop(kind):
    """vmap over a leading axis of (state, cache): three scenarios at once equal three calls."""
    k = 3
    scs = [make(kind, k, seed=s)[1] for s in range(3)]
    draft = tiny_draft(TARGET, kind=kind, k=k)
    states, caches = stack([s.state for s in scs]), stack([dense_from_paged(s) for s in scs])

    def run(state, cache):
        return fspec.propose(draft.params, state, cache, cfg=draft.cfg)

    got_states, got_caches = torch.func.vmap(run)(states, caches)
    for i, sc in enumerate(scs):
        want, want_cache = run(sc.state, dense_from_paged(sc))
        assert_states_close(unstack(got_states, i), want)
        torch.testing.assert_close(got_caches.k[i], want_cache.k, rtol=0, atol=ATOL)
    one, _ = torch.func.vmap(lambda s, c: fspec.draft_step(draft.params, s, c, cfg=draft.cfg))(states, caches)
    assert torch.equal(one.step, torch.ones(3, dtype=torch.int64))


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_over_an_ensemble_of_three_heads_equals_a_loop(kind):
    """vmap over stacked params (three heads of one kind, one state and cache) equals three calls."""
    k = 2
    heads = [tiny_draft(TARGET, kind=kind, k=k, seed=s) for s in (1, 2, 3)]
    _, sc = make(kind, k)
    cfg = heads[0].cfg
    dense = dense_from_paged(sc)

    def run(params):
        return fspec.propose(params, sc.state, dense, cfg=cfg)

    got, _ = torch.func.vmap(run)(stack([h.params for h in heads]))
    for i, h in enumerate(heads):
        assert_states_close(unstack(got, i), run(h.params)[0])


def _float64(draft, sc):
    params = pytree.tree_map(lambda x: x.double() if x.is_floating_point() else x, draft.params)
    state = dataclasses.replace(
        sc.state, hidden=sc.state.hidden.double(), draft_probs=sc.state.draft_probs.double()
    )
    cache = pytree.tree_map(lambda x: x.double(), dense_from_paged(sc))
    return params, state, cache


@pytest.mark.parametrize("kind", KINDS)
def test_grad_of_propose_equals_central_finite_differences_in_float64(kind):
    """torch.func.grad of a loss of propose's q and hidden w.r.t. the head's params equals central finite
    differences (float64, eps 1e-6) at random coordinates; sampled rows (T > 0) and a greedy row."""
    draft, sc = make(kind, 3, temperature=(0.0, 1.0, 0.7))
    params, state, cache = _float64(draft, sc)
    trainable, frozen = split(params)
    weights = torch.randn(
        state.draft_probs.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )

    def loss(tr):
        out, _ = fspec.propose({**frozen, **tr}, state, cache, cfg=draft.cfg)
        return (out.draft_probs * weights).sum() + 0.1 * out.hidden.sum()

    grads = torch.func.grad(loss)(trainable)
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for name in ("fc", "eh_proj", "layer", "layers", "norm", "final_norm"):
        if name not in trainable:
            continue
        leaves, spec = pytree.tree_flatten(trainable[name])
        gleaves = pytree.tree_leaves(grads[name])
        for li in torch.randperm(len(leaves), generator=gen)[:2].tolist():
            leaf = leaves[li]
            idx = torch.randint(leaf.numel(), (1,), generator=gen).item()

            def at(delta, leaf=leaf, li=li, idx=idx, leaves=leaves, spec=spec, name=name):
                x = leaf.detach().clone()
                x.view(-1)[idx] += delta
                new = leaves[:li] + [x] + leaves[li + 1 :]
                return loss({**trainable, name: pytree.tree_unflatten(new, spec)})

            eps = 1e-6
            fd = (at(eps) - at(-eps)) / (2 * eps)
            g = gleaves[li].reshape(-1)[idx]
            torch.testing.assert_close(g, fd, rtol=1e-5, atol=1e-7, msg=f"{name}[{li}][{idx}]")
            checked += 1
    assert checked >= 2
    total = sum(g.abs().sum() for g in pytree.tree_leaves(grads))
    assert total > 0, "no gradient reached the params"


def test_greedy_step_under_grad_flows_through_hidden_and_logits_not_argmax():
    """Greedy drafts: the hidden's grad w.r.t. the params is nonzero; the tokens equal the no-grad ones."""
    draft, sc = make("eagle3", 2, greedy=True)
    trainable, frozen = split(draft.params)
    dense = dense_from_paged(sc)

    def loss(tr):
        out, _ = fspec.propose({**frozen, **tr}, sc.state, dense, cfg=draft.cfg)
        return out.hidden.square().sum(), out.draft_tokens

    grads, tokens = torch.func.grad(loss, has_aux=True)(trainable)
    want, _ = fspec.propose(draft.params, sc.state, dense, cfg=draft.cfg)
    assert torch.equal(tokens, want.draft_tokens)
    # (eagle3 fc projects the target hidden before the first step: not part of draft_step)
    assert grads["layer"]["o"].abs().sum() > 0 and grads["layer"]["hidden_norm"].abs().sum() > 0
    # plain autograd too: q of a sampled draft requires grad
    draft, sc = make("mtp", 2)
    params = pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point()), draft.params)
    out, _ = fspec.propose(params, sc.state, dense_from_paged(sc), cfg=draft.cfg)
    assert out.draft_probs.requires_grad and out.hidden.requires_grad


def test_gumbel_sampling_is_differentiable_through_q_with_the_noise_fixed_by_the_seed():
    """Same seed, same tokens under grad_and_value; d(loss)/d(lm_head) of q at T = 1 matches finite
    differences; another seed draws other tokens."""
    draft, sc = make("eagle", 2, temperature=(1.0, 1.0, 1.0))
    params, state, cache = _float64(draft, sc)
    head = params["fc"]

    def loss(fc):
        out, _ = fspec.propose({**params, "fc": fc}, state, cache, cfg=draft.cfg)
        picked = out.draft_probs.gather(-1, out.draft_tokens[..., None]).squeeze(-1)  # q of each draft
        return picked.log().sum(), out.draft_tokens

    g, (value, tokens) = torch.func.grad_and_value(loss, has_aux=True)(head)
    _, tokens_again = loss(head)
    assert torch.equal(tokens, tokens_again), "the Gumbel noise must be a function of the state's seeds"
    eps, idx = 1e-6, (3, 5)
    plus, minus = head.clone(), head.clone()
    plus[idx] += eps
    minus[idx] -= eps
    fd = (loss(plus)[0] - loss(minus)[0]) / (2 * eps)
    torch.testing.assert_close(g[idx], fd, rtol=1e-5, atol=1e-7)
    other = dataclasses.replace(
        state, sampling=dataclasses.replace(state.sampling, seed=state.sampling.seed + 12345)
    )
    out, _ = fspec.propose(params, other, cache, cfg=draft.cfg)
    assert not torch.equal(out.draft_tokens, tokens), "another seed should draw other tokens (p < 1e-3)"


def test_compiled_dense_draft_step_equals_eager_without_graph_breaks():
    """torch.compile(fullgraph=True) of the dense draft_step and propose give the eager results."""
    draft, sc = make("eagle3", 2)
    dense = dense_from_paged(sc)
    step = torch.compile(
        lambda p, s, c: fspec.propose(p, s, c, cfg=draft.cfg), fullgraph=True, backend="aot_eager"
    )
    got, _ = step(draft.params, sc.state, dense)
    want, _ = fspec.propose(draft.params, sc.state, dense, cfg=draft.cfg)
    assert_states_close(got, want)


def test_prefill_with_a_dense_cache_then_propose_equals_the_paged_path():
    """fspec.prefill(cache="dense") returns a DenseKVCache; propose over it equals propose over the paged."""
    draft = tiny_draft(TARGET, kind="eagle3", k=3)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    pre_d = fspec.prefill(TARGET, draft, prompts, temperature=[0.0, 1.0], cache="dense")
    pre_p = fspec.prefill(TARGET, draft, prompts, temperature=[0.0, 1.0])
    assert isinstance(pre_d.draft_cache, fspec.DenseKVCache) and pre_d.draft_cache.batch_size == 2
    got, _ = fspec.propose(draft.params, pre_d.state, pre_d.draft_cache, cfg=pre_d.draft_cfg)
    want, _ = fspec.propose(draft.params, pre_p.state, pre_p.draft_cache, cfg=pre_p.draft_cfg)
    assert_states_close(got, want)


def test_dense_cache_errors_name_the_argument():
    """A dense cache of the wrong batch or too short for the rollout is refused with a ValueError."""
    draft, sc = make("mtp", 3)
    small = fspec.DenseKVCache.create(draft.cfg.model, batch_size=3, max_len=8)
    with pytest.raises(ValueError, match="cache: expected room"):
        fspec.propose(draft.params, sc.state, small, cfg=draft.cfg)
    wrong = fspec.DenseKVCache.create(draft.cfg.model, batch_size=2, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="cache: expected"):
        fspec.draft_step(draft.params, sc.state, wrong, cfg=draft.cfg)
    with pytest.raises(ValueError, match="batch_size"):
        fspec.DenseKVCache.create(draft.cfg.model, batch_size=0, max_len=8)


def test_filtered_sampling_over_the_dense_cache_equals_the_paged_one():
    """top_k / top_p / min_p requests: the dense path's reference sampler draws the paged kernels' tokens."""
    draft, sc = make("eagle", 3, seed=5)
    sampling = fspec.SamplingParams.create(
        3, temperature=[0.0, 1.0, 0.8], seed=[11, 12, 13], top_k=[0, 5, 0], top_p=[1.0, 1.0, 0.9], min_p=0.05
    )
    state = dataclasses.replace(sc.state, sampling=sampling)
    got, _ = fspec.propose(draft.params, state, dense_from_paged(sc), cfg=draft.cfg)
    want, _ = fspec.propose(draft.params, state, sc.cache, cfg=draft.cfg)
    assert_states_close(got, want)
