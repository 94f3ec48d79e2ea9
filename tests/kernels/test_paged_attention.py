"""Paged attention and K/V cache writes: interpreted kernels vs their PyTorch references vs a naive loop.

CPU shapes are tiny (the interpreter costs ~0.4 ms per program iteration): B = 4 requests (one of them a
padding row with seq_len 0), Nkv = 2 KV heads x group 2, D = 16, block_size 4, max_blocks 5, non-sequential
block tables, contexts that cross block boundaries. Cache slots that no request owns hold NaN, so any read
outside a request's context turns the output into NaN.
"""

import dataclasses
import math
import re

import pytest
import torch
from fresh_process import in_fresh_process

from fspec.kernels import attention_ops
from fspec.kernels.kv_write import kv_write, kv_write_ref
from fspec.kernels.paged_attention import (
    AttentionConfig,
    default_config,
    paged_attention,
    paged_attention_ref,
)

# The interpreter turns the 1-element array of a runtime loop bound into an int (triton 3.6, numpy < 2.4).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# (rtol, atol) of the kernel and the reference against a float64 loop over the same (rounded) inputs: fp32 is
# accumulation order only; fp16/bf16 add the rounding of the output (and the interpreter's bf16 conversion,
# which truncates where torch rounds: up to 2 ulp of 2^-8).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 24, 4, 5
# Launch configs: one split (the main kernel normalises), and split-K with the reduce kernel (partition 8 of
# a 20-token capacity = 3 splits; block_n 4 = one cache block per iteration, 8 = two blocks per iteration).
CONFIGS = {
    "one_split": AttentionConfig(block_n=16, partition=32),
    "split_bn4": AttentionConfig(block_n=4, partition=8),
    "split_bn8": AttentionConfig(block_n=8, partition=8),
}
# seq_lens per request (0 = padding request) and live query tokens of each (the rest of num_query rows are
# padding, positions -1): contexts of 1 token, ending on a block boundary (4, 20 = full table), crossing one.
LENS = {"ragged": ([1, 7, 0, 13], [1, 2, 0, 3]), "boundaries": ([20, 4, 0, 5], [3, 1, 0, 2])}


