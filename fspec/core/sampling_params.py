"""`SamplingParams`: every request's sampling settings as one frozen pytree of [B] tensors.

The draft state carries it (`DraftState.sampling`) and the rounds take it as one argument; the sampling and
verification kernels read each option from its tensor, so options mix freely in a batch and changing them
never recompiles. A sampling option is one field here (with its default in `SAMPLING_DEFAULTS` and its check
in `validate_sampling_params`) plus the kernels that read it: nothing between passes options one by one.
"""

from __future__ import annotations

import math
import numbers
import struct

import torch

from fspec.core.pytree import pytree_dataclass, static_field


@pytree_dataclass
class SamplingParams:
    """Per-request sampling settings of B requests.

    Attributes:
        temperature: [B] float32, finite, >= 0; 0 = greedy. Mixed freely in a batch.
        seed: [B] int64, the seed of each request's counter-based sampler (noise is a pure function of
            (seed, position, token id, salt)).
        top_k: [B] int32 >= 0; keep the k most likely tokens (0 = off).
        top_p: [B] float32 in (0, 1]; keep the shortest most-likely prefix of mass >= top_p (1 = off).
        min_p: [B] float32 in [0, 1); drop tokens less likely than min_p times the most likely one (0 = off).
        suppress_ids: [B, E] int64, token ids the target may not emit at positions below `suppress_until`
            (-1 = no id; `generate` puts the stop ids here for min_new_tokens, as HF and vLLM suppress them).
        suppress_until: [B] int64, the first position at which `suppress_ids` are allowed again.
    The filters compose as vLLM's do: min_p, then top_k, then top_p over what is left (ops/sampling.py).
    """

    temperature: torch.Tensor
    seed: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    suppress_ids: torch.Tensor
    suppress_until: torch.Tensor
    # Static: whether any sampled request (temperature > 0) filters (top_k > 0, top_p < 1 or min_p > 0).
    # `create` sets it from the values; with False the samplers skip the filter (its launch on the GPU; the
    # CPU reference's sort of every row), exactly as with every option off. A greedy request's filters never
    # count: every filter keeps the most likely token, so its argmax is the same filtered or not. A different
    # value is a different tree: a compiled call keeps one graph for calls without filters and one for calls
    # with them, whatever the values.
    filtered: bool = static_field(default=True)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def create(
        cls,
        batch_size: int,
        *,
        temperature: torch.Tensor | float | list = 0.0,
        seed: torch.Tensor | int | list = 0,
        top_k: torch.Tensor | int | list = 0,
        top_p: torch.Tensor | float | list = 1.0,
        min_p: torch.Tensor | float | list = 0.0,
        suppress_ids: torch.Tensor | list | None = None,
        suppress_until: torch.Tensor | int | list = 0,
        device: torch.device | str | None = None,
    ) -> SamplingParams:
        """Settings of `batch_size` requests, each option a scalar (for all) or one value per request (a list
        or a [B] tensor); suppress_ids a list of ids for all requests or a [B, E] tensor (None: none).
        Validated; a float seed is refused, never truncated."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        b = batch_size
        given = dict(temperature=temperature, seed=seed, top_k=top_k, top_p=top_p, min_p=min_p)
        rows = _plain_rows({**given, "suppress_until": suppress_until}, b) if suppress_ids is None else None
        device = _device(device) if device is not None else None
        if rows is not None:  # what `generate` gives: Python numbers, valid
            return cls._of_rows(rows, device)
        temperature = per_request("temperature", temperature, b, device, floating=True)
        device = temperature.device
        top_k = per_request("top_k", top_k, b, device, floating=False).clamp(max=2**31 - 1).to(torch.int32)
        top_p = per_request("top_p", top_p, b, device, floating=True)
        min_p = per_request("min_p", min_p, b, device, floating=True)
        made = cls(
            temperature=temperature,
            seed=per_request("seed", seed, b, device, floating=False),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            suppress_ids=_suppress_ids(suppress_ids, b, device),
            suppress_until=per_request("suppress_until", suppress_until, b, device, floating=False),
            filtered=bool((((top_k > 0) | (top_p < 1) | (min_p > 0)) & (temperature > 0)).any()),
        )
        validate_sampling_params(made, batch_size=b, device=device)
        return made

    @classmethod
    def _of_rows(cls, rows: dict[str, list], device) -> SamplingParams:
        """`create` for options that `_plain_rows` passed: one tensor per field from its B Python values. The
        general path took ~35 tensor operations (per-field conversion, then a tensor check of every value):
        for one request given as lists, what `generate` passes, 319 against 47 us (as scalars 258 against 23;
        CPU, one thread)."""
        device = torch.device("cpu") if device is None else device
        fields = {name: torch.tensor(v, dtype=_DTYPES[name], device=device) for name, v in rows.items()}
        t, k, p, m = (rows[n] for n in ("temperature", "top_k", "top_p", "min_p"))
        # as the float32 fields say (1e-50 is a greedy 0 there, 1 - 1e-9 an unfiltered 1)
        filtered = any(
            _f32(ti) > 0 and (ki > 0 or _f32(pi) < 1 or _f32(mi) > 0) for ti, ki, pi, mi in zip(t, k, p, m)
        )
        b = len(t)
        suppress = torch.full((b, 0), -1, dtype=torch.int64, device=device)
        return cls(**fields, suppress_ids=suppress, filtered=filtered)

    def filters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[None, None, None]:
        """(top_k, top_p, min_p) for the samplers, or three None when no request filters (`filtered`)."""
        return (self.top_k, self.top_p, self.min_p) if self.filtered else (None, None, None)

    def pad(self, extra: int) -> SamplingParams:
        """These settings followed by `extra` padding requests' (every option at its default: greedy); these
        settings themselves for extra 0 (the fields are immutable in a pytree: nothing to copy)."""
        if extra == 0:
            return self
        return SamplingParams(
            **{
                name: torch.cat([t, t.new_full((extra, *t.shape[1:]), _PAD[name])])
                for name, t in self._fields().items()
            },
            filtered=self.filtered,
        )

    def take(self, batch_size: int) -> SamplingParams:
        """The first `batch_size` requests' settings (views)."""
        return SamplingParams(
            **{name: t[:batch_size] for name, t in self._fields().items()}, filtered=self.filtered
        )

    def rows(self, index: list[int]) -> SamplingParams:
        """The settings of requests `index` (a list of row numbers), in that order."""
        idx = torch.tensor(index, dtype=torch.int64, device=self.temperature.device)
        return SamplingParams(
            **{name: t.index_select(0, idx) for name, t in self._fields().items()}, filtered=self.filtered
        )

    def to_device(self, device: torch.device | str) -> SamplingParams:
        """These settings on `device` (the same object when they are there already).

        From the CPU to CUDA the fields travel as one copy: packed into one pinned buffer, copied without
        blocking the host, and viewed back as the fields on the device. Seven pageable copies would each wait
        for the stream to drain (a `generate` call made them twice, while a prefill ran)."""
        device = _device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current device: cuda:0, say
            device = torch.device("cuda", torch.cuda.current_device())
        if self.temperature.device == device:
            return self
        fields = self._fields()
        if device.type != "cuda" or any(t.device.type != "cpu" for t in fields.values()):
            moved = {name: t.to(device) for name, t in fields.items()}
            return SamplingParams(**moved, filtered=self.filtered)
        parts, offsets, at = [], [], 0
        for t in fields.values():
            raw = t.contiguous().view(-1).view(torch.uint8)
            pad = -raw.numel() % 8  # every field starts 8-byte aligned: a view as its dtype needs it
            parts += [raw, raw.new_zeros(pad)]
            offsets.append(at)
            at += raw.numel() + pad
        packed = torch.cat(parts).pin_memory().to(device, non_blocking=True)
        out = {}
        for (name, t), start in zip(fields.items(), offsets):
            size = t.numel() * t.element_size()
            out[name] = packed[start : start + size].view(t.dtype).view(t.shape)
        return SamplingParams(**out, filtered=self.filtered)

    def fields(self) -> dict[str, torch.Tensor]:
        """Every [B] (and [B, E]) tensor of these settings by field name."""
        return self._fields()

    def copy_into(self, buffers: SamplingParams) -> SamplingParams:
        """These settings written into `buffers` (the same shapes: static buffers a CUDA graph reads) in
        place; returns the buffers, with this `filtered`."""
        fields = {name: getattr(buffers, name).copy_(t) for name, t in self._fields().items()}
        return SamplingParams(**fields, filtered=self.filtered)

    def _fields(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _PAD}


