"""Sampling: per-row temperature, counter-based Philox noise, Gumbel-max; dispatch to the kernels.

Randomness is explicit and stateless: a row's sample is a pure function of its logits, temperature,
`seed` and `position` (and the `salt` naming the decision, see `fspec.kernels.salts`), never of the global
RNG, the batch it sits in, or padding. The same Philox stream drives the Triton kernel and the PyTorch
reference, so CPU and GPU agree token for token on the same fp32 logits.

Validation runs eagerly at this boundary (it reads values, e.g. temperature >= 0, so it syncs once: the
value checks are one `fspec::value_flags` launch, kernels/value_flags.py) and is skipped while
`torch.compile` traces; the calls below it are branch-free and sync-free.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from fspec.kernels import ops as kops
from fspec.kernels.philox import MAX_VOCAB
from fspec.kernels.salts import MAX_SALT, SALT_ACCEPT, SALT_BONUS, SALT_DRAFT, SALT_RESIDUAL
from fspec.kernels.value_flags import (
    FLAG_COL,
    FLAG_D2T,
    FLAG_LOGITS,
    FLAG_NAMES,
    FLAG_POSITIONS,
    FLAG_TEMPERATURE,
    bad_d2t,
    bad_positions,
    bad_temperature,
    scan_logits,
)

__all__ = ["SALT_ACCEPT", "SALT_BONUS", "SALT_DRAFT", "SALT_RESIDUAL", "gumbel_sample"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def argument_error(name: str, expected: str, actual: object) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {actual}")


def check_tensor(
    name: str,
    t: object,
    *,
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> None:
    """Raise ValueError naming `name` when `t` is not a tensor of the given shape/ndim/dtype/device."""
    if not isinstance(t, Tensor):
        raise argument_error(name, "a torch.Tensor", type(t).__name__)
    if ndim is not None and t.dim() != ndim:
        raise argument_error(name, f"a {ndim}-d tensor", f"shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise argument_error(name, f"shape {tuple(shape)}", f"shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise argument_error(name, f"dtype in {[str(d) for d in dtypes]}", t.dtype)
    if device is not None and t.device != device:
        raise argument_error(name, f"device {device} (that of the logits)", t.device)
    if contiguous and not t.is_contiguous():
        raise argument_error(name, "a contiguous tensor (it is written in place)", f"strides {t.stride()}")


def raise_flagged(flags: int, *checks: tuple[int, Callable[[], None]]) -> None:
    """After `fspec::value_flags` (one launch, one device read): every check pairs its FLAG_* bit with the
    function that finds the bad value and raises the ValueError naming it; those whose bit is set run, in
    order. A set bit that no check confirms (a value at a float32 limit, where the device's arithmetic and
    the host's differ: logits / temperature at the edge of overflow) is still refused, with a ValueError
    naming the arguments behind the bits."""
    if not flags:
        return
    for bit, check in checks:
        if flags & bit:
            check()
    names = ", ".join(name for bit, name in FLAG_NAMES.items() if flags & bit)
    raise argument_error(
        names,
        "values that pass the kernels' own checks",
        f"values that fail them (flags {flags:#x}) at a float32 limit the host-side checks do not reach",
    )


def check_temperature(temperature: Tensor) -> None:
    """Temperatures must be finite and >= 0 (0 = greedy)."""
    bad = bad_temperature(temperature)
    if bool(bad.any()):
        raise argument_error(
            "temperature", "finite values >= 0", f"{temperature[bad][:4].tolist()} (first bad values)"
        )


def check_logits(name: str, logits: Tensor, temperature: Tensor) -> None:
    """No +inf logit, and logits / temperature finite in every sampled row.

    Either would make the row's softmax NaN: the kernels would then sample a wrong token (token 0 for a
    temperature of 1e-38 where argmax is 1) and write NaN probabilities q that verification cannot use.
    NaN and -inf are fine (they count as -inf).
    """
    posinf, overflow, big, t = scan_logits(logits, temperature)
    if bool(posinf):
        raise argument_error(name, "no +inf values (NaN and -inf count as -inf)", "+inf entries")
    if bool(overflow.any()):
        raise argument_error(
            "temperature",
            "0 (greedy) or a value for which logits / temperature stays finite",
            f"{t.expand_as(big)[overflow][:1].tolist()} with max |logit| {big[overflow][:1].tolist()}",
        )


def check_positions(positions: Tensor, *, span: int) -> None:
    """Positions (plus `span` slots after them) must lie in [-1, 2^31), the Philox position field."""
    bad = bad_positions(positions, span)
    if bool(bad.any()):
        raise argument_error(
            "positions", f"values in [-1, 2^31 - {span + 1}]", f"{positions[bad][:4].tolist()}"
        )


def unit_stride(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The [N] per-row inputs with unit stride: the kernels index them as ptr + row. An expanded (stride 0)
    or strided view would otherwise be read at the wrong place, past its storage on the GPU."""
    return tuple(t.contiguous() for t in tensors)


