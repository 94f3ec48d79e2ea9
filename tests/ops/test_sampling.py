"""fspec.gumbel_sample: distribution, invariants, column writes, compile, and input validation."""

import math

import pytest
import torch
from scipy.stats import chisquare

from fspec.kernels.gumbel import gumbel_sample_ref
from fspec.kernels.salts import SALT_DRAFT, SALT_RESIDUAL
from fspec.ops.sampling import gumbel_sample
from fspec.ops.verify import rejection_sample

P_MIN = 1e-3  # chi-square acceptance bound: a correct sampler fails a given fixed-seed test with prob 1e-3


def _batch(n: int = 6, v: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen) * 2
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.0, 0.3, 2.0, 1.0])[:n]
    seeds = torch.randint(0, 1 << 40, (n,), generator=gen)
    positions = torch.randint(0, 1 << 20, (n,), generator=gen)
    return logits, temperature, seeds, positions


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_gumbel_sample_matches_softmax_distribution(temperature):
    """200k draws (one per position) follow softmax(l / T); softmax(l) at the wrong T is rejected."""
    n, logits = 200_000, torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.1])
    rows = logits.expand(n, -1)
    seeds, positions = torch.full((n,), 1234), torch.arange(n)
    tokens = gumbel_sample_ref(rows, torch.full((n,), temperature), seeds, positions)
    counts = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * n
    assert chisquare(counts, expected).pvalue > P_MIN, f"counts {counts.tolist()} vs {expected.tolist()}"
    # power: the same counts clearly reject the untempered softmax
    assert chisquare(counts, torch.softmax(logits.double(), dim=0) * n).pvalue < 1e-12


def test_gumbel_sample_greedy_rows_are_argmax_and_ignore_seed():
    """Temperature 0 returns argmax(logits) (first maximum), whatever the seed and position."""
    logits, _, seeds, positions = _batch()
    zeros = torch.zeros(6)
    logits[3, [4, 9]] = 100.0  # tie: smallest id wins
    tokens = gumbel_sample(logits, zeros, seeds, positions)
    assert torch.equal(tokens, logits.argmax(-1)) and int(tokens[3]) == 4
    assert torch.equal(gumbel_sample(logits, zeros, seeds + 1, positions + 5), tokens)


def test_gumbel_sample_reproducible_and_independent_of_batch_composition():
    """Same (seed, position): same token alone, in a permuted batch, or repeated; a new seed differs."""
    logits, temperature, seeds, positions = _batch(seed=1)
    temperature = torch.full((6,), 5.0)  # flat distributions, so a changed seed shows
    tokens = gumbel_sample(logits, temperature, seeds, positions)
    assert torch.equal(gumbel_sample(logits, temperature, seeds, positions), tokens)
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    assert torch.equal(
        gumbel_sample(logits[perm], temperature[perm], seeds[perm], positions[perm]), tokens[perm]
    )
    alone = gumbel_sample(logits[2:3], temperature[2:3], seeds[2:3], positions[2:3])
    assert torch.equal(alone, tokens[2:3])
    assert not torch.equal(gumbel_sample(logits, temperature, seeds + 1, positions), tokens)
    assert not torch.equal(gumbel_sample(logits, temperature, seeds, positions + 1), tokens)
    assert not torch.equal(gumbel_sample(logits, temperature, seeds, positions, salt=SALT_RESIDUAL), tokens)


def test_gumbel_sample_into_writes_only_col_and_leaves_inputs_untouched():
    """Only out_tokens[:, col] / out_probs[:, col] are written; inputs intact; tokens are a fresh tensor."""
    logits, temperature, seeds, positions = _batch()
    inputs = [x.clone() for x in (logits, temperature, seeds, positions)]
    out_tokens = torch.full((6, 3), -9, dtype=torch.int64)
    out_probs = torch.full((6, 3, 50), -1.0)
    tokens = gumbel_sample(
        logits, temperature, seeds, positions, out_tokens=out_tokens, out_probs=out_probs, col=torch.tensor(1)
    )
    assert torch.equal(tokens, gumbel_sample(logits, temperature, seeds, positions, salt=SALT_DRAFT))
    assert torch.equal(out_tokens[:, 1], tokens) and bool((out_tokens[:, [0, 2]] == -9).all())
    assert bool((out_probs[:, [0, 2]] == -1.0).all())
    greedy = temperature == 0
    soft = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    expected = torch.where(greedy[:, None], torch.nn.functional.one_hot(tokens, 50).float(), soft)
    torch.testing.assert_close(out_probs[:, 1], expected, rtol=1e-5, atol=2e-6)
    tokens[0] = 12345
    assert int(out_tokens[0, 1]) != 12345, "returned tokens must not alias out_tokens"
    for before, after in zip(inputs, (logits, temperature, seeds, positions)):
        assert torch.equal(before, after)


