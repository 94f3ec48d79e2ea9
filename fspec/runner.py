"""One batch of `fspec.generate`: host bookkeeping between rounds, device work inside them.

The host side (this class) holds what legitimately changes between rounds and is cheap on the host: each
request's emitted tokens, its position, its blocks. Everything a round computes on the device is a pure
function call: `llama.forward`, `rejection_sample`, `propose`.
"""

from __future__ import annotations

import functools

import torch

from fspec.cache import BlockAllocator, KVCache, mark_static
from fspec.compile import compile_propose
from fspec.config import DraftConfig, bucket_for
from fspec.draft import propose
from fspec.kernels.salts import SALT_BONUS
from fspec.metadata import decode_metadata, first_step_metadata
from fspec.models import llama, project_target_hidden
from fspec.models.eagle3 import draft_to_target
from fspec.models.llama import TargetHidden
from fspec.sampling import gumbel_sample
from fspec.state import init_draft_state
from fspec.verify import rejection_sample


@functools.cache
def _compiled_target_forward(cfg, aux_layer_ids: tuple[int, ...], max_query_len: int):
    def run(params, input_ids, meta, cache):
        logits, hidden, _ = llama.forward(
            params, input_ids, meta, cache, cfg=cfg, aux_layer_ids=aux_layer_ids, max_query_len=max_query_len
        )
        return logits, hidden

    return torch.compile(run, mode="reduce-overhead", fullgraph=True, dynamic=False)


@functools.cache
def _compiled_propose(cfg: DraftConfig):
    return compile_propose(cfg=cfg)


