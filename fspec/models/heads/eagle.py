"""EAGLE-1 draft head (Li et al. 2024), and what every head kind shares.

Every head module (`eagle`, `eagle3`, `mtp`) has the same functions:

    init(cfg: DraftConfig, target_params, *, seed, device=None) -> params
    project_target_hidden(params, target_hidden: TargetHidden, *, cfg) -> [T, H]
    _hidden(params, input_ids [...], hidden [..., H], positions [...], attend, *, cfg) -> out [..., H]
    pre_logits(params, out [..., H], *, cfg) -> [..., H]
    logits(params, out [..., H], *, cfg) -> [..., Vd]

and ends with ``KIND = register(HeadKind(...))``, which describes the kind to the rest of fspec
(`fspec.models.heads.base`). `fspec.models.heads.head_forward` (paged, one step over T tokens) /
`head_forward_dense` (causal, [B, S]) build every head's step from those functions, so the paged step, the
dense training step and distillation's unrolled step share one definition of each head.

`hidden` always has the head's width H: the first draft step feeds
`project_target_hidden(params, target_hidden)` (computed once from the target's outputs), later steps feed the
head's own `new_hidden`. So a step keeps one shape per call, unlike EAGLE-3's reference, which decides by
`hidden.shape[-1]` whether to apply fc.

EAGLE-1, as in SafeAILab/EAGLE eagle/model/cnets1.py:
* x = fc(cat(embed(ids), hidden)), fc 2H -> H with a bias (`Model(..., bias=True)`; configs may say
  "bias": false, then `fc_bias` is absent from the params);
* decoder layers whose layer 0 has no input_layernorm (`LlamaDecoderLayer`: ``if self.index != 0``);
* logits = lm_head(x) with the *target's* lm_head and no final norm (`topK_generate`: ``head(last_hidden)``);
* `hidden` of the first step is the target's last hidden after its final norm (`TargetHidden.last`), the next
  step's is the layers' output x.
The embedding and lm_head are the target's Parameter objects (shared, never saved with the head).

Draft params: {"embed": [V, H] (target's), "fc": [H, 2H], "fc_bias": [H], "layers": [layer dicts; layer 0 has
no "input_norm"], "lm_head": [V, H] (target's)}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fspec.core.config import DraftConfig
from fspec.models import layers as L
from fspec.models import llama
from fspec.models.heads.base import HeadKind, register


def target_shape(
    cfg: DraftConfig, target_params: dict, *, kind: str, same_width: bool = True
) -> tuple[torch.dtype, torch.device]:
    """Check `cfg` against the target's parameters; return the target's (dtype, device). same_width: the
    head's hidden size must be the target's (it shares the target's embedding and lm_head)."""
    if cfg.kind != kind:
        raise ValueError(f"cfg.kind: expected {kind!r} for this head module, got {cfg.kind!r}")
    embed = target_params["embed"]
    v, ht = embed.shape
    if v != cfg.model.vocab_size or ht != cfg.target_hidden_size:
        raise ValueError(
            f"target_params['embed']: expected shape [{cfg.model.vocab_size}, {cfg.target_hidden_size}] "
            f"(cfg.model.vocab_size, cfg.target_hidden_size), got {list(embed.shape)}"
        )
    if same_width and cfg.model.hidden_size != ht:
        raise ValueError(
            f"cfg.model.hidden_size: expected the target's hidden size {ht} for a {kind!r} head, "
            f"got {cfg.model.hidden_size}"
        )
    return embed.dtype, embed.device


def init(cfg: DraftConfig, target_params: dict, *, seed: int, device=None, fc_bias: bool = True) -> dict:
    """A fresh EAGLE-1 head sharing the target's embedding and lm_head (HF init for the rest)."""
    dtype, tdev = target_shape(cfg, target_params, kind="eagle")
    kw = {"dtype": dtype, "device": tdev if device is None else device}
    gen = torch.Generator().manual_seed(seed)
    h = cfg.model.hidden_size
    params = {"embed": target_params["embed"], "fc": L.normal(gen, h, 2 * h, **kw)}
    if fc_bias:
        params["fc_bias"] = L.zeros(h, **kw)
    params["layers"] = [
        L.init_layer(gen, cfg.model, attn_in=h, input_norm=i > 0, **kw)
        for i in range(cfg.model.num_hidden_layers)
    ]
    params["lm_head"] = llama.lm_head(target_params)
    return params


def project_target_hidden(
    params: dict, target_hidden: llama.TargetHidden, *, cfg: DraftConfig
) -> torch.Tensor:
    """The first step's hidden input: the target's final-normed last hidden [..., H]."""
    return target_hidden.last


def _hidden(params: dict, input_ids, hidden, positions, attend, *, cfg: DraftConfig, rows=None):
    m = cfg.model
    emb = F.embedding(input_ids, params["embed"])  # [..., H]
    x = L.linear(torch.cat((emb, hidden.to(emb.dtype)), dim=-1), params["fc"], params.get("fc_bias"))
    cos, sin = L.rope_cos_sin(positions, cfg=m, dtype=x.dtype)
    last = len(params["layers"]) - 1
    for i, p in enumerate(params["layers"]):
        attn_in = x if i == 0 else L.rms_norm(x, p["input_norm"], m.rms_norm_eps)  # layer 0: no input norm
        # every row's K/V of every layer go to the cache; only the last layer can drop rows after attention
        x = L.decoder_layer(p, attn_in, x, cos, sin, attend, cfg=m, layer=i, rows=rows if i == last else None)
    return x


def pre_logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., H]: what lm_head multiplies, the output itself (EAGLE-1 has no final norm)."""
    return out


def logits(params: dict, out: torch.Tensor, *, cfg: DraftConfig) -> torch.Tensor:
    """[..., V] logits of the head's output [..., H]: the target's lm_head, no final norm (EAGLE-1)."""
    return L.linear(pre_logits(params, out, cfg=cfg), params["lm_head"])


def _hf_config(cfg: DraftConfig, params: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "bias": "fc_bias" in params}


def _init_kwargs(config: dict) -> dict:
    """fc_bias from config.json's "bias" (a real bool: "no" is not True; default true, as published)."""
    bias = config.get("bias", True)
    if not isinstance(bias, bool):
        raise ValueError(f"config.bias: expected true or false, got {bias!r}")
    return {"fc_bias": bias}


KIND = register(
    HeadKind(
        name="eagle",
        init=init,
        project_target_hidden=project_target_hidden,
        hidden=_hidden,
        pre_logits=pre_logits,
        logits=logits,
        param_keys=("embed", "fc", "layers", "lm_head"),
        checkpoint_keys={
            "embed": "embed_tokens.weight",
            "fc": "fc.weight",
            "fc_bias": "fc.bias",
            "lm_head": "lm_head.weight",
        },
        dtype_key="fc",
        hf_config=_hf_config,
        init_kwargs=_init_kwargs,
        recognizes=lambda config, tensors: "fc.weight" in tensors,
        recognized_by="'fc.weight' keys",
        recognize_order=1,  # EAGLE-3 heads have fc.weight too
    )
)
