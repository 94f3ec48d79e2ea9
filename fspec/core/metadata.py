"""Pure metadata algebra: slot mappings and the attention metadata of every draft step.

The metadata of step i+1 is a function of the metadata of step i, computed on the device with fixed shapes and
no host sync, so it runs inside a captured CUDA graph. (vLLM's Model Runner V2 built draft metadata once and
read stale slots from the second MTP step on; its fix, PR #41162, rebuilds it on the host before each step.)

Slot of a token at position `pos` of request `b`: ``block_table[b, pos // block_size] * block_size +
pos % block_size``; -1 (do not write) where `pos < 0`.

The public `slot_mapping` validates its inputs; the underscore functions are branch-free and trust them.
"""

from __future__ import annotations

import torch

from fspec.core.state import AttnMetadata, check_positive_int
from fspec.kernels import ops as kops
from fspec.kernels.step_metadata import MODE_ADVANCE, MODE_AFTER, MODE_DECODE, MODE_FIRST
from fspec.kernels.step_metadata import slot_mapping_ref as _slot_mapping  # the one slot algebra


def _from_kernel(
    start: torch.Tensor,
    count: torch.Tensor | None,
    block_table: torch.Tensor,
    *,
    num_query: int,
    block_size: int,
    max_model_len: int,
    mode: int,
) -> AttnMetadata:
    """`AttnMetadata` whose derived fields come from one `fspec::step_metadata` launch; the block table is
    passed through.

    Why an op: every layer hands the step's metadata to the custom attention ops, and Inductor, which sees
    the fields as cheap pointwise expressions of the step's inputs, recomputed them in front of each op
    (three ~1 µs kernels per layer of a 1B decode step on an H200, read off its generated code). Materialised
    through opaque copies they cost four small kernels and four copies per step; one kernel writes all four
    (kernels/step_metadata.py)."""
    positions, query_start_loc, seq_lens, slots = kops.step_metadata(
        start, count, block_table, num_query, block_size, max_model_len, mode
    )
    return AttnMetadata(
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slots,
    )


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] int64: the request each query token belongs to (rows query_start_loc[b]:query_start_loc[b+1])."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=torch.int64)
    return torch.searchsorted(query_start_loc[1:].to(torch.int64), tokens, right=True)


