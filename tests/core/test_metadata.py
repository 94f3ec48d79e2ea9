"""Metadata algebra: slot mappings, builders and advance, against naive references and as properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspec
from fspec.core.metadata import token_requests
from fspec.core.state import AttnMetadata


def _naive_slot(block_table: list[list[int]], b: int, pos: int, block_size: int) -> int:
    if pos < 0 or pos // block_size >= len(block_table[b]):
        return -1
    block = block_table[b][pos // block_size]
    return -1 if block < 0 else block * block_size + pos % block_size


def _disjoint_tables(draw, b: int, max_blocks: int) -> torch.Tensor:
    perm = draw(st.permutations(list(range(b * max_blocks))))
    return torch.tensor(perm, dtype=torch.int32).view(b, max_blocks)


@st.composite
def decode_batches(draw):
    """A decode batch: disjoint block tables, live positions inside the table, some padding rows."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    b = draw(st.integers(1, 6))
    max_blocks = draw(st.integers(1, 5))
    table = _disjoint_tables(draw, b, max_blocks)
    cap = max_blocks * block_size
    positions = draw(st.lists(st.integers(-1, cap - 1), min_size=b, max_size=b))
    return table, torch.tensor(positions, dtype=torch.int64), block_size


def test_slot_mapping_matches_naive_for_1d_and_2d_positions():
    """Vectorised slots equal the per-token formula on an irregular table, -1 for padding."""
    table = torch.tensor([[7, 2, 9], [0, 4, -1], [5, 1, 3]], dtype=torch.int32)
    pos2d = torch.tensor([[0, 4, 11, -1], [1, 5, 7, -1], [-1, -1, 8, 3]])
    got = fspec.slot_mapping(table, pos2d, 4)
    want = [[_naive_slot(table.tolist(), b, p, 4) for p in row] for b, row in enumerate(pos2d.tolist())]
    assert got.dtype == torch.int64 and got.tolist() == want
    assert fspec.slot_mapping(table, pos2d[:, 1], 4).tolist() == [want[0][1], want[1][1], want[2][1]]


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        (torch.tensor([12, 0, 0]), "positions: expected values < 12"),
        (torch.tensor([0, -2, 0]), "positions: expected values >= -1"),
        (torch.tensor([0, 9, 0]), "block_table: expected allocated"),
        (torch.tensor([0, 0]), "positions: expected 3 rows"),
        (torch.tensor([0.0, 1.0, 2.0]), "positions: expected an integer"),
    ],
)
def test_slot_mapping_rejects_positions_outside_the_table(positions, match):
    """Positions past the table, below -1, in unallocated blocks, or of the wrong shape raise ValueError."""
    table = torch.tensor([[7, 2, 9], [0, 4, -1], [5, 1, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        fspec.slot_mapping(table, positions, 4)


def test_slot_mapping_rejects_bad_block_size_and_table():
    """block_size must be a positive int; block_table an integer matrix."""
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        fspec.slot_mapping(table, torch.tensor([0, 0]), 0)
    with pytest.raises(ValueError, match="block_table"):
        fspec.slot_mapping(table.float(), torch.tensor([0, 0]), 4)


@settings(max_examples=150, deadline=None)
@given(decode_batches(), st.integers(0, 3))
def test_two_advances_equal_metadata_built_fresh_at_positions_plus_two(batch, extra):
    """advance(advance(m)) == decode_metadata(positions + 2), clamped at max_model_len - 1."""
    table, positions, block_size = batch
    max_model_len = table.shape[1] * block_size + extra
    positions = positions.clamp(max=max_model_len - 1)
    meta = fspec.decode_metadata(positions, table, block_size=block_size)
    twice = fspec.advance(
        fspec.advance(meta, block_size=block_size, max_model_len=max_model_len),
        block_size=block_size,
        max_model_len=max_model_len,
    )
    fresh_pos = torch.where(positions >= 0, (positions + 2).clamp(max=max_model_len - 1), positions)
    fresh = fspec.decode_metadata(fresh_pos, table, block_size=block_size)
    for got, want in zip(fspec.tree.tree_leaves(twice), fspec.tree.tree_leaves(fresh)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    tl = table.tolist()
    naive = [_naive_slot(tl, b, p, block_size) for b, p in enumerate(fresh_pos.tolist())]
    assert twice.slot_mapping.tolist() == naive, "a position past the block table must not get a slot"


@settings(max_examples=150, deadline=None)
@given(decode_batches())
def test_disjoint_block_tables_never_share_a_slot_and_padding_never_gets_one(batch):
    """Live tokens of requests with disjoint tables land on distinct slots; padding maps to -1, always."""
    table, positions, block_size = batch
    cap = table.shape[1] * block_size
    meta = fspec.decode_metadata(positions, table, block_size=block_size)
    for _ in range(3):
        live = meta.positions >= 0
        slots = meta.slot_mapping
        assert bool((slots[~live] == -1).all()), "a padding token got a slot"
        assert bool((slots[live] >= 0).all()) and bool((slots[live] < table.numel() * block_size).all())
        assert slots[live].unique().numel() == int(live.sum()), "two live tokens share a slot"
        meta = fspec.advance(meta, block_size=block_size, max_model_len=cap)


@settings(max_examples=100, deadline=None)
@given(decode_batches(), st.integers(1, 5))
def test_first_step_metadata_matches_naive_and_hands_over_to_decode(batch, num_query):
    """The first step's Q rows per request are start..start+n-1 then padding; decode_after continues."""
    table, starts, block_size = batch
    cap = table.shape[1] * block_size
    gen = torch.Generator().manual_seed(int(starts.sum()) + num_query)
    counts = torch.randint(0, num_query + 1, starts.shape, generator=gen)
    counts = torch.minimum(counts, (cap - starts).clamp(min=0))  # stay inside the table
    meta = fspec.first_step_metadata(starts, counts, table, num_query=num_query, block_size=block_size)
    tl = table.tolist()
    want_pos = [
        (s + j if s >= 0 and j < n else -1)
        for s, n in zip(starts.tolist(), counts.tolist())
        for j in range(num_query)
    ]
    assert meta.positions.tolist() == want_pos
    reqs = token_requests(meta.query_start_loc, meta.num_tokens).tolist()
    assert reqs == [b for b in range(len(tl)) for _ in range(num_query)]
    assert meta.slot_mapping.tolist() == [_naive_slot(tl, r, p, block_size) for r, p in zip(reqs, want_pos)]
    want_lens = [s + n if s >= 0 else 0 for s, n in zip(starts.tolist(), counts.tolist())]
    assert meta.seq_lens.tolist() == want_lens
    nxt = fspec.decode_after(meta, block_size=block_size, max_model_len=cap)
    want_next = [min(n, cap - 1) if n > 0 else -1 for n in want_lens]
    assert nxt.positions.tolist() == want_next
    assert nxt.slot_mapping.tolist() == [_naive_slot(tl, b, p, block_size) for b, p in enumerate(want_next)]


def test_advance_clamps_at_max_model_len_and_keeps_padding():
    """Positions stop at max_model_len - 1 and seq_lens at max_model_len; padding rows stay -1 / 0."""
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    meta = fspec.decode_metadata(torch.tensor([10, -1]), table, block_size=4)
    for _ in range(4):
        meta = fspec.advance(meta, block_size=4, max_model_len=12)
    assert meta.positions.tolist() == [11, -1]
    assert meta.seq_lens.tolist() == [12, 0]
    assert meta.slot_mapping.tolist() == [2 * 4 + 3, -1]


def test_unallocated_blocks_never_yield_a_slot():
    """A position whose block entry is -1 maps to -1 inside the branch-free path (advance)."""
    table = torch.tensor([[3, -1]], dtype=torch.int32)
    meta = fspec.decode_metadata(torch.tensor([3]), table, block_size=4)
    assert meta.slot_mapping.tolist() == [15]
    assert fspec.advance(meta, block_size=4, max_model_len=8).slot_mapping.tolist() == [-1]


def test_metadata_builders_keep_dtypes_and_shapes():
    """Every builder emits the dtypes the state's docstrings give (core/state.py)
    and advance preserves every leaf's shape and dtype."""
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    meta = fspec.decode_metadata(torch.tensor([3, 5]), table, block_size=4)
    assert [x.dtype for x in fspec.tree.tree_leaves(meta)] == [
        torch.int64,
        torch.int32,
        torch.int32,
        torch.int32,
        torch.int64,
    ]
    nxt = fspec.advance(meta, block_size=4, max_model_len=16)
    for a, b in zip(fspec.tree.tree_leaves(meta), fspec.tree.tree_leaves(nxt)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


@pytest.mark.parametrize("steps", [1, 4])
def test_decode_rollout_is_decode_after_applied_again_and_again(steps):
    """Entry s of `decode_rollout` is `decode_after` applied s + 1 times (after a multi-token step, with
    padding requests, a position reaching max_model_len and one past the block table), in one op."""
    table = torch.tensor([[3, 1, -1, 7], [0, 2, 4, 5], [-1, -1, -1, -1]], dtype=torch.int32)
    meta = fspec.first_step_metadata(
        torch.tensor([4, 11, -1]), torch.tensor([3, 2, 0]), table, num_query=3, block_size=4
    )
    rollout = fspec.decode_rollout(meta, steps, block_size=4, max_model_len=14)
    assert len(rollout) == steps
    want = meta
    for got in rollout:
        want = fspec.decode_after(want, block_size=4, max_model_len=14)
        for name in AttnMetadata.__fspec_children__:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
    with pytest.raises(ValueError, match="steps"):
        fspec.decode_rollout(meta, 0, block_size=4, max_model_len=14)


def test_metadata_fields_are_materialised_once_through_an_opaque_op():
    """The derived fields of decode / first-step / decode-after / advanced metadata come from one
    `fspec::step_metadata` op (one kernel on the GPU), so a compiled step computes them once however many
    layers read them (Inductor recomputed them in front of each layer's attention op otherwise), and the op
    keeps values, vmap and the eager path intact."""
    from fspec.core.metadata import _decode_metadata, _first_step_metadata

    calls = []

    def count_ops(gm, example_inputs):
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        calls.append(sum(t in ("fspec.step_metadata", "fspec.step_metadata.default") for t in targets))
        return gm.forward

    def read16(meta):  # sixteen "layers" read the fields
        return sum(meta.seq_lens.sum() + (meta.positions + meta.slot_mapping).sum() for _ in range(16))

    def step(pos, table):
        return read16(_decode_metadata(pos, table, block_size=4))

    def first_then_after(start, n, table):
        meta = _first_step_metadata(start, n, table, num_query=3, block_size=4)
        return read16(meta) + read16(fspec.decode_after(meta, block_size=4, max_model_len=16))

    def advanced(pos, table):
        return read16(
            fspec.advance(_decode_metadata(pos, table, block_size=4), block_size=4, max_model_len=16)
        )

    pos = torch.tensor([5, -1, 9])
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    n = torch.tensor([2, 0, 3])
    for fn, args, want in (
        (step, (pos, table), 1),
        (first_then_after, (pos, n, table), 2),
        (advanced, (pos, table), 2),
    ):
        calls.clear()
        torch._dynamo.reset()
        got = torch.compile(fn, backend=count_ops, fullgraph=True)(*args)
        assert calls == [want], fn.__name__  # step_metadata ops in the graph
        assert got == fn(*args)
    metas = [fspec.decode_metadata(p, table, block_size=4) for p in (pos, pos + 1)]
    stacked = fspec.tree.tree_map(lambda *xs: torch.stack(xs), *metas)
    for build in (
        lambda m: fspec.advance(m, block_size=4, max_model_len=16),
        lambda m: fspec.decode_after(m, block_size=4, max_model_len=16),
        lambda m: _decode_metadata(m.positions, m.block_table, block_size=4),
    ):
        batched = torch.func.vmap(build)(stacked)
        for i, meta in enumerate(metas):
            want = build(meta)
            for a, b in zip(fspec.tree.tree_leaves(want), fspec.tree.tree_leaves(batched)):
                assert torch.equal(b[i], a)
