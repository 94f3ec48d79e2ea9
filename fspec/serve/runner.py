"""One `fspec.generate` call: host bookkeeping between rounds, with continuous batching; each round's device
work is one call.

The host side (`Run`) holds what legitimately changes between rounds and is cheap on the host: each
request's emitted tokens, its position, its blocks, and the queue of requests not yet admitted. The batch has
a fixed number of slots (a batch bucket); a request that finishes frees its slot and its KV blocks, and the
next waiting request is prefilled into the slot while the others go on (`_admit`), so a call of many prompts
of mixed lengths keeps the batch full instead of waiting for its slowest request. A round's device work is
one function (`fspec.serve.rounds.spec_round_in_place` / `decode_round`: the pure round, then its own
bookkeeping on the device, which writes the next current token, position and proposal in place), one CUDA
graph when compiled; the host reads the round's tokens once (one sync per round). The block table goes to
the device only when a request crosses into a new block, finishes or is admitted. What compiled runs keep
between calls (caches, static buffers, compiled rounds) is a `fspec.serve.resources.Resources` of the
`fspec.Generator` that runs them.

On CUDA a prefill runs in chunks of a few fixed lengths (`fspec.serve.resources.chunk_sizes`) through the
same paged kernels as the rounds, so no shape depends on a prompt's length: compiled calls replay one
captured graph per chunk shape, eager calls meet the same few Triton specialisations. Elsewhere (the CPU) a
prefill runs whole prompts at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from fspec.compile.graph_capture import GraphCapture
from fspec.core.cache import BlockAllocator, table_width
from fspec.core.config import bucket_for
from fspec.core.pytree import tree
from fspec.core.sampling_params import SamplingParams
from fspec.serve.prefill import max_model_len, prefill_batch
from fspec.serve.resources import Resources, chunk_sizes, pick_chunk
from fspec.serve.rounds import (
    PrefillChunk,
    advance,
    captured_prefill_chunk,
    compiled_decode_round,
    compiled_spec_round,
    decode_round,
    prefill_round,
    run_drafts,
    spec_round,
)
from fspec.serve.stops import StopConfig, StopTracker, stop_config

# Blocks allocated ahead of need, so the block table (a host-to-device copy) changes every few rounds, not
# every round a request crosses a block boundary.
_LOOKAHEAD = 4
MAX_SLOTS = 256  # the largest batch bucket


@dataclasses.dataclass(frozen=True)
class Refill:
    """When a call with prompts still waiting fills its free slots (continuous batching).

    Each admission is a prefill: a target forward (a few, for prompts longer than a chunk). On a GPU its cost
    should hardly depend on how many requests it takes, a small model's forward being bound by its launches:
    filling every slot the round it frees then spends about one forward per finished request, and waiting
    until several slots are free one for all of them, at the price of those slots idling a few rounds. On a
    CPU a prefill costs what its tokens cost, and an idle slot is a padding row computed for nothing.
    Admission happens when requests wait for a free slot and any of these holds: no request is live; at
    least ceil(share × slots) slots are free; a slot has been free for max_wait rounds. The default,
    share = 0, admits in the round a slot frees: 3-5% faster than share = 0.125 on the CPU, 12% slower on
    one H100 run at B = 64 (docs/serve.md); it stays until the GPU's case is repeated. Every call of at most
    `slots` prompts admits them all at once anyway. The rule is text-generation-inference's router's
    (`--waiting-served-ratio`, `--max-waiting-tokens`), here counted in free slots and rounds.

    share: a float in [0, 1]; max_wait: an int >= 1 (rounds launched since the slot was freed)."""

    share: float = 0.0
    max_wait: int = 8

    def __post_init__(self) -> None:
        share, wait = self.share, self.max_wait
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"share: expected a float in [0, 1], got {share!r}")
        if isinstance(wait, bool) or not isinstance(wait, int) or wait < 1:
            raise ValueError(f"max_wait: expected an int >= 1, got {wait!r}")

    def due(self, free: int, slots: int, live: bool, waited: int) -> bool:
        """Whether to admit now: `free` of `slots` slots free, `live` whether any request is, `waited` the
        rounds the longest-free slot has been free."""
        return free > 0 and (not live or free >= math.ceil(self.share * slots) or waited >= self.max_wait)


class Run:
    """Generation for any number of requests, at most `max_slots` at once in a batch bucket of slots.

    stops: the call's `fspec.serve.stops.StopConfig` (default: the target's EOS ids only). detokenize: build
    each request's text as it grows (`StopTracker.text`; always when there are stop strings): a stream reads
    it between rounds (`rounds()`). resources: what compiled calls keep (a `fspec.Generator`'s; None: fresh
    ones for this run only). refill: when free slots take waiting requests (`Refill`)."""

    def __init__(
        self,
        target,
        draft,
        prompts,
        options,
        *,
        max_new_tokens,
        compile,
        stats,
        progress,
        resources: Resources | None = None,
        stops: StopConfig | None = None,
        detokenize: bool = False,
        max_slots: int = MAX_SLOTS,
        refill: Refill = Refill(),
    ):
        self.res = Resources() if resources is None else resources
        self.target, self.draft, self.stats = target, draft, stats
        self.compile, self.progress = compile, progress
        # Pipelined rounds (launch r + 1 before reading r) hide the host's per-round work: on the H200 they
        # took a K = 5 round from 1.39x to 1.14x its cost model. `pipeline = False` on a Run before `go()`
        # reads each round before launching the next (the synchronous loop: tests compare the two).
        self.pipeline = True
        self.max_new = max_new_tokens
        self.k = draft.cfg.num_speculative_steps if draft is not None else 0
        self.bs = draft.cfg.block_size if draft is not None else 16
        self.max_len = max_model_len(target, draft)
        self.prompts = [list(p) for p in prompts]
        self.n_real = len(self.prompts)  # requests
        # Every request's worst case: what `_ensure` can hand out. `_launch` asks for n + 3K + 2 tokens while
        # the request is live (n <= prompt + max_new_tokens - 2), plus _LOOKAHEAD blocks, capped at the table.
        # (Capping the tokens at max_len before adding the look-ahead under-counted: one prompt of 1 token,
        # max_new_tokens=15, K=3 ran out of blocks; tests/test_fuzz.py found it.)
        full = -(-self.max_len // self.bs)  # what max_model_len allows
        self.worst = [
            min(-(-(len(p) + max_new_tokens + 3 * self.k + 2) // self.bs) + _LOOKAHEAD, full)
            for p in self.prompts
        ]
        # The block table is as wide as this call can need (`table_width`), not max_model_len: attention
        # reads the whole table where it cannot read lengths (compiled code, the kernels' launch grid).
        # Compiled calls never go narrower than what the generator's warm-up recorded.
        self.max_blocks = table_width(max(self.worst) * self.bs, block_size=self.bs, max_blocks=full)
        if compile:
            self.max_blocks = max(self.max_blocks, min(self.res.min_width(target.cfg, self.bs), full))
        self.b = bucket_for(min(self.n_real, max_slots))  # slots
        slots = min(self.n_real, self.b)
        self.device = target.params["embed"].device
        temps = options["temperature"]
        self.stops = stop_config(target, max_new_tokens=max_new_tokens) if stops is None else stops
        # every request's settings, on the host; a slot's row of the device copy is written at admission
        self.host_sampling = SamplingParams.create(self.n_real, **options, **self._suppression())
        self.suppress = self.host_sampling.suppress_ids.shape[1]
        self.bufs = None
        if compile:
            self.bufs = self.res.device_buffers(self.b, self.max_blocks, self.suppress, self.device)
        # Compiled rounds on CUDA replay fspec's own graphs (`GraphCapture`): a round's host cost is one
        # replay, not dynamo's guards over ~300 argument tensors and the graph tree's bookkeeping.
        self.captured = compile and self.device.type == "cuda"
        self.chunked = self.device.type == "cuda"  # prefill in fixed-length chunks (module docstring)
        self.graph_key = None  # the rounds' argument layout, the same every round of a run (`_launch`)
        self.round_fn = None  # the compiled round of this run (`_launch`), looked up once
        self.ring: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # read-back homes (`_read_back`)
        start = self.host_sampling.take(slots).pad(self.b - slots).to_device(self.device)
        if self.bufs is not None:  # static buffers: written in place, read by the graphs where they lie
            self.sampling = start.copy_into(self.bufs["sampling"])
        else:
            self.sampling = tree.tree_map(lambda t: t.clone(), start)
        # A greedy batch run eagerly off CUDA takes its tokens by argmax (`fspec.serve.rounds.sample_tokens`:
        # the same tokens, without the CPU reference sampler's noise); compiled rounds keep one graph for all.
        self.greedy = not compile and self.device.type != "cuda" and all(t == 0 for t in temps)
        detokenize = detokenize or bool(self.stops.stop)
        tok = target.tokenizer
        self.track = [StopTracker(self.stops, tok, detokenize=detokenize) for _ in range(self.n_real)]
        self.out: list[list[int]] = [t.tokens for t in self.track]  # the trackers' own lists
        self.waiting = deque(range(self.n_real))  # requests not yet admitted, in order
        self.req = [-1] * self.b  # the request in each slot (-1: never used)
        self.done = [True] * self.b  # slot idle: its request finished, or none admitted yet
        self.admitted_at = [0] * self.b  # the first round whose rows are the slot's current request's
        self.refill = refill
        self.freed_at = [0] * self.b  # rounds launched when the slot's last request finished
        self.n = [0] * self.b  # position of each slot's current token
        self.cur = [0] * self.b  # the current token (emitted, not yet in the target cache)
        self.blocks: list[list[int]] = [[] for _ in range(self.b)]
        # The block table on the host, kept row by row as blocks are handed out and given back: rebuilding
        # it from `blocks` costs ~3.4 ms at B = 256 (a tensor per slot), and some request crosses into a new
        # block almost every round at that size.
        self.table_h = torch.full((self.b, self.max_blocks), -1, dtype=torch.int32)
        # Enough blocks for the `slots` largest worst cases at once: any set of concurrent requests fits, so
        # a free slot waits for blocks only while a finished request's blocks are still in flight.
        need = sum(sorted(self.worst, reverse=True)[:slots])
        self.table_dirty = self.live_dirty = True
        self.free_at: dict[int, list[int]] = {}  # round index -> blocks to free once that round is processed
        self.processing = -1
        self.firsts: list = []  # admitted requests' first tokens not yet emitted: (event, tokens, slots)
        self.rounds_launched = 0
        self.in_flight = False  # a launched round not yet processed
        self.alloc = BlockAllocator(need)  # hands out what the requests can use; the cache may hold more
        tdtype = target.params["embed"].dtype
        self.tcache = self.res.cache(target.cfg, need, self.bs, tdtype, self.device, compile)
        self.dcache = None
        if draft is not None:
            dtype = draft.params["embed"].dtype
            self.dcache = self.res.cache(draft.cfg.model, need, self.bs, dtype, self.device, compile)
            if all(t == 0 for t in temps) and not draft.cfg.greedy_drafts:
                # A greedy batch verifies by argmax: q is one-hot, so skip building [B, K, V] probabilities.
                cfg = dataclasses.replace(draft.cfg, greedy_drafts=True)
                self.draft = draft = dataclasses.replace(draft, cfg=cfg)

    def _suppression(self) -> dict:
        """min_new_tokens as HF and vLLM do it: the stop ids (EOS unless ignored, stop_token_ids) are masked
        in the target's logits until each request has that many new tokens (`rounds.suppress_tokens`; its
        first new token sits at position len(prompt)). Nothing without min_new_tokens: no mask op runs. The
        id list is padded to a power of two with -1, so calls with nearby stop sets share graphs."""
        ids = sorted(self.stops.eos | self.stops.stop_token_ids)
        if self.stops.min_new_tokens == 0 or not ids:
            return {}
        width = 1 << (len(ids) - 1).bit_length()
        return {
            "suppress_ids": ids + [-1] * (width - len(ids)),
            "suppress_until": [len(p) + self.stops.min_new_tokens for p in self.prompts],
        }

    # -- host bookkeeping --

    def _ensure(self, b: int, tokens: int) -> None:
        want = -(-tokens // self.bs)
        have = len(self.blocks[b])
        if want > have:
            want = min(want + _LOOKAHEAD, self.max_blocks)
            new = self.alloc.allocate(want - have)
            self.blocks[b] += new
            self.table_h[b, have:want] = torch.tensor(new, dtype=torch.int32)
            self.table_dirty = True

    def _table_host(self, slots) -> torch.Tensor:
        """The block table of `slots` (-1: a padding row), one row each, -1 past a request's blocks."""
        index = torch.tensor(slots, dtype=torch.int64)
        return torch.where((index >= 0)[:, None], self.table_h[index.clamp(min=0)], -1)

    def _emit(self, b: int, new: list[int], *, first: bool = False) -> None:
        """Append new tokens to slot b's request and make the last one its current token.

        The current token sits at position n; new tokens take positions n + 1, ... (the prefill's first token
        takes n itself). A sequence holds at most max_model_len tokens: tokens past it are dropped, exactly
        as target-only decoding would never produce them. The request ends at a stop condition
        (`StopTracker.add`: stop string, stop token id, EOS; the first token of the round that meets one), at
        max_new_tokens, or when its sequence is full.
        """
        if not first:
            new = new[: self.max_len - 1 - self.n[b]]
        track = self.track[self.req[b]]
        for t in new:
            if track.add(t) or len(track.tokens) >= self.max_new:
                self._finish(b)
                return
            if not first:
                self.n[b] += 1
        self.cur[b] = new[-1]
        if self.n[b] + 1 >= self.max_len:
            self._finish(b)

    def _finish(self, b: int) -> None:
        self.track[self.req[b]].end()
        self.done[b] = True
        self.freed_at[b] = self.rounds_launched
        # The round launched after the one being processed may still use these blocks: free them once it
        # has been processed (`_process` frees `free_at[index]` after waiting for round `index`).
        self.free_at.setdefault(self.processing + 1, []).extend(self.blocks[b])
        self.blocks[b] = []
        self.table_h[b] = -1
        self.table_dirty = self.live_dirty = True

    def _live(self) -> bool:
        return not all(self.done)

    # -- admission: prefill waiting requests into free slots --

    def _admissible(self) -> list[tuple[int, int]]:
        """(slot, request) pairs to admit now, in request order: when `refill` says it is time, free slots,
        and blocks for each request's worst case beyond what the live requests may still claim (their worst
        cases)."""
        if not self.in_flight:  # nothing on the device can still use blocks that wait to be freed
            for blocks in self.free_at.values():
                self.alloc.free(blocks)
            self.free_at.clear()
        free = [b for b in range(self.b) if self.done[b] and not self.blocks[b]]
        waited = self.rounds_launched - min((self.freed_at[b] for b in free), default=self.rounds_launched)
        if not self.refill.due(len(free), self.b, self._live(), waited):
            return []
        budget = self.alloc.num_free - sum(
            self.worst[self.req[b]] - len(self.blocks[b]) for b in range(self.b) if not self.done[b]
        )
        pairs = []
        while self.waiting and free and self.worst[self.waiting[0]] <= budget:
            r = self.waiting.popleft()
            budget -= self.worst[r]
            pairs.append((free.pop(0), r))
        return pairs

    def _admit(self, drafts, *, defer: bool = False):
        """Prefill the admissible waiting requests into free slots and merge their first token, position,
        settings and first drafts into the batch's device state. Returns the batch's drafts.

        The first tokens are emitted now, or with `defer` by the next `_process` (before its rows): the host
        then queues their copy out and goes on to launch the next round instead of waiting for the prefill,
        so the device is never left without queued work at an admission."""
        pairs = self._admissible()
        if not pairs:
            return drafts
        slots = [s for s, _ in pairs]
        reqs = [r for _, r in pairs]
        for s, r in pairs:
            self.req[s], self.done[s] = r, False
            self.n[s] = len(self.prompts[r])
            self.admitted_at[s] = self.rounds_launched  # rounds launched before now are not this request's
            self._ensure(s, self.n[s] + 2 * self.k + 1)
        # Chunked prefill (CUDA) pads the group to a batch bucket: its graphs and Triton specialisations are
        # per bucket. Whole-prompt prefill (the CPU) runs eagerly, where a padding request would be a prompt's
        # worth of rows computed for nothing: the group is the admitted requests.
        group = bucket_for(len(reqs)) if self.chunked else len(reqs)
        sampling = self.host_sampling.rows(reqs).pad(group - len(reqs)).to_device(self.device)
        first, new = self._prefill(slots, reqs, group, sampling)
        # one pinned copy of (slots, lengths), queued behind the prefill: a pageable copy would wait for it
        both = self._to_device(torch.tensor([slots, [self.n[s] for s in slots]], dtype=torch.int64))
        index, lens = both[0], both[1]
        g = len(reqs)
        self.cur_d.index_copy_(0, index, first[:g])
        self.n_d.index_copy_(0, index, lens)
        for name, t in self.sampling.fields().items():
            t.index_copy_(0, index, getattr(sampling, name)[:g])
        if new is not None:
            for home, d in zip(drafts, new):
                home.index_copy_(0, index, d[:g])
        self.live_dirty = self.table_dirty = True
        self.firsts.append((*self._to_host(first[:g]), slots))
        if not defer:
            self._emit_firsts()
        return drafts

    def _emit_firsts(self) -> None:
        """Emit the admitted requests' first tokens (each at position n, its prompt's length)."""
        for event, first, slots in self.firsts:
            if event is not None:
                event.synchronize()
            for s, token in zip(slots, first.tolist(), strict=True):
                self._emit(s, [token], first=True)
        self.firsts.clear()

    def _prefill(self, slots, reqs, group: int, sampling: SamplingParams):
        """The target prefill of requests `reqs` (into `slots`), their first tokens [group] and the head's
        first K drafts ([group, K], [group, K, Vd]) or None; rows past len(reqs) are padding."""
        prompts = [self.prompts[r] for r in reqs]
        lens = [len(p) for p in prompts] + [0] * (group - len(reqs))
        table = self._table_host([*slots, *[-1] * (group - len(slots))])
        dcfg = self.draft.cfg if self.draft is not None else None
        dparams = self.draft.params if self.draft is not None else None
        if not self.chunked:  # whole prompts at once, eagerly (module docstring)
            self.stats.target_forwards += 1
            ids = torch.zeros(group, max(lens), dtype=torch.int64)
            for b, p in enumerate(prompts):
                ids[b, : len(p)] = torch.tensor(p)
            live = [b < len(reqs) for b in range(group)]
            first, _, state = prefill_batch(
                self.target, self.draft, ids.to(self.device), lens, live, table.to(self.device), sampling,
                self.tcache, block_size=self.bs, greedy=self.greedy,
            )  # fmt: skip
            if state is None:
                return first, None
            return first, run_drafts(dparams, state, self.dcache, cfg=dcfg)
        fn = prefill_round
        if self.compile:
            fn = self.res.graph(captured_prefill_chunk, self.target.cfg, dcfg, self.bs)
        sizes = chunk_sizes(group)
        done_upto = [0] * group
        out = None
        table_d = None if self.compile else self._to_device(table)  # compiled: into each chunk's buffer
        while True:
            left = [lens[b] - done_upto[b] for b in range(group)]
            if max(left) <= 0:
                break
            c = pick_chunk(sizes, max(left))
            ids = torch.zeros(group, c, dtype=torch.int64)
            counts = torch.zeros(group, dtype=torch.int64)
            starts, ahead = torch.zeros_like(counts), torch.zeros_like(counts)
            final = torch.zeros(group, dtype=torch.bool)
            for b, p in enumerate(prompts):
                lo = done_upto[b]
                if lo >= lens[b]:
                    continue
                take = min(c, lens[b] - lo)
                ids[b, :take] = torch.tensor(p[lo : lo + take])
                counts[b], starts[b] = take, lo
                ahead[b] = p[lo + c] if lo + c < lens[b] else 0
                final[b] = lo + take == lens[b]
                done_upto[b] = lo + take
            live = counts > 0
            self.stats.target_forwards += 1
            if self.compile:
                bufs = self.res.chunk_buffers(group, c, self.max_blocks, self.suppress, self.device)
                for name, t in (("ids", ids), ("counts", counts), ("live", live), ("table", table)):
                    self._to_device(t, bufs[name])
                ch = bufs["chunk"]
                for dst, t in ((ch.starts, starts), (ch.lookahead, ahead), (ch.final, final)):
                    self._to_device(t, dst)
                grp = sampling.copy_into(bufs["sampling"])
                args = (self.target.params, dparams, bufs["ids"], bufs["counts"], bufs["live"], bufs["table"],
                        grp, self.tcache, self.dcache)  # fmt: skip
                result = fn(*args, ch)
                final_d = ch.final
            else:
                ch = PrefillChunk(
                    starts=self._to_device(starts), lookahead=self._to_device(ahead),
                    final=self._to_device(final),
                )  # fmt: skip
                result = fn(
                    self.target.params, dparams, self._to_device(ids), self._to_device(counts),
                    self._to_device(live), table_d, sampling, self.tcache, self.dcache,
                    tcfg=self.target.cfg, dcfg=dcfg, block_size=self.bs, chunk=ch,
                )  # fmt: skip
                final_d = ch.final
            # keep each request's results from the chunk that ends its prompt (graph outputs: copied out)
            if out is None:
                out = [t.clone() for t in result]
            else:
                out = [_where_rows(final_d, new, old) for new, old in zip(result, out)]
        return out[0], (tuple(out[1:]) if len(out) > 1 else None)

    # -- device work --

    def _device_state(self) -> None:
        """Device copies of (current token, position, live) and the proposal's homes; updated by device ops
        after each round and at admission (in place, in the static buffers, when compiled)."""
        cur = torch.tensor(self.cur, dtype=torch.int64)
        n = torch.tensor(self.n, dtype=torch.int64)
        live = torch.tensor([not d for d in self.done])
        if self.bufs is None:
            self.cur_d, self.n_d, self.live_d = (self._to_device(t) for t in (cur, n, live))
        else:
            self.cur_d, self.n_d = self._to_device(cur, self.bufs["cur"]), self._to_device(n, self.bufs["n"])
            self.live_d, self.table_d = self._to_device(live, self.bufs["live"]), self.bufs["table"]
        if self.draft is None:
            return None
        k, dcfg = self.k, self.draft.cfg
        vd = 0 if dcfg.greedy_drafts else dcfg.draft_vocab_size
        if self.compile:  # the compiled rounds read and write the proposal at fixed addresses
            homes = self.res.draft_buffers(self.b, k, vd, self.device)
            return tuple(h.zero_() for h in homes)
        return (
            torch.zeros(self.b, k, dtype=torch.int64, device=self.device),
            torch.zeros(self.b, k, vd, dtype=torch.float32, device=self.device),
        )

    # -- the pipelined round loop --
    #
    # Round r + 1 is launched before the host reads round r's tokens: its inputs (current token, position)
    # come from round r's outputs through device ops, and the host copies round r's tokens out through pinned
    # memory while the GPU runs round r + 1. A request that finishes in round r has therefore run one extra,
    # ignored round (unless round r would end every request at full acceptance: `_pending_may_end_all`);
    # its blocks are freed only once that round has completed, and a request admitted into its slot ignores
    # that round's row (`admitted_at`). Host-to-device copies use pinned memory (a pageable copy waits for
    # the stream to drain, which would serialise host and device again).

    def _to_device(self, t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """t on the device: copied into `into` (a static buffer) when given, else a new tensor."""
        if self._async_copies():
            t = t.pin_memory()
            self._keep.append(t)  # alive until the copy has run (cleared after each processed round)
        if into is not None:
            return into.copy_(t, non_blocking=True)
        return t.to(self.device, non_blocking=True)

    def _launch(self, drafts):
        """Queue one round on the device; returns (record, next drafts)."""
        k = self.k
        for b in range(self.b):
            if not self.done[b]:
                # Round r + 1 starts at most K + 1 past the host's view of n and writes up to 2K beyond it.
                self._ensure(b, self.n[b] + 3 * k + 2 if self.draft is not None else self.n[b] + 3)
        bufs = self.bufs or {}
        if self.table_dirty:
            # CUDA copies leave from a snapshot of their own (pinned, or staged); on the CPU the device
            # tensor would be the kept table itself, which later rounds rewrite
            table = self.table_h if self.device.type == "cuda" else self.table_h.clone()
            self.table_d = self._to_device(table, bufs.get("table"))
            self.table_dirty = False
        if self.live_dirty:
            self.live_d = self._to_device(torch.tensor([not d for d in self.done]), bufs.get("live"))
            self.live_dirty = False
        self.stats.target_forwards += 1
        if self.compile and not self.captured:  # torch.compile's graph trees; fspec's own graphs need none
            torch.compiler.cudagraph_mark_step_begin()
        tcfg, state = self.target.cfg, (self.cur_d, self.n_d, self.live_d, self.table_d)
        if self.draft is None:
            args = (self.target.params, *state, self.sampling, self.tcache)
            factory, key = compiled_decode_round, (tcfg, self.bs, self.max_len, self.captured)
        else:
            args = (self.target.params, self.draft.params, *state, *drafts, self.sampling, self.tcache)
            args += (self.dcache,)
            factory, key = compiled_spec_round, (tcfg, self.draft.cfg, self.max_len, self.captured)
        if self.compile:  # the graph writes cur_d, n_d (and the proposal's static homes) in place
            if self.round_fn is None:
                self.round_fn = self.res.graph(factory, *key)
            return self._read_back(self._replay(self.round_fn, args)), drafts
        if self.draft is None:
            options = dict(tcfg=tcfg, block_size=self.bs, max_len=self.max_len, greedy=self.greedy)
            return self._read_back(decode_round(*args, **options)), drafts
        # eagerly the next proposal is a new pair of tensors: nothing is copied into the old one
        tokens, accepted, *drafts = spec_round(*args, tcfg=tcfg, dcfg=self.draft.cfg, max_len=self.max_len)
        return self._read_back(advance(self.cur_d, self.n_d, tokens, accepted)), tuple(drafts)

    def _replay(self, fn, args: tuple):
        """fn(*args) for a compiled round; a captured one gets the run's layout key, computed on the first
        round (every later round passes the same tensors: the static buffers, the kept caches, the draft
        homes), so a round does not flatten and inspect its ~300 argument tensors again."""
        if not self.captured:
            return fn(*args)
        if self.graph_key is None:
            self.graph_key = GraphCapture.layout_key(args)
        return fn(*args, key=self.graph_key)

    def _read_back(self, both: torch.Tensor):
        """Queue the copy of a round's (tokens [B, K + 1], accepted [B]) as one [B, K + 2] tensor to the host;
        returns the round's record (event, host tensor, round index)."""
        home = None
        if self._async_copies():
            # Three pinned homes and events, used in turn: at most two rounds are in flight (the one being
            # processed and the one just launched), and a round's row is copied out (`tolist`) when processed.
            if not self.ring:
                self.ring = [
                    (torch.empty(both.shape, dtype=both.dtype, pin_memory=True), torch.cuda.Event())
                    for _ in range(3)
                ]
            home = self.ring[self.rounds_launched % 3]
        return (*self._to_host(both, home), self.rounds_launched)

    def _async_copies(self) -> bool:
        """Whether copies between host and device go through pinned memory without waiting for the queued
        work (pipelined CUDA), rather than as plain (synchronising) copies."""
        return self.device.type == "cuda" and self.pipeline

    def _to_host(self, t: torch.Tensor, home=None) -> tuple:
        """(event, host tensor): t copied to the host behind the work queued so far without waiting for it,
        into `home` (a pinned tensor and an event, reused) or a new pinned tensor, and the event to wait on
        before reading it; where nothing is copied out (`_async_copies`), (None, t)."""
        if not self._async_copies():
            return None, t
        host, event = home if home is not None else (torch.empty(t.shape, dtype=t.dtype, pin_memory=True),
                                                     torch.cuda.Event())  # fmt: skip
        host.copy_(t, non_blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return event, host

    def _process(self, record) -> None:
        """Read one launched round's tokens (waiting for it) and update the host bookkeeping."""
        event, host, index = record
        if event is not None:
            event.synchronize()
        self._keep.clear()
        self.alloc.free(self.free_at.pop(index, []))  # requests that finished two rounds ago
        rows = host.tolist()
        self.processing = index
        self._emit_firsts()  # before the rows: this round may be a just-admitted request's first
        live = [b for b in range(self.b) if not self.done[b] and index >= self.admitted_at[b]]
        self.stats.record([rows[b][-1] for b in live])
        for b in live:
            acc = rows[b][-1]
            self._emit(b, rows[b][: acc + 1])

    def _pending_may_end_all(self) -> bool:
        """Whether the round being waited for ends every live request if it accepts all its drafts (K + 1
        tokens; 1 when decoding target-only) and no request waits. The next round is then launched only
        after reading it: at the end of a run the pipelined loop would otherwise queue a round that is almost
        surely wasted (a whole target forward and K draft steps: 2% of a 256-token run at full acceptance).
        Costs one host round-trip without overlap when the round falls short."""
        if self.waiting:
            return False
        step = self.k + 1
        return all(
            self.done[b]
            or len(self.out[self.req[b]]) + step >= self.max_new
            or self.n[b] + step + 1 >= self.max_len
            for b in range(self.b)
        )

    def rounds(self) -> Iterator[None]:
        """The run, resumable: yields once the first admitted requests' first tokens are emitted and again
        after each processed round, with every request's `track` (tokens, text, reason) up to date; ends when
        every request has. Closing it early (a stream dropped half-way) still returns every block."""
        self._keep: list[torch.Tensor] = []
        drafts = self._device_state()
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.n_real * self.max_new, desc="fspec generate", unit="tok")
        emitted = 0
        pending = None
        try:
            drafts = self._admit(drafts)
            yield
            while pending is not None or self._live() or self.waiting:
                launched = None
                if self._live() and (pending is None or not self._pending_may_end_all()):
                    launched, drafts = self._launch(drafts)
                    self.rounds_launched += 1
                if not self.pipeline and launched is not None:
                    pending, launched = launched, None  # synchronous: read the round just launched
                processed = pending is not None
                if processed:
                    self._process(pending)
                pending = launched
                self.in_flight = pending is not None
                if self.waiting:
                    drafts = self._admit(drafts, defer=True)
                if bar is not None:
                    now = sum(map(len, self.out))
                    bar.update(max(now - emitted, 0))  # a stop string's cut can shorten an output
                    emitted = max(now, emitted)
                if processed:
                    yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            for blocks in [*self.free_at.values(), *self.blocks]:  # live requests' too, if closed early
                self.alloc.free(blocks)
            self.free_at.clear()
            self.blocks = [[] for _ in range(self.b)]
            self.table_h.fill_(-1)
            if bar is not None:
                bar.close()

    def go(self) -> list[list[int]]:
        """Run to the end; the new tokens per request."""
        for _ in self.rounds():
            pass
        return self.out


def _where_rows(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """new where mask [B] else old, row by row (tensors [B, ...])."""
    return torch.where(mask.view(-1, *[1] * (new.dim() - 1)), new, old)


class Stats:
    """Counters over all request-rounds of a `generate` call."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.request_rounds = 0
        self.emitted = 0
        self.accepted_at = [0] * k  # request-rounds where draft k+1 was accepted
        self.target_forwards = 0
        self.rounds = 0

    def record(self, accepted: list[int]) -> None:
        self.rounds += 1
        for a in accepted:
            self.request_rounds += 1
            self.emitted += a + 1
            for j in range(a):
                self.accepted_at[j] += 1

    def summary(self, new_tokens: int, seconds: float) -> dict[str, Any]:
        n = max(self.request_rounds, 1)
        rates = [c / n for c in self.accepted_at]
        cond = [rates[0]] if rates else []
        cond += [rates[j] / rates[j - 1] if rates[j - 1] > 0 else 0.0 for j in range(1, len(rates))]
        return {
            "acceptance_length": self.emitted / n if self.request_rounds else 1.0,
            "acceptance_rate_per_position": rates,
            "conditional_acceptance_per_position": cond,
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "new_tokens": new_tokens,
            "seconds": seconds,
            "tokens_per_second": new_tokens / seconds if seconds > 0 else float("inf"),
            "num_speculative_steps": self.k,
        }