def _metadata(seq_lens: list[int], live: list[int], num_query: int, seed: int):
    """Block table (random distinct blocks; -1 or garbage past the context), positions, query_start_loc."""
    gen = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    table = torch.full((b, MAX_BLOCKS), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        k = -(-n // BLOCK_SIZE)
        table[i, :k] = perm[used : used + k].int()
        table[i, k:] = -1 if i % 2 else 123_456  # unallocated: -1, or garbage that must never be read
        used += k
    positions = torch.full((b, num_query), -1, dtype=torch.int64)
    for i, (n, m) in enumerate(zip(seq_lens, live)):
        m = min(m, num_query)
        positions[i, :m] = torch.arange(n - m, n)  # the last m tokens are this step's (causal among them)
    qsl = torch.arange(b + 1, dtype=torch.int32) * num_query
    return table, torch.tensor(seq_lens, dtype=torch.int32), positions.reshape(-1), qsl


def _live_slots(table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    slots = [
        int(table[b, j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE
        for b in range(len(seq_lens))
        for j in range(int(seq_lens[b]))
    ]
    return torch.tensor(slots, dtype=torch.int64)


def _cache(table, seq_lens, *, kv_heads: int, head_dim: int, dtype, seed: int, poison=float("nan")):
    """K/V caches [NUM_BLOCKS, BLOCK_SIZE, Nkv, D]: random in live slots, `poison` everywhere else."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS * BLOCK_SIZE, kv_heads, head_dim)
    k, v = torch.full(shape, poison), torch.full(shape, poison)
    live = _live_slots(table, seq_lens)
    k[live] = torch.randn(len(live), kv_heads, head_dim, generator=gen)
    v[live] = torch.randn(len(live), kv_heads, head_dim, generator=gen)
    view = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    return k.view(view).to(dtype), v.view(view).to(dtype)


def _naive(q, k_cache, v_cache, table, seq_lens, positions, qsl, *, scale):
    """Per-token float64 loop: gather positions 0..p of the token's request through its table, softmax."""
    t, n, d = q.shape
    kv_heads = k_cache.shape[2]
    group = n // kv_heads
    kf, vf = k_cache.double().reshape(-1, kv_heads, d), v_cache.double().reshape(-1, kv_heads, d)
    out = torch.zeros(t, n, d, dtype=torch.float64)
    for tok in range(t):
        b = int(torch.searchsorted(qsl[1:], torch.tensor(tok, dtype=torch.int32), right=True))
        p = int(positions[tok])
        if p < 0:
            continue
        assert p < int(seq_lens[b])
        slots = [int(table[b, j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE for j in range(p + 1)]
        for head in range(n):
            keys, values = kf[slots, head // group], vf[slots, head // group]  # [p + 1, D]
            w = torch.softmax(keys @ q[tok, head].double() * scale, dim=0)
            out[tok, head] = w @ values
    return out


def _case(lens: str, num_query: int, dtype, *, kv_heads=2, group=2, head_dim=16, seed=0):
    seq_lens, live = LENS[lens]
    table, seq, positions, qsl = _metadata(seq_lens, live, num_query, seed)
    kc, vc = _cache(table, seq, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(len(seq_lens) * num_query, kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, kc, vc, table, seq, positions, qsl


def _full_config(
    cfg: AttentionConfig, *, num_query: int, group: int = 2, head_dim: int = 16
) -> AttentionConfig:
    """The launcher's complete config for the test cases' sizes (4 requests, 2 KV heads, capacity 20)."""
    return default_config(
        batch=4, kv_heads=2, group=group, num_query=num_query, head_dim=head_dim,
        capacity=MAX_BLOCKS * BLOCK_SIZE, override=cfg,
    )  # fmt: skip


def _num_splits(cfg: AttentionConfig, *, num_query: int, group: int = 2, head_dim: int = 16) -> int:
    full = _full_config(cfg, num_query=num_query, group=group, head_dim=head_dim)
    return math.ceil(MAX_BLOCKS * BLOCK_SIZE / full.partition)


# ----------------------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------------------


def test_split_configs_really_split():
    """The split configs produce 3 partitions of the 20-token capacity, the one-split config a single one."""
    assert _num_splits(CONFIGS["one_split"], num_query=3) == 1
    assert _num_splits(CONFIGS["split_bn4"], num_query=3) == 3
    assert _num_splits(CONFIGS["split_bn8"], num_query=1) == 3


def test_the_heuristic_splits_into_partitions_of_at_least_min_partition(monkeypatch):
    """The split heuristic's shortest partition is the module constant MIN_PARTITION (64, table `switches`
    run g), read when a launch is planned (a benchmark may set it before compiling: kernel_timeline.py)."""
    from fspec.kernels import paged_attention as pa

    sizes = dict(batch=1, kv_heads=8, group=4, num_query=1, head_dim=64, capacity=2304)
    assert pa.MIN_PARTITION == 64
    assert pa.default_config(**sizes).partition == 64  # 36 splits of the 2304-token capacity
    monkeypatch.setattr(pa, "MIN_PARTITION", 256)
    assert pa.default_config(**sizes).partition == 256  # 9 splits


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_query", [1, 3])
@pytest.mark.parametrize("lens", list(LENS))
def test_paged_attention_kernel_and_reference_match_naive_loop(lens, num_query, dtype, config):
    """Kernel and reference equal the per-token loop; padding rows are exactly 0; nothing reads NaN slots."""
    q, kc, vc, table, seq, positions, qsl = _case(lens, num_query, dtype)
    scale = 0.3
    expected = _naive(q, kc, vc, table, seq, positions, qsl, scale=scale)
    args = (q, kc, vc, table, seq, positions, qsl)
    out = paged_attention(*args, scale=scale, num_query=num_query, config=CONFIGS[config])
    ref = paged_attention_ref(*args, scale=scale, num_query=num_query)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape == q.shape
    rtol, atol = TOL[dtype]
    for name, got in (("kernel", out), ("reference", ref)):
        assert torch.isfinite(got).all(), f"{name} read a NaN-poisoned slot outside some request's context"
        torch.testing.assert_close(
            got.double(), expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert (got[positions < 0] == 0).all(), f"{name}: padding rows must be exactly 0"
    assert (positions >= 0).sum() >= 3 and (positions < 0).any()  # the case has live and padding rows


@pytest.mark.parametrize("kv_heads, group, head_dim", [(1, 4, 24), (3, 1, 16)])
def test_paged_attention_gqa_shapes_and_unpadded_head_dim(kv_heads, group, head_dim):
    """Group 4 with D = 24 (masked to a 32-wide tile) and plain MHA (group 1) match the loop: split or not,
    and with the (query, head) rows spread over several programs (block_m 4 < 3 x group rows)."""
    q, kc, vc, table, seq, positions, qsl = _case(
        "ragged", 3, torch.float32, kv_heads=kv_heads, group=group, head_dim=head_dim, seed=5
    )
    expected = _naive(q, kc, vc, table, seq, positions, qsl, scale=0.2)
    tiled = AttentionConfig(block_n=4, partition=8, block_m=4)  # interpreter only: tl.dot needs 16 on a GPU
    for cfg in (CONFIGS["one_split"], CONFIGS["split_bn4"], tiled):
        out = paged_attention(q, kc, vc, table, seq, positions, qsl, scale=0.2, num_query=3, config=cfg)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_reads_nothing_outside_the_context():
    """Different garbage (NaN, +-1e4) in slots no request owns gives bit-identical kernel outputs."""
    seq_lens, live = LENS["ragged"]
    table, seq, positions, qsl = _metadata(seq_lens, live, 3, seed=7)
    q = torch.randn(len(seq_lens) * 3, 4, 16, generator=torch.Generator().manual_seed(8))
    outs = []
    for poison in (float("nan"), 1e4, -1e4):
        kc, vc = _cache(table, seq, kv_heads=2, head_dim=16, dtype=torch.float32, seed=9, poison=poison)
        args = (q, kc, vc, table, seq, positions, qsl)
        outs.append(paged_attention(*args, scale=0.25, num_query=3, config=CONFIGS["split_bn4"]))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("config", ["one_split", "split_bn4"])
def test_paged_attention_seq_lens_bound_the_context_even_when_positions_do_not(config):
    """seq_lens wins over stale positions: seq_len 0 reads nothing (output 0), a position past seq_len sees
    only keys < seq_len; the NaN-poisoned slots past each context stay unread."""
    seq_lens, live = LENS["ragged"]
    table, seq, positions, qsl = _metadata(seq_lens, live, 3, seed=13)
    kc, vc = _cache(table, seq, kv_heads=2, head_dim=16, dtype=torch.float32, seed=14)
    positions = positions.view(4, 3).clone()
    positions[2] = torch.tensor([2, 3, 4])  # padding request (seq_len 0) with stale positions
    positions[1, 2] = 9  # request 1 holds 7 tokens; position 9 must see keys 0..6 only
    positions = positions.reshape(-1)
    q = torch.randn(12, 4, 16, generator=torch.Generator().manual_seed(15))
    args = (q, kc, vc, table, seq, positions, qsl)
    out = paged_attention(*args, scale=0.25, num_query=3, config=CONFIGS[config])
    ref = paged_attention_ref(*args, scale=0.25, num_query=3)
    assert torch.isfinite(out).all() and (out[6:9] == 0).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    seen = positions.clone()
    seen[5] = 6  # what position 9 of a 7-token request amounts to
    expected = _naive(
        q, kc, vc, table, seq, torch.where(torch.arange(12) // 3 == 2, -1, seen), qsl, scale=0.25
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_stacked_cache_reads_only_its_layer():
    """A stacked [L, ...] cache with layer=1 gives the single-layer result; NaN layers 0, 2 unread."""
    q, kc, vc, table, seq, positions, qsl = _case("boundaries", 3, torch.float32, seed=11)
    k_all = torch.full((3, *kc.shape), float("nan"))
    v_all = torch.full((3, *vc.shape), float("nan"))
    k_all[1], v_all[1] = kc, vc
    args = (table, seq, positions, qsl)
    for impl, kw in ((paged_attention, dict(config=CONFIGS["split_bn8"])), (paged_attention_ref, {})):
        single = impl(q, kc, vc, *args, scale=0.25, num_query=3, **kw)
        stacked = impl(q, k_all, v_all, *args, scale=0.25, num_query=3, layer=1, **kw)
        assert torch.isfinite(stacked).all() and torch.equal(single, stacked)


# ----------------------------------------------------------------------------------------------------------
# kv_write
# ----------------------------------------------------------------------------------------------------------


def _write_inputs(dtype, *, layers: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cache_shape = (layers, NUM_BLOCKS, BLOCK_SIZE, 3, 16)
    k_cache = (torch.randn(cache_shape, generator=gen) * 100).to(dtype)  # poison: random, not zeros
    v_cache = (torch.randn(cache_shape, generator=gen) * 100).to(dtype)
    slots = torch.tensor([37, -1, 5, 90, -1, 12, 64, 3], dtype=torch.int64)  # non-sequential, two padding
    fused = torch.randn(len(slots), 2 * 3 * 16 + 8, generator=gen).to(dtype)  # k, v as strided views of a
    k = fused[:, 8 : 8 + 48].view(-1, 3, 16)  # fused projection output: token stride 104, not 48
    v = fused[:, 56:].view(-1, 3, 16)
    return k, v, k_cache, v_cache, slots


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_write_writes_live_slots_and_leaves_every_other_byte(dtype):
    """Live tokens land at their slots of `layer`; slot -1 writes nothing; all else unchanged."""
    k, v, k_cache, v_cache, slots = _write_inputs(dtype, layers=3)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_write(k, v, k_cache, v_cache, slots, layer=1)
    kv_write_ref(k, v, ref_k, ref_v, slots, layer=1)
    assert torch.equal(_bits(k_cache), _bits(ref_k)) and torch.equal(_bits(v_cache), _bits(ref_v))
    live = slots >= 0
    flat_k, flat_v = k_cache[1].reshape(-1, 3, 16), v_cache[1].reshape(-1, 3, 16)
    assert torch.equal(_bits(flat_k[slots[live]]), _bits(k[live])), "live K rows must be copied exactly"
    assert torch.equal(_bits(flat_v[slots[live]]), _bits(v[live]))
    untouched = torch.ones(3, NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[1, slots[live]] = False
    for after, before in ((k_cache, before_k), (v_cache, before_v)):
        a, b = after.reshape(3, -1, 3, 16), before.reshape(3, -1, 3, 16)
        assert torch.equal(_bits(a[untouched]), _bits(b[untouched])), "a slot that was not written changed"


def test_kv_write_single_layer_cache_and_all_padding():
    """A 4-D cache works without `layer`; an all-padding step (-1 everywhere) leaves it bit-identical."""
    k, v, k_cache, v_cache, slots = _write_inputs(torch.float32, layers=1)
    kc, vc = k_cache[0].clone(), v_cache[0].clone()
    before = kc.clone()
    kv_write(k, v, kc, vc, torch.full_like(slots, -1))
    assert torch.equal(_bits(kc), _bits(before))
    kv_write(k, v, kc, vc, slots)
    assert torch.equal(kc.reshape(-1, 3, 16)[slots[slots >= 0]], k[slots >= 0])


# ----------------------------------------------------------------------------------------------------------
# Registered ops: schema, fake implementation, torch.compile
# ----------------------------------------------------------------------------------------------------------


def _op_inputs():
    q, kc, vc, table, seq, positions, qsl = _case("ragged", 3, torch.float32, seed=21)
    # stacked 2-layer cache, the step writes layer 1; K/V of the new tokens at their slots (padding: -1)
    k_all = torch.stack([torch.randn_like(kc), kc])
    v_all = torch.stack([torch.randn_like(vc), vc])
    request = torch.arange(4).repeat_interleave(3)
    pos = positions.clamp(min=0)
    slots = table[request, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    slots = torch.where(positions < 0, -1, slots)
    gen = torch.Generator().manual_seed(22)
    k_new = torch.randn(len(slots), 2, 16, generator=gen)
    v_new = torch.randn(len(slots), 2, 16, generator=gen)
    return q, k_new, v_new, k_all, v_all, slots, table, seq, positions, qsl


def test_ops_pass_opcheck():
    """Schemas (exact mutation of the caches), fake implementations and dispatch are consistent."""
    q, k_new, v_new, k_all, v_all, slots, table, seq, positions, qsl = _op_inputs()
    torch.library.opcheck(
        torch.ops.fspec.kv_write.default, (k_new, v_new, k_all.clone(), v_all.clone(), slots), {"layer": 1}
    )
    torch.library.opcheck(
        torch.ops.fspec.paged_attention.default,
        (q, k_all, v_all, table, seq, positions, qsl),
        {"scale": 0.25, "num_query": 3, "layer": 1},
    )


def _step(q, k_new, v_new, k_all, v_all, slots, table, seq, positions, qsl):
    torch.ops.fspec.kv_write(k_new, v_new, k_all, v_all, slots, layer=1)
    out = torch.ops.fspec.paged_attention(
        q, k_all, v_all, table, seq, positions, qsl, scale=0.25, num_query=3, layer=1
    )
    return out * 2.0  # something for inductor to fuse around the ops


def test_ops_compile_fullgraph_equal_eager_and_write_the_cache():
    """torch.compile(fullgraph=True) of write + attend on CPU equals eager, and its cache writes are kept."""
    inputs = _op_inputs()
    q, k_new, v_new, k_all, v_all, slots, table, seq, positions, qsl = inputs
    ke, ve = k_all.clone(), v_all.clone()
    eager = _step(q, k_new, v_new, ke, ve, slots, table, seq, positions, qsl)
    assert attention_ops.kernels_interpreted()
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    kc, vc = k_all.clone(), v_all.clone()
    out = compiled(q, k_new, v_new, kc, vc, slots, table, seq, positions, qsl)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(_bits(kc), _bits(ke)) and torch.equal(_bits(vc), _bits(ve)), (
        "the compiled kv_write must mutate the donated cache"
    )
    live = slots >= 0
    assert torch.equal(kc[1].reshape(-1, 2, 16)[slots[live]], k_new[live])
    assert torch.equal(_bits(kc[0]), _bits(k_all[0])), "layer 0 must be untouched"
    # the attention saw the freshly written K/V: it matches the naive loop over the written cache
    expected = _naive(q, kc[1], vc[1], table, seq, positions, qsl, scale=0.25) * 2.0
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Compiled (not interpreted) kernels: sm_90 code generation here, the H200 under @pytest.mark.gpu
# ----------------------------------------------------------------------------------------------------------


def _in_fresh_process(body: str) -> None:
    in_fresh_process(__file__, globals(), body)


def _ptx_for_h200(kernel, types: dict, consts: dict, **options) -> str:
    """PTX of `kernel` for sm_90 (triton's bundled ptxas; no GPU needed). Pointers and strides get the
    16-divisibility the launcher's specialisation sees at real shapes (aligned buffers, D = 128)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    hint = [["tt.divisibility", 16]]
    attrs = {
        (i,): hint
        for i, n in enumerate(names)
        if sig[n][0] == "*" or n.startswith("stride") or n == "partition"
    }
    src = ASTSource(kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _compile_kernels_for_h200() -> None:
    from fspec.kernels import kv_write as kw
    from fspec.kernels import paged_attention as pa

    ptrs = dict(block_table_ptr="*i32", seq_lens_ptr="*i32", positions_ptr="*i64", query_start_loc_ptr="*i32")
    ptrs |= dict(part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32", scale_log2="fp32")
    # (dtype, num_query, group, head_dim, split): decode and K+1 rows, split-K (with the reduce kernel) and
    # not, an unpadded head dim
    for dtype, nq, group, d, split in (
        ("bf16", 1, 4, 128, True), ("bf16", 4, 4, 128, False), ("fp16", 1, 4, 128, False),
        ("fp32", 4, 4, 128, True), ("bf16", 3, 1, 24, True),
    ):  # fmt: skip
        cfg = pa.default_config(batch=8, kv_heads=8, group=group, num_query=nq, head_dim=d, capacity=4096)
        types = dict(
            ptrs, q_ptr=f"*{dtype}", k_cache_ptr=f"*{dtype}", v_cache_ptr=f"*{dtype}", out_ptr=f"*{dtype}"
        )
        consts = dict(
            NUM_QUERY=nq, GROUP=group, KV_HEADS=8, HEAD_DIM=d, BLOCK_SIZE=16, SPLIT=split,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=triton_next_pow2(d), UPCAST=dtype == "fp32",
            EARLY_KV=False,
        )  # fmt: skip
        ptx = _ptx_for_h200(
            pa._paged_attention_kernel, types, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
        loads = set(re.findall(r"ld\.global[\w.]*", ptx))
        if dtype != "fp32" and d == 128:
            # K/V tiles move as 16-byte cp.async copies (pipelined), never 2-byte scalar loads
            assert "cp.async.cg.shared.global" in ptx and not any(x.endswith("16") for x in loads), loads
    # EARLY_KV under PDL (decode, and K + 1 rows): the first tile's old K/V rows are requested before the
    # wait; nothing is stored before it, and the wait comes once, ahead of the trigger
    for nq in (1, 4):
        cfg = pa.default_config(batch=1, kv_heads=8, group=4, num_query=nq, head_dim=64, capacity=2048)
        types = dict(ptrs, q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16")
        types |= dict(k_early_ptr="*bf16", v_early_ptr="*bf16")
        consts = dict(
            NUM_QUERY=nq, GROUP=4, KV_HEADS=8, HEAD_DIM=64, BLOCK_SIZE=16, SPLIT=True,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=64, UPCAST=False,
            NQ_POW2=nq, EARLY_KV=True, PDL=True,
        )  # fmt: skip
        ptx = _ptx_for_h200(
            pa._paged_attention_kernel, types, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
        assert ptx.count("griddepcontrol.wait") == 1, nq
        before, after = ptx.split("griddepcontrol.wait")
        assert "griddepcontrol.launch_dependents" in after, nq
        early = re.findall(r"ld\.global[\w.]*|cp\.async\.\w+\.shared\.global", before)
        assert len(early) >= 4, (nq, early)  # metadata, the block table, K and V
        assert not re.search(r"st\.global|atom\.|red\.", before), nq
    reduce_consts = dict(NUM_HEADS=32, HEAD_DIM=128, SPLITS_POW2=16, BLOCK_D=128, EARLY_RELEASE=False)
    reduce_types = dict(part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32", out_ptr="*bf16")
    _ptx_for_h200(pa._paged_attention_reduce_kernel, reduce_types, reduce_consts, num_warps=4)
    # EARLY_RELEASE under PDL: the next launch is released first, then the wait, then every load and store
    for release in (False, True):
        consts = dict(reduce_consts, EARLY_RELEASE=release, PDL=True)
        ptx = _ptx_for_h200(pa._paged_attention_reduce_kernel, reduce_types, consts, num_warps=4)
        wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        assert (trigger < wait) == release and ptx.count("griddepcontrol") == 2, release
        assert not re.search(r"ld\.global|st\.global", ptx[:wait]), release
    kv_types = dict(
        k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_mapping_ptr="*i64"
    )
    kv_consts = dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128)
    ptx = _ptx_for_h200(kw._kv_write_kernel, kv_types, kv_consts, num_warps=4)
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= set(re.findall(r"(?:ld|st)\.global[\w.]*", ptx))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_kernels_compile_for_h200_with_vectorised_cache_access():
    """The compiled (not interpreted) kernels build for sm_90 at default configs, with 16-byte K/V moves."""
    _in_fresh_process("_compile_kernels_for_h200")


# ----------------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes, CUDA graphs
# ----------------------------------------------------------------------------------------------------------


def _gpu_case(num_query: int, *, seed: int, batch=8, heads=32, kv_heads=8, head_dim=128, block_size=16):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = 4096 // block_size
    lens = torch.randint(1000, 4001, (batch,), generator=gen)  # room for the replay test's +37
    lens[-1] = 0  # one padding request
    num_blocks = batch * max_blocks + 7
    table = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).int()
    positions = lens[:, None] - num_query + torch.arange(num_query)[None, :]
    positions = torch.where((lens[:, None] > 0) & (positions >= 0), positions, -1).reshape(-1)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * num_query
    dev = dict(device="cuda")
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch * num_query, heads, head_dim, generator=gen).to(torch.bfloat16)
    cpu = (q, kc, vc, table, lens.int(), positions, qsl)
    return tuple(x.to(**dev) for x in cpu)


def _gpu_matches_reference() -> None:
    scale = 128**-0.5
    for num_query in (1, 4):
        q, kc, vc, table, seq, positions, qsl = _gpu_case(num_query, seed=num_query)
        args = (q, kc, vc, table, seq, positions, qsl)
        ref = paged_attention_ref(*args, scale=scale, num_query=num_query)
        assert (ref.float().abs().amax() > 0.05).item()  # not a vacuous comparison of near-zero outputs
        for cfg in (
            None,
            AttentionConfig(block_n=64, partition=4096),
            AttentionConfig(block_n=32, partition=512),
            AttentionConfig(block_n=64, partition=64),
        ):
            out = paged_attention(*args, scale=scale, num_query=num_query, config=cfg)
            torch.testing.assert_close(
                out.float(), ref.float(), rtol=2e-2, atol=1e-2, msg=lambda m, c=cfg: f"{c}: {m}"
            )
            assert (out[positions < 0] == 0).all()
        op = torch.ops.fspec.paged_attention(*args, scale=scale, num_query=num_query)
        torch.testing.assert_close(op.float(), ref.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
def test_paged_attention_gpu_matches_reference_at_llama_shapes():
    """B = 8, 32/8 heads, D = 128, bf16, contexts 1k-4k, block 16, num_query 1 and 4: Triton (default split-K,
    one split, 512-token splits) and the registered op equal the reference."""
    _in_fresh_process("_gpu_matches_reference")


def _gpu_cuda_graph_replay() -> None:
    q, kc, vc, table, seq, positions, qsl = _gpu_case(1, seed=3)
    block_size = kc.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(4)
    k_new = torch.randn(q.shape[0], kc.shape[2], kc.shape[3], device="cuda", generator=gen).bfloat16()
    v_new = torch.randn_like(k_new)

    def slots_of(pos):
        p = pos.clamp(min=0)
        s = table[torch.arange(len(pos), device="cuda"), p // block_size].long() * block_size + p % block_size
        return torch.where(pos < 0, -1, s)

    slots = slots_of(positions)

    def step():
        torch.ops.fspec.kv_write(k_new, v_new, kc, vc, slots)
        return torch.ops.fspec.paged_attention(
            q, kc, vc, table, seq, positions, qsl, scale=128**-0.5, num_query=1
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    results = []
    for delta in (0, 37, -500):
        live = seq > 0
        seq.copy_(torch.where(live, seq + delta, seq))
        positions.copy_(torch.where(live, seq.long() - 1, -1))
        slots.copy_(slots_of(positions))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(q, kc, vc, table, seq, positions, qsl, scale=128**-0.5, num_query=1)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2)
        live_slots = slots >= 0
        assert torch.equal(kc.view(-1, *kc.shape[2:])[slots[live_slots]], k_new[live_slots])
        results.append(out.clone())
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])


@pytest.mark.gpu
def test_ops_gpu_cuda_graph_replay_follows_metadata_tensors():
    """One captured kv_write + paged_attention replays with new seq_lens/positions/slots (changed in place
    between replays) and gives the new results: nothing about the metadata is frozen into the graph."""
    _in_fresh_process("_gpu_cuda_graph_replay")


def _gpu_kv_write() -> None:
    q, kc, vc, table, seq, positions, qsl = _gpu_case(4, seed=5)
    block_size = kc.shape[1]
    # new tokens at the last 4 positions of each request (a padding request: slots -1), crossing block
    # boundaries where a context length is not a multiple of the block size
    p = positions.clamp(min=0)
    rows = torch.arange(len(positions), device="cuda") // 4
    slots = table[rows, p // block_size].long() * block_size + p % block_size
    slots = torch.where(positions < 0, -1, slots)
    gen = torch.Generator(device="cuda").manual_seed(6)
    k_new = torch.randn(len(slots), kc.shape[2], kc.shape[3], device="cuda", generator=gen).bfloat16()
    v_new = torch.randn_like(k_new)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch.ops.fspec.kv_write(k_new, v_new, kc, vc, slots)
    kv_write_ref(k_new, v_new, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert (slots < 0).any() and (slots >= 0).sum() > 4


@pytest.mark.gpu
def test_kv_write_gpu_writes_exactly_the_reference_slots():
    """The compiled KV-write kernel on the H200 (bf16, 8 KV heads of 128, block 16, a padding request) leaves
    the cache bit-identical to the reference: live slots written, -1 skipped, nothing else touched. Outside
    a graph, so compute-sanitizer memcheck can run it with the caching allocator off."""
    _in_fresh_process("_gpu_kv_write")


def test_bad_launch_configs_are_value_errors_naming_the_field():
    """An explicit AttentionConfig is checked before any launch: power-of-two tiles (>= 16 on a GPU, any on
    the interpreter), positive partition and stages, 1..16 warps."""
    from fspec.kernels.paged_attention import check_config

    check_config(AttentionConfig(block_n=4, partition=8, block_m=4), cuda=False)  # the interpreter's tiles
    for field, bad in (
        ("block_n", 24), ("block_m", 12), ("partition", 0), ("num_warps", 3), ("num_stages", 0),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^config\.{field}: expected"):
            check_config(dataclasses.replace(AttentionConfig(), **{field: bad}), cuda=False)
    with pytest.raises(ValueError, match=r"^config\.block_n: expected a power of two >= 16, got 8"):
        check_config(AttentionConfig(block_n=8), cuda=True)
    with pytest.raises(ValueError, match=r"^config: expected an AttentionConfig"):
        check_config({"block_n": 16}, cuda=False)
    # and the launcher checks before it launches
    q, cache = torch.randn(1, 4, 16), torch.randn(4, 16, 2, 16)
    meta = (
        torch.arange(4, dtype=torch.int32)[None],
        torch.tensor([20], dtype=torch.int32),
        torch.tensor([19]),
    )
    with pytest.raises(ValueError, match=r"^config\.block_m: expected a power of two >= 1, got 12"):
        paged_attention(
            q, cache, cache, *meta, torch.tensor([0, 1], dtype=torch.int32), scale=0.25, num_query=1,
            config=AttentionConfig(block_m=12),
        )  # fmt: skip


def test_every_cache_launcher_refuses_a_non_contiguous_layer_naming_its_strides():
    """The kernels address a slot as slot * Nkv * D: each launcher that takes the caches (the write, the two
    RoPE writes, the q/k/v epilogue, the attention) refuses a strided layer with a ValueError naming the
    strides and shapes, before it reads any other argument."""
    from fspec.kernels import paged_attention as pa
    from fspec.kernels import qkv_rope_write as qrw
    from fspec.kernels import rope_kv_write as rkv

    good = torch.zeros(2, 4, 2, 8)
    bad = torch.zeros(2, 4, 8, 2).transpose(2, 3)  # [2, 4, 2, 8], D-stride 2
    x = torch.zeros(1)
    calls = {
        "kv_write": lambda kc, vc: kv_write(x, x, kc, vc, x),
        "rope_kv_write": lambda kc, vc: rkv.rope_kv_write(x, x, x, x, x, kc, vc, x),
        "rope_pos_kv_write": lambda kc, vc: rkv.rope_pos_kv_write(x, x, x, x, x, torch.float32, kc, vc, x),
        "qkv_rope_write": lambda kc, vc: qrw.qkv_rope_write(
            x, x, positions=x, inv_freq=x, table_dtype=torch.float32, k_cache=kc, v_cache=vc, slot_mapping=x
        ),
        "paged_attention": lambda kc, vc: pa.paged_attention(x, kc, vc, x, x, x, x, scale=1.0, num_query=1),
    }
    want = r"^k_cache/v_cache: expected contiguous layers \[num_blocks, block_size, Nkv, D\], got strides "
    for call in calls.values():
        for kc, vc, strides in ((bad, good, r"\(64, 16, 1, 2\) and \(64, 16, 8, 1\)"),
                                (good, bad, r"\(64, 16, 8, 1\) and \(64, 16, 1, 2\)")):  # fmt: skip
            with pytest.raises(ValueError, match=want + strides + r" for shapes \(2, 4, 2, 8\)"):
                call(kc, vc)


# ----------------------------------------------------------------------------------------------------------
# Bounds for long prompts and long contexts (tile caps lowered so the interpreter runs the loops)
# ----------------------------------------------------------------------------------------------------------


# slow at 16 (one split per chunk, five chunks): 32 runs the same chunk loop, two splits at a time, the last
# chunk partial
@pytest.mark.parametrize("tile", [pytest.param(16, marks=pytest.mark.slow), 32])
def test_reduce_kernel_combines_many_splits_a_chunk_at_a_time(monkeypatch, tile):
    """REDUCE_TILE lowered: 5 splits (partition 4 of the 20-token capacity) are combined 1 or 2 at a time by
    the reduce kernel, the running max rescaled per chunk: equal to the per-token loop, as with one load."""
    from fspec.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "REDUCE_TILE", tile)
    cfg = AttentionConfig(block_n=4, partition=4)
    for lens in LENS:
        for num_query in (1, 3):
            q, kc, vc, table, seq, positions, qsl = _case(lens, num_query, torch.float32, seed=3)
            plan = pa.launch_plan(
                tokens=q.shape[0], batch=4, heads=4, kv_heads=2, head_dim=16, num_query=num_query,
                max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE, config=cfg,
            )  # fmt: skip
            assert plan.splits == 5 and plan.reduce_chunk == tile // 16 and plan.reduce_grid is not None
            out = paged_attention(q, kc, vc, table, seq, positions, qsl, scale=0.3, num_query=num_query,
                                  config=cfg)  # fmt: skip
            want = _naive(q, kc, vc, table, seq, positions, qsl, scale=0.3)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
            assert (out[positions < 0] == 0).all()


def test_early_kv_is_dropped_above_its_query_cap_with_the_same_result(monkeypatch):
    """Above MAX_EARLY_KV_QUERY rows per request (a prefill) the launch takes no early loads: its
    [next_pow2(Q)] scan of positions would grow with the prompt. Early caches of NaN are then never read,
    and the output is bit-identical to the plain launch; at or below the cap the early loads stay."""
    from fspec.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "MAX_EARLY_KV_QUERY", 2)
    cfg = CONFIGS["split_bn4"]
    sizes = dict(tokens=12, batch=4, heads=4, kv_heads=2, head_dim=16, max_blocks=MAX_BLOCKS,
                 block_size=BLOCK_SIZE, config=cfg, early_kv=True)  # fmt: skip
    assert pa.launch_plan(**sizes, num_query=2).early_kv and pa.launch_plan(**sizes, num_query=2).nq_pow2 == 2
    plan = pa.launch_plan(**sizes, num_query=3)
    assert not plan.early_kv and plan.nq_pow2 == 1
    q, kc, vc, table, seq, positions, qsl = _case("ragged", 3, torch.float32, seed=4)
    args = (q, kc, vc, table, seq, positions, qsl)
    plain = paged_attention(*args, scale=0.3, num_query=3, config=cfg)
    poison = (torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan")))
    early = paged_attention(*args, scale=0.3, num_query=3, config=cfg, early_kv=True, _early_cache=poison)
    assert torch.equal(early, plain)


def test_launch_plan_keeps_splits_on_grid_axis_2_within_cuda_limits():
    """A partition override far below capacity / 65535 is raised so the splits (grid axis 2) stay within
    CUDA's 65535."""
    from fspec.kernels import paged_attention as pa

    big = dict(tokens=1, batch=1, heads=9, kv_heads=3, head_dim=64, num_query=1, block_size=16)
    plan = pa.launch_plan(**big, max_blocks=1 << 20, config=AttentionConfig(partition=64))
    assert plan.splits <= pa.MAX_GRID_YZ and plan.grid[1] <= pa.MAX_GRID_YZ
    assert plan.config.partition % plan.config.block_n == 0
