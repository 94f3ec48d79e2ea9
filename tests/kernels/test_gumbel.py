"""Gumbel kernel (interpreted) against its PyTorch reference and against plain softmax / argmax; on the
H200 (@pytest.mark.gpu) the two sampling launches under PDL right behind the LM head that writes their
logits."""

import math

import pytest
import torch
from fresh_process import in_fresh_process

from fspec.kernels import gumbel
from fspec.kernels.gumbel import gumbel_sample, gumbel_sample_ref
from fspec.kernels.salts import SALT_DRAFT, SALT_RESIDUAL

# float32 probabilities from block-wise vs whole-row sums differ by a few ulps
PROB_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
POISON_TOKEN, POISON_PROB = -77, -3.0


def _inputs(n: int, v: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen) * 3).to(dtype)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 2.0, 0.3, 1.3])[:n]  # greedy and sampled rows mixed
    seeds = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen)
    positions = torch.randint(0, 1 << 31, (n,), generator=gen)
    return logits, temperature, seeds, positions


def _buffers(n: int, k: int, v: int):
    return torch.full((n, k), POISON_TOKEN, dtype=torch.int64), torch.full((n, k, v), POISON_PROB)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, v, block", [(7, 401, 128), (3, 1823, 256)])
def test_gumbel_kernel_matches_reference_and_writes_only_col(n, v, block, dtype):
    """Tokens equal the reference and land in column col of out_tokens / out_probs; other columns kept."""
    logits, temperature, seeds, positions = _inputs(n, v, dtype)
    k, col = 4, torch.tensor(2)
    out_tokens, out_probs = _buffers(n, k, v)
    tokens = gumbel_sample(
        logits,
        temperature,
        seeds,
        positions,
        out_tokens=out_tokens,
        out_probs=out_probs,
        col=col,
        block=block,
    )
    ref_tokens, ref_probs = _buffers(n, k, v)
    expected = gumbel_sample_ref(
        logits, temperature, seeds, positions, out_tokens=ref_tokens, out_probs=ref_probs, col=col
    )
    assert torch.equal(tokens, expected)
    assert torch.equal(out_tokens, ref_tokens)
    torch.testing.assert_close(out_probs, ref_probs, rtol=1e-5, atol=PROB_TOL[dtype])
    others = [0, 1, 3]
    assert bool((out_tokens[:, others] == POISON_TOKEN).all()) and bool(
        (out_probs[:, others] == POISON_PROB).all()
    )
    assert torch.equal(out_tokens[:, 2], tokens)
    # independent checks: greedy rows are argmax; probs are softmax(l / T) or one-hot
    x = logits.float()
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], x[greedy].argmax(-1))
    soft = torch.softmax(x / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    expected_probs = torch.where(greedy[:, None], torch.nn.functional.one_hot(tokens, v).float(), soft)
    torch.testing.assert_close(out_probs[:, 2], expected_probs, rtol=1e-5, atol=PROB_TOL[dtype])
    # the sampled rows are not all their argmax: the noise is really there
    assert not torch.equal(tokens[~greedy], x[~greedy].argmax(-1))


@pytest.mark.parametrize("map_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n, v, block", [(7, 401, 128), (3, 1031, 256)])
def test_gumbel_kernel_maps_ids_through_d2t_into_the_return_and_the_column(n, v, block, map_dtype):
    """With d2t, the returned ids and out_tokens' column are t + d2t[t] (EAGLE-3's target ids), equal to the
    reference; out_probs stays over the sampled vocabulary (one-hot at the draft id t for greedy rows)."""
    logits, temperature, seeds, positions = _inputs(n, v, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    d2t = torch.randint(0, 5000, (v,), generator=gen).to(map_dtype)  # irregular offsets, all ids >= 0
    k, col = 3, torch.tensor(1)
    out_tokens, out_probs = _buffers(n, k, v)
    got = gumbel_sample(
        logits, temperature, seeds, positions, out_tokens=out_tokens, out_probs=out_probs, col=col, d2t=d2t,
        block=block,
    )  # fmt: skip
    ref_tokens, ref_probs = _buffers(n, k, v)
    expected = gumbel_sample_ref(
        logits, temperature, seeds, positions, out_tokens=ref_tokens, out_probs=ref_probs, col=col, d2t=d2t
    )
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert torch.equal(out_tokens, ref_tokens) and torch.equal(out_tokens[:, 1], got)
    torch.testing.assert_close(out_probs, ref_probs, rtol=1e-5, atol=PROB_TOL[torch.float32])
    # independently: the same draws without the map, then mapped by hand
    plain_tokens, plain_probs = _buffers(n, k, v)
    plain = gumbel_sample(
        logits, temperature, seeds, positions, out_tokens=plain_tokens, out_probs=plain_probs, col=col,
        block=block,
    )  # fmt: skip
    assert torch.equal(got, plain + d2t[plain].long())
    greedy = temperature == 0
    one_hot = torch.nn.functional.one_hot(plain[greedy], v).float()
    assert torch.equal(out_probs[greedy, 1], one_hot)  # the draft id's one-hot, not the mapped id's
    assert bool((got != plain).any())  # the map really moved some ids


@pytest.mark.parametrize("n, v, block", [(7, 401, 128), (3, 1031, 256), (0, 64, 16)])
def test_gumbel_kernel_offsets_int32_positions_and_writes_the_next_column(n, v, block):
    """A draft step's call: int32 positions (its seq_lens) plus position_offset draw exactly what int64
    positions + offset draw, and next_col receives col + 1 (also for N = 0, where nothing launches)."""
    logits, temperature, seeds, positions = _inputs(n, v, torch.float32, seed=5)
    seq_lens = (positions % 100_000).to(torch.int32)
    k, col = 4, torch.tensor(2)
    got_tokens, got_probs = _buffers(n, k, v)
    next_col = torch.tensor(-9)
    got = gumbel_sample(
        logits, temperature, seeds, seq_lens, out_tokens=got_tokens, out_probs=got_probs, col=col,
        block=block, position_offset=1, next_col=next_col,
    )  # fmt: skip
    want_tokens, want_probs = _buffers(n, k, v)
    want = gumbel_sample(
        logits, temperature, seeds, seq_lens.long() + 1, out_tokens=want_tokens, out_probs=want_probs,
        col=col, block=block,
    )  # fmt: skip
    assert int(next_col) == 3
    assert (
        torch.equal(got, want) and torch.equal(got_tokens, want_tokens) and torch.equal(got_probs, want_probs)
    )
    ref_next = torch.tensor(-9)
    ref_tokens, ref_probs = _buffers(n, k, v)
    ref = gumbel_sample_ref(
        logits, temperature, seeds, seq_lens, out_tokens=ref_tokens, out_probs=ref_probs, col=col,
        position_offset=1, next_col=ref_next,
    )  # fmt: skip
    assert torch.equal(got, ref) and torch.equal(got_tokens, ref_tokens) and int(ref_next) == 3
    if n:  # the offset is really applied: without it, some sampled row draws another token
        plain = gumbel_sample(logits, temperature, seeds, seq_lens.long(), block=block)
        assert not torch.equal(plain, got)


def test_gumbel_kernel_without_out_buffers_matches_reference_and_salt_matters():
    """The tokens-only launch equals the reference; another salt draws different tokens."""
    logits, temperature, seeds, positions = _inputs(7, 401, torch.float32, seed=1)
    temperature = torch.full((7,), 2.0)
    tokens = gumbel_sample(logits, temperature, seeds, positions, block=64)
    assert torch.equal(tokens, gumbel_sample_ref(logits, temperature, seeds, positions))
    other = gumbel_sample(logits, temperature, seeds, positions, salt=SALT_RESIDUAL, block=64)
    assert torch.equal(other, gumbel_sample_ref(logits, temperature, seeds, positions, salt=SALT_RESIDUAL))
    assert not torch.equal(tokens, other)
    assert SALT_DRAFT != SALT_RESIDUAL


def test_gumbel_kernel_ties_go_to_the_smallest_token_id():
    """Equal maxima inside one block and across blocks resolve to the smallest token id."""
    v = 300
    logits = torch.zeros(3, v)
    logits[0, [7, 8, 250]] = 5.0  # tie inside block 0 and with block 3 (block 64)
    logits[1, [70, 130, 299]] = 5.0  # first maximum in block 1
    logits[2] = 1.0  # all equal
    temperature, seeds, positions = torch.zeros(3), torch.arange(3), torch.arange(3)
    out_tokens, out_probs = _buffers(3, 1, v)
    tokens = gumbel_sample(
        logits,
        temperature,
        seeds,
        positions,
        out_tokens=out_tokens,
        out_probs=out_probs,
        col=torch.tensor(0),
        block=64,
    )
    assert tokens.tolist() == [7, 70, 0]
    assert torch.equal(out_probs[:, 0], torch.nn.functional.one_hot(tokens, v).float())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gumbel_kernel_nan_never_wins_and_dead_rows_return_token_zero(temperature):
    """NaN logits are -inf; a row of NaN / -inf returns token 0 with a one-hot probability."""
    v = 200
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(3))
    nan_at = [0, 5, 64, 199]
    logits[0, nan_at] = float("nan")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[3] = float("nan")
    logits[3, 150] = float("-inf")
    logits[3, 97] = -1e30  # the only finite logit
    t = torch.full((4,), temperature)
    seeds, positions = torch.arange(4), torch.arange(4)
    out_tokens, out_probs = _buffers(4, 2, v)
    tokens = gumbel_sample(
        logits, t, seeds, positions, out_tokens=out_tokens, out_probs=out_probs, col=torch.tensor(1), block=64
    )
    ref_tokens, ref_probs = _buffers(4, 2, v)
    gumbel_sample_ref(
        logits, t, seeds, positions, out_tokens=ref_tokens, out_probs=ref_probs, col=torch.tensor(1)
    )
    assert int(tokens[0]) not in nan_at
    assert tokens[1:].tolist() == [0, 0, 97]
    one_hot = torch.nn.functional.one_hot(tokens[1:], v).float()
    assert torch.equal(out_probs[1:, 1], one_hot) and torch.equal(ref_probs[1:, 1], one_hot)
    assert torch.equal(out_tokens, ref_tokens)
    assert bool(torch.isfinite(out_probs).all())
    assert float(out_probs[0, 1, nan_at].abs().max()) == 0.0
    torch.testing.assert_close(out_probs, ref_probs, rtol=1e-5, atol=2e-6)


def test_gumbel_kernel_rows_reaching_inf_are_decided_greedily():
    """Compiled callers skip validation: a sampled row whose logits / T reach +inf — a +inf logit, two of
    them, or a temperature that overflows finite logits — takes its first raw argmax with a one-hot
    probability, in the kernel and the reference alike; no NaN anywhere; the other rows are unchanged."""
    v = 300
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, v, generator=gen) * 3
    logits[0, 170] = float("inf")  # one +inf: token 170
    logits[1, [40, 260]] = float("inf")  # two: the first, 40
    logits[2, 7], logits[2, 250] = 3e30, 5e30  # both overflow at T = 1e-9; the raw argmax is 250
    t = torch.tensor([1.0, 0.6, 1e-9, 0.8, 0.0])
    seeds, positions = torch.arange(5) + 9, torch.arange(5) * 4
    out_tokens, out_probs = _buffers(5, 2, v)
    tokens = gumbel_sample(
        logits, t, seeds, positions, out_tokens=out_tokens, out_probs=out_probs, col=torch.tensor(0), block=64
    )
    ref_tokens, ref_probs = _buffers(5, 2, v)
    ref = gumbel_sample_ref(
        logits, t, seeds, positions, out_tokens=ref_tokens, out_probs=ref_probs, col=torch.tensor(0)
    )
    assert tokens[:3].tolist() == ref[:3].tolist() == [170, 40, 250]
    assert torch.equal(tokens, ref) and torch.equal(out_tokens, ref_tokens)
    one_hot = torch.nn.functional.one_hot(tokens[:3], v).float()
    assert torch.equal(out_probs[:3, 0], one_hot) and torch.equal(ref_probs[:3, 0], one_hot)
    assert bool(torch.isfinite(out_probs).all()) and bool(torch.isfinite(ref_probs).all())
    torch.testing.assert_close(out_probs, ref_probs, rtol=0, atol=PROB_TOL[torch.float32])
    # rows 3 and 4 are what they are without the others (batch invariance)
    alone = gumbel_sample(logits[3:], t[3:], seeds[3:], positions[3:], block=64)
    assert torch.equal(alone, tokens[3:])


