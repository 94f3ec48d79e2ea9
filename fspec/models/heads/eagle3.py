"""EAGLE-3 draft head (Li et al. 2025), with a reduced draft vocabulary.

As in SafeAILab/EAGLE eagle/model/cnets.py (`Model`, `LlamaDecoderLayeremb`):
* the target's hidden states at the input of three layers (low, middle, high; `llama.eagle3_layer_ids`) are
  concatenated [T, 3·Ht] and projected by fc (3·Ht -> H, no bias) — here once, by `project_target_hidden`,
  before the first draft step; later steps feed the head's own [T, H] output, which skips fc;
* the layer's attention input is cat(input_layernorm(embed(ids)), hidden_norm(hidden)) [T, 2H] (q/k/v read
  2H), its residual is the un-normed `hidden`;
* logits over the draft vocabulary Vd = lm_head(norm(out)) with the head's own `norm` and `lm_head` [Vd, H]
  (`topK_genrate`: ``self.lm_head(self.norm(last_hidden))``); the next step's hidden is `out`, before the
  norm.
* `d2t` [Vd] int64 offsets (target id = draft id + d2t[draft id]) and `t2d` [V] bool (target id is in the
  draft vocabulary), the buffers of published checkpoints.

Draft params: {"embed": [V, H] (the target's when H == Ht, else the head's own), "fc": [H, 3·Ht],
"layer": {..., "q": [N·D, 2H], "input_norm", "hidden_norm", ...}, "norm": [H], "lm_head": [Vd, H],
"d2t": [Vd] int64, "t2d": [V] bool} (d2t/t2d are frozen Parameters, so CUDA graphs treat them as static).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from fspec.core.config import DraftConfig, ModelConfig
from fspec.models import layers as L
from fspec.models import llama
from fspec.models.heads.base import HeadKind, register
from fspec.models.heads.eagle import target_shape


def draft_to_target(ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target token ids of draft ids (any shape): ids + d2t[ids]; negative ids (padding) stay as they are.

    Eager calls validate: integer ids < Vd on d2t's device, d2t an integer [Vd] tensor (ValueError)."""
    if not torch.compiler.is_compiling():
        if not isinstance(d2t, torch.Tensor) or d2t.dim() != 1 or not _is_int(d2t):
            raise ValueError(f"d2t: expected an integer [Vd] tensor, got {_describe(d2t)}")
        if not isinstance(ids, torch.Tensor) or not _is_int(ids) or ids.device != d2t.device:
            raise ValueError(f"ids: expected an integer tensor on {d2t.device} (d2t's), got {_describe(ids)}")
        if ids.numel() and int(ids.max()) >= d2t.numel():
            raise ValueError(f"ids: expected draft ids < Vd = {d2t.numel()}, got max {int(ids.max())}")
    return _draft_to_target(ids, d2t)


def _is_int(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return type(x).__name__


def check_d2t(d2t: object, *, draft_vocab_size: int, vocab_size: int, name: str = "d2t") -> None:
    """ValueError naming `name` unless d2t is an integer [Vd] tensor of offsets mapping every draft id t to
    t + d2t[t] in [0, V), no two draft ids to one target id (a repeated id would merge two draft tokens'
    probabilities: sampled speculation stops being lossless)."""
    if not isinstance(d2t, torch.Tensor) or not _is_int(d2t):
        raise ValueError(f"{name}: expected an integer tensor of id offsets, got {_describe(d2t)}")
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(
            f"{name}: expected shape [{draft_vocab_size}] (draft_vocab_size), got {list(d2t.shape)}"
        )
    ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t.long()  # [Vd] target ids
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}: expected t + d2t[t] in [0, {vocab_size}) (the target vocabulary) for every draft id t, "
            f"got d2t[{t}] = {int(d2t[t])} (target id {int(ids[t])})"
        )
    values, counts = ids.unique(return_counts=True)
    if values.numel() != ids.numel():
        raise ValueError(
            f"{name}: expected distinct target ids t + d2t[t] (an injective map), got target ids "
            f"{values[counts > 1][:4].tolist()} mapped from more than one draft id"
        )


def _check_params(cfg: DraftConfig, params: dict, where: str) -> None:
    """The d2t of `params` (when present: a published file may lack it) against cfg's Vd and V."""
    if "d2t" in params:
        check_d2t(
            params["d2t"],
            draft_vocab_size=cfg.draft_vocab_size,
            vocab_size=cfg.model.vocab_size,
            name=f"{where}d2t",
        )


