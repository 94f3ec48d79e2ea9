"""The target's tokenizer: a `tokenizers.Tokenizer` that also applies the checkpoint's chat template.

    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = target.tokenizer.decode(ids, skip_special_tokens=False)

Every other attribute (encode, decode, id_to_token, token_to_id, get_vocab_size, save, ...) is the wrapped
tokenizer's own, read and set through to it.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from fspec.models import chat


class ChatTokenizer:
    """A `tokenizers.Tokenizer` (`backend`) with the checkpoint's chat template.

    Attributes:
        backend: the wrapped `tokenizers.Tokenizer`.
        chat_template: the Jinja chat template, or None.
        bos_token_id, eos_token_ids: the config's BOS id (or None) and EOS ids, whose strings the template
            sees as `bos_token` and `eos_token` (the first EOS id).
    """

    __slots__ = ("backend", "chat_template", "bos_token_id", "eos_token_ids")

    def __init__(
        self,
        backend: Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        if not isinstance(backend, Tokenizer):
            raise ValueError(f"backend: expected a tokenizers.Tokenizer, got {type(backend).__name__}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template: expected a str or None, got {type(chat_template).__name__}")
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "chat_template", chat_template)
        object.__setattr__(self, "bos_token_id", bos_token_id)
        object.__setattr__(self, "eos_token_ids", tuple(eos_token_ids))

    def __getattr__(self, name):  # only for names the wrapper does not define: the backend's
        if name.startswith("__") or name in ChatTokenizer.__slots__:
            raise AttributeError(name)  # an unset slot (mid-unpickling) must not recurse
        return getattr(self.backend, name)

    def __setattr__(self, name, value):
        if name in ChatTokenizer.__slots__:
            object.__setattr__(self, name, value)
        else:  # e.g. `tok.post_processor = ...` configures the backend, as on a plain Tokenizer
            setattr(self.backend, name, value)

    def __repr__(self) -> str:
        return f"ChatTokenizer({self.backend.get_vocab_size(with_added_tokens=True)} ids, chat template: " + (
            "yes)" if self.chat_template else "none)"
        )

    def render_chat(self, messages, *, add_generation_prompt: bool = True) -> str:
        """`messages` rendered with the chat template (`fspec.models.chat.render`), not tokenized."""
        names = chat.special_tokens(self.backend, self.bos_token_id, self.eos_token_ids)
        return chat.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **names)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tokenize: bool = True):
        """As transformers' `PreTrainedTokenizerFast.apply_chat_template`: `messages` (a list of
        {"role": str, "content": str}) rendered with the chat template, with the assistant's generation prompt
        when add_generation_prompt; the token ids (special tokens not added again: the template writes
        them) when tokenize, else the text. ValueError without a template or for malformed messages."""
        if not isinstance(tokenize, bool):
            raise ValueError(f"tokenize: expected a bool, got {tokenize!r}")
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.backend.encode(text, add_special_tokens=False).ids if tokenize else text


def wrap(tokenizer, *, chat_template: str | None, bos_token_id: int | None, eos_token_ids) -> object:
    """`tokenizer` as a `ChatTokenizer` with these settings: a `tokenizers.Tokenizer` is wrapped, a
    `ChatTokenizer` with the same settings returned as is (other settings: its backend re-wrapped); anything
    else (None, another library's tokenizer) is returned unchanged."""
    settings = dict(
        chat_template=chat_template, bos_token_id=bos_token_id, eos_token_ids=tuple(eos_token_ids)
    )
    if isinstance(tokenizer, ChatTokenizer):
        if all(getattr(tokenizer, k) == v for k, v in settings.items()):
            return tokenizer
        tokenizer = tokenizer.backend
    if isinstance(tokenizer, Tokenizer):
        return ChatTokenizer(tokenizer, **settings)
    return tokenizer
