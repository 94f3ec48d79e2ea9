"""RoPE + K/V cache write (kernels/rope_kv_write.py): the interpreted kernel against its PyTorch reference and
against a float64 oracle, the registered op, and the paged model forward built on it.

q, k and v are views of one fused projection output [T, (N + 2·Nkv)·D + pad] whose pad columns hold NaN, so a
read past a head or a wrong row stride shows up as NaN. Caches are random (poison), stacked [L, ...] with the
step writing layer 1; slots are non-sequential, cross block boundaries, and include padding (-1).
"""

import itertools
import re

import pytest
import torch
from fresh_process import in_fresh_process

import fspec
from fspec.core.cache import KVCache
from fspec.core.metadata import _slot_mapping
from fspec.kernels import attention_ops
from fspec.kernels.rope_kv_write import rope_kv_write, rope_kv_write_ref
from fspec.models import layers as L
from fspec.models import llama

# The interpreter turns the 1-element array of a program id into an int (triton 3.6, numpy < 2.4).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

NUM_BLOCKS, BLOCK_SIZE, PAD = 6, 4, 5  # 24 slots per layer; PAD NaN columns after each projection row
# (T, N, Nkv, D): decode-sized and odd T, GQA groups of 2 and 8, head dims 64, 128 and the unpadded 80
SHAPES = [(1, 4, 2, 64), (3, 8, 1, 128), (7, 4, 2, 80), (7, 8, 1, 64), (3, 4, 2, 128), (1, 8, 1, 80)]
# slots per T: padding rows (-1), a block's last slot then the next block's first (3, 4), reversed order
SLOTS = {1: [13], 3: [7, -1, 4], 7: [23, 3, -1, 4, 8, -1, 16]}


def _heads_cfg(n: int, nkv: int, d: int) -> fspec.ModelConfig:
    """A config that only fixes the heads and RoPE (for `rope_cos_sin`)."""
    return fspec.ModelConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=n,
        num_key_value_heads=nkv, head_dim=d, rope_theta=500.0,
    )  # fmt: skip


def _inputs(t: int, n: int, nkv: int, d: int, dtype: torch.dtype, *, seed: int = 0):
    """q/k/v views of one wider projection row, cos/sin of positions, poisoned stacked caches, slots."""
    gen = torch.Generator().manual_seed(seed)
    width = (n + 2 * nkv) * d
    qkv = torch.full((t, width + PAD), float("nan"))
    qkv[:, :width] = torch.randn(t, width, generator=gen)
    qkv = qkv.to(dtype)
    q, k, v = qkv[:, :width].split([n * d, nkv * d, nkv * d], dim=-1)
    q, k, v = (x.unflatten(-1, (-1, d)) for x in (q, k, v))  # [T, heads, D] views, token stride width + PAD
    cfg = _heads_cfg(n, nkv, d)
    positions = torch.randint(0, 4000, (t,), generator=gen)
    cos, sin = L.rope_cos_sin(positions, cfg=cfg, dtype=dtype)  # [T, D]
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, nkv, d)
    k_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    slots = torch.tensor(SLOTS[t], dtype=torch.int64)
    return q, k, v, cos, sin, k_cache, v_cache, slots


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 bit patterns as integers that count representable values (adjacent floats differ by 1)."""
    b = _bits(x).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32: within 1e-6 (the interpreter runs the reference's fp32 ops in the same order: in practice exact);
    fp16: bit-identical (both round to nearest even); bf16: within one unit in the last place (the
    interpreter truncates fp32 -> bf16 where torch rounds)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=what)
        return
    ulps, allowed = (_ordered(got) - _ordered(want)).abs().max(), int(got.dtype == torch.bfloat16)
    assert ulps <= allowed, f"{what}: {int(ulps)} ulp apart (at most {allowed} allowed)"


def _oracle(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 rotate-half RoPE written per half: out = (x1·c - x2·s, x2·c + x1·s) over x [T, heads, D]."""
    x, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "n", "nkv", "d"), SHAPES)
