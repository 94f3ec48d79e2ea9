"""generate's top_k / top_p / min_p: per request, mixed in a batch, and lossless under speculation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

import fspec
from fspec.kernels.sampling_filter import filter_logits_ref, sampling_filter_ref

from engine_setup import aligned_pair

# Four groups of requests in one batch, one setting each: the options mix freely per request.
GROUPS = [
    dict(top_k=3, top_p=1.0, min_p=0.0),
    dict(top_k=0, top_p=0.7, min_p=0.0),
    dict(top_k=0, top_p=1.0, min_p=0.2),
    dict(top_k=6, top_p=0.8, min_p=0.05),
]


def _batch(n_per_group: int, seed0: int):
    opts = {name: [g[name] for g in GROUPS for _ in range(n_per_group)] for name in GROUPS[0]}
    seeds = list(range(seed0, seed0 + n_per_group * len(GROUPS)))
    return opts, seeds


def _marginals(results, position, vocab):
    return np.bincount([r[position] for r in results], minlength=vocab)


def _chi2_p(a, b):
    keep = (a + b) >= 10  # pool rare tokens: the chi-square approximation needs expected counts >= 5
    table = np.stack([np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


def test_filtered_speculation_is_lossless_per_request_chi_square():
    """Each group's marginals at new positions 1..3 match target-only sampling with the same options
    (two-sample chi-square, 256 requests per group and engine; every p-value > 1e-4: Bonferroni over the
    12 tests keeps the family-wise false alarm under 0.2%). Power: the same test tells the top_p = 0.7
    group from unfiltered sampling at p < 1e-6."""
    target, draft = aligned_pair(k=4, head_noise=0.08)
    n, new = 256, 4
    prompts = [[5, 17, 33]] * (n * len(GROUPS))
    opts, seeds = _batch(n, 0)
    spec = fspec.generate(target, draft, prompts, max_new_tokens=new, temperature=1.0, seed=seeds, **opts)
    opts, seeds = _batch(n, 10**6)
    base = fspec.generate(target, None, prompts, max_new_tokens=new, temperature=1.0, seed=seeds, **opts)
    assert 1.3 < spec.stats["acceptance_length"] < 5, spec.stats  # rejections and acceptances both occur
    v = target.cfg.vocab_size
    for g in range(len(GROUPS)):
        rows = slice(g * n, (g + 1) * n)
        for pos in range(1, new):
            p = _chi2_p(_marginals(spec.tokens[rows], pos, v), _marginals(base.tokens[rows], pos, v))
            assert p > 1e-4, f"group {GROUPS[g]}, position {pos}: spec and target-only differ (p = {p:.2e})"
    free = fspec.generate(target, None, prompts[:n], max_new_tokens=3, temperature=1.0, seed=seeds[:n])
    assert _chi2_p(_marginals(free.tokens, 2, v), _marginals(base.tokens[n : 2 * n], 2, v)) < 1e-6


@pytest.mark.parametrize("draft_on", [False, True])
def test_every_first_token_lies_in_the_kept_set_of_its_request(draft_on):
    """The first new token of each request is one its own options keep (the reference filter on the
    prefill's logits), and a filter that keeps one token makes it certain."""
    target, draft = aligned_pair(k=3)
    opts, seeds = _batch(16, 7)
    prompts = [[5, 17, 33]] * len(seeds)
    res = fspec.generate(
        target, draft if draft_on else None, prompts, max_new_tokens=2, temperature=1.3, seed=seeds, **opts
    )
    pre = fspec.prefill(target, None, prompts, temperature=1.3, seed=seeds, **opts)
    temp = torch.full((len(seeds),), 1.3)
    thr, cut = sampling_filter_ref(
        pre.logits,
        temp,
        torch.tensor(opts["top_k"], dtype=torch.int32),
        torch.tensor(opts["top_p"]),
        torch.tensor(opts["min_p"]),
    )
    kept = filter_logits_ref(pre.logits, thr, cut) > float("-inf")
    for b, toks in enumerate(res.tokens):
        assert bool(kept[b, toks[0]]), (b, toks[0])
    assert pre.tokens.tolist() == [t[0] for t in res.tokens]


def test_top_k_one_is_greedy_token_for_token():
    """top_k = 1 at any temperature gives the greedy tokens, with and without a head."""
    target, draft = aligned_pair(k=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [20] * 9]
    want = fspec.generate(target, None, prompts, max_new_tokens=12)
    for d in (None, draft):
        got = fspec.generate(
            target, d, prompts, max_new_tokens=12, temperature=0.9, top_k=1, seed=[1, 2, 3, 4]
        )
        assert got.tokens == want.tokens


def test_a_greedy_request_s_filters_change_nothing_and_select_no_filtered_graph():
    """Greedy requests with top_k / top_p / min_p: the tokens of no filters (every filter keeps the argmax),
    with and without a head; their settings select the unfiltered samplers (`SamplingParams.filtered`
    False), so such calls share the greedy graphs; in a mixed batch the sampled row's filter still holds."""
    target, draft = aligned_pair(k=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [20] * 9]
    opts = dict(top_k=[2, 0, 1, 7], top_p=[1.0, 0.3, 0.9, 0.5], min_p=[0.0, 0.0, 0.4, 0.1])
    assert not fspec.SamplingParams.create(4, **opts).filtered
    for d in (None, draft):
        want = fspec.generate(target, d, prompts, max_new_tokens=12)
        assert fspec.generate(target, d, prompts, max_new_tokens=12, **opts).tokens == want.tokens
        mixed = fspec.generate(
            target, d, prompts, max_new_tokens=12, temperature=[0.0, 0.0, 5.0, 0.0], top_k=[3, 3, 1, 3]
        )
        assert mixed.tokens == want.tokens  # row 2 samples at temperature 5 but top_k = 1 keeps its argmax


def test_changing_the_options_of_a_compiled_call_compiles_nothing():
    """Two compiled sampled calls of one bucket with different temperatures, top_k, top_p and min_p per
    request: the second compiles no new graph (the kernels read the options from tensors) and each equals
    the eager engine's tokens for the same seeds."""
    from torch._dynamo.utils import counters

    target, draft = aligned_pair(k=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [11], [20] * 9]
    a = dict(temperature=[0.8, 1.0, 1.2, 0.5], top_p=0.9, seed=[1, 2, 3, 4])
    b = dict(
        temperature=[1.0, 0.6, 1.0, 1.5], top_k=[3, 0, 5, 1], min_p=[0.1, 0.0, 0.2, 0.0], seed=[5, 6, 7, 8]
    )
    torch._dynamo.reset()
    counters.clear()
    first = fspec.generate(target, draft, prompts, max_new_tokens=6, compile=True, **a)
    graphs = counters["stats"]["unique_graphs"]
    second = fspec.generate(target, draft, prompts, max_new_tokens=6, compile=True, **b)
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert first.tokens == fspec.generate(target, draft, prompts, max_new_tokens=6, **a).tokens
    assert second.tokens == fspec.generate(target, draft, prompts, max_new_tokens=6, **b).tokens
