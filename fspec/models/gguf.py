"""Llama-architecture GGUF files (llama.cpp's format) as an HF config dict and HF-keyed tensors.

`read_gguf` is what `fspec.load_target` calls for a path ending in ``.gguf``. It parses the file
(`fspec.models.gguf_file`: memory-mapped, header and metadata in one pass), and

1. builds an HF config.json dict from the ``llama.*`` metadata (`hf_config`), which `ModelConfig.from_hf`
   reads like any other: embedding_length -> hidden_size, block_count, attention.head_count(_kv),
   feed_forward_length, context_length, rope.freq_base, attention.layer_norm_rms_epsilon, vocab_size; tied
   embeddings when there is no ``output.weight``; BOS / EOS (and EOT / EOM) ids from ``tokenizer.ggml.*``;
   RoPE scaling from ``llama.rope.scaling.*`` or a ``rope_freqs.weight`` tensor (Llama 3.1's scaling, which
   llama.cpp stores as per-frequency divisors);
2. dequantizes every tensor (the `gguf` package's codecs, `dequantize`; F16 / BF16 are reinterpreted, not
   converted) and renames it to fspec's HF keys (`hf_key`);
3. undoes the row permutation llama.cpp's convert_hf_to_gguf.py applies to q_proj / k_proj (`unpermute_rows`);
4. builds the tokenizer (`fspec.models.gguf_tokenizer`) and takes ``tokenizer.chat_template``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from einops import rearrange

from fspec.kernels.rope_cos_sin import inv_freq
from fspec.models.gguf_file import GGUFFile, GGUFFormatError, TensorInfo, parse
from fspec.models.gguf_tokenizer import build_tokenizer

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANT_TYPES)

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
DEQUANT_CHUNK = 1 << 20  # elements dequantized at a time: bounds the codec's float32 temporaries
_IGNORED = ("rope_freqs.weight",)  # read into the config (RoPE scaling), not a parameter


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """What a Llama GGUF file holds, in HF terms.

    Attributes:
        config: an HF config.json dict for `ModelConfig.from_hf` ("torch_dtype" is the tensors' dtype).
        tensors: HF key (``model.layers.{i}.self_attn.q_proj.weight``, ...) -> CPU tensor, q/k rows in HF
            order; matrices [out, in], norms [H].
        tokenizer: a `tokenizers.Tokenizer`, or None where the file's tokenizer is not one `gguf_tokenizer`
            builds (a warning said why).
        chat_template: the Jinja chat template (``tokenizer.chat_template``), or None.
    """

    config: dict
    tensors: dict
    tokenizer: Any = None
    chat_template: str | None = None


def read_gguf(path, *, dtype: torch.dtype | None = None) -> GGUFModel:
    """Read a Llama GGUF file; float tensors come out in `dtype`, default float32 when any matrix is
    quantized (or the file mixes float types), else the matrices' own F16 / BF16 / F32.

    Raises FileNotFoundError for a missing file; ValueError naming the file for one that is not GGUF, is
    truncated, has another architecture, an unsupported tensor type (named with its tensor) or names
    fspec does not map.
    """
    path = Path(path)
    # 1. open, check every tensor is one we read and map, before dequantizing any
    file = _open(path)
    meta = file.metadata
    shapes = {t.name: t.shape for t in file.tensors}
    config = hf_config(meta, shapes, where=path)
    # 2. dequantize, rename, undo the q/k permutation; rope_freqs goes into the config
    dtype = dtype or _file_dtype(file)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors = {}
    for t in file.tensors:
        value = dequantize(t)
        if t.name == "rope_freqs.weight":
            config.update(llama3_scaling(value, config, where=path))
            continue
        key = hf_key(t.name)
        proj = key.split(".")[-2]
        if proj in heads:
            value = unpermute_rows(value, heads[proj])
        tensors[key] = value.to(dtype) if value.is_floating_point() else value
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    # 3. tokenizer and chat template
    return GGUFModel(
        config=config,
        tensors=tensors,
        tokenizer=build_tokenizer(meta, where=str(path)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _check_tensors(file: GGUFFile, path: Path) -> None:
    for t in file.tensors:
        if t.type_name not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name!r} has type {t.type_name}; expected one of {SUPPORTED_TYPES}"
            )
    unknown = [t.name for t in file.tensors if t.name not in _IGNORED and hf_key(t.name) is None]
    if unknown:
        raise ValueError(
            f"{path}: unexpected tensors {unknown[:4]}{' ...' if len(unknown) > 4 else ''} for a Llama GGUF "
            f"(expected token_embd, blk.N.attn_q/k/v/output, attn_norm, ffn_gate/up/down, ffn_norm, "
            f"output_norm, output)"
        )


def _open(path: Path) -> GGUFFile:
    """Parse `path` (`fspec.models.gguf_file.parse`); check every tensor is of a type fspec reads and lies
    inside the file."""
    if not path.is_file():
        raise FileNotFoundError(f"path: expected a GGUF file, got {str(path)!r} (no such file)")
    try:
        file = parse(path)
    except GGUFFormatError as e:
        text = str(e)
        if not text.startswith("expected a GGUF file"):
            text = f"expected a complete GGUF file, could not read it ({text})"
        raise ValueError(f"{path}: {text}") from None
    _check_tensors(file, path)
    size = path.stat().st_size
    for t in file.tensors:
        if t.data is None:
            raise ValueError(
                f"{path}: tensor {t.name!r} expected {t.n_bytes} bytes at offset {t.offset}, the file "
                f"has {max(size - t.offset, 0)} (truncated?)"
            )
    return file


def hf_config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], *, where) -> dict[str, Any]:
    """An HF config.json dict from GGUF metadata `meta` and the tensors' numpy-order `shapes`."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{where}: general.architecture: expected 'llama', got {arch!r}")
    llama = {k.removeprefix("llama."): v for k, v in meta.items() if k.startswith("llama.")}
    required = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
    for key in required:
        if key not in llama:
            raise ValueError(f"{where}: expected metadata llama.{key}, the file has none")
    heads = llama["attention.head_count"]
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = llama.get("vocab_size") or (len(tokens) if tokens else shapes.get("token_embd.weight", (0,))[0])
    hidden = llama["embedding_length"]
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": llama["feed_forward_length"],
        "num_hidden_layers": llama["block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": llama.get("attention.head_count_kv", heads),
        "head_dim": llama.get("attention.key_length") or llama.get("rope.dimension_count") or hidden // heads,
        "max_position_embeddings": llama.get("context_length", 4096),
        "rms_norm_eps": llama.get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": llama.get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(llama, where=where),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
    }
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    return config


def _rope_scaling(llama: dict[str, Any], *, where) -> dict[str, Any] | None:
    kind = llama.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(llama.get("rope.scaling.factor", 1.0))}
    raise ValueError(f"{where}: llama.rope.scaling.type: expected 'none' or 'linear', got {kind!r}")


