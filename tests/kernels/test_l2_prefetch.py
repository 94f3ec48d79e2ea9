"""L2 prefetch of weights (kernels/l2_prefetch.py): the regions' checks, `fspec::skinny_linear_prefetch`
(the product, then the prefetches: the same result as `fspec::skinny_linear`), what a layer and an EAGLE-3
head ask for (fspec.models.layers), and, on CUDA, that the prefetching kernels leave every value as it was.
The instruction itself is checked in the sm_90 compile of test_skinny_linear.py (one UBLKPF.L2 per region)."""

from __future__ import annotations

import pytest
import torch

import fspec
from fspec import checkpoint as ck
from fspec.kernels import l2_prefetch as P
from fspec.kernels import ops  # noqa: F401  (registers torch.ops.fspec)
from fspec.kernels.skinny_linear import skinny_linear, skinny_linear_ref
from fspec.models import eagle3
from fspec.models import layers as L


def test_regions_are_checked_and_named():
    w = torch.zeros(8, 16)  # 64-byte rows
    P.check_regions([w, w[2:4], w[5]], w.device)  # whole, leading rows, one row: fine
    P.check_regions((), w.device)
    cases = [
        (w, r"^prefetch: expected a list of at most 3 tensors"),
        ([w] * 4, r"^prefetch: expected a list of at most 3 tensors"),
        ([w, 3], r"^prefetch\[1\]: expected a tensor, got int"),
        ([w.to("meta")], r"^prefetch\[0\]: expected a tensor on cpu, got one on meta"),
        ([w[:, :4]], r"^prefetch\[0\]: expected a contiguous tensor, got strides \(16, 1\)"),
        ([torch.zeros(3, dtype=torch.int16)], r"^prefetch\[0\]: expected a multiple of 16 bytes, got 6"),
        ([torch.zeros(40, dtype=torch.uint8)[1:17]], r"^prefetch\[0\]: expected a 16-byte-aligned address"),
    ]
    for regions, match in cases:
        with pytest.raises(ValueError, match=match):
            P.check_regions(regions, w.device)
    with pytest.raises(ValueError, match=r"^regions\[0\]: expected a contiguous tensor"):
        P.l2_prefetch([w[:, :4]])
    with pytest.raises(ValueError, match=r"^programs: expected an int >= 1, got 0"):
        P.l2_prefetch([w], programs=0)


def test_region_args_are_pointer_byte_pairs_padded_with_the_fallback():
    a, b, fallback = torch.zeros(4, 8), torch.zeros(2, dtype=torch.float64), torch.zeros(1)
    args = P.region_args([a, b], fallback)
    assert len(args) == 2 * P.MAX_REGIONS
    assert args[0] is a and args[1] == 128 and args[2] is b and args[3] == 16
    assert args[4] is fallback and args[5] == 0
    assert P.region_args([], fallback) == [fallback, 0] * P.MAX_REGIONS


def test_nothing_is_issued_off_cuda():
    w = torch.zeros(8, 16)
    assert not P.enabled(w)
    assert P.l2_prefetch([w]) is None  # checked, then nothing to launch


@pytest.mark.parametrize(("m", "silu"), [(1, False), (1, True), (3, False)])
def test_the_prefetching_op_computes_what_skinny_linear_does(m, silu):
    """The product with prefetch regions equals the plain one bit for bit (the interpreter runs the kernel
    and skips the prefetches; on CUDA they are issued), and the op passes opcheck (its fake checks the
    regions too)."""
    gen = torch.Generator().manual_seed(m + 10 * silu)
    x, w = torch.randn(m, 40, generator=gen), torch.randn(24, 40, generator=gen)
    norm = torch.rand(40, generator=gen)
    regions = [w[:4], w[12:16]]
    plain = torch.ops.fspec.skinny_linear(x, w, norm, 1e-6, silu, None)
    got = torch.ops.fspec.skinny_linear_prefetch(x, w, norm, 1e-6, silu, None, regions)
    assert torch.equal(got, plain)
    assert torch.equal(skinny_linear(x, w, norm_weight=norm, silu_mul=silu, prefetch=regions), plain)
    ref = skinny_linear_ref(x, w, norm_weight=norm, silu_mul=silu, prefetch=regions)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    op = torch.ops.fspec.skinny_linear_prefetch.default
    torch.library.opcheck(op, (x, w, norm, 1e-6, silu, None, regions))
    with pytest.raises(ValueError, match=r"^prefetch\[0\]: expected a contiguous tensor"):
        torch.ops.fspec.skinny_linear_prefetch(x, w, norm, 1e-6, silu, None, [w[:, :8]])
    with pytest.raises(ValueError, match=r"^prefetch\[0\]: expected a contiguous tensor"):
        skinny_linear_ref(x, w, prefetch=[w[:, :8]])