# value-check bits of the sampling options, above value_flags' FLAG_* (computed by torch ops on the device and
# OR-ed into the same single read; the host checks below always confirm them)
FLAG_TOP_K, FLAG_TOP_P, FLAG_MIN_P = 1 << 10, 1 << 11, 1 << 12


def check_options(
    top_k: Tensor | None, top_p: Tensor | None, min_p: Tensor | None, *, n: int, device: torch.device
) -> tuple[Tensor | None, list[tuple[int, Callable[[], None]]]]:
    """The sampling options' shape, dtype and device checks (raising now), and their value checks: (int32
    tensor of FLAG_TOP_K / FLAG_TOP_P / FLAG_MIN_P bits on the device, or None without options; the
    (bit, check) pairs for `raise_flagged`). All three are tensors of shape [n], or all three None."""
    given = [x is not None for x in (top_k, top_p, min_p)]
    if not any(given):
        return None, []
    if not all(given):
        raise argument_error("top_k, top_p, min_p", "all three tensors or all three None", f"given={given}")
    check_tensor("top_k", top_k, shape=(n,), dtypes=(torch.int32, torch.int64), device=device)
    check_tensor("top_p", top_p, shape=(n,), dtypes=(torch.float32,), device=device)
    check_tensor("min_p", min_p, shape=(n,), dtypes=(torch.float32,), device=device)
    bad = {
        "top_k": (FLAG_TOP_K, top_k, top_k < 0, "values >= 0 (0 = off)"),
        "top_p": (FLAG_TOP_P, top_p, ~((top_p > 0) & (top_p <= 1)), "values in (0, 1] (1 = off)"),
        "min_p": (FLAG_MIN_P, min_p, ~((min_p >= 0) & (min_p < 1)), "values in [0, 1) (0 = off)"),
    }
    bits = sum(mask.any().int() * bit for bit, _, mask, _ in bad.values()).view(1)

    def check(name: str) -> Callable[[], None]:
        def run() -> None:
            _, t, mask, expected = bad[name]
            raise argument_error(name, expected, f"{t[mask][:4].tolist()} (first bad values)")

        return run

    return bits, [(bit, check(name)) for name, (bit, *_) in bad.items()]


def _validate_gumbel(
    logits, temperature, seed, positions, salt, out_tokens, out_probs, col, d2t=None, options=(None,) * 3
) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    n, v = logits.shape
    if not 1 <= v < MAX_VOCAB:
        raise argument_error("logits", f"a vocabulary size in [1, {MAX_VOCAB})", v)
    dev = logits.device
    check_tensor("temperature", temperature, shape=(n,), dtypes=(torch.float32,), device=dev)
    check_tensor("seed", seed, shape=(n,), dtypes=(torch.int64,), device=dev)
    check_tensor("positions", positions, shape=(n,), dtypes=(torch.int64,), device=dev)
    if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < MAX_SALT:
        raise argument_error("salt", f"an int in [0, {MAX_SALT})", repr(salt))
    given = [x is not None for x in (out_tokens, out_probs, col)]
    if any(given) and not all(given):
        raise argument_error("out_tokens, out_probs, col", "all three or none", f"given={given}")
    option_bits, option_checks = check_options(*options, n=n, device=dev)
    checks = [
        (FLAG_TEMPERATURE, lambda: check_temperature(temperature)),
        (FLAG_LOGITS, lambda: check_logits("logits", logits, temperature)),
        (FLAG_POSITIONS, lambda: check_positions(positions, span=0)),
        *option_checks,
    ]
    if out_tokens is None:
        if d2t is not None:
            raise argument_error("d2t", "None unless out_tokens, out_probs and col are given", "a tensor")
        flags = kops.value_flags(logits, temperature, positions, 0, None, 0, None, None, None)
        raise_flagged(int(flags if option_bits is None else flags | option_bits), *checks)
        return
    if d2t is not None:
        check_tensor("d2t", d2t, shape=(v,), dtypes=(torch.int32, torch.int64), device=dev)

        def check_d2t() -> None:
            first = int(bad_d2t(d2t).nonzero()[0, 0])
            raise argument_error(
                "d2t", "offsets with t + d2t[t] >= 0 for every t", f"d2t[{first}] = {int(d2t[first])}"
            )

        checks.append((FLAG_D2T, check_d2t))
    check_tensor("out_tokens", out_tokens, ndim=2, dtypes=(torch.int64,), device=dev, contiguous=True)
    k = out_tokens.shape[1]
    check_tensor("out_tokens", out_tokens, shape=(n, k))
    check_tensor(
        "out_probs", out_probs, shape=(n, k, v), dtypes=(torch.float32,), device=dev, contiguous=True
    )
    check_tensor("col", col, shape=(), dtypes=(torch.int64,), device=dev)

    def check_col() -> None:
        if not 0 <= int(col) < k:
            raise argument_error("col", f"a value in [0, {k}) (columns of out_tokens)", int(col))

    flags = kops.value_flags(logits, temperature, positions, 0, col, k, None, None, d2t)
    raise_flagged(int(flags if option_bits is None else flags | option_bits), *checks, (FLAG_COL, check_col))


