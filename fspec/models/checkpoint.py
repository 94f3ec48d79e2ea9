"""Checkpoints in the layouts other tools read: HF for targets, published EAGLE / EAGLE-3 layouts for heads.

Target (`load_target` / `save_target`): a local HF directory with config.json (either RoPE spelling),
weights in `model.safetensors` or shards `model-0000i-of-0000n.safetensors` listed by
`model.safetensors.index.json`, and an optional tokenizer.json. Keys: ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight`` (absent when
tied); transformers loads what `save_target` writes.

Draft heads (`load_draft` / `save_draft`), keys as in SafeAILab/EAGLE's state dicts (eagle/model/cnets1.py and
cnets.py `Model`):
* EAGLE-1: ``fc.weight``, ``fc.bias``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.*``,
  ``layers.{i}.post_attention_layernorm.weight`` (and ``input_layernorm`` for i > 0); config "bias" tells
  whether fc has a bias.
* EAGLE-3: ``fc.weight``, ``midlayer.self_attn.*``, ``midlayer.input_layernorm.weight``,
  ``midlayer.hidden_norm.weight``, ``midlayer.post_attention_layernorm.weight``, ``midlayer.mlp.*``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``; config architectures ["LlamaForCausalLMEagle3"] with
  `draft_vocab_size` (and `target_hidden_size` when it differs from hidden_size).
* MTP: DeepSeek-V3's MTP-layer names without the ``model.layers.{L}.`` prefix (vLLM deepseek_mtp.py):
  ``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight``, ``self_attn.*``, ``mlp.*``,
  ``input_layernorm.weight``, ``post_attention_layernorm.weight``, ``shared_head.norm.weight``.
The embedding (``embed_tokens.weight``) and, for EAGLE-1/MTP, the lm_head (``lm_head.weight`` /
``shared_head.head.weight``) are the target's and are not saved; a checkpoint that carries its own copy loads
it as the head's own. An EAGLE-3 head made with `init_draft(tie_lm_head=True)` saves no ``lm_head.weight``
either: config.json records ``"tie_lm_head": true`` and `load_draft` rebuilds it from the target's lm_head.
config.json records the kind under "fspec_draft"; without it (published heads) the kind is read from the
architecture or the weight names.

What differs per kind (key names, the config.json fields, how a published head is recognised) is the kind's
`HeadKind` (`fspec.models.heads.base`); this module branches on no kind name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fspec.core.config import DraftConfig, ModelConfig
from fspec.models import chat, llama
from fspec.models import layers as L
from fspec.models.generation_config import GenerationDefaults, read_generation_config
from fspec.models.gguf import read_gguf
from fspec.models.heads import HeadKind, head_kind, kinds, lookup, names
from fspec.models.tokenizer import wrap as wrap_tokenizer

SHAREABLE = ("embed", "lm_head")  # draft params that default to the target's Parameter objects


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target. Attributes: cfg (ModelConfig), params (dict pytree), tokenizer (a
    `fspec.models.tokenizer.ChatTokenizer`, a `tokenizers.Tokenizer` with `apply_chat_template`, or None),
    chat_template (the checkpoint's Jinja chat template, or None; `render_chat` renders it), generation (the
    checkpoint's generation_config.json as a `GenerationDefaults`, or None: its EOS ids are `generate`'s
    default EOS set, `sampling_defaults` its sampling settings).

    A plain `tokenizers.Tokenizer` given as tokenizer is wrapped in a ChatTokenizer holding chat_template and
    the config's BOS / EOS ids (again after `dataclasses.replace`, so the two never disagree)."""

    cfg: ModelConfig
    params: dict
    tokenizer: Any = None
    chat_template: str | None = None
    generation: GenerationDefaults | None = None

    def __post_init__(self):
        tok = wrap_tokenizer(
            self.tokenizer,
            chat_template=self.chat_template,
            bos_token_id=self.cfg.bos_token_id,
            eos_token_ids=self.cfg.eos_token_ids,
        )
        object.__setattr__(self, "tokenizer", tok)


