"""MTP draft head in DeepSeek-V3's multi-token-prediction style, with a Llama decoder layer.

DeepSeek-V3 (tech report §2.2): module k combines the previous depth's representation h with the embedding
of the next token: h' = M · [RMSNorm(h); RMSNorm(Emb(t))], runs one transformer block, and shares the
embedding and the output head with the main model. Following vLLM's vllm/model_executor/models/deepseek_mtp.py
(`DeepSeekMultiTokenPredictorLayer`, `SharedHead`):
* the embedding at position 0 is zeroed ("masking inputs at position 0, as not needed by MTP"; branch-free
  here, `where(positions == 0, 0, emb)`);
* x = eh_proj(cat(enorm(emb), hnorm(hidden))), eh_proj 2H -> H without bias (embedding first, then hidden);
* out = decoder_layer(x) (DeepSeek's block is MLA + MoE; ours is a Llama layer);
* logits = lm_head(shared_head.norm(out)): the module's own final norm, then the target's lm_head;
* the next step's hidden is `out` (before the norm); the first step's is the target's last hidden after its
  final norm (`TargetHidden.last`), which is what vLLM's DeepseekV2Model returns to the proposer.

Draft params: {"embed": [V, H] (target's), "enorm": [H], "hnorm": [H], "eh_proj": [H, 2H], "layer": {...},
"final_norm": [H], "lm_head": [V, H] (target's)}. Checkpoint names are DeepSeek's MTP-layer names without the
``model.layers.{L}.`` prefix (see `fspec.models.checkpoint`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fspec.core.config import DraftConfig
from fspec.models import layers as L
from fspec.models import llama, packed
from fspec.models.heads.base import HeadKind, register
from fspec.models.heads.eagle import target_shape


def init(cfg: DraftConfig, target_params: dict, *, seed: int, device=None) -> dict:
    """A fresh MTP head sharing the target's embedding and lm_head (HF init for the rest)."""
    dtype, tdev = target_shape(cfg, target_params, kind="mtp")
    kw = {"dtype": dtype, "device": tdev if device is None else device}
    gen = torch.Generator().manual_seed(seed)
    h = cfg.model.hidden_size
    return {
        "embed": target_params["embed"],
        "enorm": L.ones(h, **kw),
        "hnorm": L.ones(h, **kw),
        "eh_proj": L.normal(gen, h, 2 * h, **kw),
        "layer": L.init_layer(gen, cfg.model, attn_in=h, **kw),
        "final_norm": L.ones(h, **kw),
        "lm_head": llama.lm_head(target_params),
    }


def project_target_hidden(
    params: dict, target_hidden: llama.TargetHidden, *, cfg: DraftConfig
) -> torch.Tensor:
    """The first step's hidden input: the target's final-normed last hidden [..., H]."""
    return target_hidden.last


def _hidden(params: dict, input_ids, hidden, positions, attend, *, cfg: DraftConfig, rows=None):
    m, p, eps = cfg.model, params["layer"], cfg.model.rms_norm_eps
    emb = F.embedding(input_ids, params["embed"])  # [..., H]
    emb = torch.where((positions == 0)[..., None], torch.zeros_like(emb), emb)
    x = packed.linear(
        torch.cat(
            (L.rms_norm(emb, params["enorm"], eps), L.rms_norm(hidden.to(emb.dtype), params["hnorm"], eps)),
            -1,
        ),
        params["eh_proj"],
    )  # [..., H]
    cos, sin = L.rope_cos_sin(positions, cfg=m, dtype=x.dtype)
    return L.decoder_layer(
        p, L.rms_norm(x, p["input_norm"], eps), x, cos, sin, attend, cfg=m, layer=0, rows=rows
    )


def pre_logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., H]: what lm_head multiplies, the module's final norm (shared_head.norm) of out."""
    return L.rms_norm(out, params["final_norm"], cfg.model.rms_norm_eps)


def logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., V] logits: the module's final norm (shared_head.norm), then the target's lm_head."""
    return packed.linear(pre_logits(params, out, cfg=cfg), params["lm_head"])


KIND = register(
    HeadKind(
        name="mtp",
        init=init,
        project_target_hidden=project_target_hidden,
        hidden=_hidden,
        pre_logits=pre_logits,
        logits=logits,
        param_keys=("embed", "enorm", "hnorm", "eh_proj", "layer", "final_norm", "lm_head"),
        checkpoint_keys={
            "embed": "embed_tokens.weight",
            "enorm": "enorm.weight",
            "hnorm": "hnorm.weight",
            "eh_proj": "eh_proj.weight",
            "final_norm": "shared_head.norm.weight",
            "lm_head": "shared_head.head.weight",
        },
        dtype_key="eh_proj",
        hf_config=lambda cfg, params: {"architectures": ["FspecMTPHead"]},
        recognizes=lambda config, tensors: "eh_proj.weight" in tensors,
        recognized_by="'eh_proj.weight' keys",
    )
)
