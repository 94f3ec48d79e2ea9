"""target.tokenizer: the checkpoint's tokenizers.Tokenizer, with transformers' apply_chat_template."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
from tokenizers import Tokenizer

import fspec
from fspec.models.tokenizer import ChatTokenizer

# ChatML-like, with everything a template reads: bos/eos, a system branch, a filter, the generation prompt
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|pad|>system\nYou are helpful.{{ eos_token }}\n{% endif %}<|pad|>{{ m['role'] }}\n"
    "{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|pad|>assistant\n"
    "{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "def f(x):  return x + 1  "}],
    [
        {"role": "system", "content": "Answer in code."},
        {"role": "user", "content": "import os"},
        {"role": "assistant", "content": "print(os.sep)"},
        {"role": "user", "content": "and sys?"},
    ],
]


@pytest.fixture(scope="module")
def toy():
    return fspec.load_toy()


def chat_target(target):
    """The toy target with TEMPLATE and BOS = <|pad|> (id 1), so both special strings reach the template."""
    return dataclasses.replace(
        target, chat_template=TEMPLATE, cfg=dataclasses.replace(target.cfg, bos_token_id=1)
    )


def test_apply_chat_template_equals_transformers(toy, tmp_path):
    """On a directory save_target wrote (tokenizer.json), with chat_template.jinja and transformers'
    tokenizer_config.json, load_target's tokenizer renders and tokenizes every chat exactly as
    transformers' fast tokenizer does, with and without the generation prompt."""
    from transformers import AutoTokenizer

    fspec.save_target(chat_target(toy[0]), tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)  # read by transformers and load_target alike
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|pad|>",
        "eos_token": "<|endoftext|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = fspec.load_target(tmp_path).tokenizer
    assert isinstance(ours, ChatTokenizer)
    for messages in CHATS:
        for gen in (True, False):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
            assert ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False) == text
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == list(ids)
    assert text.startswith("<|pad|><|pad|>system") and ids[0] == 1  # BOS written once, by the template


def test_apply_chat_template_is_render_chat_then_encode_without_specials(toy):
    """Same text as fspec.render_chat; ids = encode(text, add_special_tokens=False), which here differs from
    the default encode (the toy tokenizer's post-processor is byte-level only, so check a BOS-adding one)."""
    target = chat_target(toy[0])
    text = fspec.render_chat(target, CHATS[1])
    assert target.tokenizer.apply_chat_template(CHATS[1], tokenize=False) == text
    assert target.tokenizer.apply_chat_template(CHATS[1]) == target.tokenizer.encode(text).ids
    from tokenizers import processors

    backend = Tokenizer.from_str(target.tokenizer.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|pad|> $A", special_tokens=[("<|pad|>", 1)]
    )
    bos_adding = dataclasses.replace(target, tokenizer=backend)
    assert bos_adding.tokenizer.encode(text).ids[0] == 1 and bos_adding.tokenizer.encode(text).ids[1] == 1
    assert bos_adding.tokenizer.apply_chat_template(CHATS[1]) == target.tokenizer.apply_chat_template(
        CHATS[1]
    )


def test_wrapper_delegates_every_tokenizer_method_existing_code_uses(toy):
    """encode(...).ids, encode_batch, decode, id_to_token, token_to_id, get_vocab_size, to_str / save, and
    attribute assignment reach the wrapped tokenizers.Tokenizer unchanged."""
    tok = toy[0].tokenizer
    raw = Tokenizer.from_str(tok.to_str())
    text = "import os\nprint(os.sep)  # 12"
    assert tok.encode(text).ids == raw.encode(text).ids
    assert tok.encode(text, add_special_tokens=False).ids == raw.encode(text, add_special_tokens=False).ids
    assert [e.ids for e in tok.encode_batch([text, "x"])] == [e.ids for e in raw.encode_batch([text, "x"])]
    ids = raw.encode(text).ids
    assert tok.decode(ids) == raw.decode(ids) == text
    assert tok.decode([0, *ids], skip_special_tokens=False) == "<|endoftext|>" + text
    assert tok.id_to_token(0) == "<|endoftext|>" and tok.token_to_id("<|pad|>") == 1
    assert tok.get_vocab_size() == raw.get_vocab_size() == 4096 and tok.get_vocab() == raw.get_vocab()
    copied = copy.deepcopy(tok)
    copied.pre_tokenizer = None  # set through to the copy's backend, not onto the wrapper
    assert copied.backend.pre_tokenizer is None and tok.backend.pre_tokenizer is not None
    restored = pickle.loads(pickle.dumps(chat_target(toy[0]).tokenizer))
    assert restored.chat_template == TEMPLATE and restored.apply_chat_template(CHATS[0])[:2] == [1, 1]


def test_target_keeps_its_tokenizer_and_template_in_step(toy):
    """A plain Tokenizer given to Target is wrapped; dataclasses.replace with another template re-wraps the
    same backend, and one with the same settings keeps the very object."""
    target = toy[0]
    raw = target.tokenizer.backend
    assert isinstance(fspec.Target(target.cfg, target.params, raw).tokenizer, ChatTokenizer)
    assert fspec.Target(target.cfg, target.params).tokenizer is None
    templated = chat_target(target)
    assert templated.tokenizer.backend is raw and templated.tokenizer.chat_template == TEMPLATE
    assert dataclasses.replace(templated, params=templated.params).tokenizer is templated.tokenizer
    with pytest.raises(ValueError, match="chat_template: expected a Jinja chat template, got None"):
        target.tokenizer.apply_chat_template(CHATS[0])


def test_apply_chat_template_rejects_bad_arguments(toy):
    """Malformed messages are named by index; tokenize and add_generation_prompt must be bools; a template's
    raise_exception becomes a ValueError."""
    tok = chat_target(toy[0]).tokenizer
    with pytest.raises(ValueError, match=r"messages\[1\]: expected a dict with str 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="messages: expected a non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="tokenize: expected a bool, got 1"):
        tok.apply_chat_template(CHATS[0], tokenize=1)
    with pytest.raises(ValueError, match="add_generation_prompt: expected a bool"):
        tok.apply_chat_template(CHATS[0], add_generation_prompt="yes")
    strict = ChatTokenizer(tok.backend, chat_template="{{ raise_exception('only users') }}")
    with pytest.raises(ValueError, match="the chat template refused them: only users"):
        strict.apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="backend: expected a tokenizers.Tokenizer, got str"):
        ChatTokenizer("vocab.json")


# slow: loads the 98 MB GGUF (12 s); the wrapper's rendering and ids against transformers' are checked on a
# saved directory by test_apply_chat_template_equals_transformers, and `fspec demo` renders this template
@pytest.mark.slow
def test_default_model_tokenizer_applies_smollm2s_template():
    """The GGUF-loaded default target: its tokenizer is a ChatTokenizer whose ids are the demo's (render_chat,
    then encode without special tokens), starting with <|im_start|>."""
    target, _ = fspec.load_default()
    messages = [{"role": "user", "content": "Write a haiku."}]
    ids = target.tokenizer.apply_chat_template(messages)
    assert isinstance(target.tokenizer, ChatTokenizer)
    assert ids == target.tokenizer.encode(fspec.render_chat(target, messages), add_special_tokens=False).ids
    assert target.tokenizer.decode(ids[:1], skip_special_tokens=False) == "<|im_start|>"
    text = target.tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "Write a haiku.<|im_end|>" in text