def test_kernel_matches_reference_and_writes_only_live_slots(t, n, nkv, d, dtype):
    """Interpreted kernel == reference (q out, every cache byte); live slots of layer 1 hold RoPE(k) and v;
    slot -1 and every other slot and layer keep their bytes; the reference agrees with a float64 oracle."""
    q, k, v, cos, sin, k_cache, v_cache, slots = _inputs(t, n, nkv, d, dtype, seed=t * n + d)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots, layer=1)
    want = rope_kv_write_ref(q, k, v, cos, sin, ref_k, ref_v, slots, layer=1)
    assert out.shape == (t, n, d) and out.dtype == dtype and torch.isfinite(out).all()
    _assert_close(out, want, "q_out")
    _assert_close(k_cache, ref_k, "k_cache")
    assert torch.equal(_bits(v_cache), _bits(ref_v)), "v is copied without arithmetic"
    # the reference against the oracle: rotate-half, the right slots, nothing else touched
    live = slots >= 0
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]  # output rounding
    torch.testing.assert_close(want.double(), _oracle(q, cos, sin), rtol=tol, atol=tol)
    flat_k, flat_v = ref_k[1].reshape(-1, nkv, d), ref_v[1].reshape(-1, nkv, d)
    torch.testing.assert_close(flat_k[slots[live]].double(), _oracle(k, cos, sin)[live], rtol=tol, atol=tol)
    assert torch.equal(_bits(flat_v[slots[live]]), _bits(v[live]))
    untouched = torch.ones(2, NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[1, slots[live]] = False
    for after, before in ((k_cache, before_k), (v_cache, before_v)):
        a, b = after.reshape(2, -1, nkv, d), before.reshape(2, -1, nkv, d)
        assert torch.equal(_bits(a[untouched]), _bits(b[untouched])), "a slot that was not written changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "n", "nkv", "d"), SHAPES)
def test_positions_variant_equals_the_table_kernels_bit_for_bit(t, n, nkv, d, dtype):
    """rope_pos_kv_write (cos / sin from positions and inv_freq in the kernel, rounded to the tables' dtype)
    writes exactly the bytes that rope_cos_sin's tables followed by rope_kv_write write (padding positions
    -1 take position 0's values), equals its reference, and the op (inverse frequencies from the rope
    parameters) equals the launcher."""
    from fspec.kernels.rope_cos_sin import rope_cos_sin
    from fspec.kernels.rope_kv_write import rope_pos_kv_write, rope_pos_kv_write_ref

    q, k, v, _, _, k_cache, v_cache, slots = _inputs(t, n, nkv, d, dtype, seed=t * n + d + 1)
    gen = torch.Generator().manual_seed(t + d)
    positions = torch.randint(0, 40000, (t,), generator=gen)
    positions[0] = -1  # padding: position 0's values
    cfg = _heads_cfg(n, nkv, d)
    inv_freq = L.rope_inv_freq(cfg, "cpu")
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)  # the table kernel (interpreted)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = rope_kv_write(q, k, v, cos, sin, want_k, want_v, slots, layer=1)
    got_k, got_v = k_cache.clone(), v_cache.clone()
    got = rope_pos_kv_write(q, k, v, positions, inv_freq, dtype, got_k, got_v, slots, layer=1)
    for a, b in ((got, want), (got_k, want_k), (got_v, want_v)):
        assert torch.equal(_bits(a), _bits(b))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = rope_pos_kv_write_ref(q, k, v, positions, inv_freq, dtype, ref_k, ref_v, slots, layer=1)
    if dtype == torch.bfloat16:  # the interpreter truncates the bf16 tables where torch rounds: ~1 ulp of cos
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-6, atol=2**-4)
        torch.testing.assert_close(got_k.float(), ref_k.float(), rtol=2**-6, atol=2**-4)
    else:
        _assert_close(got, ref, "q_out")
        _assert_close(got_k, ref_k, "k_cache")
    op_k, op_v = k_cache.clone(), v_cache.clone()
    _, rope_type, rope = L.rope_key(cfg)
    rope = (rope_type, list(rope))
    op_out = torch.ops.fspec.rope_pos_kv_write(q, k, v, positions, op_k, op_v, slots, dtype, *rope, layer=1)
    assert torch.equal(_bits(op_out), _bits(got)) and torch.equal(_bits(op_k), _bits(got_k))
    # the positions really drive it: other positions rotate otherwise
    caches = k_cache.clone(), v_cache.clone()
    moved = rope_pos_kv_write(q, k, v, positions + 7, inv_freq, dtype, *caches, slots)
    assert not torch.equal(_bits(moved), _bits(got))


