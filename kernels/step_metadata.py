"""A step's attention metadata in one launch: positions, query_start_loc, seq_lens and slot_mapping.

    step_metadata(start [B], count [B] | None, block_table [B, max_blocks], *, num_query, block_size,
                  max_model_len, mode, steps=1)
        -> (positions [S * B * Q] int64, query_start_loc [B + 1] int32, seq_lens [S * B] int32,
            slot_mapping [S * B * Q] int64)                                     S = steps

Three modes, each the exact arithmetic of the PyTorch reference beside the kernel (`step_metadata_ref`, which
is what `fspec.core.metadata` computed before this kernel existed):

* MODE_DECODE (Q = 1): `start` holds each request's position (-1 = padding): positions = start, seq_lens =
  start + 1 where start >= 0, else 0.
* MODE_AFTER (Q = 1): `start` holds the previous step's seq_lens; the next token sits at seq_lens (clamped to
  max_model_len - 1) where seq_lens > 0, else the row is padding (-1, seq_len 0). With `steps` = S > 1, the
  metadata of S such steps in a row (each from the one before: step s's position is min(seq_lens + s,
  max_model_len - 1)), stacked: step s's fields are rows [s * B, (s + 1) * B) (query_start_loc is the same
  for every step). A draft rollout's K decode steps then cost one launch instead of K.
* MODE_FIRST: request b's `count[b]` tokens sit at start[b] + j, j < count[b]; its other rows of Q are
  padding; a request with start < 0 is a padding row (seq_len 0).
* MODE_ADVANCE (Q = 1): `start` holds decode positions, `count` their seq_lens; live rows (position >= 0)
  move one position on (clamped to max_model_len - 1) and one token longer (clamped to max_model_len);
  padding rows keep both.

query_start_loc = arange(B + 1) * Q. Slot of a token at position p of request b: block_table[b, p // bs] * bs
+ p % bs, or -1 where p < 0, p // bs is past the table, or the table's entry is negative (unallocated).

Why: each of these fields is an input of the attention ops of every layer, so it must be one materialised
buffer (Inductor recomputed cheap expressions in front of every consumer, fspec/core/metadata.py).
Materialised through copies, the four fields cost four small Inductor kernels and four device copies per step:
eight launches of ~1 µs plus a ~0.4 µs gap each in a CUDA graph (benchmarks/kernel_timeline.py, draft step of
a 1B-shaped EAGLE-3 head on the H200). One kernel writes all four.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .pdl import pdl_enter

MODE_DECODE, MODE_AFTER, MODE_FIRST, MODE_ADVANCE = 0, 1, 2, 3
BLOCK_B = 128  # requests per program, at most (fewer where a request's query rows fill the tile)
# Elements of one program's [BLOCK_B, BLOCK_Q] tile, at most, and query rows per program, at most. The tile
# holds int64 positions, slots and block-table entries; the launch used to make it BLOCK_B x next_pow2(Q),
# so a 129-token prefill asked for 128 x 256 x 8 bytes = 262144 bytes of shared memory on the H200 (limit
# 232448) and a prompt of 8192 tokens for 8 MB. A decode step (Q = 1) and a first draft step (Q = K + 1 <= 8)
# keep their 128-request tiles; a prefill's rows are cut into BLOCK_Q-row tiles of as many requests as fit.
MAX_TILE = 1024
MAX_BLOCK_Q = 1024
MAX_GRID = 2**31 - 1  # CUDA's limit on grid axis 0 (axes 1 and 2: 65535); the launch uses axis 0 only


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The launch of `_step_metadata_kernel` for B requests of Q query rows, `steps` steps.

    Attributes:
        block_b: requests per program (a power of two, block_b * block_q <= MAX_TILE).
        block_q: query rows per program (a power of two, at most MAX_BLOCK_Q).
        b_tiles: programs along the requests, cdiv(B + 1, block_b) (query_start_loc has B + 1 entries).
        q_tiles: programs along each request's query rows, cdiv(Q, block_q).
        grid: (steps * b_tiles * q_tiles,): program p is step p // (b_tiles * q_tiles), request tile
            (p // q_tiles) % b_tiles and query tile p % q_tiles, all on axis 0 (no axis-1/2 limit).
    """

    block_b: int
    block_q: int
    b_tiles: int
    q_tiles: int
    grid: tuple[int]


