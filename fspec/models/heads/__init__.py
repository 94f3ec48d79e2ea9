"""The draft heads: one module per kind, and the dispatch over them.

`eagle` (EAGLE-1), `eagle3` and `mtp` are the draft heads, all with the same functions (see
`fspec.models.heads.eagle`); `fspec.models.llama` is the target they read. Each head module registers a
`HeadKind` describing itself (`fspec.models.heads.base`); importing this package imports every head module,
so the registry is complete. The dispatchers below pick the kind by `lookup(cfg.kind)` (a static string, so
the choice is made at trace time); the validating ones (head_init, project_target_hidden, head_forward,
head_forward_dense, check_head_params) also check `cfg` against the kind's rules in eager calls (`head_kind`).

Adding a head kind: a module here that ends with ``KIND = register(HeadKind(...))``, and its name in the
import line below.
"""

from __future__ import annotations

from types import ModuleType

import torch

from fspec.core.cache import KVCache, check_cache
from fspec.core.config import DraftConfig
from fspec.core.pytree import tree
from fspec.core.state import AttnMetadata, _expect, check_positive_int, validate_attn_metadata
from fspec.models import llama
from fspec.models.heads import eagle, eagle3, mtp  # every head module: importing one registers its kind
from fspec.models.heads.base import HeadKind, kinds, lookup, names, register
from fspec.models.heads.eagle3 import draft_to_target, vocab_maps
from fspec.models.layers import fuse_projections, rope_key, unfuse_projections
from fspec.models.llama import TargetHidden, eagle3_layer_ids
from fspec.ops.attention import BACKENDS, Attend, bind, causal, resolve_backend

# The built-in head modules by kind name, and the top-level keys of their params (`HeadKind.param_keys`), for
# callers that want a module (`head_module`); fspec itself reads the registry (`lookup`), which also holds
# kinds registered anywhere else.
_MODULES = (eagle, eagle3, mtp)
HEADS: dict[str, ModuleType] = {m.KIND.name: m for m in _MODULES}
HEAD_KEYS = {m.KIND.name: m.KIND.param_keys for m in _MODULES}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def head_module(kind: str) -> ModuleType:
    """The module implementing draft head `kind` (one of `HEADS`: "eagle", "eagle3" or "mtp")."""
    if kind not in HEADS:
        raise ValueError(f"kind: expected one of {tuple(HEADS)}, got {kind!r}")
    return HEADS[kind]


def head_kind(cfg: DraftConfig) -> HeadKind:
    """`lookup(cfg.kind)`; eager calls also check `cfg` against the kind's rules (`HeadKind.check_config`):
    where a DraftConfig meets a head. ValueError naming `kind` or the offending DraftConfig field."""
    kind = lookup(cfg.kind)
    if not torch.compiler.is_compiling():
        kind.check_config(cfg)
    return kind


def head_init(cfg: DraftConfig, target_params: dict, *, seed: int, **kwargs) -> dict:
    """Fresh parameters of the head `cfg.kind` for the target's parameters."""
    _check_cfg(cfg)
    return head_kind(cfg).init(cfg, target_params, seed=seed, **kwargs)


def project_target_hidden(params: dict, target_hidden: TargetHidden, *, cfg: DraftConfig) -> torch.Tensor:
    """[T, H]: the first draft step's hidden input from the target's hidden states (EAGLE-3: fc(aux))."""
    if not torch.compiler.is_compiling():
        _check_cfg(cfg)
    kind = head_kind(cfg)
    if not torch.compiler.is_compiling():
        if not isinstance(target_hidden, TargetHidden):
            raise ValueError(f"target_hidden: expected a TargetHidden, got {type(target_hidden).__name__}")
        if not kind.reads_aux_layers and target_hidden.last.shape[-1] != cfg.target_hidden_size:
            raise ValueError(
                f"target_hidden.last: expected last dim Ht = {cfg.target_hidden_size}, "
                f"got {target_hidden.last.shape[-1]}"
            )
    return kind.project_target_hidden(params, target_hidden, cfg=cfg)


def head_hidden(
    params: dict,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    *,
    cfg: DraftConfig,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., H]: the output hidden of one step of head `cfg.kind` over input_ids [...] and hidden [..., H] at
    `positions` [...], with attention supplied as `attend(q, k, v, layer, cos, sin)` (RoPE is the attend's;
    distillation passes its own training-time-test mask). Differentiable; no cache. With rows [R] (tokens
    laid out [T]): only those rows' outputs, [R, H], every row's K/V still attended and cached."""
    return lookup(cfg.kind).hidden(params, input_ids, hidden, positions, attend, cfg=cfg, rows=rows)


def head_logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., Vd] logits of head `cfg.kind` for its output hidden `out` [..., H] (EAGLE-3: draft vocab)."""
    return lookup(cfg.kind).logits(params, out, cfg=cfg)


