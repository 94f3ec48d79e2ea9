"""Static, hashable configurations.

Everything here is a Python value that, when it changes, legitimately changes the compiled program (shapes,
layer counts, the draft kind, K). Values that change between calls without a recompile live in the state as
tensors instead. Every config validates itself on construction and names the offending field (a
DraftConfig the fields no head kind decides: its kind's own rules are checked where it meets a head).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "llama3", "linear")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _bad(owner: str, name: str, expected: str, actual: Any) -> ValueError:
    return ValueError(f"{owner}.{name}: expected {expected}, got {actual!r}")


def _check_positive_ints(owner: str, obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _bad(owner, name, "a positive int", value)


def _check_positive_float(owner: str, obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _bad(owner, name, "a positive finite number", value)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3).

    Attributes:
        vocab_size: V, rows of the embedding and the lm_head.
        hidden_size: H.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: L.
        num_attention_heads: N query heads.
        num_key_value_heads: KV heads (GQA); divides N.
        head_dim: D; HF's default is hidden_size // num_attention_heads.
        max_position_embeddings: positions the model was trained for; the default max_model_len.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_type: "default", "linear" or "llama3".
        rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position_embeddings:
            the scaling parameters of "linear" (factor) and "llama3" (all four); ignored for "default".
        tie_word_embeddings: the lm_head reuses the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
        bos_token_id: or -1 when none.
        eos_token_ids: tuple of end-of-sequence ids (possibly empty).
        model_type: HF `model_type`.
        torch_dtype: HF dtype name of the checkpoint ("float32", "bfloat16", "float16").
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int = -1
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        owner = "ModelConfig"
        _check_positive_ints(
            owner,
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
                "rope_original_max_position_embeddings",
            ),
        )
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(owner, name, "True or False", getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise _bad(
                owner,
                "num_key_value_heads",
                f"a divisor of num_attention_heads={self.num_attention_heads}",
                self.num_key_value_heads,
            )
        if self.head_dim % 2:
            raise _bad(owner, "head_dim", "an even int (RoPE rotates pairs)", self.head_dim)
        for name in (
            "rms_norm_eps",
            "rope_theta",
            "rope_factor",
            "rope_low_freq_factor",
            "rope_high_freq_factor",
        ):
            _check_positive_float(owner, self, name)
        if self.rope_type not in ROPE_TYPES:
            raise _bad(owner, "rope_type", f"one of {ROPE_TYPES}", self.rope_type)
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise _bad(
                owner,
                "rope_high_freq_factor",
                f"> rope_low_freq_factor={self.rope_low_freq_factor}",
                self.rope_high_freq_factor,
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise _bad(owner, "model_type", f"one of {SUPPORTED_MODEL_TYPES}", self.model_type)
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            raise _bad(owner, "torch_dtype", "'float32', 'bfloat16' or 'float16'", self.torch_dtype)
        if not isinstance(self.eos_token_ids, tuple) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
            for t in self.eos_token_ids
        ):
            raise _bad(
                owner, "eos_token_ids", f"a tuple of ints in [0, {self.vocab_size})", self.eos_token_ids
            )
        if (
            isinstance(self.bos_token_id, bool)
            or not isinstance(self.bos_token_id, int)
            or not -1 <= self.bos_token_id < self.vocab_size
        ):
            raise _bad(owner, "bos_token_id", f"-1 or an int in [0, {self.vocab_size})", self.bos_token_id)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from an HF `config.json` dict.

        Accepts both RoPE spellings: the older top-level `rope_theta` + `rope_scaling` keys and the
        transformers-5 `rope_parameters` dict (which carries `rope_theta` itself).
        """
        if not isinstance(config, Mapping):
            raise ValueError(
                f"config: expected a mapping (a parsed config.json), got {type(config).__name__}"
            )
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = config.get("architectures")
            raise ValueError(
                f"config.model_type: expected one of {SUPPORTED_MODEL_TYPES} (Llama-family), "
                f"got {model_type!r} (architectures={archs!r})"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in config:
                raise ValueError(f"config.{key}: expected a value in config.json, got no such key")
            _hf_int(config, key, positive=True)
        _check_unread_fields(config)
        heads = config["num_attention_heads"]
        rope = _rope_from_hf(config)
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in eos_ids):
            raise ValueError(f"config.eos_token_id: expected an int, a list of ints or null, got {eos!r}")
        bos = _hf_int(config, "bos_token_id", default=None)
        head_dim = _hf_int(config, "head_dim", positive=True, default=None) or config["hidden_size"] // heads
        qwen2 = model_type == "qwen2"
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=_hf_int(config, "num_key_value_heads", positive=True, default=None) or heads,
            head_dim=head_dim,
            max_position_embeddings=_hf_int(config, "max_position_embeddings", positive=True, default=4096),
            rms_norm_eps=_hf_float(config, "rms_norm_eps", default=1e-6),
            tie_word_embeddings=_hf_bool(config, "tie_word_embeddings", default=False),
            attention_bias=_hf_bool(config, "attention_bias", default=qwen2),
            qk_norm=model_type == "qwen3",
            bos_token_id=-1 if bos is None else bos,
            eos_token_ids=eos_ids,
            model_type=model_type,
            torch_dtype=_hf_dtype(config),
            **rope,
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF `config.json` dict, readable by transformers 4.4x (rope_theta/rope_scaling) and 5.x."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        arch["mistral"] = "MistralForCausalLM"
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "torch_dtype": self.torch_dtype,
            "rope_theta": self.rope_theta,
            "rope_scaling": self._rope_scaling_dict(),
        }
        if self.bos_token_id >= 0:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
            )
        return out

    def _rope_scaling_dict(self) -> dict[str, Any] | None:
        if self.rope_type == "default":
            return None
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.rope_factor}
        return {
            "rope_type": "llama3",
            "factor": self.rope_factor,
            "low_freq_factor": self.rope_low_freq_factor,
            "high_freq_factor": self.rope_high_freq_factor,
            "original_max_position_embeddings": self.rope_original_max_position_embeddings,
        }


