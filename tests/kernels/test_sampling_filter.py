"""The top_k / top_p / min_p filter kernel (interpreted) against its sort-based reference and hand-worked
prefixes; the sampling and verification kernels with the options against their references; on the H200
(@pytest.mark.gpu) the same at V = 49152."""

import pytest
import torch

from fspec.kernels import ops as kops
from fspec.kernels.gumbel import gumbel_sample, gumbel_sample_ref
from fspec.kernels.rejection import rejection_sample, rejection_sample_ref
from fspec.kernels.sampling_filter import filter_logits_ref, sampling_filter, sampling_filter_ref

INF = float("inf")


def _options(n: int, v: int, gen: torch.Generator):
    """Per-row options cycling through the edge values: top_k in {0, 1, 2, V-1, V, V+5, a few}, top_p tiny,
    mid and 1.0, min_p 0, mid and near 1; temperatures with greedy rows among sampled ones."""
    top_k = torch.tensor([0, 1, 2, max(v - 1, 0), v, v + 5, 3, 0, 5, 0, 2], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.5, 1e-6, 1.0, 0.8, 1.0, 0.73, 1.0, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.999, 0.05, 0.0, 0.2, 0.0, 0.3, 0.0])
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 2.0, 0.5, 1.0, 0.0, 0.9, 1.1])
    idx = torch.randperm(11, generator=gen)[:n] if n <= 11 else torch.arange(n) % 11
    return temperature[idx], top_k[idx], top_p[idx], min_p[idx]