def launch_config(
    b: int, q: int, steps: int = 1, *, max_tile: int | None = None, max_block_q: int | None = None
) -> LaunchConfig:
    """Tiles and grid for B requests of Q rows (the caps default to MAX_TILE and MAX_BLOCK_Q, read at call
    time, so a test can lower them to run the looping path under the interpreter)."""
    max_tile = MAX_TILE if max_tile is None else max_tile
    max_block_q = MAX_BLOCK_Q if max_block_q is None else max_block_q
    block_q = min(triton.next_power_of_2(max(q, 1)), max_block_q, max_tile)
    block_b = max(1, min(BLOCK_B, max_tile // block_q))
    b_tiles, q_tiles = triton.cdiv(b + 1, block_b), triton.cdiv(max(q, 1), block_q)
    programs = steps * b_tiles * q_tiles
    if programs > MAX_GRID:
        raise ValueError(
            f"start/num_query/steps: expected at most {MAX_GRID} programs, got {programs} for B = {b}, "
            f"Q = {q}, steps = {steps}"
        )
    return LaunchConfig(block_b=block_b, block_q=block_q, b_tiles=b_tiles, q_tiles=q_tiles, grid=(programs,))


@triton.jit
def _step_metadata_kernel(
    start_ptr,  # [B] int: positions (DECODE, ADVANCE), previous seq_lens (AFTER) or first positions (FIRST)
    count_ptr,  # [B] int: live tokens per request (FIRST), seq_lens (ADVANCE); unread otherwise
    block_table_ptr,  # [B, max_blocks] int: cache block of each request's j-th block (-1 = unallocated)
    positions_ptr,  # [S * B * Q] int64 out
    query_start_loc_ptr,  # [B + 1] int32 out
    seq_lens_ptr,  # [S * B] int32 out
    slot_mapping_ptr,  # [S * B * Q] int64 out
    B,  # requests
    max_blocks,  # columns of the block table
    stride_table,  # elements between rows of the block table
    block_size,  # tokens per cache block
    max_model_len,  # AFTER, ADVANCE: positions clamp at max_model_len - 1
    b_tiles,  # programs along the requests (`LaunchConfig.b_tiles`)
    Q: tl.constexpr,  # query rows per request (1 but for FIRST)
    Q_TILES: tl.constexpr,  # programs along a request's query rows, cdiv(Q, BLOCK_Q)
    MODE: tl.constexpr,  # MODE_DECODE, MODE_AFTER, MODE_FIRST or MODE_ADVANCE
    BLOCK: tl.constexpr,  # requests per program
    BLOCK_Q: tl.constexpr,  # query rows per program, a power of two (BLOCK * BLOCK_Q <= MAX_TILE)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    s = pid // (b_tiles * Q_TILES)  # step of a MODE_AFTER rollout (0 otherwise)
    tile = pid % (b_tiles * Q_TILES)
    qt = tile % Q_TILES  # this program's query rows: qt * BLOCK_Q + [0, BLOCK_Q)
    b = (tile // Q_TILES) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    b_ok = b < B
    x = tl.load(start_ptr + b, mask=b_ok, other=-1).to(tl.int64)
    j = qt * BLOCK_Q + tl.arange(0, BLOCK_Q).to(tl.int64)  # [BLOCK_Q]
    j_ok = j < Q
    if MODE == 1:  # AFTER: x is the previous seq_lens
        row_live = x > 0
        first = tl.where(row_live, tl.minimum(x + s, max_model_len - 1), -1)
        seq = tl.where(row_live, first + 1, 0)
        pos = first[:, None] + j[None, :]  # Q = 1: j = 0
    elif MODE == 0:  # DECODE: x is the position, kept as given
        seq = tl.where(x >= 0, x + 1, 0)
        pos = x[:, None] + j[None, :]
    elif MODE == 3:  # ADVANCE: x is the position, count the seq_len
        lens = tl.load(count_ptr + b, mask=b_ok, other=0).to(tl.int64)
        row_live = x >= 0
        seq = tl.where(row_live, tl.minimum(lens + 1, max_model_len), lens)
        pos = tl.where(row_live, tl.minimum(x + 1, max_model_len - 1), x)[:, None] + j[None, :]
    else:  # FIRST
        count = tl.load(count_ptr + b, mask=b_ok, other=0).to(tl.int64)
        row_live = x >= 0
        seq = tl.where(row_live, x + count, 0)
        live = row_live[:, None] & (j[None, :] < count[:, None])
        pos = tl.where(live, x[:, None] + j[None, :], -1)
    ok = b_ok[:, None] & j_ok[None, :]  # [BLOCK, BLOCK_Q]
    p = tl.maximum(pos, 0)
    col = p // block_size
    beyond = col >= max_blocks
    entry = block_table_ptr + b[:, None] * stride_table + tl.minimum(col, max_blocks - 1)
    blk = tl.load(entry, mask=ok & (max_blocks > 0), other=-1).to(tl.int64)
    slot = tl.where((pos < 0) | beyond | (blk < 0), -1, blk * block_size + p % block_size)
    row = s * B * Q + b[:, None] * Q + j[None, :]
    tl.store(positions_ptr + row, pos, mask=ok)
    tl.store(slot_mapping_ptr + row, slot, mask=ok)
    # per-request fields: written by the request's first query tile only
    tl.store(seq_lens_ptr + s * B + b, seq.to(tl.int32), mask=b_ok & (qt == 0))
    tl.store(query_start_loc_ptr + b, (b * Q).to(tl.int32), mask=(b <= B) & (s == 0) & (qt == 0))


def _outputs(b: int, q: int, device: torch.device, steps: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (
        torch.empty(steps * b * q, dtype=torch.int64, device=device),
        torch.empty(b + 1, dtype=torch.int32, device=device),
        torch.empty(steps * b, dtype=torch.int32, device=device),
        torch.empty(steps * b * q, dtype=torch.int64, device=device),
    )


def check_steps(steps: int, mode: int) -> None:
    """`steps` is an int >= 1, and above 1 only in MODE_AFTER (a ValueError naming it otherwise)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    if steps > 1 and mode != MODE_AFTER:
        raise ValueError(f"steps: expected 1 outside MODE_AFTER ({MODE_AFTER}), got {steps} with mode {mode}")


def step_metadata(
    start: Tensor,
    count: Tensor | None,
    block_table: Tensor,
    *,
    num_query: int,
    block_size: int,
    max_model_len: int,
    mode: int,
    steps: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the kernel: (positions, query_start_loc, seq_lens, slot_mapping). Inputs are assumed
    validated (fspec.core.metadata checks them eagerly); `count` is read only in MODE_FIRST and
    MODE_ADVANCE."""
    check_steps(steps, mode)
    b = start.shape[0]
    q = num_query if mode == MODE_FIRST else 1
    outs = _outputs(b, q, start.device, steps)
    start = start.contiguous()
    count = start if count is None else count.contiguous()
    cfg = launch_config(b, q, steps)
    _step_metadata_kernel[cfg.grid](
        start, count, block_table, *outs, b, block_table.shape[1], block_table.stride(0), block_size,
        max_model_len, cfg.b_tiles, Q=q, Q_TILES=cfg.q_tiles, MODE=mode, BLOCK=cfg.block_b,
        BLOCK_Q=cfg.block_q, **pdl.options(start),
    )  # fmt: skip
    return outs


def step_metadata_ref(
    start: Tensor,
    count: Tensor | None,
    block_table: Tensor,
    *,
    num_query: int,
    block_size: int,
    max_model_len: int,
    mode: int,
    steps: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Plain-PyTorch twin of `step_metadata`; a rollout (steps > 1) chains single MODE_AFTER steps, each
    started from the previous step's seq_lens, by definition."""
    check_steps(steps, mode)
    if steps > 1:
        out, x = [], start
        for _ in range(steps):
            out.append(step_metadata_ref(x, None, block_table, num_query=1, block_size=block_size,
                                         max_model_len=max_model_len, mode=MODE_AFTER))  # fmt: skip
            x = out[-1][2]
        pos, qsl, lens, slots = zip(*out)
        return torch.cat(pos), qsl[0], torch.cat(lens), torch.cat(slots)
    x = start.to(torch.int64)
    b = x.shape[0]
    q = num_query if mode == MODE_FIRST else 1
    j = torch.arange(q, device=x.device)
    if mode == MODE_AFTER:
        live = x > 0
        pos = torch.where(live, x.clamp(max=max_model_len - 1), -1)
        seq = torch.where(live, pos + 1, 0)
        positions = pos[:, None]
    elif mode == MODE_DECODE:
        seq = torch.where(x >= 0, x + 1, 0)
        positions = x[:, None].clone()  # an op's output never aliases its input
    elif mode == MODE_ADVANCE:
        lens = count.to(torch.int64)
        live = x >= 0
        seq = torch.where(live, (lens + 1).clamp(max=max_model_len), lens)
        positions = torch.where(live, (x + 1).clamp(max=max_model_len - 1), x)[:, None]
    else:
        n = count.to(torch.int64)
        row_live = x >= 0
        seq = torch.where(row_live, x + n, 0)
        live = row_live[:, None] & (j[None, :] < n[:, None])
        positions = torch.where(live, x[:, None] + j[None, :], -1)  # [B, Q]
    request = torch.arange(b, device=x.device)[:, None].expand(b, q)
    slot = slot_mapping_ref(block_table, positions, block_size, request)
    qsl = (torch.arange(b + 1, device=x.device) * q).to(torch.int32)
    return positions.reshape(-1), qsl, seq.to(torch.int32), slot.reshape(-1)


def slot_mapping_ref(block_table: Tensor, positions: Tensor, block_size: int, request: Tensor) -> Tensor:
    """Branch-free int64 slots of `positions` (any shape) of requests `request` (same shape): -1 where the
    position is < 0, lies past the table, or its block entry is < 0 (unallocated). fspec.core.metadata's
    algebra and checks use it too (as `_slot_mapping`)."""
    pos = positions.clamp(min=0)
    col = pos // block_size
    beyond = col >= block_table.shape[1]
    if block_table.shape[1] == 0:
        return torch.full_like(positions, -1, dtype=torch.int64)
    # Clamping keeps the gather in bounds for padding and out-of-table tokens; their slot becomes -1 below.
    block = block_table[request.long(), col.clamp(max=block_table.shape[1] - 1)].long()
    slot = block * block_size + pos % block_size
    # An unallocated block (-1) or a position past the table never yields a slot: writing there would
    # corrupt another request's K/V.
    return torch.where((positions < 0) | beyond | (block < 0), torch.full_like(slot, -1), slot)
