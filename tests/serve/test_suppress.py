"""fspec/serve/rounds.py::suppress_tokens: the min_new_tokens processor against a plain loop."""

from __future__ import annotations

import torch

import fspec
from fspec.serve.rounds import suppress_tokens


def _loop_reference(logits, ids, until, positions):
    out = logits.clone()
    per = logits.shape[0] // ids.shape[0]
    for row in range(logits.shape[0]):
        b = row // per
        if positions[row] < until[b]:
            for t in ids[b].tolist():
                if t >= 0:
                    out[row, t] = float("-inf")
    return out


def test_suppression_follows_each_rows_position_and_request_and_ignores_padding_ids():
    """Rows of three requests (two rows each): ids are -inf exactly where the row's position is below its
    request's bound; a -1 entry suppresses nothing, also beside a real suppression of id 0."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen)
    ids = torch.tensor([[0, -1, 5], [7, 7, -1], [-1, -1, -1]])
    until = torch.tensor([10, 4, 100])
    positions = torch.tensor([9, 10, 3, 4, 0, 1])
    sampling = fspec.SamplingParams.create(3, suppress_ids=ids, suppress_until=until)
    got = suppress_tokens(logits, sampling, positions)
    want = _loop_reference(logits, ids, until, positions)
    assert torch.equal(got, want)
    assert torch.isinf(got[0, 0]) and torch.isinf(got[0, 5]) and not torch.isinf(got[1]).any()
    assert torch.isinf(got[2, 7]) and not torch.isinf(got[3]).any() and not torch.isinf(got[4:]).any()


def test_no_ids_is_the_logits_themselves():
    logits = torch.randn(4, 9)
    sampling = fspec.SamplingParams.create(2)
    assert suppress_tokens(logits, sampling, torch.zeros(4, dtype=torch.int64)) is logits


def test_min_new_tokens_masks_the_stop_ids_in_the_target_and_speculation_stays_exact():
    """With EOS set to each prompt's greedy first token, min_new_tokens = 3 keeps EOS out of the first three
    tokens: the first is the argmax without EOS (the prefill's logits), greedy speculation equals target-only
    decoding token for token, and without min_new_tokens every request ends at its first token."""
    from engine_setup import aligned_pair

    target, draft = aligned_pair(k=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [11], [20] * 9]
    first = fspec.generate(target, None, prompts, max_new_tokens=1).tokens
    for b, p in enumerate(prompts):
        eos = first[b][0]
        plain = fspec.generate(target, None, [p], max_new_tokens=8, eos_token_id=eos)
        assert plain.tokens == [[eos]] and plain.finish_reason == ["eos"]
        want = fspec.generate(target, None, [p], max_new_tokens=8, eos_token_id=eos, min_new_tokens=3)
        got = fspec.generate(target, draft, [p], max_new_tokens=8, eos_token_id=eos, min_new_tokens=3)
        assert got.tokens == want.tokens and eos not in want.tokens[0][:3]
        logits = fspec.prefill(target, None, [p]).logits[0].clone()
        logits[eos] = float("-inf")
        assert want.tokens[0][0] == int(logits.argmax())
