"""RoPE's cos and sin tables of a forward's positions in one launch.

    rope_cos_sin(positions [...] int, inv_freq [D/2] float32, dtype) -> (cos [..., D], sin [..., D]) in dtype

freqs = max(position, 0) * inv_freq in fp32 (padding positions -1 get position 0's values), duplicated over
the two halves of D (the rotate-half layout), cos and sin rounded once to `dtype`: the arithmetic of
`fspec.models.layers.rope_cos_sin`, whose PyTorch code is the reference here.

Why: every layer's RoPE reads the same tables, and a compiled forward hands them to each layer's custom
attention op (`fspec::rope_kv_write`); Inductor, seeing cheap pointwise expressions of the positions,
recomputed them in front of each op: one ~1.3 µs kernel per layer of a 1B-shaped decode step on the H200
(16 per token; benchmarks/kernel_timeline.py). An op's outputs are buffers: computed once per forward.
"""

import math
import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .pdl import pdl_enter

BLOCK_T = 16  # positions per program


def inv_freq(head_dim: int, rope_type: str, rope: Sequence[float], device: torch.device | str) -> Tensor:
    """[D/2] fp32 inverse frequencies for rope_type "default", "linear" (divided by factor) or "llama3"
    (transformers' `_compute_llama3_parameters`: wavelengths shorter than original_max / high_freq_factor
    are kept, longer than original_max / low_freq_factor divided by `factor`, and the band between
    interpolated with smooth = (original_max / wavelen - low) / (high - low)); rope = (theta, factor,
    low_freq_factor, high_freq_factor, original_max), as `fspec.models.layers.rope_key` gives them."""
    theta, factor, low, high, original_max = rope
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    freq = 1.0 / (theta**exponent)
    if rope_type == "linear":
        return freq / factor
    if rope_type == "default":
        return freq
    low_freq_wavelen, high_freq_wavelen = original_max / low, original_max / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (original_max / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_INV_FREQ: dict[tuple, Tensor] = {}


def cached_inv_freq(key: tuple, device: torch.device) -> Tensor:
    """`inv_freq(*key, device)` for key = (head_dim, rope_type, rope), computed once per key and device and
    kept (a few hundred bytes each): what `fspec::rope_tables` multiplies positions by. Computed on the
    device, as an uncached call would. On a CUDA device a miss computes in a helper thread (and waits for
    it), so the kept tensor is an ordinary allocation even during a CUDA-graph tree's warm-up run, which
    sends every allocation of its thread to the graph's private pool, where a tensor that outlives the run
    is an untracked allocation the trees refuse (torch 2.11: "Detected 1 tensor(s) in the cudagraph pool not
    tracked as outputs"); a miss during capture computes on the capturing stream without keeping (the graph
    replays the computation)."""
    entry = (key, str(device))
    cached = _INV_FREQ.get(entry)
    if cached is not None:
        return cached
    if device.type != "cuda":
        freq = _INV_FREQ[entry] = inv_freq(*key, device)
        return freq
    if torch.cuda.is_current_stream_capturing():
        return inv_freq(*key, device)
    torch.cuda.current_stream(device).synchronize()  # whatever the caller queued is done (warm-up, eager)

    errors = []

    def compute() -> None:
        try:
            with torch.cuda.device(device):
                freq = inv_freq(*key, device)
                torch.cuda.current_stream(device).synchronize()
            _INV_FREQ[entry] = freq
        except Exception as e:  # re-raised in the caller's thread
            errors.append(e)

    helper = threading.Thread(target=compute, name="fspec-rope-inv-freq")
    helper.start()
    helper.join()
    if errors:
        raise errors[0]
    return _INV_FREQ[entry]


@triton.jit
def _rope_cos_sin_kernel(
    positions_ptr,  # [T] int positions (negative = padding: position 0's values)
    inv_freq_ptr,  # [HALF] float32
    cos_ptr,  # [T, 2 * HALF] out, the output dtype
    sin_ptr,  # [T, 2 * HALF] out
    T,  # positions
    HALF: tl.constexpr,  # D / 2
    HALF_POW2: tl.constexpr,  # next power of two >= HALF
    BLOCK: tl.constexpr,  # positions per program
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    f = tl.arange(0, HALF_POW2)  # [HALF_POW2]
    t_ok = t < T
    f_ok = f < HALF
    pos = tl.maximum(tl.load(positions_ptr + t, mask=t_ok, other=0), 0).to(tl.float32)
    freqs = pos[:, None] * tl.load(inv_freq_ptr + f, mask=f_ok, other=0.0)[None, :]  # [BLOCK, HALF_POW2]
    c = tl.cos(freqs).to(cos_ptr.dtype.element_ty)
    s = tl.sin(freqs).to(sin_ptr.dtype.element_ty)
    at = t[:, None] * (2 * HALF) + f[None, :]
    ok = t_ok[:, None] & f_ok[None, :]
    tl.store(cos_ptr + at, c, mask=ok)
    tl.store(cos_ptr + at + HALF, c, mask=ok)
    tl.store(sin_ptr + at, s, mask=ok)
    tl.store(sin_ptr + at + HALF, s, mask=ok)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Launch the kernel: (cos, sin) [..., D] in `dtype` for integer positions [...] and inv_freq [D/2]."""
    half = inv_freq.shape[0]
    shape = (*positions.shape, 2 * half)
    cos = torch.empty(shape, dtype=dtype, device=positions.device)
    sin = torch.empty(shape, dtype=dtype, device=positions.device)
    t = positions.numel()
    if t == 0:
        return cos, sin
    _rope_cos_sin_kernel[(triton.cdiv(t, BLOCK_T),)](
        positions.reshape(-1).contiguous(), inv_freq.contiguous(), cos, sin, t, HALF=half,
        HALF_POW2=triton.next_power_of_2(half), BLOCK=BLOCK_T,
        **pdl.options(positions),
    )  # fmt: skip
    return cos, sin


def rope_cos_sin_ref(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The reference: fp32 freqs of the clamped positions, duplicated halves, cos / sin cast to `dtype`."""
    freqs = positions.clamp(min=0).float()[..., None] * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)