def test_positions_variant_refuses_bad_shapes_and_dtypes_naming_them():
    from fspec.kernels.rope_kv_write import rope_pos_kv_write

    q, k, v, _, _, k_cache, v_cache, slots = _inputs(3, 4, 2, 64, torch.float32)
    inv_freq = torch.ones(32)
    with pytest.raises(ValueError, match=r"positions/inv_freq: expected shapes \[T\] = \[3\]"):
        rope_pos_kv_write(q, k, v, torch.zeros(2, dtype=torch.int64), inv_freq, torch.float32, k_cache,
                          v_cache, slots)  # fmt: skip
    with pytest.raises(ValueError, match=r"\[D/2\] = \[32\]"):
        rope_pos_kv_write(q, k, v, torch.zeros(3, dtype=torch.int64), torch.ones(31), torch.float32, k_cache,
                          v_cache, slots)  # fmt: skip
    with pytest.raises(ValueError, match=r"table_dtype: expected one of"):
        rope_pos_kv_write(q, k, v, torch.zeros(3, dtype=torch.int64), inv_freq, torch.float64, k_cache,
                          v_cache, slots)  # fmt: skip


def test_positions_op_passes_opcheck():
    q, k, v, _, _, k_cache, v_cache, slots = _inputs(3, 4, 2, 64, torch.float32)
    _, rope_type, rope = L.rope_key(_heads_cfg(4, 2, 64))
    rope = (rope_type, list(rope))
    caches = k_cache.clone(), v_cache.clone()
    args = (q, k, v, torch.tensor([5, -1, 300]), *caches, slots, torch.float32, *rope)
    torch.library.opcheck(torch.ops.fspec.rope_pos_kv_write.default, args, {"layer": 1})


def test_single_layer_cache_all_padding_and_empty_step():
    """A 4-D cache works without `layer` (== the reference); an all-padding step leaves it bit-identical but
    still returns the rotated q; T = 0 is a no-op."""
    q, k, v, cos, sin, k_cache, v_cache, slots = _inputs(3, 4, 2, 64, torch.float32)
    kc, vc = k_cache[0].clone(), v_cache[0].clone()
    before_k, before_v = kc.clone(), vc.clone()
    padding = torch.full_like(slots, -1)
    out = rope_kv_write(q, k, v, cos, sin, kc, vc, padding)
    assert torch.equal(_bits(kc), _bits(before_k)) and torch.equal(_bits(vc), _bits(before_v))
    _assert_close(out, rope_kv_write_ref(q, k, v, cos, sin, kc.clone(), vc.clone(), padding), "q_out")
    empty = rope_kv_write(q[:0], k[:0], v[:0], cos[:0], sin[:0], kc, vc, slots[:0])
    assert empty.shape == (0, 4, 64) and torch.equal(_bits(kc), _bits(before_k))
    ref_k, ref_v = kc.clone(), vc.clone()
    out = rope_kv_write(q, k, v, cos, sin, kc, vc, slots)
    _assert_close(out, rope_kv_write_ref(q, k, v, cos, sin, ref_k, ref_v, slots), "q_out")
    _assert_close(kc, ref_k, "k_cache")
    assert torch.equal(vc, ref_v) and not torch.equal(kc, before_k)


