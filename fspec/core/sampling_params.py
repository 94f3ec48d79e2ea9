"""`SamplingParams`: every request's sampling settings as one frozen pytree of [B] tensors.

The draft state carries it (`DraftState.sampling`) and the rounds take it as one argument; the sampling and
verification kernels read each option from its tensor, so options mix freely in a batch and changing them
never recompiles. A sampling option is one field here (with its default in `SAMPLING_DEFAULTS` and its check
in `validate_sampling_params`) plus the kernels that read it: nothing between passes options one by one.
"""

from __future__ import annotations

import numbers

import torch

from fspec.core.pytree import pytree_dataclass


@pytree_dataclass
class SamplingParams:
    """Per-request sampling settings of B requests.

    Attributes:
        temperature: [B] float32, finite, >= 0; 0 = greedy. Mixed freely in a batch.
        seed: [B] int64, the seed of each request's counter-based sampler (noise is a pure function of
            (seed, position, token id, salt)).
    """

    temperature: torch.Tensor
    seed: torch.Tensor

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
        device: torch.device | str | None = None,
    ) -> SamplingParams:
        """Settings of `batch_size` requests, each option a scalar (for all) or one value per request (a list
        or a [B] tensor). Validated; a float seed is refused, never truncated."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        device = torch.device(device) if device is not None else None
        made = cls(
            temperature=per_request("temperature", temperature, batch_size, device, floating=True),
            seed=per_request("seed", seed, batch_size, device, floating=False),
        )
        validate_sampling_params(made, batch_size=batch_size, device=made.temperature.device)
        return made

    def pad(self, extra: int) -> SamplingParams:
        """These settings followed by `extra` padding requests' (greedy, seed 0)."""
        return SamplingParams(
            temperature=torch.cat([self.temperature, self.temperature.new_zeros(extra)]),
            seed=torch.cat([self.seed, self.seed.new_zeros(extra)]),
        )

    def take(self, batch_size: int) -> SamplingParams:
        """The first `batch_size` requests' settings (views)."""
        return SamplingParams(temperature=self.temperature[:batch_size], seed=self.seed[:batch_size])


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
    fields = (("temperature", torch.float32), ("seed", torch.int64))
    for field, dtype in fields:
        t = getattr(sp, field)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}.{field}: expected a tensor, got {_describe(t)}")
        if tuple(t.shape) != (batch_size,) or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"{name}.{field}: expected a [{batch_size}] {dtype} tensor on {device}, got {_describe(t)}"
            )
        if not t.is_contiguous():  # the kernels read it with unit stride
            raise ValueError(f"{name}.{field}: expected a contiguous tensor, got strides {t.stride()}")
    temp = sp.temperature
    if not bool(torch.isfinite(temp).all()) or bool((temp < 0).any()):
        raise ValueError(f"{name}.temperature: expected finite values >= 0, got {temp.tolist()[:8]}")
