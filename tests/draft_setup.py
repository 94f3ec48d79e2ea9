"""Shared set-up of the draft-loop tests: a tiny target and head, a filled head cache, a first-step state.

The naive reference here rebuilds everything from scratch on the host at every step: it keeps each request's
whole sequence of (token, hidden) pairs and recomputes the head's dense, causal forward over all of it, with
no cache, no block table and no metadata. A draft loop that reads stale metadata or a wrong slot disagrees
with it.
"""

from __future__ import annotations

import dataclasses

import torch

import fspec
from fspec.kernels.salts import SALT_DRAFT
from fspec.models import llama

BLOCK = 4
MAX_LEN = 48


def tiny_target(seed: int = 0) -> fspec.Target:
    cfg = fspec.ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=MAX_LEN,
    )
    return fspec.Target(cfg=cfg, params=llama.init(cfg, seed=seed))


def tiny_draft(
    target: fspec.Target, *, kind: str, k: int, greedy: bool = False, seed: int = 1
) -> fspec.Draft:
    extra = {}
    if kind == "eagle3":
        ids = torch.randperm(97, generator=torch.Generator().manual_seed(seed))[:61].sort().values
        extra = {"draft_vocab_size": 61, "draft_ids": ids}
    draft = fspec.init_draft(
        target,
        kind=kind,
        seed=seed,
        num_speculative_steps=k,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        greedy_drafts=greedy,
        **extra,
    )
    # Sharpen the random head so that sampling is far from uniform (a stronger test of q and of the noise).
    lm = draft.params["lm_head"]
    if not any(lm is p for p in fspec.tree.tree_leaves(target.params)):
        with torch.no_grad():
            lm.mul_(40.0)
    return draft


@dataclasses.dataclass
class Scenario:
    draft: fspec.Draft
    cache: fspec.KVCache
    state: fspec.DraftState  # the first step of a round: Q = K + 1 rows per request
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # per request: (tokens [n], hidden [n, H]) in the cache
    first: list[tuple[torch.Tensor, torch.Tensor]]  # per request: the live first-step (tokens, hidden)


def scenario(
    draft: fspec.Draft,
    *,
    context_lens: list[int],
    live: list[int],
    temperature: list[float],
    seed: int = 0,
    padding_rows: int = 0,
) -> Scenario:
    """Requests with ragged cached contexts, then a first step with `live[b]` of K + 1 rows live."""
    cfg = draft.cfg
    gen = torch.Generator().manual_seed(seed)
    h, k, b = cfg.model.hidden_size, cfg.num_speculative_steps, len(context_lens)
    blocks_per_req = MAX_LEN // BLOCK
    total = (b + padding_rows) * blocks_per_req
    cache = fspec.KVCache.create(cfg.model, num_blocks=total, block_size=BLOCK)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed + 1)).to(torch.int32)
    table = perm[: b * blocks_per_req].view(b, blocks_per_req)
    table = torch.cat([table, torch.full((padding_rows, blocks_per_req), -1, dtype=torch.int32)])
    n = b + padding_rows
    # 1. Fill the head's cache with each request's context (a ragged prefill through the paged head).
    qmax = max(context_lens)
    starts = torch.tensor([0] * b + [-1] * padding_rows)
    counts = torch.tensor(context_lens + [0] * padding_rows)
    meta = fspec.first_step_metadata(starts, counts, table, num_query=qmax, block_size=BLOCK)
    contexts = [
        (torch.randint(0, 97, (c,), generator=gen), torch.randn(c, h, generator=gen)) for c in context_lens
    ]
    ids = torch.zeros(n, qmax, dtype=torch.int64)
    hid = torch.zeros(n, qmax, h)
    for i, (t, x) in enumerate(contexts):
        ids[i, : len(t)], hid[i, : len(t)] = t, x
    _, _, cache = fspec.head_forward(
        draft.params, ids.view(-1), hid.view(-1, h), meta, cache, cfg=cfg, max_query_len=qmax
    )
    # 2. The first step: K + 1 rows per request, live[b] of them live, at positions context_len..
    starts = torch.tensor(context_lens + [-1] * padding_rows)
    counts = torch.tensor(live + [0] * padding_rows)
    meta = fspec.first_step_metadata(starts, counts, table, num_query=k + 1, block_size=BLOCK)
    first = [(torch.randint(0, 97, (a,), generator=gen), torch.randn(a, h, generator=gen)) for a in live]
    ids = torch.zeros(n, k + 1, dtype=torch.int64)
    hid = torch.zeros(n, k + 1, h)
    for i, (t, x) in enumerate(first):
        ids[i, : len(t)], hid[i, : len(t)] = t, x
    state = fspec.init_draft_state(
        ids.view(-1),
        hid.view(-1, h),
        meta,
        cfg=cfg,
        temperature=torch.tensor(temperature + [0.0] * padding_rows),
        seed=torch.arange(n, dtype=torch.int64) * 7919 + 11,
    )
    return Scenario(draft=draft, cache=cache, state=state, contexts=contexts, first=first)


def naive_propose(sc: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_tokens [B, K], draft_probs [B, K, Vd]) by recomputing each request's whole sequence per step."""
    cfg, params = sc.draft.cfg, sc.draft.params
    k = cfg.num_speculative_steps
    vd = 0 if cfg.greedy_drafts else cfg.draft_vocab_size
    tokens = torch.full((len(sc.contexts), k), -1, dtype=torch.int64)
    probs = torch.zeros(len(sc.contexts), k, vd)
    for b, ((ct, ch), (ft, fh)) in enumerate(zip(sc.contexts, sc.first)):
        seq_ids, seq_hidden = torch.cat([ct, ft]), torch.cat([ch, fh])
        for step in range(k):
            logits, out = fspec.head_forward_dense(params, seq_ids[None], seq_hidden[None], cfg=cfg)
            last = logits[0, -1:].float()  # [1, Vd]
            position = torch.tensor([seq_ids.numel() + 1])  # the sampled token's position
            temp = sc.state.sampling.temperature[b : b + 1]
            if cfg.greedy_drafts:
                tok = last.argmax(-1)
            else:
                out_t = torch.full((1, k), -1, dtype=torch.int64)
                out_p = torch.zeros(1, k, vd)
                tok = fspec.gumbel_sample(
                    last,
                    temp,
                    sc.state.sampling.seed[b : b + 1],
                    position,
                    salt=SALT_DRAFT,
                    out_tokens=out_t,
                    out_probs=out_p,
                    col=torch.tensor(step),
                )
                probs[b, step] = out_p[0, step]
            if cfg.kind == "eagle3":
                tok = fspec.draft_to_target(tok, params["d2t"])
            tokens[b, step] = tok[0]
            seq_ids = torch.cat([seq_ids, tok])
            seq_hidden = torch.cat([seq_hidden, out[0, -1:]])
    return tokens, probs


def leaves_snapshot(tree) -> list[torch.Tensor]:
    return [x.clone() for x in fspec.tree.tree_leaves(tree)]
