"""Rejection-sampling kernels (interpreted) against the PyTorch reference, token for token."""

import pytest
import torch

from fspec.kernels.gumbel import gumbel_sample_ref
from fspec.kernels.rejection import rejection_sample, rejection_sample_ref
from fspec.kernels.salts import SALT_BONUS, SALT_DRAFT, SALT_RESIDUAL


def _draft(target_logits, temperature, seeds, positions, *, sampled: bool, closeness: float, gen):
    """Draft tokens and q from draft logits = target logits + noise, sampled like a real draft step."""
    b, k1, v = target_logits.shape
    k = k1 - 1
    draft_logits = target_logits[:, :k].float() + torch.randn(b, k, v, generator=gen) * closeness
    tokens = torch.empty((b, k), dtype=torch.int64)
    probs = torch.empty((b, k, v))
    draft_t = temperature if sampled else torch.zeros_like(temperature)
    for i in range(k):
        gumbel_sample_ref(
            draft_logits[:, i], draft_t, seeds, positions + i, salt=SALT_DRAFT,
            out_tokens=tokens, out_probs=probs, col=torch.tensor(i),
        )  # fmt: skip
    return tokens, (probs if sampled else None)


def _check_layout(tokens, num_accepted, drafts, v):
    k = drafts.shape[1]
    slot = torch.arange(k + 1)
    assert bool(((num_accepted >= 0) & (num_accepted <= k)).all())
    padded = torch.nn.functional.pad(drafts, (0, 1), value=-1)
    before = slot < num_accepted[:, None]
    assert torch.equal(tokens[before], padded[before])
    assert bool((tokens[slot > num_accepted[:, None]] == -1).all())
    emitted = tokens.gather(1, num_accepted[:, None])
    assert bool(((emitted >= 0) & (emitted < v)).all())


