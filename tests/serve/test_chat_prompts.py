"""Chat prompts: a list of role/content messages is rendered with the chat template and tokenized without
adding special tokens again, in fspec.generate and fspec.prefill, mixed with strings and token ids."""

from __future__ import annotations

import dataclasses

import pytest

import fspec

TEMPLATE = (
    "{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}"
)
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def toy():
    target, draft = fspec.load_toy()
    return dataclasses.replace(target, chat_template=TEMPLATE), draft


def test_generate_renders_chats_in_a_mixed_batch(toy):
    """Strings, token ids and chats in one batch: each request's tokens equal those of its own ids, the chat's
    being apply_chat_template's (generation prompt added, no second BOS: it ends in '<|pad|>assistant\\n')."""
    target, draft = toy
    ids = target.tokenizer.apply_chat_template(CHAT)
    assert target.tokenizer.decode(ids, skip_special_tokens=False).endswith(
        "<|endoftext|>\n<|pad|>assistant\n"
    )
    prompts = ["import os", [5, 6, 7], CHAT, tuple(dict(m) for m in CHAT)]
    res = fspec.generate(target, draft, prompts, max_new_tokens=6)
    alone = fspec.generate(
        target, draft, [target.tokenizer.encode("import os").ids, [5, 6, 7], ids, ids], max_new_tokens=6
    )
    assert res.tokens == alone.tokens and res.text == alone.text


def test_prefill_takes_a_chat_as_generate_does(toy):
    """fspec.prefill of a chat gives the first token generate emits for it."""
    target, draft = toy
    pre = fspec.prefill(target, draft, [CHAT, [1, 2, 3]])
    first = fspec.generate(
        target, draft, [target.tokenizer.apply_chat_template(CHAT), [1, 2, 3]], max_new_tokens=1
    )
    assert pre.tokens.tolist() == [t[0] for t in first.tokens]


def test_chat_prompt_errors_name_the_prompt(toy):
    """No template, no tokenizer, a malformed message (by index), a template's refusal and a bare message
    dict: ValueErrors naming prompts[i]."""
    target, draft = toy
    plain = dataclasses.replace(target, chat_template=None)
    cases = [
        (
            plain,
            ["x", CHAT],
            r"prompts\[1\]: expected a string or token ids \(the target has no chat template\)",
        ),
        (
            dataclasses.replace(target, tokenizer=None),
            [CHAT],
            r"prompts\[0\]: expected token ids \(the target has no tokenizer to encode a chat\)",
        ),
        (
            target,
            [[1], [*CHAT, {"role": "user"}]],
            r"prompts\[1\]: messages\[1\]: expected a dict with str 'role'",
        ),
        (target, [[*CHAT, {"role": "user", "content": None}]], r"prompts\[0\]: messages\[1\]"),
        (target, [[*CHAT, 5]], r"prompts\[0\]: messages\[1\]: expected a dict"),
        (
            target,
            [CHAT[0]],
            r"prompts\[0\]: expected a string, .* got dict \(a chat is one prompt: pass \[messages\]\)",
        ),
        (
            dataclasses.replace(target, chat_template="{{ raise_exception('no users') }}"),
            [CHAT],
            r"prompts\[0\]: messages: the chat template refused them: no users",
        ),
    ]
    for tgt, prompts, match in cases:
        with pytest.raises(ValueError, match=match):
            fspec.generate(tgt, draft, prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected a string or token ids"):
        fspec.prefill(plain, draft, [CHAT])
