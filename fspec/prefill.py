"""From prompts to the head's first state: the target's prefill, the first new token, and the draft state.

    pre = fspec.prefill(target, draft, [[1, 2, 3], [4, 5]])
    state, cache = fspec.propose(draft.params, pre.state, pre.draft_cache, cfg=pre.draft_cfg)
    state.draft_tokens            # [B, K]: the K drafts after each request's first new token

This is what `fspec.generate` does before its first round, as a function: notebooks and tests that study the
draft loop on real prompts start from here instead of assembling metadata, caches and the shifted
(hidden, token) pairs by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fspec.cache import KVCache, table_width
from fspec.checkpoint import Draft, Target
from fspec.config import DraftConfig
from fspec.rounds import prefill_forward
from fspec.state import DraftState, validate_draft_state


@dataclasses.dataclass(frozen=True)
class Prefill:
    """The result of `prefill`.

    Attributes:
        tokens: [B] int64, each request's first new token (the target's sample for position len(prompt),
            with the engine's salt, so `generate` emits the same one).
        logits: [B, V] float32, the target's logits at each prompt's last position (p of that token).
        state: the head's first `DraftState` (step 0: the prompt's (hidden i, token i + 1) pairs, the last
            pairing the final hidden with the new token), ready for `fspec.propose` / `fspec.draft_step`;
            None without a head.
        target_cache, draft_cache: the KV caches holding the prompts (the draft cache is written by propose;
            None without a head). Both use `block_table`.
        block_table: [B, M] int32: request b owns the blocks of its row (-1 past them), enough for its
            prompt plus `room` tokens; M = `fspec.cache.table_width` of the longest (a power of two of 512
            tokens' worth, at most what max_model_len allows).
        draft_cfg: the head's config with K = num_speculative_steps: pass it to `propose` (None without a
            head).
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    state: DraftState | None
    target_cache: KVCache
    draft_cache: KVCache | None
    block_table: torch.Tensor
    draft_cfg: DraftConfig | None


def prefill_batch(
    target: Target,
    draft: Draft | None,
    ids: torch.Tensor,
    lens: Sequence[int],
    live: Sequence[bool],
    table: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    tcache: KVCache,
    *,
    block_size: int,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, DraftState | None]:
    """Unvalidated core of `prefill` (the engine calls it): ids [B, Q] (request b's prompt in its first
    lens[b] columns; rows with live[b] False are padding). Returns (first tokens [B], last-position logits
    [B, V] float32, the head's first state or None). greedy: every temperature is 0 (the first tokens by
    argmax, `fspec.rounds.sample_tokens`)."""
    device = ids.device
    dcfg = draft.cfg if draft is not None else None
    return prefill_forward(
        target.params,
        draft.params if draft is not None else None,
        ids,
        torch.tensor(list(lens), dtype=torch.int64, device=device),
        torch.tensor(list(live), dtype=torch.bool, device=device),
        table,
        temperature,
        seed,
        tcache,
        tcfg=target.cfg,
        dcfg=dcfg,
        block_size=block_size,
        greedy=greedy,
    )


def prefill(
    target: Target,
    draft: Draft | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    temperature: float | Sequence[float] = 0.0,
    seed: int | Sequence[int] = 0,
    num_speculative_steps: int | None = None,
    room: int = 64,
) -> Prefill:
    """Run the target over `prompts`, sample each request's first new token, and build the head's first state.

    prompts, temperature, seed: as in `fspec.generate` (same validation and errors). num_speculative_steps:
    K of the returned state (default: the head's). room: new tokens each request's blocks can hold beyond its
    prompt (capped at max_model_len); one propose writes K + 1 positions, one verification K + 1 more.
    Fresh caches on the target's device; nothing is compiled.
    """
    from fspec.engine import _validate, max_model_len

    if isinstance(room, bool) or not isinstance(room, int) or room < 1:
        raise ValueError(f"room: expected a positive int (new tokens per request), got {room!r}")
    k = num_speculative_steps
    if k is None:
        k = draft.cfg.num_speculative_steps if isinstance(draft, Draft) else 1
    ids, temps, seeds, k, draft = _validate(target, draft, prompts, 1, temperature, seed, k)
    device = target.params["embed"].device
    bs = draft.cfg.block_size if draft is not None else 16
    limit = max_model_len(target, draft)
    blocks = [-(-min(len(p) + room, limit) // bs) for p in ids]
    # As wide as the requests' blocks need (`table_width`), not max_model_len: attention reads the whole
    # table where it cannot read lengths (compiled code, the kernels' launch grid).
    width = table_width(max(blocks) * bs, block_size=bs, max_blocks=max(-(-limit // bs), 1))
    table = torch.full((len(ids), width), -1, dtype=torch.int32)
    offset = 0
    for b, n in enumerate(blocks):
        table[b, :n] = torch.arange(offset, offset + n, dtype=torch.int32)
        offset += n
    table = table.to(device)
    tcache = KVCache.create(
        target.cfg, num_blocks=offset, block_size=bs, dtype=target.params["embed"].dtype, device=device
    )
    dcache = None
    if draft is not None:
        dtype = draft.params["embed"].dtype
        dcache = KVCache.create(draft.cfg.model, num_blocks=offset, block_size=bs, dtype=dtype, device=device)
    padded = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.int64)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = torch.tensor(p)
    temp = torch.tensor(temps, dtype=torch.float32, device=device)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    first, last, state = prefill_batch(
        target,
        draft,
        padded.to(device),
        [len(p) for p in ids],
        [True] * len(ids),
        table,
        temp,
        seed_t,
        tcache,
        block_size=bs,
        greedy=device.type != "cuda" and all(t == 0 for t in temps),
    )
    if state is not None:
        validate_draft_state(state, cfg=draft.cfg)
    return Prefill(
        tokens=first,
        logits=last,
        state=state,
        target_cache=tcache,
        draft_cache=dcache,
        block_table=table,
        draft_cfg=draft.cfg if draft is not None else None,
    )
