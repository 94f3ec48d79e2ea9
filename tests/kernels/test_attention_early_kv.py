"""The paged attention's early K/V loads (`early_kv`): each program requests its first key tile's old rows
before its PDL wait and the rows of the forward's own tokens after it; and its early release
(`early_release`): the reduce lets the next launch start before its wait. The layers ask for both.

Under the interpreter nothing runs concurrently, so the tests hand the early loads a different copy of the
cache (`_early_cache`): NaN where the new rows are in the early copy and where the old rows of each split's
first tile are in the late one. An output without NaN that matches the float64 loop then shows that every
row came from the load the design assigns it. On the H200 (@pytest.mark.gpu) the kernel ahead really runs
while the early loads go out: a CUDA graph of the q/k/v product with the cache write in its epilogue (and
of the multi-row cache write) followed by the attention, the new slots NaN before each replay.
"""

from __future__ import annotations

import pytest
import torch
from fresh_process import in_fresh_process
from test_paged_attention import BLOCK_SIZE, CONFIGS, LENS, _case, _naive

from fspec.kernels import attention_ops  # noqa: F401  (registers torch.ops.fspec)
from fspec.kernels import paged_attention as pa
from fspec.models import llama

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _split_caches(kc, vc, table, seq, positions, num_query, cfg):
    """(early, late) copies of the caches: the early one NaN at the rows of each request's query positions
    and after, the late one NaN at the old rows inside each split's first tile (the rows the kernel must
    take from the early load)."""
    early = [kc.clone(), vc.clone()]
    late = [kc.clone(), vc.clone()]
    flat = lambda c: c.view(-1, *c.shape[2:])  # noqa: E731
    for b in range(len(seq)):
        p = positions[b * num_query : (b + 1) * num_query]
        live = p[p >= 0]
        first_new = int(live.min()) if len(live) else 1 << 30
        for j in range(int(seq[b])):
            slot = int(table[b, j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE
            if j >= first_new:
                for c in early:
                    flat(c)[slot] = float("nan")
            elif j % cfg.partition < cfg.block_n:
                for c in late:
                    flat(c)[slot] = float("nan")
    return early, late


@pytest.mark.parametrize("lens", sorted(LENS))
@pytest.mark.parametrize("num_query", [1, 3])
@pytest.mark.parametrize("config", ["one_split", "split_bn4", "split_bn8"])
def test_old_rows_come_from_the_early_load_and_new_rows_from_the_late_one(lens, num_query, config):
    q, kc, vc, table, seq, positions, qsl = _case(lens, num_query, torch.float32)
    cfg = CONFIGS[config]
    (ke, ve), (kl, vl) = _split_caches(kc, vc, table, seq, positions, num_query, cfg)
    assert torch.isnan(ke).any() and torch.isnan(kl).any()  # both copies really are poisoned
    got = pa.paged_attention(
        q, kl, vl, table, seq, positions, qsl, scale=0.3, num_query=num_query, config=cfg,
        early_kv=True, _early_cache=(ke, ve),
    )  # fmt: skip
    want = _naive(q, kc, vc, table, seq, positions, qsl, scale=0.3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # on one cache the early path computes exactly what the plain one does
    args = (q, kc, vc, table, seq, positions, qsl)
    plain = pa.paged_attention(*args, scale=0.3, num_query=num_query, config=cfg)
    assert torch.equal(
        pa.paged_attention(*args, scale=0.3, num_query=num_query, config=cfg, early_kv=True), plain
    )


def _record_flags(monkeypatch) -> list:
    """Replace the launcher with one that records each call's (early_kv, early_release) and launches; the
    original stays reachable as `pa.paged_attention.__wrapped__`."""
    seen = []
    launch = pa.paged_attention

    def recording(*a, **k):
        seen.append((k["early_kv"], k["early_release"]))
        return launch(*a, **k)

    recording.__wrapped__ = launch
    monkeypatch.setattr(pa, "paged_attention", recording)
    return seen


def test_op_passes_both_flags_through_and_passes_opcheck(monkeypatch):
    q, kc, vc, table, seq, positions, qsl = _case("ragged", 3, torch.float32)
    args = (q, kc, vc, table, seq, positions, qsl)
    seen = _record_flags(monkeypatch)
    launch = pa.paged_attention.__wrapped__
    want = launch(*args, scale=0.3, num_query=3)
    flags = [(False, False), (True, False), (False, True), (True, True)]
    for early, release in flags:
        got = torch.ops.fspec.paged_attention(
            *args, scale=0.3, num_query=3, early_kv=early, early_release=release
        )
        assert torch.equal(got, want)
    assert seen == flags
    kwargs = {"scale": 0.3, "num_query": 3, "early_kv": True, "early_release": True}
    torch.library.opcheck(torch.ops.fspec.paged_attention.default, args, kwargs)
    # the reduce kernel with EARLY_RELEASE (interpreted: launches run in program order) computes the same
    split = launch(*args, scale=0.3, num_query=3, config=CONFIGS["split_bn4"])
    assert torch.equal(
        launch(*args, scale=0.3, num_query=3, config=CONFIGS["split_bn4"], early_release=True), split
    )


def _tiny():
    import fspec

    return fspec.ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=500.0, rope_type="llama3", rope_factor=8.0,
        rope_original_max_position_embeddings=64,
    )  # fmt: skip


@pytest.mark.parametrize("qkv_rope", [False, True])
def test_layers_ask_for_early_loads_and_release(qkv_rope, monkeypatch):
    """A paged prefill then a decode step of a tiny Llama (the decode's one row through `qkv_rope_write`, as
    on CUDA where one-row products go to skinny_linear, or through the separate cache write, as on the
    CPU): every attention launch gets early_kv and early_release (the launch before it writes only q and
    the new rows; the o projection after it reads only its weight before its wait)."""
    import fspec
    from fspec.core.cache import KVCache
    from fspec.core.metadata import _slot_mapping
    from fspec.kernels import qkv_rope_write as qrw
    from fspec.models import layers as L

    cfg = _tiny()
    params = L.fuse_projections(llama.init(cfg, seed=3))
    tables = torch.tensor([[2, 0, 3]], dtype=torch.int32)

    def meta(pos):
        n = len(pos)
        return fspec.AttnMetadata(
            positions=pos, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([int(pos[-1]) + 1], dtype=torch.int32), block_table=tables,
            slot_mapping=_slot_mapping(tables, pos, 4, torch.zeros(n, dtype=torch.int64)),
        )  # fmt: skip

    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    if qkv_rope:
        monkeypatch.setattr(L, "use_skinny_linear", lambda x, w, **kw: x.shape[:-1].numel() == 1)
    epilogues = []
    write = qrw.qkv_rope_write
    monkeypatch.setattr(qrw, "qkv_rope_write", lambda *a, **k: epilogues.append(1) or write(*a, **k))
    seen = _record_flags(monkeypatch)
    cache = KVCache.create(cfg, num_blocks=5, block_size=4)
    _, _, cache = llama.forward(params, ids, meta(torch.arange(6)), cache, cfg=cfg, backend="paged",
                                max_query_len=6)  # fmt: skip
    llama.forward(params, torch.tensor([7]), meta(torch.tensor([6])), cache, cfg=cfg, backend="paged",
                  max_query_len=1)  # fmt: skip
    assert seen == [(True, True)] * (2 * cfg.num_hidden_layers), seen
    assert len(epilogues) == (cfg.num_hidden_layers if qkv_rope else 0)  # the decode step's layers


@pytest.mark.gpu
def test_gpu_new_rows_are_read_after_the_kernel_that_writes_them():
    in_fresh_process(__file__, globals(), "_gpu_body")


def _gpu_body():
    """On the H200 with PDL, bf16, 1B-layer shapes (32 / 8 heads of 64, K = 2048, context ~2k, 64-token
    splits): a CUDA graph of `qkv_rope_write` then `paged_attention(early_kv=True)` (decode), and of
    `rope_pos_kv_write` then the attention over four new rows per request (a first draft step or a
    verification, B = 3), each followed by an o projection (`skinny_linear`) that the reduce releases before
    its wait (`early_release`), replayed with new positions whose slots hold NaN before each replay: the
    output equals the reference attention over the written cache (a new row taken from the early load would
    be NaN or stale), the projection equals one of that output run afterwards, and so do eager calls."""
    from fspec.kernels import pdl
    from fspec.kernels.rope_cos_sin import inv_freq as make_inv_freq

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    assert pdl.enabled(torch.empty(1, device=dev)), "the test is about PDL's early start"
    n, nkv, d, k, bs, max_blocks = 32, 8, 64, 2048, 16, 160
    gen = torch.Generator(device=dev).manual_seed(0)
    inv = make_inv_freq(d, "llama3", (500000.0, 32.0, 1.0, 4.0, 8192.0), dev)
    for nq, batch in ((1, 1), (4, 3)):
        _gpu_case(nq, batch, n=n, nkv=nkv, d=d, k=k, bs=bs, max_blocks=max_blocks, gen=gen, inv=inv)


def _gpu_case(nq, batch, *, n, nkv, d, k, bs, max_blocks, gen, inv):
    """One case of `_gpu_body`: nq rows per request, `batch` requests."""
    from fspec.kernels.qkv_rope_write import qkv_rope_write
    from fspec.kernels.rope_kv_write import rope_pos_kv_write
    from fspec.kernels.skinny_linear import skinny_linear

    dev = torch.device("cuda")
    num_blocks = batch * max_blocks + 3
    kc = torch.randn(num_blocks, bs, nkv, d, device=dev, generator=gen, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(num_blocks, device=dev, generator=gen)[: batch * max_blocks]
    table = table.view(batch, max_blocks).int()
    x = torch.randn(batch * nq, k, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn((n + 2 * nkv) * d, k, device=dev, generator=gen, dtype=torch.bfloat16) * k**-0.5
    qkv = x @ w.T  # the multi-row case's projection (the graph replays the cache write + attention)
    w_o = torch.randn(n * d, n * d, device=dev, generator=gen, dtype=torch.bfloat16) * (n * d) ** -0.5
    positions = torch.zeros(batch * nq, dtype=torch.int64, device=dev)
    seq = torch.zeros(batch, dtype=torch.int32, device=dev)
    slots = torch.zeros_like(positions)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * nq

    def set_context(lens):
        pos = torch.tensor([[c - nq + i for i in range(nq)] for c in lens], device=dev).reshape(-1)
        positions.copy_(pos)
        seq.copy_(torch.tensor(lens, dtype=torch.int32, device=dev))
        blk = table.long()[torch.arange(batch, device=dev).repeat_interleave(nq), pos // bs]
        slots.copy_(blk * bs + pos % bs)
        kc.view(-1, nkv, d)[slots] = float("nan")  # stale until the kernel ahead writes them
        vc.view(-1, nkv, d)[slots] = float("nan")

    def step():
        if nq == 1:
            y = qkv_rope_write(x, w, positions=positions, inv_freq=inv, table_dtype=torch.bfloat16,
                               k_cache=kc, v_cache=vc, slot_mapping=slots)  # fmt: skip
            q = y[:, : n * d].view(1, n, d)
        else:
            q, kk, v = (t.reshape(batch * nq, -1, d) for t in qkv.split([n * d, nkv * d, nkv * d], -1))
            q = rope_pos_kv_write(q, kk, v, positions, inv, torch.bfloat16, kc, vc, slots)
        out = torch.ops.fspec.paged_attention(q, kc, vc, table, seq, positions, qsl, scale=d**-0.5,
                                              num_query=nq, early_kv=True, early_release=True)  # fmt: skip
        return q, out, skinny_linear(out.reshape(batch * nq, -1), w_o)  # o starts before the reduce waits

    contexts = ([2047], [1999]) if nq == 1 else ([2040, 1500, 77], [1700, 2047, 64])
    set_context(contexts[0])
    step()  # warm-up: compile
    set_context(contexts[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q, static_out, static_o = step()
    for lens in contexts + contexts[:1]:
        set_context(lens)
        graph.replay()
        torch.cuda.synchronize()
        want = pa.paged_attention_ref(static_q, kc, vc, table, seq, positions, qsl, scale=d**-0.5,
                                      num_query=nq)  # fmt: skip
        assert not torch.isnan(static_out).any(), (nq, lens)
        torch.testing.assert_close(static_out, want, rtol=2e-2, atol=2e-2)
        # the o projection released early read this replay's attention output, not the last one's
        assert torch.equal(static_o, skinny_linear(static_out.reshape(batch * nq, -1), w_o)), (nq, lens)
        set_context(lens)
        eager_q, eager_out, eager_o = step()
        torch.cuda.synchronize()
        assert not torch.isnan(eager_out).any(), (nq, lens)
        torch.testing.assert_close(eager_out, static_out, rtol=0, atol=0)
        assert torch.equal(eager_o, static_o), (nq, lens)
