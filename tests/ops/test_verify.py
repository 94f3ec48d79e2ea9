"""fspec.rejection_sample: lossless output distribution, invariants, the vLLM salt regression, validation."""

import pytest
import torch
from scipy.stats import binomtest, chisquare

from fspec.kernels import rejection
from fspec.kernels.gumbel import gumbel_sample_ref
from fspec.kernels.philox import philox_gumbel_ref, philox_uniform_ref
from fspec.kernels.rejection import rejection_sample_ref
from fspec.kernels.salts import SALT_ACCEPT, SALT_BONUS, SALT_DRAFT, SALT_RESIDUAL
from fspec.ops.verify import rejection_sample

P_MIN = 1e-3  # chi-square / binomial acceptance bound for fixed-seed statistical tests


def _naive_rejection(target, drafts, q, temperature, seeds, positions):
    """Textbook per-request loop (Leviathan et al. 2023) over the same Philox streams."""
    b, k1, v = target.shape
    tokens, accepted = torch.full((b, k1), -1), torch.zeros(b, dtype=torch.int64)
    for i in range(b):
        t, seed = float(temperature[i]), seeds[i : i + 1]
        for k in range(k1):
            logits, pos = target[i, k].float(), positions[i : i + 1] + k
            if t == 0:
                best = int(torch.argmax(logits))
                if k < k1 - 1 and int(drafts[i, k]) == best:
                    tokens[i, k], accepted[i] = best, k + 1
                    continue
                tokens[i, k] = best
                break
            p = torch.softmax(logits / t, dim=-1)
            if k == k1 - 1:  # bonus
                tokens[i, k] = int(torch.argmax(logits / t + philox_gumbel_ref(seed, pos, v, SALT_BONUS)[0]))
                break
            x = int(drafts[i, k])
            qk = q[i, k] if q is not None else torch.nn.functional.one_hot(drafts[i, k], v).float()
            u = float(philox_uniform_ref(seed, pos, torch.tensor([0]), SALT_ACCEPT)[0])
            if u * float(qk[x]) < float(p[x]):
                tokens[i, k], accepted[i] = x, k + 1
                continue
            residual = (p - qk).clamp_min(0)  # never all zero here: random q != p (zero mass: kernel tests)
            g = philox_gumbel_ref(seed, pos, v, SALT_RESIDUAL)[0]
            tokens[i, k] = int(torch.argmax(residual.log() + g))
            break
    return tokens, accepted


def _draft_tokens(draft_logits, temperature, seeds, positions):
    """Sample drafts like a draft loop: column k at positions + k with SALT_DRAFT; returns (tokens, q)."""
    b, k, v = draft_logits.shape
    tokens, probs = torch.empty((b, k), dtype=torch.int64), torch.empty((b, k, v))
    for i in range(k):
        gumbel_sample_ref(
            draft_logits[:, i], temperature, seeds, positions + i, salt=SALT_DRAFT,
            out_tokens=tokens, out_probs=probs, col=torch.tensor(i),
        )  # fmt: skip
    return tokens, probs


@pytest.mark.parametrize("drafts_kind", ["sampled", "greedy"])
def test_rejection_sample_matches_naive_loop(drafts_kind):
    """The public op equals a textbook per-request loop, mixed greedy / sampled targets in one batch."""
    b, k, v = 6, 4, 30
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(b, k + 1, v, generator=gen) * 2
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.0, 0.9])
    seeds, positions = torch.randint(0, 1 << 40, (b,), generator=gen), torch.arange(b) * 100
    draft_logits = target[:, :k] + torch.randn(b, k, v, generator=gen)
    drafts, q = _draft_tokens(draft_logits, temperature.clamp_min(0.5), seeds, positions)
    if drafts_kind == "greedy":
        drafts, q = draft_logits.argmax(-1), None
    drafts[0, :2] = target[0, :2].argmax(-1)  # greedy target row accepts two drafts
    tokens, n = rejection_sample(target, drafts, q, temperature, seeds, positions)
    want_tokens, want_n = _naive_rejection(target, drafts, q, temperature, seeds, positions)
    assert torch.equal(tokens, want_tokens) and torch.equal(n, want_n)
    assert int(n[0]) >= 2 and len(set(n.tolist())) > 1