def _draft_to_target(ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """`draft_to_target` without validation (branch-free; inside compiled steps and training)."""
    mapped = ids + d2t[ids.clamp(min=0)]
    return torch.where(ids < 0, ids, mapped)


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) from `draft_ids`, the draft vocab's target ids (increasing)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    if isinstance(draft_ids, torch.Tensor) and not _is_int(draft_ids):
        raise ValueError(f"draft_ids: expected integer token ids, got dtype {draft_ids.dtype}")
    ids = torch.as_tensor(draft_ids, dtype=torch.int64)
    if ids.dim() != 1 or ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError(
            f"draft_ids: expected a non-empty strictly increasing [Vd] tensor, got {ids.tolist()[:8]}"
        )
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(
            f"draft_ids: expected ids in [0, {vocab_size}), got min {int(ids[0])}, max {int(ids[-1])}"
        )
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def init(
    cfg: DraftConfig, target_params: dict, *, seed: int, device=None, draft_ids: torch.Tensor | None = None
) -> dict:
    """A fresh EAGLE-3 head. draft_ids: the Vd target ids of the draft vocabulary (default 0..Vd-1).

    When H == Ht the embedding is the target's and lm_head starts as the target's lm_head rows of the draft
    vocabulary (a copy the head owns); otherwise both are random.
    """
    dtype, tdev = target_shape(cfg, target_params, kind="eagle3", same_width=False)
    device = tdev if device is None else device
    kw = {"dtype": dtype, "device": device}
    m, v, vd = cfg.model, cfg.model.vocab_size, cfg.draft_vocab_size
    h, ht = m.hidden_size, cfg.target_hidden_size
    draft_ids = torch.arange(vd) if draft_ids is None else torch.as_tensor(draft_ids, dtype=torch.int64).cpu()
    if draft_ids.shape != (vd,):
        raise ValueError(
            f"draft_ids: expected shape [{vd}] (cfg.draft_vocab_size), got {list(draft_ids.shape)}"
        )
    d2t, t2d = vocab_maps(draft_ids, v)
    gen = torch.Generator().manual_seed(seed)
    shared = h == ht
    layer = L.init_layer(gen, m, attn_in=2 * h, **kw)
    layer["hidden_norm"] = L.ones(h, **kw)
    params = {
        "embed": target_params["embed"] if shared else L.normal(gen, v, h, **kw),
        "fc": L.normal(gen, h, 3 * ht, **kw),
        "layer": layer,
        "norm": L.ones(h, **kw),
    }
    if shared and torch.device(device).type != "meta":
        rows = llama.lm_head(target_params).detach().index_select(0, draft_ids.to(tdev))
        params["lm_head"] = L.param(rows.to(**kw).clone())
    else:
        params["lm_head"] = L.normal(gen, vd, h, **kw)
    params["d2t"] = L.param(d2t.to(device))
    params["t2d"] = L.param(t2d.to(device))
    return params


def tied_lm_head(cfg: DraftConfig, params: dict, target_params: dict) -> torch.Tensor:
    """[Vd, H] the target's lm_head rows of the draft vocabulary (draft id t -> target id t + d2t[t]) in the
    head's dtype: the output layer of a tied head (frozen; EAGLE-1 and EAGLE-2 draft through the target's own
    head). The target's own tensor where the draft vocabulary is the whole vocabulary in order. ValueError
    naming tie_lm_head unless H equals the target's hidden size (the rows multiply the head's H)."""
    if cfg.model.hidden_size != cfg.target_hidden_size:
        raise ValueError(
            f"tie_lm_head: expected a head as wide as its target (H = Ht = {cfg.target_hidden_size}), "
            f"got H = {cfg.model.hidden_size}"
        )
    head = llama.lm_head(target_params)
    d2t, dtype = params["d2t"], params["fc"].dtype
    whole = d2t.numel() == head.shape[0] and not bool(d2t.any())
    if whole and head.dtype == dtype:
        return head
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.long()
    return L.param(head.detach().index_select(0, ids.to(head.device)).to(dtype=dtype, device=d2t.device))


def project_target_hidden(
    params: dict, target_hidden: llama.TargetHidden, *, cfg: DraftConfig
) -> torch.Tensor:
    """fc over the target's aux hidden [..., 3·Ht] -> [..., H]: the first draft step's hidden input."""
    aux = target_hidden.aux
    if aux.shape[-1] != 3 * cfg.target_hidden_size:
        raise ValueError(
            f"target_hidden.aux: expected last dim 3·Ht = {3 * cfg.target_hidden_size} (run the target with "
            f"aux_layer_ids=cfg.target_layer_ids={cfg.target_layer_ids}), got {aux.shape[-1]}"
        )
    return L.linear(aux.to(params["fc"].dtype), params["fc"])