@dataclasses.dataclass(frozen=True)
class Draft:
    """A draft head. Attributes: cfg (DraftConfig), params (dict pytree), shared (names of params taken from
    the target: its own Parameter objects, or a tied EAGLE-3 lm_head's rows of the target's lm_head; frozen in
    training, not saved, re-linked or rebuilt on load)."""

    cfg: DraftConfig
    params: dict
    shared: tuple[str, ...] = ()


# --- key maps ----------------------------------------------------------------------------------------------


def target_key_map(params: dict) -> dict[str, tuple]:
    """HF key -> path into `params` (a tuple of dict keys / list indices)."""
    keys = {"model.embed_tokens.weight": ("embed",), "model.norm.weight": ("norm",)}
    for i, layer in enumerate(params["layers"]):
        keys.update({f"model.layers.{i}.{L.LAYER_KEYS[n]}": ("layers", i, n) for n in layer})
    if "lm_head" in params:
        keys["lm_head.weight"] = ("lm_head",)
    return keys


def draft_key_map(kind: str, params: dict) -> dict[str, tuple]:
    """Published-layout key -> path into the head's `params` (`HeadKind.key_map` of head kind `kind`)."""
    return lookup(kind).key_map(params)


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


# --- files --------------------------------------------------------------------------------------------------


def _directory(path) -> Path:
    path = _as_path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"path: expected a checkpoint directory, got {str(path)!r} (no such directory)"
        )
    return path


def _as_path(path) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path: expected a str or os.PathLike, got {type(path).__name__} {path!r}")
    return Path(path)


