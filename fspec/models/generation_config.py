"""A checkpoint's generation_config.json: the EOS ids and sampling settings its authors meant to be used.

HF checkpoints ship it beside config.json; transformers' `generate` reads it as its defaults, and vLLM
applies its sampling fields the same way. Its eos_token_id often lists more ids than config.json's (Llama 3
Instruct: 128001, 128008 and 128009 against config.json's 128001), so it is the default EOS set of
`fspec.generate`. Only the fields read here are checked; the file's other keys (max_length,
repetition_penalty, transformers_version, ...) are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What a generation_config.json says; each field None when the file does not set it.

    Attributes:
        eos_token_ids: the ids that end generation (a tuple, possibly empty).
        do_sample: whether generation samples (False or absent: greedy, as in transformers).
        temperature: the sampling temperature (>= 0).
        top_k: keep the k most likely tokens (0: all).
        top_p: nucleus mass in (0, 1].
        min_p: drop tokens below min_p times the most likely one's probability, in [0, 1].
    """

    eos_token_ids: tuple[int, ...] | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


def read_generation_config(path, *, vocab_size: int) -> GenerationDefaults | None:
    """The generation_config.json of checkpoint directory `path`, or None when there is none.

    Raises ValueError naming the file and the key for malformed JSON or a value of the wrong type or range
    (eos ids outside [0, vocab_size), a negative top_k, top_p outside (0, 1], ...); null counts as absent."""
    file = Path(path) / FILE
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: expected a JSON object, got unreadable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")

    def bad(key: str, expected: str) -> ValueError:
        return ValueError(f"{file}: key {key!r}: expected {expected}, got {raw[key]!r}")

    def number(key: str, ok, expected: str) -> float | None:
        v = raw.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise bad(key, expected)
        return float(v)

    eos = raw.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            raise bad("eos_token_id", f"an int or a list of ints in [0, {vocab_size})")
        eos = tuple(dict.fromkeys(ids))
    do_sample = raw.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise bad("do_sample", "true or false")
    top_k = raw.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise bad("top_k", "an int >= 0")
    return GenerationDefaults(
        eos_token_ids=eos,
        do_sample=do_sample,
        temperature=number("temperature", lambda v: v >= 0, "a number >= 0"),
        top_k=top_k,
        top_p=number("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        min_p=number("min_p", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    )


def sampling_defaults(target: Any) -> dict[str, float | int]:
    """{temperature, top_k, top_p, min_p} as transformers derives them from `target.generation`: greedy
    (temperature 0, no filtering) unless the file says do_sample true; then the file's values, a missing one
    taking the neutral setting (temperature 1.0, top_k 0, top_p 1.0, min_p 0.0). A target without a
    generation_config.json (a GGUF file, a model built in code) is greedy."""
    gen = getattr(target, "generation", False)
    if gen is not None and not isinstance(gen, GenerationDefaults):
        raise ValueError(f"target: expected a fspec.Target, got {type(target).__name__}")
    if gen is None or not gen.do_sample:
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    return {k: default if getattr(gen, k) is None else getattr(gen, k) for k, default in neutral.items()}