def _hidden(params: dict, input_ids, hidden, positions, attend, *, cfg: DraftConfig, rows=None):
    m, p = cfg.model, params["layer"]
    emb = F.embedding(input_ids, params["embed"])  # [..., H]
    hidden = hidden.to(emb.dtype)
    cos, sin = L.rope_cos_sin(positions, cfg=m, dtype=emb.dtype)
    attn_in = torch.cat(
        (
            L.rms_norm(emb, p["input_norm"], m.rms_norm_eps),
            L.rms_norm(hidden, p["hidden_norm"], m.rms_norm_eps),
        ),
        dim=-1,
    )  # [..., 2H]
    return L.decoder_layer(p, attn_in, hidden, cos, sin, attend, cfg=m, layer=0, rows=rows)


def pre_logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., H]: what lm_head multiplies, norm(out)."""
    return L.rms_norm(out, params["norm"], cfg.model.rms_norm_eps)


def logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., Vd] logits over the DRAFT vocabulary: lm_head(norm(out))."""
    return L.linear(pre_logits(params, out, cfg=cfg), params["lm_head"])


# --- the kind: its DraftConfig rules and checkpoint hooks ---------------------------------------------------


def _ids_ok(ids: tuple, top: int | None) -> bool:
    """Three int layer ids, each >= 0 (and <= top when given)."""
    return len(ids) == 3 and all(
        not isinstance(i, bool) and isinstance(i, int) and i >= 0 and (top is None or i <= top) for i in ids
    )


def _config_rules(cfg: DraftConfig) -> None:
    if not _ids_ok(cfg.target_layer_ids, None):
        raise ValueError(
            f"DraftConfig.target_layer_ids: expected three non-negative layer ids for eagle3, "
            f"got {cfg.target_layer_ids!r}"
        )


def _pick_layer_ids(ids, num_layers: int) -> tuple[int, ...]:
    """init_draft's target_layer_ids: default the published (2, L // 2, L - 3); three ids in [0, L]."""
    if ids is None:
        return llama.eagle3_layer_ids(num_layers)
    ids = tuple(ids)
    if not _ids_ok(ids, num_layers):
        raise ValueError(
            f"target_layer_ids: expected three target layer ids in [0, {num_layers}], got {ids!r}"
        )
    return ids


def _hf_config(cfg: DraftConfig, params: dict) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.target_layer_ids),  # the key vLLM reads
    }
    if cfg.target_hidden_size != cfg.model.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    return config


def _read_hf_config(config: dict, recorded: dict, tc: ModelConfig, where: Path) -> dict:
    """target_layer_ids (fspec's record, vLLM's key, or an "eagle_config"'s; default the published ones,
    each in [0, L]) and draft_vocab_size (default V) of a checkpoint's config.json."""
    ids = recorded.get("target_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    ids = ids or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids and (not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)):
        raise ValueError(f"{where}: target_layer_ids: expected a list of ints, got {ids!r}")
    layer_ids = tuple(ids) if ids else llama.eagle3_layer_ids(tc.num_hidden_layers)
    if any(not 0 <= i <= tc.num_hidden_layers for i in layer_ids):
        raise ValueError(
            f"{where}: target_layer_ids: expected ids in [0, {tc.num_hidden_layers}], got {layer_ids}"
        )
    return {"target_layer_ids": layer_ids, "draft_vocab_size": config.get("draft_vocab_size", tc.vocab_size)}


def _recognizes(config: dict, tensors: dict) -> bool:
    archs = config.get("architectures") or []
    return (
        any("Eagle3" in a for a in archs)
        or "draft_vocab_size" in config
        or any(k.startswith("midlayer.") for k in tensors)
    )


KIND = register(
    HeadKind(
        name="eagle3",
        init=init,
        project_target_hidden=project_target_hidden,
        hidden=_hidden,
        pre_logits=pre_logits,
        logits=logits,
        param_keys=("embed", "fc", "layer", "norm", "lm_head", "d2t", "t2d"),
        checkpoint_keys={
            "embed": "embed_tokens.weight",
            "fc": "fc.weight",
            "norm": "norm.weight",
            "lm_head": "lm_head.weight",
            "d2t": "d2t",
            "t2d": "t2d",
        },
        dtype_key="fc",
        reads_aux_layers=True,
        reduced_vocab=True,
        config_rules=_config_rules,
        pick_layer_ids=_pick_layer_ids,
        layer_prefix="midlayer.",
        hf_config=_hf_config,
        read_hf_config=_read_hf_config,
        check_params=_check_params,
        recognizes=_recognizes,
        recognized_by="an Eagle3 architecture, 'draft_vocab_size' or 'midlayer.*' keys",
        tied_lm_head=tied_lm_head,
    )
)