def _logits(n: int, v: int, gen: torch.Generator, dtype=torch.float32):
    """Random logits rounded to a coarse grid (ties everywhere, also at the boundaries), with a NaN row
    stretch, a row of -inf and NaN only, and a row with most tokens -inf."""
    x = torch.round(torch.randn(n, v, generator=gen) * 2) / 2
    if n > 2:
        x[1, : v // 2] = float("nan")
        x[2] = float("-inf")
        x[2, ::2] = float("nan")
    if n > 4:
        x[4, 1:] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize(
    "n, v, block", [(3, 1, 16), (5, 7, 16), (11, 401, 64), (4, 4099, 1024), (7, 4099, 8192)]
)
def test_sampling_filter_kernel_matches_reference_on_irregular_shapes(n, v, block):
    """(thr, cut) of the kernel equal the sort-based reference's, canonical form included, on rows with
    ties at the boundary, NaN, -inf and dead rows, greedy rows and every option edge."""
    gen = torch.Generator().manual_seed(v + n)
    logits = _logits(n, v, gen)
    opts = _options(n, v, gen)
    thr, cut = sampling_filter(logits, *opts, block=block)
    want_thr, want_cut = sampling_filter_ref(logits, *opts)
    assert thr.dtype == torch.float32 and cut.dtype == torch.int32
    assert torch.equal(thr, want_thr) and torch.equal(cut, want_cut), (thr, want_thr, cut, want_cut)
    # the kept prefix is never empty in a live sampled row, and everything is kept in greedy rows
    kept = torch.isfinite(filter_logits_ref(logits, thr, cut)).sum(-1)
    live = torch.isfinite(logits.float()).any(-1)  # some finite logit (NaN and -inf are not)
    assert bool((kept[live] >= 1).all())
    greedy = opts[0] == 0
    assert bool((thr[greedy] == -INF).all()) and bool((cut[greedy] == v - 1).all())


def test_sampling_filter_bf16_logits_and_op_match_reference():
    """bfloat16 logits (compared in float32) through the registered op give the reference's prefix."""
    gen = torch.Generator().manual_seed(3)
    logits = _logits(6, 301, gen, torch.bfloat16)
    opts = _options(6, 301, gen)
    got = kops.sampling_filter(logits, *opts)
    want = sampling_filter_ref(logits, *opts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# (logits, T, top_k, top_p, min_p, expected kept ids): worked by hand from the semantics
WORKED = [
    ([2.0, 5, 5, 1, 5, 0], 1.0, 2, 1.0, 0.0, [1, 2]),  # ties split by id
    ([2.0, 5, 5, 1, 5, 0], 1.0, 3, 1.0, 0.0, [1, 2, 4]),  # the whole tie group
    ([2.0, 5, 5, 1, 5, 0], 1.0, 1, 1.0, 0.0, [1]),  # top_k = 1: the first argmax
    ([2.0, 5, 5, 1, 5, 0], 0.0, 2, 0.5, 0.5, [0, 1, 2, 3, 4, 5]),  # greedy rows keep everything
    ([2.0, 5, 5, 1, 5, 0], 1.0, 2**40, 0.5, 0.0, [1, 2]),  # an int64 top_k past V is off; top_p: 2 of 3.07
    # w = (1, .75, .5, .25) via log-probabilities (.4, .3, .2, .1): total 2.5, top_p .5 -> mass 1.25
    ([-0.9162907, -1.2039728, -1.6094379, -2.3025851], 1.0, 0, 0.5, 0.0, [0, 1]),
    ([-0.9162907, -1.2039728, -1.6094379, -2.3025851], 1.0, 0, 0.3, 0.0, [0]),
    ([-0.9162907, -1.2039728, -1.6094379, -2.3025851], 1.0, 0, 1e-9, 0.0, [0]),  # never empty
    ([-0.9162907, -1.2039728, -1.6094379, -2.3025851], 1.0, 0, 1.0, 0.6, [0, 1]),  # min_p: w >= .6
    ([-0.9162907, -1.2039728, -1.6094379, -2.3025851], 1.0, 0, 1.0, 0.49, [0, 1, 2]),
    # min_p .4 keeps 3 (total 2.25); top_k 2 of them (total 1.75); top_p .5 -> mass .875: one token
    ([-0.9162907, -1.2039728, -1.6094379, -2.3025851], 1.0, 2, 0.5, 0.4, [0]),
    ([-0.9162907, -1.2039728, -1.6094379, -2.3025851], 1.0, 2, 0.6, 0.4, [0, 1]),
    # four equal logits: top_p .5 -> mass 2: ids 0, 1 (mass before 0, 1); .51 -> 2.04: ids 0, 1, 2
    ([0.0, 0, 0, 0], 1.0, 0, 0.5, 0.0, [0, 1]),
    ([0.0, 0, 0, 0], 1.0, 0, 0.51, 0.0, [0, 1, 2]),
    ([3.0, -INF, 3, float("nan"), 1], 1.0, 4, 1.0, 0.0, [0, 1, 2, 4]),  # top_k reaches a -inf token
    ([3.0, -INF, 3, float("nan"), 1], 1.0, 0, 1.0, 0.2, [0, 2]),  # min_p drops -inf, NaN and w = e^-2
    ([3.0, -INF, 3, float("nan"), 1], 0.5, 0, 0.99, 0.0, [0, 2]),  # T = .5: w(1) = e^-4, 2 of 2.018
    ([-INF, -INF, float("nan")], 1.0, 1, 0.5, 0.5, [0, 1, 2]),  # a dead row: nothing to filter
]


@pytest.mark.parametrize("case", range(len(WORKED)))
def test_sampling_filter_keeps_the_hand_worked_prefix(case):
    """Kernel and reference keep exactly the tokens worked out by hand from the stated semantics."""
    row, t, k, p, mp, want = WORKED[case]
    logits = torch.tensor([row])
    opts = (torch.tensor([t]), torch.tensor([k]), torch.tensor([p]), torch.tensor([mp]))
    clean = torch.where(logits.isnan(), -INF, logits)[0]
    for thr, cut in (sampling_filter(logits, *opts, block=16), sampling_filter_ref(logits, *opts)):
        keep = (clean > thr) | ((clean == thr) & (torch.arange(len(row)) <= cut))  # the (thr, cut) rule
        assert keep.nonzero().flatten().tolist() == want, (float(thr), int(cut))


def test_sampling_filter_reads_the_options_of_each_request():
    """rows_per_request = K + 1: logits [B * (K+1), V] (and the [B, K+1, V] view, strided) with options [B]
    give what options repeated per row give."""
    gen = torch.Generator().manual_seed(7)
    b, k1, v = 3, 4, 97
    big = torch.randn(b, k1 + 2, v, generator=gen).round()
    logits = big[:, 1 : k1 + 1]  # [B, K+1, V], not contiguous over rows
    temperature, top_k = torch.tensor([1.0, 0.8, 1.5]), torch.tensor([3, 0, 7], dtype=torch.int64)
    top_p, min_p = torch.tensor([1.0, 0.6, 0.9]), torch.tensor([0.0, 0.1, 0.0])
    per_row = [o.repeat_interleave(k1) for o in (temperature, top_k, top_p, min_p)]
    want = sampling_filter_ref(logits.reshape(b * k1, v), *per_row)
    for got in (
        sampling_filter(logits, temperature, top_k, top_p, min_p, k1, block=64),
        sampling_filter(logits.reshape(b * k1, v), temperature, top_k, top_p, min_p, k1, block=64),
        sampling_filter_ref(logits, temperature, top_k, top_p, min_p, k1),
    ):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(set(want[1].tolist())) > 1


def _sample_inputs(n: int, v: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.round(torch.randn(n, v, generator=gen) * 4) / 2  # ties
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 2.0, 0.9, 1.0])[:n]
    seeds = torch.randint(0, 1 << 40, (n,), generator=gen)
    positions = torch.randint(0, 1 << 20, (n,), generator=gen)
    top_k = torch.tensor([2, 0, 1, 20, 0, 5, 0], dtype=torch.int32)[:n]
    top_p = torch.tensor([0.5, 0.9, 1.0, 0.8, 1.0, 1.0, 1.0])[:n]
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.2, 0.0, 0.0])[:n]
    return logits, temperature, seeds, positions, (top_k, top_p, min_p)


