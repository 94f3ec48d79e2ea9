"""RoPE tables in one launch (kernels/rope_cos_sin.py): the interpreted kernel against its PyTorch reference
on irregular shapes, dtypes and position ranges, and the op as the model layers call it (values, vmap, one op
per compiled forward).

The kernel's cos / sin (NumPy's under the interpreter, libdevice's on the GPU) and PyTorch's may differ in the
last bit of a float32; the comparison allows 2 float32 ulps of the argument's size (|freq| up to ~1e4 here)
in float32, and one unit of the output dtype's last place after rounding.
"""

import pytest
import torch

import fspec
from fspec.kernels import ops
from fspec.kernels.rope_cos_sin import rope_cos_sin, rope_cos_sin_ref
from fspec.models import layers as L

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _cfg(head_dim: int, rope_type: str = "llama3") -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, rope_theta=500000.0, rope_type=rope_type, rope_factor=32.0,
    )  # fmt: skip


@pytest.mark.parametrize("shape", [(1,), (3,), (37,), (2, 7), (0,)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(shape, head_dim, dtype):
    assert ops.kernels_interpreted() or torch.cuda.is_available()
    g = torch.Generator().manual_seed(head_dim + len(shape))
    positions = torch.randint(-1, 9000, shape, generator=g)
    if positions.numel():
        positions.view(-1)[0] = -1  # padding: position 0's values
    inv_freq = L.rope_inv_freq(_cfg(head_dim), "cpu")
    got = rope_cos_sin(positions, inv_freq, dtype)
    want = rope_cos_sin_ref(positions, inv_freq, dtype)
    for g_, w in zip(got, want):
        assert g_.shape == (*shape, head_dim) and g_.dtype == dtype
        assert torch.equal(g_[..., : head_dim // 2], g_[..., head_dim // 2 :])  # the two halves
        if dtype == torch.float32:  # the argument's ulp bounds the error of a correctly rounded cos / sin
            freqs = positions.clamp(min=0).float()[..., None] * inv_freq
            ulp = torch.cat((freqs, freqs), -1).abs().clamp(min=1.0) * 2.0**-23
            assert ((g_ - w).abs() <= 2 * ulp).all()
        else:
            torch.testing.assert_close(g_.float(), w.float(), atol=2.0**-8, rtol=2.0**-8)
    if positions.numel():
        assert torch.equal(got[0].reshape(-1, head_dim)[0], torch.ones(head_dim, dtype=dtype))  # cos(0) = 1


def test_model_layers_call_one_op_per_forward_and_keep_vmap():
    """`layers.rope_cos_sin` goes through one `fspec::rope_tables` op (what a compiled forward computes once
    for all its layers), equals the reference, and maps over batched positions."""
    cfg = _cfg(64)
    positions = torch.tensor([[4, -1, 130], [7, 8, 9]])
    targets = []

    def count(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def forward16(p):  # sixteen "layers" read the tables
        cos, sin = L.rope_cos_sin(p, cfg=cfg, dtype=torch.float32)
        return sum((cos * sin).sum() for _ in range(16))

    torch._dynamo.reset()
    got = torch.compile(forward16, backend=count, fullgraph=True)(positions)
    assert sum(t.startswith("fspec.rope_tables") for t in targets) == 1
    assert got == forward16(positions)
    want = rope_cos_sin_ref(positions, L.rope_inv_freq(cfg, "cpu"), torch.float32)
    for g_, w in zip(L.rope_cos_sin(positions, cfg=cfg, dtype=torch.float32), want):
        assert torch.allclose(g_, w, atol=1e-5, rtol=0)
    mapped = torch.func.vmap(lambda p: L.rope_cos_sin(p, cfg=cfg, dtype=torch.float32))(positions)
    for m, w in zip(mapped, want):
        assert torch.allclose(m, w, atol=1e-5, rtol=0)
