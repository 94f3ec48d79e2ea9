"""GPU tests (run on the H200 host; skipped without CUDA): kernels against their references, CPU/GPU token
agreement, compiled against eager, and CUDA-graph capture of the whole draft loop with nothing skipped."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fspec
from fspec.compile import compile_propose, pad_to_bucket
from fspec.kernels import gumbel, rejection

from draft_setup import scenario, tiny_draft, tiny_target
from engine_setup import aligned_pair

pytestmark = pytest.mark.gpu


def _logits(n: int, v: int, seed: int) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(("n", "v"), [(7, 401), (33, 32000), (5, 128256)])
def test_gumbel_kernel_on_gpu_agrees_with_the_cpu_reference_token_for_token(n, v):
    """Same fp32 logits, seeds and positions: the Triton kernel on the H200 picks the CPU reference's tokens
    (near-ties aside: at most one row in a hundred may differ) and writes the same probabilities."""
    logits = _logits(n, v, n)
    temp = torch.tensor([0.0, 1.0, 0.7] * n)[:n]
    seed = torch.arange(n, dtype=torch.int64) * 31 + 5
    pos = torch.arange(n, dtype=torch.int64) + 100
    out_t = torch.full((n, 3), -1, dtype=torch.int64)
    out_p = torch.zeros(n, 3, v)
    col = torch.tensor(1)
    want = gumbel.gumbel_sample_ref(logits, temp, seed, pos, salt=0)
    args = [x.cuda() for x in (logits, temp, seed, pos)]
    got_t, got_p = out_t.cuda(), out_p.cuda()
    got = fspec.gumbel_sample(*args, salt=0, out_tokens=got_t, out_probs=got_p, col=col.cuda())
    assert (got.cpu() != want).sum() <= max(1, n // 100)
    assert torch.equal(got_t[:, 1].cpu(), got.cpu()) and bool((got_t[:, [0, 2]] == -1).all())
    ref_p = torch.where(
        temp[:, None] > 0,
        torch.softmax(logits / temp.clamp(min=1e-6)[:, None], -1),
        torch.nn.functional.one_hot(want, v).float(),
    )
    torch.testing.assert_close(got_p[:, 1].cpu(), ref_p, rtol=1e-4, atol=1e-6)


def test_gumbel_kernel_on_gpu_treats_nan_and_inf_as_the_reference_does():
    """The GPU path masks NaN with max.f32 and reads full blocks without a mask: rows with NaN around and at
    the finite maximum, a NaN-only row but one token, +inf logits (decided greedily), an all -inf row but one
    token, in the last (partial) block too; greedy and sampled rows; tokens equal the CPU reference's. The op
    is called directly: the public function refuses +inf in eager calls, a compiled graph reaches the kernel
    without that check."""
    n, v = 8, 5000  # two 2048-token blocks and a partial one
    logits = _logits(n, v, 11)
    logits[0, ::7] = float("nan")
    logits[1, logits[1].argmax()] = float("nan")  # the largest finite logit becomes NaN
    logits[2] = float("nan")
    logits[2, 4321] = -3.0  # in the partial block
    logits[3, 100] = float("inf")
    logits[4] = float("-inf")
    logits[4, 4999] = 0.0
    logits[5, 2048:] = float("nan")
    logits[6, 4990] = 1e30  # with T = 0.5 overflows to +inf: decided greedily
    logits[7, ::3] = float("nan")
    temp = torch.tensor([1.0, 0.0, 1.0, 0.7, 1.0, 1.3, 0.5, 0.0])
    seed = torch.arange(n, dtype=torch.int64) * 7 + 1
    pos = torch.arange(n, dtype=torch.int64) + 50
    want = gumbel.gumbel_sample_ref(logits, temp, seed, pos, salt=0)
    got = torch.ops.fspec.gumbel_sample(*(x.cuda() for x in (logits, temp, seed, pos)), 0)
    assert got.cpu().tolist() == want.tolist()
    assert want[2] == 4321 and want[3] == 100 and want[4] == 4999 and want[6] == 4990


def test_rejection_kernel_on_gpu_agrees_with_the_cpu_reference():
    """B = 64, K = 5, V = 32000, sampled drafts, mixed greedy and sampled targets: tokens and counts agree."""
    b, k, v = 64, 5, 32000
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(b, k + 1, v, generator=gen) * 2
    q = torch.softmax(torch.randn(b, k, v, generator=gen) * 2, -1)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k)
    temp = torch.tensor([0.0, 1.0] * (b // 2))
    seed = torch.arange(b, dtype=torch.int64)
    pos = torch.arange(b, dtype=torch.int64) * 3
    want_t, want_n = rejection.rejection_sample_ref(target_logits, drafts, q, temp, seed, pos)
    got_t, got_n = fspec.rejection_sample(*(x.cuda() for x in (target_logits, drafts, q, temp, seed, pos)))
    assert (got_n.cpu() != want_n).sum() <= 1
    rows = got_n.cpu() == want_n
    assert torch.equal(got_t.cpu()[rows], want_t[rows])


def test_whole_draft_loop_is_one_cuda_graph_equal_to_eager():
    """compile_propose on CUDA with cudagraph_or_error: no graph skipped, one graph for the bucket, replays on
    a second batch of the same bucket without recompiling, tokens equal to eager."""
    torch._inductor.config.triton.cudagraph_or_error = True
    target = tiny_target()
    draft = tiny_draft(target, kind="eagle3", k=4)
    to_cuda = lambda tree: fspec.tree.tree_map(lambda x: x.cuda(), tree)  # noqa: E731
    params = {k: v for k, v in draft.params.items()}
    params = fspec.tree.tree_map(lambda p: torch.nn.Parameter(p.detach().cuda(), requires_grad=False), params)
    torch._dynamo.reset()
    counters.clear()
    fn = compile_propose(cfg=draft.cfg)
    for seed in (1, 2):
        sc = scenario(draft, context_lens=[3, 9, 14], live=[2, 5, 1], temperature=[0.0, 1.0, 0.7], seed=seed)
        state, _ = pad_to_bucket(sc.state, cfg=draft.cfg)
        state = to_cuda(state)
        cache = fspec.KVCache(k=sc.cache.k.cuda(), v=sc.cache.v.cuda())
        eager_cache = fspec.KVCache(k=cache.k.clone(), v=cache.v.clone())
        want, _ = fspec.propose(params, state, eager_cache, cfg=draft.cfg)
        got, _ = fn(params, state, cache)
        assert torch.equal(got.draft_tokens[:3].cpu(), want.draft_tokens[:3].cpu())
        torch.testing.assert_close(got.draft_probs[:3], want.draft_probs[:3], rtol=1e-3, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._inductor.config.triton.cudagraph_or_error = False


def test_own_cuda_graph_loop_equals_eager_with_one_capture_per_layout():
    """compile_propose(mode="cuda-graph"): one capture for two batches of one bucket in one cache (the
    second replays with the new batch's values: a stale staged input would give the first batch's tokens),
    tokens, q and the cache writes equal to eager; parameters at new addresses are a new layout, so a second
    capture, still equal to eager."""
    target = tiny_target()
    draft = tiny_draft(target, kind="eagle3", k=4)
    to_cuda = lambda tree: fspec.tree.tree_map(lambda x: x.cuda(), tree)  # noqa: E731
    as_params = lambda tree: fspec.tree.tree_map(  # noqa: E731
        lambda p: torch.nn.Parameter(p.detach().cuda().clone(), requires_grad=False), tree
    )
    params = as_params(draft.params)
    torch._dynamo.reset()
    fn = compile_propose(cfg=draft.cfg, mode="cuda-graph")
    cache, seen = None, []
    for seed, ps, counts in ((1, params, (1, 1)), (2, params, (1, 2)), (3, as_params(draft.params), (2, 3))):
        sc = scenario(draft, context_lens=[3, 9, 14], live=[2, 5, 1], temperature=[0.0, 1.0, 0.7], seed=seed)
        state = to_cuda(pad_to_bucket(sc.state, cfg=draft.cfg)[0])
        if cache is None:  # one cache for every call: its tensors keep their addresses
            cache = fspec.KVCache(k=sc.cache.k.cuda(), v=sc.cache.v.cuda())
        cache.k.copy_(sc.cache.k)
        cache.v.copy_(sc.cache.v)
        eager_cache = fspec.KVCache(k=cache.k.clone(), v=cache.v.clone())
        want, _ = fspec.propose(ps, state, eager_cache, cfg=draft.cfg)
        got, got_cache = fn(ps, state, cache)
        assert (fn.graphs.captures, fn.graphs.replays) == counts
        assert torch.equal(got.draft_tokens[:3].cpu(), want.draft_tokens[:3].cpu())
        torch.testing.assert_close(got.draft_probs[:3], want.draft_probs[:3], rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(got_cache.k, eager_cache.k, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(got_cache.v, eager_cache.v, rtol=1e-3, atol=1e-5)
        assert (
            got.sampling.temperature is state.sampling.temperature
        )  # the caller's tensor, not the staged copy
        seen.append(got.draft_tokens[:3].cpu())
    assert not torch.equal(seen[0], seen[1])


def test_graph_capture_given_keys_replay_their_own_layouts_in_any_order():
    """`GraphCapture` with caller-given keys: the same key object again replays without a new capture (the
    shortcut past the layout hash), another layout under its own key captures its own graph, and going back
    to the first key (no longer the last) replays the first graph with the new values written in place."""
    from fspec.compile.graph_capture import GraphCapture

    fn = GraphCapture(lambda x, y: (x * 2 + y,))
    a, b = torch.ones(3, device="cuda"), torch.ones(3, device="cuda")
    c, d = torch.ones(5, device="cuda"), torch.ones(5, device="cuda")
    key_ab, key_cd = GraphCapture.layout_key((a, b)), GraphCapture.layout_key((c, d))
    for value, args, key, counts in (
        (1.0, (a, b), key_ab, (1, 1)),
        (2.0, (a, b), key_ab, (1, 2)),
        (3.0, (c, d), key_cd, (2, 3)),
        (4.0, (a, b), key_ab, (2, 4)),
        (5.0, (a, b), None, (2, 5)),  # no key: the layout's own, equal to key_ab
    ):
        args[0].fill_(value)
        (out,) = fn(*args, key=key)
        assert (fn.captures, fn.replays) == counts
        assert torch.equal(out.cpu(), torch.full((args[0].numel(),), 2 * value + 1))


def test_rope_frequencies_kept_by_a_graphs_first_call_are_not_graph_pool_allocations():
    """A reduce-overhead graph whose first (warm-up) call misses the inverse-frequency cache of
    `fspec::rope_tables`: the kept tensor must not come from the graph's private pool (CUDA-graph trees
    refuse an untracked allocation there, as torch 2.11 did in the draft benchmark); replays give the
    reference's tables, and the kept frequencies are the ones computed on the device."""
    from fspec.kernels import rope_cos_sin as rcs
    from fspec.models import layers as L

    cfg = tiny_target().cfg
    rcs._INV_FREQ.clear()
    torch._dynamo.reset()
    tables = torch.compile(
        lambda p: L.rope_cos_sin(p, cfg=cfg, dtype=torch.float32), mode="reduce-overhead", fullgraph=True
    )
    for step in range(4):  # warm-up, capture, replays
        positions = torch.arange(5, device="cuda") + 100 * step
        torch.compiler.cudagraph_mark_step_begin()
        cos, sin = tables(positions)
        want = rcs.rope_cos_sin_ref(positions, L.rope_inv_freq(cfg, "cuda"), torch.float32)
        for got, w in zip((cos, sin), want):  # positions < 400: a few float32 ulps of cos / sin
            torch.testing.assert_close(got, w, rtol=0, atol=1e-4)
    kept = rcs._INV_FREQ[(L.rope_key(cfg), "cuda:0")]
    assert torch.equal(kept, L.rope_inv_freq(cfg, "cuda"))


