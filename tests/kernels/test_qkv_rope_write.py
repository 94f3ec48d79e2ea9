"""The one-row q/k/v product with RoPE and the cache write as its epilogue (kernels/qkv_rope_write.py,
`fspec::qkv_rope_write`): the interpreted kernel against the two launches it replaces (`skinny_linear` then
`rope_pos_kv_write`) and against its PyTorch reference, the op, the checks, a paged decode step through it
(the one-row layers' default), the sm_90 build, and the H200 under @pytest.mark.gpu.

Caches are random (poison) and stacked [L, ...] with the step writing layer 1, so a write to a wrong slot,
head or layer shows up as a changed byte elsewhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fresh_process import in_fresh_process, ptxas_spills

import fspec
from fspec.core.cache import KVCache
from fspec.core.metadata import _slot_mapping
from fspec.kernels import attention_ops  # noqa: F401  (registers torch.ops.fspec)
from fspec.kernels.qkv_rope_write import qkv_rope_write, qkv_rope_write_ref
from fspec.kernels.rope_cos_sin import inv_freq as make_inv_freq
from fspec.kernels.rope_kv_write import rope_pos_kv_write
from fspec.kernels.skinny_linear import SkinnyConfig, skinny_linear
from fspec.models import layers as L
from fspec.models import llama

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

ROPE = ("llama3", (500.0, 8.0, 1.0, 4.0, 64.0))  # rope_type, (theta, factor, low, high, original max)
# (N, Nkv, D, K): GQA groups of 1.5 / 4 / 1 / 5, head dims 8, 4, 16 and 12 (12: four-column programs, pairs
# (d, d + 6) across two of them), reductions that are not multiples of the tiles
SHAPES = [(3, 2, 8, 40), (4, 1, 4, 37), (2, 2, 16, 100), (5, 1, 12, 64)]


def _inputs(n, nkv, d, k, dtype, *, seed, position, slot, norm):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn((n + 2 * nkv) * d, k, generator=gen) * k**-0.5).to(dtype)
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype) if norm else None
    shape = (2, 5, 4, nkv, d)
    k_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    inv = make_inv_freq(d, ROPE[0], ROPE[1], "cpu")
    return x, w, g, torch.tensor([position]), inv, k_cache, v_cache, torch.tensor([slot])


@pytest.mark.parametrize(("n", "nkv", "d", "k"), SHAPES)
@pytest.mark.parametrize(("position", "slot", "norm"), [(13, 9, True), (4000, 0, False), (-1, -1, True)])
def test_kernel_equals_the_two_launches_and_the_reference(n, nkv, d, k, position, slot, norm):
    """float32: output and both caches bit for bit as `skinny_linear` then `rope_pos_kv_write` (same inputs,
    same float32 operations), and within float32 rounding of the reference; a padding row (position -1,
    slot -1) is rotated as position 0 and writes nothing; the caches' other bytes never change."""
    x, w, g, pos, inv, kc, vc, slots = _inputs(n, nkv, d, k, torch.float32, seed=n + d, position=position,
                                               slot=slot, norm=norm)  # fmt: skip
    kw = {"norm_weight": g, "positions": pos, "inv_freq": inv, "table_dtype": torch.float32}
    got_k, got_v = kc.clone(), vc.clone()
    got = qkv_rope_write(x, w, **kw, k_cache=got_k, v_cache=got_v, slot_mapping=slots, layer=1)
    # the two launches
    two_k, two_v = kc.clone(), vc.clone()
    y = skinny_linear(x, w, norm_weight=g)
    q, kk, v = (t.reshape(1, -1, d) for t in y.split([n * d, nkv * d, nkv * d], dim=-1))
    q_rot = rope_pos_kv_write(q, kk, v, pos, inv, torch.float32, two_k, two_v, slots, layer=1)
    assert got.shape == (1, (n + 2 * nkv) * d) and got.dtype == x.dtype
    assert torch.equal(got[:, : n * d], q_rot.reshape(1, -1))
    assert torch.equal(got[:, (n + nkv) * d :], y[:, (n + nkv) * d :])  # v as the product gave it
    assert torch.equal(got_k, two_k) and torch.equal(got_v, two_v)
    # the reference
    ref_k, ref_v = kc.clone(), vc.clone()
    want = qkv_rope_write_ref(x, w, **kw, k_cache=ref_k, v_cache=ref_v, slot_mapping=slots, layer=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, ref_v, rtol=1e-5, atol=1e-5)
    if slot >= 0:  # k_rot and v landed in the slot of layer 1, nothing else moved
        b, o = divmod(slot, 4)
        kv = got[0, n * d :].reshape(2, nkv, d)
        assert torch.equal(got_k[1, b, o], kv[0]) and torch.equal(got_v[1, b, o], kv[1])
        got_k[1, b, o], got_v[1, b, o] = kc[1, b, o], vc[1, b, o]
    assert torch.equal(got_k, kc) and torch.equal(got_v, vc)