def gumbel_sample(
    logits: Tensor,
    temperature: Tensor,
    seed: Tensor,
    positions: Tensor,
    *,
    salt: int = SALT_DRAFT,
    out_tokens: Tensor | None = None,
    out_probs: Tensor | None = None,
    col: Tensor | None = None,
    d2t: Tensor | None = None,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    """Sample one token per row: argmax(logits / T + Gumbel noise), or argmax(logits) where T = 0; with the
    sampling options, from the processed distribution p' (kernels/sampling_filter.py states it).

    Args:
        logits: [N, V] float32 / bfloat16 / float16 (computed in float32). Any row stride is fine; a
            vocabulary stride other than 1 costs a contiguous copy. NaN counts as -inf; a row without a
            finite logit returns token 0. Ties go to the smallest token id.
        temperature: [N] float32, finite, >= 0; 0 = greedy. Greedy and sampled rows mix freely.
        seed: [N] int64 Philox key per row.
        positions: [N] int64 in [-1, 2^31): the position the sampled token is for (Philox counter;
            -1 marks padding rows).
            temperature, seed and positions may be strided views: the kernels read them with unit
            stride, so a non-contiguous one is copied first.
        salt: which decision this is (`fspec.kernels.salts`; default SALT_DRAFT).
        out_tokens: [N, K] int64, contiguous; receives the tokens in column `col`.
        out_probs: [N, K, V] float32, contiguous; receives softmax(logits / T) (one-hot at the token where
            T = 0 or no logit is finite) in column `col`. No other column is touched.
        col: 0-d int64 tensor on the logits' device, in [0, K); read on the device, so a step counter in the
            state can drive it without recompiling or syncing.
        d2t: [V] int32 / int64 id offsets (EAGLE-3's draft-to-target map), only with the out buffers: the
            returned ids and out_tokens' column are t + d2t[t] for the sampled t, each >= 0; out_probs stays
            over the sampled vocabulary. One launch fewer than mapping the ids afterwards.
        top_k: [N] int32 / int64 >= 0 (0 = off), top_p: [N] float32 in (0, 1] (1 = off), min_p: [N]
            float32 in [0, 1) (0 = off): all three tensors or all three None (None: no filter launch). The
            token is drawn from p' (softmax(logits / T) over the kept prefix of the row's order, renormalised;
            T = 0 rows stay argmax) and out_probs receives p' (0 outside the prefix). With d2t the filter
            runs over the given (draft) vocabulary, ordered by draft id.

    Returns:
        tokens [N] int64 (a fresh tensor); N = 0 gives an empty one.

    Raises:
        ValueError naming the argument (eager calls only; skipped under torch.compile).
    """
    if not torch.compiler.is_compiling():
        options = (top_k, top_p, min_p)
        _validate_gumbel(logits, temperature, seed, positions, salt, out_tokens, out_probs, col, d2t, options)
    temperature, seed, positions = unit_stride(temperature, seed, positions)
    if out_tokens is None:
        return kops.gumbel_sample(logits, temperature, seed, positions, salt, top_k, top_p, min_p)
    args = (logits, temperature, seed, positions, salt, out_tokens, out_probs, col)
    return kops.gumbel_sample_into(*args, d2t, 0, top_k, top_p, min_p)[0]
