"""Functional target models and draft heads.

`llama` is the target; `eagle` (EAGLE-1), `eagle3` and `mtp` are the draft heads, all with the same functions
(see `fspec.models.eagle`). The dispatchers below pick a head module by `cfg.kind` (a static string, so the
choice is made at trace time).
"""

from __future__ import annotations

from types import ModuleType

import torch

from fspec.attention import Attend
from fspec.cache import KVCache
from fspec.config import DraftConfig
from fspec.models import eagle, eagle3, llama, mtp
from fspec.models.eagle3 import draft_to_target, vocab_maps
from fspec.models.llama import TargetHidden, eagle3_layer_ids
from fspec.state import AttnMetadata

HEADS: dict[str, ModuleType] = {"eagle": eagle, "eagle3": eagle3, "mtp": mtp}


def head_module(kind: str) -> ModuleType:
    """The module implementing draft head `kind` ("eagle", "eagle3" or "mtp")."""
    if kind not in HEADS:
        raise ValueError(f"kind: expected one of {tuple(HEADS)}, got {kind!r}")
    return HEADS[kind]


def head_init(cfg: DraftConfig, target_params: dict, *, seed: int, **kwargs) -> dict:
    """Fresh parameters of the head `cfg.kind` for the target's parameters."""
    return head_module(cfg.kind).init(cfg, target_params, seed=seed, **kwargs)


def project_target_hidden(params: dict, target_hidden: TargetHidden, *, cfg: DraftConfig) -> torch.Tensor:
    """[T, H]: the first draft step's hidden input from the target's hidden states (EAGLE-3: fc(aux))."""
    return head_module(cfg.kind).project_target_hidden(params, target_hidden, cfg=cfg)


def head_hidden(
    params: dict,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    *,
    cfg: DraftConfig,
) -> torch.Tensor:
    """[..., H]: the output hidden of one step of head `cfg.kind` over input_ids [...] and hidden [..., H] at
    `positions` [...], with attention supplied as `attend(q, k, v, layer)` (distillation passes its own
    training-time-test mask). Differentiable; no cache."""
    return head_module(cfg.kind)._hidden(params, input_ids, hidden, positions, attend, cfg=cfg)


def head_logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., Vd] logits of head `cfg.kind` for its output hidden `out` [..., H] (EAGLE-3: draft vocab)."""
    return head_module(cfg.kind).logits(params, out, cfg=cfg)


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
    """
    return head_module(cfg.kind).forward(
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


def head_forward_dense(
    params: dict, input_ids: torch.Tensor, hidden: torch.Tensor, *, cfg: DraftConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal dense step of head `cfg.kind` over [B, S]: (logits [B, S, Vd], new_hidden [B, S, H])."""
    return head_module(cfg.kind).forward_dense(params, input_ids, hidden, cfg=cfg)


__all__ = [
    "HEADS",
    "TargetHidden",
    "draft_to_target",
    "eagle",
    "eagle3",
    "eagle3_layer_ids",
    "head_forward",
    "head_forward_dense",
    "head_hidden",
    "head_init",
    "head_logits",
    "head_module",
    "llama",
    "mtp",
    "project_target_hidden",
    "vocab_maps",
]
