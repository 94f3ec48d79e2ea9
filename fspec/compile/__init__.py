"""Every `torch.compile` call of fspec, in one place.

Two ways to run the draft loop as CUDA graphs (docs/compile-facts.md records why these two and not the obvious
`state = compiled_step(state)`, which raises "accessing tensor output of CUDAGraphs that has been overwritten"
on its second call):

* `compile_propose` (the primary path): the whole K-step loop is one function, compiled with
  `mode="reduce-overhead", fullgraph=True`, so the K intermediate states never leave the graph. One graph per
  batch bucket: callers pad with `pad_to_bucket` (padding rows: positions and slots -1).
* `compile_step` (to compare): one step compiled, replayed K times; the draft buffers are allocated once per
  bucket, given static addresses and written in place (donated), and the small outputs (tokens, hidden,
  metadata, step) are copied out after each replay, before the next replay overwrites them.

The KV cache is written inside the graph: its buffers get static addresses (`fspec.core.cache.mark_static`),
or the graph would be skipped for "mutated inputs". Parameters are `nn.Parameter`s, static by construction.

`compile_propose(mode="cuda-graph")` compiles the same function in Inductor's default mode and captures it
into CUDA graphs of fspec's own (`fspec.compile.graph_capture.GraphCapture`): a call is the input copy and one
`replay()`, without dynamo's guards and the CUDA-graph tree's bookkeeping (hundreds of µs of host time a
call, more than a short draft loop's GPU time).

A CUDA graph reads its inputs at fixed addresses, so every call copies the state's tensors there. PyTorch's
CUDA-graph trees do it per tensor (`torch._foreach_copy_` over mixed dtypes falls back to one copy each): nine
launches of ~1 µs for a draft state, plus nine host calls. `compile_propose` keeps its own static-address
copies of the leaves `propose` reads (`StagedInputs`) and refreshes them with one `_foreach_copy_` over byte
views (one dtype, so one multi-tensor kernel); the graph then reads them in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fspec.compile import inductor_pdl
from fspec.compile.graph_capture import GraphCapture
from fspec.core.cache import KVCache, mark_static
from fspec.core.config import BATCH_BUCKETS, DraftConfig, bucket_for
from fspec.core.pytree import replace, tree
from fspec.core.state import AttnMetadata, DraftState
from fspec.draft import _step, propose

# Nine batch buckets, each one graph, for several configs (a generate round and a decode step, greedy and
# sampled drafts, the per-step path's two shapes): dynamo's default limit of 8 recompiles per code object
# would silently fall back to eager.
_RECOMPILE_LIMIT = 8 * len(BATCH_BUCKETS)

# torch.compile's modes, and fspec's own: Inductor's default mode captured by `GraphCapture`
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "cuda-graph")


def _check_mode(mode: str | None, allowed: tuple = MODES) -> None:
    if mode not in allowed:
        raise ValueError(f"mode: expected one of {allowed}, got {mode!r}")


def jit(fn: Callable, mode: str | None = "reduce-overhead") -> Callable:
    """`torch.compile(fn, fullgraph=True, dynamic=False)` in `mode`: every fspec graph goes through here.
    `mode="cuda-graph"` compiles in Inductor's default mode (the caller captures the graphs: `GraphCapture`).

    On CUDA, in reduce-overhead and cuda-graph mode, the compile carries `inductor_options` and every call of
    the compiled function runs inside `fspec.compile.inductor_pdl.always_wait()` (where Inductor lowers:
    compiles are lazy), so Inductor's PDL kernels wait as fspec's do, and nothing of it outlives the call."""
    _check_mode(mode)
    _configure_dynamo()
    options = inductor_options(mode)
    if not options:
        return torch.compile(fn, mode=None if mode == "cuda-graph" else mode, fullgraph=True, dynamic=False)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with inductor_pdl.always_wait():
            return compiled(*args, **kwargs)

    call.compiled = compiled  # the torch.compile object itself
    return call


def inductor_options(mode: str | None, *, cuda: bool | None = None) -> dict | None:
    """Inductor options that replace `mode` in `jit`, or None for the plain mode: only for reduce-overhead
    and cuda-graph (fspec's own capture: Inductor's CUDA graphs stay off) on CUDA, and where this torch has
    the hook fspec/compile/inductor_pdl.py patches. Inductor's programmatic dependent launch (its kernels
    chain with fspec's; `jit` makes each of them wait: fspec/compile/inductor_pdl.py says why), with the FX
    graph caches off for these compiles: the wait is not part of Inductor's cache keys, so a graph cached
    without it must not come back. (Coordinate-descent tuning and max-autotune were measured and left out:
    docs/experiments.md.)"""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if mode not in ("reduce-overhead", "cuda-graph") or not cuda or not inductor_pdl.available():
        return None
    return {
        "triton.cudagraphs": mode == "reduce-overhead",
        "triton.enable_pdl": True,
        "fx_graph_cache": False,
        "fx_graph_remote_cache": False,
    }


def _configure_dynamo() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < _RECOMPILE_LIMIT:
            setattr(config, name, _RECOMPILE_LIMIT)


# the state fields `propose` reads, each a tensor or a pytree of them (`step` and the draft buffers are
# replaced before anything reads them)
_PROPOSE_READS = ("input_ids", "hidden", "sampling", "attn")
_PROPOSE_SKIPS = ("step", "draft_tokens", "draft_probs")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a uint8 view (one call for the usual unit-stride leaf; a copy for any other)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous().reshape(-1)
    return t.view(torch.uint8)


class StagedInputs:
    """Static-address copies of the state leaves a compiled rollout reads, refreshed by one launch per call.

    `stage(state)` returns `state` with those leaves replaced by the copies (allocated once per set of leaf
    shapes and dtypes, marked static so the CUDA graph reads them where they lie); `restore(out, staged,
    state)` puts the caller's own tensors back wherever `out` passes a copy through (the sampling settings,
    the block table), so a result holds no tensor the next call overwrites beyond the graph's own.
    """

    def __init__(self, *, placeholders: bool = False) -> None:
        # per leaf shapes and dtypes: the copies' byte views and the staged state (without placeholders its
        # unread leaves are the caller's: only its staged leaves are kept, as a state to `replace` from)
        self._slots: dict[tuple, tuple[list[torch.Tensor], DraftState]] = {}
        # placeholders=True: the leaves `propose` never reads (step, draft buffers) are replaced by tensors
        # of their shape allocated once and never written, so that every leaf of a staged state keeps its
        # address across calls (what `GraphCapture` keys its graphs on) and the staged state is one object
        self._placeholders = placeholders
        # restore plans of results that are kept objects (a captured graph's output), by id
        self._plans: dict[int, tuple[DraftState, list[tuple[str, int]], list[tuple[str, int]]]] = {}

    @staticmethod
    def _leaves(state: DraftState) -> tuple[list[torch.Tensor], object]:
        """The leaves of the fields `propose` reads, and their tree structure."""
        return tree.tree_flatten([getattr(state, n) for n in _PROPOSE_READS])

    @staticmethod
    def _with(state: DraftState, leaves: list[torch.Tensor], spec) -> DraftState:
        """`state` with the fields `propose` reads rebuilt from `leaves`."""
        return replace(state, **dict(zip(_PROPOSE_READS, tree.tree_unflatten(spec, leaves))))

    def stage(self, state: DraftState) -> DraftState:
        src, spec = self._leaves(state)
        key = (src[0].device, spec, *((t.shape, t.dtype) for t in src))
        if self._placeholders:
            key += tuple((t.shape, t.dtype) for t in self._unread(state))
        slot = self._slots.get(key)
        if slot is None:
            dst = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in src]
            for t in dst:
                torch._dynamo.mark_static_address(t)
            staged = self._with(state, dst, spec)
            if self._placeholders:  # valid values, never written
                staged = replace(
                    staged, **{n: t.clone() for n, t in zip(_PROPOSE_SKIPS, self._unread(state))}
                )
            slot = self._slots[key] = ([_bytes(t) for t in dst], staged)
        dst_bytes, staged = slot
        torch._foreach_copy_(dst_bytes, [_bytes(t) for t in src])  # one dtype: one kernel on CUDA
        if self._placeholders:
            return staged
        return replace(state, **{n: getattr(staged, n) for n in _PROPOSE_READS})

    @staticmethod
    def _unread(state: DraftState) -> list[torch.Tensor]:
        return [getattr(state, n) for n in _PROPOSE_SKIPS]

    def restore(self, out: DraftState, staged: DraftState, state: DraftState) -> DraftState:
        """`out` with every leaf that is one of `staged`'s copies replaced by `state`'s own tensor."""
        plan = self._plans.get(id(out))
        if plan is None or plan[0] is not out:
            index = {id(d): i for i, d in enumerate(self._leaves(staged)[0])}
            leaves, spec = self._leaves(out)
            swaps = [(j, index[id(t)]) for j, t in enumerate(leaves) if id(t) in index]
            plan = (out, swaps, spec)
            if self._placeholders:  # a captured graph's output: the same object on every replay
                self._plans[id(out)] = plan
        _, swaps, spec = plan
        if not swaps:
            return out
        leaves, src = self._leaves(out)[0], self._leaves(state)[0]
        for j, i in swaps:
            leaves[j] = src[i]
        return self._with(out, leaves, spec)


def compile_propose(
    *,
    cfg: DraftConfig,
    backend: str = "auto",
    max_context: int | None = None,
    mode: str | None = "reduce-overhead",
) -> Callable[[dict, DraftState, KVCache], tuple[DraftState, KVCache]]:
    """`propose` compiled whole: `(params, state, cache) -> (state, cache)`, one graph per batch bucket.

    The returned state's tensors belong to the graph and are overwritten by the next call: read (or copy)
    them before calling again. The cache is donated and must have static addresses (`mark_static`, done
    here on first use of each cache object). In reduce-overhead and cuda-graph modes the state's leaves
    reach the graph through `StagedInputs` (one copy launch per call instead of one per leaf).

    `mode="cuda-graph"` (CUDA only; elsewhere it is Inductor's default mode) captures the compiled loop into
    one `torch.cuda.CUDAGraph` per bucket and parameter / cache addresses (`GraphCapture`) and replays it
    with no dynamo guard or graph-tree check per call; `.graphs` on the returned function is that
    `GraphCapture` (its `captures` and `replays` counters).
    """
    _check_mode(mode)

    def run(params: dict, state: DraftState, cache: KVCache) -> DraftState:
        return propose(params, state, cache, cfg=cfg, backend=backend, max_context=max_context)[0]

    compiled = jit(run, mode)
    graphs = GraphCapture(compiled)
    marked: set[int] = set()
    staged = StagedInputs(placeholders=mode == "cuda-graph")

    def call(params: dict, state: DraftState, cache: KVCache) -> tuple[DraftState, KVCache]:
        if id(cache) not in marked:
            mark_static(cache)
            marked.add(id(cache))
        if mode == "cuda-graph" and state.input_ids.is_cuda:
            inputs = staged.stage(state)  # one object per bucket, every leaf at a fixed address
            leaves, spec = tree.tree_flatten(params)
            key = (id(inputs), spec, cache.k.data_ptr(), cache.v.data_ptr(), *(p.data_ptr() for p in leaves))
            return staged.restore(graphs(params, inputs, cache, key=key), inputs, state), cache
        if mode != "reduce-overhead":
            return compiled(params, state, cache), cache
        torch.compiler.cudagraph_mark_step_begin()
        inputs = staged.stage(state)
        return staged.restore(compiled(params, inputs, cache), inputs, state), cache

    call.graphs = graphs
    return call


def compile_step(
    *,
    cfg: DraftConfig,
    backend: str = "auto",
    max_context: int | None = None,
    mode: str | None = "reduce-overhead",
) -> Callable[[dict, DraftState, KVCache], tuple[DraftState, KVCache]]:
    """The per-step alternative to `compile_propose`, with the same signature and result.

    One compiled step (a graph for the first step's shape, one for the decode shape) replayed K times. The
    draft buffers of each batch shape are allocated once, marked static and written in place by every
    replay; the result's `draft_tokens` / `draft_probs` are those buffers (overwritten by the next call).
    `mode="cuda-graph"` is `compile_propose`'s alone.
    """
    _check_mode(mode, tuple(m for m in MODES if m != "cuda-graph"))

    def run(params: dict, state: DraftState, cache: KVCache) -> DraftState:
        return _step(params, state, cache, cfg=cfg, backend=backend, max_context=max_context)[0]

    compiled = jit(run, mode)
    buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    marked: set[int] = set()

    def call(params: dict, state: DraftState, cache: KVCache) -> tuple[DraftState, KVCache]:
        if id(cache) not in marked:
            mark_static(cache)
            marked.add(id(cache))
        key = (tuple(state.draft_probs.shape), state.draft_probs.device)
        if key not in buffers:
            toks = torch.full(
                state.draft_tokens.shape, -1, dtype=torch.int64, device=state.draft_tokens.device
            )
            probs = torch.zeros_like(state.draft_probs)
            torch._dynamo.mark_static_address(toks)
            torch._dynamo.mark_static_address(probs)
            buffers[key] = (toks, probs)
        toks, probs = buffers[key]
        step = torch.zeros((), dtype=torch.int64, device=toks.device)
        state = replace(state, draft_tokens=toks, draft_probs=probs, step=step)
        for _ in range(cfg.num_speculative_steps):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(params, state, cache)
            # Copy the outputs the next replay reads: the graph overwrites its outputs on every replay.
            state = replace(
                out,
                input_ids=out.input_ids.clone(),
                hidden=out.hidden.clone(),
                attn=_clone_meta(out.attn),
                step=out.step.clone(),
                draft_tokens=toks,
                draft_probs=probs,
            )
        return state, cache

    return call


def _clone_meta(meta: AttnMetadata) -> AttnMetadata:
    return AttnMetadata(*(getattr(meta, n).clone() for n in AttnMetadata.__fspec_children__))


def pad_to_bucket(state: DraftState, *, cfg: DraftConfig) -> tuple[DraftState, int]:
    """Pad `state` with padding requests up to its batch bucket; returns (padded state, real batch size).

    Padding requests have no live tokens (positions -1, slot -1, seq_len 0, block table -1), token 0, zero
    hidden, greedy sampling with seed 0: they read nothing live and write nothing to the cache.
    """
    b = state.attn.num_requests
    bucket = bucket_for(b)
    if bucket == b:
        return state, b
    extra = bucket - b
    q = state.attn.num_tokens // b
    attn = state.attn
    t_extra = extra * q
    padded_attn = AttnMetadata(
        positions=torch.cat([attn.positions, attn.positions.new_full((t_extra,), -1)]),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=attn.positions.device) * q,
        seq_lens=torch.cat([attn.seq_lens, attn.seq_lens.new_zeros(extra)]),
        block_table=torch.cat(
            [attn.block_table, attn.block_table.new_full((extra, attn.block_table.shape[1]), -1)]
        ),
        slot_mapping=torch.cat([attn.slot_mapping, attn.slot_mapping.new_full((t_extra,), -1)]),
    )
    padded = replace(
        state,
        input_ids=torch.cat([state.input_ids, state.input_ids.new_zeros(t_extra)]),
        hidden=torch.cat([state.hidden, state.hidden.new_zeros(t_extra, state.hidden.shape[1])]),
        attn=padded_attn,
        draft_tokens=torch.cat(
            [state.draft_tokens, state.draft_tokens.new_full((extra, cfg.num_speculative_steps), -1)]
        ),
        draft_probs=torch.cat(
            [state.draft_probs, state.draft_probs.new_zeros(extra, *state.draft_probs.shape[1:])]
        ),
        sampling=state.sampling.pad(extra),
    )
    return padded, b


def unpad(state: DraftState, batch_size: int) -> DraftState:
    """The first `batch_size` requests' draft results of a padded state (draft_tokens, draft_probs, ...)."""
    q = state.attn.num_tokens // state.attn.num_requests
    t = batch_size * q
    attn = state.attn
    return replace(
        state,
        input_ids=state.input_ids[:t],
        hidden=state.hidden[:t],
        attn=AttnMetadata(
            positions=attn.positions[:t],
            query_start_loc=attn.query_start_loc[: batch_size + 1],
            seq_lens=attn.seq_lens[:batch_size],
            block_table=attn.block_table[:batch_size],
            slot_mapping=attn.slot_mapping[:t],
        ),
        draft_tokens=state.draft_tokens[:batch_size],
        draft_probs=state.draft_probs[:batch_size],
        sampling=state.sampling.take(batch_size),
    )