def test_tokens_per_program_come_from_the_call_or_the_default():
    """launch_block: an explicit block wins, else DEFAULT_BLOCK; a value that is not a power of two >= 4 is
    refused, naming the argument. The kernel's tokens do not depend on the block size (same Philox
    streams)."""
    from fspec.kernels.gumbel import DEFAULT_BLOCK, launch_block

    assert launch_block(None) == DEFAULT_BLOCK and launch_block(64) == 64 and launch_block(4) == 4
    for bad in (6, 2, 0, -8, True, 64.0, "128"):
        with pytest.raises(ValueError, match=r"^block: expected a power of two >= 4, got"):
            launch_block(bad)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 1031, generator=gen)
    t, seeds, positions = torch.tensor([0.0, 1.0, 1.7]), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    default = gumbel_sample(logits, t, seeds, positions)
    assert torch.equal(default, gumbel_sample(logits, t, seeds, positions, block=256))
    assert torch.equal(default, gumbel_sample(logits, t, seeds, positions, block=64))


def test_scratch_buffers_are_disjoint_contiguous_large_enough_and_16_byte_aligned():
    """The launchers' partial-result buffers come from one allocation: each is a flat buffer with room for
    its shape, starts on a 16-byte boundary (Triton specialises pointers on it) and shares no element with
    another."""
    shapes = [(3, 5), (3,), (1,), (2, 7)]
    for dtype in (torch.float32, torch.int64):
        bufs = gumbel.scratch(dtype, torch.device("cpu"), *shapes)
        assert len(bufs) == len(shapes)
        assert all(t.dim() == 1 and t.numel() >= math.prod(s) for t, s in zip(bufs, shapes))
        assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in bufs)
        for i, t in enumerate(bufs):
            t.fill_(i)
        assert all(bool((t == i).all()) for i, t in enumerate(bufs))


