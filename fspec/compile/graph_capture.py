"""A compiled function captured into CUDA graphs of fspec's own and replayed without dynamo or graph trees.

`torch.compile(mode="reduce-overhead")` replays a CUDA graph too, but every call first runs dynamo's guards
and the CUDA-graph tree's bookkeeping (input checks, the pool's liveness, one output tensor rebuilt per
leaf): 210-450 µs of host time per `compile_propose` call on the H200 host, more than the GPU time of a
short draft loop (BENCHMARKS.md, `draft_loop`). `GraphCapture` compiles nothing itself: it takes an already
compiled function (Inductor's default mode, no CUDA graphs), and for each layout of its arguments (every
tensor leaf's address, shape, stride and dtype, and the tree structure) runs it twice on a side stream
(compilation, autotuning and one-time caches happen there), captures a third call into a
`torch.cuda.CUDAGraph`, and from then on replays that graph. A call costs the flatten, the key and
`replay()`; with the same `key` object as the call before (a caller that computed `layout_key` once), only
`replay()`.

What the caller promises, as with any CUDA graph: the argument tensors of one layout stay where they are (a
new address is a new layout, so a new capture, never a stale read), inputs are written in place between
calls (`fspec.compile.StagedInputs` does that for a draft state), and the function is deterministic with no
host synchronisation. The result's tensors are the graph's own outputs: every call of any layout may
overwrite them (all graphs share one memory pool), so read or copy them before the next call. Each layout's
graph and outputs live as long as the `GraphCapture` does: a caller that allocates a new KV cache per call
captures a new graph per call; keep the cache (as the engine keeps its buffers) or drop the compiled function.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from fspec.core.pytree import tree


class GraphCapture:
    """`fn` (a compiled function of pytrees of CUDA tensors) replayed from one CUDA graph per argument layout.

    `captures` and `replays` count what happened (tests and benchmarks read them).
    """

    def __init__(
        self, fn: Callable, *, warmup: int = 2, preserve: Callable[[tuple], list[torch.Tensor]] | None = None
    ) -> None:
        """preserve(args): the argument tensors `fn` writes in place that the warm-up calls must leave as they
        were (copied aside before them and back after the capture), e.g. a position that each call advances.
        Writes that a repeated call makes again with the same values (a KV cache's slots) need no keeping."""
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup: expected an int >= 1 (the first call compiles), got {warmup!r}")
        if preserve is not None and not callable(preserve):
            raise ValueError(f"preserve: expected None or a callable of the arguments, got {preserve!r}")
        self._fn = fn
        self._warmup = warmup
        self._preserve = preserve
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        # the last caller-given key and its entry: a run passes the same key object every round, and hashing
        # a layout of ~300 leaves costs ~60 µs of host time on the H100 host, a sixth of a SmolLM2 round
        self._last: tuple[Hashable, tuple[torch.cuda.CUDAGraph, Any]] | None = None
        self._pool = None
        self.captures = 0
        self.replays = 0

    @staticmethod
    def layout_key(args: tuple) -> tuple:
        """The key of `args`' layout (tree structure; each leaf's address, shape, stride and dtype): what a
        caller that passes the same tensors every call computes once and hands to `__call__` as `key`."""
        return GraphCapture._key(args)

    @staticmethod
    def _key(args: tuple) -> tuple:
        leaves, spec = tree.tree_flatten(args)
        for x in leaves:
            if not isinstance(x, torch.Tensor) or not x.is_cuda:
                raise ValueError(
                    f"args: expected pytrees of CUDA tensors, got a leaf {type(x).__name__}"
                    + (f" on {x.device}" if isinstance(x, torch.Tensor) else "")
                )
        return (spec, *((x.data_ptr(), x.shape, x.stride(), x.dtype) for x in leaves))

    def __call__(self, *args: Any, key: Hashable | None = None) -> Any:
        """Replay the graph of `args`' layout (capturing it first if new). `key`, when given, stands for the
        layout (the caller vouches that equal keys mean equal addresses, shapes, strides and dtypes) and
        saves the flatten of every argument."""
        if key is not None and self._last is not None and self._last[0] is key:
            entry = self._last[1]
        else:
            given = key
            if key is None:
                key = self._key(args)
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._graphs[key] = self._capture(args)
            if given is not None:
                self._last = (given, entry)
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, Any]:
        kept = [(t, t.clone()) for t in self._preserve(args)] if self._preserve is not None else []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self._warmup):
                self._fn(*args)
                for t, saved in kept:
                    t.copy_(saved)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._fn(*args)
        self.captures += 1
        return graph, out