# each field's value for a padding request (and the option's "off")
_PAD = {
    "temperature": 0.0,
    "seed": 0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "suppress_ids": -1,
    "suppress_until": 0,
}
_DTYPES = {
    "temperature": torch.float32,
    "seed": torch.int64,
    "top_k": torch.int32,
    "top_p": torch.float32,
    "min_p": torch.float32,
    "suppress_ids": torch.int64,
    "suppress_until": torch.int64,
}


# each option's valid values, as a predicate that reads a tensor (elementwise) or a Python number alike, and
# its words: `validate_sampling_params` checks the fields with it, `_plain_rows` the Python values (NaN fails
# every comparison, so it is refused as the tensor check refuses it)
_RANGES = {
    "temperature": (lambda x: (x >= 0) & (x < math.inf), "finite values >= 0"),
    "top_k": (lambda x: x >= 0, "values >= 0 (0 = off)"),
    "top_p": (lambda x: (x > 0) & (x <= 1), "values in (0, 1] (1 = off)"),
    "min_p": (lambda x: (x >= 0) & (x < 1), "values in [0, 1) (0 = off)"),
    "suppress_ids": (lambda x: x >= -1, "token ids or -1"),
}


def _plain_rows(options: dict[str, object], b: int) -> dict[str, list] | None:
    """Each option as its B values when every option is a plain Python number, or a list / tuple of B of
    them, inside its range as its field holds it (what `validate_sampling_params` would pass; float32 for the
    floats: 1e39 is inf there); None for anything else, a bad value included, which then takes `create`'s
    general path and its errors."""

    def real(x) -> bool:
        return type(x) in (int, float)

    def integer(x, lo: int, hi: int) -> bool:
        return type(x) is int and lo <= x < hi

    def in_range(name: str):
        return lambda x: real(x) and bool(_RANGES[name][0](_f32(x)))

    long = (-(2**63), 2**63)
    ok = {
        "temperature": in_range("temperature"),
        "seed": lambda x: integer(x, *long),
        "top_k": lambda x: integer(x, 0, 2**31),  # _RANGES' top_k; the general path clamps past int32
        "top_p": in_range("top_p"),
        "min_p": in_range("min_p"),
        "suppress_until": lambda x: integer(x, *long),
    }
    rows = {}
    for name, value in options.items():
        values = list(value) if type(value) in (list, tuple) else [value] * b
        if len(values) != b or not all(map(ok[name], values)):
            return None
        rows[name] = values
    return rows


