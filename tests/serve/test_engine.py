"""fspec.generate: greedy speculation is exact, sampled speculation is lossless, bad requests are named."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

import fspec
from fspec.core.config import size_bucket
from fspec.serve.engine import Stats
from fspec.serve.runner import Run

from draft_setup import tiny_draft, tiny_target
from engine_setup import aligned_pair

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [20] * 9, list(range(30, 52))]


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculation_equals_target_only_greedy_decoding(k):
    """Token for token, with partial acceptance (τ strictly between 1 and K + 1)."""
    target, draft = aligned_pair(k=k)
    want = fspec.generate(target, None, PROMPTS, max_new_tokens=24)
    got = fspec.generate(target, draft, PROMPTS, max_new_tokens=24, num_speculative_steps=k)
    assert got.tokens == want.tokens
    assert all(len(t) == 24 for t in got.tokens)
    tau = got.stats["acceptance_length"]
    assert 1.2 < tau < k + 1 or (k == 1 and 1.2 < tau < 2), tau


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_greedy_speculation_is_exact_for_every_head_kind(kind):
    """Random EAGLE-3 (reduced vocabulary) and MTP heads change nothing in greedy output."""
    target = tiny_target()
    draft = tiny_draft(target, kind=kind, k=3)
    want = fspec.generate(target, None, PROMPTS, max_new_tokens=10)
    got = fspec.generate(target, draft, PROMPTS, max_new_tokens=10)
    assert got.tokens == want.tokens


def test_acceptance_stats_are_consistent():
    """τ = 1 + Σ_k P(draft k accepted); rates never increase with k; forwards = rounds + prefill."""
    target, draft = aligned_pair(k=5)
    res = fspec.generate(target, draft, PROMPTS, max_new_tokens=30, num_speculative_steps=5)
    s = res.stats
    rates = s["acceptance_rate_per_position"]
    assert len(rates) == 5 and all(a >= b for a, b in zip(rates, rates[1:]))
    assert s["acceptance_length"] == pytest.approx(1 + sum(rates))
    assert s["target_forwards"] == s["rounds"] + 1
    assert s["new_tokens"] == sum(map(len, res.tokens)) == 4 * 30 + (48 - 22) and s["tokens_per_second"] > 0
    cond = s["conditional_acceptance_per_position"]
    assert cond[0] == pytest.approx(rates[0]) and cond[1] == pytest.approx(rates[1] / rates[0])


def _marginals(results: list[list[int]], position: int, vocab: int) -> np.ndarray:
    return np.bincount([r[position] for r in results], minlength=vocab)


def _chi2_p(a: np.ndarray, b: np.ndarray) -> float:
    keep = (a + b) >= 10  # pool rare tokens: the chi-square approximation needs expected counts >= 5
    table = np.stack([np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


def test_sampled_speculation_is_lossless_chi_square():
    """Marginals of generated tokens at positions 1..5 match target-only sampling (two-sample chi-square).

    1024 requests each; every p-value must exceed 1e-3 (Bonferroni over 5 positions: family-wise false alarm
    < 0.5%). Power: the same test tells temperature 1.0 from 1.5 of target-only sampling at p < 1e-6.
    """
    target, draft = aligned_pair(k=4, head_noise=0.08)
    n, new = 1024, 6
    prompts = [[5, 17, 33]] * n
    spec = fspec.generate(
        target,
        draft,
        prompts,
        max_new_tokens=new,
        temperature=1.0,
        seed=list(range(n)),
        num_speculative_steps=4,
    )
    base = fspec.generate(
        target, None, prompts, max_new_tokens=new, temperature=1.0, seed=list(range(n, 2 * n))
    )
    assert 1.3 < spec.stats["acceptance_length"] < 4.5, spec.stats  # rejections and acceptances both occur
    v = target.cfg.vocab_size
    for pos in range(1, new):
        p = _chi2_p(_marginals(spec.tokens, pos, v), _marginals(base.tokens, pos, v))
        assert p > 1e-3, f"position {pos}: speculative and target-only marginals differ (p = {p:.2e})"
    hot = fspec.generate(
        target, None, prompts, max_new_tokens=3, temperature=1.5, seed=list(range(2 * n, 3 * n))
    )
    assert _chi2_p(_marginals(hot.tokens, 2, v), _marginals(base.tokens, 2, v)) < 1e-6


def test_same_seed_reproduces_and_batch_composition_does_not_matter():
    """A request's sampled tokens depend on its seed only, not on its neighbours or its row."""
    target, draft = aligned_pair(k=3)
    a = fspec.generate(target, draft, PROMPTS, max_new_tokens=12, temperature=0.9, seed=[1, 2, 3, 4, 5])
    b = fspec.generate(target, draft, PROMPTS[::-1], max_new_tokens=12, temperature=0.9, seed=[5, 4, 3, 2, 1])
    c = fspec.generate(target, draft, [PROMPTS[2]], max_new_tokens=12, temperature=0.9, seed=3)
    assert a.tokens == b.tokens[::-1]
    assert c.tokens[0] == a.tokens[2]