@pytest.mark.gpu
def test_gpu_finish_kernel_reads_the_logits_of_the_launch_before_its_block_kernel():
    in_fresh_process(__file__, globals(), "_gpu_finish_body")


def _gpu_finish_body():
    """On the H200 with PDL: a CUDA graph of a draft LM head (`skinny_linear`, which lets the next launch
    start once its first weight tile is requested) followed by `gumbel_sample` into a column (the block
    kernel, then the finish kernel, each waiting on the launch ahead before it reads), replayed with new
    hidden rows each time, and the same calls eagerly: the probabilities written equal the reference softmax
    over that replay's logits (a block read before the LM head finished would hold the last replay's),
    greedy rows get the one-hot of their exact argmax, sampled rows the reference's token (near-ties
    aside)."""
    from fspec.kernels import pdl

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    assert pdl.enabled(torch.empty(1, device=dev)), "the test is about PDL's early start"
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(32000, 2048, device=dev, generator=gen, dtype=torch.bfloat16) * (3 * 2048**-0.5)
    for temps in ([1.0], [0.7, 0.0, 1.3]):  # the one-row product, and three rows (a greedy one among them)
        _gpu_finish_case(torch.tensor(temps, device=dev), w, gen)


def _gpu_finish_case(temperature, w, gen, col=2):
    """One case of `_gpu_finish_body`: one row per temperature, the LM head's weight `w` [V, H]."""
    from fspec.kernels.skinny_linear import skinny_linear

    dev, n, (v, h) = w.device, len(temperature), w.shape
    x = torch.empty(n, h, device=dev, dtype=torch.bfloat16)
    seed = torch.arange(n, device=dev) * 7 + 11
    positions = torch.arange(n, device=dev) + 2000
    out_tokens = torch.full((n, 4), -1, dtype=torch.int64, device=dev)
    out_probs = torch.zeros(n, 4, v, device=dev)
    col_t, next_col = torch.tensor(col, device=dev), torch.zeros((), dtype=torch.int64, device=dev)
    greedy = temperature.cpu() == 0

    def step():
        logits = skinny_linear(x, w)
        tokens = gumbel.gumbel_sample(logits, temperature, seed, positions, salt=SALT_DRAFT,
                                      out_tokens=out_tokens, out_probs=out_probs, col=col_t,
                                      next_col=next_col)  # fmt: skip
        return logits, tokens

    def check(logits, tokens, what):
        ref_t, ref_p = torch.full((n, 4), -1, dtype=torch.int64), torch.zeros(n, 4, v)
        want = gumbel_sample_ref(logits.cpu(), temperature.cpu(), seed.cpu(), positions.cpu(),
                                 salt=SALT_DRAFT, out_tokens=ref_t, out_probs=ref_p,
                                 col=torch.tensor(col))  # fmt: skip
        assert torch.equal(tokens.cpu()[greedy], want[greedy]), what
        assert int((tokens.cpu() != want).sum()) <= 1, what
        assert torch.equal(out_tokens[:, col], tokens) and int(next_col) == col + 1, what
        torch.testing.assert_close(out_probs[:, col].cpu()[~greedy], ref_p[:, col][~greedy],
                                   rtol=1e-4, atol=1e-6, msg=what)  # fmt: skip
        hot = torch.nn.functional.one_hot(tokens.cpu()[greedy], v).float()
        assert torch.equal(out_probs[:, col].cpu()[greedy], hot), what

    x.copy_(torch.randn(n, h, device=dev, generator=gen))
    step()  # warm-up: compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits, static_tokens = step()
    for i in range(4):
        x.copy_(torch.randn(n, h, device=dev, generator=gen))  # new logits: stale ones would show
        out_probs.zero_()
        graph.replay()
        torch.cuda.synchronize()
        check(static_logits, static_tokens, f"replay {i}, n = {n}")
        x.copy_(torch.randn(n, h, device=dev, generator=gen))
        out_probs.zero_()
        logits, tokens = step()
        torch.cuda.synchronize()
        check(logits, tokens, f"eager {i}, n = {n}")