# (N, Nkv, D, K, M): the tile kernel (D a multiple of 16: one or two programs per head, up to 16 rows) and
# the CUDA-core rows kernel (D = 8, 12, 4: 8-, 4- and 4-column programs); reductions not tile multiples
ROWS_SHAPES = [(3, 2, 16, 40, 2), (4, 1, 32, 37, 5), (2, 2, 16, 100, 16), (3, 2, 8, 40, 3), (5, 1, 12, 64, 6),
               (4, 1, 4, 37, 8)]  # fmt: skip


@pytest.mark.parametrize(("n", "nkv", "d", "k", "m"), ROWS_SHAPES)
@pytest.mark.parametrize(("norm", "rows_tile"), [(True, False), (False, False), (True, True), (False, True)])
def test_several_rows_equal_the_two_launches_and_the_reference(n, nkv, d, k, m, norm, rows_tile, monkeypatch):
    """float32, M rows at their own positions and slots, the second a padding row (position -1, slot -1):
    output and caches within float32 rounding of `skinny_linear` then `rope_pos_kv_write` and of the
    reference; each live row's k_rot and v are in its slot of layer 1 exactly as the output gives them, and
    no other byte of either cache changes. On the default several-row kernels, and on the rows tile kernel
    (an `fma` + `one_tile` several-row config; its BLOCK_N the head dim's power-of-two factor, up to 16)."""
    from fspec.kernels import qkv_rope_write as qrw
    from fspec.kernels import skinny_linear as sl

    if rows_tile:
        cfg = SkinnyConfig(block_n=min(16, d & -d), block_k=512, num_warps=8, fma=True, one_tile=True)
        monkeypatch.setattr(qrw, "rows_config", lambda *a, **kw: cfg)
        launched = []
        kernel = sl._skinny_rows_tile_kernel

        class Spy:
            def __getitem__(self, grid):
                return lambda *args, **kw: launched.append(kw["ROWS"]) or kernel[grid](*args, **kw)

        monkeypatch.setattr(qrw, "_skinny_rows_tile_kernel", Spy())
    gen = torch.Generator().manual_seed(n * d + m)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn((n + 2 * nkv) * d, k, generator=gen) * k**-0.5
    g = torch.rand(k, generator=gen) + 0.5 if norm else None
    kc, vc = (torch.randn(2, 5, 4, nkv, d, generator=gen) * 100 for _ in range(2))
    inv = make_inv_freq(d, ROPE[0], ROPE[1], "cpu")
    pos = torch.randint(0, 5000, (m,), generator=gen)
    slots = torch.randperm(20, generator=gen)[:m]
    pos[1], slots[1] = -1, -1
    kw = {"norm_weight": g, "positions": pos, "inv_freq": inv, "table_dtype": torch.float32, "layer": 1}
    got_k, got_v = kc.clone(), vc.clone()
    got = qkv_rope_write(x, w, **kw, k_cache=got_k, v_cache=got_v, slot_mapping=slots)
    assert got.shape == (m, (n + 2 * nkv) * d) and got.dtype == x.dtype
    if rows_tile:
        assert launched == [m]
    two_k, two_v = kc.clone(), vc.clone()
    y = skinny_linear(x, w, norm_weight=g)
    q, kk, v = (t.reshape(m, -1, d) for t in y.split([n * d, nkv * d, nkv * d], dim=-1))
    q_rot = rope_pos_kv_write(q, kk, v, pos, inv, torch.float32, two_k, two_v, slots, layer=1)
    torch.testing.assert_close(got[:, : n * d], q_rot.reshape(m, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, (n + nkv) * d :], y[:, (n + nkv) * d :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, two_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, two_v, rtol=1e-5, atol=1e-5)
    ref_k, ref_v = kc.clone(), vc.clone()
    want = qkv_rope_write_ref(x, w, **kw, k_cache=ref_k, v_cache=ref_v, slot_mapping=slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-5)
    for row in range(m):
        if slots[row] < 0:
            continue
        b, o = divmod(int(slots[row]), 4)
        kv = got[row, n * d :].reshape(2, nkv, d)
        assert torch.equal(got_k[1, b, o], kv[0]) and torch.equal(got_v[1, b, o], kv[1])
        got_k[1, b, o], got_v[1, b, o] = kc[1, b, o], vc[1, b, o]
    assert torch.equal(got_k, kc) and torch.equal(got_v, vc)


def test_bf16_equals_the_two_launches_and_is_near_the_reference():
    """bf16: bit for bit as the two interpreted launches (the interpreter rounds float32 -> bf16 by
    truncation in both), and within four bf16 roundings of the row's largest value of the reference (three
    roundings: the norm, the product, RoPE; RoPE mixes two rounded values)."""
    x, w, g, pos, inv, kc, vc, slots = _inputs(4, 2, 16, 96, torch.bfloat16, seed=7, position=77, slot=5,
                                               norm=True)  # fmt: skip
    kw = {"norm_weight": g, "positions": pos, "inv_freq": inv, "table_dtype": torch.bfloat16, "layer": 1}
    got_k, ref_k, two_k = kc.clone(), kc.clone(), kc.clone()
    got = qkv_rope_write(x, w, **kw, k_cache=got_k, v_cache=vc.clone(), slot_mapping=slots)
    y = skinny_linear(x, w, norm_weight=g)
    q, kk, v = (t.reshape(1, -1, 16) for t in y.split([64, 32, 32], dim=-1))
    q_rot = rope_pos_kv_write(q, kk, v, pos, inv, torch.bfloat16, two_k, vc.clone(), slots, layer=1)
    assert torch.equal(got[:, :64], q_rot.reshape(1, -1)) and torch.equal(got_k, two_k)
    want = qkv_rope_write_ref(x, w, **kw, k_cache=ref_k, v_cache=vc.clone(), slot_mapping=slots)
    tol = 4 * 2**-8 * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)
    torch.testing.assert_close(got_k.float(), ref_k.float(), rtol=0, atol=tol)


