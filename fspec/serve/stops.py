"""When a request ends: EOS, stop token ids, stop strings, min_new_tokens, max_new_tokens; and why.

The checks run on the host between rounds (`fspec.serve.runner.Run._emit`), one new token at a time, so a
round that accepts several tokens ends its request at the first one that stops it, exactly as target-only
decoding would. In order, for each new token once the request has at least min_new_tokens new tokens: a stop
string completed by the token's text (finish_reason "stop"), the token in stop_token_ids ("stop"), the token
in the EOS set unless ignore_eos ("eos"); then max_new_tokens or a full sequence ("length").

Stop strings are matched on the detokenized new text (never the prompt), across token boundaries and across
the tokens of one round. The text is built incrementally (`IncrementalText`), never by decoding the whole
output again. A match cuts the text exactly before its first character; `tokens` keeps the longest prefix of
the new tokens whose text ends at or before the match start. So a token that straddles the match start is
dropped with the match, and decode(tokens) is a prefix of text (equal to it when the match starts on a
token boundary).

A stop string is looked for only in text that arrives once the request has min_new_tokens tokens (as in
vLLM): a match completed earlier is ignored; a later match may still start in earlier text, and the cut
can then leave fewer than min_new_tokens tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from fspec.models.checkpoint import Target

FINISH_REASONS = ("stop", "eos", "length")


@dataclasses.dataclass(frozen=True)
class StopConfig:
    """The stop conditions of one `generate` call (every request of the call has the same).

    Attributes:
        stop: stop strings (possibly empty).
        stop_token_ids: token ids that end a request like EOS, reported as "stop" (kept in `tokens`).
        eos: the EOS ids that end a request (empty with ignore_eos).
        min_new_tokens: no condition ends a request before it has this many new tokens.
    """

    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    eos: frozenset[int] = frozenset()
    min_new_tokens: int = 0


def default_eos(target: Target) -> tuple[int, ...]:
    """The EOS ids `generate` uses unless told otherwise: generation_config.json's if the checkpoint has
    them, else config.json's."""
    gen = target.generation
    if gen is not None and gen.eos_token_ids is not None:
        return gen.eos_token_ids
    return target.cfg.eos_token_ids


def stop_config(
    target: Target,
    *,
    max_new_tokens: int,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int = 0,
) -> StopConfig:
    """The checked `StopConfig` of `generate`'s stop arguments; ValueError naming the argument, the expected
    and the actual value for a bad one."""
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) for s in stop):
        raise ValueError(f"stop: expected a str or a list of str, got {stop!r:.80}")
    for i, s in enumerate(stop):
        if not s:
            raise ValueError(f"stop[{i}]: expected a non-empty string, got {s!r}")
    if stop and target.tokenizer is None:
        raise ValueError(
            f"stop: expected no stop strings (the target has no tokenizer to decode with), got {stop!r:.80}"
        )
    v = target.cfg.vocab_size
    stop_ids = _token_ids("stop_token_ids", [] if stop_token_ids is None else stop_token_ids, v, one=False)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos: expected a bool, got {ignore_eos!r}")
    eos = (
        default_eos(target) if eos_token_id is None else _token_ids("eos_token_id", eos_token_id, v, one=True)
    )
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens: expected an int >= 0, got {min_new_tokens!r}")
    if min_new_tokens > max_new_tokens:
        raise ValueError(
            f"min_new_tokens: expected at most max_new_tokens={max_new_tokens}, got {min_new_tokens}"
        )
    return StopConfig(
        stop=tuple(dict.fromkeys(stop)),
        stop_token_ids=frozenset(stop_ids),
        eos=frozenset() if ignore_eos else frozenset(eos),
        min_new_tokens=min_new_tokens,
    )


