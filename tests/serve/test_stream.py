"""fspec.stream: chunks as rounds finish, whose deltas concatenate to exactly what generate returns."""

from __future__ import annotations

import pytest

import fspec
from fspec.serve.engine import Stats
from fspec.serve.runner import Run
from fspec.serve.stops import StopConfig, StopTracker, held_back, stop_config
from fspec.serve.stream import stream_chunks

from engine_setup import aligned_pair

PROMPTS = ["Once upon a time", "The cat"]


@pytest.fixture(scope="module")
def toy():
    """The toy target (a byte-level BPE tokenizer) and its EAGLE-3 head, loaded once for this file."""
    return fspec.load_toy()


def _joined(chunks):
    assert chunks and all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.tokens], chunks[-1].finish_reason


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_stream_deltas_concatenate_to_generate_text_and_tokens(toy, one_thread, speculative, temperature):
    """Greedy and sampled, speculative and target-only: the joined deltas and tokens, and the last chunk's
    finish_reason, equal generate's for the same arguments, with and without a stop string (whose start is
    held back until the match decides); chunks arrive as rounds finish (several of them)."""
    target, draft = toy
    head = draft if speculative else None
    for p in PROMPTS:
        kw = dict(max_new_tokens=32, temperature=temperature, seed=7)
        free = fspec.generate(target, head, [p], **kw)
        chunks = list(fspec.stream(target, head, p, **kw))
        assert _joined(chunks) == (free.text[0], free.tokens[0], free.finish_reason[0]) and len(chunks) > 5
        stop = [free.text[0][15:18], "zzzz"]
        want = fspec.generate(target, head, [p], stop=stop, **kw)
        assert want.finish_reason == ["stop"] and want.text[0] == free.text[0][: free.text[0].find(stop[0])]
        chunks = list(fspec.stream(target, head, p, stop=stop, **kw))
        assert _joined(chunks) == (want.text[0], want.tokens[0], "stop"), p


def test_stream_holds_back_a_possible_stop_string_prefix(toy):
    """Text that could begin a stop string is not settled until a later token rules the match out (and the
    tokens carrying it wait with it); split UTF-8 characters are never settled half-way."""
    tok = toy[0].tokenizer
    text = "héllo wörld ✓ 😀 done"
    ids = tok.encode(text).ids
    assert (
        held_back("abc wör", ["wörld!"]) == 3
        and held_back("aaa", ["aab"]) == 2
        and held_back("x", ["y"]) == 0
    )
    track = StopTracker(StopConfig(stop=("wörld!",)), tok, detokenize=True)
    settled = []
    for i in ids:
        assert not track.add(i)
        settled.append(track.settled())
    for (s, t), (s2, t2) in zip(settled, settled[1:]):
        assert s2.startswith(s) and t2[: len(t)] == t and "\ufffd" not in s2  # never retracted
        assert s2 == tok.decode(t2) or s2.startswith(tok.decode(t2))
    upto = [s for s, _ in settled]
    assert "héllo " in upto and not any(s.startswith("héllo w") and len(s) < 12 for s in upto)
    assert "héllo wörld " in upto  # released once " " follows "wörld" instead of "!"
    track.end()
    assert track.settled() == (text, ids) and track.reason == "length"


def test_stream_of_token_ids_without_a_tokenizer_and_with_eos():
    """A target without a tokenizer streams token ids (text ""); an EOS override ends it with "eos"."""
    target, draft = aligned_pair(k=3)
    free = fspec.generate(target, draft, [[4, 5, 6]], max_new_tokens=16)
    eos = free.tokens[0][6]
    want = fspec.generate(target, draft, [[4, 5, 6]], max_new_tokens=16, eos_token_id=eos)
    chunks = list(fspec.stream(target, draft, [4, 5, 6], max_new_tokens=16, eos_token_id=eos))
    assert _joined(chunks) == ("", want.tokens[0], "eos")


def test_closing_a_stream_early_returns_every_block(toy, one_thread):
    """A stream dropped after two chunks returns all its blocks; the pipelined round loop is resumable."""
    target, draft = toy
    stops = stop_config(target, max_new_tokens=40)
    run = Run(target, draft, [target.tokenizer.encode("The cat").ids], dict(temperature=[0.0], seed=[0]),
              max_new_tokens=40,
              compile=False, stats=Stats(3), progress=False, stops=stops, detokenize=True)  # fmt: skip
    total = run.alloc.num_free
    chunks = stream_chunks(run)
    next(chunks), next(chunks)
    chunks.close()
    assert run.alloc.num_free == total and not run.alloc._used


def test_stream_takes_one_prompt(toy):
    target, draft = toy
    with pytest.raises(ValueError, match="prompt: expected one prompt .* got a list of 2 prompts"):
        fspec.stream(target, draft, ["a", "b"], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens: expected a positive int"):
        fspec.stream(target, draft, "a", max_new_tokens=0)