def test_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(L.L2_PREFETCH_ENV, raising=False)
    assert L.l2_prefetch_budget() == L.L2_PREFETCH_DEFAULT_MIB << 20
    monkeypatch.setenv(L.L2_PREFETCH_ENV, "24")
    assert L.l2_prefetch_budget() == 24 << 20
    monkeypatch.setenv(L.L2_PREFETCH_ENV, "0")
    assert L.l2_prefetch_budget() == 0
    for bad in ("-1", "65", "1.5", "on", ""):
        monkeypatch.setenv(L.L2_PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=rf"^FSPEC_L2_PREFETCH: expected an integer .* got {bad!r}"):
            L.l2_prefetch_budget()


def test_a_layer_asks_for_o_then_equal_leading_rows_of_gate_and_up():
    h, inter = 16, 24  # bf16 rows of 32 bytes (o) and 32 bytes (gate/up)
    p = {
        "o": torch.zeros(h, h, dtype=torch.bfloat16),
        "gate_up": torch.arange(2 * inter * h, dtype=torch.float32).reshape(2 * inter, h).bfloat16(),
    }
    o_bytes, row = h * h * 2, h * 2
    assert L.prefetch_after_qkv(p, 0) == []
    partial = L.prefetch_after_qkv(p, 5 * row + 7)  # o does not fit: its leading 5 rows
    assert len(partial) == 1 and partial[0].data_ptr() == p["o"].data_ptr() and partial[0].shape == (5, h)
    assert L.prefetch_after_qkv(p, row - 1) == []
    for extra_rows in (0, 1, 2, 7, 2 * inter, 10 * inter):
        got = L.prefetch_after_qkv(p, o_bytes + extra_rows * row)
        assert got[0].data_ptr() == p["o"].data_ptr() and got[0].shape == p["o"].shape
        r = min(extra_rows // 2, inter)
        if r == 0:
            assert len(got) == 1
            continue
        gate, up = got[1:]
        assert gate.data_ptr() == p["gate_up"].data_ptr() and gate.shape == (r, h)
        assert torch.equal(up, p["gate_up"][inter : inter + r])  # the up half's rows of those programs
        assert up.data_ptr() == p["gate_up"][inter].data_ptr()
        assert sum(t.numel() * t.element_size() for t in got) <= o_bytes + extra_rows * row
    assert L.prefetch_after_qkv({"o": p["o"]}, 1 << 20) == []  # no fused gate/up: nothing
    (lead,) = L.leading_rows(p["o"], 3 * row + 5)
    assert lead.data_ptr() == p["o"].data_ptr() and lead.shape == (3, h)
    assert L.leading_rows(torch.zeros(0, 4), 100) == []


def _recording(monkeypatch) -> list:
    """Route every product through skinny_linear (as on CUDA) and record the ops `layers` calls."""
    seen, real = [], L.call

    def call(name, *args):
        seen.append((name, args))
        return real(name, *args)

    monkeypatch.setattr(L, "call", call)
    monkeypatch.setattr(L, "use_skinny_linear", lambda x, w, **kw: True)
    monkeypatch.setattr(L, "use_fused_layer", lambda p, x, cfg, **kw: True)
    return seen


def test_a_fused_target_decode_step_prefetches_and_computes_the_same(monkeypatch):
    """A one-token forward through the fused layers: each layer's q/k/v launch carries its layer's o and
    gate/up rows under a budget, none without, and the logits are the same bits."""
    cfg = fspec.ModelConfig(
        vocab_size=53, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
    )  # fmt: skip
    params = fspec.fuse_projections(fspec.models.llama.init(cfg, seed=3))
    ids = torch.tensor([[7]])
    seen = _recording(monkeypatch)
    monkeypatch.setenv(L.L2_PREFETCH_ENV, "0")
    want, _ = fspec.models.llama.forward_dense(params, ids, cfg=cfg)
    assert [n for n, _ in seen].count("skinny_linear_prefetch") == 0
    seen.clear()
    monkeypatch.setenv(L.L2_PREFETCH_ENV, "1")  # 1 MiB: every layer's o and all of gate/up
    got, _ = fspec.models.llama.forward_dense(params, ids, cfg=cfg)
    assert torch.equal(got, want)
    calls = [args for n, args in seen if n == "skinny_linear_prefetch"]
    assert len(calls) == cfg.num_hidden_layers
    for args, p in zip(calls, params["layers"]):
        assert args[1] is p["qkv"]
        o, gate, up = args[-1]
        assert torch.equal(o, p["o"]) and o.data_ptr() == p["o"].data_ptr()
        assert torch.equal(torch.cat([gate, up]), p["gate_up"])


def test_an_eagle3_head_prefetches_its_qkv_from_the_lm_head(monkeypatch):
    """The one-row LM head asks for the leading rows of the layer's fused q/k/v (the next step's first
    product), within the budget; several rows and a zero budget ask for nothing; the logits are the same."""
    tcfg = fspec.ModelConfig(
        vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, head_dim=4,
    )  # fmt: skip
    target = ck.Target(tcfg, fspec.models.llama.init(tcfg, seed=0))
    draft = ck.init_draft(target, kind="eagle3", seed=3, block_size=4, max_model_len=32, draft_vocab_size=40)
    cfg, params = draft.cfg, fspec.fuse_projections(draft.params)
    assert "qkv" in params["layer"]
    out = torch.randn(1, cfg.model.hidden_size)
    seen = _recording(monkeypatch)
    monkeypatch.setenv(L.L2_PREFETCH_ENV, "0")
    want = eagle3.logits(params, out, cfg=cfg)
    assert [n for n, _ in seen] == ["skinny_linear"]
    seen.clear()
    monkeypatch.setenv(L.L2_PREFETCH_ENV, "1")
    got = eagle3.logits(params, out, cfg=cfg)
    assert torch.equal(got, want)
    ((name, args),) = seen
    assert name == "skinny_linear_prefetch" and args[1] is params["lm_head"]
    (qkv,) = args[-1]
    assert qkv.data_ptr() == params["layer"]["qkv"].data_ptr() and torch.equal(qkv, params["layer"]["qkv"])
    seen.clear()
    eagle3.logits(params, torch.randn(3, cfg.model.hidden_size), cfg=cfg)  # three rows: no prefetch
    assert [n for n, _ in seen] == ["skinny_linear"]


@pytest.mark.gpu
def test_prefetching_kernels_change_no_value_on_cuda():
    """On CUDA (sm_90: the prefetches are issued) the one-row product with three regions equals the plain
    one bit for bit, eagerly and in a CUDA graph; a standalone prefetch of a tensor leaves it as it was."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 2048, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(3072, 2048, device=dev, generator=gen, dtype=torch.bfloat16)
    later = torch.randn(16384, 2048, device=dev, generator=gen, dtype=torch.bfloat16)
    norm = torch.rand(2048, device=dev, generator=gen, dtype=torch.bfloat16)
    before = later.clone()
    regions = [later[:100], later[8192:8292], w]
    plain = skinny_linear(x, w, norm_weight=norm)
    got = skinny_linear(x, w, norm_weight=norm, prefetch=regions)
    assert P.enabled(x) == (torch.cuda.get_device_capability(dev)[0] >= 9)
    assert torch.equal(got, plain)
    graph = torch.cuda.CUDAGraph()
    static = torch.empty_like(plain)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static.copy_(torch.ops.fspec.skinny_linear_prefetch(x, w, norm, 1e-6, False, None, regions))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, plain)
    P.l2_prefetch([later, later[:7]], programs=64)
    torch.cuda.synchronize()
    assert torch.equal(later, before)


def test_the_one_row_launcher_hands_the_regions_to_the_kernel_where_enabled(monkeypatch):
    """Where prefetches are issued (`enabled`, forced here: the CPU has no bulk prefetch) the one-row launch
    carries PREFETCH = the number of regions and each region's (tensor, bytes); where they are not, none;
    several rows never (the tile kernels take no regions)."""
    from fspec.kernels import skinny_linear as SL

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((args, kw))

    monkeypatch.setattr(SL, "_skinny_gemv_kernel", Recorder())
    x, w = torch.randn(1, 32), torch.randn(48, 32)
    regions = [w[:16], w[32:40]]
    for on in (True, False):
        launches.clear()
        monkeypatch.setattr(P, "enabled", lambda t, on=on: on)
        skinny_linear(x, w, prefetch=regions)
        ((args, kw),) = launches
        pf = args[12:18]  # after stride_wn: three (pointer, bytes) pairs
        if on:
            assert kw["PREFETCH"] == 2
            assert pf[0] is regions[0] and pf[1] == 16 * 32 * 4
            assert pf[2] is regions[1] and pf[3] == 8 * 32 * 4 and pf[5] == 0
        else:
            assert kw["PREFETCH"] == 0 and pf[1] == pf[3] == pf[5] == 0
    launches.clear()
    got = skinny_linear(torch.randn(3, 32), w, prefetch=regions)  # the tile kernel, no regions
    assert launches == [] and got.shape == (3, 48)