def _device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch.device or a device string, got {device!r}") from None


def _f32(x: float) -> float:
    """x rounded to float32, as a float32 tensor of it holds it (overflow to inf)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _suppress_ids(value, b: int, device) -> torch.Tensor:
    if value is None:
        return torch.full((b, 0), -1, dtype=torch.int64, device=device)
    if isinstance(value, torch.Tensor):
        if value.dim() != 2 or value.shape[0] != b or value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(f"suppress_ids: expected a [{b}, E] integer tensor, got {_describe(value)}")
        return value.to(device=device, dtype=torch.int64).contiguous()
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in value
    ):
        raise ValueError(
            f"suppress_ids: expected a list of token ids or a [{b}, E] tensor, got {value!r:.80}"
        )
    row = torch.tensor(list(value), dtype=torch.int64).reshape(1, -1)
    return row.expand(b, -1).contiguous().to(device)


def per_request(name: str, value: object, b: int, device, *, floating: bool) -> torch.Tensor:
    """A [B] float32 (floating) or int64 tensor from a scalar, a list of B values or a [] / [B] tensor;
    ValueError naming `name` otherwise. On `device` (None: a tensor's own device, else the CPU)."""
    kind = "a number" if floating else "an int"
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != b):
            raise ValueError(
                f"{name}: expected {kind} or a [{b}] tensor (one per request), got {_describe(value)}"
            )
        if value.dtype == torch.bool or value.is_complex() or (not floating and value.is_floating_point()):
            want = "a float or integer" if floating else "an integer"
            raise ValueError(f"{name}: expected {want} dtype, got {value.dtype}")
        device = value.device if device is None else device
    elif isinstance(value, (list, tuple)):
        if len(value) != b:
            raise ValueError(f"{name}: expected {b} values (one per request), got {len(value)}")
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, numbers.Real if floating else numbers.Integral):
                raise ValueError(f"{name}[{i}]: expected {kind}, got {_describe(v)}")
        try:
            as_tensor = torch.tensor(value, dtype=torch.float64 if floating else torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise ValueError(f"{name}: expected {b} {kind}s, got {value!r:.80} ({err})") from None
        return per_request(name, as_tensor, b, device, floating=floating)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real if floating else numbers.Integral):
        raise ValueError(f"{name}: expected {kind} or a [{b}] tensor, got {_describe(value)}")
    elif not floating and not -(2**63) <= int(value) < 2**63:
        raise ValueError(f"{name}: expected a 64-bit int, got {value!r}")
    dtype = torch.float32 if floating else torch.int64
    value = torch.as_tensor(value, dtype=dtype, device=device).expand(b)
    return value.clone(memory_format=torch.contiguous_format)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__} {x!r}"