def _check_table_positions(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int, *, in_table: bool = True
) -> None:
    """ValueError unless `positions` ([B] or [B, T]) fit `block_table`: types, rows, device, >= -1 (padding),
    and with `in_table` also inside the table on allocated blocks."""
    check_positive_int("block_size", block_size)
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or not _is_int(block_table):
        raise ValueError(
            f"block_table: expected an integer [B, max_blocks] tensor, got {_describe(block_table)}"
        )
    if not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2) or not _is_int(positions):
        raise ValueError(f"positions: expected an integer [B] or [B, T] tensor, got {_describe(positions)}")
    if positions.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"positions: expected {block_table.shape[0]} rows (block_table's B), got {positions.shape[0]}"
        )
    if positions.device != block_table.device:
        raise ValueError(f"positions: expected device {block_table.device}, got {positions.device}")
    if bool((positions < -1).any()):
        raise ValueError(f"positions: expected values >= -1 (-1 = padding), got min {int(positions.min())}")
    if not in_table:
        return
    capacity = block_table.shape[1] * block_size
    if bool((positions >= capacity).any()):
        raise ValueError(
            f"positions: expected values < {capacity} (block_table holds {block_table.shape[1]} blocks of "
            f"{block_size}), got max {int(positions.max())}"
        )
    b = positions.shape[0]
    request = torch.arange(b, device=positions.device).view(b, *([1] * (positions.dim() - 1)))
    live = positions >= 0
    blocks = block_table[request.expand_as(positions)[live], positions[live] // block_size]
    if bool((blocks < 0).any()):
        raise ValueError(
            "block_table: expected allocated (>= 0) blocks at every live position, got -1 entries"
        )


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` ([B] or [B, T]) through `block_table` [B, max_blocks]; int64, same shape.

    -1 where the position is < 0 (padding). A position beyond the table, or one whose block entry is
    negative (not allocated), raises ValueError. B = 0 gives an empty result.
    """
    _check_table_positions(block_table, positions, block_size)
    b = positions.shape[0]
    request = torch.arange(b, device=positions.device).view(b, *([1] * (positions.dim() - 1)))
    return _slot_mapping(block_table, positions.long(), block_size, request.expand_as(positions))


def _is_int(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__}"


def decode_metadata(positions: torch.Tensor, block_table: torch.Tensor, *, block_size: int) -> AttnMetadata:
    """Metadata of a decode step: one query token per request at `positions` [B] (-1 = padding row).

    Validates eagerly (ValueError naming the argument): integer positions >= -1, an integer [B, max_blocks]
    table on the same device, a positive block_size. Like `advance`, it is total in the position: a position
    past the table or on an unallocated (-1) block gets slot -1 (never another request's slot), and
    `validate_attn_metadata` (run by `draft_step`, `propose`, `attention`, `head_forward`) rejects such
    metadata through its seq_lens and block checks. B = 0 gives empty metadata.
    """
    if not torch.compiler.is_compiling():
        if isinstance(positions, torch.Tensor) and positions.dim() != 1:
            raise ValueError(f"positions: expected a [B] tensor, got {_describe(positions)}")
        _check_table_positions(block_table, positions, block_size, in_table=False)
    return _decode_metadata(positions, block_table, block_size=block_size)


def _decode_metadata(positions: torch.Tensor, block_table: torch.Tensor, *, block_size: int) -> AttnMetadata:
    """`decode_metadata` without validation (branch-free; inside compiled rounds)."""
    table = block_table.to(torch.int32).contiguous()
    return _from_kernel(
        positions, None, table, num_query=1, block_size=block_size, max_model_len=1, mode=MODE_DECODE
    )


def first_step_metadata(
    start_positions: torch.Tensor,
    num_tokens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_query: int,
    block_size: int,
) -> AttnMetadata:
    """Metadata of the first draft step: up to `num_query` tokens per request (T = B * num_query).

    Request b's tokens sit at positions start_positions[b] + j for j < num_tokens[b]; the rest of its
    `num_query` rows are padding (-1). A request with start_positions[b] < 0 is a padding row. Typical use:
    the K+1 tokens the target just verified, of which num_accepted + 1 are live.

    Validates eagerly (ValueError naming the argument): num_query and block_size positive ints, integer
    [B] start_positions >= -1 and num_tokens with num_tokens[b] in [0, num_query] for live rows, a table of
    B rows on their device. Positions past the table get slot -1, as in `decode_metadata`.
    """
    if not torch.compiler.is_compiling():
        _check_first_step(
            start_positions, num_tokens, block_table, num_query=num_query, block_size=block_size
        )
    return _first_step_metadata(
        start_positions, num_tokens, block_table, num_query=num_query, block_size=block_size
    )


def _check_first_step(start_positions, num_tokens, block_table, *, num_query: int, block_size: int) -> None:
    check_positive_int("num_query", num_query)
    check_positive_int("block_size", block_size)
    for name, x in (("start_positions", start_positions), ("num_tokens", num_tokens)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or not _is_int(x):
            raise ValueError(f"{name}: expected an integer [B] tensor, got {_describe(x)}")
    if num_tokens.shape != start_positions.shape or num_tokens.device != start_positions.device:
        raise ValueError(
            f"num_tokens: expected shape {tuple(start_positions.shape)} on {start_positions.device} "
            f"(start_positions'), got {tuple(num_tokens.shape)} on {num_tokens.device}"
        )
    if isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
        if block_table.shape[0] != start_positions.shape[0] or block_table.device != start_positions.device:
            raise ValueError(
                f"block_table: expected {start_positions.shape[0]} rows on {start_positions.device} "
                f"(start_positions'), got {tuple(block_table.shape)} on {block_table.device}"
            )
    if bool((start_positions < -1).any()):
        raise ValueError(
            f"start_positions: expected values >= -1 (-1 = padding row), got min {int(start_positions.min())}"
        )
    live_rows = start_positions >= 0
    bad = live_rows & ((num_tokens < 0) | (num_tokens > num_query))
    if bool(bad.any()):
        raise ValueError(
            f"num_tokens: expected values in [0, num_query={num_query}] for live rows, "
            f"got {num_tokens[bad][:4].tolist()}"
        )
    j = torch.arange(num_query, device=start_positions.device)
    live = live_rows[:, None] & (j[None, :] < num_tokens.long()[:, None])
    positions = torch.where(live, start_positions.long()[:, None] + j[None, :], -1)  # [B, Q]
    _check_table_positions(block_table, positions, block_size, in_table=False)


def _first_step_metadata(
    start_positions: torch.Tensor,
    num_tokens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_query: int,
    block_size: int,
) -> AttnMetadata:
    """`first_step_metadata` without validation (branch-free; inside compiled rounds)."""
    table = block_table.to(torch.int32).contiguous()
    return _from_kernel(
        start_positions, num_tokens, table, num_query=num_query, block_size=block_size, max_model_len=1,
        mode=MODE_FIRST,
    )  # fmt: skip


def advance(meta: AttnMetadata, *, block_size: int, max_model_len: int) -> AttnMetadata:
    """The metadata of the next decode step (one token per request, T = B).

    positions + 1 and seq_lens + 1, clamped to max_model_len - 1 and max_model_len; padding rows (-1) stay
    padding; the slot mapping is recomputed from the block table. Branch-free: runs inside a CUDA graph.
    A position past the block table gets slot -1 (never another request's slot); eager calls check the
    arguments' types and that `meta` has one token per request (no value checks: no host sync).
    """
    if not torch.compiler.is_compiling():
        _check_algebra_args(meta, block_size, max_model_len, decode=True)
    nxt = _from_kernel(
        meta.positions, meta.seq_lens, meta.block_table, num_query=1, block_size=block_size,
        max_model_len=max_model_len, mode=MODE_ADVANCE,
    )  # fmt: skip
    return AttnMetadata(  # query_start_loc is passed through, as the block table is
        positions=nxt.positions.to(meta.positions.dtype),
        query_start_loc=meta.query_start_loc,
        seq_lens=nxt.seq_lens.to(meta.seq_lens.dtype),
        block_table=meta.block_table,
        slot_mapping=nxt.slot_mapping,
    )


def decode_after(meta: AttnMetadata, *, block_size: int, max_model_len: int) -> AttnMetadata:
    """Decode metadata for the token that follows each request's last cached token (any T, result T = B).

    After a multi-token step (the first draft step, target verification) the next token of request b sits at
    position seq_lens[b]; requests with seq_lens 0 are padding. Positions clamp at max_model_len - 1.
    Eager calls check the arguments' types and shapes (no value checks: no host sync).
    """
    if not torch.compiler.is_compiling():
        _check_algebra_args(meta, block_size, max_model_len, decode=False)
    return _from_kernel(
        meta.seq_lens, None, meta.block_table, num_query=1, block_size=block_size,
        max_model_len=max_model_len, mode=MODE_AFTER,
    )  # fmt: skip


def decode_rollout(
    meta: AttnMetadata, steps: int, *, block_size: int, max_model_len: int
) -> list[AttnMetadata]:
    """`steps` decode steps' metadata in a row, from one launch: entry s is `decode_after` applied s + 1 times
    to `meta` (entry 0 is `decode_after(meta)`). A draft rollout knows all K of its steps' metadata before it
    samples anything (positions do not depend on tokens), so `propose` takes them from here instead of one
    `decode_after` launch per step. The entries are views into one set of buffers (query_start_loc and the
    block table shared). Eager calls check what `decode_after` checks and that steps is an int in
    [1, max_model_len].
    """
    if not torch.compiler.is_compiling():
        _check_algebra_args(meta, block_size, max_model_len, decode=False)
        check_positive_int("steps", steps)
        if steps > max_model_len:  # past it every step is a padding step: 2^62 steps would never return
            raise ValueError(f"steps: expected at most max_model_len={max_model_len}, got {steps}")
    b = meta.seq_lens.shape[0]
    args = (meta.seq_lens, None, meta.block_table, 1, block_size, max_model_len, MODE_AFTER, steps)
    positions, query_start_loc, seq_lens, slots = kops.step_metadata(*args)
    return [
        AttnMetadata(
            positions=positions[s * b : (s + 1) * b],
            query_start_loc=query_start_loc,
            seq_lens=seq_lens[s * b : (s + 1) * b],
            block_table=meta.block_table,
            slot_mapping=slots[s * b : (s + 1) * b],
        )
        for s in range(steps)
    ]


def _check_algebra_args(meta: AttnMetadata, block_size: int, max_model_len: int, *, decode: bool) -> None:
    """Static checks of `advance` / `decode_after` arguments: types, ranks, dtypes and devices only."""
    if not isinstance(meta, AttnMetadata):
        raise ValueError(f"meta: expected an AttnMetadata, got {type(meta).__name__}")
    check_positive_int("block_size", block_size)
    check_positive_int("max_model_len", max_model_len)
    leaves = (
        ("positions", 1),
        ("query_start_loc", 1),
        ("seq_lens", 1),
        ("block_table", 2),
        ("slot_mapping", 1),
    )
    for name, ndim in leaves:
        x = getattr(meta, name)
        if not isinstance(x, torch.Tensor) or x.dim() != ndim or not _is_int(x):
            raise ValueError(f"meta.{name}: expected an integer {ndim}-d tensor, got {_describe(x)}")
        if x.device != meta.positions.device:
            raise ValueError(f"meta.{name}: expected device {meta.positions.device}, got {x.device}")
    b = meta.seq_lens.shape[0]
    if meta.block_table.shape[0] != b:
        raise ValueError(
            f"meta.block_table: expected {b} rows (seq_lens' B), got {meta.block_table.shape[0]}"
        )
    if decode and meta.positions.shape[0] != b:
        raise ValueError(
            f"meta.positions: expected one token per request (T = B = {b}: decode metadata), "
            f"got T={meta.positions.shape[0]} (use decode_after after a multi-token step)"
        )
