"""Counter-based RNG: Philox4x32-10 exactly as Triton's `tl.randint4x` / `tl.rand`, plus a PyTorch twin.

Every random number in fspec is a pure function of `(seed, position, token id, salt)`:

    key     = (seed mod 2^32, (seed >> 32) mod 2^32)        # the whole int64 seed, two's complement
    offset  = salt * 2^53 + (position mod 2^31) * 2^22 + token_id // 4          # int64, fields disjoint
    counter = (offset mod 2^32, offset >> 32, 0, 0)          # what `tl.randint4x(seed, offset)` builds
    word    = Philox4x32-10(counter, key)[token_id mod 4]    # uint32
    u       = uniform(word)                                  # float32 in [0, 1), `tl.uint_to_uniform_float`
    gumbel  = -log(-log(u))                                  # u = 0 gives -inf: that token never wins

Field widths: token_id < 2^24 (22 bits of token groups), position < 2^31, salt < 2^10 (10 bits; the sign bit
stays 0), so streams of distinct (position, token id, salt) never share a counter, and distinct seeds never
share a key. Negative positions (padding rows use -1) are taken mod 2^31: -1 reads the stream of position
2^31 - 1, which is harmless because padding outputs are discarded.

Four tokens share one Philox evaluation (one per output word). Estimate, not yet measured: ten rounds cost
~60 integer instructions per evaluation, so one evaluation per token would make a 256 x 128256 Gumbel pass
compute-bound on an H200 (~2e9 instructions, ~120 us at ~16.7 int32 Tops/s, versus ~30 us to read the 131 MB
of logits at 4.2 TB/s); four tokens per evaluation bring Philox under the memory time.

The reference functions emulate uint32 arithmetic in int64 tensors (values kept in [0, 2^32)), splitting the
32 x 32-bit products into 16-bit halves so nothing overflows int64. They reproduce Random123's known-answer
vectors and Triton's output bit for bit (tests/kernels/test_philox.py).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import libdevice

# Philox4x32 constants (Random123 / triton.language.random).
PHILOX_KEY_A = 0x9E3779B9  # Weyl increment of key word 0 per round
PHILOX_KEY_B = 0xBB67AE85  # Weyl increment of key word 1 per round
PHILOX_ROUND_A = 0xD2511F53  # multiplier of counter word 0
PHILOX_ROUND_B = 0xCD9E8D57  # multiplier of counter word 2
PHILOX_ROUNDS = 10
# `uint_to_uniform_float`: largest scale with (2^31 - 1) * scale < 1 after float32 rounding.
UNIFORM_SCALE = 4.6566127342e-10

SALT_SHIFT = 53  # offset bits [53, 63): salt
POSITION_SHIFT = 22  # offset bits [22, 53): position mod 2^31
POSITION_MASK = (1 << 31) - 1
MAX_VOCAB = 1 << 24  # token_id // 4 must fit in the 22 low bits
_MASK32 = 0xFFFFFFFF

_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
_NEG_LN2: tl.constexpr = tl.constexpr(-0.6931471805599453)
_KEY_A: tl.constexpr = tl.constexpr(PHILOX_KEY_A)
_KEY_B: tl.constexpr = tl.constexpr(PHILOX_KEY_B)
_ROUND_A: tl.constexpr = tl.constexpr(PHILOX_ROUND_A)
_ROUND_B: tl.constexpr = tl.constexpr(PHILOX_ROUND_B)
_ROUNDS: tl.constexpr = tl.constexpr(PHILOX_ROUNDS)
_SALT_UNIT: tl.constexpr = tl.constexpr(1 << SALT_SHIFT)
_POSITION_UNIT: tl.constexpr = tl.constexpr(1 << POSITION_SHIFT)
_POSITION_MASK: tl.constexpr = tl.constexpr(POSITION_MASK)


# ----------------------------------------------------------------------------------------------------------
# Triton side (inlined into the sampling kernels)
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def philox_offset(
    position,  # int64 scalar or block: the token's position in its sequence
    group,  # int64 scalar or block: token_id // 4
    salt,  # int (constexpr) or int64 scalar: stream salt, < 2^10
):
    """The int64 Philox offset of `(position, token group, salt)`; see the module docstring."""
    # tensor terms first: constexpr + tensor would wrap the sum in a constexpr under the interpreter
    return (position & _POSITION_MASK) * _POSITION_UNIT + group + salt * _SALT_UNIT


@triton.jit
def _wide_mul(a: tl.constexpr, x):
    """(hi, lo) 32-bit words of a * x for a uint32 constant and a uint32 block: one 32 x 32 -> 64-bit multiply
    (IMAD.WIDE on NVIDIA GPUs) instead of separate mul.hi and mul.lo."""
    p = x.to(tl.uint64) * a
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def philox4x32(
    c0,  # uint32 block: counter word 0
    c1,  # uint32 scalar or block: counter word 1 (counter words 2 and 3 are 0)
    seed,  # int64 scalar: the key, (low word, high word)
):
    """Philox4x32-10 of counter (c0, c1, 0, 0) and key `seed`: what `tl.randint4x(seed, c1 * 2^32 + c0)`
    returns, bit for bit (tests/kernels/test_philox.py), with the per-element work cut to the rounds: c1 and
    the key stay scalars, and each round's products are two 64-bit multiplies."""
    key = seed.to(tl.uint64)  # two's complement of an int64 seed
    k0 = key.to(tl.uint32)
    k1 = (key >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    c1 = c1 + zero
    c2, c3 = zero, zero
    for _ in tl.static_range(_ROUNDS):
        hi_b, lo_b = _wide_mul(_ROUND_B, c2)
        hi_a, lo_a = _wide_mul(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0, c1, c2, c3


@triton.jit
def philox_uniform_tile(
    seed,  # int64 scalar: the request's seed (the Philox key)
    position,  # int64 scalar: position of the row being sampled
    salt,  # int (constexpr) or int64 scalar: stream salt
    start,  # int64 scalar, a multiple of 4: first token id of the tile
    GROUPS: tl.constexpr,  # tile covers tokens [start, start + 4 * GROUPS)
):
    """Uniforms of tokens `start + 4 * g + w` as a [GROUPS, 4] float32 tile (one Philox call per row g)."""
    # The offset's low word holds the token group in bits [0, 22) and never carries out of them (token ids
    # < MAX_VOCAB), so counter word 0 is the tile's base word + g and word 1 is one scalar for the tile.
    base = philox_offset(position, start // 4, salt)  # int64 scalar
    c0 = (base & 0xFFFFFFFF).to(tl.uint32) + tl.arange(0, GROUPS).to(tl.uint32)  # [GROUPS]
    r0, r1, r2, r3 = philox4x32(c0, (base >> 32).to(tl.uint32), seed)
    w = tl.arange(0, 4)[None, :]  # [1, 4]: output word = token id mod 4
    r = tl.where(
        w == 0, r0[:, None], tl.where(w == 1, r1[:, None], tl.where(w == 2, r2[:, None], r3[:, None]))
    )
    return tl.uint_to_uniform_float(r)  # [GROUPS, 4]


@triton.jit
def philox_gumbel_tile(
    seed,  # int64 scalar: Philox key
    position,  # int64 scalar: position of the row being sampled
    salt,  # int (constexpr) or int64 scalar: stream salt
    start,  # int64 scalar, a multiple of 4: first token id of the tile
    GROUPS: tl.constexpr,  # tile covers tokens [start, start + 4 * GROUPS)
    FAST_LOG: tl.constexpr = False,  # both logs on the GPU's approximate log2 unit where safe (see below)
):
    """Gumbel noise -log(-log(u)) of tokens `start + 4 * g + w` as a [GROUPS, 4] float32 tile.

    The inner log must be accurate in relative terms: for u near 1, e = -log(u) is tiny and the noise
    -log(e) large (those are the tokens that win): `log_unit` (within 1 ulp), or with FAST_LOG
    `neg_log_unit_fast` (1.3e-7 relative near 1, 5.8e-7 elsewhere; ~12 instructions instead of ~20). The
    outer log only needs absolute accuracy (it is added to the logits): with FAST_LOG it is lg2.approx
    (absolute error <= 2^-22 on [0.5, 2], 2 ulp elsewhere) times -ln 2, which replaces ~24 instructions of
    `tl.log` per token with two. FAST_LOG is for GPU launches (the interpreter has no libdevice); tokens can
    then differ from the float64 reference only where two keys are within ~8e-7 of each other.
    """
    u = philox_uniform_tile(seed, position, salt, start, GROUPS)
    if FAST_LOG:  # -ln(e) = lg2(e) * -ln 2: one multiply the caller's add can fuse with (no unary minus)
        return libdevice.fast_log2f(neg_log_unit_fast(u)) * _NEG_LN2
    return -log_abs(-log_unit(u), False)


@triton.jit
def log_unit(
    u,  # float32 block in [0, 1): uniforms from `tl.uint_to_uniform_float`
):
    """ln(u), within 1 ulp (tests/kernels/test_philox.py), -inf at u = 0.

    `tl.log` (libdevice's logf) spends ~29 instructions a token, most of them on inputs a uniform never is
    (negative, denormal, inf, NaN). Here: u = 2^k * m with m in [sqrt(1/2), sqrt(2)) by integer arithmetic
    on the bits, then ln(u) = k ln 2 + log1p(f), f = m - 1 (exact), log1p(f) = f + f^2 * P(f) with P a
    degree-8 least-squares fit on Chebyshev nodes of that interval (0.88 ulp measured over 2e6 uniforms) and
    ln 2 split in two so k ln 2 is exact: ~20 instructions. Near u = 1 (k = 0, f = u - 1 exact) the relative
    error stays within an ulp, which is what the Gumbel noise of likely winners needs.
    """
    bits = u.to(tl.int32, bitcast=True) - 0x3F3504F3  # 0x3F3504F3 = sqrt(1/2)
    k = (bits >> 23).to(tl.float32)  # arithmetic shift: the exponent relative to [sqrt(1/2), sqrt(2))
    f = ((bits & 0x007FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True) - 1.0
    p = -0.07866667956113815 * f + 0.12821748852729797
    p = p * f - 0.131016343832016
    p = p * f + 0.1418900042772293
    p = p * f - 0.1662759929895401
    p = p * f + 0.2000196874141693
    p = p * f - 0.2500077188014984
    p = p * f + 0.33333322405815125
    p = p * f - 0.4999999701976776
    r = k * 0.693145751953125 + (f + (f * f) * p + k * 1.428606820309417e-06)
    return tl.where(u > 0, r, float("-inf"))


# ln(1 + f) = f * P(f) on f in [-1/4, 0] (u in [3/4, 1]): P of degree 6, least squares on Chebyshev nodes,
# within 1.3e-7 relative of the true log in float32 arithmetic (tests/kernels/test_philox.py)
_NEAR_ONE: tl.constexpr = tl.constexpr(0.75)
_P1: tl.constexpr = tl.constexpr(-0.49999937415122986)
_P2: tl.constexpr = tl.constexpr(0.3333813548088074)
_P3: tl.constexpr = tl.constexpr(-0.24880552291870117)
_P4: tl.constexpr = tl.constexpr(0.21348357200622559)
_P5: tl.constexpr = tl.constexpr(-0.09198083728551865)
_P6: tl.constexpr = tl.constexpr(0.3308808207511902)


@triton.jit
def log_near_one(
    u,  # float32 block, meant for u in [3/4, 1]
    SIGN: tl.constexpr = 1.0,  # -1.0: -ln(u), the sign folded into the coefficients (no extra instruction)
):
    """SIGN * ln(u) for u in [3/4, 1] as f * P(f), f = u - 1 (exact there): 8 instructions, within 1.3e-7
    relative error (tests/kernels/test_philox.py), so tiny -log(u) keep their relative accuracy."""
    f = u - 1.0
    p = (_P6 * SIGN) * f + (_P5 * SIGN)
    p = p * f + (_P4 * SIGN)
    p = p * f + (_P3 * SIGN)
    p = p * f + (_P2 * SIGN)
    p = p * f + (_P1 * SIGN)
    p = p * f + SIGN
    return f * p


@triton.jit
def neg_log_unit_fast(
    u,  # float32 block in [0, 1): uniforms
):
    """-ln(u) for the Gumbel noise on a GPU: ~11 instructions a token instead of `log_unit`'s ~20.

    Where -ln(u) is tiny (u > 3/4: the noise of likely winners) its relative error becomes the noise's
    absolute error, so that side is `log_near_one` (1.3e-7 relative). Elsewhere the GPU's approximate log2
    (absolute error <= 2^-22 on [1/2, 2], 2 ulp below) is within 2^-22 / log2(4/3) = 5.8e-7 relative, which
    moves a key by at most that much (the outer log adds <= 1.7e-7): tokens can differ from the float64
    reference only where two keys are that close. u = 0 gives +inf (that token never wins). Signs live in
    the constants: Triton's unary minus is a subtraction from 0, an instruction of its own."""
    return tl.where(u > _NEAR_ONE, log_near_one(u, -1.0), libdevice.fast_log2f(u) * _NEG_LN2)


@triton.jit
def log_abs(
    x,  # float32 block, x >= 0
    FAST: tl.constexpr,  # on the GPU's approximate log2 unit
):
    """log(x) for values whose ABSOLUTE error is what matters (they are added to logits and compared):
    with FAST, lg2.approx * ln 2 (absolute error <= 2^-22 * ln 2 on [0.5, 2], 2 ulp of the result elsewhere;
    two instructions instead of ~24 for `tl.log`); otherwise `tl.log` (the interpreter has no libdevice)."""
    if FAST:
        return libdevice.fast_log2f(x) * _LN2
    return tl.log(x)


# ----------------------------------------------------------------------------------------------------------
# PyTorch reference (int64 tensors holding uint32 values)
# ----------------------------------------------------------------------------------------------------------


def _mulhilo(a: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * x, for a uint32 constant and uint32 values x.

    a * x = (x * a_hi + (x * a_lo >> 16)) * 2^16 + (x * a_lo mod 2^16); every term stays below 2^49.
    """
    low = x * (a & 0xFFFF)
    mid = x * (a >> 16) + (low >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low & 0xFFFF)


def philox4x32_ref(
    c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor, *, rounds: int = PHILOX_ROUNDS
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 of counter (c0..c3) and key (k0, k1): int64 tensors (broadcastable) of uint32 values."""
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def randint4x_ref(seed: Tensor, offset: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`tl.randint4x(seed, offset)` for broadcastable int64 seed/offset: four uint32 words in int64."""
    zero = torch.zeros_like(offset)
    return philox4x32_ref(
        offset & _MASK32, (offset >> 32) & _MASK32, zero, zero, seed & _MASK32, (seed >> 32) & _MASK32
    )


def uint_to_uniform_float_ref(x: Tensor) -> Tensor:
    """`tl.uint_to_uniform_float` of uint32 values held in int64: float32 in [0, 1)."""
    signed = torch.where(x >= 1 << 31, x - (1 << 32), x)  # bitcast to int32
    folded = torch.where(signed < 0, -signed - 1, signed)  # [0, 2^31 - 1]
    return folded.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32, device=x.device)


def philox_offset_ref(position: Tensor, group: Tensor, salt: int) -> Tensor:
    """The int64 Philox offset of `(position, token_id // 4, salt)`; see the module docstring."""
    return (salt << SALT_SHIFT) + ((position & POSITION_MASK) << POSITION_SHIFT) + group


def philox_uniform_ref(seed: Tensor, position: Tensor, token_id: Tensor, salt: int) -> Tensor:
    """Uniform u(seed, position, token id, salt) in [0, 1), float32, broadcasting the int64 inputs."""
    words = randint4x_ref(seed, philox_offset_ref(position, token_id >> 2, salt))
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # [..., 4]
    word = torch.broadcast_to(token_id & 3, stacked.shape[:-1]).unsqueeze(-1)
    return uint_to_uniform_float_ref(torch.gather(stacked, -1, word).squeeze(-1))


def philox_gumbel_ref(seed: Tensor, position: Tensor, vocab_size: int, salt: int) -> Tensor:
    """Gumbel noise of every token id in [0, vocab_size): [..., V] float32 for int64 seed/position [...]."""
    groups = torch.arange((vocab_size + 3) // 4, dtype=torch.int64, device=position.device)  # [G]
    words = randint4x_ref(
        seed[..., None], philox_offset_ref(position[..., None], groups, salt)
    )  # 4 x [..., G]
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # [..., G, 4]
    u = uint_to_uniform_float_ref(stacked.flatten(-2)[..., :vocab_size])  # [..., V]
    return -torch.log(-torch.log(u))