def test_gumbel_sample_accepts_strided_logits():
    """A [B, T, V] slice and a vocabulary-strided view sample the same tokens as contiguous logits."""
    logits, temperature, seeds, positions = _batch()
    seq = torch.randn(6, 4, 50)
    seq[:, -1] = logits
    assert torch.equal(gumbel_sample(seq[:, -1], temperature, seeds, positions),
                       gumbel_sample(logits, temperature, seeds, positions))  # fmt: skip
    strided = torch.randn(6, 100)[:, ::2]
    strided.copy_(logits)
    assert strided.stride(-1) == 2
    assert torch.equal(gumbel_sample(strided, temperature, seeds, positions),
                       gumbel_sample(logits, temperature, seeds, positions))  # fmt: skip


def _step(logits, temperature, seeds, positions, out_tokens, out_probs, col, target):
    tokens = gumbel_sample(
        logits, temperature, seeds, positions, out_tokens=out_tokens, out_probs=out_probs, col=col
    )
    verified, num_accepted = rejection_sample(target, out_tokens, out_probs, temperature, seeds, positions)
    return tokens, verified, num_accepted


def test_compiled_sampling_and_verification_match_eager_without_recompiles():
    """torch.compile(fullgraph=True) of gumbel_sample (col tensor) + rejection_sample: as eager, 1 graph."""
    b, k, v = 4, 3, 40
    gen = torch.Generator().manual_seed(4)
    logits, target = torch.randn(b, v, generator=gen), torch.randn(b, k + 1, v, generator=gen)
    temperature, seeds, positions = (
        torch.tensor([0.0, 0.7, 1.0, 1.3]),
        torch.arange(b) * 7,
        torch.arange(b) + 3,
    )
    eager = (torch.zeros(b, k, dtype=torch.int64), torch.full((b, k, v), 1.0 / v))
    compiled = tuple(x.clone() for x in eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(_step, fullgraph=True)
    for i in range(k):  # the column comes from a tensor: one graph for every value
        col = torch.tensor(i)
        want = _step(logits + i, temperature, seeds, positions + i, *eager, col, target)
        got = step(logits + i, temperature, seeds, positions + i, *compiled, col, target)
        for w, g in zip(want, got):
            assert torch.equal(w, g)
        assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert bool((compiled[0] != 0).any()), "the compiled step must have written the token buffer"


def _valid_gumbel_args():
    logits, temperature, seeds, positions = _batch(n=4, v=10)
    return dict(
        logits=logits, temperature=temperature, seed=seeds, positions=positions, salt=0,
        out_tokens=torch.zeros(4, 3, dtype=torch.int64), out_probs=torch.zeros(4, 3, 10), col=torch.tensor(2),
    )  # fmt: skip


BAD_GUMBEL_ARGS = [
    ("logits", lambda a: a["logits"][0]),
    ("logits", lambda a: a["logits"].double()),
    ("logits", lambda a: a["logits"].long()),
    ("temperature", lambda a: a["temperature"][:3]),
    ("temperature", lambda a: a["temperature"].double()),
    ("temperature", lambda a: torch.tensor([0.5, -0.1, 1.0, 1.0])),
    ("temperature", lambda a: torch.tensor([0.5, float("nan"), 1.0, 1.0])),
    ("temperature", lambda a: torch.tensor([0.5, float("inf"), 1.0, 1.0])),
    ("seed", lambda a: a["seed"].int()),
    ("seed", lambda a: a["seed"].to("meta")),
    ("positions", lambda a: a["positions"][None]),
    ("positions", lambda a: torch.tensor([0, -2, 1, 1])),
    ("positions", lambda a: torch.tensor([0, 1 << 31, 1, 1])),
    ("salt", lambda a: 1 << 10),
    ("salt", lambda a: -1),
    ("salt", lambda a: torch.tensor(1)),
    ("col", lambda a: torch.tensor(3)),
    ("col", lambda a: torch.tensor(-1)),
    ("col", lambda a: torch.tensor([1])),
    ("col", lambda a: torch.tensor(1, dtype=torch.int32)),
    ("out_tokens", lambda a: a["out_tokens"].int()),
    ("out_tokens", lambda a: torch.zeros(3, 4, dtype=torch.int64).t()),
    ("out_probs", lambda a: torch.zeros(4, 3, 11)),
    ("out_probs", lambda a: torch.zeros(4, 3, 10, dtype=torch.bfloat16)),
    ("out_probs", lambda a: torch.zeros(4, 10, 3).transpose(1, 2)),
    ("d2t", lambda a: torch.zeros(9, dtype=torch.int64)),
    ("d2t", lambda a: torch.zeros(10)),
    ("d2t", lambda a: torch.tensor([0] * 9 + [-10])),  # token 9 would map to id -1
]


@pytest.mark.parametrize("name, make_bad", BAD_GUMBEL_ARGS)
def test_gumbel_sample_rejects_bad_input_naming_the_argument(name, make_bad):
    """A bad argument raises ValueError that names it and states what was expected and what came."""
    args = _valid_gumbel_args()
    gumbel_sample(**args)  # the valid arguments pass
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: expected .+, got .+"):
        gumbel_sample(**args)


def test_gumbel_sample_requires_all_or_none_of_the_out_arguments():
    """out_tokens, out_probs and col come together; d2t only with them."""
    args = _valid_gumbel_args()
    del args["out_probs"]
    with pytest.raises(ValueError, match="out_tokens, out_probs, col: expected all three or none"):
        gumbel_sample(**args)
    args = _valid_gumbel_args()
    for name in ("out_tokens", "out_probs", "col"):
        del args[name]
    with pytest.raises(ValueError, match="^d2t: expected None unless out_tokens, out_probs and col"):
        gumbel_sample(**args, d2t=torch.zeros(10, dtype=torch.int64))


def test_valid_eager_calls_read_the_device_once(monkeypatch):
    """Validation gathers its value checks into one host read (a device sync on CUDA) per call, for
    gumbel_sample with out buffers and for rejection_sample with sampled drafts; bad values still raise."""
    reads = []
    for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    gumbel_sample(**_valid_gumbel_args())
    assert len(reads) == 1, reads
    reads.clear()
    gumbel_sample(**_valid_gumbel_args(), d2t=torch.arange(10) % 3)  # the id-map check joins the same read
    assert len(reads) == 1, reads
    reads.clear()
    b, k, v = 3, 2, 11
    target = torch.randn(b, k + 1, v, generator=torch.Generator().manual_seed(3))
    q = torch.softmax(torch.randn(b, k, v), -1)
    drafts, temp = torch.randint(0, v, (b, k)), torch.tensor([0.0, 1.0, 0.5])
    rejection_sample(target, drafts, q, temp, torch.arange(b), torch.arange(b))
    # the validation's one read; on the CPU the reference then reads whether any temperature is > 0 (its
    # greedy fast path), from host memory: no sync
    assert reads == ["__int__"] + ["__bool__"] * (not target.is_cuda), reads
    with pytest.raises(ValueError, match="^positions: expected"):
        rejection_sample(target, drafts, q, temp, torch.arange(b), torch.tensor([0, -5, 0]))


def test_a_flag_the_host_checks_cannot_confirm_is_still_a_value_error(monkeypatch):
    """Where the kernel's value check fires and the host-side checks find nothing (a value at a float32
    limit, where the device's arithmetic differs), the call is refused with a ValueError naming the
    arguments behind the bits, not run and not an internal error."""
    from fspec.kernels import value_flags as vf
    from fspec.ops import sampling

    def flagged(*args):
        return torch.tensor([vf.FLAG_LOGITS | vf.FLAG_COL], dtype=torch.int32)

    monkeypatch.setattr(sampling.kops, "value_flags", flagged)
    with pytest.raises(ValueError, match=r"^logits, col: expected values that pass the kernels' own checks"):
        gumbel_sample(**_valid_gumbel_args())


# ----------------------------------------------------------------------------------------------------------
# top_k / top_p / min_p
# ----------------------------------------------------------------------------------------------------------


def processed_distribution(logits, temperature: float, top_k: int, top_p: float, min_p: float):
    """p' of one row, float64, straight from the semantics (kernels/sampling_filter.py): a Python walk over
    the order (logit descending, id ascending), independent of the reference's tensor code."""
    row = [float("-inf") if x != x else float(x) for x in logits.tolist()]
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    top = row[order[0]]
    w = {i: math.exp((row[i] - top) / temperature) for i in order}
    kept = [i for i in order if min_p <= 0 or w[i] >= min_p]
    if top_k > 0:
        kept = kept[:top_k]
    if top_p < 1:
        total, before, prefix = sum(w[i] for i in kept), 0.0, []
        for i in kept:
            if before < top_p * total or not prefix:
                prefix.append(i)
            before += w[i]
        kept = prefix
    p = torch.zeros(len(row), dtype=torch.float64)
    for i in kept:
        p[i] = w[i]
    return p / p.sum()


OPTION_CASES = {  # name: (top_k, top_p, min_p) on the 16 logits of `_option_logits`, T = 0.8
    "top_k": (3, 1.0, 0.0),
    "top_p": (0, 0.7, 0.0),
    "min_p": (0, 1.0, 0.15),
    "all_three": (6, 0.8, 0.05),
}


def _option_logits():
    logits = torch.tensor(
        [1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.1, 1.1, 0.9, -1.0, 0.3, 1.6, -2.0, 0.7, 1.0]
    )
    return logits  # ties: 1.0 at ids 0 and 15, 1.1 at 7 and 8


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_gumbel_sample_with_options_matches_the_processed_distribution(case):
    """10k draws (one per position) with top_k / top_p / min_p follow p' (chi-square over its support, bound
    P_MIN); no draw lands outside the kept prefix; the unfiltered softmax is rejected; out_probs is p'."""
    n, t = 10_000, 0.8
    top_k, top_p, min_p = OPTION_CASES[case]
    logits = _option_logits()
    want = processed_distribution(logits, t, top_k, top_p, min_p)
    opts = dict(top_k=torch.full((n,), top_k), top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p))
    rows = logits.expand(n, -1)
    tokens = gumbel_sample(rows, torch.full((n,), t), torch.full((n,), 99), torch.arange(n), **opts)
    counts = torch.bincount(tokens, minlength=16).double()
    support = want > 0
    assert 1 < int(support.sum()) < 16, "the case must drop some tokens and keep several"
    assert float(counts[~support].sum()) == 0.0, f"draws outside the kept prefix: {counts.tolist()}"
    pvalue = chisquare(counts[support], want[support] * n).pvalue
    assert pvalue > P_MIN, f"{case}: counts {counts.tolist()} vs {(want * n).tolist()}"
    plain = torch.softmax(logits.double() / t, dim=0)
    assert chisquare(counts, plain * n).pvalue < 1e-12
    out_tokens, out_probs = torch.zeros(4, 1, dtype=torch.int64), torch.zeros(4, 1, 16)
    few = {k: v[:4] for k, v in opts.items()}
    gumbel_sample(rows[:4], torch.full((4,), t), torch.arange(4), torch.arange(4), out_tokens=out_tokens,
                  out_probs=out_probs, col=torch.tensor(0), **few)  # fmt: skip
    torch.testing.assert_close(out_probs[:, 0].double(), want.expand(4, -1), rtol=1e-5, atol=1e-6)