def _on_cuda(target, draft):
    """The same models with every weight on the GPU; the head keeps sharing the target's embedding/lm_head."""
    cuda = lambda p: torch.nn.Parameter(p.detach().cuda(), requires_grad=False)  # noqa: E731
    t_params = fspec.tree.tree_map(cuda, target.params)
    d_params = {}
    for name, value in draft.params.items():
        if name in ("embed", "lm_head") and name in draft.shared:
            d_params[name] = t_params[name]
        else:
            d_params[name] = fspec.tree.tree_map(cuda, value)
    return fspec.Target(cfg=target.cfg, params=t_params), fspec.Draft(
        cfg=draft.cfg, params=d_params, shared=draft.shared
    )


def test_compiled_generate_on_gpu_equals_eager_greedy():
    """fspec.generate(compile=True) on CUDA produces the eager CPU run's greedy tokens."""
    target, draft = aligned_pair(k=4)
    want = fspec.generate(target, draft, [[1, 2, 3], [5, 6]], max_new_tokens=16, num_speculative_steps=4)
    t2, d2 = _on_cuda(target, draft)
    got = fspec.generate(
        t2, d2, [[1, 2, 3], [5, 6]], max_new_tokens=16, num_speculative_steps=4, compile=True
    )
    assert got.tokens == want.tokens


