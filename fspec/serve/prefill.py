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
import math
from collections.abc import Sequence

import torch

from fspec.core.cache import DenseKVCache, KVCache, table_width
from fspec.core.config import DraftConfig
from fspec.core.pytree import tree
from fspec.core.sampling_params import SamplingParams
from fspec.core.state import DraftState, validate_draft_state
from fspec.models.checkpoint import Draft, Target
from fspec.models.heads import head_kind
from fspec.serve.prompts import prompt_ids
from fspec.serve.rounds import prefill_forward


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
            None without a head). Both use `block_table`; with cache="dense" the draft cache is a
            `DenseKVCache` instead (one row of positions per request).
        block_table: [B, M] int32: request b owns the blocks of its row (-1 past them), enough for its
            prompt plus `room` tokens; M = `fspec.core.cache.table_width` of the longest (a power of two of
            512 tokens' worth, at most what max_model_len allows).
        draft_cfg: the head's config with K = num_speculative_steps: pass it to `propose` (None without a
            head).
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    state: DraftState | None
    target_cache: KVCache
    draft_cache: KVCache | DenseKVCache | None
    block_table: torch.Tensor
    draft_cfg: DraftConfig | None


def prefill_batch(
    target: Target,
    draft: Draft | None,
    ids: torch.Tensor,
    lens: Sequence[int],
    live: Sequence[bool],
    table: torch.Tensor,
    sampling: SamplingParams,
    tcache: KVCache,
    *,
    block_size: int,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, DraftState | None]:
    """Unvalidated core of `prefill` (the engine calls it): ids [B, Q] (request b's prompt in its first
    lens[b] columns; rows with live[b] False are padding). Returns (first tokens [B], last-position logits
    [B, V] float32, the head's first state or None). greedy: every temperature is 0 (the first tokens by
    argmax, `fspec.serve.rounds.sample_tokens`)."""
    device = ids.device
    dcfg = draft.cfg if draft is not None else None
    return prefill_forward(
        target.params,
        draft.params if draft is not None else None,
        ids,
        torch.tensor(list(lens), dtype=torch.int64, device=device),
        torch.tensor(list(live), dtype=torch.bool, device=device),
        table,
        sampling,
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
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    num_speculative_steps: int | None = None,
    room: int = 64,
    cache: str = "paged",
) -> Prefill:
    """Run the target over `prompts`, sample each request's first new token, and build the head's first state.

    prompts and the sampling options: as in `fspec.generate` (same validation and errors).
    num_speculative_steps: K of the returned state (default: the head's). room: new tokens each request's
    blocks can hold beyond its prompt (capped at max_model_len); one propose writes K + 1 positions, one
    verification K + 1 more. cache: the head's cache, "paged" (a `KVCache` on `block_table`, for serving) or
    "dense" (a `DenseKVCache` of [B, L, Nkv, M·block_size, D], written out of place: `propose` over it is a
    pure function for torch.func.grad / vmap, see `fspec.draft`).
    Fresh caches on the target's device; nothing is compiled.
    """
    if cache not in ("paged", "dense"):
        raise ValueError(f"cache: expected 'paged' or 'dense', got {cache!r}")
    if isinstance(room, bool) or not isinstance(room, int) or room < 1:
        raise ValueError(f"room: expected a positive int (new tokens per request), got {room!r}")
    options = dict(temperature=temperature, seed=seed, top_k=top_k, top_p=top_p, min_p=min_p)
    ids, options, k, draft = _validate(target, draft, prompts, 1, options, num_speculative_steps)
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
        if cache == "dense":  # positions reach at most the table's capacity, as in the paged cache
            dcache = DenseKVCache.create(
                draft.cfg.model, batch_size=len(ids), max_len=width * bs, dtype=dtype, device=device
            )
        else:
            dcache = KVCache.create(
                draft.cfg.model, num_blocks=offset, block_size=bs, dtype=dtype, device=device
            )
    padded = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.int64)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = torch.tensor(p)
    sampling = SamplingParams.create(len(ids), **options, device=device)
    first, last, state = prefill_batch(
        target,
        draft,
        padded.to(device),
        [len(p) for p in ids],
        [True] * len(ids),
        table,
        sampling,
        tcache,
        block_size=bs,
        greedy=device.type != "cuda" and all(t == 0 for t in options["temperature"]),
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


# --- the checks at the public boundary: fspec.prefill, fspec.generate (runner.py, engine.py) ----------------

MIN_TEMPERATURE = 1e-6  # smallest positive temperature `generate` accepts (see `_validate`)
# Largest temperature `generate` accepts: at T = 1e4 logits of a few hundred are flat to within 5% (already
# uniform sampling); 1e39 passes a finite check but is no setting anyone means, and overflows float32 itself.
MAX_TEMPERATURE = 1e4


def max_model_len(target: Target, draft: Draft | None) -> int:
    """The longest sequence a run may reach: the target's positions, and the head's cache if any."""
    n = target.cfg.max_position_embeddings
    return n if draft is None else min(n, draft.cfg.max_model_len)


def _validate(target, draft, prompts, max_new_tokens, options: dict, k, compile=False, progress=False):
    """The checks of `fspec.generate` / `fspec.prefill`: (token ids per prompt, each sampling option as one
    value per prompt, K, the draft with K set). options: temperature, seed, top_k, top_p, min_p as given
    (a scalar or one per prompt); k None takes the head's recorded K."""
    if not isinstance(target, Target):
        raise ValueError(f"target: expected a fspec.Target, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, Draft):
        raise ValueError(f"draft: expected a fspec.Draft or None, got {type(draft).__name__}")
    device = target.params["embed"].device
    if draft is not None:
        devices = {x.device for x in tree.tree_leaves(draft.params) if isinstance(x, torch.Tensor)}
        if devices - {device}:
            raise ValueError(
                f"draft: expected parameters on the target's device {device}, got {sorted(map(str, devices))}"
            )
        if any(i > target.cfg.num_hidden_layers for i in head_kind(draft.cfg).aux_layer_ids(draft.cfg)):
            raise ValueError(
                f"draft: expected target_layer_ids in [0, {target.cfg.num_hidden_layers}] (target layers; "
                f"{target.cfg.num_hidden_layers}: the final normed hidden), "
                f"got {draft.cfg.target_layer_ids}"
            )
    if k is None:
        k = draft.cfg.num_speculative_steps if draft is not None else 1
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
        raise ValueError(f"num_speculative_steps: expected an int in [1, 16], got {k!r}")
    if draft is not None:
        if draft.cfg.model.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"draft: expected a head over the target's vocabulary of {target.cfg.vocab_size}, "
                f"got {draft.cfg.model.vocab_size}"
            )
        if draft.cfg.target_hidden_size != target.cfg.hidden_size:
            raise ValueError(
                f"draft: expected target_hidden_size {target.cfg.hidden_size}, "
                f"got {draft.cfg.target_hidden_size}"
            )
        if draft.cfg.num_speculative_steps != k:
            draft = dataclasses.replace(draft, cfg=dataclasses.replace(draft.cfg, num_speculative_steps=k))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    for name, flag in (("compile", compile), ("progress", progress)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts: expected a non-empty list of strings or token lists, got {prompts!r:.80}")
    ids = [prompt_ids(target, p, i) for i, p in enumerate(prompts)]
    limit = max_model_len(target, draft)
    for i, p in enumerate(ids):
        if len(p) >= limit:
            raise ValueError(
                f"prompts[{i}]: expected at most {limit - 1} tokens (max_model_len={limit} minus one new "
                f"token), got {len(p)}"
            )
    n = len(ids)
    temps = _per_request("temperature", options["temperature"], n, float)
    for i, t in enumerate(temps):
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature[{i}]: expected a finite value >= 0, got {t!r}")
        if t > MAX_TEMPERATURE:
            raise ValueError(
                f"temperature[{i}]: expected at most MAX_TEMPERATURE={MAX_TEMPERATURE:g}, got {t!r}"
            )
        if 0 < t < MIN_TEMPERATURE:
            # The samplers divide logits by T: at T = 1e-38 a logit of 1000 overflows to inf, the softmax
            # turns NaN and the kernels return token 0. Below 1e-6 sampling is greedy for sane logits anyway.
            raise ValueError(
                f"temperature[{i}]: expected 0 (greedy) or a value >= {MIN_TEMPERATURE} "
                f"(smaller ones overflow logits / temperature), got {t!r}"
            )
    seeds = _per_request("seed", options["seed"], n, int)
    for i, s in enumerate(seeds):
        if not -(2**63) <= s < 2**63:
            raise ValueError(f"seed[{i}]: expected a 64-bit int, got {s!r}")
    top_k = _per_request("top_k", options["top_k"], n, int)
    top_p = _per_request("top_p", options["top_p"], n, float)
    min_p = _per_request("min_p", options["min_p"], n, float)
    for name, values, ok, want in (
        ("top_k", top_k, lambda x: x >= 0, "an int >= 0 (0 = off)"),
        ("top_p", top_p, lambda x: 0 < x <= 1, "a value in (0, 1] (1 = off)"),
        ("min_p", min_p, lambda x: 0 <= x < 1, "a value in [0, 1) (0 = off)"),
    ):
        for i, x in enumerate(values):
            if not ok(x):  # NaN fails every comparison
                raise ValueError(f"{name}[{i}]: expected {want}, got {x!r}")
    per_prompt = dict(temperature=temps, seed=seeds, top_k=top_k, top_p=top_p, min_p=min_p)
    return ids, per_prompt, k, draft


def _per_request(name: str, value, n: int, kind: type) -> list:
    if isinstance(value, torch.Tensor) and value.dim() == 0:  # a 0-d tensor is one number (as HF takes it)
        value = value.item()
    if isinstance(value, torch.Tensor) and value.dim() != 1:
        raise ValueError(
            f"{name}: expected a number, a list or a 0-d / 1-D tensor, got shape {tuple(value.shape)}"
        )
    if isinstance(value, (list, tuple, torch.Tensor)):
        values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
        if len(values) != n:
            raise ValueError(f"{name}: expected one value or {n} (one per prompt), got {len(values)}")
    else:
        values = [value] * n
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise ValueError(f"{name}[{i}]: expected {'an int' if kind is int else 'a number'}, got {v!r}")
        out.append(kind(v))
    return out
