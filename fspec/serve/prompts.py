"""One prompt of `fspec.generate` / `fspec.prefill` as token ids: a string (tokenized), a chat (rendered
with the checkpoint's template, then tokenized), or token ids (checked against the vocabulary)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fspec.models.checkpoint import Target, render_chat


def is_chat(prompt) -> bool:
    """Whether `prompt` is a chat: a non-empty list or tuple of dicts ({"role": str, "content": str})."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)


def prompt_ids(target: Target, prompt, i: int) -> list[int]:
    """`prompts[i]` as token ids: a string is tokenized as the tokenizer is set up (its BOS, if it adds
    one); a list of {"role", "content"} messages is rendered with the chat template, generation prompt added,
    and tokenized without adding special tokens again (the template writes them), as transformers'
    `apply_chat_template` does; a list or 1-D tensor of ints is taken as is. ValueError naming `prompts[i]`
    for anything else, an empty prompt, ids outside the vocabulary, and a string or chat the target cannot
    tokenize or render."""
    if isinstance(prompt, str):
        if target.tokenizer is None:
            raise ValueError(f"prompts[{i}]: expected token ids (the target has no tokenizer), got a string")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): the tokenizer's Rust side panics
            raise ValueError(
                f"prompts[{i}]: expected a valid Unicode string, got {prompt!r:.40} ({e})"
            ) from None
        ids = target.tokenizer.encode(prompt).ids
    elif is_chat(prompt):
        ids = _chat_ids(target, prompt, i)
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(
                f"prompts[{i}]: expected a 1-D tensor of token ids, got shape {tuple(prompt.shape)}"
            )
        ids = prompt.tolist()
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, dict)):
        ids = list(prompt)
    else:
        hint = " (a chat is one prompt: pass [messages])" if isinstance(prompt, dict) else ""
        raise ValueError(
            f"prompts[{i}]: expected a string, a list of token ids or a list of role/content messages, "
            f"got {type(prompt).__name__}{hint}"
        )
    if not ids:
        raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
    v = target.cfg.vocab_size
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < v]
    if bad:
        raise ValueError(f"prompts[{i}]: expected token ids in [0, {v}), got {bad[:4]}")
    return ids


def _chat_ids(target: Target, messages, i: int) -> list[int]:
    if target.tokenizer is None:
        raise ValueError(
            f"prompts[{i}]: expected token ids (the target has no tokenizer to encode a chat), got messages"
        )
    if not target.chat_template:
        raise ValueError(
            f"prompts[{i}]: expected a string or token ids (the target has no chat template), got messages"
        )
    try:
        text = render_chat(target, list(messages), add_generation_prompt=True)
    except ValueError as e:  # "messages[j]: ..." -> "prompts[i]: messages[j]: ..."
        raise ValueError(f"prompts[{i}]: {e}") from e
    return target.tokenizer.encode(text, add_special_tokens=False).ids