def test_gumbel_sample_top_k_1_is_greedy_and_greedy_rows_ignore_options():
    """top_k = 1 returns the first argmax in sampled rows; T = 0 rows are argmax whatever the options."""
    logits, temperature, seeds, positions = _batch()
    logits[1, [3, 30]] = 50.0  # tie: 3
    opts = dict(top_k=torch.ones(6, dtype=torch.int32), top_p=torch.full((6,), 0.5), min_p=torch.zeros(6))
    tokens = gumbel_sample(logits, temperature, seeds, positions, **opts)
    assert torch.equal(tokens, logits.argmax(-1)) and int(tokens[1]) == 3
    greedy = dict(top_k=torch.full((6,), 7), top_p=torch.full((6,), 0.01), min_p=torch.full((6,), 0.9))
    zeros = torch.zeros(6)
    assert torch.equal(gumbel_sample(logits, zeros, seeds, positions, **greedy), logits.argmax(-1))


def test_compiled_sampling_with_options_matches_eager_without_recompiles():
    """torch.compile(fullgraph=True) of gumbel_sample + rejection_sample with option tensors: as eager, one
    graph whatever the option values."""
    b, k, v = 4, 3, 40
    gen = torch.Generator().manual_seed(4)
    logits, target = torch.randn(b, v, generator=gen), torch.randn(b, k + 1, v, generator=gen)
    temperature, seeds, positions = (
        torch.tensor([0.0, 0.7, 1.0, 1.3]),
        torch.arange(b) * 7,
        torch.arange(b) + 3,
    )

    def step(logits, out_tokens, out_probs, col, top_k, top_p, min_p):
        gumbel_sample(logits, temperature, seeds, positions, out_tokens=out_tokens, out_probs=out_probs,
                      col=col, top_k=top_k, top_p=top_p, min_p=min_p)  # fmt: skip
        return rejection_sample(
            target, out_tokens, out_probs, temperature, seeds, positions, top_k, top_p, min_p
        )

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    for i in range(3):
        opts = (
            torch.tensor([0, 3 + i, 1, 5]),
            torch.tensor([1.0, 0.9, 0.5 + 0.1 * i, 1.0]),
            torch.full((b,), 0.02 * i),
        )
        eager_bufs = (torch.zeros(b, k, dtype=torch.int64), torch.full((b, k, v), 1.0 / v))
        comp_bufs = tuple(x.clone() for x in eager_bufs)
        want = step(logits + i, *eager_bufs, torch.tensor(i), *opts)
        got = compiled(logits + i, *comp_bufs, torch.tensor(i), *opts)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert torch.equal(eager_bufs[1], comp_bufs[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


BAD_OPTIONS = [
    ("top_k", lambda a: a["top_k"] - 3),
    ("top_k", lambda a: a["top_k"].float()),
    ("top_k", lambda a: a["top_k"][:3]),
    ("top_p", lambda a: torch.tensor([0.5, 0.0, 1.0, 1.0])),
    ("top_p", lambda a: torch.tensor([0.5, 1.5, 1.0, 1.0])),
    ("top_p", lambda a: torch.tensor([0.5, float("nan"), 1.0, 1.0])),
    ("top_p", lambda a: a["top_p"].double()),
    ("min_p", lambda a: torch.tensor([0.0, 1.0, 0.0, 0.0])),
    ("min_p", lambda a: torch.tensor([0.0, -0.1, 0.0, 0.0])),
    ("min_p", lambda a: a["min_p"].to("meta")),
]


def _valid_option_args():
    return dict(
        **_valid_gumbel_args(), top_k=torch.tensor([0, 2, 5, 1], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.5, 1.0]), min_p=torch.tensor([0.0, 0.1, 0.0, 0.5]),
    )  # fmt: skip


@pytest.mark.parametrize("into", [True, False])
@pytest.mark.parametrize("name, make_bad", BAD_OPTIONS)
def test_gumbel_sample_rejects_bad_options_naming_them(name, make_bad, into):
    """A bad top_k / top_p / min_p raises ValueError naming it, with and without the out buffers."""
    args = _valid_option_args()
    if not into:
        for drop in ("out_tokens", "out_probs", "col"):
            del args[drop]
    gumbel_sample(**args)
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: expected .+, got .+"):
        gumbel_sample(**args)


def test_gumbel_sample_requires_all_three_options_or_none():
    """A mix of option tensors and None is refused."""
    args = _valid_option_args()
    args["top_p"] = None
    with pytest.raises(
        ValueError, match=r"^top_k, top_p, min_p: expected all three tensors or all three None"
    ):
        gumbel_sample(**args)


def test_valid_calls_with_options_still_read_the_device_once(monkeypatch):
    """The options' value checks join the single device read of the other checks."""
    reads = []
    for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    gumbel_sample(**_valid_option_args())
    assert len(reads) == 1, reads