def _chain(n: int, k: int, v: int, *, greedy_drafts: bool, seed: int):
    """n requests whose target p_k and draft q_k differ per slot and from each other (context-free mocks)."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, v, generator=gen) * 1.5  # [K+1, V]
    draft_logits = target_logits[:k] + torch.randn(k, v, generator=gen) * 1.5  # [K, V]
    seeds, positions = torch.arange(n) * 7919 + seed, torch.full((n,), 1000)
    t = torch.ones(n)
    drafts, q = _draft_tokens(draft_logits.expand(n, k, v), t, seeds, positions)
    if greedy_drafts:
        drafts, q = draft_logits.argmax(-1).expand(n, k).contiguous(), None
    tokens, accepted = rejection_sample_ref(target_logits.expand(n, k + 1, v), drafts, q, t, seeds, positions)
    p = torch.softmax(target_logits.double(), dim=-1)
    qd = torch.softmax(draft_logits.double(), dim=-1) if not greedy_drafts else None
    if greedy_drafts:
        qd = torch.nn.functional.one_hot(draft_logits.argmax(-1), v).double()
    return tokens, accepted, p, qd


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_rejection_sample_output_follows_the_target_distribution(greedy_drafts):
    """K = 3, 200k requests: each emitted slot j, given it is emitted (n >= j), is distributed as p_j."""
    n, k, v = 200_000, 3, 5
    tokens, accepted, p, q = _chain(n, k, v, greedy_drafts=greedy_drafts, seed=3)
    for j in range(k + 1):
        emitted = accepted >= j
        counts = torch.bincount(tokens[emitted, j], minlength=v).double()
        total = float(counts.sum())
        assert total > 5000, f"slot {j}: only {total} samples"
        assert chisquare(counts, p[j] * total).pvalue > P_MIN, f"slot {j}: {counts / total} vs p {p[j]}"
        if j < k:  # power: the draft distribution itself is rejected
            wrong = (q[j] + 1e-6) / (q[j] + 1e-6).sum()  # one-hot q has zeros
            assert chisquare(counts, wrong * total).pvalue < 1e-12
    # acceptance: P(n >= j) = prod_{i<j} alpha_i with alpha = sum min(p, q); the whole count distribution
    alpha = torch.minimum(p[:k], q).sum(-1)  # [K]
    reach = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(alpha, 0)])  # P(n >= j)
    expected = (reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])) * n  # P(n = j)
    counts = torch.bincount(accepted, minlength=k + 1).double()
    assert chisquare(counts, expected).pvalue > P_MIN, f"{counts.tolist()} vs {expected.tolist()}"


def test_acceptance_rate_equals_sum_of_min_p_q():
    """Binomial test: the first draft is accepted with probability alpha = sum_x min(p(x), q(x))."""
    n, k, v = 100_000, 3, 7
    _, accepted, p, q = _chain(n, k, v, greedy_drafts=False, seed=8)
    alpha = float(torch.minimum(p[0], q[0]).sum())
    hits = int((accepted >= 1).sum())
    assert 0.2 < alpha < 0.9, f"alpha {alpha} should be informative"
    assert binomtest(hits, n, alpha).pvalue > P_MIN, f"{hits / n} accepted vs alpha {alpha}"


def _vllm_case(n: int):
    """A worked example of lossless verification: target p = (.1, .45, .45), draft q = (.6, .3, .1),
    one sampled draft."""
    p, q = torch.tensor([0.1, 0.45, 0.45]), torch.tensor([0.6, 0.3, 0.1])
    seeds, positions, t = torch.arange(n) * 1000003 + 17, torch.full((n,), 5), torch.ones(n)
    drafts = gumbel_sample_ref(q.log().expand(n, 3), t, seeds, positions, salt=SALT_DRAFT)
    target = torch.stack([p.log(), p.log()]).expand(n, 2, 3)
    tokens, _ = rejection_sample_ref(
        target, drafts[:, None], q.expand(n, 1, 3).contiguous(), t, seeds, positions
    )
    p = p.double() / p.double().sum()  # float32 (.1, .45, .45) is off 1 by an ulp; chisquare checks sums
    return torch.bincount(tokens[:, 0], minlength=3).double(), p * n


def test_residual_salt_keeps_the_target_distribution_where_reused_draft_noise_skews_it(monkeypatch):
    """vLLM #47386: reusing draft noise gave (.100, .394, .506) for p = (.1, .45, .45); salting fixes it."""
    n = 200_000
    counts, expected = _vllm_case(n)
    assert chisquare(counts, expected).pvalue > P_MIN, f"salted: {(counts / n).tolist()}"
    monkeypatch.setattr(rejection, "SALT_RESIDUAL", SALT_DRAFT)  # reproduce the bug: reuse the draft's noise
    bad, _ = _vllm_case(n)
    assert chisquare(bad, expected).pvalue < 1e-12
    assert torch.allclose(bad / n, torch.tensor([0.100, 0.394, 0.506], dtype=torch.float64), atol=0.005)


