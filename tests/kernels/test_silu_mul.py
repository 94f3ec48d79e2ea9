"""SwiGLU's activation in one launch (kernels/silu_mul.py): the kernel (interpreted on the CPU, compiled on
CUDA) against its PyTorch reference on irregular shapes, and where `fspec.models.layers` uses it.

Bounds: exp comes from another library than PyTorch's, so float32 elements may differ by a few ulps
(rtol 2e-6); after rounding to bfloat16 an element may land one unit in the last place away (at most 1 in
50, never more than one unit).
"""

import pytest
import torch

from fspec.kernels import ops
from fspec.kernels.silu_mul import silu_mul, silu_mul_ref
from fspec.models import layers as L

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
        return
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    ulps = (got.float() - want.float()).abs() / (torch.exp2(torch.floor(torch.log2(scale))) * eps)
    assert ulps.max().item() <= 1.0, ulps.max().item()
    assert (ulps > 0).float().mean().item() <= 0.02


@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (5, 3072), (2, 3, 98), (257, 64), (2, 2 * 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(shape, dtype):
    """Widths below, at and above one BLOCK (1024 per half), odd halves, several leading axes."""
    assert ops.kernels_interpreted() or torch.cuda.is_available()
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE)
    _close(silu_mul(x), silu_mul_ref(x))


def test_strided_rows_zero_rows_extremes_and_refusals():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 40, generator=g).to(DEVICE)[::2]  # rows two apart
    _close(silu_mul(x), silu_mul_ref(x))
    assert silu_mul(torch.zeros(0, 6, device=DEVICE)).shape == (0, 3)
    big = torch.tensor([[-100.0, 100.0, 0.0, 2.0, 3.0, -1.0]], device=DEVICE)  # exp overflow: silu(-100) = -0
    _close(silu_mul(big), silu_mul_ref(big))
    for bad, said in (
        (torch.zeros(2, 5, device=DEVICE), "(2, 5) torch.float32"),
        (torch.zeros(2, 4, device=DEVICE, dtype=torch.float16), "torch.float16"),
        (torch.zeros(2, 0, device=DEVICE), "(2, 0)"),
    ):
        with pytest.raises(ValueError, match=r"gate_up: expected \[\.\.\., 2I\]") as err:
            silu_mul(bad)
        assert said in str(err.value)


def test_the_op_and_the_layers():
    """`ops.silu_mul` equals the reference and compiles without a graph break; `layers.silu_mul` calls it on
    CUDA when eager and plain, and `layers.mlp` with a fused gate/up equals the unfused one; under autograd it
    is the PyTorch code."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=g).to(DEVICE)
    want = silu_mul_ref(x)
    _close(ops.silu_mul(x), want)
    _close(torch.compile(ops.silu_mul, fullgraph=True, backend="eager")(x), want)
    _close(L.silu_mul(x), want)
    h, inner = 16, 20
    p = {
        k: torch.randn(*s, generator=g).to(DEVICE)
        for k, s in (("gate", (inner, h)), ("up", (inner, h)), ("down", (h, inner)))
    }
    rows = torch.randn(5, h, generator=g).to(DEVICE)
    fused = {"gate_up": torch.cat([p["gate"], p["up"]]), "down": p["down"]}
    torch.testing.assert_close(L.mlp(fused, rows), L.mlp(p, rows), rtol=1e-5, atol=1e-5)
    xg = x.clone().requires_grad_()
    L.silu_mul(xg).sum().backward()
    gate = x[:, :20]
    sig = torch.sigmoid(gate)
    torch.testing.assert_close(xg.grad[:, 20:], gate * sig)
