"""Philox4x32-10: Random123 known answers, and the PyTorch reference against Triton bit for bit."""

import pytest
import torch
import triton
import triton.language as tl

from fspec.kernels.philox import (
    MAX_VOCAB,
    POSITION_MASK,
    UNIFORM_SCALE,
    log_near_one,
    log_unit,
    philox4x32_ref,
    philox_gumbel_ref,
    philox_gumbel_tile,
    philox_offset,
    philox_offset_ref,
    philox_uniform_ref,
    philox_uniform_tile,
    randint4x_ref,
    uint_to_uniform_float_ref,
)
from fspec.kernels.salts import MAX_SALT, SALT_ACCEPT, SALT_BONUS, SALT_DRAFT, SALT_RESIDUAL

# Random123 v1.14.0, tests/kat_vectors, "philox4x32 10" lines: counter words, key words, output words.
KAT = [
    ("00000000 00000000 00000000 00000000", "00000000 00000000", "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    ("ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    ("243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "d16cfe09 94fdcceb 5001e420 24126ea1"),
]


def _words(text: str) -> list[torch.Tensor]:
    return [torch.tensor(int(w, 16), dtype=torch.int64) for w in text.split()]


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_philox_reference_reproduces_random123_known_answers(counter, key, expected):
    """philox4x32_ref gives Random123's published Philox4x32-10 outputs."""
    out = philox4x32_ref(*_words(counter), *_words(key))
    assert [f"{int(w):08x}" for w in out] == expected.split()


@triton.jit
def _randint4x_probe_kernel(
    seed_ptr,  # [S] int64 seeds
    offset_ptr,  # [M] int64 offsets
    words_ptr,  # [S, 4, M] int64 out: the four uint32 words of tl.randint4x
    uniform_ptr,  # [S, M] float32 out: tl.rand
    M,  # number of offsets
    BLOCK: tl.constexpr,  # >= M
):
    s = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    live = i < M
    seed = tl.load(seed_ptr + s)
    offset = tl.load(offset_ptr + i, mask=live)
    w0, w1, w2, w3 = tl.randint4x(seed, offset)
    base = words_ptr + s * 4 * M + i
    tl.store(base, w0.to(tl.int64) & 0xFFFFFFFF, mask=live)
    tl.store(base + M, w1.to(tl.int64) & 0xFFFFFFFF, mask=live)
    tl.store(base + 2 * M, w2.to(tl.int64) & 0xFFFFFFFF, mask=live)
    tl.store(base + 3 * M, w3.to(tl.int64) & 0xFFFFFFFF, mask=live)
    tl.store(uniform_ptr + s * M + i, tl.rand(seed, offset), mask=live)


def test_philox_reference_equals_triton_randint4x_and_rand_bit_for_bit():
    """randint4x_ref / uint_to_uniform_float_ref equal tl.randint4x / tl.rand for int64 seeds and offsets."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.tensor([0, 1, 12345, -7, (1 << 62) + 11, -(1 << 63), (1 << 63) - 1], dtype=torch.int64)
    edge = [0, 1, -1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, -(1 << 63)]
    random = torch.randint(-(1 << 63), (1 << 63) - 1, (300,), dtype=torch.int64, generator=gen)
    offsets = torch.cat([torch.tensor(edge, dtype=torch.int64), random])  # [M]
    m = offsets.numel()
    words = torch.empty((len(seeds), 4, m), dtype=torch.int64)
    uniform = torch.empty((len(seeds), m), dtype=torch.float32)
    _randint4x_probe_kernel[(len(seeds),)](seeds, offsets, words, uniform, m, BLOCK=512)
    ref = torch.stack(randint4x_ref(seeds[:, None], offsets[None, :]), dim=1)  # [S, 4, M]
    assert torch.equal(words, ref)
    ref_u = uint_to_uniform_float_ref(ref[:, 0])
    assert torch.equal(uniform.view(torch.int32), ref_u.view(torch.int32))


@triton.jit
def _uniform_conversion_probe_kernel(
    x_ptr,  # [M] int32: uint32 bit patterns
    u_ptr,  # [M] float32 out
    M,  # number of values
    BLOCK: tl.constexpr,  # >= M
):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < M).to(tl.uint32, bitcast=True)
    tl.store(u_ptr + i, tl.uint_to_uniform_float(x), mask=i < M)


def test_uniform_conversion_matches_triton_at_the_extremes_and_stays_below_one():
    """The uint32 -> [0, 1) conversion agrees with Triton on 0, 2^31 +- 1, 2^32 - 1 and never reaches 1."""
    bits = [
        0,
        1,
        2,
        (1 << 31) - 2,
        (1 << 31) - 1,
        1 << 31,
        (1 << 31) + 1,
        (1 << 32) - 2,
        (1 << 32) - 1,
        12345,
    ]
    x = torch.tensor(bits, dtype=torch.int64)
    u = torch.empty(len(bits), dtype=torch.float32)
    _uniform_conversion_probe_kernel[(1,)](
        torch.where(x >= 1 << 31, x - (1 << 32), x).int(), u, len(bits), BLOCK=16
    )
    ref = uint_to_uniform_float_ref(x)
    assert torch.equal(u.view(torch.int32), ref.view(torch.int32))
    assert ref[0] == 0.0 and ref[-2] == 0.0  # 0 and 2^32 - 1 (int32 -1 folds to 0) both map to 0
    assert float(ref.max()) == float(ref[4]) < 1.0  # 2^31 - 1 is the largest, still below 1


@triton.jit
def _tile_probe_kernel(
    seed_ptr,  # [R] int64
    position_ptr,  # [R] int64
    offset_ptr,  # [R, G] int64 out: philox_offset of (position, group, salt)
    uniform_ptr,  # [R, 4 * G] float32 out: philox_uniform_tile
    gumbel_ptr,  # [R, 4 * G] float32 out: philox_gumbel_tile
    SALT: tl.constexpr,  # stream salt
    GROUPS: tl.constexpr,  # token groups per row
):
    r = tl.program_id(0)
    seed = tl.load(seed_ptr + r)
    position = tl.load(position_ptr + r)
    g = tl.arange(0, GROUPS).to(tl.int64)
    tl.store(offset_ptr + r * GROUPS + g, philox_offset(position, g, SALT))
    token = 4 * g[:, None] + tl.arange(0, 4)[None, :]
    start = tl.zeros([], dtype=tl.int64)
    tl.store(uniform_ptr + r * 4 * GROUPS + token, philox_uniform_tile(seed, position, SALT, start, GROUPS))
    tl.store(gumbel_ptr + r * 4 * GROUPS + token, philox_gumbel_tile(seed, position, SALT, start, GROUPS))


@pytest.mark.parametrize("salt", [SALT_DRAFT, SALT_BONUS, MAX_SALT - 1])
def test_triton_noise_tiles_equal_the_reference(salt):
    """philox_offset / philox_uniform_tile / philox_gumbel_tile equal the reference (uniforms bitwise)."""
    seeds = torch.tensor([3, -5, 1 << 40, 0], dtype=torch.int64)
    positions = torch.tensor([0, 17, POSITION_MASK, -1], dtype=torch.int64)
    groups = 16
    offsets = torch.empty((4, groups), dtype=torch.int64)
    uniform = torch.empty((4, 4 * groups), dtype=torch.float32)
    gumbel = torch.empty((4, 4 * groups), dtype=torch.float32)
    _tile_probe_kernel[(4,)](seeds, positions, offsets, uniform, gumbel, SALT=salt, GROUPS=groups)
    g = torch.arange(groups)
    assert torch.equal(offsets, philox_offset_ref(positions[:, None], g, salt))
    tokens = torch.arange(4 * groups)
    ref_u = philox_uniform_ref(seeds[:, None], positions[:, None], tokens, salt)
    assert torch.equal(uniform.view(torch.int32), ref_u.view(torch.int32))
    ref_g = philox_gumbel_ref(seeds, positions, 4 * groups, salt)
    assert torch.equal(ref_g, -torch.log(-torch.log(ref_u)))
    torch.testing.assert_close(gumbel, ref_g, rtol=1e-6, atol=1e-6)


def test_philox_counter_fields_never_collide():
    """Distinct (position, token group, salt) give distinct offsets, including each field's extremes."""
    positions = torch.tensor([0, 1, 2, 1000, POSITION_MASK - 1, POSITION_MASK], dtype=torch.int64)
    groups = torch.tensor([0, 1, 2, 1 << 20, MAX_VOCAB // 4 - 2, MAX_VOCAB // 4 - 1], dtype=torch.int64)
    salts = [SALT_DRAFT, SALT_ACCEPT, SALT_RESIDUAL, SALT_BONUS, MAX_SALT - 2, MAX_SALT - 1]
    offsets = torch.stack([philox_offset_ref(positions[:, None], groups[None, :], s) for s in salts])
    assert offsets.unique().numel() == offsets.numel() == 6 * 6 * 6
    assert bool((offsets >= 0).all()), "the salt field must leave the int64 sign bit clear"
    # the padding position -1 wraps onto the last position, not onto a neighbouring salt's stream
    assert torch.equal(
        philox_offset_ref(torch.tensor(-1), groups, 1),
        philox_offset_ref(torch.tensor(POSITION_MASK), groups, 1),
    )


def test_noise_streams_differ_by_seed_position_token_and_salt():
    """Changing any one of seed, position, token id or salt changes the uniform."""
    base = dict(seed=torch.tensor(7), position=torch.tensor(100), token_id=torch.tensor(5), salt=SALT_DRAFT)
    u0 = philox_uniform_ref(**base)
    changes = [dict(seed=torch.tensor(8)), dict(position=torch.tensor(101)), dict(token_id=torch.tensor(6))]
    for change in [*changes, dict(token_id=torch.tensor(9)), dict(salt=SALT_RESIDUAL)]:
        assert philox_uniform_ref(**{**base, **change}) != u0, change
    u = philox_uniform_ref(
        torch.tensor(7), torch.arange(64)[:, None], torch.arange(256)[None, :], SALT_ACCEPT
    )
    assert u.unique().numel() > 0.999 * u.numel()
    # uniform moments over 16384 values: mean 1/2 +- 4.5 sigma (sigma = 0.0023), variance 1/12 +- 5%
    assert abs(float(u.mean()) - 0.5) < 0.0102 and abs(float(u.var()) - 1 / 12) < 0.0042


@triton.jit
def _log_unit_probe_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, log_unit(tl.load(u_ptr + i, mask=ok, other=0.5)), mask=ok)


def test_log_unit_is_within_one_ulp_of_the_true_log_on_every_kind_of_uniform():
    """`log_unit` (the inner log of the Gumbel noise) against float64: within 1 ulp of float32 on random
    uniforms, on the 2^31 - 1 grid's smallest values, on the values closest to 1 (where -log(u) is tiny and
    its relative error becomes the noise's absolute error), around sqrt(1/2) (the range reduction's seam),
    and -inf at 0."""
    gen = torch.Generator().manual_seed(0)
    below_one = 1.0 - torch.arange(1, 4097, dtype=torch.float64) * 2.0**-24
    seam = torch.tensor(0.5**0.5, dtype=torch.float64) * (1 + torch.arange(-2048, 2048) * 2.0**-23)
    u = torch.cat(
        [
            torch.rand(200_000, generator=gen, dtype=torch.float64),
            torch.arange(1, 4097, dtype=torch.float64) * UNIFORM_SCALE,
            below_one,
            seam,
            torch.tensor([0.5, 0.25, 2.0**-31, 0.0], dtype=torch.float64),
        ]
    ).float()
    out = torch.empty_like(u)
    _log_unit_probe_kernel[(triton.cdiv(len(u), 4096),)](u, out, len(u), BLOCK=4096)
    assert out[-1] == float("-inf") and torch.isfinite(out[:-1]).all()
    truth = torch.log(u[:-1].double())
    ulp = (truth.float().abs().nextafter(torch.tensor(float("inf"))) - truth.float().abs()).double()
    err_ulp = ((out[:-1].double() - truth).abs() / ulp).max().item()
    assert err_ulp <= 1.0, err_ulp


@triton.jit
def _log_near_one_probe_kernel(u_ptr, out_ptr, neg_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    u = tl.load(u_ptr + i, mask=ok, other=0.9)
    tl.store(out_ptr + i, log_near_one(u), mask=ok)
    tl.store(neg_ptr + i, log_near_one(u, -1.0), mask=ok)


def test_log_near_one_keeps_relative_accuracy_where_the_fast_inner_log_uses_it():
    """`log_near_one`, the side of the GPU's fast inner log (`neg_log_unit_fast`) that handles u > 3/4,
    against float64 in float32 arithmetic without fused multiply-adds (the GPU's FMAs round less): within
    1.3e-7 relative error (~2 ulp) on every float32 in [3/4, 1) near both ends and on random uniforms there,
    including the 4096 values just below 1 where -log(u) is tiny. SIGN = -1 (the sign folded into the
    coefficients) gives exactly the negation."""
    gen = torch.Generator().manual_seed(1)
    u = torch.cat(
        [
            0.75 + 0.25 * torch.rand(200_000, generator=gen, dtype=torch.float64),
            1.0 - torch.arange(1, 4097, dtype=torch.float64) * 2.0**-24,
            0.75 + torch.arange(0, 4096, dtype=torch.float64) * 2.0**-24,
        ]
    ).float()
    out, neg = torch.empty_like(u), torch.empty_like(u)
    _log_near_one_probe_kernel[(triton.cdiv(len(u), 4096),)](u, out, neg, len(u), BLOCK=4096)
    truth = torch.log(u.double())
    rel = ((out.double() - truth).abs() / truth.abs()).max().item()
    assert rel <= 1.3e-7, rel
    assert torch.equal(neg, -out)
