"""One batch of `fspec.generate`: host bookkeeping between rounds; each round's device work is one call.

The host side (`Run`) holds what legitimately changes between rounds and is cheap on the host: each
request's emitted tokens, its position, its blocks. A round's device work is one pure function
(`fspec.serve.rounds.spec_round` / `decode_step`), one CUDA graph when compiled; the host reads the round's
tokens once (one sync per round) and updates the device copies of (current token, position, live) with device
ops. The block table goes to the device only when a request crosses into a new block or finishes. What
compiled runs keep between calls (caches, static buffers, compiled rounds) is a `Resources` of the
`fspec.Generator` that runs them. The `Generator` (and its `GenerateResult`) is defined here, beside the `Run`
it drives, and so is the default one (`default_generator()`), which a `Run` given no resources uses:
fspec/serve/engine.py (`fspec.generate`) builds on this module, never the other way round.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fspec.compile.graph_capture import GraphCapture
from fspec.core.cache import BlockAllocator, KVCache, mark_static, table_width
from fspec.core.config import bucket_for, size_bucket
from fspec.core.pytree import tree
from fspec.core.sampling_params import SamplingParams
from fspec.draft import _step
from fspec.models.checkpoint import Draft, Target
from fspec.models.generation_config import sampling_defaults
from fspec.serve.prefill import _validate, max_model_len, prefill_batch
from fspec.serve.rounds import (
    compiled_decode_round,
    compiled_later_drafts,
    compiled_prefill_round,
    compiled_spec_round,
    decode_step,
    run_drafts,
    spec_round,
)
from fspec.serve.stops import StopConfig, StopTracker, stop_config
from fspec.serve.stream import StreamChunk, stream_chunks

# Blocks allocated ahead of need, so the block table (a host-to-device copy) changes every few rounds, not
# every round a request crosses a block boundary.
_LOOKAHEAD = 4


class Resources:
    """What compiled generation keeps between calls, owned by a `fspec.Generator`: KV caches, the rounds'
    static input buffers and the compiled round functions.

    CUDA graphs record the addresses of their static inputs, so fresh caches and buffers on every call would
    make every call record its graphs anew; a compiled function per config keeps its graphs. Caches and
    buffers are bounded to the `max_shapes` most recent shapes each. Stale cache contents are harmless:
    nothing past a request's seq_lens is ever read."""

    def __init__(self, *, max_shapes: int = 4) -> None:
        self.max_shapes = max_shapes
        self.caches: dict[tuple, KVCache] = {}
        self.buffers: dict[tuple, dict[str, torch.Tensor]] = {}
        self.graphs: dict[tuple, object] = {}

    def cache(self, cfg, num_blocks: int, block_size: int, dtype, device, compiled: bool) -> KVCache:
        """A KV cache of this shape: a fresh one eagerly, the kept one (static addresses) when compiled."""
        shape = dict(num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)
        if not compiled:
            return KVCache.create(cfg, **shape)
        key = (cfg, num_blocks, block_size, dtype, str(device))
        if key not in self.caches:
            if len(self.caches) >= self.max_shapes:  # keep the most recent shapes only
                self.caches.pop(next(iter(self.caches)))
            self.caches[key] = mark_static(KVCache.create(cfg, **shape))
        return self.caches[key]

    def device_buffers(self, b: int, max_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The compiled rounds' per-request inputs (current token, position, live flag, block table, sampling
        settings) in buffers with static addresses: a CUDA graph reads them where they lie instead
        of copying each one in before every replay (six launches per target-only token on the H200), and the
        target-only round writes the current token and position back in place."""
        key = (b, max_blocks, str(device))
        if key not in self.buffers:
            if len(self.buffers) >= self.max_shapes:
                self.buffers.pop(next(iter(self.buffers)))
            bufs = {
                "cur": torch.zeros(b, dtype=torch.int64, device=device),
                "n": torch.zeros(b, dtype=torch.int64, device=device),
                "live": torch.zeros(b, dtype=torch.bool, device=device),
                "table": torch.full((b, max_blocks), -1, dtype=torch.int32, device=device),
                "sampling": SamplingParams.create(b, device=device),
            }
            for t in tree.tree_leaves(bufs):
                torch._dynamo.mark_static_address(t)
            self.buffers[key] = bufs
        return self.buffers[key]

    def draft_buffers(self, b: int, k: int, vd: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Static homes for a round's proposal (draft_tokens [b, k], draft_probs [b, k, vd]): a captured round
        (`compiled_spec_round(captured=True)`) reads its inputs where they lay when it was captured, so each
        round's proposal is copied here rather than cloned to a new address."""
        key = ("drafts", b, k, vd, str(device))
        if key not in self.buffers:
            if len(self.buffers) >= self.max_shapes:
                self.buffers.pop(next(iter(self.buffers)))
            self.buffers[key] = {
                "tokens": torch.zeros(b, k, dtype=torch.int64, device=device),
                "probs": torch.zeros(b, k, vd, dtype=torch.float32, device=device),
            }
        bufs = self.buffers[key]
        return bufs["tokens"], bufs["probs"]

    def graph(self, factory, *key):
        """`factory(*key)` (a compiled round function), made once per key and kept."""
        k = (factory, *key)
        if k not in self.graphs:
            self.graphs[k] = factory(*key)
        return self.graphs[k]