def llama3_scaling(freqs: torch.Tensor, config: dict[str, Any], *, where) -> dict[str, Any]:
    """The config's "rope_scaling" for a ``rope_freqs.weight`` tensor: llama.cpp's convert script stores
    Llama 3.1 scaling as the divisor of each inverse frequency (1 for short wavelengths, `factor` for long
    ones, interpolated between). The file keeps only the divisors, so they are matched against Llama 3's
    published parameters (low_freq_factor 1, high_freq_factor 4, original context 8192) with factor =
    the largest divisor; other divisors are a ValueError rather than a silently different RoPE."""
    factor = float(freqs.max())
    if factor == 1.0 and bool((freqs == 1).all()):
        return {}
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = (config["rope_theta"], factor, 1.0, 4.0, 8192)
    base = inv_freq(config["head_dim"], "default", rope, "cpu")
    expected = base / inv_freq(config["head_dim"], "llama3", rope, "cpu")
    if freqs.shape != expected.shape or not torch.allclose(freqs.float(), expected, rtol=1e-4, atol=0):
        raise ValueError(
            f"{where}: rope_freqs.weight: expected Llama 3's RoPE scaling divisors (factor {factor:g}, "
            f"low_freq_factor 1, high_freq_factor 4, original context 8192), got other values"
        )
    return {"rope_scaling": scaling}


def hf_key(name: str) -> str | None:
    """fspec's HF key for a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.
    q_proj.weight``), None for a name outside the Llama layout."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{int(parts[1])}.{_LAYER[parts[2]]}.{suffix}"
    return None


def dequantize(t: TensorInfo) -> torch.Tensor:
    """A tensor of the file as a CPU tensor in numpy order ([out, in] for a matrix): F32 / F16 / BF16 as
    stored, quantized types dequantized to float32 by the `gguf` package's codec of the type
    (`gguf.quants.Q4_1.dequantize_rows`, ...), DEQUANT_CHUNK elements at a time. Copies out of the memmap."""
    import gguf

    kind = t.type_name
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.array(t.data))
    if kind == "BF16":  # bytes [..., 2·in]: reinterpret as bfloat16, as stored
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    # `gguf.quants.dequantize` runs the codec over groups of 16 rows (2.9 s for SmolLM2's 211 Q4_1 matrices on
    # one thread); its codec class's `dequantize_rows` over ~1M-element chunks gives the same values in 0.4 s
    codec = getattr(gguf.quants, kind)
    rows = t.data.reshape(-1, t.data.shape[-1])
    out = np.empty((rows.shape[0], t.shape[-1]), dtype=np.float32)
    step = max(1, DEQUANT_CHUNK // t.shape[-1])
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = codec.dequantize_rows(rows[i : i + step])
    return torch.from_numpy(out.reshape(t.shape))


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's `permute` of q_proj (heads = N) / k_proj (heads = Nkv) rows.

    llama.cpp's RoPE rotates adjacent pairs (GPT-J style), HF's rotates the two halves of each head (NeoX
    style), so the converter reorders each head's D rows from (half, i) to (i, half), i < D/2:
    ``w.reshape(n, 2, D/2, ...).swapaxes(1, 2)``. The inverse reads the rows as (n, i, half) and puts half
    first again. Works for a weight [n·D, in] and a bias [n·D]."""
    if w.shape[0] % (2 * heads):
        raise ValueError(f"w: expected rows divisible by 2·heads = {2 * heads}, got shape {list(w.shape)}")
    return rearrange(w, "(n i half) ... -> (n half i) ...", n=heads, half=2).contiguous()


def _file_dtype(file: GGUFFile) -> torch.dtype:
    """The dtype a file's tensors load in by default: the matrices' own when all of them are one float type,
    float32 when any is quantized or they mix."""
    kinds = {t.type_name for t in file.tensors if len(t.shape) > 1}
    return FLOAT_TYPES[kinds.pop()] if len(kinds) == 1 and kinds <= set(FLOAT_TYPES) else torch.float32