def _token_ids(name: str, value, vocab: int, *, one: bool) -> list[int]:
    """value as a list of ids in [0, vocab): a list or tuple of ints (or one int when `one`)."""
    what = f"{'an int or ' if one else ''}a list of ints in [0, {vocab})"
    if one and isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected {what}, got {value!r:.80}")
    bad = [t for t in value if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{name}: expected {what}, got {bad[:4]}")
    return list(value)


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of `text` could still begin a stop string (the longest suffix that is a
    proper prefix of one): a stream holds them back until the next tokens decide."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalText:
    """The text of a growing token list, decoded a few tokens at a time.

    Each push decodes only a window: the tokens since the last-but-one confirmed point (`prefix`; the
    context a SentencePiece decoder needs to keep or strip a leading space) and the new ones, and appends
    what the window's text adds past its confirmed part. A window whose text ends in U+FFFD ends in an
    incomplete UTF-8 character (byte-level BPE splits multi-byte characters across tokens): nothing is
    confirmed until a later token completes it, or `flush` at the end. For byte-level BPE and SentencePiece
    decoders the text equals decoding all tokens at once.

    Attributes (host state, updated in place):
        tokens: the tokens pushed so far.
        text: the confirmed text of tokens[:read].
        ends, end_chars: the token count and the text length at every confirmed point (both increasing;
            `tokens_before` reads them).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = self.read = 0  # window start; end of the confirmed tokens
        self.prefix_text = ""  # decode(tokens[prefix:read])
        self.ends, self.end_chars = [0], [0]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def push(self, token: int) -> None:
        """Add one token; confirm the text it completes."""
        self.tokens.append(token)
        window = self._decode(self.tokens[self.prefix :])
        if len(window) > len(self.prefix_text) and not window.endswith("\ufffd"):
            self._confirm(window)

    def flush(self) -> None:
        """Confirm everything (the last tokens' text even if it ends in an incomplete character)."""
        if self.read < len(self.tokens):
            window = self._decode(self.tokens[self.prefix :])
            self._confirm(window)

    def _confirm(self, window: str) -> None:
        self.text += window[len(self.prefix_text) :]
        self.prefix, self.read = self.read, len(self.tokens)
        self.prefix_text = self._decode(self.tokens[self.prefix : self.read])
        if len(self.text) > self.end_chars[-1] or self.read == len(self.tokens):
            self.ends.append(self.read)
            self.end_chars.append(len(self.text))

    def tokens_before(self, chars: int) -> int:
        """The most tokens whose confirmed text ends at or before character `chars`."""
        return self.ends[bisect.bisect_right(self.end_chars, chars) - 1]


class StopTracker:
    """One request's new tokens, its text (when detokenizing), and why it ended (`reason`, None while live).

    Attributes:
        cfg: the call's `StopConfig`.
        tokens: the new tokens (cut at a stop string's match).
        text: the `IncrementalText` of the tokens, or None when not detokenizing (no stop strings, no stream).
        reason: one of FINISH_REASONS once the request has ended, else None.
        matched: whether a stop string ended it (the text and tokens are cut).
    """

    def __init__(self, cfg: StopConfig, tokenizer, *, detokenize: bool) -> None:
        self.cfg = cfg
        self.tokens: list[int] = []
        self.text = IncrementalText(tokenizer) if detokenize and tokenizer is not None else None
        self.reason: str | None = None
        self.matched = False

    def add(self, token: int) -> bool:
        """Append one new token; True when it ends the request (a stop string, a stop token id or EOS)."""
        self.tokens.append(token)
        armed = len(self.tokens) >= self.cfg.min_new_tokens
        if self.text is not None:
            before = len(self.text.text)
            self.text.push(token)
            if armed and self._cut_at_stop(before):
                return True
        if armed and token in self.cfg.stop_token_ids:
            self.reason = "stop"
        elif armed and token in self.cfg.eos:
            self.reason = "eos"
        return self.reason is not None

    def end(self) -> None:
        """The request ends (reason "length" unless already set): the text's last characters are confirmed
        and looked through for a stop string too."""
        if self.text is not None and not self.matched:
            before = len(self.text.text)
            self.text.flush()
            if len(self.tokens) >= self.cfg.min_new_tokens:
                self._cut_at_stop(before)
        if self.reason is None:
            self.reason = "length"

    def _cut_at_stop(self, before: int) -> bool:
        """Cut at the earliest stop string that ends past character `before` (the text new since then)."""
        text = self.text.text
        hits = [text.find(s, max(0, before - len(s) + 1)) for s in self.cfg.stop]
        hits = [i for i in hits if i >= 0]
        if not hits:
            return False
        start = min(hits)
        del self.tokens[self.text.tokens_before(start) :]
        self.text.text = text[:start]
        self.reason, self.matched = "stop", True
        return True

    def settled(self) -> tuple[str, list[int]]:
        """The text and tokens no later token can change: confirmed text short of what could still begin a
        stop string, and the tokens whose text lies within it. All of it once the request has ended."""
        if self.text is None:
            return "", self.tokens
        if self.reason is not None:
            return self.text.text, self.tokens
        text = self.text.text
        text = text[: len(text) - held_back(text, self.cfg.stop)]
        return text, self.tokens[: self.text.tokens_before(len(text))]
