"""Functional Llama-family target (Llama 2/3, Mistral, Qwen2, Qwen3): `init`, `forward`, `forward_dense`.

Parameters are a dict pytree of frozen `torch.nn.Parameter`s (static inputs for CUDA graphs), no None leaves:

    {"embed": [V, H],
     "layers": [{"q": [N·D, H], "k": [Nkv·D, H], "v": [Nkv·D, H], "o": [H, N·D],
                 "gate": [I, H], "up": [I, H], "down": [H, I], "input_norm": [H], "post_norm": [H],
                 optional "q_bias", "k_bias", "v_bias" (Qwen2; Llama/Qwen3 with attention_bias), "o_bias",
                 optional "q_norm", "k_norm" [D] (Qwen3)}, ...],
     "norm": [H],
     "lm_head": [V, H]}          # absent when cfg.tie_word_embeddings (the embedding is reused)

Numerics match transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (tests compare logits).
Logits come out in the parameters' dtype, as HF's do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fspec.core.cache import KVCache
from fspec.core.config import ModelConfig
from fspec.core.state import AttnMetadata
from fspec.models import layers as L
from fspec.models import packed
from fspec.ops.attention import Attend, bind, causal


class TargetHidden(NamedTuple):
    """Hidden states a draft head reads from the target.

    Attributes:
        last: [..., H], the final hidden after the final norm (HF LlamaModel's `last_hidden_state`; EAGLE-1
            and MTP read it).
        aux: [..., k·H], the hidden states at the *input* of layers `aux_layer_ids`, concatenated in that
            order (EAGLE-3 reads k = 3); [..., 0] when no layer was asked for. Id L (the number of layers)
            is HF's `hidden_states[L]`, the final hidden after the final norm (= `last`).
    """

    last: torch.Tensor
    aux: torch.Tensor


def eagle3_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 reads: (2, L // 2, L - 3), clamped into [0, L - 1] and sorted.

    SafeAILab/EAGLE eagle/model/modeling_llama_kv.py (LlamaModel.forward) appends `hidden_states` *before*
    calling layer idx when ``idx == len(self.layers) - 3 or idx == len(self.layers) // 2 or idx == 2``,
    i.e. the input of layers 2, 16, 29 for Llama-3.1-8B (L = 32), in layer order; vLLM uses the same
    (2, L // 2, L - 3). For L < 6 the three ids collide or leave the range: we clamp (L = 4 gives (1, 2, 2);
    L = 1 gives (0, 0, 0)) and keep duplicates, so fc always sees 3·H features.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
    top = num_layers - 1
    return tuple(sorted((min(2, top), min(num_layers // 2, top), max(num_layers - 3, 0))))  # type: ignore[return-value]


def init(
    cfg: ModelConfig, *, seed: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> dict:
    """Random parameters with HF's initialization (weights N(0, 0.02), norms 1, biases 0)."""
    gen = torch.Generator().manual_seed(seed)
    kw = {"dtype": dtype, "device": device}
    h = cfg.hidden_size
    params: dict = {
        "embed": L.normal(gen, cfg.vocab_size, h, **kw),
        "layers": [L.init_layer(gen, cfg, attn_in=h, **kw) for _ in range(cfg.num_hidden_layers)],
        "norm": L.ones(h, **kw),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = L.normal(gen, cfg.vocab_size, h, **kw)
    return params


def lm_head(params: dict) -> torch.Tensor:
    """[V, H] output projection: `lm_head`, or the embedding when tied."""
    return params["lm_head"] if "lm_head" in params else params["embed"]


def _body(
    params: dict,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    *,
    cfg: ModelConfig,
    aux_layer_ids: tuple[int, ...],
    logit_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TargetHidden]:
    """Embedding, layers, final norm and lm_head over any leading shape [...] (lm_head over the rows
    `logit_rows` of a flat [T] input only, when given)."""
    _check_aux_ids(aux_layer_ids, cfg)
    x = F.embedding(input_ids, params["embed"])  # [..., H]
    cos, sin = L.rope_cos_sin(positions, cfg=cfg, dtype=x.dtype)
    captured = {}
    for i, p in enumerate(params["layers"]):
        if i in aux_layer_ids:
            captured[i] = x
        if L.use_fused_layer(p, x, cfg):
            x = L.fused_decoder_layer(p, x, cos, sin, attend, cfg=cfg, layer=i)
            continue
        attn_in = L.rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
        x = L.decoder_layer(p, attn_in, x, cos, sin, attend, cfg=cfg, layer=i)
    last = L.rms_norm(x, params["norm"], cfg.rms_norm_eps)
    captured[cfg.num_hidden_layers] = last  # HF's hidden_states[L]: the final hidden, after the final norm
    aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else x[..., :0]
    head_in = last if logit_rows is None else last.index_select(0, logit_rows)
    return packed.linear(head_in, lm_head(params)), TargetHidden(last=last, aux=aux)


def forward(
    params: dict,
    input_ids: torch.Tensor,
    meta: AttnMetadata,
    cache: KVCache | None,
    *,
    cfg: ModelConfig,
    backend: str = "auto",
    aux_layer_ids: tuple[int, ...] = (),
    max_query_len: int | None = None,
    max_context: int | None = None,
    logit_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TargetHidden, KVCache | None]:
    """Run T tokens of B requests through the target.

    input_ids [T] int64, `meta` describes where they sit (positions [T], -1 = padding). With the "reference"
    backend the K/V of every layer are written into `cache` at meta.slot_mapping (donated: written in place
    and returned); "dense" attends among these T tokens only and leaves `cache` untouched (may be None).
    aux_layer_ids (static): layers whose input hidden goes into `TargetHidden.aux` (EAGLE-3:
    `eagle3_layer_ids`).
    logit_rows: [R] int64 rows of the T whose logits are wanted (a prefill wants each request's last one:
    the lm_head over every prompt row is a fifth of a SmolLM2 prefill's FLOPs and [T, V] floats), or None
    for all.
    Returns (logits [T, V] or [R, V], TargetHidden(last [T, H], aux [T, len(aux_layer_ids)·H]), cache).
    """

    attend = bind(
        meta, cache, backend=backend, max_query_len=max_query_len, max_context=max_context,
        rope=L.rope_key(cfg),
    )  # fmt: skip
    logits, hidden = _body(
        params, input_ids, meta.positions, attend, cfg=cfg, aux_layer_ids=aux_layer_ids, logit_rows=logit_rows
    )
    return logits, hidden, cache


def forward_dense(
    params: dict, input_ids: torch.Tensor, *, cfg: ModelConfig, aux_layer_ids: tuple[int, ...] = ()
) -> tuple[torch.Tensor, TargetHidden]:
    """Causal forward over input_ids [B, S] (positions 0..S-1, no cache, differentiable).

    Returns (logits [B, S, V], TargetHidden(last [B, S, H], aux [B, S, len(aux_layer_ids)·H])).
    """
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).expand(b, s)
    return _body(params, input_ids, positions, causal, cfg=cfg, aux_layer_ids=aux_layer_ids)


def _check_aux_ids(aux_layer_ids: tuple[int, ...], cfg: ModelConfig) -> None:
    if not isinstance(aux_layer_ids, tuple) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= cfg.num_hidden_layers
        for i in aux_layer_ids
    ):
        raise ValueError(
            f"aux_layer_ids: expected a tuple of layer ids in [0, {cfg.num_hidden_layers}], "
            f"got {aux_layer_ids!r}"
        )