def test_op_matches_the_launcher_and_passes_opcheck():
    x, w, g, pos, _, kc, vc, slots = _inputs(3, 2, 8, 40, torch.float32, seed=1, position=21, slot=6,
                                             norm=True)  # fmt: skip
    op_k, op_v = kc.clone(), vc.clone()
    got = torch.ops.fspec.qkv_rope_write(
        x, w, g, 1e-6, pos, op_k, op_v, slots, torch.float32, ROPE[0], list(ROPE[1]), layer=1
    )
    inv = make_inv_freq(8, ROPE[0], ROPE[1], "cpu")
    want_k, want_v = kc.clone(), vc.clone()
    want = qkv_rope_write(x, w, norm_weight=g, positions=pos, inv_freq=inv, table_dtype=torch.float32,
                          k_cache=want_k, v_cache=want_v, slot_mapping=slots, layer=1)  # fmt: skip
    assert torch.equal(got, want) and torch.equal(op_k, want_k) and torch.equal(op_v, want_v)
    op = torch.ops.fspec.qkv_rope_write.default
    args = (x, w, g, 1e-6, pos, kc.clone(), vc.clone(), slots, torch.float32, ROPE[0], list(ROPE[1]))
    torch.library.opcheck(op, args, {"layer": 1})


def test_bad_input_names_the_argument():
    x, w, g, pos, inv, kc, vc, slots = _inputs(3, 2, 8, 40, torch.float32, seed=2, position=3, slot=1,
                                               norm=True)  # fmt: skip

    def call(**over):
        kw = dict(x=x, w=w, norm_weight=g, positions=pos, inv_freq=inv, table_dtype=torch.float32, k_cache=kc,
                  v_cache=vc, slot_mapping=slots, layer=1)  # fmt: skip
        kw.update(over)
        a, b = kw.pop("x"), kw.pop("w")
        return qkv_rope_write(a, b, **kw)

    cases = [
        ({"x": x.repeat(9, 1)}, r"^x: expected 1 to 8 rows \[M, K\] at head dim 8, got shape \(9, 40\)"),
        ({"x": x[:0]}, r"^x: expected a \[M, K\] tensor with 1 <= M <= 16, got shape \(0, 40\)"),
        ({"x": x.repeat(2, 1)}, r"^positions: expected a \[2\] integer tensor \(x's rows\), got \(1,"),
        ({"w": w[:-4]}, r"^w: expected \[\(N \+ 2·Nkv\)·D, K\] rows with N >= 1, Nkv = 2, D = 8"),
        ({"w": w[: 4 * 8]}, r"^w: expected \[\(N \+ 2·Nkv\)·D, K\] rows with N >= 1"),  # no q columns
        ({"w": w[:, :30]}, r"^w: expected a \[N, 40\] tensor"),
        ({"k_cache": kc.double(), "v_cache": vc.double()}, r"^k_cache: expected x's dtype torch.float32"),
        ({"positions": torch.tensor([1, 2])}, r"^positions: expected a \[1\] integer tensor \(x's rows"),
        ({"positions": torch.tensor([1.0])}, r"^positions: expected a \[1\] integer tensor"),
        ({"slot_mapping": torch.tensor([[1]])}, r"^slot_mapping: expected a \[1\] integer tensor"),
        ({"inv_freq": inv[:3]}, r"^inv_freq: expected shape \[D/2\] = \[4\], got \(3,\)"),
        ({"table_dtype": torch.int32}, r"^table_dtype: expected one of"),
        ({"layer": 2}, r"^layer: expected a value in \[0, 2\), got 2"),
        ({"norm_weight": g[:5]}, r"^norm_weight: expected a \[40\] tensor"),
        ({"eps": -1.0}, r"^eps: expected a finite number >= 0"),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**over)
    odd = torch.zeros(2, 5, 4, 2, 7)
    with pytest.raises(ValueError, match=r"^k_cache: expected an even head dim D"):
        call(w=torch.zeros(7 * 7, 40), k_cache=odd, v_cache=odd.clone(), inv_freq=inv[:3])
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()  # the op's fake (what torch.compile traces) checks too
    fake = [mode.from_tensor(t) for t in (x.repeat(9, 1), w, g, pos, kc, vc, slots)]
    with mode, pytest.raises(ValueError, match=r"^x: expected 1 to 8 rows"):
        torch.ops.fspec.qkv_rope_write(*fake[:3], 1e-6, *fake[3:], torch.float32, ROPE[0], list(ROPE[1]))


