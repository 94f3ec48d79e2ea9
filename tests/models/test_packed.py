"""`fspec.models.packed`: oneDNN-packed linear weights against `F.linear` (their reference) on irregular
shapes, and which leaves of a params tree `pack_params` packs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fspec.models import layers as L
from fspec.models import packed as P

pytestmark = pytest.mark.skipif(not P.supported(), reason="this PyTorch build has no oneDNN packed linear")


@pytest.mark.parametrize("lead", [(1,), (2,), (5,), (6,), (67,), (2, 3)])
@pytest.mark.parametrize("n, k", [(577, 613), (1031, 257)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(lead, n, k, bias):
    gen = torch.Generator().manual_seed(n + k + len(lead))
    w = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(*lead, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    pw = P.pack(w)
    assert P.is_packed(pw) and not P.is_packed(w) and tuple(pw.shape) == (n, k)
    want = F.linear(x, w, b)
    got = P.packed_linear(x, pw, b)
    assert got.shape == want.shape == (*lead, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(L.linear(x, pw, b), want, rtol=1e-5, atol=1e-5)  # the layers' entry point


def test_packable_rules():
    big = torch.randn(512, 512)  # 2**18 elements: the smallest packed
    assert P.packable(big)
    assert not P.packable(torch.randn(511, 512))
    assert not P.packable(big.to(torch.bfloat16))
    assert not P.packable(big.clone().requires_grad_())
    assert not P.packable(torch.randn(4, 128, 512))  # not a matrix
    assert not P.packable(torch.empty(512, 512, device="meta"))
    assert not P.packable(P.pack(big))  # already packed
    assert not P.packable([big])


def _tree():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    layer = {"qkv": r(768, 512), "o": r(512, 512), "input_norm": r(512), "small": r(16, 512)}
    return {"embed": r(600, 512), "layers": [layer, dict(layer, o=r(512, 512))], "norm": r(512)}


def test_pack_params_packs_projections_and_a_tied_head():
    params = _tree()
    memo: dict = {}
    out = P.pack_params(params, memo, tied_head=True)
    assert out["embed"] is params["embed"] and out["norm"] is params["norm"]  # looked up / 1-d: as they are
    assert P.is_packed(out["lm_head"]) and "lm_head" not in params  # the tied head, packed from embed
    torch.testing.assert_close(P.packed_linear(params["norm"][None], out["lm_head"]),
                               params["norm"][None] @ params["embed"].T, rtol=1e-5, atol=1e-4)  # fmt: skip
    for got, layer in zip(out["layers"], params["layers"], strict=True):
        assert P.is_packed(got["qkv"]) and P.is_packed(got["o"])
        assert got["input_norm"] is layer["input_norm"] and got["small"] is layer["small"]
    # the two layers share one qkv tensor: packed once
    assert out["layers"][0]["qkv"] is out["layers"][1]["qkv"]
    assert out["layers"][0]["o"] is not out["layers"][1]["o"]
    srcs = P.sources(params, tied_head=True)
    assert [id(t) for t in srcs] == list(memo)  # the walk order, each tensor once
    assert {id(t) for t in srcs} == {id(params["embed"]), id(params["layers"][0]["qkv"]),
                                     id(params["layers"][0]["o"]), id(params["layers"][1]["o"])}  # fmt: skip
    untied = P.pack_params(params, tied_head=False)
    assert "lm_head" not in untied and len(P.sources(params, tied_head=False)) == 3
    again = P.pack_params(params, memo, tied_head=True)  # a memo hit reuses the packed tensor
    assert again["layers"][1]["o"] is out["layers"][1]["o"]