def test_launcher_reads_strided_slots_and_cos_sin():
    """A stride-2 slot mapping (poison slots between) and cos/sin as column views of wider rows give the
    results of their contiguous copies."""
    q, k, v, cos, sin, k_cache, v_cache, slots = _inputs(7, 4, 2, 64, torch.float32, seed=9)
    wide = torch.full((2, 7, 64 + 3), float("nan"))
    wide[0, :, 3:], wide[1, :, 3:] = cos, sin
    poisoned = torch.full((14,), 17, dtype=torch.int64)  # 17: a slot no token owns
    poisoned[::2] = slots
    kc, vc = k_cache.clone(), v_cache.clone()
    want = rope_kv_write(q, k, v, cos, sin, kc, vc, slots, layer=1)
    got = rope_kv_write(q, k, v, wide[0, :, 3:], wide[1, :, 3:], k_cache, v_cache, poisoned[::2], layer=1)
    assert torch.equal(got, want) and torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


def test_bad_shapes_name_the_argument():
    """An odd head dim (rotate-half needs pairs), a head shape unlike the cache's, or cos of another T."""
    q, k, v, cos, sin, k_cache, v_cache, slots = _inputs(3, 4, 2, 64, torch.float32)
    odd, odd_cache = torch.zeros(3, 4, 63), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 63)
    with pytest.raises(ValueError, match="even head dim"):
        rope_kv_write(odd, odd[:, :2], odd[:, :2], cos[:, :63], sin[:, :63], odd_cache, odd_cache, slots)
    with pytest.raises(ValueError, match="k/v"):
        rope_kv_write(q, k[:, :1], v[:, :1], cos, sin, k_cache, v_cache, slots, layer=1)
    with pytest.raises(ValueError, match="cos"):
        rope_kv_write_ref(q, k, v, cos[:2], sin, k_cache, v_cache, slots, layer=1)
    with pytest.raises(ValueError, match="layer"):
        rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots, layer=2)


# ----------------------------------------------------------------------------------------------------------
# The registered op: schema, fake implementation, dispatch, torch.compile
# ----------------------------------------------------------------------------------------------------------


def test_op_passes_opcheck_and_its_fake_gives_q_out_in_the_cache_dtype():
    """Schema (exact mutation of both caches), fake and dispatch agree, and the op computes the reference's
    result; on "meta" tensors the fake returns q_out [T, N, D] in the cache's dtype."""
    q, k, v, cos, sin, k_cache, v_cache, slots = _inputs(3, 4, 2, 64, torch.float32)
    op = torch.ops.fspec.rope_kv_write.default
    args = (q, k, v, cos, sin, k_cache.clone(), v_cache.clone(), slots)
    torch.library.opcheck(op, args, {"layer": 1})
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = rope_kv_write_ref(q, k, v, cos, sin, ref_k, ref_v, slots, layer=1)
    _assert_close(op(*args, layer=1), want, "q_out")
    _assert_close(args[5], ref_k, "k_cache")
    assert torch.equal(args[6], ref_v)
    meta = [x.to("meta") for x in (q, k, v, cos, sin)]
    caches = [x.to("meta", torch.bfloat16) for x in (k_cache, v_cache)]
    out = op(*meta, *caches, slots.to("meta"), layer=1)
    assert out.shape == (3, 4, 64) and out.dtype == torch.bfloat16 and out.device.type == "meta"


def _step(q, k, v, cos, sin, k_cache, v_cache, slots):
    return torch.ops.fspec.rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots, layer=1) * 2.0


