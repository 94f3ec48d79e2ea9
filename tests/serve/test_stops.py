"""Stop conditions of `fspec.generate` (stop strings, stop token ids, EOS, min_new_tokens), finish_reason,
incremental detokenization, and generation_config.json defaults."""

from __future__ import annotations

import dataclasses
import json

import pytest

import fspec
from fspec.models.generation_config import GenerationDefaults, sampling_defaults
from fspec.serve.stops import IncrementalText, StopConfig, StopTracker

from engine_setup import aligned_pair

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [20] * 9]
TEXT_PROMPTS = ["Once upon a time", "def main(", "The cat"]
UNICODE = "héllo wörld ✓ 😀 done"


@pytest.fixture(scope="module")
def toy():
    """The toy target (a byte-level BPE tokenizer) and its EAGLE-3 head, loaded once for this file."""
    return fspec.load_toy()


def _cut_reference(tok, tokens: list[int], stop: list[str]) -> tuple[str, list[int]]:
    """Brute force: decode the whole output, cut before the first match of any stop string, keep the
    longest token prefix whose text is a prefix of the cut text."""
    text = tok.decode(tokens)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    if not hits:
        return text, tokens
    cut = text[: min(hits)]
    j = max(j for j in range(len(tokens) + 1) if cut.startswith(tok.decode(tokens[:j])))
    return cut, tokens[:j]


def _stops_spanning_tokens(tok, tokens: list[int]) -> list[str]:
    """Stop strings taken from the greedy output that start inside a token and end inside a later one."""
    pieces = [tok.decode([t]) for t in tokens]
    found = []
    for i in range(3, len(pieces) - 3, 5):
        if len(pieces[i]) > 1 and pieces[i + 1] and pieces[i + 2]:
            found.append(pieces[i][1:] + pieces[i + 1] + pieces[i + 2][:1])
    return found


@pytest.mark.parametrize("speculative", [False, True])
def test_stop_strings_across_tokens_and_rounds_match_a_brute_force_cut(speculative, toy, one_thread):
    """Stop strings that start mid-token and span 2-3 tokens (accepted in one round or across rounds when
    speculating): text and tokens equal decoding the uncut greedy output, cut before the first match."""
    target, draft = toy
    head = draft if speculative else None
    free = fspec.generate(target, None, TEXT_PROMPTS, max_new_tokens=48)
    tok = target.tokenizer
    checked, tau = 0, []
    for p, full in zip(TEXT_PROMPTS, free.tokens):
        for stop in _stops_spanning_tokens(tok, full)[:3]:
            got = fspec.generate(target, head, [p], max_new_tokens=48, stop=[stop, "never-in-output"])
            want_text, want_tokens = _cut_reference(tok, full, [stop])
            assert got.text[0] == want_text and got.tokens[0] == want_tokens, (p, stop)
            assert got.finish_reason == ["stop"] and stop not in got.text[0]
            assert tok.decode(got.tokens[0]) == want_text[: len(tok.decode(got.tokens[0]))]
            checked += 1
            tau.append(got.stats["acceptance_length"])
    assert checked >= 6
    assert (min(tau) > 1.5) if speculative else (max(tau) == 1.0), tau  # several tokens per round


def test_stop_string_inside_the_first_token_cuts_it_away(toy, one_thread):
    """A match starting inside the first token: the text is cut exactly before it and `tokens` keeps no
    token (the first one's text does not lie wholly before the match)."""
    target, draft = toy
    free = fspec.generate(target, draft, ["Once upon a time"], max_new_tokens=8)
    first = target.tokenizer.decode(free.tokens[0][:1])
    assert len(first) >= 3, first
    got = fspec.generate(target, draft, ["Once upon a time"], max_new_tokens=8, stop=first[1:3])
    assert got.text == [first[:1]] and got.tokens == [[]] and got.finish_reason == ["stop"]