def test_draft_equal_to_target_accepts_everything():
    """q == p (sampled drafts from the target itself): every draft is accepted, n == K."""
    n, k, v = 20_000, 4, 6
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(k + 1, v, generator=gen).expand(n, k + 1, v)
    t, seeds, positions = torch.full((n,), 0.8), torch.arange(n), torch.arange(n) % 977
    drafts, q = _draft_tokens(logits[:, :k], t, seeds, positions)
    tokens, accepted = rejection_sample_ref(logits, drafts, q, t, seeds, positions)
    assert bool((accepted == k).all()) and torch.equal(tokens[:, :k], drafts)
    small = slice(0, 5)  # the public op (kernel when interpreted) on a few rows
    tokens_op, accepted_op = rejection_sample(
        logits[small], drafts[small], q[small], t[small], seeds[small], positions[small]
    )
    assert torch.equal(tokens_op, tokens[small]) and bool((accepted_op == k).all())


def test_greedy_target_is_deterministic_and_follows_the_argmax_chain():
    """Temperature 0: accept while draft == argmax, then emit argmax; the seed changes nothing."""
    b, k, v = 5, 3, 20
    gen = torch.Generator().manual_seed(6)
    target = torch.randn(b, k + 1, v, generator=gen)
    best = target.argmax(-1)  # [B, K+1]
    drafts = best[:, :k].clone()
    drafts[1, 0] = (best[1, 0] + 1) % v
    drafts[2, 2] = (best[2, 2] + 1) % v
    t, positions = torch.zeros(b), torch.arange(b)
    tokens, n = rejection_sample(target, drafts, None, t, torch.arange(b), positions)
    assert n.tolist() == [3, 0, 2, 3, 3]
    assert tokens[1].tolist() == [int(best[1, 0]), -1, -1, -1]
    assert tokens[2].tolist() == best[2, :3].tolist() + [-1]
    assert torch.equal(tokens[0], best[0])
    again = rejection_sample(target, drafts, None, t, torch.arange(b) + 99, positions + 5)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], n)


def test_same_seed_reproduces_and_another_seed_changes_the_outcome():
    """Equal (seed, positions) give equal tokens; other seeds give other tokens."""
    b, k, v = 8, 3, 12
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(b, k + 1, v, generator=gen)
    t, seeds, positions = torch.ones(b), torch.arange(b), torch.arange(b) * 3
    drafts, q = _draft_tokens(torch.randn(b, k, v, generator=gen), t, seeds, positions)
    inputs = [x.clone() for x in (target, drafts, q)]
    first = rejection_sample(target, drafts, q, t, seeds, positions)
    second = rejection_sample(target, drafts, q, t, seeds, positions)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    other = rejection_sample(target, drafts, q, t, seeds + 1000, positions)
    assert not torch.equal(first[0], other[0])
    for before, after in zip(inputs, (target, drafts, q)):
        assert torch.equal(before, after)


