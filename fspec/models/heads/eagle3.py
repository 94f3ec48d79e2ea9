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

import torch
import torch.nn.functional as F

from fspec.core.config import DraftConfig
from fspec.models import layers as L
from fspec.models import llama
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
    dtype, tdev = target_shape(cfg, target_params, kind="eagle3")
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