@pytest.mark.parametrize("speculative", [True, False])
def test_compiled_rounds_replay_their_own_graphs_captured_once_per_layout(speculative):
    """On CUDA a compiled `generate` replays its rounds from fspec's own graphs (`GraphCapture`): sampled and
    greedy tokens equal the eager run's, a second call of the same shapes captures nothing new, and the
    capture's warm-up calls leave the target-only round's in-place position and token as they were (the
    tokens would shift otherwise)."""
    from fspec.serve.rounds import compiled_decode_round, compiled_spec_round

    target, draft = _on_cuda(*aligned_pair(k=4))
    draft = draft if speculative else None
    prompts = [[1, 2, 3], [5, 6], [7]]
    kw = dict(max_new_tokens=20, temperature=[0.0, 0.9, 0.0], seed=[1, 2, 3])
    if speculative:
        kw["num_speculative_steps"] = 4
    want = fspec.generate(target, draft, prompts, **kw).tokens
    gen = fspec.Generator()
    assert gen.generate(target, draft, prompts, compile=True, **kw).tokens == want
    kinds = (compiled_spec_round, compiled_decode_round)
    rounds = [g for k, g in gen.resources.graphs.items() if k[0] in kinds]  # not the prefill chunks
    assert len(rounds) == 1 and rounds[0].captures == 1
    replays = rounds[0].replays
    assert gen.generate(target, draft, prompts, compile=True, **kw).tokens == want
    assert rounds[0].captures == 1 and rounds[0].replays > replays