def head_pre_logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., H]: what head `cfg.kind`'s lm_head multiplies (its final norm of `out`, if it has one);
    `head_logits` = linear(head_pre_logits(...), params["lm_head"])."""
    return lookup(cfg.kind).pre_logits(params, out, cfg=cfg)


def head_forward(
    params: dict,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    meta: AttnMetadata,
    cache: KVCache | None,
    *,
    cfg: DraftConfig,
    backend: str = "auto",
    max_query_len: int | None = None,
    max_context: int | None = None,
    logit_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, KVCache | None]:
    """One draft step of head `cfg.kind`: (logits, new_hidden [T, H], cache (donated)).

    logits are [T, Vd], or [R, Vd] for the rows `logit_rows` [R] only (the lm_head is the largest matmul of a
    draft step; the first step of a round samples from one row per request, not from all K + 1).

    Eager calls validate (ValueError naming the argument): input_ids [T] int64 in [0, V), hidden [T, H]
    float, params of `cfg.kind` on their device, `meta` of T tokens valid for `cache` (a KVCache of the
    head's layout) unless backend="dense", max_query_len >= every request's query count, logit_rows in
    [0, T). `draft_step` / `propose` validate the whole state and call `_head_forward` directly.
    """
    if not torch.compiler.is_compiling():
        _check_head_forward(params, input_ids, hidden, meta, cache, cfg, backend, max_query_len, max_context)
        if logit_rows is not None:
            _expect("logit_rows", logit_rows, shape=(None,), dtype=torch.int64, device=input_ids.device)
            t = input_ids.shape[0]
            if logit_rows.numel() and (int(logit_rows.min()) < 0 or int(logit_rows.max()) >= t):
                raise ValueError(f"logit_rows: expected rows in [0, T={t}), got {logit_rows.tolist()[:8]}")
    return _head_forward(
        params,
        input_ids,
        hidden,
        meta,
        cache,
        cfg=cfg,
        backend=backend,
        max_query_len=max_query_len,
        max_context=max_context,
        logit_rows=logit_rows,
    )


def _head_forward(
    params: dict,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    meta: AttnMetadata,
    cache: KVCache | None,
    *,
    cfg: DraftConfig,
    backend: str = "auto",
    max_query_len: int | None = None,
    max_context: int | None = None,
    logit_rows: torch.Tensor | None = None,
    rows_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, KVCache | None]:
    """`head_forward` without validation (the draft loop's step, after `validate_draft_state`). With
    `rows_only` the new hidden is that of `logit_rows` only, [R, H]: the rows after the attention are
    computed for those rows alone (`decoder_layer`'s rows), which is all a draft step reads."""
    attend = bind(
        meta, cache, backend=backend, max_query_len=max_query_len, max_context=max_context,
        rope=rope_key(cfg.model),
    )  # fmt: skip
    if rows_only and logit_rows is not None:
        new_hidden = head_hidden(params, input_ids, hidden, meta.positions, attend, cfg=cfg, rows=logit_rows)
        return head_logits(params, new_hidden, cfg=cfg), new_hidden, cache  # [R, Vd], [R, H]
    new_hidden = head_hidden(params, input_ids, hidden, meta.positions, attend, cfg=cfg)  # [T, H]
    rows = new_hidden if logit_rows is None else new_hidden.index_select(0, logit_rows)
    return head_logits(params, rows, cfg=cfg), new_hidden, cache


def head_forward_dense(
    params: dict, input_ids: torch.Tensor, hidden: torch.Tensor, *, cfg: DraftConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal, cache-free, differentiable step of head `cfg.kind` over [B, S]:
    (logits [B, S, Vd], new_hidden [B, S, H]).

    Eager calls validate input_ids [B, S] int64 in [0, V) and hidden [B, S, H] float on one device."""
    if not torch.compiler.is_compiling():
        _check_cfg(cfg)
        _expect("input_ids", input_ids, shape=(None, None), dtype=torch.int64)
        b, s = input_ids.shape
        dev = input_ids.device
        _expect("hidden", hidden, shape=(b, s, cfg.model.hidden_size), dtype=FLOATS, device=dev)
        check_head_params(params, cfg=cfg, device=dev)
        _check_ids(input_ids, cfg.model.vocab_size)
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).expand(b, s)
    out = head_hidden(params, input_ids, hidden, positions, causal, cfg=cfg)
    return head_logits(params, out, cfg=cfg), out


def _check_cfg(cfg: object) -> None:
    if not isinstance(cfg, DraftConfig):
        raise ValueError(f"cfg: expected a DraftConfig, got {type(cfg).__name__}")


def _check_ids(ids: torch.Tensor, vocab: int, name: str = "input_ids") -> None:
    """Token ids in [0, vocab); skipped for ids batched by torch.func.vmap (no data-dependent check there)."""
    if _is_batched(ids):
        return
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{name}: expected token ids in [0, {vocab}), got min {int(ids.min())}, max {int(ids.max())}"
        )


def _is_batched(x: torch.Tensor) -> bool:
    return bool(getattr(torch._C._functorch, "is_batchedtensor", lambda t: False)(x))


def check_head_params(
    params: object, *, cfg: DraftConfig, device: torch.device, name: str = "params"
) -> None:
    """ValueError naming `name` unless `params` is a `cfg.kind` head's dict with every tensor on `device`
    (and naming `kind` or the DraftConfig field unless `cfg` is a valid config of its kind)."""
    keys = head_kind(cfg).param_keys
    if not isinstance(params, dict):
        raise ValueError(
            f"{name}: expected a dict of a {cfg.kind!r} head's parameters, got {type(params).__name__}"
        )
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(
            f"{name}: expected a {cfg.kind!r} head's keys {keys}, missing {missing} "
            f"(got keys {sorted(params)})"
        )
    want = (cfg.model.vocab_size, cfg.model.hidden_size)
    embed = params["embed"]
    if not isinstance(embed, torch.Tensor) or tuple(embed.shape) != want:
        got = tuple(embed.shape) if isinstance(embed, torch.Tensor) else type(embed).__name__
        raise ValueError(f"{name}['embed']: expected shape {list(want)} (cfg.model's V, H), got {got}")
    for leaf in tree.tree_leaves(params):
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            raise ValueError(f"{name}: expected every tensor on {device}, got one on {leaf.device}")


def _check_head_forward(params, input_ids, hidden, meta, cache, cfg, backend, max_query_len, max_context):
    _check_cfg(cfg)
    _expect("input_ids", input_ids, shape=(None,), dtype=torch.int64)
    t, dev = input_ids.shape[0], input_ids.device
    _expect("hidden", hidden, shape=(t, cfg.model.hidden_size), dtype=FLOATS, device=dev)
    check_head_params(params, cfg=cfg, device=dev)
    _check_ids(input_ids, cfg.model.vocab_size)
    if not isinstance(meta, AttnMetadata):
        raise ValueError(f"meta: expected an AttnMetadata, got {type(meta).__name__}")
    _expect("meta.positions", meta.positions, shape=(t,), dtype=torch.int64, device=dev)
    _expect("meta.query_start_loc", meta.query_start_loc, shape=(None,), dtype=torch.int32, device=dev)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    for name, value in (("max_query_len", max_query_len), ("max_context", max_context)):
        if value is not None:
            check_positive_int(name, value)
    if resolve_backend(backend, cache) != "dense":
        # The slots in `meta` must have been computed with the cache's block size (cfg.block_size matters
        # to the draft loop's metadata algebra, checked by draft_step / propose, not to one forward).
        bs = cache.block_size if isinstance(cache, KVCache) else cfg.block_size
        check_cache(cache, cfg=cfg.model, block_size=bs, device=dev)
        validate_attn_metadata(
            meta,
            block_size=bs,
            max_model_len=cfg.max_model_len,
            num_blocks=cache.num_blocks,
            name="meta",
        )
    counts = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    if max_query_len is not None and counts.numel() and int(counts.max()) > max_query_len:
        raise ValueError(
            f"max_query_len: expected at least the largest query count per request, {int(counts.max())}, "
            f"got {max_query_len}"
        )


__all__ = [
    "HEADS",
    "HeadKind",
    "TargetHidden",
    "draft_to_target",
    "eagle",
    "eagle3",
    "eagle3_layer_ids",
    "fuse_projections",
    "head_forward",
    "head_forward_dense",
    "head_hidden",
    "head_init",
    "head_kind",
    "head_logits",
    "head_pre_logits",
    "head_module",
    "kinds",
    "llama",
    "lookup",
    "mtp",
    "names",
    "project_target_hidden",
    "register",
    "unfuse_projections",
    "vocab_maps",
]