def test_op_runs_the_kernel_eagerly_and_compiles_fullgraph_keeping_the_cache_writes():
    """Eager CPU calls under the interpreter run the Triton kernel (== the reference); torch.compile
    (fullgraph) traces the op through its fake and keeps its in-place writes of the donated caches."""
    q, k, v, cos, sin, k_cache, v_cache, slots = _inputs(7, 4, 2, 80, torch.float32, seed=3)
    assert attention_ops.kernels_interpreted()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = rope_kv_write_ref(q, k, v, cos, sin, ref_k, ref_v, slots, layer=1) * 2.0
    kc, vc = k_cache.clone(), v_cache.clone()
    eager = _step(q, k, v, cos, sin, kc, vc, slots)
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    ck, cv = k_cache.clone(), v_cache.clone()
    out = compiled(q, k, v, cos, sin, ck, cv, slots)
    for got, cache, what in ((eager, kc, "eager"), (out, ck, "compiled")):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m, w=what: f"{w} q_out: {m}")
        torch.testing.assert_close(cache, ref_k, rtol=0, atol=1e-6, msg=lambda m, w=what: f"{w} k: {m}")
    assert torch.equal(cv, ref_v) and torch.equal(vc, ref_v)
    assert not torch.equal(ck, k_cache), "the compiled op must mutate the donated cache"


# ----------------------------------------------------------------------------------------------------------
# The paged model forward (RoPE fused into the cache write) against the "reference" backend
# ----------------------------------------------------------------------------------------------------------


def _tiny(model_type: str) -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=500.0, model_type=model_type,
        qk_norm=model_type == "qwen3", rope_type="llama3", rope_factor=8.0,
        rope_original_max_position_embeddings=64,
    )  # fmt: skip


def _prefill(cfg: fspec.ModelConfig):
    """Two ragged prompts (5 and 7 tokens, the second crossing two block boundaries) and one padding token."""
    tables = torch.tensor([[3, 0, -1], [1, 5, 2], [-1, -1, -1]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, -1])
    req = torch.tensor([0] * 5 + [1] * 7 + [2])
    meta = fspec.AttnMetadata(
        positions=positions,
        query_start_loc=torch.tensor([0, 5, 12, 13], dtype=torch.int32),
        seq_lens=torch.tensor([5, 7, 0], dtype=torch.int32),
        block_table=tables,
        slot_mapping=_slot_mapping(tables, positions, BLOCK_SIZE, req),
    )
    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    return ids, meta


