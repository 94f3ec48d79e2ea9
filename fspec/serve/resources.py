"""What compiled generation keeps between calls (`Resources`, owned by a `fspec.Generator`): KV caches, static
input buffers, compiled and captured round functions, and the warmed-up plan that bounds their shapes.

CUDA graphs record the addresses of their inputs, so fresh caches and buffers on every call would make every
call record its graphs anew. Three things keep the set of graphs small whatever the prompts:

* one KV-cache pool per (model config, block size, dtype, device), reused by every compiled call and
  replaced by a larger one only when a call needs more blocks than it has (`cache`);
* block tables of a few widths (`fspec.core.cache.table_width`: powers of two of 512 tokens), and never
  narrower than the width `fspec.Generator.warmup` recorded (`min_width`);
* prefill in chunks of a few fixed lengths (`chunk_sizes`), so no graph depends on a prompt's length.
"""

from __future__ import annotations

import dataclasses
import weakref
from functools import partial

import torch

from fspec.compile.graph_capture import GraphCapture
from fspec.core.cache import KVCache, mark_static
from fspec.core.config import size_bucket
from fspec.core.pytree import tree
from fspec.core.sampling_params import SamplingParams
from fspec.models import packed as P
from fspec.serve.rounds import PrefillChunk

# Prefill chunk lengths (tokens per request per chunk call), and the most rows one chunk call runs: a group of
# g requests takes the lengths min(c, CHUNK_ROWS // g) (at least 16), so activations stay bounded at any g.
CHUNK_SIZES = (64, 256, 1024)
CHUNK_ROWS = 4096


