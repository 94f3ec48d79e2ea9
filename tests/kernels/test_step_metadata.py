"""One-launch step metadata (kernels/step_metadata.py): the interpreted kernel against its PyTorch reference
on irregular shapes, and the reference against the metadata algebra written out by hand.

Inputs cover padding rows (-1), positions on unallocated (-1) table entries and past the table, positions
crossing block boundaries, requests past one program's 128 (B = 130, 257), an empty batch, ragged first-step
token counts, and seq_lens at and past max_model_len. Long prompts: query rows cut into tiles (the caps
lowered so the interpreter runs many tiles; and at the real caps, 129 and 1025 rows) equal the reference too.
"""

import pytest
import torch

from fspec.kernels import ops
from fspec.kernels import step_metadata as sm
from fspec.kernels.step_metadata import (
    MODE_ADVANCE,
    MODE_AFTER,
    MODE_DECODE,
    MODE_FIRST,
    step_metadata,
    step_metadata_ref,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

BLOCK_SIZE, MAX_BLOCKS, MAX_LEN = 4, 5, 18  # the table holds 20 positions; max_model_len cuts at 18


def _inputs(b: int, q: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 4 * b + 8, (b, MAX_BLOCKS), generator=g, dtype=torch.int32)
    table[torch.rand(b, MAX_BLOCKS, generator=g) < 0.2] = -1  # unallocated blocks
    start = torch.randint(-1, 26, (b,), generator=g)  # -1 padding, up to past the table (>= 20)
    count = torch.randint(0, q + 1, (b,), generator=g)
    return start, count, table


@pytest.mark.parametrize("b", [0, 1, 3, 37, 130, 257])
@pytest.mark.parametrize(
    "mode,q", [(MODE_DECODE, 1), (MODE_AFTER, 1), (MODE_FIRST, 1), (MODE_FIRST, 6), (MODE_ADVANCE, 1)]
)
def test_kernel_equals_reference(b, mode, q):
    assert ops.kernels_interpreted() or torch.cuda.is_available()
    start, count, table = _inputs(b, q, seed=b * 10 + mode + q)
    if mode == MODE_ADVANCE:  # count holds seq_lens: at and past max_model_len too
        count = torch.randint(0, MAX_LEN + 3, (b,), generator=torch.Generator().manual_seed(b))
    args = (start, count if mode in (MODE_FIRST, MODE_ADVANCE) else None, table)
    kw = dict(num_query=q, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, mode=mode)
    got = step_metadata(*args, **kw)
    want = step_metadata_ref(*args, **kw)
    for name, g, w in zip(("positions", "query_start_loc", "seq_lens", "slot_mapping"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize("b", [0, 1, 3, 37, 130, 257])
@pytest.mark.parametrize("steps", [2, 5, 7])
def test_rollout_kernel_equals_chained_reference(b, steps):
    """A MODE_AFTER rollout (one program per step and request tile, closed form min(seq_lens + s,
    max_model_len - 1)) equals the reference, which chains single steps by definition; seq_lens run up to
    and past max_model_len and the table's end, so clamping and slot -1 are crossed inside the rollout."""
    assert ops.kernels_interpreted() or torch.cuda.is_available()
    start, _, table = _inputs(b, 1, seed=100 + b + steps)
    start[: min(b, 3)] = torch.tensor([MAX_LEN - 2, MAX_LEN, 0])[: min(b, 3)]
    kw = dict(num_query=1, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, mode=MODE_AFTER, steps=steps)
    got = step_metadata(start.to(torch.int32), None, table, **kw)
    want = step_metadata_ref(start.to(torch.int32), None, table, **kw)
    for name, g, w in zip(("positions", "query_start_loc", "seq_lens", "slot_mapping"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name
    one = dict(kw, steps=1)
    x = start.to(torch.int32)
    for s in range(steps):  # step s of the rollout is one MODE_AFTER step from step s - 1's seq_lens
        pos, qsl, lens, slots = step_metadata_ref(x, None, table, **one)
        assert torch.equal(got[0][s * b : (s + 1) * b], pos) and torch.equal(got[1], qsl)
        assert torch.equal(got[2][s * b : (s + 1) * b], lens)
        assert torch.equal(got[3][s * b : (s + 1) * b], slots)
        x = lens


@pytest.mark.parametrize(
    "steps,mode", [(0, MODE_AFTER), (True, MODE_AFTER), (2.0, MODE_AFTER), (2, MODE_DECODE)]
)
def test_rollout_steps_are_checked(steps, mode):
    start, _, table = _inputs(3, 1, seed=0)
    kw = dict(num_query=1, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, mode=mode, steps=steps)
    for fn in (step_metadata, step_metadata_ref):
        with pytest.raises(ValueError, match="steps"):
            fn(start, None, table, **kw)


def _slot(table: torch.Tensor, b: int, pos: int) -> int:
    if pos < 0 or pos // BLOCK_SIZE >= table.shape[1] or table[b, pos // BLOCK_SIZE] < 0:
        return -1
    return int(table[b, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE


def test_reference_equals_the_algebra_written_out():
    """Per request and row, in plain Python: what each mode means (fspec/core/metadata.py's builders)."""
    b, q = 37, 6
    start, count, table = _inputs(b, q, seed=5)
    start[:4] = torch.tensor([17, 18, 25, 0])  # at, past max_model_len - 1 (AFTER clamps), past the table
    seq_lens = torch.randint(0, MAX_LEN + 3, (b,), generator=torch.Generator().manual_seed(7))
    seq_lens[:2] = torch.tensor([MAX_LEN - 1, MAX_LEN])  # one below and at max_model_len
    for mode in (MODE_DECODE, MODE_AFTER, MODE_FIRST, MODE_ADVANCE):
        qq = q if mode == MODE_FIRST else 1
        second = {MODE_FIRST: count, MODE_ADVANCE: seq_lens}.get(mode)
        pos, qsl, lens, slots = step_metadata_ref(
            start, second, table, num_query=qq, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, mode=mode
        )
        assert qsl.tolist() == [i * qq for i in range(b + 1)]
        for r in range(b):
            s = int(start[r])
            if mode == MODE_DECODE:
                want_pos, want_len = [s], (s + 1 if s >= 0 else 0)
            elif mode == MODE_AFTER:  # s is the previous seq_len
                p = min(s, MAX_LEN - 1) if s > 0 else -1
                want_pos, want_len = [p], (p + 1 if s > 0 else 0)
            elif mode == MODE_ADVANCE:  # s is the position, seq_lens[r] its seq_len
                n = int(seq_lens[r])
                want_pos = [min(s + 1, MAX_LEN - 1) if s >= 0 else s]
                want_len = min(n + 1, MAX_LEN) if s >= 0 else n
            else:
                n = int(count[r])
                want_pos = [s + j if s >= 0 and j < n else -1 for j in range(q)]
                want_len = s + n if s >= 0 else 0
            assert pos[r * qq : (r + 1) * qq].tolist() == want_pos, (mode, r)
            assert int(lens[r]) == want_len, (mode, r)
            assert slots[r * qq : (r + 1) * qq].tolist() == [_slot(table, r, p) for p in want_pos], (mode, r)


def _assert_kernel_equals_reference(start, count, table, **kw):
    got = step_metadata(start, count, table, **kw)
    want = step_metadata_ref(start, count, table, **kw)
    for name, g, w in zip(("positions", "query_start_loc", "seq_lens", "slot_mapping"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), (name, kw)


def _long_inputs(b: int, q: int, seed: int):
    """Prompts of up to q tokens (some exactly q, some empty, a padding request) over a table that holds
    them, with unallocated blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-q // BLOCK_SIZE) + 1
    table = torch.randint(0, 8 * b * blocks + 8, (b, blocks), generator=g, dtype=torch.int32)
    table[torch.rand(b, blocks, generator=g) < 0.1] = -1
    count = torch.randint(0, q + 1, (b,), generator=g)
    count[: min(b, 2)] = q
    start = torch.zeros(b, dtype=torch.int64)
    if b > 2:
        start[b // 2] = -1  # a padding request
    return start, count, table


@pytest.mark.parametrize("b", [0, 1, 5, 9])
@pytest.mark.parametrize("q", [1, 3, 4, 5, 13])
def test_query_rows_in_tiles_equal_the_reference(monkeypatch, b, q):
    """With the caps lowered to 16-element tiles of at most 4 rows, a first step of up to 13 rows per request
    runs as several query tiles of fewer requests per program (4 x 4, or 16 x 1 at Q = 1): positions,
    slots, seq_lens and query_start_loc equal the reference (each request's per-request fields written by
    its first query tile only)."""
    monkeypatch.setattr(sm, "MAX_TILE", 16)
    monkeypatch.setattr(sm, "MAX_BLOCK_Q", 4)
    cfg = sm.launch_config(b, q)
    assert cfg.block_q == min(4, 1 << (q - 1).bit_length()) and cfg.block_b * cfg.block_q <= 16
    assert cfg.q_tiles == -(-q // cfg.block_q) and cfg.grid == (cfg.b_tiles * cfg.q_tiles,)
    start, count, table = _long_inputs(b, q, seed=b * 31 + q)
    kw = dict(num_query=q, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, mode=MODE_FIRST)
    _assert_kernel_equals_reference(start, count, table, **kw)
    if q == 1:  # the one-row modes too, at 16 requests per program
        for mode in (MODE_DECODE, MODE_AFTER, MODE_ADVANCE):
            second = count if mode == MODE_ADVANCE else None
            kw = dict(num_query=1, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, mode=mode)
            _assert_kernel_equals_reference(start + 3, second, table, **kw)


def test_rollout_with_lowered_caps_equals_the_chained_reference(monkeypatch):
    """steps > 1 with 4-request tiles: step s of request tile t is program s * b_tiles + t."""
    monkeypatch.setattr(sm, "MAX_TILE", 4)
    start, _, table = _inputs(11, 1, seed=3)
    kw = dict(num_query=1, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, mode=MODE_AFTER, steps=3)
    assert sm.launch_config(11, 1, 3).grid == (3 * 3,)
    _assert_kernel_equals_reference(start.to(torch.int32), None, table, **kw)


@pytest.mark.parametrize("b, q", [(3, 129), (2, 1025)])
def test_long_prompts_at_the_real_caps_equal_the_reference(b, q):
    """Just past the old crash (129 rows: a 128 x 256 int64 tile, 262144 bytes of shared memory on the
    H200) and past one query tile (1025 rows: two tiles of 1024): equal to the reference."""
    cfg = sm.launch_config(b, q)
    assert cfg.block_b * cfg.block_q <= sm.MAX_TILE and cfg.q_tiles == -(-q // sm.MAX_BLOCK_Q)
    start, count, table = _long_inputs(b, q, seed=q)
    kw = dict(num_query=q, block_size=16, max_model_len=1 << 20, mode=MODE_FIRST)
    _assert_kernel_equals_reference(start, count, table, **kw)


def test_launch_config_bounds_the_tile_for_any_prompt_and_batch():
    """Every (B, Q) up to 256 x 8192 (SmolLM2's max_position_embeddings) and beyond: the tile holds at most
    MAX_TILE elements, at most MAX_BLOCK_Q rows, covers all B + 1 requests and Q rows, and the grid is
    one axis within CUDA's 2^31 - 1; decode keeps its 128-request tiles."""
    for b in (0, 1, 7, 128, 255, 256, 4096):
        for q in (1, 2, 6, 17, 127, 128, 129, 1000, 4096, 8191, 8192, 65536):
            for steps in (1, 5) if q == 1 else (1,):
                cfg = sm.launch_config(b, q, steps)
                assert cfg.block_b * cfg.block_q <= sm.MAX_TILE and cfg.block_q <= sm.MAX_BLOCK_Q, (b, q)
                assert cfg.block_b * cfg.b_tiles >= b + 1 and cfg.block_q * cfg.q_tiles >= q, (b, q)
                assert len(cfg.grid) == 1 and cfg.grid[0] == steps * cfg.b_tiles * cfg.q_tiles <= sm.MAX_GRID
    assert sm.launch_config(256, 1).block_b == sm.BLOCK_B == 128
    assert sm.launch_config(256, 6) == sm.LaunchConfig(
        block_b=128, block_q=8, b_tiles=3, q_tiles=1, grid=(3,)
    )