@pytest.mark.parametrize("ops", ["reference", "triton"])
@pytest.mark.parametrize(
    ("model_type", "fused"), [("llama", True), ("llama", False), ("qwen3", True), ("qwen2", False)]
)
def test_paged_forward_equals_reference_backend(model_type, fused, ops, monkeypatch):
    """backend="paged" (RoPE inside fspec::rope_kv_write) == backend="reference" on a prefill: logits, aux
    hidden, and every live cache slot (layer 0's K/V bit for bit: same inputs, same fp32 ops); for fused and
    separate q/k/v weights, qk-norm (qwen3) and q/k/v biases (qwen2); the ops run their PyTorch references
    ("reference") or the interpreted Triton kernels ("triton")."""
    if ops == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops fall back to their references
    cfg = _tiny(model_type)
    params = llama.init(cfg, seed=2)
    gen = torch.Generator().manual_seed(3)
    for layer in params["layers"]:  # norms and biases away from 1 and 0, so that they matter
        for name, leaf in layer.items():
            if "norm" in name or "bias" in name:
                leaf.data.add_(0.3 * torch.randn(leaf.shape, generator=gen))
    if fused:
        params = L.fuse_projections(params)
    ids, meta = _prefill(cfg)
    out = {}
    for backend in ("reference", "paged"):
        cache = KVCache.create(cfg, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        logits, hidden, cache = llama.forward(
            params, ids, meta, cache, cfg=cfg, backend=backend, aux_layer_ids=(1,), max_query_len=7
        )
        out[backend] = (logits, hidden.aux, cache)
    (want, want_aux, want_cache), (got, got_aux, got_cache) = out["reference"], out["paged"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_aux, want_aux, rtol=1e-5, atol=1e-5)
    # block NUM_BLOCKS is the reference backend's scratch block (it writes padding rows there)
    for name in ("k", "v"):
        g, w = getattr(got_cache, name)[:, :NUM_BLOCKS], getattr(want_cache, name)[:, :NUM_BLOCKS]
        assert torch.equal(g[0], w[0]), f"layer 0's {name} cache must be bit-identical"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got_cache.k[:, :NUM_BLOCKS].abs().sum() > 0


def test_compiled_paged_forward_hands_the_projection_output_to_the_op(monkeypatch):
    """torch.compile(fullgraph) of a fused model's paged decode step equals eager, and in Inductor's code each
    layer's fspec::rope_pos_kv_write reads q, k and v as views of the qkv matmul's output, with no kernel
    between the two (the H200 profile showed ~5 RoPE/copy kernels per layer there before the fusion), and no
    cos/sin tables are computed at all (the op computes them from the positions)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled graph runs the op's reference
    from torch._inductor.utils import run_and_get_code

    cfg = _tiny("llama")
    params = L.fuse_projections(llama.init(cfg, seed=4))
    tables = torch.tensor([[0, 1], [2, 3], [-1, -1]], dtype=torch.int32)
    meta = fspec.decode_metadata(torch.tensor([0, 5, -1]), tables, block_size=BLOCK_SIZE)
    ids = torch.tensor([3, 8, 0])

    def step(params, ids, meta, cache):
        return llama.forward(params, ids, meta, cache, cfg=cfg, backend="paged", max_query_len=1)[0]

    eager_cache, compiled_cache = (KVCache.create(cfg, num_blocks=4, block_size=BLOCK_SIZE) for _ in range(2))
    want = step(params, ids, meta, eager_cache)
    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(step, fullgraph=True), params, ids, meta, compiled_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled_cache.k, eager_cache.k, rtol=1e-5, atol=1e-5)
    lines = [x.strip() for x in codes[-1].splitlines() if not x.strip().startswith("#")]
    ops = [i for i, x in enumerate(lines) if "fspec.rope_pos_kv_write.default(" in x]
    assert len(ops) == cfg.num_hidden_layers
    # cos / sin come from the positions inside the op: the tables, read by nothing else, are not computed
    assert not [x for x in lines if "rope_tables" in x or "rope_cos_sin" in x]
    for i in ops:
        j = max(j for j in range(i) if lines[j].startswith("extern_kernels."))
        mm = re.fullmatch(r"extern_kernels\.(?:add)?mm\(.*out=(buf\d+)\)", lines[j])
        assert mm, f"the op's inputs should come straight from the qkv matmul, got {lines[j]}"
        between = [x for x in lines[j + 1 : i] if re.match(r"(cpp_fused|triton_)\w*\(", x)]
        assert all("_cos_" in x and "_sin_" in x for x in between), between
        views = re.findall(r"reinterpret_tensor\((buf\d+),", lines[i].split("rope_pos_kv_write.default(")[1])
        assert views[:3] == [mm.group(1)] * 3, lines[i]


# ----------------------------------------------------------------------------------------------------------
# Compiled (not interpreted) kernel: sm_90 code generation here, the H200 under @pytest.mark.gpu
# ----------------------------------------------------------------------------------------------------------


def _in_fresh_process(body: str) -> None:
    in_fresh_process(__file__, globals(), body)


def _compile_for_h200() -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fspec.kernels import rope_kv_write as rkv

    kernel = rkv._rope_kv_write_kernel
    cases = (("bf16", (32, 8, 128)), ("fp16", (16, 2, 64)), ("fp32", (8, 1, 80)))
    for (dtype, (n, nkv, d)), from_positions in itertools.product(cases, (False, True)):
        types = dict(cos_ptr=f"*{dtype}", sin_ptr=f"*{dtype}", slot_mapping_ptr="*i64")
        types |= dict(positions_ptr="*i64", inv_freq_ptr="*fp32")
        types |= {f"{x}_ptr": f"*{dtype}" for x in ("q", "k", "v", "q_out", "k_cache", "v_cache")}
        consts = dict(NUM_HEADS=n, KV_HEADS=nkv, HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2))
        table = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
        consts |= dict(PDL=True, FROM_POSITIONS=from_positions, TABLE_DTYPE=table)
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in kernel.arg_names}
        hint = [["tt.divisibility", 16]]  # aligned buffers and strides, as at real shapes
        attrs = {(i,): hint for i, a in enumerate(kernel.arg_names) if sig[a][0] == "*" or "stride" in a}
        src = ASTSource(kernel, sig, consts, attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"]
        stores = set(re.findall(r"st\.global[\w.]*", ptx))
        assert stores, f"{dtype}: no global stores in the PTX"


def test_kernel_compiles_for_h200():
    """The compiled (not interpreted) kernel builds for sm_90: bf16 Llama-8B heads, fp16, fp32 with D = 80,
    reading the cos / sin tables and computing them from positions."""
    _in_fresh_process("_compile_for_h200")


def _gpu_matches_reference() -> None:
    """Llama-8B decode and verify shapes on CUDA: T = 64 and 37 tokens (a padding row every 5th), 32/8 heads
    of 128, block 16, a 2-layer bf16 and fp32 cache; q/k/v views of one projection output."""
    for dtype, t in ((torch.bfloat16, 64), (torch.float32, 37)):
        gen = torch.Generator().manual_seed(t)
        n, nkv, d, bs, blocks = 32, 8, 128, 16, 64
        qkv = torch.randn(t, (n + 2 * nkv) * d + 64, generator=gen).to(dtype).cuda()
        q, k, v = (
            x.unflatten(-1, (-1, d)) for x in qkv[:, : (n + 2 * nkv) * d].split([n * d, nkv * d, nkv * d], -1)
        )
        pos = torch.randint(0, 8000, (t,), generator=gen)
        cfg = _heads_cfg(n, nkv, d)
        cos, sin = L.rope_cos_sin(pos.cuda(), cfg=cfg, dtype=dtype)
        slots = torch.randperm(blocks * bs, generator=gen)[:t]
        slots[::5] = -1
        slots = slots.cuda()
        kc = torch.randn(2, blocks, bs, nkv, d, generator=gen).to(dtype).cuda()
        vc = torch.randn_like(kc)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        kc_pos, vc_pos = kc.clone(), vc.clone()
        out = torch.ops.fspec.rope_kv_write(q, k, v, cos, sin, kc, vc, slots, layer=1)
        # cos / sin from the positions inside the kernel: exactly the tables' bits
        _, rope_type, rope = L.rope_key(cfg)
        rope = (rope_type, list(rope))
        out_pos = torch.ops.fspec.rope_pos_kv_write(
            q, k, v, pos.cuda(), kc_pos, vc_pos, slots, dtype, *rope, layer=1
        )
        assert torch.equal(out_pos, out) and torch.equal(kc_pos, kc) and torch.equal(vc_pos, vc)
        want = rope_kv_write_ref(q, k, v, cos, sin, kc_ref, vc_ref, slots, layer=1)
        torch.cuda.synchronize()
        if dtype == torch.float32:  # FMA contraction on the GPU: ~1 ulp of the products
            torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
            torch.testing.assert_close(kc, kc_ref, rtol=0, atol=1e-5)
        else:  # one rounding of (possibly contracted) fp32 results: at most 1 bf16 ulp apart
            assert (_ordered(out.cpu()) - _ordered(want.cpu())).abs().max() <= 1
            assert (_ordered(kc.cpu()) - _ordered(kc_ref.cpu())).abs().max() <= 1
        assert torch.equal(vc, vc_ref)
        written = torch.zeros(2, blocks * bs, dtype=torch.bool, device="cuda")
        written[1, slots[slots >= 0]] = True
        assert torch.equal(kc.view(2, -1, nkv, d)[~written], kc_ref.view(2, -1, nkv, d)[~written])


@pytest.mark.gpu
def test_kernel_gpu_matches_reference():
    """The compiled kernel on CUDA equals the reference (within one output rounding) and writes exactly the
    reference's slots; with cos / sin from the positions it writes the same bits."""
    _in_fresh_process("_gpu_matches_reference")