def _tiny(head_dim: int = 8) -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, rope_theta=500.0, rope_type="llama3", rope_factor=8.0,
        rope_original_max_position_embeddings=64,
    )  # fmt: skip


@pytest.mark.parametrize("fused_layer", [True, False])
@pytest.mark.parametrize("step_rows", [1, 3])
def test_decode_step_through_the_fused_projection_equals_the_two_launches(
    fused_layer, step_rows, monkeypatch
):
    """A paged batch-1 step after a prefill, of one row (decode) or three (a verification), routed as on
    CUDA (one-row products on skinny_linear, a narrow model's few rows on the fused layer; the fused layer,
    or the plain layer an EAGLE head's first layer takes): every layer launches `qkv_rope_write` and no
    `rope_pos_kv_write`, and the logits and every cache byte equal those of the two launches it replaces
    (the product, then `rope_pos_kv_write`: forced here by a layer that never hands its rows to
    `attend.qkv_rope`), under the interpreter; within float32 rounding for the plain layer, whose unfused
    several-row products (the six-row prefill's) are F.linear's."""
    from fspec.kernels import qkv_rope_write as qrw
    from fspec.kernels import rope_kv_write as rkv

    cfg = _tiny(16)  # D = 16: the several-row product's tile kernel, as the unfused path's
    params = L.fuse_projections(llama.init(cfg, seed=4))
    for layer in params["layers"]:  # norms away from 1, so that a missing input norm shows
        for name, leaf in layer.items():
            if "norm" in name:
                leaf.data.add_(0.3 * torch.randn(leaf.shape, generator=torch.Generator().manual_seed(5)))
    tables = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    positions = torch.arange(6)
    prefill = fspec.AttnMetadata(
        positions=positions,
        query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        block_table=tables,
        slot_mapping=_slot_mapping(tables, positions, 4, torch.zeros(6, dtype=torch.int64)),
    )
    step_positions = torch.arange(6, 6 + step_rows)
    step = fspec.AttnMetadata(
        positions=step_positions,
        query_start_loc=torch.tensor([0, step_rows], dtype=torch.int32),
        seq_lens=torch.tensor([6 + step_rows], dtype=torch.int32),
        block_table=tables,
        slot_mapping=_slot_mapping(tables, step_positions, 4, torch.zeros(step_rows, dtype=torch.int64)),
    )
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    use = L.use_fused_layer
    monkeypatch.setattr(L, "use_skinny_linear", lambda x, w, **kw: x.shape[:-1].numel() == 1)
    monkeypatch.setattr(L, "use_fused_layer", lambda p, x, c, **kw: fused_layer and use(p, x, c, cuda=True))
    use_qkv = L.use_qkv_rope
    monkeypatch.setattr(L, "use_qkv_rope", lambda x, w, c, **kw: use_qkv(x, w, c, cuda=True))
    launches = {"qkv": 0, "rope": 0}
    fused, rope = qrw.qkv_rope_write, rkv.rope_pos_kv_write

    def count(name, fn):
        return lambda *a, **k: launches.__setitem__(name, launches[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(qrw, "qkv_rope_write", count("qkv", fused))
    monkeypatch.setattr(rkv, "rope_pos_kv_write", count("rope", rope))

    def decode() -> tuple:
        cache = KVCache.create(cfg, num_blocks=6, block_size=4)
        _, _, cache = llama.forward(params, ids, prefill, cache, cfg=cfg, backend="paged", max_query_len=6)
        before = dict(launches)
        logits, _, cache = llama.forward(
            params, torch.tensor([9, 2, 5][:step_rows]), step, cache, cfg=cfg, backend="paged",
            max_query_len=step_rows,
        )  # fmt: skip
        return logits, cache, {k: launches[k] - before[k] for k in launches}

    with monkeypatch.context() as m:
        m.setattr(L, "_qkv_rope_attention", lambda *a, **k: None)
        want, want_cache, two = decode()
    got, got_cache, one = decode()
    assert two == {"qkv": 0, "rope": cfg.num_hidden_layers}
    assert one == {"qkv": cfg.num_hidden_layers, "rope": 0}
    if fused_layer:  # the fused layer's unfused path runs its several-row products on the same tile kernel
        assert torch.equal(got, want)
        assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    else:  # the plain layer's run on F.linear (the prefill's six rows too): another summation order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_cache.k, want_cache.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_cache.v, want_cache.v, rtol=1e-5, atol=1e-5)


def test_a_layer_hands_its_one_row_to_qkv_rope_with_or_without_rows(monkeypatch):
    """`decoder_layer` (an EAGLE head's layer) gives one row to `attend.qkv_rope` whether or not `rows`
    picks it (later draft steps pass rows), with no input norm; two rows, or an attend without the
    attribute, go through project_qkv and attend; the outputs agree with the plain path's."""
    cfg = _tiny()
    p = L.fuse_projections(llama.init(cfg, seed=6))["layers"][0]
    monkeypatch.setattr(L, "use_skinny_linear", lambda x, w, **kw: True)
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 32, generator=gen), torch.randn(2, 32, generator=gen)
    cos = sin = torch.zeros(2, 8)
    seen = []

    def attend(q, k, v, layer, cos, sin):
        seen.append("attend")
        return q * 0.5 + (k * v).repeat_interleave(2, dim=-2)

    def qkv_rope(x1, w, norm_weight, eps, layer, table_dtype):
        seen.append(("qkv_rope", x1.shape, w is p["qkv"], norm_weight, layer, table_dtype))
        q, k, v = L.project_qkv(p, x1, cfg=cfg)
        return attend(q, k, v, layer, None, None)

    attend.qkv_rope = qkv_rope
    for rows in (None, torch.tensor([0])):
        seen.clear()
        got = L.decoder_layer(p, x[:1], res[:1], cos[:1], sin[:1], attend, cfg=cfg, layer=1, rows=rows)
        assert seen == [("qkv_rope", (1, 32), True, None, 1, cos.dtype), "attend"]
        seen.clear()
        without = lambda *a: attend(*a)  # noqa: E731  (no qkv_rope attribute)
        plain = L.decoder_layer(p, x[:1], res[:1], cos[:1], sin[:1], without, cfg=cfg, layer=1, rows=rows)
        assert seen == ["attend"]
        assert torch.equal(got, plain)
    seen.clear()
    L.decoder_layer(p, x, res, cos, sin, attend, cfg=cfg, layer=1)  # two rows on the CPU: the plain path
    assert seen == ["attend"]
    use = (
        L.use_qkv_rope
    )  # two rows where the several-row layers are fused (CUDA, a narrow model): handed over
    monkeypatch.setattr(L, "use_qkv_rope", lambda x, w, c, **kw: use(x, w, c, cuda=True))
    seen.clear()
    got = L.decoder_layer(p, x, res, cos, sin, attend, cfg=cfg, layer=1)
    assert seen == [("qkv_rope", (2, 32), True, None, 1, cos.dtype), "attend"]
    seen.clear()
    assert torch.equal(got, L.decoder_layer(p, x, res, cos, sin, lambda *a: attend(*a), cfg=cfg, layer=1))
    wide = dataclasses.replace(cfg, hidden_size=L.FUSED_ROWS_MAX_HIDDEN + 32)  # a wide model keeps cuBLAS
    assert not L.use_qkv_rope(x, p["qkv"], wide) and L.use_qkv_rope(x, p["qkv"], cfg)


def test_paged_qkv_rope_bounds_the_attention_by_the_rows_it_has(monkeypatch):
    """`attend.qkv_rope`'s attention is told each request has at most min(T, max_query_len) query rows: one
    row stays one whatever bind's bound (the one-row attention tile), several rows take the bound; rows the
    kernel does not take (17, or 9 at a head dim of 8) and a cache of another dtype hand back None."""
    from fspec.ops import attention as A

    seen = []
    monkeypatch.setattr(A.kops, "qkv_rope_write", lambda x, w, *a, **k: torch.zeros(x.shape[0], w.shape[0]))
    monkeypatch.setattr(A.kops, "paged_attention", lambda q, *a, **k: seen.append(k["num_query"]) or q)
    cache = KVCache.create(_tiny(16), num_blocks=4, block_size=4)
    meta = fspec.decode_metadata(torch.tensor([5]), torch.tensor([[0, 1]], dtype=torch.int32), block_size=4)
    w = torch.zeros((4 + 2 * 2) * 16, 32)
    rope = (ROPE[0], ROPE[1])
    for rows, bound, want in ((1, 6, 1), (1, None, 1), (3, None, 3), (6, 4, 4), (6, 8, 6), (16, 16, 16)):
        x = torch.zeros(rows, 32)
        got = A._paged_qkv_rope(x, w, None, 1e-6, 0, torch.float32, meta=meta, cache=cache, rope_params=rope,
                                max_query_len=bound)  # fmt: skip
        assert got.shape == (rows, 4, 16) and seen[-1] == want
    count = len(seen)
    assert A._paged_qkv_rope(torch.zeros(17, 32), w, None, 1e-6, 0, torch.float32, meta=meta, cache=cache,
                             rope_params=rope) is None  # fmt: skip
    assert A._paged_qkv_rope(torch.zeros(2, 32).double(), w.double(), None, 1e-6, 0, torch.float32, meta=meta,
                             cache=cache, rope_params=rope) is None  # fmt: skip
    narrow = KVCache.create(_tiny(8), num_blocks=4, block_size=4)
    assert A._paged_qkv_rope(torch.zeros(9, 32), torch.zeros(64, 32), None, 1e-6, 0, torch.float32, meta=meta,
                             cache=narrow, rope_params=rope) is None  # fmt: skip
    assert len(seen) == count


def test_compiled_decode_step_through_the_fused_projection(monkeypatch):
    """torch.compile(fullgraph) of a paged batch-1 decode step routed through `fspec::qkv_rope_write` (as on
    CUDA): equal to eager (logits and cache), the graph calls the op once per layer and no
    `rope_pos_kv_write`, and a second step at the next position reuses the graph (no recompile)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled graph runs the op's reference
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    cfg = _tiny()
    params = L.fuse_projections(llama.init(cfg, seed=4))
    monkeypatch.setattr(L, "use_skinny_linear", lambda x, w, **kw: x.shape[:-1].numel() == 1)
    use = L.use_fused_layer
    monkeypatch.setattr(L, "use_fused_layer", lambda p, x, c, **kw: use(p, x, c, cuda=True))
    tables = torch.tensor([[0, 1]], dtype=torch.int32)

    def step(params, ids, meta, cache):
        return llama.forward(params, ids, meta, cache, cfg=cfg, backend="paged", max_query_len=1)[0]

    eager_cache, compiled_cache = (KVCache.create(cfg, num_blocks=4, block_size=4) for _ in range(2))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    for i, pos in enumerate((5, 6)):
        meta = fspec.decode_metadata(torch.tensor([pos]), tables, block_size=4)
        ids = torch.tensor([3 + pos])
        want = step(params, ids, meta, eager_cache)
        if i == 0:
            got, codes = run_and_get_code(compiled, params, ids, meta, compiled_cache)
            lines = [x for x in codes[-1].splitlines() if not x.strip().startswith("#")]
            assert sum("fspec.qkv_rope_write.default(" in x for x in lines) == cfg.num_hidden_layers
            assert not [x for x in lines if "rope_pos_kv_write" in x]
        else:
            got = compiled(params, ids, meta, compiled_cache)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled_cache.k, eager_cache.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled_cache.v, eager_cache.v, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def _compile_for_sm90_body():
    """The one-row kernel with the RoPE epilogue at a 1B layer's (D = 64), an 8B head's (D = 128) and a 1B
    EAGLE-3 head's q/k/v configs, with the input norm and without: no register spills (ptxas's report)."""
    import inspect

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fspec.kernels.skinny_linear import _skinny_gemv_kernel, default_config, gemv_block_k, norm_block

    names = list(inspect.signature(_skinny_gemv_kernel.fn).parameters)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "norm_ptr": "*bf16", "res_ptr": "*bf16",
             "part_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32", "positions_ptr": "*i64",
             "inv_freq_ptr": "*fp32", "slot_ptr": "*i64", "k_cache_ptr": "*bf16",
             "v_cache_ptr": "*bf16"}  # fmt: skip
    for rows, k, d, norm in ((3072, 2048, 64, True), (6144, 8192, 128, False), (3072, 4096, 64, False)):
        cfg = default_config(rows, k, one_row=True)
        block_k, one_tile, _ = gemv_block_k(cfg, k)
        consts = {"BLOCK_N": cfg.block_n, "BLOCK_K": block_k, "NORM": norm, "SILU": False, "RESIDUAL": False,
                  "PDL": True, "ONE_TILE": one_tile, "SPLIT_K": 1, "NORM_BLOCK": norm_block(k, cfg.num_warps),
                  "ROPE_HEAD_DIM": d, "TABLE_DTYPE": tl.bfloat16}  # fmt: skip
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        src = ASTSource(fn=_skinny_gemv_kernel, signature=sig, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
        # ptxas's own account: no spills (the 32-byte stack frame is cos / sin's argument reduction for
        # large arguments, a local array, as in _rope_kv_write_kernel)
        assert ptxas_spills(compiled.asm["ptx"]) is None, f"spills ({rows} x {k}, D = {d}, {consts})"
    # several rows (kernels/qkv_rope_write.py `rows_config`; models at most FUSED_ROWS_MAX_HIDDEN wide): the
    # tile kernel, 16 padded rows, at SmolLM2-135M's q/k/v (9 + 2 x 3 heads of 64, K = 576, input norm), its
    # EAGLE-3 head's (K = 1152, no norm) and a 896-wide model's (14 + 2 x 2 heads), no spills
    from fspec.kernels.qkv_rope_write import rows_config
    from fspec.kernels.skinny_linear import _skinny_linear_kernel

    names = list(inspect.signature(_skinny_linear_kernel.fn).parameters)
    for rows, k, d, norm in ((960, 576, 64, True), (960, 1152, 64, False), (1152, 896, 64, True)):
        cfg = rows_config(rows, k, d, norm=norm)
        assert not cfg.fma
        consts = {"M_PAD": 16, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "UPCAST": False, "NORM": norm,
                  "SILU": False, "RESIDUAL": False, "PDL": True, "ROPE_HEAD_DIM": d,
                  "TABLE_DTYPE": tl.bfloat16}  # fmt: skip
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        src = ASTSource(fn=_skinny_linear_kernel, signature=sig, constexprs=consts)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert ptxas_spills(compiled.asm["ptx"]) is None, f"spills ({rows} x {k}, D = {d}, {consts})"


def test_kernel_compiles_for_sm90():
    in_fresh_process(__file__, globals(), "_compile_for_sm90_body")


@pytest.mark.gpu
def test_gpu_equals_the_two_launches_at_llama_shapes():
    in_fresh_process(__file__, globals(), "_gpu_body")


@pytest.mark.gpu
def test_gpu_several_rows_equal_the_two_launches_at_smollm2_shapes():
    in_fresh_process(__file__, globals(), "_gpu_rows_body")


def _gpu_rows_body():
    """On the GPU, bf16 at SmolLM2-135M's q/k/v (9 q heads, 3 KV heads of 64, K = 576, input norm) for a
    batch-1 round's 6 verification rows and for 16 rows, and a 896-wide model's, one row of each padding:
    output and caches within one bf16 rounding of `skinny_linear` then `rope_pos_kv_write` (the same tile
    kernel's product: v equal), eagerly and in a CUDA graph replayed with new positions and slots."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for n, nkv, d, k, m in ((9, 3, 64, 576, 6), (9, 3, 64, 576, 16), (14, 2, 64, 896, 6)):
        _gpu_case(n, nkv, d, k, m, norm=True, theta=100000.0)


def _gpu_case(n: int, nkv: int, d: int, k: int, m: int, *, norm: bool, theta: float) -> None:
    """One shape on the GPU (bf16, m rows at positions from 1000 and slots from 500; with more than two rows
    the third is padding): `qkv_rope_write` against `skinny_linear` then `rope_pos_kv_write`, eagerly and in
    a CUDA graph replayed with new positions and slots (both caches compared whole each time)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n + m + d)
    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn((n + 2 * nkv) * d, k, device=dev, generator=gen, dtype=torch.bfloat16) * k**-0.5
    g = torch.rand(k, device=dev, generator=gen, dtype=torch.bfloat16) + 0.5 if norm else None
    kc = torch.randn(3, 64, 16, nkv, d, device=dev, generator=gen, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    inv = make_inv_freq(d, ROPE[0], (theta, 8.0, 1.0, 4.0, 8192.0), dev)
    pos = torch.arange(1000, 1000 + m, device=dev)
    slot = torch.arange(500, 500 + m, device=dev)
    if m > 2:
        pos[2], slot[2] = -1, -1
    kw = {"norm_weight": g, "positions": pos, "inv_freq": inv, "table_dtype": torch.bfloat16}

    def two():
        two_k, two_v = kc.clone(), vc.clone()
        y = skinny_linear(x, w, norm_weight=g)
        q, kk, v = (t.reshape(m, -1, d) for t in y.split([n * d, nkv * d, nkv * d], dim=-1))
        q_rot = rope_pos_kv_write(q, kk, v, pos, inv, torch.bfloat16, two_k, two_v, slot, layer=2)
        return q_rot.reshape(m, -1), y[:, (n + nkv) * d :], two_k, two_v

    got_k, got_v = kc.clone(), vc.clone()
    got = qkv_rope_write(x, w, **kw, k_cache=got_k, v_cache=got_v, slot_mapping=slot, layer=2)
    q_rot, v_want, two_k, two_v = two()
    torch.testing.assert_close(got[:, : n * d], q_rot, rtol=8e-3, atol=8e-3)
    assert torch.equal(got[:, (n + nkv) * d :], v_want)
    torch.testing.assert_close(got_k, two_k, rtol=8e-3, atol=8e-3)
    assert torch.equal(got_v, two_v)
    graph, static = torch.cuda.CUDAGraph(), torch.empty_like(got)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static.copy_(qkv_rope_write(x, w, **kw, k_cache=got_k, v_cache=got_v, slot_mapping=slot, layer=2))
    pos.add_(77)
    slot.copy_(torch.arange(3, 3 + m, device=dev))
    if m > 2:
        slot[2] = -1
    got_k.copy_(kc)
    got_v.copy_(vc)
    graph.replay()
    q_rot, _, two_k, two_v = two()
    torch.cuda.synchronize()
    torch.testing.assert_close(static[:, : n * d], q_rot, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got_k, two_k, rtol=8e-3, atol=8e-3)
    assert torch.equal(got_v, two_v)


def _gpu_body():
    """On the GPU, bf16 at a 1B layer's shapes (32 q heads, 8 KV heads of 64, K = 2048, input norm) and an
    8B EAGLE-3 head's (32 / 8 of 128, K = 8192), one row: output and caches equal `skinny_linear` then
    `rope_pos_kv_write` (same roundings; bit for bit where the compiler contracts both the same way, else
    within one bf16 rounding), eagerly and in a CUDA graph replayed with a new position and slot."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _gpu_case(32, 8, 64, 2048, 1, norm=True, theta=500000.0)
    _gpu_case(32, 8, 128, 8192, 1, norm=False, theta=500000.0)