def _into(fn, logits, temperature, seeds, positions, opts, **kw):
    n, v = logits.shape
    dev = logits.device
    out_tokens = torch.full((n, 3), -7, dtype=torch.int64, device=dev)
    out_probs = torch.full((n, 3, v), -1.0, device=dev)
    tokens = fn(
        logits, temperature, seeds, positions, out_tokens=out_tokens, out_probs=out_probs,
        col=torch.tensor(1, device=dev), top_k=opts[0], top_p=opts[1], min_p=opts[2], **kw,
    )  # fmt: skip
    return tokens, out_tokens, out_probs


@pytest.mark.parametrize("n, v, block", [(7, 401, 128), (5, 61, 16)])
def test_gumbel_kernel_with_options_matches_reference_and_writes_p_prime(n, v, block):
    """With options the kernel's tokens and out_probs equal the reference's; out_probs is p' (0 outside the
    kept prefix, softmax of the kept logits inside) and every token lies in its row's prefix."""
    logits, temperature, seeds, positions, opts = _sample_inputs(n, v, seed=v)
    tokens, out_tokens, out_probs = _into(
        gumbel_sample, logits, temperature, seeds, positions, opts, block=block
    )
    want, want_tokens, want_probs = _into(gumbel_sample_ref, logits, temperature, seeds, positions, opts)
    assert torch.equal(tokens, want) and torch.equal(out_tokens, want_tokens)
    torch.testing.assert_close(out_probs, want_probs, rtol=1e-5, atol=2e-6)
    thr, cut = sampling_filter_ref(logits, temperature, *opts)
    kept = filter_logits_ref(logits, thr, cut)
    assert bool(torch.isfinite(kept.gather(1, tokens[:, None])).all()), "a token outside its prefix"
    sampled = temperature > 0
    p_prime = torch.softmax(kept[sampled] / temperature[sampled, None], dim=-1)
    torch.testing.assert_close(out_probs[sampled, 1], p_prime, rtol=1e-5, atol=2e-6)
    assert bool((out_probs[sampled, 1][~torch.isfinite(kept[sampled])] == 0).all())
    plain = gumbel_sample(logits, temperature, seeds, positions, block=block, top_k=opts[0], top_p=opts[1],
                          min_p=opts[2])  # fmt: skip
    assert torch.equal(plain, tokens)


def test_gumbel_kernel_with_options_maps_draft_ids_after_filtering_the_draft_vocabulary():
    """EAGLE-3's reduced vocabulary: the filter runs over the draft logits (ids by draft id), then d2t
    maps the sampled id."""
    logits, temperature, seeds, positions, opts = _sample_inputs(5, 61, seed=9)
    d2t = torch.randint(0, 500, (61,), generator=torch.Generator().manual_seed(1))
    got = _into(gumbel_sample, logits, temperature, seeds, positions, opts, d2t=d2t, block=16)
    want = _into(gumbel_sample_ref, logits, temperature, seeds, positions, opts, d2t=d2t)
    plain = _into(gumbel_sample, logits, temperature, seeds, positions, opts, block=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0], plain[0] + d2t[plain[0]]) and torch.equal(got[2], plain[2])


def test_top_k_1_is_greedy_exactly():
    """top_k = 1 in sampled rows returns the first argmax (ties to the smallest id) with a one-hot p'."""
    n, v = 5, 200
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(n, v, generator=gen)
    logits[0, [3, 150, 199]] = 9.0  # tie across blocks: 3
    logits[1, [77, 78]] = 9.0
    temperature, seeds, positions = torch.tensor([1.0, 2.0, 0.5, 5.0, 1.0]), torch.arange(n), torch.arange(n)
    opts = (torch.ones(n, dtype=torch.int32), torch.full((n,), 0.7), torch.zeros(n))
    for fn, kw in ((gumbel_sample, {"block": 64}), (gumbel_sample_ref, {})):
        tokens, _, probs = _into(fn, logits, temperature, seeds, positions, opts, **kw)
        assert torch.equal(tokens, logits.argmax(-1)) and tokens[:2].tolist() == [3, 77]
        assert torch.equal(probs[:, 1], torch.nn.functional.one_hot(tokens, v).float())