CASES = {
    # name: (B, K, V, block, dtype, temperatures, sampled drafts)
    "sampled_fp32": (5, 3, 401, 128, torch.float32, [0.8, 1.0, 0.5, 1.3, 0.9], True),
    "sampled_bf16": (5, 3, 401, 256, torch.bfloat16, [0.8, 1.0, 0.5, 1.3, 0.9], True),
    "greedy_drafts": (5, 3, 401, 256, torch.float32, [0.8, 1.0, 0.5, 1.3, 0.9], False),
    "greedy_target": (5, 3, 401, 256, torch.float32, [0.0] * 5, True),
    "mixed": (5, 3, 401, 256, torch.float16, [0.0, 1.0, 0.0, 1.3, 0.7], True),
    "long_k": (2, 8, 150, 64, torch.float32, [1.0, 0.0], True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_kernel_matches_reference(case):
    """Kernel tokens and acceptance counts equal the reference on irregular shapes."""
    b, k, v, block, dtype, temps, sampled = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    target = (torch.randn(b, k + 1, v, generator=gen) * 2).to(dtype)
    temperature = torch.tensor(temps)
    seeds = torch.randint(-(1 << 62), 1 << 62, (b,), generator=gen)
    positions = torch.randint(0, (1 << 31) - k - 1, (b,), generator=gen)
    drafts, q = _draft(target, temperature, seeds, positions, sampled=sampled, closeness=0.3, gen=gen)
    drafts[0] = target[0, :k].float().argmax(-1)  # row 0: greedy target accepts all of these
    if q is not None:
        q[0] = torch.nn.functional.one_hot(drafts[0], v).float()  # keep (drafts, q) consistent for row 0
    tokens, n = rejection_sample(target, drafts, q, temperature, seeds, positions, block=block)
    ref_tokens, ref_n = rejection_sample_ref(target, drafts, q, temperature, seeds, positions)
    assert torch.equal(tokens, ref_tokens) and torch.equal(n, ref_n)
    _check_layout(tokens, n, drafts, v)
    assert len(set(n.tolist())) > 1, f"want both early rejections and acceptances in one batch, got {n}"


def test_rejection_kernel_draft_equal_to_target_accepts_all_and_samples_the_bonus():
    """q = p accepts every draft; the bonus equals gumbel_sample at slot K with SALT_BONUS."""
    b, k, v = 4, 3, 301
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(b, k + 1, v, generator=gen) * 2
    temperature = torch.tensor([0.6, 1.0, 1.7, 0.0])
    seeds, positions = torch.arange(b) * 31 + 1, torch.arange(b) * 1000
    drafts, q = torch.empty((b, k), dtype=torch.int64), torch.empty((b, k, v))
    for i in range(k):
        col = torch.tensor(i)
        gumbel_sample_ref(
            target[:, i], temperature, seeds, positions + i, out_tokens=drafts, out_probs=q, col=col
        )
    tokens, n = rejection_sample(target, drafts, q, temperature, seeds, positions, block=128)
    assert n.tolist() == [k] * b
    assert torch.equal(tokens[:, :k], drafts)
    bonus = gumbel_sample_ref(target[:, k], temperature, seeds, positions + k, salt=SALT_BONUS)
    assert torch.equal(tokens[:, k], bonus)
    ref_tokens, ref_n = rejection_sample_ref(target, drafts, q, temperature, seeds, positions)
    assert torch.equal(tokens, ref_tokens) and torch.equal(n, ref_n)


def test_rejection_kernel_without_residual_mass_falls_back_to_sampling_p():
    """p == q (exactly 1/4 on 4 tokens) and a draft with q(x) = 0: rejected, replacement drawn from p."""
    b, k, v = 3, 3, 70
    support = torch.tensor([3, 10, 40, 69])
    target = torch.full((b, k + 1, v), float("-inf"))
    target[:, :, support] = 0.0
    q = torch.zeros(b, k, v)
    q[:, :, support] = 0.25
    drafts = torch.full((b, k), 5, dtype=torch.int64)  # p(5) = q(5) = 0
    temperature, seeds, positions = torch.ones(b), torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9])
    tokens, n = rejection_sample(target, drafts, q, temperature, seeds, positions, block=32)
    assert n.tolist() == [0] * b
    fallback = gumbel_sample_ref(target[:, 0], temperature, seeds, positions, salt=SALT_RESIDUAL)
    assert torch.equal(tokens[:, 0], fallback)
    assert bool(torch.isin(fallback, support).all())
    ref_tokens, ref_n = rejection_sample_ref(target, drafts, q, temperature, seeds, positions)
    assert torch.equal(tokens, ref_tokens) and torch.equal(n, ref_n)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rejection_kernel_nan_and_dead_target_rows(temperature):
    """NaN target logits never win; a slot with no finite logit acts as a one-hot at token 0."""
    b, k, v = 3, 2, 90
    target = torch.randn(b, k + 1, v, generator=torch.Generator().manual_seed(9))
    target[0, 0] = float("nan")  # dead slot 0: emits token 0 whatever the draft
    target[1, 0] = float("-inf")
    target[1, 0, 0] = float("nan")
    target[2, :, :40] = float("nan")  # NaN on tokens < 40 everywhere, drafts point at them
    drafts = torch.tensor([[7, 8], [0, 3], [12, 20]])
    t, seeds, positions = torch.full((b,), temperature), torch.arange(b), torch.arange(b)
    tokens, n = rejection_sample(target, drafts, None, t, seeds, positions, block=32)
    ref_tokens, ref_n = rejection_sample_ref(target, drafts, None, t, seeds, positions)
    assert torch.equal(tokens, ref_tokens) and torch.equal(n, ref_n)
    assert int(tokens[0, 0]) == 0 and int(n[0]) == 0  # draft 7 rejected, one-hot at 0 emitted
    assert int(tokens[1, 0]) == 0 and int(n[1]) >= 1  # draft 0 accepted in the dead slot
    assert int(n[2]) == 0 and int(tokens[2, 0]) >= 40  # p(12) = 0: rejected, replacement outside the NaNs


