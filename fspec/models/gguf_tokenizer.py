"""A `tokenizers.Tokenizer` from a GGUF file's metadata (llama.cpp keeps no tokenizer.json).

Byte-level BPE only (``tokenizer.ggml.model == "gpt2"``, what llama.cpp writes for GPT-2-style vocabularies:
SmolLM, Llama 3, StarCoder). The vocabulary is ``tokenizer.ggml.tokens`` by id, the merges
``tokenizer.ggml.merges`` ("a b" strings, best first), and ``tokenizer.ggml.token_type`` marks control tokens
(3, e.g. ``<|im_start|>``: special added tokens) and user-defined ones (4, e.g. ``<think>``: added tokens
matched whole, not special). Those two kinds are stored as raw text, not in the byte alphabet, so they sit in
the BPE vocabulary under their raw text and the added token finds its id there.

``tokenizer.ggml.pre`` names how llama.cpp splits text before BPE (llama-vocab.cpp, `regex_exprs`):
* "gpt-2" and kin: the GPT-2 regex alone, which `ByteLevel(use_regex=True)` applies itself;
* "smollm" and kin: ``\\p{N}`` first, then the GPT-2 regex: every digit is its own piece
  (`Digits(individual_digits=True)`), as SmolLM2's own tokenizer.json does;
* "llama-bpe" and kin (Llama 3): one regex, then byte-level without a regex, and whole-word vocabulary hits
  skip the merges (llama.cpp's `ignore_merges`, HF's "ignore_merges": true).
Any other value (llama.cpp's "default" fallback included) builds no tokenizer, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's llama_token_type values

# llama-vocab.cpp's names for each family
GPT2_PRE = ("gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais")  # the GPT-2 regex alone
DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")  # \p{N}, then GPT-2's
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3")  # LLAMA3_SPLIT, ignore_merges, BOS added
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE = (*GPT2_PRE, *DIGITS_PRE, *LLAMA3_PRE)


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre == pre`` (one of SUPPORTED_PRE)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in LLAMA3_PRE)
    if pre in GPT2_PRE:
        return byte_level
    if pre in DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in LLAMA3_PRE:
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(f"tokenizer.ggml.pre: expected one of {SUPPORTED_PRE}, got {pre!r}")


def build_tokenizer(meta: Mapping[str, Any], *, where: str) -> Tokenizer | None:
    """The tokenizer that ``tokenizer.*`` metadata `meta` describes; None (with a warning naming the file and
    the reason) for one this module does not build: a SentencePiece vocabulary ("llama"), an unknown
    pre-tokenizer, or no vocabulary at all. Raises ValueError for inconsistent metadata."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    # "default" (also a missing key) is llama.cpp's fallback regex set, which nothing here reproduces
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or kind != "gpt2" or pre not in SUPPORTED_PRE:
        reason = (
            "no tokenizer.ggml.tokens"
            if tokens is None
            else f"tokenizer.ggml.model={kind!r} (only 'gpt2', byte-level BPE, is built)"
            if kind != "gpt2"
            else f"tokenizer.ggml.pre={pre!r} (expected one of {SUPPORTED_PRE})"
        )
        warnings.warn(f"{where}: no tokenizer built: {reason}", stacklevel=3)
        return None
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(
            f"{where}: tokenizer.ggml.token_type: expected {len(tokens)} entries (one per token), "
            f"got {len(types)}"
        )
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated string keeps its first id, as a dict-built vocabulary would
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    if any(len(m) != 2 for m in merges):
        raise ValueError(f"{where}: tokenizer.ggml.merges: expected 'left right' strings")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in LLAMA3_PRE))
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    added = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    tok.post_processor = _post_processor(meta, tokens, pre=pre)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"{where}: tokenizer vocabulary: expected {len(tokens)} ids, got "
            f"{tok.get_vocab_size(with_added_tokens=True)} (control or user-defined tokens absent from it?)"
        )
    return tok


def _post_processor(meta: Mapping[str, Any], tokens: list[str], *, pre: str) -> processors.PostProcessor:
    """BOS / EOS around each sequence where the file asks for them (llama.cpp's default adds BOS for the
    Llama 3 pre-tokenizers only); otherwise byte-level offsets and nothing added."""
    ends = []
    for flag, key, default in (
        ("add_bos_token", "bos_token_id", pre in LLAMA3_PRE),
        ("add_eos_token", "eos_token_id", False),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        wanted = meta.get(f"tokenizer.ggml.{flag}", default)
        ends.append((tokens[token_id], token_id) if wanted and token_id is not None else None)
    if ends == [None, None]:
        return processors.ByteLevel(trim_offsets=False)
    bos, eos = ([e[0]] if e else [] for e in ends)
    return processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)],
        special_tokens=[e for e in ends if e is not None],
    )