def test_options_all_off_equal_no_options_bit_for_bit():
    """Options given as tensors but all off (0, 1.0, 0) sample the same tokens and write the same
    probabilities, bit for bit, as no options, in the sampling and the verification kernels."""
    n, v = 7, 97
    logits, temperature, seeds, positions, _ = _sample_inputs(n, v, seed=2)
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    off = (torch.zeros(n, dtype=torch.int64), torch.ones(n), torch.zeros(n))
    none = (None, None, None)
    a = _into(gumbel_sample, logits, temperature, seeds, positions, off, block=32)
    b = _into(gumbel_sample, logits, temperature, seeds, positions, none, block=32)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    b_, k = 4, 3
    target = torch.randn(b_, k + 1, v, generator=torch.Generator().manual_seed(5))
    drafts = target[:, :k].argmax(-1)
    drafts[1, 1] = 0
    q = torch.softmax(torch.randn(b_, k, v), -1)
    t = torch.tensor([1.0, 0.0, 0.7, 1.2])
    off = tuple(o[:b_] for o in off)
    for probs in (q, None):
        with_off = rejection_sample(target, drafts, probs, t, seeds[:b_], positions[:b_], *off, block=32)
        without = rejection_sample(target, drafts, probs, t, seeds[:b_], positions[:b_], block=32)
        assert torch.equal(with_off[0], without[0]) and torch.equal(with_off[1], without[1])


@pytest.mark.parametrize("sampled", [True, False])
def test_rejection_kernel_with_options_matches_reference(sampled):
    """Verification against p' (options per request, read by all K + 1 slots): kernel tokens and counts
    equal the reference, for sampled drafts (q' from the draft's own options) and greedy drafts; emitted
    tokens lie in their slot's kept prefix."""
    b, k, v = 6, 3, 150
    gen = torch.Generator().manual_seed(10 + sampled)
    target = torch.round(torch.randn(b, k + 1, v, generator=gen) * 4) / 2
    temperature = torch.tensor([1.0, 0.8, 0.0, 1.3, 1.0, 0.6])
    seeds, positions = torch.arange(b) * 13 + 1, torch.arange(b) * 50
    top_k = torch.tensor([3, 0, 2, 1, 10, 0])
    top_p = torch.tensor([1.0, 0.7, 0.5, 1.0, 0.9, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.3])
    draft_logits = target[:, :k] + torch.randn(b, k, v, generator=gen)
    drafts, q = torch.empty((b, k), dtype=torch.int64), torch.empty((b, k, v))
    d_opts = (torch.full((b,), 4), torch.full((b,), 0.95), torch.zeros(b))  # the draft's own options
    for i in range(k):
        gumbel_sample_ref(
            draft_logits[:, i], temperature.clamp_min(0.5), seeds, positions + i, out_tokens=drafts,
            out_probs=q, col=torch.tensor(i), top_k=d_opts[0], top_p=d_opts[1], min_p=d_opts[2],
        )  # fmt: skip
    if not sampled:
        drafts, q = draft_logits.argmax(-1), None
    drafts[0] = target[0, :k].argmax(-1)
    if q is not None:
        q[0] = torch.nn.functional.one_hot(drafts[0], v).float()
    got = rejection_sample(target, drafts, q, temperature, seeds, positions, top_k, top_p, min_p, block=64)
    want = rejection_sample_ref(target, drafts, q, temperature, seeds, positions, top_k, top_p, min_p)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    thr, cut = sampling_filter_ref(target, temperature, top_k, top_p, min_p, k + 1)
    kept = torch.isfinite(filter_logits_ref(target, thr.view(b, k + 1), cut.view(b, k + 1)))
    n = got[1]
    emitted = got[0].gather(1, n[:, None])  # [B, 1]
    slot_kept = kept[torch.arange(b), n].gather(1, emitted).squeeze(1)
    assert bool(slot_kept[temperature > 0].all()), "an emitted token outside the target's kept prefix"


# ----------------------------------------------------------------------------------------------------------
# H200 (real sizes)
# ----------------------------------------------------------------------------------------------------------