def test_requests_stop_at_eos_and_at_max_model_len():
    """EOS ends a request (EOS included); a request near max_model_len stops before writing past it."""
    target, draft = aligned_pair(k=3)
    free = fspec.generate(target, draft, PROMPTS, max_new_tokens=16)
    eos = free.tokens[1][5]
    cfg = dataclasses.replace(target.cfg, eos_token_ids=(eos,))
    t2 = dataclasses.replace(target, cfg=cfg)
    got = fspec.generate(t2, draft, PROMPTS, max_new_tokens=16)
    for toks, full in zip(got.tokens, free.tokens):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert toks == full[:cut]
    long_prompt = [list(range(44)), list(range(47))]  # max_model_len 48
    want = fspec.generate(target, None, long_prompt, max_new_tokens=30)
    res = fspec.generate(target, draft, long_prompt, max_new_tokens=30)
    assert [len(t) for t in res.tokens] == [4, 1] and res.tokens == want.tokens


def test_blocks_are_freed_when_requests_finish():
    """After a run with requests of different lengths every block is back in the allocator."""
    target, draft = aligned_pair(k=3)
    from fspec.serve.engine import Stats

    run = Run(
        target,
        draft,
        PROMPTS,
        dict(temperature=[0.0] * 5, seed=[0] * 5),
        max_new_tokens=9,
        compile=False,
        stats=Stats(3),
        progress=False,
    )
    total = run.alloc.num_free
    run.go()
    assert run.alloc.num_free == total and all(not b for b in run.blocks)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompts": [[]]}, r"prompts\[0\]: expected at least one token"),
        ({"prompts": [[1, 97]]}, r"prompts\[0\]: expected token ids in \[0, 97\)"),
        ({"prompts": [list(range(48))]}, r"prompts\[0\]: expected at most 47 tokens"),
        ({"prompts": ["text"]}, r"prompts\[0\]: expected token ids \(the target has no tokenizer\)"),
        ({"prompts": []}, "prompts: expected a non-empty list"),
        ({"temperature": -0.5}, r"temperature\[0\]: expected a finite value >= 0"),
        ({"temperature": float("nan")}, r"temperature\[0\]: expected a finite value >= 0"),
        ({"temperature": [0.0, 1.0]}, "temperature: expected one value or 1"),
        ({"seed": [1, 2]}, "seed: expected one value or 1"),
        ({"seed": 1.5}, r"seed\[0\]: expected an int, got 1.5"),
        ({"max_new_tokens": 0}, "max_new_tokens: expected a positive int"),
        ({"num_speculative_steps": 0}, r"num_speculative_steps: expected an int in \[1, 16\]"),
        ({"top_k": -1}, r"top_k\[0\]: expected an int >= 0"),
        ({"top_k": 2.0}, r"top_k\[0\]: expected an int, got 2.0"),
        ({"top_k": True}, r"top_k\[0\]: expected an int, got True"),
        ({"top_p": 0.0}, r"top_p\[0\]: expected a value in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p\[0\]: expected a value in \(0, 1\]"),
        ({"top_p": float("nan")}, r"top_p\[0\]: expected a value in \(0, 1\]"),
        ({"min_p": 1.0}, r"min_p\[0\]: expected a value in \[0, 1\)"),
        ({"min_p": [0.1, 0.2]}, "min_p: expected one value or 1"),
    ],
)
def test_bad_requests_raise_value_errors_naming_the_argument(kwargs, match):
    target, draft = aligned_pair(k=3)
    args = {"prompts": [[1, 2]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        fspec.generate(target, draft, args.pop("prompts"), **args)


# slow: 256 and 1024 requests compiled (17 s, 67 s on a cold Inductor cache). In the default run, compiled
# greedy output equals target-only greedy
# (test_compiled_generate_reuses_its_graphs_across_calls_of_one_bucket), compiled sampled output equals the
# eager engine's (test_compiled_generate_with_the_prefill_graph), and the eager engine's sampled marginals
# pass the chi-square test (test_sampled_speculation_is_lossless_chi_square).
@pytest.mark.slow
def test_compiled_generate_is_exact_when_greedy_and_lossless_when_sampled():
    """compile=True (whole draft loop and verification forward as compiled graphs, bucket 256): greedy output
    equals target-only greedy; sampled marginals pass the chi-square test above (p > 1e-3 each)."""
    target, draft = aligned_pair(k=4, head_noise=0.08)
    prompts = (PROMPTS * 52)[:256]
    want = fspec.generate(target, None, prompts, max_new_tokens=10)
    got = fspec.generate(target, draft, prompts, max_new_tokens=10, num_speculative_steps=4, compile=True)
    assert got.tokens == want.tokens
    n, new = 1024, 5
    same = [[5, 17, 33]] * n
    spec = fspec.generate(
        target,
        draft,
        same,
        max_new_tokens=new,
        temperature=1.0,
        seed=list(range(n)),
        num_speculative_steps=4,
        compile=True,
    )
    base = fspec.generate(target, None, same, max_new_tokens=new, temperature=1.0, seed=list(range(n, 2 * n)))
    v = target.cfg.vocab_size
    for pos in range(1, new):
        p = _chi2_p(_marginals(spec.tokens, pos, v), _marginals(base.tokens, pos, v))
        assert p > 1e-3, f"position {pos}: compiled speculative marginals differ (p = {p:.2e})"


@pytest.mark.parametrize("sizes", [(4,), (3, 8), (64,)])
def test_chunked_prefill_equals_whole_prompt_prefill(monkeypatch, sizes):
    """The CUDA engine's prefill in chunks (`PrefillChunk`: each chunk attends to the earlier ones in the
    cache, the head pairs a chunk's last hidden with the next chunk's first token, the first token and drafts
    come from the chunk that ends each prompt) run here on the CPU with tiny chunk lengths: the same tokens
    as whole-prompt prefill, greedy and sampled, for ragged prompts of 1 to 23 tokens and a padding row."""
    from fspec.serve import runner
    from fspec.serve.engine import Stats
    from fspec.serve.rounds import prefill_chunk_round

    monkeypatch.setattr(runner, "chunk_sizes", lambda group: sizes)
    # compiled calls replay the chunk from a CUDA graph; here the same static buffers feed the eager function
    uncaptured = lambda tcfg, dcfg, bs: functools.partial(
        prefill_chunk_round, tcfg=tcfg, dcfg=dcfg, block_size=bs
    )
    monkeypatch.setattr(runner, "captured_prefill_chunk", uncaptured)
    target, draft = aligned_pair(k=3)
    prompts = [*PROMPTS, [7]]  # six requests: bucket 8
    opts = dict(temperature=[0.0, 0.9, 0.0, 1.2, 0.7, 1.0], seed=[3, 1, 4, 1, 5, 9])
    for head in (draft, None):
        runs = []
        modes = (
            ((False, False), (True, False), (True, True))
            if sizes == (3, 8)
            else ((False, False), (True, False))
        )
        for chunked, compile in modes:
            run = Run(target, head, prompts, opts, max_new_tokens=9, compile=compile,
                      stats=Stats(3 if head else 0), progress=False)  # fmt: skip
            run.chunked = chunked
            runs.append(run.go())
        assert all(r == runs[0] for r in runs[1:]), (head is None, sizes)
    # Tokens are lossless whatever the drafts: compare the first drafts, q and both caches themselves.
    first = []
    for chunked in (False, True):
        forwards = Stats(3)
        run = Run(target, draft, prompts, opts, max_new_tokens=2, compile=False, stats=forwards,
                  progress=False)  # fmt: skip
        run.chunked, run._keep = chunked, []
        drafts = run._admit(run._device_state())
        used = torch.tensor([blk for blocks in run.blocks for blk in blocks])
        first.append((*drafts, run.tcache.k[:, used], run.dcache.k[:, used], forwards.target_forwards))
    (tok0, q0, tk0, dk0, _), (tok1, q1, tk1, dk1, calls) = first
    assert torch.equal(tok1, tok0)
    for got, want in ((q1, q0), (tk1, tk0), (dk1, dk0)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == (1 if sizes == (64,) else -(-max(map(len, prompts)) // sizes[-1]))  # chunk calls


def test_compiled_calls_after_warmup_compile_nothing():
    """`Generator.warmup(max_batch=2, max_len=...)` compiles every round graph compiled calls of up to 2
    requests within max_len use; afterwards calls of 1 or 2 prompts of other lengths, greedy, sampled and
    sampled with top_k / top_p / min_p, speculative and target-only, compile nothing (dynamo's graph count),
    and give target-only greedy's tokens (greedy) and the eager engine's (sampled)."""
    from torch._dynamo.utils import counters

    target, draft = aligned_pair(k=3)
    gen = fspec.Generator(max_shapes=1)  # fewer kept shapes than the warm-up makes: its own are pinned
    torch._dynamo.reset()
    counters.clear()
    report = gen.warmup(target, draft, max_batch=2, max_len=40)
    assert report["calls"] == 2 * 3 and report["seconds"] > 0  # buckets 1, 2; greedy, sampled, filtered
    assert gen.warmup(target, None, max_batch=2, max_len=40)["calls"] == 2 * 3
    graphs = counters["stats"]["unique_graphs"]
    warmed = dict(gen.resources.buffers)
    assert len(warmed) >= 4 and set(warmed) == gen.resources.pinned
    assert graphs >= 4, dict(counters["stats"])
    rng = torch.Generator().manual_seed(0)
    for b, n, new in ((1, 3, 5), (2, 17, 9), (1, 30, 6), (2, 1, 9), (2, 11, 20)):
        prompts = [torch.randint(0, 97, (n + i,), generator=rng).tolist() for i in range(b)]
        want = fspec.generate(target, None, prompts, max_new_tokens=new).tokens
        for head in (draft, None):
            got = gen.generate(target, head, prompts, max_new_tokens=new, compile=True)
            assert got.tokens == want, (b, n, head is None)
        temps, seeds = [0.8] * b, list(range(b))
        sampled = gen.generate(target, draft, prompts, max_new_tokens=new, temperature=temps, seed=seeds,
                               compile=True)  # fmt: skip
        eager = fspec.generate(target, draft, prompts, max_new_tokens=new, temperature=temps, seed=seeds)
        assert sampled.tokens == eager.tokens
        opts = dict(temperature=temps, seed=seeds, top_k=[5, 0][:b], top_p=0.8, min_p=[0.0, 0.1][:b])
        for head in (draft, None):
            filtered = gen.generate(target, head, prompts, max_new_tokens=new, compile=True, **opts)
            assert filtered.tokens == fspec.generate(target, head, prompts, max_new_tokens=new, **opts).tokens
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert all(gen.resources.buffers[k] is v for k, v in warmed.items())  # nothing the graphs read moved
    for bad in (0, 300, 1.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            gen.warmup(target, draft, max_batch=bad)
    for bad in (1, 10**6, 2.0):
        with pytest.raises(ValueError, match="max_len"):
            gen.warmup(target, draft, max_len=bad)
    with pytest.raises(ValueError, match="target"):
        gen.warmup(None, draft)
    with pytest.raises(ValueError, match=r"filters: expected a bool, got 1"):
        gen.warmup(target, draft, filters=1)


@pytest.mark.parametrize("pipeline", [True, False])
def test_pipelined_and_synchronous_round_loops_agree_and_free_every_block(pipeline):
    """The engine's two loops (round r + 1 launched before round r is read, or not) emit the same tokens,
    sampled or greedy, and return every block to the allocator."""
    from fspec.serve.engine import Stats

    target, draft = aligned_pair(k=3)
    want = fspec.generate(
        target, draft, PROMPTS, max_new_tokens=14, temperature=[0.0, 0.8, 0.0, 1.0, 0.5], seed=[3, 1, 4, 1, 5]
    )
    run = Run(
        target,
        draft,
        PROMPTS,
        dict(temperature=[0.0, 0.8, 0.0, 1.0, 0.5], seed=[3, 1, 4, 1, 5]),
        max_new_tokens=14,
        compile=False,
        stats=Stats(3),
        progress=False,
    )
    run.pipeline = pipeline
    total = run.alloc.num_free
    assert run.go() == want.tokens
    assert run.alloc.num_free == total


def test_compiled_calls_share_one_cache_pool_that_only_grows():
    """size_bucket (KV-cache blocks, prompt lengths): never below n, at most 25% above it (16 floor),
    monotone, four sizes per power of two. Compiled runs of one generator share one cache pool (the graphs
    keep its address) while their needs fit, and a larger need replaces it with one of size_bucket(need)."""
    from fspec.serve.resources import Resources

    sizes = [size_bucket(n) for n in range(1, 5000)]
    assert all(s >= n and (n <= 16 or s <= 1.25 * n) for n, s in enumerate(sizes, 1))
    assert sizes == sorted(sizes) and len(set(sizes)) <= 4 * 9 + 1
    target, draft = aligned_pair(k=3)
    res = Resources()

    def run(max_new: int, copies: int = 1) -> Run:
        greedy = dict(temperature=[0.0] * 5 * copies, seed=[0] * 5 * copies)
        return Run(target, draft, PROMPTS * copies, greedy, max_new_tokens=max_new, compile=True,
                   stats=Stats(3), progress=False, resources=res)  # fmt: skip

    runs = [run(m) for m in (11, 4, 6, 9)]
    assert len({r.alloc.num_blocks for r in runs}) == 4  # four different needs ...
    assert len({id(r.tcache) for r in runs}) == 1  # ... one pool, made for the largest, first
    assert runs[0].tcache.num_blocks == size_bucket(runs[0].alloc.num_blocks)
    bigger = run(11, copies=3)
    assert bigger.tcache is not runs[0].tcache
    assert bigger.tcache.num_blocks == size_bucket(bigger.alloc.num_blocks)
    assert run(5).tcache is bigger.tcache


def test_compiled_generate_reuses_its_graphs_across_calls_of_one_bucket():
    """Two compiled calls, same batch bucket, different prompts and max_new_tokens (needs of 49 and 51 blocks:
    one cache bucket): the second compiles nothing (the round graph, and draft steps 2..K of the first
    proposal), and both equal eager greedy decoding."""
    from torch._dynamo.utils import counters

    target, draft = aligned_pair(k=3)
    other = [p[::-1] for p in PROMPTS]
    torch._dynamo.reset()
    counters.clear()
    first = fspec.generate(target, draft, PROMPTS, max_new_tokens=4, num_speculative_steps=3, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the round (off CUDA the prefill runs eagerly)
    second = fspec.generate(target, draft, other, max_new_tokens=6, num_speculative_steps=3, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert first.tokens == fspec.generate(target, None, PROMPTS, max_new_tokens=4).tokens
    assert second.tokens == fspec.generate(target, None, other, max_new_tokens=6).tokens


def test_a_generator_owns_what_compiled_calls_keep_and_the_default_one_serves_generate():
    """`fspec.Generator` holds the KV caches, static buffers and compiled rounds of its compiled calls: a
    second call of one bucket reuses the very cache and round function; a user's generator keeps its own,
    apart from the default one behind `fspec.generate`; `clear()` drops them; the tokens are the same."""
    target, draft = aligned_pair(k=3)
    kw = dict(max_new_tokens=4, num_speculative_steps=3, compile=True)
    default = fspec.default_generator()
    mine = fspec.Generator()
    assert mine is not default and not mine.resources.caches and not mine.resources.graphs
    before = (set(default.resources.caches), set(default.resources.graphs))
    first = mine.generate(target, draft, PROMPTS, **kw)
    caches, graphs = dict(mine.resources.caches), dict(mine.resources.graphs)
    assert len(caches) == 2 and graphs  # the target's and the head's cache; the round, the later drafts
    assert (set(default.resources.caches), set(default.resources.graphs)) == before  # untouched
    second = mine.generate(target, draft, [p[::-1] for p in PROMPTS], **kw)
    assert all(mine.resources.caches[k] is v for k, v in caches.items())  # the same buffers: graphs replay
    assert all(mine.resources.graphs[k] is v for k, v in graphs.items())
    assert first.tokens == fspec.generate(target, draft, PROMPTS, **kw).tokens  # through the default
    assert set(default.resources.graphs) >= set(graphs)
    assert second.tokens == fspec.generate(target, None, [p[::-1] for p in PROMPTS], max_new_tokens=4).tokens
    mine.clear()
    assert not mine.resources.caches and not mine.resources.buffers and not mine.resources.graphs
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_shapes"):
            fspec.Generator(max_shapes=bad)


def test_the_round_loop_queues_no_round_past_a_predictable_end():
    """The pipelined loop launches round r + 1 before reading round r, unless round r ends every request at
    full acceptance: target-only decoding runs one forward per new token (the prefill's included), and a
    head forced to full acceptance runs (n - 1) / (K + 1) rounds for n new tokens, none of them wasted."""
    target = tiny_target()
    res = fspec.generate(target, None, [[1, 2, 3]], max_new_tokens=9)
    assert len(res.tokens[0]) == 9 and res.stats["target_forwards"] == 9
    # Zero output heads: every logit ties, argmax is token 0 for target and head alike (no EOS configured).
    params = {**target.params, "lm_head": torch.zeros_like(target.params["lm_head"])}
    forced = fspec.Target(cfg=target.cfg, params=params)
    draft = tiny_draft(forced, kind="mtp", k=3)
    draft = dataclasses.replace(
        draft, params={**draft.params, "lm_head": torch.zeros_like(draft.params["lm_head"])}
    )
    res = fspec.generate(forced, draft, [[1, 2, 3], [4, 5]], max_new_tokens=13, num_speculative_steps=3)
    assert res.tokens == [[0] * 13, [0] * 13] and res.stats["acceptance_length"] == 4.0
    assert res.stats["target_forwards"] == 1 + 3


def test_compiled_target_only_decoding_equals_eager_and_keeps_its_graph_across_calls():
    """compile=True without a draft runs `decode_round` (the token, cur and n advanced in place in static
    buffers): tokens equal eager target-only decoding, greedy and sampled (the same Philox noise), and a
    second call of the bucket with other prompts, temperatures and seeds compiles nothing new."""
    from torch._dynamo.utils import counters

    target, _ = aligned_pair(k=3)
    other = [p[::-1] for p in PROMPTS]
    temps, seeds = [0.0, 0.8, 1.3, 0.0, 1.0], [3, 1, 4, 1, 5]
    torch._dynamo.reset()
    counters.clear()
    first = fspec.generate(target, None, PROMPTS, max_new_tokens=6, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    sampled = dict(max_new_tokens=9, temperature=temps, seed=seeds)
    second = fspec.generate(target, None, other, compile=True, **sampled)
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert first.tokens == fspec.generate(target, None, PROMPTS, max_new_tokens=6).tokens
    assert second.tokens == fspec.generate(target, None, other, **sampled).tokens
    greedy = fspec.generate(target, None, other, max_new_tokens=9).tokens
    assert second.tokens != greedy  # the sampled rows did sample


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_the_in_place_round_is_the_pure_round_plus_its_bookkeeping(greedy_drafts):
    """`spec_round_in_place` (what compiled runs replay) returns `spec_round`'s tokens and accepted counts as
    one [B, K + 2] record, and writes the next proposal over its draft inputs, the last emitted token into
    cur and n + accepted + 1 into n; for greedy drafts (no probabilities) and sampled ones alike."""
    from fspec.serve import rounds

    target, draft = aligned_pair(k=3)
    draft = dataclasses.replace(draft, cfg=dataclasses.replace(draft.cfg, greedy_drafts=greedy_drafts))
    opts = dict(temperature=[0.9, 0.0, 1.3, 0.7, 0.0], seed=[3, 1, 4, 1, 5])
    run = Run(target, draft, PROMPTS, opts, max_new_tokens=8, compile=False, stats=Stats(3), progress=False)
    run._keep = []
    drafts = run._admit(run._device_state())
    _, drafts = run._launch(drafts)  # one round first: blocks allocated, table and live flags on the device
    args = [target.params, draft.params, run.cur_d, run.n_d, run.live_d, run.table_d, *drafts, run.sampling]
    static = dict(tcfg=target.cfg, dcfg=draft.cfg, max_len=run.max_len)
    pure = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    tokens, accepted, next_tokens, next_probs = rounds.spec_round(*pure, run.tcache, run.dcache, **static)
    cur, n = run.cur_d.clone(), run.n_d.clone()
    record = rounds.spec_round_in_place(*args, run.tcache, run.dcache, **static)
    assert record.shape == (run.b, 3 + 2) and (accepted > 0).any()
    assert torch.equal(record, torch.cat([tokens, accepted[:, None]], 1))
    assert torch.equal(run.cur_d, tokens.gather(1, accepted[:, None]).squeeze(1))
    assert not torch.equal(run.cur_d, cur) and torch.equal(run.n_d, n + accepted + 1)
    assert torch.equal(drafts[0], next_tokens) and torch.equal(drafts[1], next_probs)
    assert drafts[1].shape[-1] == (0 if greedy_drafts else draft.cfg.draft_vocab_size)


def test_k_defaults_to_the_heads_recorded_k():
    """num_speculative_steps=None (the default) drafts the K the head's config records."""
    target, draft = aligned_pair(k=4)
    res = fspec.generate(target, draft, PROMPTS[:2], max_new_tokens=6)
    assert res.stats["num_speculative_steps"] == 4
    res = fspec.generate(target, draft, PROMPTS[:2], max_new_tokens=6, num_speculative_steps=2)
    assert res.stats["num_speculative_steps"] == 2