def test_earliest_match_wins_and_text_without_a_match_equals_decoding(toy, one_thread):
    """Of several stop strings the earliest match cuts; with no match the text equals decoding the tokens
    and the reason is "length"."""
    target, draft = toy
    free = fspec.generate(target, draft, TEXT_PROMPTS, max_new_tokens=32)
    text = free.text[0]
    late, early = text[20:24], text[6:9]
    got = fspec.generate(target, draft, TEXT_PROMPTS[:1], max_new_tokens=32, stop=[late, early])
    assert got.text[0] == text[: text.find(early)]
    none = fspec.generate(target, draft, TEXT_PROMPTS, max_new_tokens=32, stop="\x00never")
    assert none.text == free.text and none.tokens == free.tokens
    assert none.finish_reason == free.finish_reason == ["length"] * 3


def test_incremental_text_waits_for_split_utf8_characters(toy):
    """Byte-level BPE splits é, ö, ✓ and 😀 over 2-4 tokens: the confirmed text never holds U+FFFD, only
    grows, and ends equal to decoding everything at once."""
    tok = toy[0].tokenizer
    ids = tok.encode(UNICODE).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test needs split characters
    inc = IncrementalText(tok)
    seen = ""
    for i in ids:
        inc.push(i)
        assert "\ufffd" not in inc.text and inc.text.startswith(seen)
        seen = inc.text
    inc.flush()
    assert inc.text == tok.decode(ids) == UNICODE


@pytest.mark.parametrize("stop", ["ö", "😀", "wör", "✓ 😀 d"])
def test_stop_string_of_multibyte_characters_cuts_at_the_character(stop, toy):
    """A stop string of split characters: the request ends at the token that completes the match, the text
    is cut before it, and tokens keep the longest prefix whose text lies before the match (a split
    character's leading byte tokens, or a token straddling the match start, go with it)."""
    tok = toy[0].tokenizer
    ids = tok.encode(UNICODE).ids
    track = StopTracker(StopConfig(stop=(stop,)), tok, detokenize=True)
    fed = next(n for n, i in enumerate(ids, 1) if track.add(i))
    cut = UNICODE[: UNICODE.find(stop)]
    assert track.reason == "stop" and tok.decode(ids[:fed]).startswith(cut + stop)  # ends once matched
    assert not tok.decode(ids[: fed - 1]).startswith(cut + stop)
    assert track.text.text == cut
    kept = len(track.tokens)
    assert ids[:kept] == track.tokens and cut.startswith(tok.decode(track.tokens))
    assert not cut.startswith(tok.decode(ids[: kept + 1]))  # the next token reaches into the match


def test_stop_token_ids_end_requests_and_are_kept():
    """A stop token id ends a request at its first occurrence, kept in tokens, reason "stop"."""
    target, draft = aligned_pair(k=3)
    free = fspec.generate(target, draft, PROMPTS, max_new_tokens=16)
    stop_tok = free.tokens[1][5]
    got = fspec.generate(target, draft, PROMPTS, max_new_tokens=16, stop_token_ids=[stop_tok, 96])
    for toks, full, why in zip(got.tokens, free.tokens, got.finish_reason):
        cut = full.index(stop_tok) + 1 if stop_tok in full[:16] else len(full)
        assert toks == full[:cut]
        assert why == ("stop" if stop_tok in full else "length")
    assert got.text is None


def test_eos_override_ignore_eos_and_generation_config_default(tmp_path):
    """eos_token_id replaces the EOS set (reason "eos"); ignore_eos lets a request run past EOS to
    max_new_tokens while stop_token_ids still stop it; a checkpoint's generation_config.json eos ids are
    the default set."""
    target, draft = aligned_pair(k=3)
    free = fspec.generate(target, draft, PROMPTS, max_new_tokens=16)
    eos = free.tokens[0][4]
    cut = [full[: full.index(eos) + 1] if eos in full else full for full in free.tokens]
    got = fspec.generate(target, draft, PROMPTS, max_new_tokens=16, eos_token_id=eos)
    assert got.tokens == cut and got.finish_reason[0] == "eos"
    assert got.finish_reason == ["eos" if eos in full else "length" for full in free.tokens]
    t_eos = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, eos_token_ids=(eos,)))
    assert fspec.generate(t_eos, draft, PROMPTS, max_new_tokens=16).tokens == cut
    ignored = fspec.generate(t_eos, draft, PROMPTS, max_new_tokens=16, ignore_eos=True)
    assert ignored.tokens == free.tokens and set(ignored.finish_reason) == {"length"}
    both = fspec.generate(t_eos, draft, PROMPTS, max_new_tokens=16, ignore_eos=True, stop_token_ids=[eos])
    assert both.tokens == cut and both.finish_reason[0] == "stop"
    fspec.save_target(target, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [96, eos]}))
    loaded = fspec.load_target(tmp_path)
    assert (
        loaded.generation.eos_token_ids == (96, eos) and loaded.cfg.eos_token_ids == target.cfg.eos_token_ids
    )
    assert fspec.generate(loaded, None, PROMPTS, max_new_tokens=16).tokens == cut


