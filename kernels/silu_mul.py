"""SwiGLU's activation in one launch for eager CUDA code.

    silu_mul(gate_up [..., 2I]) -> silu(gate) * up, gate = gate_up[..., :I], up = gate_up[..., I:]

The fused gate/up projection's output goes in as it lies. The arithmetic is eager PyTorch's two kernels:
silu in float32 (x / (1 + exp(-x))) rounded to the input's dtype, then the product in float32 rounded once
more. Only exp's last bits differ from the reference (float32 and bfloat16, `DTYPES`; other dtypes take the
reference).

Why: eager PyTorch runs `F.silu(gate) * up` as two launches over a strided half of gate_up; in a captured
prefill chunk of SmolLM2 they took ~165 µs of a one-token call's ~1.46 ms of GPU time on the H100, against
~43 µs for Inductor's fused kernel in compiled code (BENCHMARKS.md, "The target-only gap, split"). Compiled
code keeps the reference, which Inductor fuses itself.

Grid: (rows, column blocks of BLOCK), so any width works with a fixed tile.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .rms_norm import _round_bf16

DTYPES = (torch.float32, torch.bfloat16)
BLOCK = 1024


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """The reference: silu(first half) * second half of the last axis."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inner, stride_x, stride_o, BLOCK: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    if BF16:
        act = _round_bf16(act)
    out = act * up
    if BF16:
        out = _round_bf16(out)  # exact in bfloat16: the store's cast does not round again
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def fits(gate_up: Tensor) -> bool:
    """Whether the kernel takes gate_up: [..., 2I] (I >= 1) of `DTYPES`."""
    return (
        gate_up.dtype in DTYPES
        and gate_up.dim() >= 1
        and gate_up.shape[-1] % 2 == 0
        and gate_up.shape[-1] > 0
    )


def silu_mul(gate_up: Tensor) -> Tensor:
    """`silu_mul_ref` in one launch; ValueError unless `fits(gate_up)`."""
    if not fits(gate_up):
        raise ValueError(
            f"gate_up: expected [..., 2I] with I >= 1 of {[str(d) for d in DTYPES]}, got "
            f"{tuple(gate_up.shape)} {gate_up.dtype}"
        )
    inner = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inner)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], inner), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(inner))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inner, block))](
            rows, out, inner, rows.stride(0), out.stride(0), BLOCK=block,
            BF16=gate_up.dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip
    return out.view(*gate_up.shape[:-1], inner)