_MISSING = object()


def _hf_value(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """config[key]; `default` when the key is absent or null (HF's reading of a null field)."""
    value = config.get(key, _MISSING)
    return default if value is _MISSING or value is None else value


def _hf_int(config: Mapping[str, Any], key: str, *, positive: bool = False, default: Any = _MISSING) -> Any:
    """An int field of config.json (bools and floats refused, never truncated: 1.7 is not 1)."""
    value = config[key] if default is _MISSING else _hf_value(config, key, default)
    if value is default and default is not _MISSING:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0):
        raise ValueError(f"config.{key}: expected {'a positive' if positive else 'an'} int, got {value!r}")
    return value


def _hf_float(config: Mapping[str, Any], key: str, *, default: float, where: str = "config") -> float:
    """A positive finite number field of config.json (null counts as absent for optional fields only)."""
    value = config.get(key, default) if isinstance(config, Mapping) else default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{where}.{key}: expected a positive finite number, got {value!r}")
    return float(value)


def _hf_bool(config: Mapping[str, Any], key: str, *, default: bool) -> bool:
    """A true/false field of config.json ("no" is not True)."""
    value = _hf_value(config, key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.{key}: expected true or false, got {value!r}")
    return value


def _hf_dtype(config: Mapping[str, Any]) -> str:
    value = _hf_value(config, "torch_dtype", _hf_value(config, "dtype", "float32"))
    if value not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"config.torch_dtype: expected 'float32', 'bfloat16' or 'float16', got {value!r}")
    return value


SUPPORTED_ACTIVATIONS = ("silu", "swish")  # SwiGLU; transformers' ACT2FN maps both to SiLU


def _check_unread_fields(config: Mapping[str, Any]) -> None:
    """Fields fspec does not implement, refused instead of silently ignored: another MLP activation and MLP
    biases (fspec's layer is a bias-free SwiGLU)."""
    act = _hf_value(config, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"config.hidden_act: expected one of {SUPPORTED_ACTIVATIONS}, got {act!r}")
    if _hf_bool(config, "mlp_bias", default=False):
        raise ValueError("config.mlp_bias: expected false (fspec's MLP has no biases), got True")