def test_min_new_tokens_defers_every_stop_condition(toy, one_thread):
    """Before min_new_tokens no EOS or stop token id can be emitted (they are masked in the target's logits,
    as HF and vLLM do) and no stop string ends a request: it ends at the first one at or after that count.
    Speculation stays exact: the same tokens as target-only decoding with the same settings."""
    target, draft = aligned_pair(k=3)
    free = fspec.generate(target, draft, PROMPTS, max_new_tokens=24)
    full = free.tokens[3]
    tok = next(t for t in full[:6] if full.count(t) >= 2)
    first = full.index(tok)
    for kw in ({"eos_token_id": tok}, {"stop_token_ids": [tok]}):
        m = first + 1
        got = fspec.generate(target, draft, PROMPTS[3:], max_new_tokens=24, min_new_tokens=m, **kw)
        plain = fspec.generate(target, None, PROMPTS[3:], max_new_tokens=24, min_new_tokens=m, **kw)
        toks = got.tokens[0]
        assert toks == plain.tokens[0] and toks[:first] == full[:first], kw
        assert tok not in toks[:m] and toks[first] != tok, kw  # masked while fewer than m new tokens
        if tok in toks:  # then it ended the request, at its first occurrence
            assert toks.index(tok) == len(toks) - 1 and got.finish_reason[0] in ("eos", "stop"), kw
        else:
            assert len(toks) == 24 and got.finish_reason == ["length"], kw
        early = fspec.generate(target, draft, PROMPTS[3:], max_new_tokens=24, min_new_tokens=first, **kw)
        assert early.tokens[0] == full[: first + 1], kw  # the (first + 1)-th token may stop it
    target, draft = toy
    free = fspec.generate(target, draft, ["The cat"], max_new_tokens=40)
    text, toks = free.text[0], free.tokens[0]
    word = next(w for w in (" the", " to", "t") if text.count(w) >= 2)
    lens = [len(target.tokenizer.decode(toks[:j])) for j in range(len(toks) + 1)]
    done_at = next(j for j in range(len(toks) + 1) if lens[j] >= text.find(word) + len(word))
    got = fspec.generate(target, draft, ["The cat"], max_new_tokens=40, stop=word, min_new_tokens=done_at + 1)
    later = text.find(word, text.find(word) + 1)
    assert got.text[0] == text[:later] and got.finish_reason == ["stop"]


def test_finish_reason_length_at_max_new_tokens_and_at_max_model_len():
    """ "length" for both limits; one call mixes reasons per request."""
    target, draft = aligned_pair(k=3)
    res = fspec.generate(target, draft, [list(range(44)), [1, 2]], max_new_tokens=10)
    assert [len(t) for t in res.tokens] == [4, 10] and res.finish_reason == ["length", "length"]
    free = fspec.generate(target, draft, PROMPTS, max_new_tokens=16)
    eos = free.tokens[2][3]
    mixed = fspec.generate(target, draft, PROMPTS, max_new_tokens=16, eos_token_id=eos)
    assert "eos" in mixed.finish_reason
    assert all((r == "eos") == (t[-1] == eos) for r, t in zip(mixed.finish_reason, mixed.tokens))