def test_rejection_kernel_slots_reaching_inf_verify_greedily():
    """A sampled slot whose target logits / T reach +inf verifies greedily against the raw argmax: a draft
    equal to it is accepted, another one is replaced by it, the bonus is it; slots and requests without +inf
    keep their sampled verification. Kernel and reference agree, tokens are valid ids."""
    gen = torch.Generator().manual_seed(8)
    b, k, v = 4, 3, 97
    target = torch.randn(b, k + 1, v, generator=gen) * 2
    target[0, 0, 11] = float("inf")  # request 0, slot 0: argmax 11
    target[1, 1, [5, 60]] = float("inf")  # request 1, slot 1: the first +inf, 5
    target[2, :, 30] = 2e30  # request 2: every slot overflows at T = 1e-9 (point mass at 30)
    target[2, :, 31] = 1e30
    temperature = torch.tensor([1.0, 0.7, 1e-9, 0.9])
    seeds, positions = torch.arange(b) + 3, torch.arange(b) * 10
    drafts, q = _draft(target, temperature, seeds, positions, sampled=True, closeness=0.5, gen=gen)
    drafts[0, 0] = 11  # accepted (slot 0 of request 0 is greedy and 11 its argmax)
    drafts[1, :] = torch.tensor([int(drafts[1, 0]), 7, 5])  # slot 1 rejects 7, replaced by 5
    drafts[2] = torch.tensor([30, 30, 30])  # all accepted, bonus 30
    tokens, n = rejection_sample(target, drafts, q, temperature, seeds, positions, block=32)
    ref_tokens, ref_n = rejection_sample_ref(target, drafts, q, temperature, seeds, positions)
    assert torch.equal(tokens, ref_tokens) and torch.equal(n, ref_n)
    _check_layout(tokens, n, drafts, v)
    assert int(n[0]) >= 1 and int(tokens[0, 0]) == 11
    if int(n[1]) >= 1:  # slot 0 of request 1 is sampled; when it is accepted, slot 1 is the greedy one
        assert int(n[1]) == 1 and int(tokens[1, 1]) == 5
    assert int(n[2]) == k and tokens[2].tolist() == [30, 30, 30, 30]


@pytest.mark.parametrize("sampled", [True, False])
def test_decide_and_finalize_loop_over_slot_and_block_chunks(monkeypatch, sampled):
    """Caps lowered: the decide kernel walks K + 1 = 6 slots 2 at a time and 10 vocabulary blocks 2 at a
    time (MAX_DECIDE_SLOTS, MAX_DECIDE_TILE), the finalize kernel 4 at a time (MAX_REDUCE_BLOCKS, the last
    chunk partial):
    tokens and counts equal the reference, first rejections in every chunk of slots among them; greedy
    and sampled targets, with a +inf slot and a dead one."""
    from fspec.kernels import gumbel, rejection

    monkeypatch.setattr(gumbel, "MAX_REDUCE_BLOCKS", 4)
    monkeypatch.setattr(rejection, "MAX_DECIDE_SLOTS", 2)
    monkeypatch.setattr(rejection, "MAX_DECIDE_TILE", 4)
    b, k, v, block = 6, 5, 150, 16
    assert rejection.decide_tiles(k + 1, gumbel.vocab_blocks(v, block)[2]) == (2, 2)
    gen = torch.Generator().manual_seed(21 + sampled)
    target = torch.randn(b, k + 1, v, generator=gen) * 2
    target[4, 2, 33] = float("inf")  # a slot that verifies greedily (point mass at 33)
    target[5, 1] = float("nan")  # a dead slot: one-hot at token 0
    temperature = torch.tensor([0.9, 0.0, 1.2, 0.7, 1.0, 0.0])
    seeds, positions = torch.arange(b) * 5 + 2, torch.arange(b) * 17
    drafts, q = _draft(target, temperature, seeds, positions, sampled=sampled, closeness=0.2, gen=gen)
    greedy = target[:, :k].float().argmax(-1)
    drafts[0] = greedy[0]  # request 0 (sampled target) likely accepts far
    drafts[1, :4] = greedy[1, :4]  # request 1 (greedy target): rejects at slot 4 (third slot chunk)
    drafts[1, 4] = (greedy[1, 4] + 1) % v
    drafts[3, :2] = greedy[3, :2]
    if q is not None:
        q[0] = torch.nn.functional.one_hot(drafts[0], v).float()
    tokens, n = rejection.rejection_sample(target, drafts, q, temperature, seeds, positions, block=block)
    ref_tokens, ref_n = rejection_sample_ref(target, drafts, q, temperature, seeds, positions)
    assert torch.equal(tokens, ref_tokens) and torch.equal(n, ref_n)
    _check_layout(tokens, n, drafts, v)
    assert int(n[1]) == 4 and len(set(n.tolist())) > 2, n


