"""Chat templates rendered as transformers renders them (utils/chat_template_utils.py): one sandboxed Jinja
environment, the messages checked first, the BOS / EOS strings taken from the config's ids."""

from __future__ import annotations

import json
from datetime import datetime


def check_messages(messages, *, name: str = "messages") -> list[dict]:
    """`messages` as a list of dicts, each with str "role" and "content"; ValueError naming `name[i]` for
    the first that is not."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{name}: expected a non-empty list of role/content dicts, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{name}[{i}]: expected a dict with str 'role' and 'content', got {m!r:.80}")
    return [dict(m) for m in messages]


def special_tokens(tokenizer, bos_token_id: int | None, eos_token_ids) -> dict[str, str]:
    """The template's `bos_token` and `eos_token`: the strings of the config's BOS id and first EOS id
    ("" without a tokenizer or an id)."""

    def name(i):
        return (tokenizer.id_to_token(i) or "") if tokenizer is not None and i is not None and i >= 0 else ""

    return {"bos_token": name(bos_token_id), "eos_token": name(eos_token_ids[0] if eos_token_ids else None)}


def render(
    template: str | None,
    messages,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """`messages` rendered with the Jinja chat `template`, as transformers'
    `apply_chat_template(..., tokenize=False)` renders it, given `messages`, `add_generation_prompt`,
    `bos_token` and `eos_token`.

    Raises ValueError when there is no template, for malformed messages (named by index), and when the
    template itself refuses them (its `raise_exception`).
    """
    import jinja2

    if not template:
        raise ValueError("chat_template: expected a Jinja chat template, got None (the checkpoint has none)")
    if not isinstance(add_generation_prompt, bool):
        raise ValueError(f"add_generation_prompt: expected a bool, got {add_generation_prompt!r}")
    messages = check_messages(messages)
    try:
        return (
            chat_environment()
            .from_string(template)
            .render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
            )
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"messages: the chat template refused them: {e}") from e


def chat_environment():
    """transformers' chat-template Jinja environment: sandboxed and immutable, trim_blocks and lstrip_blocks,
    loop controls, `raise_exception`, `strftime_now` and a `tojson` that does not HTML-escape."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env