def test_generation_config_is_read_and_gives_hf_sampling_defaults(tmp_path):
    """generation_config.json's fields land in Target.generation (absent ones None, unknown keys ignored);
    sampling_defaults is greedy unless do_sample is true, then the file's values with neutral fill-ins."""
    target, _ = aligned_pair(k=3)
    fspec.save_target(target, tmp_path)
    assert fspec.load_target(tmp_path).generation is None
    assert sampling_defaults(target) == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    file = tmp_path / "generation_config.json"
    file.write_text(json.dumps({"eos_token_id": 5, "temperature": 0.6, "top_p": 0.9, "max_length": 99}))
    gen = fspec.load_target(tmp_path).generation
    assert gen == GenerationDefaults(eos_token_ids=(5,), temperature=0.6, top_p=0.9)
    loaded = fspec.load_target(tmp_path)
    assert sampling_defaults(loaded)["temperature"] == 0.0  # do_sample absent: greedy, as transformers
    file.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None}))
    want = {"temperature": 0.6, "top_k": 0, "top_p": 0.9, "min_p": 0.0}
    assert sampling_defaults(fspec.load_target(tmp_path)) == want
    file.write_text(json.dumps({"do_sample": True, "top_k": 20, "min_p": 0.05}))
    want = {"temperature": 1.0, "top_k": 20, "top_p": 1.0, "min_p": 0.05}
    assert sampling_defaults(fspec.load_target(tmp_path)) == want
    with pytest.raises(ValueError, match="target: expected a fspec.Target"):
        sampling_defaults(object())


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "expected a JSON object, got unreadable JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"eos_token_id": 97}', r"key 'eos_token_id': expected an int or a list of ints in \[0, 97\)"),
        ('{"eos_token_id": [1, true]}', "key 'eos_token_id'"),
        ('{"do_sample": "yes"}', "key 'do_sample': expected true or false"),
        ('{"temperature": -1}', "key 'temperature': expected a number >= 0"),
        ('{"temperature": "hot"}', "key 'temperature'"),
        ('{"top_k": -1}', "key 'top_k': expected an int >= 0"),
        ('{"top_k": 2.5}', "key 'top_k'"),
        ('{"top_p": 0}', r"key 'top_p': expected a number in \(0, 1\]"),
        ('{"min_p": 1.5}', r"key 'min_p': expected a number in \[0, 1\]"),
    ],
)
def test_malformed_generation_config_names_the_file_and_key(tmp_path, content, match):
    target, _ = aligned_pair(k=3)
    fspec.save_target(target, tmp_path)
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match="generation_config.json: " + match):
        fspec.load_target(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop": 5}, "stop: expected a str or a list of str, got 5"),
        ({"stop": ["ok", 3]}, "stop: expected a str or a list of str"),
        ({"stop": ["ok", ""]}, r"stop\[1\]: expected a non-empty string"),
        ({"stop": "x", "toy": False}, r"stop: expected no stop strings \(the target has no tokenizer"),
        ({"stop_token_ids": [4096]}, r"stop_token_ids: expected a list of ints in \[0, 4096\), got \[4096\]"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids: expected a list of ints in \[0, 4096\)"),
        ({"stop_token_ids": [True]}, r"stop_token_ids: expected .* got \[True\]"),
        ({"stop_token_ids": 7}, "stop_token_ids: expected a list of ints"),
        ({"ignore_eos": 1}, "ignore_eos: expected a bool, got 1"),
        ({"eos_token_id": True}, r"eos_token_id: expected an int or a list of ints in \[0, 4096\)"),
        ({"eos_token_id": [5000]}, r"eos_token_id: expected an int or a list of ints .* got \[5000\]"),
        ({"eos_token_id": 1.0}, "eos_token_id: expected an int or a list of ints"),
        ({"min_new_tokens": -1}, "min_new_tokens: expected an int >= 0, got -1"),
        ({"min_new_tokens": True}, "min_new_tokens: expected an int >= 0, got True"),
        ({"min_new_tokens": 9}, "min_new_tokens: expected at most max_new_tokens=8, got 9"),
    ],
)
@pytest.mark.parametrize("call", ["generate", "stream"])
def test_bad_stop_arguments_raise_value_errors_naming_them(kwargs, match, call, toy):
    """generate and stream check their stop arguments before any work (stream: when called)."""
    kwargs = dict(kwargs)
    target, _ = toy
    if not kwargs.pop("toy", True):
        target = dataclasses.replace(target, tokenizer=None)
    with pytest.raises(ValueError, match=match):
        if call == "generate":
            fspec.generate(target, None, [[1, 2]], max_new_tokens=8, **kwargs)
        else:
            fspec.stream(target, None, [1, 2], max_new_tokens=8, **kwargs)
