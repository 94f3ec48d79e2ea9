"""Linear weights prepacked for oneDNN: faster several-row products in eager float32 inference on the CPU.

PyTorch's `F.linear` on a float32 CPU tensor calls MKL's sgemm, which runs a few rows far below a one-row
product's memory-bound speed. On the 2-core AMD EPYC (AVX2) of the project's CPU figures, one thread, the 120
projections of SmolLM2-135M's 30 layers plus its 49152-row LM head took 36.5 ms for one row, 85.9 ms for six
(the K + 1 rows of a K = 5 verification: 2.35 decode steps) and 92.5 ms for three. The same products over
weights reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then
`torch.ops.mkldnn._linear_pointwise`) took 38.3, 59.5 and 46.1 ms (benchmarks/bench_cpu_packed.py). A
speculative round's verification is the several-row case, so this is where CPU speculation gains or loses.

`pack_params` makes the packed copy of a params pytree; `fspec.models.layers.linear` runs a packed weight
through oneDNN. The embedding ("embed") stays dense (rows are looked up); a tied LM head gets a packed
"lm_head" of its own. Weights under MIN_ELEMENTS stay dense: there oneDNN's ~20 µs a call costs more than MKL
(96 x 64: 3.6 µs MKL, 24 µs packed). Packed tensors are opaque (no strides, no autograd, no torch.compile):
only `fspec.Generator`'s eager CPU calls use them, on a copy it keeps beside the caller's weights
(`fspec.serve.resources.Resources.prepacked`); training and compiled code never see one.
"""

from __future__ import annotations

import torch

MIN_ELEMENTS = 1 << 18  # smallest weight packed (576 x 576 and larger: every SmolLM2-135M projection)
BATCH_HINT = 64  # the row count oneDNN's layout is chosen for; 1..8 rows measured alike with 6 or 64
SKIP = ("embed",)  # looked up by row, never multiplied


def supported() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear (the CPU builds of PyPI's wheels do)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def packable(w: object) -> bool:
    """Whether w is a weight `pack_params` packs: a dense 2-d float32 CPU tensor of at least MIN_ELEMENTS
    elements that needs no gradient."""
    return (
        isinstance(w, torch.Tensor)
        and w.layout == torch.strided
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.numel() >= MIN_ELEMENTS
        and not w.requires_grad
    )


def is_packed(w: torch.Tensor) -> bool:
    """Whether w is a packed weight (oneDNN's opaque layout). Traced code never asks the tensor: compiled
    functions never receive a packed weight."""
    return not torch.compiler.is_compiling() and w.is_mkldnn


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] reordered for oneDNN (a new tensor; w is unchanged)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), batch_size=BATCH_HINT)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ b) for a packed w [N, K] -> [..., N]."""
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), w, b, "none", [], "")
    return y.reshape(*lead, w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)`, or `packed_linear` for a packed w: the products that skip
    `fspec.models.layers.linear` (the target's LM head, an MTP head's) call this."""
    return packed_linear(x, w, b) if is_packed(w) else torch.nn.functional.linear(x, w, b)


def sources(params, *, tied_head: bool) -> list[torch.Tensor]:
    """The tensors `pack_params(params, tied_head=...)` packs, in its walk order, each distinct one once."""
    out: dict[int, torch.Tensor] = {}

    def walk(node, key=None) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, key)
        elif key not in SKIP and packable(node):
            out.setdefault(id(node), node)

    walk(params)
    if tied_head and "lm_head" not in params and packable(params.get("embed")):
        out.setdefault(id(params["embed"]), params["embed"])
    return list(out.values())


def pack_params(params: dict, memo: dict[int, torch.Tensor] | None = None, *, tied_head: bool) -> dict:
    """A copy of a params pytree (dicts, lists, tuples) with every packable weight packed, the rest the same
    objects. tied_head: the tree's LM head is its "embed" (a target without "lm_head"): add a packed
    "lm_head". memo: id -> packed tensor shared between calls (a head that holds the target's tensors
    packs them once)."""
    memo = {} if memo is None else memo

    def packed(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = pack(t)
        return memo[id(t)]

    def walk(node, key=None):
        if isinstance(node, dict):
            return {k: walk(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, key) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v, key) for v in node)
        return packed(node) if key not in SKIP and packable(node) else node

    out = walk(params)
    if tied_head and "lm_head" not in params and packable(params.get("embed")):
        out["lm_head"] = packed(params["embed"])
    return out