GREEDY_CASES = {
    # name: (B, K, V, dtype, options)
    "one_request_k5": (1, 5, 4099, torch.float32, False),
    "irregular": (5, 3, 401, torch.float32, True),
    "bf16_long_k": (3, 9, 97, torch.bfloat16, False),
    "fp16_one_draft": (4, 1, 33, torch.float16, True),
    "empty_batch": (0, 3, 50, torch.float32, False),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_batch_reference_skips_noise_and_matches_the_general_path(monkeypatch, case):
    """A batch whose every temperature is 0 verifies by argmax alone in the reference (no softmax, no Philox
    draw, no filter): tokens and counts equal the general path's on irregular shapes, half-precision logits,
    ties (the smallest id wins), NaN, dead (-inf / NaN) and +inf slots, drafts that match a prefix of the
    argmaxes, out-of-range draft ids, and sampling options (inactive at temperature 0)."""
    from fspec.kernels import rejection

    b, k, v, dtype, options = GREEDY_CASES[case]
    gen = torch.Generator().manual_seed(len(case) + 100)
    target = (torch.randn(b, k + 1, v, generator=gen) * 3).round().to(dtype)  # rounding: many ties
    if b:
        target[0, 0, 5] = float("nan")
        target[-1, 0] = float("-inf")  # a dead slot: argmax 0
        target[b // 2, k, 7] = float("inf")
        if k > 1:
            target[-1, 1] = float("nan")
    greedy = rejection.first_argmax_ref(rejection.clean_logits_ref(target))
    drafts = torch.randint(0, v, (b, k), generator=gen)
    for i in range(b):  # request i matches the argmax on its first i % (k + 1) slots
        take = i % (k + 1)
        drafts[i, :take] = greedy[i, :take]
    if b > 2:
        drafts[2, -1] = v + 3  # never an argmax: rejected
    temperature = torch.zeros(b)
    seeds, positions = torch.arange(b) * 7 + 1, torch.arange(b) * 13
    q = torch.softmax(torch.randn(b, k, v, generator=gen), -1) if b % 2 else None
    opts = ()
    if options:
        opts = (torch.full((b,), 3), torch.full((b,), 0.5), torch.full((b,), 0.1))
    want = rejection._rejection_sample_general_ref(target, drafts, q, temperature, seeds, positions, *opts)

    def refuse(*args, **kwargs):
        raise AssertionError("a greedy batch drew noise or took a softmax")

    for name in ("philox_gumbel_ref", "philox_uniform_ref", "softmax_ref", "sampling_filter_ref"):
        monkeypatch.setattr(rejection, name, refuse)
    got = rejection.rejection_sample_ref(target, drafts, q, temperature, seeds, positions, *opts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if b:
        _check_layout(got[0], got[1], drafts.clamp(max=v - 1), v)
        assert len(set(got[1].tolist())) > 1 or b == 1


def test_batch_with_a_sampled_request_takes_the_general_path():
    """One request at temperature > 0 beside greedy ones: the whole batch runs the general path (its sampled
    request's noise is drawn exactly as before), with the general path's tokens."""
    from fspec.kernels import rejection

    b, k, v = 3, 4, 301
    gen = torch.Generator().manual_seed(31)
    target = torch.randn(b, k + 1, v, generator=gen) * 2
    temperature = torch.tensor([0.0, 0.8, 0.0])
    seeds, positions = torch.arange(b) + 11, torch.arange(b) * 40
    drafts, q = _draft(target, temperature, seeds, positions, sampled=True, closeness=0.3, gen=gen)
    want = rejection._rejection_sample_general_ref(target, drafts, q, temperature, seeds, positions)
    got = rejection.rejection_sample_ref(target, drafts, q, temperature, seeds, positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert rejection._no_sampled_request(temperature) is False
    assert rejection._no_sampled_request(torch.zeros(b)) is True