def _valid_rejection_args():
    b, k, v = 3, 2, 10
    return dict(
        target_logits=torch.randn(b, k + 1, v), draft_tokens=torch.zeros(b, k, dtype=torch.int64),
        draft_probs=torch.full((b, k, v), 0.1), temperature=torch.ones(b), seed=torch.arange(b),
        positions=torch.arange(b),
    )  # fmt: skip


BAD_REJECTION_ARGS = [
    ("target_logits", lambda a: a["target_logits"][:, 0]),
    ("target_logits", lambda a: a["target_logits"][:, :1]),
    ("target_logits", lambda a: a["target_logits"].double()),
    ("draft_tokens", lambda a: a["draft_tokens"].int()),
    ("draft_tokens", lambda a: a["draft_tokens"][:, :1]),
    ("draft_tokens", lambda a: torch.tensor([[0, 1], [2, 10], [3, 4]])),
    ("draft_tokens", lambda a: torch.tensor([[0, 1], [2, -1], [3, 4]])),
    ("draft_probs", lambda a: a["draft_probs"][:, :, :9]),
    ("draft_probs", lambda a: a["draft_probs"].half()),
    ("temperature", lambda a: torch.tensor([1.0, -1.0, 1.0])),
    ("temperature", lambda a: torch.tensor([1.0, float("nan"), 1.0])),
    ("temperature", lambda a: torch.ones(4)),
    ("seed", lambda a: a["seed"].float()),
    ("positions", lambda a: torch.tensor([0, (1 << 31) - 2, 0])),  # + K passes 2^31 - 1
    ("positions", lambda a: a["positions"].to("meta")),
]


@pytest.mark.parametrize("name, make_bad", BAD_REJECTION_ARGS)
def test_rejection_sample_rejects_bad_input_naming_the_argument(name, make_bad):
    """A bad argument raises ValueError that names it and states what was expected and what came."""
    args = _valid_rejection_args()
    rejection_sample(**args)  # the valid arguments pass
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: expected .+, got .+"):
        rejection_sample(**args)


# ----------------------------------------------------------------------------------------------------------
# top_k / top_p / min_p: verification against the target's processed p'
# ----------------------------------------------------------------------------------------------------------

TARGET_OPTIONS = (4, 0.85, 0.02)  # top_k, top_p, min_p of the target
DRAFT_OPTIONS = (6, 0.95, 0.0)  # the draft's own, different ones


