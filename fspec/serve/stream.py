"""`fspec.stream`: one request's new text and tokens as its rounds finish.

A stream is a `Run` of one request driven through `Run.rounds()`, which yields after each processed round:
no thread, no queue. Between rounds the request's `StopTracker` says what is settled (`settled`): confirmed
text short of any tail that could still begin a stop string, and the tokens whose text lies within it. A
chunk carries what settled since the previous one, so the deltas never have to be taken back: their
concatenation is the text (and the tokens) `generate` returns for the same arguments, cut at a stop string
included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """What one step of a stream adds.

    Attributes:
        text: the new text since the previous chunk ("" when the target has no tokenizer).
        tokens: the new token ids since the previous chunk.
        finish_reason: None until the last chunk, which carries "stop", "eos" or "length" (as
            `GenerateResult.finish_reason`).
    """

    text: str
    tokens: list[int]
    finish_reason: str | None


def stream_chunks(run) -> Iterator[StreamChunk]:
    """The chunks of `run` (a `fspec.serve.runner.Run` of one request), one per round that settles
    something, the last one with the finish reason; the run's blocks are returned when the stream ends or
    is closed."""
    track = run.track[0]
    text_sent = tokens_sent = 0
    rounds = run.rounds()
    try:
        for _ in rounds:
            text, tokens = track.settled()
            if track.reason is not None:
                yield StreamChunk(text[text_sent:], tokens[tokens_sent:], track.reason)
                return
            if len(text) > text_sent or len(tokens) > tokens_sent:
                yield StreamChunk(text[text_sent:], tokens[tokens_sent:], None)
                text_sent, tokens_sent = len(text), len(tokens)
    finally:
        rounds.close()