def _hard_rows(v: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose winner sits in a later chunk of blocks or ties across chunks: random sampled and greedy
    rows, an equal maximum in blocks 1 and 9 (greedy), +inf in blocks 4 and 7 (the first wins), logits
    overflowing at a tiny T, a dead row (NaN and -inf), and the maximum in the last, partial block."""
    logits = torch.randn(8, v, generator=gen) * 3
    logits[2, [20, 150]] = 9.0
    logits[3, [70, 120]] = float("inf")
    logits[4, 5], logits[4, v - 3] = 3e30, 5e30
    logits[5] = float("nan")
    logits[5, ::3] = float("-inf")
    logits[6, v - 1] = 12.0
    t = torch.tensor([0.9, 0.0, 0.0, 0.7, 1e-9, 1.1, 0.0, 1.4])
    return logits, t


# slow at 2 (six chunks, ~9 s interpreted): 8 runs the same chunk loop, over two chunks, the last one partial
@pytest.mark.parametrize("cap", [pytest.param(2, marks=pytest.mark.slow), 8])
def test_row_reductions_over_many_blocks_load_a_chunk_at_a_time(monkeypatch, cap):
    """MAX_REDUCE_BLOCKS lowered to 2 or 8 of the 12 vocabulary blocks (V = 187, block 16): the per-row
    reductions of the tokens-only and the column launches loop over chunks, the last one partial at 8
    (first maximal block kept across chunks, the softmax sum rescaled per chunk) and equal the reference:
    tokens exactly, the probabilities within the block-wise tolerance."""
    monkeypatch.setattr(gumbel, "MAX_REDUCE_BLOCKS", cap)
    v = 187
    assert gumbel.vocab_blocks(v, 16) == (16, 12, cap)
    logits, t = _hard_rows(v, torch.Generator().manual_seed(cap))
    seeds, positions = torch.arange(8) * 7 + 3, torch.arange(8) * 11
    tokens = gumbel_sample(logits, t, seeds, positions, block=16)
    want = gumbel_sample_ref(logits, t, seeds, positions)
    assert torch.equal(tokens, want)
    assert tokens[2:7].tolist() == [20, 70, v - 3, 0, v - 1]
    out_tokens, out_probs = _buffers(8, 3, v)
    ref_tokens, ref_probs = _buffers(8, 3, v)
    col = torch.tensor(1)
    got = gumbel_sample(logits, t, seeds, positions, out_tokens=out_tokens, out_probs=out_probs, col=col,
                        block=16)  # fmt: skip
    gumbel_sample_ref(logits, t, seeds, positions, out_tokens=ref_tokens, out_probs=ref_probs, col=col)
    assert torch.equal(got, want) and torch.equal(out_tokens, ref_tokens)
    torch.testing.assert_close(out_probs, ref_probs, rtol=1e-5, atol=PROB_TOL[torch.float32])


def test_tiny_blocks_of_a_large_vocabulary_grow_to_fit_grid_axis_1(monkeypatch):
    """The vocabulary blocks are grid axis 1 (CUDA: at most 65535): a block too small for V doubles until
    they fit (MAX_GRID_Y lowered to 3 here: 4 -> 16 tokens for V = 41), with the same tokens."""
    assert gumbel.vocab_blocks(49152, 2048) == (2048, 24, 32)  # SmolLM2 at the default block: unchanged
    assert gumbel.vocab_blocks(1 << 24, 4)[1] <= gumbel.MAX_GRID_Y  # philox.MAX_VOCAB at the smallest block
    monkeypatch.setattr(gumbel, "MAX_GRID_Y", 3)
    assert gumbel.vocab_blocks(41, 4) == (16, 3, 4)
    logits, temperature, seeds, positions = _inputs(7, 41, torch.float32, seed=2)
    got = gumbel_sample(logits, temperature, seeds, positions, block=4)
    assert torch.equal(got, gumbel_sample_ref(logits, temperature, seeds, positions))