def _rope_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping):
            raise ValueError(f"config.rope_parameters: expected an object or null, got {params!r}")
        scaling = dict(params)
        theta = scaling.get("rope_theta", config.get("rope_theta", 10000.0))
        where = "config.rope_parameters"
    else:
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping):
            raise ValueError(f"config.rope_scaling: expected an object or null, got {scaling!r}")
        scaling = dict(scaling)
        theta = config.get("rope_theta", 10000.0)
        where = "config.rope_scaling"
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}.rope_type: expected one of {ROPE_TYPES}, got {rope_type!r}")
    out: dict[str, Any] = {"rope_theta": _hf_float({"rope_theta": theta}, "rope_theta", default=1e4)}
    out["rope_type"] = rope_type
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = _hf_float(scaling, "factor", default=1.0, where=where)
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = _hf_float(scaling, "low_freq_factor", default=1.0, where=where)
        out["rope_high_freq_factor"] = _hf_float(scaling, "high_freq_factor", default=4.0, where=where)
        out["rope_original_max_position_embeddings"] = _hf_int(
            scaling, "original_max_position_embeddings", positive=True, default=8192
        )
    return out


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Static configuration of a draft head and of the draft loop that runs it.

    Attributes:
        kind: the name of a registered head kind (`fspec.models.heads`): "eagle" (EAGLE-1: fc(cat(emb,
            hidden)) then a layer), "eagle3" (fc over three target layers, a layer over cat(norm(emb),
            hidden_norm(hidden)), reduced vocabulary) or "mtp" (DeepSeek-style enorm/hnorm/eh_proj then a
            layer). Only its type is checked here (core knows no head); the kind's own rules (the kind exists,
            target_layer_ids, a reduced draft_vocab_size) are checked where the config meets a head
            (`fspec.models.heads.head_kind`: the heads' dispatch, init_draft, load_draft, draft_step /
            propose, generate).
        model: shape of the head's decoder layer(s); `model.vocab_size` is the TARGET vocabulary.
        num_speculative_steps: K, draft tokens proposed per round.
        draft_vocab_size: Vd, the head's output vocabulary (EAGLE-3 maps it back with d2t); equals
            `model.vocab_size` for heads without a reduced vocabulary.
        target_hidden_size: hidden size of the target the head reads.
        target_layer_ids: for "eagle3", the target layers at whose INPUT the hidden states are taken (HF's
            `hidden_states[i]`, as EAGLE-3 and vLLM do) and combined by the head's fc (low, mid, high); empty
            for other kinds.
        block_size: tokens per KV-cache block.
        max_model_len: positions are clamped below it; the cache holds at most this many per request.
        greedy_drafts: drafts are argmax (q is one-hot, no probabilities stored); otherwise sampled at the
            request's temperature with their processed probabilities kept for lossless verification.
    """

    kind: str
    model: ModelConfig
    num_speculative_steps: int = 3
    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    target_layer_ids: tuple[int, ...] = ()
    block_size: int = 16
    max_model_len: int = 4096
    greedy_drafts: bool = False

    def __post_init__(self) -> None:
        owner = "DraftConfig"
        if not isinstance(self.kind, str) or not self.kind:
            raise _bad(owner, "kind", "a head kind's name (a non-empty str)", self.kind)
        if not isinstance(self.model, ModelConfig):
            raise _bad(owner, "model", "a ModelConfig", type(self.model).__name__)
        # 0 means "the same as the model's": resolved here so every consumer sees the final value.
        if self.draft_vocab_size == 0:
            object.__setattr__(self, "draft_vocab_size", self.model.vocab_size)
        if self.target_hidden_size == 0:
            object.__setattr__(self, "target_hidden_size", self.model.hidden_size)
        _check_positive_ints(
            owner,
            self,
            (
                "num_speculative_steps",
                "draft_vocab_size",
                "target_hidden_size",
                "block_size",
                "max_model_len",
            ),
        )
        if not isinstance(self.greedy_drafts, bool):
            raise _bad(owner, "greedy_drafts", "True or False", self.greedy_drafts)
        if self.num_speculative_steps > 16:
            raise _bad(owner, "num_speculative_steps", "an int in [1, 16]", self.num_speculative_steps)
        if self.draft_vocab_size > self.model.vocab_size:
            raise _bad(
                owner,
                "draft_vocab_size",
                f"<= model.vocab_size={self.model.vocab_size}",
                self.draft_vocab_size,
            )

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)


def env_switches() -> dict[str, str]:
    """The environment variables of this process that change what runs: fspec's (FSPEC_*) and Inductor's
    (TORCHINDUCTOR_ENABLE_PDL, ...), sorted: benchmarks record them beside their results."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FSPEC_", "TORCHINDUCTOR_"))}


def size_bucket(n: int) -> int:
    """A compiled shape for a size n (KV-cache blocks, prompt tokens): 16 up to 16, then one of four sizes per
    power of two (2^k times 1, 1.25, 1.5 or 1.75), never below n and at most 25% above it.

    Compiled graphs fix these shapes, so every distinct size compiles anew (~20 s on an H200 at 1B shapes);
    buckets make nearby sizes (max_new_tokens, prompt lengths) share graphs."""
    if n <= 16:
        return 16
    top = 1 << (n - 1).bit_length()  # the power of two >= n
    return next(q for q in (top // 2 + top // 8 * i for i in range(1, 5)) if q >= n)


def bucket_for(batch_size: int) -> int:
    """The smallest batch bucket holding `batch_size` requests (padding rows fill the rest)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    for b in BATCH_BUCKETS:
        if batch_size <= b:
            return b
    raise ValueError(f"batch_size: expected at most {BATCH_BUCKETS[-1]}, got {batch_size}")