class Run:
    """Generation for up to 256 requests, padded to their batch bucket."""

    def __init__(self, target, draft, prompts, temps, seeds, *, max_new_tokens, compile, stats, progress):
        from fspec.engine import max_model_len

        self.target, self.draft, self.stats = target, draft, stats
        self.compile, self.progress = compile, progress
        self.max_new = max_new_tokens
        self.k = draft.cfg.num_speculative_steps if draft is not None else 0
        self.bs = draft.cfg.block_size if draft is not None else 16
        self.max_len = max_model_len(target, draft)
        self.max_blocks = -(-self.max_len // self.bs)
        self.prompts = [list(p) for p in prompts]
        self.n_real = len(prompts)
        self.b = bucket_for(self.n_real)
        self.device = target.params["embed"].device
        pad = self.b - self.n_real
        self.temp = torch.tensor(list(temps) + [0.0] * pad, dtype=torch.float32, device=self.device)
        self.seed = torch.tensor(list(seeds) + [0] * pad, dtype=torch.int64, device=self.device)
        self.eos = set(target.cfg.eos_token_ids)
        self.out: list[list[int]] = [[] for _ in range(self.n_real)]
        self.done = [False] * self.n_real + [True] * pad
        self.n = [len(p) for p in self.prompts] + [0] * pad  # position of each request's current token
        self.cur = [0] * self.b  # the current token (emitted, not yet in the target cache)
        self.blocks: list[list[int]] = [[] for _ in range(self.b)]
        # Every request's worst case fits; blocks are still allocated as requests grow and freed as they end.
        need = sum(
            -(-min(len(p) + max_new_tokens + self.k + 2, self.max_len) // self.bs) for p in self.prompts
        )
        self.alloc = BlockAllocator(need)
        dtype = target.params["embed"].dtype
        self.tcache = KVCache.create(
            target.cfg, num_blocks=need, block_size=self.bs, dtype=dtype, device=self.device
        )
        self.dcache = None
        if draft is not None:
            self.dcache = KVCache.create(
                draft.cfg.model,
                num_blocks=need,
                block_size=self.bs,
                dtype=draft.params["embed"].dtype,
                device=self.device,
            )
        if compile:
            mark_static(self.tcache)
            if self.dcache is not None:
                mark_static(self.dcache)
        self.aux = draft.cfg.target_layer_ids if draft is not None and draft.cfg.kind == "eagle3" else ()

    # -- host bookkeeping --

    def _ensure(self, b: int, tokens: int) -> None:
        want = min(-(-tokens // self.bs), self.max_blocks)
        if want > len(self.blocks[b]):
            self.blocks[b] += self.alloc.allocate(want - len(self.blocks[b]))

    def _table(self) -> torch.Tensor:
        table = torch.full((self.b, self.max_blocks), -1, dtype=torch.int32)
        for b, blocks in enumerate(self.blocks):
            if blocks:
                table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table.to(self.device)

    def _emit(self, b: int, new: list[int], *, first: bool = False) -> None:
        """Append new tokens to request b and make the last one its current token.

        The current token sits at position n; new tokens take positions n + 1, ... (the prefill's first token
        takes n itself). A sequence holds at most max_model_len tokens: tokens past it are dropped, exactly
        as target-only decoding would never produce them. The request ends at EOS, at max_new_tokens, or
        when its sequence is full.
        """
        if not first:
            new = new[: self.max_len - 1 - self.n[b]]
        for t in new:
            self.out[b].append(t)
            if t in self.eos or len(self.out[b]) >= self.max_new:
                self._finish(b)
                return
            if not first:
                self.n[b] += 1
        self.cur[b] = new[-1]
        if self.n[b] + 1 >= self.max_len:
            self._finish(b)

    def _finish(self, b: int) -> None:
        self.done[b] = True
        self.alloc.free(self.blocks[b])
        self.blocks[b] = []

    # -- device work --

    def _target(self, ids: torch.Tensor, meta, q: int):
        self.stats.target_forwards += 1
        cfg = self.target.cfg
        if self.compile:
            fn = _compiled_target_forward(cfg, self.aux, q)
            torch.compiler.cudagraph_mark_step_begin()
            logits, hidden = fn(self.target.params, ids, meta, self.tcache)
            # The hidden states feed the draft loop's graph: copy them out of this graph's output buffers,
            # which the next graph generation may overwrite. The logits are consumed before that.
            return logits, TargetHidden(last=hidden.last.clone(), aux=hidden.aux.clone())
        logits, hidden, _ = llama.forward(
            self.target.params, ids, meta, self.tcache, cfg=cfg, aux_layer_ids=self.aux, max_query_len=q
        )
        return logits, hidden

    def _propose(self, ids: torch.Tensor, hidden, meta):
        cfg = self.draft.cfg
        h = project_target_hidden(self.draft.params, hidden, cfg=cfg)  # [T, H]
        state = init_draft_state(ids, h, meta, cfg=cfg, temperature=self.temp, seed=self.seed)
        if self.compile and meta.num_tokens == self.b * (self.k + 1):
            state, _ = _compiled_propose(cfg)(self.draft.params, state, self.dcache)
        else:
            state, _ = propose(self.draft.params, state, self.dcache, cfg=cfg)
        # Copies: a compiled loop's outputs are overwritten by its next replay.
        return state.draft_tokens.clone(), state.draft_probs.clone()

    def _prefill(self):
        lens = self.n
        q = max(lens)
        for b in range(self.n_real):
            self._ensure(b, lens[b] + self.k + 2)
        ids = torch.zeros(self.b, q, dtype=torch.int64)
        for b, p in enumerate(self.prompts):
            ids[b, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        starts = torch.tensor([0 if not d else -1 for d in self.done], device=self.device)
        counts = torch.tensor(lens, device=self.device)
        meta = first_step_metadata(starts, counts, self._table(), num_query=q, block_size=self.bs)
        self.stats.target_forwards += 1  # the prefill runs eagerly: its shape is the prompts'
        logits, hidden, _ = llama.forward(
            self.target.params,
            ids.view(-1),
            meta,
            self.tcache,
            cfg=self.target.cfg,
            aux_layer_ids=self.aux,
            max_query_len=q,
        )
        last = torch.arange(self.b, device=self.device) * q + (counts - 1).clamp(min=0)
        first = gumbel_sample(
            logits.index_select(0, last).float(), self.temp, self.seed, counts.long(), salt=SALT_BONUS
        )
        first_list = first.tolist()
        drafts = None
        if self.draft is not None:
            # The head's rows are positions 0..n-1, pairing hidden i with token i + 1 (last: the new token).
            shifted = torch.cat(
                [ids[:, 1:], torch.zeros(self.b, 1, dtype=torch.int64, device=self.device)], 1
            )
            shifted[torch.arange(self.b), (counts - 1).clamp(min=0)] = first
            drafts = self._propose(shifted.view(-1), hidden, meta)
        for b in range(self.n_real):
            self._emit(b, [first_list[b]], first=True)  # at position n, the prompt length
        return drafts

    def _verify_round(self, drafts):
        k = self.k
        draft_tokens, draft_probs = drafts
        live = [not d for d in self.done]
        for b in range(self.b):
            if live[b]:
                self._ensure(b, self.n[b] + k + 1)
        table = self._table()
        n = torch.tensor(self.n, device=self.device)
        starts = torch.where(torch.tensor(live, device=self.device), n, torch.full_like(n, -1))
        counts = (self.max_len - n).clamp(max=k + 1)  # near max_model_len, rows past it are padding
        meta = first_step_metadata(starts, counts, table, num_query=k + 1, block_size=self.bs)
        cur = torch.tensor(self.cur, device=self.device)
        ids = torch.cat([cur[:, None], draft_tokens.clamp(min=0)], 1)  # [B, K+1]
        logits, hidden = self._target(ids.view(-1), meta, k + 1)
        target_logits = logits.view(self.b, k + 1, -1)  # [B, K+1, V]
        q = None
        if not self.draft.cfg.greedy_drafts:
            q = draft_probs
            if self.draft.cfg.kind == "eagle3":  # q over the reduced vocabulary -> the target's
                d2t = self.draft.params["d2t"]
                ids_v = draft_to_target(torch.arange(d2t.numel(), device=self.device), d2t)
                q = draft_probs.new_zeros(self.b, k, target_logits.shape[-1]).index_copy_(
                    2, ids_v, draft_probs
                )
        tokens, accepted = rejection_sample(
            target_logits, draft_tokens.clamp(min=0), q, self.temp, self.seed, n + 1
        )
        tok_list, acc_list = tokens.tolist(), accepted.tolist()  # the round's one host sync
        self.stats.record([acc_list[b] for b in range(self.n_real) if live[b]])
        starts_next = [self.n[b] if live[b] else -1 for b in range(self.b)]
        for b in range(self.n_real):
            if live[b]:
                self._emit(b, tok_list[b][: acc_list[b] + 1])
        if all(self.done):
            return None
        # The head's first step: rows n..n+a of each live request pair the verification's hidden of position
        # n + j with the emitted token at n + j + 1; the rest are padding.
        for b in range(self.b):
            if self.done[b]:
                starts_next[b] = -1
            else:
                self._ensure(b, self.n[b] + k + 1)
        starts_t = torch.tensor(starts_next, device=self.device)
        counts_t = accepted + 1
        meta = first_step_metadata(starts_t, counts_t, self._table(), num_query=k + 1, block_size=self.bs)
        return self._propose(tokens.clamp(min=0).view(-1), hidden, meta)

    def _target_only_round(self) -> None:
        pos = torch.tensor([self.n[b] if not self.done[b] else -1 for b in range(self.b)], device=self.device)
        for b in range(self.b):
            if not self.done[b]:
                self._ensure(b, self.n[b] + 1)
        meta = decode_metadata(pos, self._table(), block_size=self.bs)
        ids = torch.tensor(self.cur, device=self.device)
        logits, _ = self._target(ids, meta, 1)
        new = gumbel_sample(
            logits.float(), self.temp, self.seed, pos.clamp(min=-1) + 1, salt=SALT_BONUS
        ).tolist()
        self.stats.record([0 for b in range(self.n_real) if not self.done[b]])
        for b in range(self.n_real):
            if not self.done[b]:
                self._emit(b, [new[b]])

    def go(self) -> list[list[int]]:
        drafts = self._prefill()
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.n_real * self.max_new, desc="fspec generate", unit="tok")
        emitted = sum(map(len, self.out))
        while not all(self.done):
            if self.draft is None:
                self._target_only_round()
            else:
                drafts = self._verify_round(drafts)
            if bar is not None:
                now = sum(map(len, self.out))
                bar.update(now - emitted)
                emitted = now
        if bar is not None:
            bar.close()
        return self.out
