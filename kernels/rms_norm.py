"""RMSNorm in one launch for eager CUDA code, alone or after a residual add.

    rms_norm(x [..., H], weight [H], eps) -> weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype)
    add_rms_norm(x, residual, weight, eps) -> (h, rms_norm(h, weight, eps)) with h = x + residual

x32 is x in float32 (HF's LlamaRMSNorm, `rms_norm_ref`): the normalised row is rounded to x's dtype, then
multiplied by the weight in their promoted dtype, as PyTorch multiplies two tensors (bf16 * bf16: the float32
product rounded once). Only the mean's summation order and rsqrt's last bit differ from the reference.
float32 and bfloat16 (`DTYPES`); other dtypes take the reference.

Why: eager PyTorch runs the reference as seven kernels (cast, pow, mean, add, rsqrt, mul, cast) and the weight
multiply. A captured prefill chunk of SmolLM2 (60 norms) spent ~1.1 ms of its 2.3 ms of GPU time in them on
the H100, against ~0.1 ms for Inductor's fused norms in compiled code (BENCHMARKS.md, "The target-only gap,
split"). Compiled code keeps the reference, which Inductor fuses with the residual add around it.

`add_rms_norm` is a pre-norm layer's residual add and the norm after it (h = residual + o(attention), then
the MLP's input norm), which eager PyTorch ran as a launch of its own per layer. h is rounded to x's dtype
before the norm reads it, as PyTorch's add rounds it, so h is the add's exact result and the norm is that of
the two separate steps.

One program per row; the row is read twice (sum of squares, then the scaled write) in BLOCK-wide steps, so any
H works with a fixed tile.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads and writes


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The reference: RMSNorm over the last axis in float32 (fp64 stays fp64), rounded to x's dtype, times
    the weight."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The reference of the residual form: (h, rms_norm_ref(h, weight, eps)) with h = x + residual."""
    h = x + residual
    return h, rms_norm_ref(h, weight, eps)


@triton.jit
def _round_bf16(v):
    """float32 v rounded to the nearest bfloat16, ties to even, kept in float32 (NaN stays NaN). Written out
    because Triton's interpreter truncates a float32 -> bfloat16 cast where the GPU rounds to nearest."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def _load_row(x_row, r_row, cols, mask, HAS_RES: tl.constexpr, X_BF16: tl.constexpr):
    """One BLOCK of the normalised input in float32: x, or x + residual rounded to x's dtype."""
    xv = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        xv += tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
        if X_BF16:
            xv = _round_bf16(xv)
    return xv


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, h_ptr, w_ptr, out_ptr, H, stride_x, stride_r, stride_h, stride_o, eps,
    BLOCK: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        xv = _load_row(x_row, r_row, cols, mask, HAS_RES, X_BF16)
        if HAS_RES:  # the sum, exact in x's dtype after the rounding above
            tl.store(h_ptr + row * stride_h + cols, xv.to(h_ptr.dtype.element_ty), mask=mask)
        acc += xv * xv
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        xv = _load_row(x_row, r_row, cols, mask, HAS_RES, X_BF16)  # recomputed, not read back from h
        y = xv * rstd
        if X_BF16:
            y = _round_bf16(y)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = w * y
        if OUT_BF16:
            out = _round_bf16(out)  # exact in bfloat16: the store's cast does not round again
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def fits(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes these arguments: x [..., H] and weight [H] of `DTYPES` on one device. Where
    it does not, the reference computes (or raises PyTorch's error for mismatched shapes or devices)."""
    return (
        x.dtype in DTYPES
        and weight.dtype in DTYPES
        and weight.device == x.device
        and x.dim() >= 1
        and tuple(weight.shape) == (x.shape[-1],)
    )


def fits_residual(x: Tensor, residual: Tensor, weight: Tensor) -> bool:
    """`fits(x, weight)` and a residual of x's shape, dtype and device: what `add_rms_norm` takes."""
    same = residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device
    return same and fits(x, weight)


def _rows(t: Tensor) -> Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor | None, Tensor]:
    """(h or None, the norm) of x [..., H] (plus residual), both [..., H]."""
    h = x.shape[-1]
    rows = _rows(x)
    res = _rows(residual) if residual is not None else rows
    w = weight.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = None if residual is None else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] and h:
        block = min(triton.next_power_of_2(h), 4096)
        warps = 4 if block <= 2048 else 8
        hs = out if total is None else total
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, hs, w, out, h, rows.stride(0), res.stride(0), hs.stride(0), out.stride(0), float(eps),
            BLOCK=block, X_BF16=x.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16,
            HAS_RES=residual is not None, num_warps=warps,
        )  # fmt: skip
    shape = (*x.shape[:-1], h)
    return (None if total is None else total.view(shape)), out.view(shape)


def _described(name: str, t: Tensor) -> str:
    return f"{name} {tuple(t.shape)} {t.dtype} on {t.device}"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm_ref` in one launch; ValueError unless `fits(x, weight)` (a wrong weight length or device
    would read out of bounds)."""
    if not fits(x, weight):
        raise ValueError(
            f"x, weight: expected x [..., H] and weight [H] of {[str(d) for d in DTYPES]} on one device, got "
            f"{_described('x', x)}, {_described('weight', weight)}"
        )
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`add_rms_norm_ref` in one launch; ValueError unless `fits_residual(x, residual, weight)`."""
    if not fits_residual(x, residual, weight):
        raise ValueError(
            f"x, residual, weight: expected x and residual [..., H] of one shape, dtype and device, and "
            f"weight [H], of {[str(d) for d in DTYPES]}, got {_described('x', x)}, "
            f"{_described('residual', residual)}, {_described('weight', weight)}"
        )
    total, out = _launch(x, residual, weight, eps)
    return total, out