def validate_sampling_params(
    sp: object, *, batch_size: int, device: torch.device, name: str = "sampling"
) -> None:
    """Check every field of `sp` for B = batch_size requests on `device`; ValueError naming the field."""
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"{name}: expected a SamplingParams, got {type(sp).__name__}")
    for field, dtype in _DTYPES.items():
        t = getattr(sp, field)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}.{field}: expected a tensor, got {_describe(t)}")
        rank_ok = t.dim() == 2 if field == "suppress_ids" else t.dim() == 1
        want = f"[{batch_size}, E]" if field == "suppress_ids" else f"[{batch_size}]"
        if not rank_ok or t.shape[0] != batch_size or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"{name}.{field}: expected a {want} {dtype} tensor on {device}, got {_describe(t)}"
            )
        if not t.is_contiguous():  # the kernels read it with unit stride
            raise ValueError(f"{name}.{field}: expected a contiguous tensor, got strides {t.stride()}")
    for field, (ok, want) in _RANGES.items():
        t = getattr(sp, field)
        bad = ~ok(t)
        if bool(bad.any()):
            raise ValueError(f"{name}.{field}: expected {want}, got {t[bad][:4].tolist()} (first bad values)")
    if not isinstance(sp.filtered, bool):
        raise ValueError(f"{name}.filtered: expected a bool, got {_describe(sp.filtered)}")
    if not sp.filtered:  # the samplers would skip the filter: no sampled request may ask for one
        off = ((sp.top_k == 0) & (sp.top_p == 1) & (sp.min_p == 0)) | (sp.temperature == 0)
        if not bool(off.all()):
            rows = torch.nonzero(~off).flatten()[:4].tolist()
            raise ValueError(
                f"{name}.filtered: expected True when a sampled request (temperature > 0) filters "
                f"(top_k > 0, top_p < 1 or min_p > 0), got False with requests {rows} filtering"
            )