def compile_prefill(device: torch.device) -> bool:
    """Whether a compiled `generate` runs its prefill as a graph too (`compiled_prefill_round`).

    On CUDA by default: the eager prefill and first proposal cost ~39 ms per call at 1B shapes on the H200,
    launch overhead that one graph replay removes. Not on CPU, where there is no launch overhead to save and
    each prompt-length bucket would cost a compile."""
    return device.type == "cuda"


class Run:
    """Generation for up to 256 requests, padded to their batch bucket.

    stops: the call's `fspec.serve.stops.StopConfig` (default: the target's EOS ids only). detokenize: build
    each request's text as it grows (`StopTracker.text`; always when there are stop strings): a stream reads
    it between rounds (`rounds()`)."""

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
        resources=None,
        stops: StopConfig | None = None,
        detokenize: bool = False,
    ):
        # what compiled calls keep between calls: a `fspec.Generator`'s (the default one's unless given)
        self.res = default_generator().resources if resources is None else resources
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
        # Every request's worst case fits; blocks are still allocated as requests grow and freed as they end.
        # The worst case is what `_ensure` can hand out: `_launch` asks for n + 3K + 2 tokens while the
        # request is live (n <= prompt + max_new_tokens - 2), plus _LOOKAHEAD blocks, capped at the table.
        # (Capping the tokens at max_len before adding the look-ahead under-counted: one prompt of 1 token,
        # max_new_tokens=15, K=3 ran out of blocks; tests/test_fuzz.py found it.)
        full = -(-self.max_len // self.bs)  # what max_model_len allows
        worst = [
            min(-(-(len(p) + max_new_tokens + 3 * self.k + 2) // self.bs) + _LOOKAHEAD, full)
            for p in self.prompts
        ]
        # The block table is as wide as this call can need (`table_width`), not max_model_len: attention
        # reads the whole table where it cannot read lengths (compiled code, the kernels' launch grid).
        self.max_blocks = table_width(max(worst) * self.bs, block_size=self.bs, max_blocks=full)
        self.n_real = len(prompts)
        self.b = bucket_for(self.n_real)
        self.device = target.params["embed"].device
        pad = self.b - self.n_real
        temps = options["temperature"]
        self.stops = stop_config(target, max_new_tokens=max_new_tokens) if stops is None else stops
        host = SamplingParams.create(self.n_real, **options, **self._suppression()).pad(pad)
        self.bufs = self.res.device_buffers(self.b, self.max_blocks, self.device) if compile else None
        # Compiled rounds on CUDA replay fspec's own graphs (`GraphCapture`): a round's host cost is one
        # replay, not dynamo's guards over ~300 argument tensors and the graph tree's bookkeeping.
        self.captured = compile and self.device.type == "cuda"
        self.graph_key = None  # the rounds' argument layout, the same every round of a run (`_launch`)
        if self.bufs is not None:  # static buffers: written in place, read by the graphs where they lie
            self.sampling = host.copy_into(self.bufs["sampling"])
        else:
            self.sampling = tree.tree_map(lambda t: t.to(self.device), host)
        # A greedy batch run eagerly off CUDA takes its tokens by argmax (`fspec.serve.rounds.sample_tokens`:
        # the same tokens, without the CPU reference sampler's noise); compiled rounds keep one graph for all.
        self.greedy = not compile and self.device.type != "cuda" and all(t == 0 for t in temps)
        detokenize = detokenize or bool(self.stops.stop)
        tok = target.tokenizer
        self.track = [StopTracker(self.stops, tok, detokenize=detokenize) for _ in range(self.n_real)]
        self.out: list[list[int]] = [t.tokens for t in self.track]  # the trackers' own lists
        self.done = [False] * self.n_real + [True] * pad
        self.n = [len(p) for p in self.prompts] + [0] * pad  # position of each request's current token
        self.cur = [0] * self.b  # the current token (emitted, not yet in the target cache)
        self.blocks: list[list[int]] = [[] for _ in range(self.b)]
        need = sum(worst)
        self.table_dirty = True
        self.free_at: dict[int, list[int]] = {}  # round index -> blocks to free once that round is processed
        self.processing = -1
        self.alloc = BlockAllocator(need)  # hands out what the requests can use; the cache may hold more
        blocks = size_bucket(need) if compile else need  # nearby sizes share graphs
        tdtype = target.params["embed"].dtype
        self.tcache = self.res.cache(target.cfg, blocks, self.bs, tdtype, self.device, compile)
        self.dcache = None
        if draft is not None:
            dtype = draft.params["embed"].dtype
            self.dcache = self.res.cache(draft.cfg.model, blocks, self.bs, dtype, self.device, compile)
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
        if want > len(self.blocks[b]):
            want = min(want + _LOOKAHEAD, self.max_blocks)
            self.blocks[b] += self.alloc.allocate(want - len(self.blocks[b]))
            self.table_dirty = True

    def _table_host(self) -> torch.Tensor:
        table = torch.full((self.b, self.max_blocks), -1, dtype=torch.int32)
        for b, blocks in enumerate(self.blocks):
            if blocks:
                table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table

    def _table(self) -> torch.Tensor:
        return self._table_host().to(self.device)

    def _emit(self, b: int, new: list[int], *, first: bool = False) -> None:
        """Append new tokens to request b and make the last one its current token.

        The current token sits at position n; new tokens take positions n + 1, ... (the prefill's first token
        takes n itself). A sequence holds at most max_model_len tokens: tokens past it are dropped, exactly
        as target-only decoding would never produce them. The request ends at a stop condition
        (`StopTracker.add`: stop string, stop token id, EOS; the first token of the round that meets one), at
        max_new_tokens, or when its sequence is full.
        """
        if not first:
            new = new[: self.max_len - 1 - self.n[b]]
        track = self.track[b]
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
        self.track[b].end()
        self.done[b] = True
        # The round launched after the one being processed may still use these blocks: free them once it
        # has been processed (`_process` frees `free_at[index]` after waiting for round `index`).
        self.free_at.setdefault(self.processing + 1, []).extend(self.blocks[b])
        self.blocks[b] = []
        self.table_dirty = self.live_dirty = True

    # -- device work --

    def _device_state(self) -> None:
        """Device copies of (current token, position, live); updated by device ops after each round (in place,
        in the static buffers, when compiled)."""
        cur = torch.tensor(self.cur, dtype=torch.int64)
        n = torch.tensor(self.n, dtype=torch.int64)
        live = torch.tensor([not d for d in self.done])
        if self.bufs is None:
            self.cur_d, self.n_d, self.live_d = cur.to(self.device), n.to(self.device), live.to(self.device)
            return
        self.cur_d, self.n_d = self.bufs["cur"].copy_(cur), self.bufs["n"].copy_(n)
        self.live_d, self.table_d = self.bufs["live"].copy_(live), self.bufs["table"]

    def _prefill(self):
        """Target prefill of the ragged prompts, the first token, and the head's prefill + first proposal."""
        lens = list(self.n)
        q = max(lens)
        for b in range(self.n_real):
            self._ensure(b, lens[b] + 2 * self.k + 1)
        whole = self.compile and compile_prefill(self.device)
        ids = torch.zeros(self.b, size_bucket(q) if whole else q, dtype=torch.int64)
        for b, p in enumerate(self.prompts):
            ids[b, : len(p)] = torch.tensor(p)
        self.stats.target_forwards += 1
        live = [not d for d in self.done]
        drafts = None
        if whole:  # one graph per batch and prompt-length bucket: prefill, first token, K drafts
            torch.compiler.cudagraph_mark_step_begin()
            dcfg = self.draft.cfg if self.draft is not None else None
            out = self.res.graph(compiled_prefill_round, self.target.cfg, dcfg, self.bs)(
                self.target.params,
                self.draft.params if self.draft is not None else None,
                ids.to(self.device),
                torch.tensor(lens, dtype=torch.int64, device=self.device),
                torch.tensor(live, device=self.device),
                self._table(),
                self.sampling,
                self.tcache,
                self.dcache,
            )
            first = out[0]
            if self.draft is not None:
                drafts = (out[1].clone(), out[2].clone())  # graph outputs: the next replay overwrites them
        else:
            first, _, state = prefill_batch(
                self.target,
                self.draft,
                ids.to(self.device),
                lens,
                live,
                self._table(),
                self.sampling,
                self.tcache,
                block_size=self.bs,
                greedy=self.greedy,
            )
            if state is not None and self.compile and self.k > 1:
                # The first step is shaped by the prompts (eager); steps 2..K are not: one graph per bucket.
                dp, dcfg = self.draft.params, self.draft.cfg
                state, _ = _step(dp, state, self.dcache, cfg=dcfg, backend="auto", max_context=None)
                d_tok, d_prob = self.res.graph(compiled_later_drafts, dcfg)(dp, state, self.dcache)
                drafts = (d_tok.clone(), d_prob.clone())  # graph outputs: the next replay overwrites them
            elif state is not None:
                drafts = run_drafts(self.draft.params, state, self.dcache, cfg=self.draft.cfg)
        first_list = first.tolist()
        for b in range(self.n_real):
            self._emit(b, [first_list[b]], first=True)  # at position n, the prompt length
        return drafts

    # -- the pipelined round loop --
    #
    # Round r + 1 is launched before the host reads round r's tokens: its inputs (current token, position)
    # come from round r's outputs through device ops, and the host copies round r's tokens out through pinned
    # memory while the GPU runs round r + 1. A request that finishes in round r has therefore run one extra,
    # ignored round (unless round r would end every request at full acceptance: `_pending_may_end_all`);
    # its blocks are freed only once that round has completed. Host-to-device copies use pinned
    # memory (a pageable copy waits for the stream to drain, which would serialise host and device again).

    def _to_device(self, t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """t on the device: copied into `into` (a static buffer) when given, else a new tensor."""
        if self.device.type == "cuda" and self.pipeline:
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
            self.table_d = self._to_device(self._table_host(), bufs.get("table"))
            self.table_dirty = False
        if self.live_dirty:
            self.live_d = self._to_device(torch.tensor([not d for d in self.done]), bufs.get("live"))
            self.live_dirty = False
        self.stats.target_forwards += 1
        if self.compile:
            torch.compiler.cudagraph_mark_step_begin()
        if self.draft is not None:
            args = (
                self.target.params,
                self.draft.params,
                self.cur_d,
                self.n_d,
                self.live_d,
                self.table_d,
                *drafts,
                self.sampling,
                self.tcache,
                self.dcache,
            )
            if self.compile:
                fn = self.res.graph(
                    compiled_spec_round, self.target.cfg, self.draft.cfg, self.max_len, self.captured
                )
                tokens, accepted, d_tok, d_prob = self._replay(fn, args)
                # The next replay overwrites this one's outputs, and the drafts are its inputs: copy them
                # (to their static homes when captured: the next replay reads them there).
                if self.captured:
                    drafts = tuple(home.copy_(d) for home, d in zip(drafts, (d_tok, d_prob)))
                else:
                    drafts = (d_tok.clone(), d_prob.clone())
            else:
                tokens, accepted, d_tok, d_prob = spec_round(
                    *args, tcfg=self.target.cfg, dcfg=self.draft.cfg, max_len=self.max_len
                )
                drafts = (d_tok, d_prob)
        else:
            args = (
                self.target.params,
                self.cur_d,
                self.n_d,
                self.live_d,
                self.table_d,
                self.sampling,
                self.tcache,
            )
            if self.compile:  # the graph advances cur_d and n_d in place and returns (token, 0)
                graph = self.res.graph(
                    compiled_decode_round, self.target.cfg, self.bs, self.max_len, self.captured
                )
                both = self._replay(graph, args)
                return self._read_back(both), drafts
            new = decode_step(
                *args, tcfg=self.target.cfg, block_size=self.bs, max_len=self.max_len, greedy=self.greedy
            )
            tokens, accepted = new[:, None], torch.zeros_like(new)
        if self.bufs is not None:  # static buffers: advanced in place
            self.n_d.add_(accepted + 1)
            self.cur_d.copy_(tokens.gather(1, accepted[:, None]).squeeze(1))
        else:
            self.n_d = self.n_d + accepted + 1
            self.cur_d = tokens.gather(1, accepted[:, None]).squeeze(1)
        return self._read_back(torch.cat([tokens, accepted[:, None]], 1)), drafts

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
        if self.device.type == "cuda" and self.pipeline:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = both, None
        return event, host, self.rounds_launched

    def _process(self, record) -> None:
        """Read one launched round's tokens (waiting for it) and update the host bookkeeping."""
        event, host, index = record
        if event is not None:
            event.synchronize()
        self._keep.clear()
        self.alloc.free(self.free_at.pop(index, []))  # requests that finished two rounds ago
        rows = host.tolist()
        live = [b for b in range(self.n_real) if not self.done[b]]
        self.stats.record([rows[b][-1] for b in live])
        self.processing = index
        for b in live:
            acc = rows[b][-1]
            self._emit(b, rows[b][: acc + 1])

    def _pending_may_end_all(self) -> bool:
        """Whether the round being waited for ends every live request if it accepts all its drafts (K + 1
        tokens; 1 when decoding target-only). The next round is then launched only after reading it: at the
        end of a run the pipelined loop would otherwise queue a round that is almost surely wasted (a whole
        target forward and K draft steps: 2% of a 256-token run at full acceptance). Costs one host
        round-trip without overlap when the round falls short."""
        step = self.k + 1
        return all(
            self.done[b] or len(self.out[b]) + step >= self.max_new or self.n[b] + step + 1 >= self.max_len
            for b in range(self.n_real)
        )

    def rounds(self) -> Iterator[None]:
        """The run, resumable: yields once the prefill's first tokens are emitted and again after each
        processed round, with every request's `track` (tokens, text, reason) up to date; ends when every
        request has. Closing it early (a stream dropped half-way) still returns every block."""
        drafts = self._prefill()
        if drafts is not None and self.captured:  # the captured rounds read the proposal at fixed addresses
            homes = self.res.draft_buffers(self.b, *drafts[1].shape[1:], self.device)
            drafts = tuple(home.copy_(d) for home, d in zip(homes, drafts))
        self._device_state()
        self._keep: list[torch.Tensor] = []
        self.rounds_launched = 0
        self.table_dirty = self.live_dirty = True
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.n_real * self.max_new, desc="fspec generate", unit="tok")
        emitted = sum(map(len, self.out))
        pending = None
        try:
            yield
            while pending is not None or not all(self.done):
                launched = None
                if not all(self.done) and (pending is None or not self._pending_may_end_all()):
                    launched, drafts = self._launch(drafts)
                    self.rounds_launched += 1
                if not self.pipeline and launched is not None:
                    pending, launched = launched, None  # synchronous: read the round just launched
                processed = pending is not None
                if processed:
                    self._process(pending)
                pending = launched
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
            if bar is not None:
                bar.close()

    def go(self) -> list[list[int]]:
        """Run to the end; the new tokens per request."""
        for _ in self.rounds():
            pass
        return self.out


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


@dataclasses.dataclass
class GenerateResult:
    """What `generate` returns.

    Attributes:
        tokens: new tokens per prompt (the EOS or stop token id included when one ended the request; cut
            like the text at a stop string: the tokens whose text ends at or before the match start).
        text: the decoded new tokens per prompt, or None when the target has no tokenizer; cut exactly
            before a stop string that ended the request (`fspec.serve.stops`).
        finish_reason: why each request ended: "stop" (a stop string or a stop token id), "eos", or
            "length" (max_new_tokens, or the sequence reached max_model_len).
        stats: acceptance_length (mean tokens per target verification forward), acceptance_rate_per_position
            (P(draft k accepted) over request-rounds, k = 1..K), conditional_acceptance_per_position
            (P(draft k accepted | draft k-1 accepted)), target_forwards, rounds, new_tokens, seconds,
            tokens_per_second, num_speculative_steps.
    """

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict[str, Any]
    finish_reason: list[str]


class Generator:
    """What `generate` keeps between calls, in one object the caller holds: KV caches and the rounds' static
    input buffers (compiled CUDA graphs record their addresses) and the compiled round functions, so that
    warm compiled calls replay their graphs instead of recording them anew.

    `fspec.generate(...)` is `fspec.default_generator().generate(...)`. A `Generator()` of one's own keeps its
    graphs and buffers apart from the default's (for example one per model in a notebook) and frees them with
    `clear()` or when dropped. Nothing else in fspec keeps state between calls.

    max_shapes: how many KV-cache shapes and buffer shapes it keeps (the most recent ones)."""

    def __init__(self, *, max_shapes: int = 4) -> None:
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes: expected an int >= 1, got {max_shapes!r}")
        self.resources = Resources(max_shapes=max_shapes)

    def clear(self) -> None:
        """Drop every kept cache, buffer and compiled function (their memory goes back on the next
        collection; torch's own compile caches are torch's)."""
        self.resources = Resources(max_shapes=self.resources.max_shapes)

    def generate(
        self,
        target: Target,
        draft: Draft | None,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float | Sequence[float] | None = None,
        seed: int | Sequence[int] = 0,
        top_k: int | Sequence[int] | None = None,
        top_p: float | Sequence[float] | None = None,
        min_p: float | Sequence[float] | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        min_new_tokens: int = 0,
        num_speculative_steps: int | None = None,
        compile: bool = False,
        progress: bool = False,
    ) -> GenerateResult:
        """`fspec.generate` with this generator's caches, buffers and compiled rounds."""
        options = _sampling_options(target, temperature, seed, top_k, top_p, min_p)
        ids, options, k, draft = _validate(
            target, draft, prompts, max_new_tokens, options, num_speculative_steps, compile, progress
        )
        stops = stop_config(
            target,
            max_new_tokens=max_new_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            eos_token_id=eos_token_id,
            min_new_tokens=min_new_tokens,
        )
        start = time.perf_counter()
        tracks: list[StopTracker] = []
        stats = Stats(k if draft is not None else 0)
        for lo in range(0, len(ids), 256):  # the largest batch bucket
            run = Run(
                target,
                draft,
                ids[lo : lo + 256],
                {name: values[lo : lo + 256] for name, values in options.items()},
                max_new_tokens=max_new_tokens,
                compile=compile,
                stats=stats,
                progress=progress,
                resources=self.resources,
                stops=stops,
            )
            run.go()
            tracks.extend(run.track)
        seconds = time.perf_counter() - start
        tokens = [t.tokens for t in tracks]
        text = None
        if target.tokenizer is not None:  # built as the requests grew when there are stop strings
            text = [target.tokenizer.decode(t.tokens) if t.text is None else t.text.text for t in tracks]
        return GenerateResult(
            tokens=tokens,
            text=text,
            stats=stats.summary(sum(map(len, tokens)), seconds),
            finish_reason=[t.reason for t in tracks],
        )

    def stream(
        self,
        target: Target,
        draft: Draft | None,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float | None = None,
        seed: int = 0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        min_new_tokens: int = 0,
        num_speculative_steps: int | None = None,
        compile: bool = False,
        progress: bool = False,
    ) -> Iterator[StreamChunk]:
        """`fspec.stream` with this generator's caches, buffers and compiled rounds. The arguments are checked
        here, before the first chunk is asked for."""
        if not isinstance(prompt, str) and isinstance(prompt, Sequence) and prompt:
            if all(isinstance(p, (str, Sequence)) for p in prompt):
                raise ValueError(
                    "prompt: expected one prompt (a string or a list of token ids), "
                    f"got a list of {len(prompt)} prompts"
                )
        options = _sampling_options(target, temperature, seed, top_k, top_p, min_p)
        ids, options, k, draft = _validate(
            target, draft, [prompt], max_new_tokens, options, num_speculative_steps, compile, progress
        )
        stops = stop_config(
            target,
            max_new_tokens=max_new_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            eos_token_id=eos_token_id,
            min_new_tokens=min_new_tokens,
        )
        run = Run(
            target,
            draft,
            ids,
            options,
            max_new_tokens=max_new_tokens,
            compile=compile,
            stats=Stats(k if draft is not None else 0),
            progress=progress,
            resources=self.resources,
            stops=stops,
            detokenize=True,
        )
        return stream_chunks(run)


def _sampling_options(target, temperature, seed, top_k, top_p, min_p) -> dict:
    """The call's sampling options, each given one or, when None, the checkpoint's generation_config.json
    default (`sampling_defaults`: greedy unless it says do_sample)."""
    defaults = sampling_defaults(target)
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return {name: defaults[name] if v is None else v for name, v in given.items()} | {"seed": seed}


_DEFAULT = Generator()  # the one instance `generate` uses; `default_generator()` hands it out


def default_generator() -> Generator:
    """The `Generator` behind `fspec.generate`: hold it to reach (or `clear()`) what the calls kept."""
    return _DEFAULT
