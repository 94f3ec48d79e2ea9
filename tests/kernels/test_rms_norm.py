"""RMSNorm in one launch (kernels/rms_norm.py): the kernel (interpreted on the CPU, compiled on CUDA) against
its PyTorch reference on irregular shapes and dtypes, and where the model layers use it.

Bounds: the kernel sums the squares in another order and takes rsqrt from another library, so float32 rows
may differ by a few ulps (rtol 4e-6 here); after rounding to bfloat16 an element may land one unit
in the last place away (at most 1 in 50 of them, never more than one unit).
"""

import pytest
import torch

from fspec.kernels import ops
from fspec.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from fspec.models import layers as L

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's last place (its dtype's spacing at want)."""
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    spacing = torch.exp2(torch.floor(torch.log2(scale))) * eps
    return (got.float() - want.float()).abs() / spacing


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-30)
        return
    ulps = _ulps(got, want)
    assert ulps.max().item() <= 1.0, ulps.max().item()
    assert (ulps > 0).float().mean().item() <= 0.02


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 576), (5, 1000), (2, 3, 96), (257, 64), (2, 5000)])
@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # the product in float32, as PyTorch promotes it
    ],
)
def test_kernel_equals_reference(shape, x_dtype, w_dtype):
    assert ops.kernels_interpreted() or torch.cuda.is_available()
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(x_dtype).to(DEVICE)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(w_dtype).to(DEVICE)
    got = rms_norm(x, w, 1e-5)
    want = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == torch.promote_types(x_dtype, w_dtype)
    _close(got, want)


def test_rows_with_a_stride_empty_batches_and_a_large_epsilon():
    """A row-strided view (every other row), zero rows, and an eps that dominates tiny rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 40, generator=g).to(DEVICE)[::2]
    w = torch.randn(40, generator=g).to(DEVICE)
    _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    empty = torch.zeros(0, 40, device=DEVICE)
    assert rms_norm(empty, w, 1e-5).shape == (0, 40)
    tiny = torch.full((2, 40), 1e-6, device=DEVICE)
    _close(rms_norm(tiny, w, 0.5), rms_norm_ref(tiny, w, 0.5))


def test_the_launcher_refuses_what_it_would_read_out_of_bounds_and_layers_leave_it_to_the_reference():
    """A weight of another length or device, or a dtype the kernel does not take: ValueError naming both
    arguments and what they are, never a launch. `layers.rms_norm` sends such calls to the reference, which
    computes (float16, a broadcastable [1] weight) or raises PyTorch's own error."""
    x = torch.randn(3, 8, device=DEVICE)
    for w, said in (
        (torch.ones(7, device=DEVICE), "weight (7,)"),
        (torch.ones(1, device=DEVICE), "weight (1,)"),
        (torch.ones(8, device=DEVICE, dtype=torch.float16), "torch.float16"),
    ):
        with pytest.raises(ValueError, match=r"x, weight: expected x \[\.\.\., H\] and weight \[H\]") as err:
            rms_norm(x, w, 1e-5)
        assert said in str(err.value) and "x (3, 8)" in str(err.value)
    half = x.half()
    _close(
        L.rms_norm(half, torch.ones(8, device=DEVICE, dtype=torch.float16), 1e-5),
        rms_norm_ref(half, torch.ones(8, device=DEVICE, dtype=torch.float16), 1e-5),
    )
    torch.testing.assert_close(
        L.rms_norm(x, torch.ones(1, device=DEVICE), 1e-5), rms_norm_ref(x, torch.ones(1, device=DEVICE), 1e-5)
    )
    with pytest.raises(RuntimeError):
        L.rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)


def test_the_op_equals_the_reference_and_compiles_without_a_graph_break():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, 48, generator=g).to(DEVICE), torch.randn(48, generator=g).to(DEVICE)
    want = rms_norm_ref(x, w, 1e-6)
    _close(ops.rms_norm(x, w, 1e-6), want)
    compiled = torch.compile(lambda a, b: ops.rms_norm(a, b, 1e-6), fullgraph=True, backend="eager")
    _close(compiled(x, w), want)


