"""What a draft head kind is (`HeadKind`), and the registry of kinds (`register`, `lookup`).

A head kind is one frozen `HeadKind`: the functions of its module (the same five for every kind, see
`fspec.models.heads.eagle`), the top-level keys of its params, the properties the rest of fspec reads instead
of comparing `DraftConfig.kind` with a name (whether the head reads the target's aux hidden states, whether
it has a reduced vocabulary, the width of its first input), its rules for a `DraftConfig`, and its checkpoint
hooks (the published key names, the config.json fields it writes and reads, how a published checkpoint
without fspec's metadata is recognised).

Each head module ends with ``KIND = register(HeadKind(...))``, and `fspec.models.heads` imports every head
module, so adding a kind touches two files: its module, and that import line in `heads/__init__.py`.

The registry is filled at import time only: `register` runs once per kind, at the end of the kind's module,
and nothing else adds, replaces or removes an entry (the one exception: a test may register a toy kind under
a test-only name and delete it from `_REGISTRY` afterwards). So the registry is effectively constant while
anything runs, and reading it inside a compiled function guards on the one key read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from fspec.core.config import DraftConfig, ModelConfig
from fspec.models import layers as L

_REGISTRY: dict[str, HeadKind] = {}  # name -> kind, in registration (import) order; see the module docstring


def _bad(name: str, expected: str, actual: Any) -> ValueError:
    return ValueError(f"DraftConfig.{name}: expected {expected}, got {actual!r}")


def _no_rules(cfg: DraftConfig) -> None:
    return None


def _no_fields(*args) -> dict:
    return {}


def _no_params_check(*args) -> None:
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class HeadKind:
    """One kind of draft head (EAGLE-1, EAGLE-3, MTP, ...), as the rest of fspec sees it.

    Attributes:
        name: the `DraftConfig.kind` string of this kind.
        init: ``init(cfg, target_params, *, seed, device=None, **init_kwargs) -> params``, a fresh head.
        project_target_hidden: ``(params, target_hidden: TargetHidden, *, cfg) -> [..., H]``, the first
            draft step's hidden input from the target's hidden states.
        hidden: ``(params, input_ids [...], hidden [..., H], positions [...], attend, *, cfg, rows=None) ->
            [..., H]``, one step's output hidden (the module's `_hidden`).
        pre_logits: ``(params, out, *, cfg) -> [..., H]``, what the lm_head multiplies.
        logits: ``(params, out, *, cfg) -> [..., Vd]``.
        param_keys: the top-level keys every params dict of this kind has.
        checkpoint_keys: top-level param name -> its key in the published layout (a "layer" dict's and a
            "layers" list's entries are named by `fspec.models.layers.LAYER_KEYS`, see `key_map`).
        dtype_key: the param whose dtype config.json records as "torch_dtype".
        reads_aux_layers: the head reads the target's hidden states at the input of `cfg.target_layer_ids`
            (`TargetHidden.aux`, EAGLE-3) instead of its final-normed last hidden (`TargetHidden.last`).
        reduced_vocab: the head drafts over a reduced vocabulary of `cfg.draft_vocab_size` ids, with
            params["d2t"] [Vd] (target id = draft id + d2t[draft id]) and params["t2d"] [V] bool.
        config_rules: ``(cfg) -> None``, the kind's own rules for a DraftConfig beyond the ones every kind
            follows (`check_config`); raises ValueError naming the field.
        pick_layer_ids: ``(ids | None, num_target_layers) -> tuple``, `init_draft`'s target_layer_ids
            (None: the kind's default), checked; only for kinds with `reads_aux_layers`.
        layer_prefix: the published prefix of a single "layer" dict's keys (EAGLE-3: "midlayer.").
        hf_config: ``(cfg, params) -> dict``, the fields `save_draft` adds to config.json (architectures,
            ...).
        read_hf_config: ``(config, recorded, target_cfg, where) -> dict``, DraftConfig fields read from a
            checkpoint's config.json (`recorded`: its "fspec_draft" object or {}) beyond the shared ones
            (EAGLE-3: target_layer_ids, draft_vocab_size); ValueError naming `where` for a bad value.
        check_params: ``(cfg, params, where) -> None``, the kind's checks of its parameter VALUES that shapes
            cannot catch (EAGLE-3: d2t), run by `init_draft`, `save_draft` and `load_draft` (there on the
            file's tensors, before any cast); ValueError naming `where` and the param.
        init_kwargs: ``(config) -> dict``, keyword arguments of `init` that a checkpoint's config.json decides
            (EAGLE-1: fc_bias from "bias").
        recognizes: ``(config, tensors) -> bool``, whether a checkpoint without "fspec_draft" metadata (a
            published head) is of this kind; None: only checkpoints that record the kind load as it.
        recognized_by: what `recognizes` looks for, for the error when no kind recognises a checkpoint.
        recognize_order: kinds are tried in increasing order (then registration order): a kind whose marks
            are also another kind's (EAGLE-1's fc.weight is EAGLE-3's too) comes later.
        tied_lm_head: ``(cfg, params, target_params) -> [Vd, H]``, the output layer of a head of this kind
            whose lm_head is tied to the target's (`init_draft(tie_lm_head=True)`: frozen, not saved, rebuilt
            from the target on load); ValueError naming tie_lm_head where the head cannot tie. None: the kind
            has no own lm_head to tie (EAGLE-1 and MTP use the target's).
    """

    name: str
    init: Callable[..., dict]
    project_target_hidden: Callable[..., torch.Tensor]
    hidden: Callable[..., torch.Tensor]
    pre_logits: Callable[..., torch.Tensor]
    logits: Callable[..., torch.Tensor]
    param_keys: tuple[str, ...]
    checkpoint_keys: Mapping[str, str]
    dtype_key: str
    reads_aux_layers: bool = False
    reduced_vocab: bool = False
    config_rules: Callable[[DraftConfig], None] = _no_rules
    pick_layer_ids: Callable[[Any, int], tuple[int, ...]] | None = None
    layer_prefix: str = ""
    hf_config: Callable[[DraftConfig, dict], dict] = _no_fields
    read_hf_config: Callable[[dict, dict, ModelConfig, Path], dict] = _no_fields
    init_kwargs: Callable[[dict], dict] = _no_fields
    check_params: Callable[[DraftConfig, dict, str], None] = _no_params_check
    recognizes: Callable[[dict, dict], bool] | None = None
    recognized_by: str = ""
    recognize_order: int = 0
    tied_lm_head: Callable[[DraftConfig, dict, dict], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty str, got {self.name!r}")
        if self.reads_aux_layers and self.pick_layer_ids is None:
            raise ValueError(f"pick_layer_ids: expected a function for {self.name!r} (it reads aux layers)")
        object.__setattr__(self, "param_keys", tuple(self.param_keys))
        object.__setattr__(self, "checkpoint_keys", MappingProxyType(dict(self.checkpoint_keys)))

    def __repr__(self) -> str:
        return f"HeadKind({self.name!r})"

    # --- what the rest of fspec asks instead of comparing names -------------------------------------------

    def aux_layer_ids(self, cfg: DraftConfig) -> tuple[int, ...]:
        """The target layers whose input hidden this head reads (`TargetHidden.aux`), () if none."""
        return cfg.target_layer_ids if self.reads_aux_layers else ()

    def input_hidden_size(self, cfg: DraftConfig) -> int:
        """The width of the target hidden `project_target_hidden` reads: len(ids)·Ht (aux) or Ht (last)."""
        return cfg.target_hidden_size * (len(cfg.target_layer_ids) if self.reads_aux_layers else 1)

    def check_config(self, cfg: DraftConfig) -> None:
        """ValueError naming the field unless `cfg` is a valid DraftConfig of this kind: the rules of every
        kind (no target_layer_ids unless the head reads aux layers; draft_vocab_size = V unless it has a
        reduced vocabulary), then the kind's `config_rules`."""
        if not isinstance(cfg, DraftConfig):
            raise ValueError(f"cfg: expected a DraftConfig, got {type(cfg).__name__}")
        if cfg.kind != self.name:
            raise _bad("kind", repr(self.name), cfg.kind)
        if not self.reads_aux_layers and cfg.target_layer_ids:
            raise _bad("target_layer_ids", f"() for kind={cfg.kind!r}", cfg.target_layer_ids)
        if not self.reduced_vocab and cfg.draft_vocab_size != cfg.model.vocab_size:
            raise _bad(
                "draft_vocab_size",
                f"model.vocab_size={cfg.model.vocab_size} (kind={cfg.kind!r} has no reduced vocabulary)",
                cfg.draft_vocab_size,
            )
        self.config_rules(cfg)

    def target_layer_ids(self, ids, num_layers: int) -> tuple[int, ...]:
        """`init_draft`'s target_layer_ids for this kind: `pick_layer_ids(ids, L)` for a head that reads aux
        layers (ids None: its default), else () (ValueError for ids given)."""
        if not self.reads_aux_layers:
            if ids:
                raise ValueError(f"target_layer_ids: expected None for kind={self.name!r}, got {ids!r}")
            return ()
        return self.pick_layer_ids(ids, num_layers)

    def key_map(self, params: dict) -> dict[str, tuple]:
        """Published-layout key -> path into the head's `params` (a tuple of dict keys / list indices)."""
        keys = {}
        for name, value in params.items():
            if name == "layers":
                for i, layer in enumerate(value):
                    keys.update({f"layers.{i}.{L.LAYER_KEYS[n]}": ("layers", i, n) for n in layer})
            elif name == "layer":
                keys.update({self.layer_prefix + L.LAYER_KEYS[n]: ("layer", n) for n in value})
            else:
                keys[self.checkpoint_keys[name]] = (name,)
        return keys


def register(kind: HeadKind) -> HeadKind:
    """Add `kind` to the registry under `kind.name` and return it (a head module's last line:
    ``KIND = register(HeadKind(...))``). ValueError for a name already registered."""
    if not isinstance(kind, HeadKind):
        raise ValueError(f"kind: expected a HeadKind, got {type(kind).__name__}")
    if kind.name in _REGISTRY:
        raise ValueError(f"kind: expected a new head kind name, got {kind.name!r} (already registered)")
    _REGISTRY[kind.name] = kind
    return kind


def lookup(name: str) -> HeadKind:
    """The registered head kind `name`; ValueError naming `kind`, the registered names and `name`."""
    kind = _REGISTRY.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"kind: expected one of {names()}, got {name!r}")
    return kind


def names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(_REGISTRY)


def kinds() -> tuple[HeadKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_REGISTRY.values())