def _option_chain(n: int, *, greedy_drafts: bool, seed: int):
    """n requests, K = 2, V = 12: target and draft logits differ per slot; the draft samples with its own
    options at its own temperature (q' written by gumbel_sample), the target verifies with others."""
    from test_sampling import processed_distribution

    k, v = 2, 12
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, v, generator=gen) * 1.5  # [K+1, V]
    draft_logits = target_logits[:k] + torch.randn(k, v, generator=gen) * 1.5  # [K, V]
    seeds, positions = torch.arange(n) * 7919 + seed, torch.full((n,), 1000)
    t_target, t_draft = 0.9, 1.2
    drafts, q = torch.empty((n, k), dtype=torch.int64), torch.empty((n, k, v))
    d_opts = [torch.full((n,), x) for x in DRAFT_OPTIONS]
    for i in range(k):
        gumbel_sample_ref(
            draft_logits[i].expand(n, v), torch.full((n,), t_draft), seeds, positions + i, salt=SALT_DRAFT,
            out_tokens=drafts, out_probs=q, col=torch.tensor(i), top_k=d_opts[0], top_p=d_opts[1],
            min_p=d_opts[2],
        )  # fmt: skip
    if greedy_drafts:
        drafts, q = draft_logits.argmax(-1).expand(n, k).contiguous(), None
    t_opts = [torch.full((n,), x) for x in TARGET_OPTIONS]
    tokens, accepted = rejection_sample(
        target_logits.expand(n, k + 1, v), drafts, q, torch.full((n,), t_target), seeds, positions, *t_opts
    )
    p = torch.stack(
        [processed_distribution(target_logits[j], t_target, *TARGET_OPTIONS) for j in range(k + 1)]
    )
    return tokens, accepted, p, target_logits


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_rejection_sample_with_options_follows_the_processed_target_distribution(greedy_drafts):
    """8k requests: the first emitted token follows the target's p'_0 and the second, given the first
    draft was accepted, p'_1 (chi-square over p's support, bound P_MIN; nothing outside it), for sampled
    drafts with other options and temperature, and for greedy drafts; the unfiltered p is rejected."""
    n = 8_000
    tokens, accepted, p, target = _option_chain(n, greedy_drafts=greedy_drafts, seed=5)
    v = p.shape[1]
    for j in range(2):
        emitted = accepted >= j
        counts = torch.bincount(tokens[emitted, j], minlength=v).double()
        total = float(counts.sum())
        support = p[j] > 0
        assert total > 1500 and 1 < int(support.sum()) < v, f"slot {j}: {total} samples, {support.tolist()}"
        assert float(counts[~support].sum()) == 0.0, f"slot {j}: tokens outside the kept prefix"
        pvalue = chisquare(counts[support], p[j][support] * total).pvalue
        assert pvalue > P_MIN, f"slot {j}: {(counts / total).tolist()} vs p' {p[j].tolist()}"
        plain = torch.softmax(target[j].double() / 0.9, dim=-1)  # the same logits, unfiltered
        assert chisquare(counts, plain * total).pvalue < 1e-12


def test_rejection_sample_with_top_k_1_follows_the_argmax_chain():
    """Target top_k = 1 at T > 0: p' is the one-hot of the argmax, so drafts equal to it are accepted, the
    first other one is replaced by it, and the bonus is it, exactly as greedy verification."""
    b, k, v = 5, 3, 20
    gen = torch.Generator().manual_seed(6)
    target = torch.randn(b, k + 1, v, generator=gen)
    best = target.argmax(-1)
    drafts = best[:, :k].clone()
    drafts[1, 0] = (best[1, 0] + 1) % v
    drafts[2, 2] = (best[2, 2] + 1) % v
    opts = (torch.ones(b, dtype=torch.int64), torch.ones(b), torch.zeros(b))
    sampled = rejection_sample(
        target, drafts, None, torch.full((b,), 1.3), torch.arange(b), torch.arange(b), *opts
    )
    greedy = rejection_sample(target, drafts, None, torch.zeros(b), torch.arange(b), torch.arange(b))
    assert torch.equal(sampled[0], greedy[0]) and torch.equal(sampled[1], greedy[1])
    assert sampled[1].tolist() == [3, 0, 2, 3, 3]


@pytest.mark.parametrize(
    "name, make_bad",
    [
        ("top_k", lambda a: torch.tensor([0, -1, 2])),
        ("top_k", lambda a: torch.zeros(4, dtype=torch.int64)),
        ("top_p", lambda a: torch.tensor([1.0, 0.0, 0.5])),
        ("top_p", lambda a: torch.tensor([1.0, 2.0, 0.5])),
        ("min_p", lambda a: torch.tensor([0.0, 1.0, 0.5])),
        ("min_p", lambda a: torch.tensor([0.0, 0.1, 0.5], dtype=torch.float64)),
    ],
)
def test_rejection_sample_rejects_bad_options_naming_them(name, make_bad):
    """A bad top_k / top_p / min_p raises ValueError naming it; a mix of tensors and None too."""
    args = _valid_rejection_args()
    args.update(top_k=torch.tensor([0, 3, 1]), top_p=torch.tensor([1.0, 0.9, 0.5]), min_p=torch.zeros(3))
    rejection_sample(**args)
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: expected .+, got .+"):
        rejection_sample(**args)
    args[name] = None
    with pytest.raises(ValueError, match=r"^top_k, top_p, min_p: expected all three"):
        rejection_sample(**args)