def test_layers_take_the_kernel_only_where_nothing_traces_or_differentiates(monkeypatch):
    """`fspec.models.layers.rms_norm` on CUDA calls the op when eager and plain; under autograd (a weight that
    requires grad), torch.func.grad and torch.compile it is the PyTorch code. On the CPU it never calls it."""
    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 16, generator=g).to(DEVICE), torch.randn(16, generator=g).to(DEVICE)
    want = rms_norm_ref(x, w, 1e-5)
    _close(L.rms_norm(x, w, 1e-5), want)
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
    calls.clear()
    wg = w.clone().requires_grad_()
    L.rms_norm(x, wg, 1e-5).sum().backward()
    torch.testing.assert_close(wg.grad, rms_norm_ref(x, torch.ones_like(w), 1e-5).sum(0))
    grad = torch.func.grad(lambda p: L.rms_norm(x, p, 1e-5).sum())(w)
    torch.testing.assert_close(grad, wg.grad)
    compiled = torch.compile(lambda a, b: L.rms_norm(a, b, 1e-5), fullgraph=True, backend="eager")
    _close(compiled(x, w), want)
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_at_smollm2_prefill_shapes_matches_the_reference():
    """256 rows of SmolLM2's 576 and a 2048-wide row block (two BLOCK steps at H = 5000), bf16 and fp32."""
    g = torch.Generator().manual_seed(6)
    for rows, h in ((256, 576), (3, 5000)):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(rows, h, generator=g) * 4).to(dtype).cuda()
            w = (1 + 0.2 * torch.randn(h, generator=g)).to(dtype).cuda()
            _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1), (3, 576), (5, 1000), (2, 3, 96), (257, 64), (2, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_form_equals_the_add_then_the_norm(shape, dtype):
    """h is the add's exact result (bit for bit, both dtypes: it is rounded once, as PyTorch's add rounds it);
    the norm is within the bounds above."""
    g = torch.Generator().manual_seed(7 + sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    r = (torch.randn(shape, generator=g) * 5).to(dtype).to(DEVICE)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    h, normed = add_rms_norm(x, r, w, 1e-5)
    want_h, want = add_rms_norm_ref(x, r, w, 1e-5)
    assert h.dtype == dtype and torch.equal(h, want_h)
    _close(normed, want)
    _close(rms_norm(want_h, w, 1e-5), want)  # the norm of the sum is the plain kernel's


def test_residual_form_with_strided_rows_and_its_refusals():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(8, 40, generator=g).to(DEVICE)[::2]
    r = torch.randn(4, 40, generator=g).to(DEVICE)
    w = torch.randn(40, generator=g).to(DEVICE)
    h, normed = add_rms_norm(x, r, w, 1e-5)
    want_h, want = add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(h, want_h)
    _close(normed, want)
    empty = torch.zeros(0, 40, device=DEVICE)
    assert [t.shape for t in add_rms_norm(empty, empty, w, 1e-5)] == [(0, 40), (0, 40)]
    for bad, said in (
        (r[:3], "residual (3, 40)"),
        (r.to(torch.bfloat16), "residual (4, 40) torch.bfloat16"),
    ):
        with pytest.raises(ValueError, match=r"x, residual, weight: expected x and residual") as err:
            add_rms_norm(x, bad, w, 1e-5)
        assert said in str(err.value) and "x (4, 40)" in str(err.value)
    with pytest.raises(ValueError, match="weight \\(39,\\)"):
        add_rms_norm(x, r, w[:39], 1e-5)


def test_the_residual_op_and_the_layer_helper():
    """`ops.add_rms_norm` equals the reference and compiles without a graph break; `layers.add_rms_norm`
    calls it on CUDA when eager and plain, takes the two steps under autograd and for mismatched dtypes."""
    g = torch.Generator().manual_seed(9)
    x, r = torch.randn(6, 48, generator=g).to(DEVICE), torch.randn(6, 48, generator=g).to(DEVICE)
    w = torch.randn(48, generator=g).to(DEVICE)
    want_h, want = add_rms_norm_ref(x, r, w, 1e-6)
    for got in (
        ops.add_rms_norm(x, r, w, 1e-6),
        torch.compile(lambda *a: ops.add_rms_norm(*a, 1e-6), fullgraph=True, backend="eager")(x, r, w),
        L.add_rms_norm(x, r, w, 1e-6),
    ):
        assert torch.equal(got[0], want_h)
        _close(got[1], want)
    rg = r.clone().requires_grad_()
    h, normed = L.add_rms_norm(x, rg, w, 1e-6)
    (h.sum() + normed.sum()).backward()
    assert rg.grad is not None and rg.grad.shape == r.shape
    mixed = L.add_rms_norm(x.double(), r, w, 1e-6)
    assert mixed[0].dtype == torch.float64
    torch.testing.assert_close(mixed[0], x.double() + r)