def chunk_sizes(group: int) -> tuple[int, ...]:
    """The chunk lengths a prefill of `group` (a batch bucket) requests uses, ascending."""
    return tuple(sorted({max(16, min(c, CHUNK_ROWS // group)) for c in CHUNK_SIZES}))


def pick_chunk(sizes: tuple[int, ...], remaining: int) -> int:
    """The chunk length for a prefill step with at most `remaining` prompt tokens left in any request: the
    shortest that holds them, else the longest."""
    return next((c for c in sizes if c >= remaining), sizes[-1])


class Resources:
    """KV-cache pools, static buffers and compiled functions of one `fspec.Generator`.

    Buffers are bounded to the `max_shapes` most recent shapes of each kind; a cache pool only grows (a larger
    one replaces it). Stale cache contents are harmless: nothing past a request's seq_lens is ever read."""

    def __init__(self, *, max_shapes: int = 4) -> None:
        self.max_shapes = max_shapes
        self.caches: dict[tuple, KVCache] = {}
        self.buffers: dict[tuple, dict] = {}
        self.graphs: dict[tuple, object] = {}
        self.widths: dict[tuple, int] = {}  # (target cfg, block size) -> the narrowest table a call uses
        self.pinned: set[tuple] = set()  # buffers a warm-up made: never evicted (its graphs read them)
        self.pinning = False  # set while `fspec.Generator.warmup` runs
        # "target" / "draft" -> (its packed weights' sources as (weakref, version), the packed params, the
        # id -> packed map): the latest model of each role (`prepacked`)
        self.packs: dict[str, tuple[list, dict, dict]] = {}

    def cache(self, cfg, num_blocks: int, block_size: int, dtype, device, compiled: bool) -> KVCache:
        """A KV cache of at least `num_blocks` blocks: a fresh one of exactly that size eagerly; when
        compiled, the kept pool (static addresses), replaced by a `size_bucket(num_blocks)` one if smaller."""
        if not compiled:
            shape = dict(num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)
            return KVCache.create(cfg, **shape)
        key = (cfg, block_size, dtype, str(device))
        kept = self.caches.get(key)
        if kept is None or kept.num_blocks < num_blocks:
            self.caches.pop(key, None)  # the old pool's memory goes before the new one is made
            kept = KVCache.create(
                cfg, num_blocks=size_bucket(num_blocks), block_size=block_size, dtype=dtype, device=device
            )
            self.caches[key] = mark_static(kept)
        return kept

    def min_width(self, tcfg, block_size: int) -> int:
        """The narrowest block table (blocks) compiled calls of this target use: what `warmup` recorded."""
        return self.widths.get((tcfg, block_size), 1)

    def _kept(self, key: tuple, make) -> dict:
        if key not in self.buffers:
            # max_shapes of each kind besides the warm-up's: the oldest unpinned one of the kind goes
            same = [k for k in self.buffers if k[0] == key[0] and k not in self.pinned]
            if len(same) >= self.max_shapes:
                self.buffers.pop(same[0])
            bufs = make()
            for t in tree.tree_leaves(bufs):
                torch._dynamo.mark_static_address(t)
            self.buffers[key] = bufs
        if self.pinning:
            self.pinned.add(key)
        return self.buffers[key]

    def device_buffers(self, b: int, max_blocks: int, suppress: int, device) -> dict:
        """The compiled rounds' per-request inputs (current token, position, live flag, block table, sampling
        settings with `suppress` stop ids per request) in buffers with static addresses: a CUDA graph reads
        them where they lie instead of copying each one in before every replay (six launches per
        target-only token on the H200), and the target-only round writes the current token and position
        back in place."""
        return self._kept(
            ("rounds", b, max_blocks, suppress, str(device)),
            lambda: {
                "cur": torch.zeros(b, dtype=torch.int64, device=device),
                "n": torch.zeros(b, dtype=torch.int64, device=device),
                "live": torch.zeros(b, dtype=torch.bool, device=device),
                "table": torch.full((b, max_blocks), -1, dtype=torch.int32, device=device),
                "sampling": _sampling_buffers(b, suppress, device),
            },
        )

    def draft_buffers(self, b: int, k: int, vd: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Static homes for a round's proposal (draft_tokens [b, k], draft_probs [b, k, vd]): a captured round
        reads its inputs where they lay when it was captured, so each round's proposal is copied here."""
        bufs = self._kept(
            ("drafts", b, k, vd, str(device)),
            lambda: {
                "tokens": torch.zeros(b, k, dtype=torch.int64, device=device),
                "probs": torch.zeros(b, k, vd, dtype=torch.float32, device=device),
            },
        )
        return bufs["tokens"], bufs["probs"]

    def chunk_buffers(self, g: int, c: int, max_blocks: int, suppress: int, device) -> dict:
        """Static inputs of a captured prefill chunk (`captured_prefill_chunk`): g requests, c tokens each."""
        return self._kept(
            ("chunk", g, c, max_blocks, suppress, str(device)),
            lambda: {
                "ids": torch.zeros(g, c, dtype=torch.int64, device=device),
                "counts": torch.zeros(g, dtype=torch.int64, device=device),
                "live": torch.zeros(g, dtype=torch.bool, device=device),
                "table": torch.full((g, max_blocks), -1, dtype=torch.int32, device=device),
                "sampling": _sampling_buffers(g, suppress, device),
                "chunk": PrefillChunk(
                    starts=torch.zeros(g, dtype=torch.int64, device=device),
                    lookahead=torch.zeros(g, dtype=torch.int64, device=device),
                    final=torch.zeros(g, dtype=torch.bool, device=device),
                ),
            },
        )

    def graph(self, factory, *key):
        """`factory(*key)` (a compiled or captured round function), made once per key and kept."""
        k = (factory, *key)
        if k not in self.graphs:
            self.graphs[k] = factory(*key)
        return self.graphs[k]

    def prepacked(self, target, draft, *, target_rows: int):
        """(target, draft) with their linear weights packed for oneDNN (`fspec.models.packed`), for eager
        float32 calls on the CPU; a model with nothing to pack comes back as it is, and so does the target
        when its steps run one row (target_rows < 2: target-only decoding of one request), where MKL's
        one-row product is as fast (38.6 vs 41.6 ms over SmolLM2's weights; results/cpu_packed.json). The
        packed copy of each role's latest model is kept and made again only when a weight changed: another
        tensor in the tree, or the same one written in place (its version counter moved, as an optimizer
        step moves it). It goes when the model does (one of its packed weights is freed) or with `clear()`."""
        memo: dict = {}
        if target_rows >= 2:
            target = self._packed(target, "target", tied_head=True, memo={})
            if "target" in self.packs:  # fresh: made or checked just now
                memo = dict(self.packs["target"][2])
        if draft is not None:  # a head holding the target's tensors packs them once
            draft = self._packed(draft, "draft", tied_head=False, memo=memo)
        return target, draft

    def _packed(self, model, role: str, *, tied_head: bool, memo: dict):
        now = P.sources(model.params, tied_head=tied_head)
        if not now or not P.supported():
            self.packs.pop(role, None)
            return model
        kept = self.packs.get(role)
        fresh = kept is not None and len(kept[0]) == len(now)
        fresh = fresh and all(r() is t and v == t._version for (r, v), t in zip(kept[0], now, strict=True))
        if not fresh:
            self.packs.pop(role, None)  # the old copy's memory goes before the new one is made
            params = P.pack_params(model.params, memo, tied_head=tied_head)
            kept = (
                [(weakref.ref(t, partial(_drop_pack, self.packs, role)), t._version) for t in now],
                params,
                memo,
            )
            self.packs[role] = kept
        return dataclasses.replace(model, params=kept[1])

    @property
    def recorded_graphs(self) -> int:
        """CUDA graphs captured so far by the kept functions (`GraphCapture.captures`)."""
        return sum(g.captures for g in self.graphs.values() if isinstance(g, GraphCapture))


def _drop_pack(packs: dict, role: str, ref: weakref.ref) -> None:
    """A packed copy goes when one of its sources does (the caller dropped the model): nothing can use it."""
    entry = packs.get(role)
    if entry is not None and any(r is ref for r, _ in entry[0]):
        del packs[role]


def _sampling_buffers(b: int, suppress: int, device) -> SamplingParams:
    ids = [-1] * suppress if suppress else None
    return SamplingParams.create(b, suppress_ids=ids, device=device)