def _read_json(file: Path, what: str = "a JSON object") -> dict:
    """A JSON object from `file`; ValueError naming the file for unreadable, invalid or non-object JSON."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: expected {what}, got invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected {what}, got a JSON {type(data).__name__}")
    return data


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: expected an HF config.json in the checkpoint directory, found none")
    return _read_json(file, "an HF config.json (a JSON object)")


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a bad header
        raise ValueError(f"{file}: expected a safetensors file, got an unreadable one ({e})") from None


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip / pickle raises RuntimeError, EOFError, UnpicklingError, ...
        raise ValueError(f"{file}: expected a torch state dict, got an unreadable file ({e})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{file}: expected a dict of tensors, got {type(tensors).__name__}")
    return tensors


def _read_tensors(path: Path, *, allow_bin: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards listed in `model.safetensors.index.json`."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: expected a 'weight_map' object, got {type(weight_map).__name__}")
        tensors = {}
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: expected 'weight_map' values to be shard file names")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise FileNotFoundError(f"{path / shard}: listed in {index.name}, but no such file")
            tensors.update(_load_safetensors(path / shard))
        return tensors
    if (path / "model.safetensors").is_file():
        return _load_safetensors(path / "model.safetensors")
    if allow_bin and (path / "pytorch_model.bin").is_file():  # published EAGLE heads ship this
        return _load_bin(path / "pytorch_model.bin")
    raise FileNotFoundError(
        f"{path}: expected model.safetensors or model.safetensors.index.json with its shards, found neither"
    )


def _write_tensors(tensors: dict[str, torch.Tensor], path: Path, *, max_shard_bytes: int | None) -> None:
    tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    meta = {"format": "pt"}  # transformers refuses safetensors without it
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, path / "model.safetensors", metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _fill(
    template: dict, keys: dict[str, tuple], tensors: dict[str, torch.Tensor], *, where: Path, dtype, device
) -> dict:
    """Copy `tensors` into a copy of `template` (meta-device shapes) by `keys`, checking names and shapes."""
    out = _copy_structure(template)
    for key, path in keys.items():
        expected = tuple(_get(template, path).shape)
        if key not in tensors:
            raise ValueError(f"{where}: missing key {key!r} (expected shape {list(expected)})")
        t = tensors[key]
        if tuple(t.shape) != expected:
            raise ValueError(f"{where}: key {key!r} expected shape {list(expected)}, got {list(t.shape)}")
        want = _get(template, path).dtype if not t.is_floating_point() else (dtype or t.dtype)
        _set(out, path, L.param(t.to(device=device, dtype=want)))
    return out


def _copy_structure(tree):
    if isinstance(tree, dict):
        return {k: _copy_structure(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_structure(v) for v in tree]
    return tree


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --- target -------------------------------------------------------------------------------------------------


def load_target(
    path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu", fuse: bool = True
) -> Target:
    """A `Target` from a local HF directory or a Llama-architecture `.gguf` file (llama.cpp's format,
    `fspec.models.gguf`); dtype None keeps the checkpoint's (float32 for a quantized GGUF, which is
    dequantized).

    fuse (default): each layer's q/k/v and gate/up weights are concatenated (`fuse_projections`), so a
    decode step runs 4 matmuls per layer instead of 7 (measured on an H200, BENCHMARKS.md); `save_target`
    writes the HF layout either way. fuse=False keeps HF's separate weights.

    The chat template comes from chat_template.jinja or tokenizer_config.json's "chat_template" (a GGUF's
    ``tokenizer.chat_template``). A directory's generation_config.json, if any, becomes `Target.generation`
    (`fspec.models.generation_config`); a GGUF file has none.

    Raises FileNotFoundError for a missing directory, file, config or weights; ValueError for an unsupported
    architecture or a missing, unexpected or mis-shaped key (named, with the expected and actual shapes), and
    for a GGUF file that is truncated, not GGUF, or holds an unsupported tensor type, and for a malformed
    generation_config.json (the file and key named).
    """
    _check_fuse(fuse)
    path = _as_path(path)
    dtype = _check_dtype(dtype)
    device = _check_device(device)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        gguf = read_gguf(path, dtype=dtype)
        cfg = ModelConfig.from_hf(gguf.config)
        params = _target_params(cfg, gguf.tensors, where=Path(path), dtype=dtype, device=device, fuse=fuse)
        return Target(cfg=cfg, params=params, tokenizer=gguf.tokenizer, chat_template=gguf.chat_template)
    path = _directory(path)
    cfg = ModelConfig.from_hf(_read_config(path))
    generation = read_generation_config(path, vocab_size=cfg.vocab_size)
    tensors = _read_tensors(path)
    params = _target_params(cfg, tensors, where=path, dtype=dtype, device=device, fuse=fuse)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for bad JSON or a bad model
            raise ValueError(
                f"{path / 'tokenizer.json'}: expected a tokenizers JSON file, got an unreadable one ({e})"
            ) from None
    chat_template = _read_chat_template(path)
    return Target(
        cfg=cfg, params=params, tokenizer=tokenizer, chat_template=chat_template, generation=generation
    )


def _target_params(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], *, where: Path, dtype, device, fuse: bool
) -> dict:
    """The target's params from HF-keyed `tensors`, names and shapes checked against `cfg`."""
    template = llama.init(cfg, seed=0, device="meta")
    keys = target_key_map(template)
    ignored = {k for k in tensors if k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        ignored.add("lm_head.weight")  # tied: the embedding is the head, whatever the file carries
    unexpected = sorted(set(tensors) - set(keys) - ignored)
    if unexpected:
        raise ValueError(
            f"{where}: unexpected keys {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''} for "
            f"model_type={cfg.model_type!r} (does config.json match the weights?)"
        )
    params = _fill(template, keys, tensors, where=where, dtype=dtype, device=device)
    if fuse:
        L.fuse_projections_(params)
    return params


def _read_chat_template(path: Path) -> str | None:
    """chat_template.jinja (which transformers prefers), else tokenizer_config.json's "chat_template" (a
    string, or a list of {"name", "template"} whose "default" entry is taken), else None."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return None
    template = _read_json(file).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def render_chat(target: Target, messages, *, add_generation_prompt: bool = True) -> str:
    """`messages` (a list of {"role": str, "content": str}) rendered with the target's chat template, as
    transformers' `apply_chat_template(..., tokenize=False)` renders it (`fspec.models.chat.render`), given
    `messages`, `add_generation_prompt`, `bos_token` and `eos_token` (the strings of the config's BOS and
    first EOS id; "" without a tokenizer). `target.tokenizer.apply_chat_template` renders the same and
    tokenizes it.

    Raises ValueError when the target has no template, for malformed messages (named by index), and when
    the template itself refuses them (its `raise_exception`).
    """
    if not target.chat_template:
        raise ValueError("target.chat_template: expected a Jinja chat template, got None")
    names = chat.special_tokens(target.tokenizer, target.cfg.bos_token_id, target.cfg.eos_token_ids)
    return chat.render(target.chat_template, messages, add_generation_prompt=add_generation_prompt, **names)


def save_target(target: Target, path, *, max_shard_bytes: int | None = None) -> None:
    """Write `target` as an HF directory transformers can load (sharded past `max_shard_bytes`): the
    weights, config.json, the tokenizer as tokenizer.json and the chat template as chat_template.jinja (a
    GGUF's, say), which `load_target` and transformers read back."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = L.unfuse_projections(target.params, target.cfg)  # HF keeps q/k/v and gate/up apart
    keys = target_key_map(params)
    _write_tensors({k: _get(params, p) for k, p in keys.items()}, path, max_shard_bytes=max_shard_bytes)
    config = target.cfg.to_hf()
    config["torch_dtype"] = _DTYPE_NAMES.get(target.params["embed"].dtype, "float32")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if target.tokenizer is not None:
        target.tokenizer.save(str(path / "tokenizer.json"))
    if target.chat_template:
        (path / "chat_template.jinja").write_text(target.chat_template, encoding="utf-8")


# --- draft --------------------------------------------------------------------------------------------------


def _target_param(name: str, target: Target) -> torch.Tensor:
    return target.params["embed"] if name == "embed" else llama.lm_head(target.params)


def _shared_names(params: dict, target: Target) -> tuple[str, ...]:
    return tuple(n for n in SHAREABLE if n in params and params[n] is _target_param(n, target))


def _positive(name: str, value, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def init_draft(
    target: Target,
    *,
    kind: str = "eagle3",
    seed: int = 0,
    num_speculative_steps: int = 3,
    draft_vocab_size: int | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
    greedy_drafts: bool = False,
    draft_ids: torch.Tensor | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
    tie_lm_head: bool = False,
) -> Draft:
    """A fresh one-layer head of `kind` for `target`, with the target's layer shapes and RoPE.

    target_layer_ids (EAGLE-3 only): the three target layers whose input the head reads; default
    `eagle3_layer_ids(L)`, the published (2, L // 2, L - 3).
    intermediate_size: the head layer's MLP width; default the target's (config.json records it).

    draft_vocab_size (EAGLE-3 only; default V) with draft_ids, the target ids of the draft vocabulary
    (default 0..Vd-1). max_model_len defaults to the target's max_position_embeddings.

    tie_lm_head (EAGLE-3 only; the head as wide as its target): the output layer is the target's lm_head
    rows of the draft vocabulary instead of a trained copy the head owns: frozen in training, not saved (the
    checkpoint records the tie and `load_draft` rebuilds it from the target), so a draft vocabulary of any
    size costs no checkpoint bytes.
    """
    _check_target(target)
    if not isinstance(tie_lm_head, bool):
        raise ValueError(f"tie_lm_head: expected True or False, got {tie_lm_head!r}")
    hk = lookup(kind)
    if tie_lm_head and hk.tied_lm_head is None:
        raise ValueError(
            f"tie_lm_head: expected False for kind={kind!r} (it drafts through the target's lm_head "
            f"already), got True"
        )
    tc = target.cfg
    head = dataclasses.replace(
        tc,
        num_hidden_layers=1,
        model_type="llama",
        attention_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        intermediate_size=_positive("intermediate_size", intermediate_size, tc.intermediate_size),
    )
    cfg = DraftConfig(
        kind=kind,
        model=head,
        num_speculative_steps=num_speculative_steps,
        draft_vocab_size=draft_vocab_size or 0,
        target_hidden_size=tc.hidden_size,
        target_layer_ids=hk.target_layer_ids(target_layer_ids, tc.num_hidden_layers),
        block_size=block_size,
        max_model_len=tc.max_position_embeddings if max_model_len is None else max_model_len,
        greedy_drafts=greedy_drafts,
    )
    hk.check_config(cfg)
    kwargs = {"draft_ids": draft_ids} if hk.reduced_vocab else {}
    params = hk.init(cfg, target.params, seed=seed, **kwargs)
    hk.check_params(cfg, params, "")
    shared = _shared_names(params, target)
    if tie_lm_head:
        params["lm_head"] = hk.tied_lm_head(cfg, params, target.params)
        shared = (*(n for n in shared if n != "lm_head"), "lm_head")
    return Draft(cfg=cfg, params=params, shared=shared)


def _tied(draft: Draft) -> bool:
    """Whether the head's lm_head is tied to the target's (`init_draft(tie_lm_head=True)`)."""
    return "lm_head" in draft.shared and head_kind(draft.cfg).tied_lm_head is not None


def save_draft(draft: Draft, path) -> None:
    """Write the head's own weights in its published layout, plus a config.json; shared target weights are
    not written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not isinstance(draft, Draft):
        raise ValueError(f"draft: expected a Draft, got {type(draft).__name__}")
    cfg = draft.cfg
    hk = head_kind(cfg)
    hk.check_params(cfg, draft.params, "draft.params.")
    params = L.unfuse_projections(draft.params, cfg.model)
    keys = hk.key_map(params)
    tensors = {k: _get(params, p) for k, p in keys.items() if p[0] not in draft.shared}
    _write_tensors(tensors, path, max_shard_bytes=None)
    config = cfg.model.to_hf()
    config.update(hk.hf_config(cfg, params))
    config["torch_dtype"] = _DTYPE_NAMES.get(params[hk.dtype_key].dtype, "float32")
    config["fspec_draft"] = {
        "kind": cfg.kind,
        "target_hidden_size": cfg.target_hidden_size,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_speculative_steps": cfg.num_speculative_steps,
        "block_size": cfg.block_size,
        "max_model_len": cfg.max_model_len,
        "greedy_drafts": cfg.greedy_drafts,
    }
    if _tied(draft):
        config["fspec_draft"]["tie_lm_head"] = True  # no lm_head.weight: load_draft rebuilds it
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _draft_kind(config: dict, tensors: dict, path: Path) -> HeadKind:
    """The kind config.json records under "fspec_draft", else the first kind that recognises the checkpoint
    (`HeadKind.recognizes`, in `recognize_order`)."""
    recorded = _recorded(config, path).get("kind")
    if recorded is not None:
        if recorded not in names():
            raise ValueError(f"{path}: config.fspec_draft.kind: expected one of {names()}, got {recorded!r}")
        return lookup(recorded)
    candidates = sorted((k for k in kinds() if k.recognizes is not None), key=lambda k: k.recognize_order)
    for kind in candidates:
        if kind.recognizes(config, tensors):
            return kind
    marks = ", ".join(f"{k.recognized_by} ({k.name})" for k in candidates)
    raise ValueError(
        f"{path}: cannot tell the draft kind: expected config.fspec_draft.kind, or {marks}; "
        f"got architectures={config.get('architectures') or []!r}"
    )


def load_draft(
    path,
    *,
    target: Target,
    num_speculative_steps: int | None = None,
    block_size: int | None = None,
    max_model_len: int | None = None,
    greedy_drafts: bool | None = None,
    dtype: torch.dtype | None = None,
    fuse: bool = True,
) -> Draft:
    """A `Draft` for `target` from a directory written by `save_draft` or a published EAGLE/EAGLE-3 head.

    Loop settings default to what the checkpoint recorded, else (3, 16, the target's max positions, False);
    float weights are cast to `dtype` (default: the target's); `fuse` as in `load_target`. Errors as in
    `load_target`.
    """
    _check_fuse(fuse)
    _check_target(target)
    dtype = _check_dtype(dtype)
    path = _directory(path)
    config = _read_config(path)
    tensors = _read_tensors(path, allow_bin=True)
    hk = _draft_kind(config, tensors, path)
    rec = _recorded(config, path)
    tc = target.cfg
    model = ModelConfig.from_hf(config)
    if model.vocab_size != tc.vocab_size:
        raise ValueError(
            f"{path}: config.vocab_size: expected the target's {tc.vocab_size}, got {model.vocab_size}"
        )
    ht = rec.get("target_hidden_size", config.get("target_hidden_size", tc.hidden_size))
    if ht != tc.hidden_size:
        raise ValueError(f"{path}: target_hidden_size: expected the target's {tc.hidden_size}, got {ht}")
    fields = hk.read_hf_config(config, rec, tc, path)  # the kind's own (EAGLE-3: layer ids, Vd)

    def pick(value, name, default):
        return value if value is not None else rec.get(name, default)

    cfg = DraftConfig(
        kind=hk.name,
        model=model,
        num_speculative_steps=pick(num_speculative_steps, "num_speculative_steps", 3),
        target_hidden_size=ht,
        block_size=pick(block_size, "block_size", 16),
        max_model_len=pick(max_model_len, "max_model_len", tc.max_position_embeddings),
        greedy_drafts=pick(greedy_drafts, "greedy_drafts", False),
        **fields,
    )
    hk.check_config(cfg)
    template = hk.init(cfg, target.params, seed=0, device="meta", **hk.init_kwargs(config))
    keys = hk.key_map(template)
    unexpected = sorted(set(tensors) - set(keys))
    if unexpected:
        raise ValueError(f"{path}: unexpected keys {unexpected[:4]} for a {hk.name!r} head")
    key_of = {p[0]: k for k, p in keys.items() if len(p) == 1}
    # Value checks on the file's own tensors, before `_fill` casts them (a float or bool d2t would become
    # int64 there).
    hk.check_params(cfg, {n: tensors[k] for n, k in key_of.items() if k in tensors}, f"{path}: ")
    # A shareable weight the file does not carry is the target's own Parameter (already in the template).
    shared = tuple(n for n in _shared_names(template, target) if key_of[n] not in tensors)
    tied = _recorded_tie(rec, hk, key_of, tensors, path)
    if tied:
        shared = (*(n for n in shared if n != "lm_head"), "lm_head")
    own = {k: p for k, p in keys.items() if p[0] not in shared}
    params = _fill(
        template,
        own,
        tensors,
        where=path,
        dtype=dtype or target.params["embed"].dtype,
        device=_device(target),
    )
    if tied:
        params["lm_head"] = hk.tied_lm_head(cfg, params, target.params)
    if fuse:
        L.fuse_projections_(params)
    return Draft(cfg=cfg, params=params, shared=shared)


def _recorded_tie(rec: dict, hk: HeadKind, key_of: dict, tensors: dict, path: Path) -> bool:
    """config.fspec_draft.tie_lm_head (default False), checked against the kind and the file's tensors."""
    tie = rec.get("tie_lm_head", False)
    if not isinstance(tie, bool):
        raise ValueError(f"{path}: config.fspec_draft.tie_lm_head: expected true or false, got {tie!r}")
    if tie and hk.tied_lm_head is None:
        raise ValueError(
            f"{path}: config.fspec_draft.tie_lm_head: expected false for a {hk.name!r} head, got true"
        )
    if tie and key_of.get("lm_head") in tensors:
        raise ValueError(
            f"{path}: {key_of['lm_head']!r}: expected no such key (config.fspec_draft.tie_lm_head is true: "
            f"the output layer is the target's), got one"
        )
    return tie


def _recorded(config: dict, path: Path) -> dict:
    """config.json's "fspec_draft" object (what `save_draft` recorded), {} when absent or null."""
    rec = config.get("fspec_draft")
    if rec is None:
        return {}
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: config.fspec_draft: expected an object or null, got {rec!r}")
    return rec


def _check_target(target) -> None:
    if not isinstance(target, Target):
        raise ValueError(f"target: expected a Target (fspec.load_target), got {type(target).__name__}")


LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(dtype) -> torch.dtype | None:
    if dtype is not None and dtype not in LOAD_DTYPES:
        allowed = ", ".join(map(str, LOAD_DTYPES))
        raise ValueError(f"dtype: expected None or one of {allowed} (a torch.dtype), got {dtype!r}")
    return dtype


def _check_device(device) -> torch.device:
    """`device` as a torch.device that exists here (ValueError, not torch's AssertionError, for CUDA
    without CUDA)."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device: expected a str or torch.device, got {type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"device: expected a device name such as 'cpu' or 'cuda:0', got {device!r} ({e})"
        ) from None
    if dev.type == "cuda" and (
        not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()
    ):
        raise ValueError(
            f"device: expected an available device, got {device!r} "
            f"({torch.cuda.device_count()} CUDA devices here)"
        )
    return dev


def _check_fuse(fuse) -> None:
    if not isinstance(fuse, bool):
        raise ValueError(f"fuse: expected True or False, got {fuse!r}")


def _device(target: Target) -> torch.device:
    return target.params["embed"].device