def _prefix_mass(logits, thr, cut, temperature):
    """float64 (kept mass, total mass) per row of the kept prefix (thr, cut), unnormalised w."""
    x = torch.where(logits.float().isnan(), -INF, logits.float()).double()
    t = torch.where(temperature > 0, temperature, 1.0).double()[:, None]
    top = x.amax(-1, keepdim=True)
    w = torch.where(torch.isfinite(x), torch.exp((x - torch.where(torch.isfinite(top), top, 0.0)) / t), 0.0)
    kept = torch.isfinite(filter_logits_ref(logits, thr, cut))
    return torch.where(kept, w, 0.0).sum(-1), w.sum(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sampling_filter_matches_reference_at_49152(dtype):
    """V = 49152, 33 rows of every option mix (ties by the thousand at every boundary): the kernel's
    (thr, cut) equal the reference's (on the same CUDA tensors) wherever top_p is off; where it is on, a
    boundary may move by float32 rounding of the masses only (kept mass within 1e-4 of the total)."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    n, v = 33, 49152
    logits = _logits(n, v, gen, dtype).to(dev)
    opts = [o.to(dev) for o in _options(n, v, gen)]
    thr, cut = sampling_filter(logits, *opts)
    want_thr, want_cut = sampling_filter_ref(logits, *opts)
    exact = opts[2] >= 1
    assert torch.equal(thr[exact], want_thr[exact]) and torch.equal(cut[exact], want_cut[exact])
    got_mass, total = _prefix_mass(logits, thr, cut, opts[0])
    want_mass, _ = _prefix_mass(logits, want_thr, want_cut, opts[0])
    assert bool(((got_mass - want_mass).abs() <= 1e-4 * total).all()), (got_mass, want_mass)


def _check_in_prefix(logits, thr, cut, tokens):
    kept = torch.isfinite(filter_logits_ref(logits, thr, cut))
    assert bool(kept.gather(-1, tokens[..., None]).all()), "a token outside its kept prefix"


@pytest.mark.gpu
def test_gpu_sampling_and_verification_with_options_at_49152():
    """V = 49152 on the H200 with active options: gumbel_sample's tokens lie in the kernel filter's prefix
    and out_probs is softmax over that prefix; rejection_sample's emitted tokens lie in their slot's prefix;
    options all off give the no-option results bit for bit."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    n, v, k = 8, 49152, 5
    logits = (torch.randn(n, v, generator=gen) * 3).to(dev)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.9, 1.1, 2.0], device=dev)
    seeds, positions = torch.arange(n, device=dev) * 7, torch.arange(n, device=dev) * 3
    opts = (
        torch.tensor([50, 0, 50, 1, 0, 50, 20, 0], device=dev, dtype=torch.int32),
        torch.tensor([0.9, 0.9, 1.0, 1.0, 1.0, 0.5, 0.95, 1.0], device=dev),
        torch.tensor([0.05, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0, 0.0], device=dev),
    )
    tokens, _, probs = _into(gumbel_sample, logits, temperature, seeds, positions, opts)
    thr, cut = sampling_filter(logits, temperature, *opts)
    _check_in_prefix(logits, thr, cut, tokens)
    sampled = temperature > 0
    kept = filter_logits_ref(logits, thr, cut)[sampled]
    torch.testing.assert_close(
        probs[sampled, 1], torch.softmax(kept / temperature[sampled, None], -1), rtol=1e-4, atol=1e-6
    )
    off = (torch.zeros_like(opts[0]), torch.ones_like(opts[1]), torch.zeros_like(opts[2]))
    a = _into(gumbel_sample, logits, temperature, seeds, positions, off)
    b = _into(gumbel_sample, logits, temperature, seeds, positions, (None, None, None))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    target = (torch.randn(n, k + 1, v, generator=gen) * 3).to(dev)
    drafts = target[:, :k].argmax(-1)
    res_tokens, res_n = rejection_sample(target, drafts, None, temperature, seeds, positions, *opts)
    thr, cut = sampling_filter(target, temperature, *opts, k + 1)
    emitted = res_tokens.gather(1, res_n[:, None]).squeeze(1)
    rows = torch.arange(n, device=dev) * (k + 1) + res_n
    _check_in_prefix(target.reshape(n * (k + 1), v)[rows], thr[rows], cut[rows], emitted)
    plain = rejection_sample(target, drafts, None, temperature, seeds, positions)
    all_off = rejection_sample(target, drafts, None, temperature, seeds, positions, *off)
    assert torch.equal(plain[0], all_off[0]) and torch.equal(plain[1], all_off[1])