@pytest.mark.parametrize("speculative", [True, False])
def test_same_seeds_give_the_same_tokens_on_gpu_across_runs_and_batch_compositions(speculative):
    """On the H200, as on the CPU (tests/test_reliability.py): a request's tokens depend on its prompt,
    temperature and seed only: the same in a repeated run, in a reversed batch, alone, and among strangers
    (another batch bucket), sampled and greedy requests mixed."""
    from test_reliability import _engine_models, assert_tokens_depend_on_the_request_only

    target, draft, _ = _engine_models()
    target, draft = _on_cuda(target, draft)
    assert_tokens_depend_on_the_request_only(target, draft if speculative else None)


def test_draft_loop_with_and_without_pdl_gives_identical_results(monkeypatch):
    """Programmatic dependent launch changes when kernels start, never what they compute: an eager propose
    (paged attention, RoPE + cache write, step metadata and the Gumbel kernels, each launched back to back
    after the kernel it reads from) gives bit-identical tokens, probabilities and cache with PDL (the
    default on an H200) and without it (the launches of a device before Hopper: `_hopper_or_later` says
    no)."""
    from fspec.kernels import pdl

    target = tiny_target()
    draft = tiny_draft(target, kind="eagle3", k=5)
    params = fspec.tree.tree_map(lambda p: p.detach().cuda(), draft.params)
    sc = scenario(draft, context_lens=[3, 9, 14], live=[2, 5, 1], temperature=[0.0, 1.0, 0.7], seed=4)
    state = fspec.tree.tree_map(lambda x: x.cuda(), sc.state)

    def run() -> tuple:
        cache = fspec.KVCache(k=sc.cache.k.cuda(), v=sc.cache.v.cuda())
        out, cache = fspec.propose(params, state, cache, cfg=draft.cfg)
        return out.draft_tokens, out.draft_probs, cache.k, cache.v

    with monkeypatch.context() as m:
        m.setattr(pdl, "_hopper_or_later", lambda device_index: False)
        assert not pdl.enabled(state.draft_tokens)
        without = run()
    assert pdl.enabled(state.draft_tokens) == (torch.cuda.get_device_capability()[0] >= 9)
    for off, on in zip(without, run()):
        assert torch.equal(off, on)
