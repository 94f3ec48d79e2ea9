"""Attention follows the requests' real length, not max_model_len, and the outputs do not change.

Before: every decode and draft step attended over the whole block table, sized for max_position_embeddings
(8192 positions for SmolLM2-135M, whatever the request held): 4.15 tok/s target-only on one CPU thread, 10.9
with the table cut to 512. Now `generate` and `prefill` size the table by what the call can need
(`fspec.core.cache.table_width`), and the reference backend, eager on the CPU, reads only what the longest
request reaches, in quanta that keep PyTorch's CPU attention bit-identical
(`fspec.core.cache.CONTEXT_QUANTUM`). The shapes the attention sees are recorded by wrapping `reference_plan`:
no timing.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F

import fspec
from fspec.core.cache import CONTEXT_QUANTUM, DECODE_CONTEXT_QUANTUM, table_width
from fspec.models import llama
from fspec.serve import runner
from fspec.serve.engine import Stats
from fspec.serve.rounds import greedy_tokens

# Tiny matmuls on 2 shared cores: one thread (conftest's `one_thread`) avoids OpenMP spin-waits.
pytestmark = pytest.mark.usefixtures("one_thread")

ATTN = sys.modules["fspec.ops.attention"]  # the module (fspec.attention is the function)
LONG = 8192  # SmolLM2-135M's max_position_embeddings
PROMPTS = [[5, 9, 2, 7, 11], [3] * 19, list(range(40, 70))]


def long_target(*, positions: int = LONG, heads: tuple[int, int, int] = (4, 2, 8), seed: int = 0):
    """A tiny random target (2 layers) with `positions` positions; heads = (N, Nkv, D)."""
    n, nkv, d = heads
    cfg = fspec.ModelConfig(
        vocab_size=97, hidden_size=n * d, intermediate_size=64, num_hidden_layers=2, num_attention_heads=n,
        num_key_value_heads=nkv, head_dim=d, max_position_embeddings=positions,
    )  # fmt: skip
    return fspec.Target(cfg=cfg, params=llama.init(cfg, seed=seed))


def eagle3_head(target, *, k: int = 3, seed: int = 1):
    return fspec.init_draft(target, kind="eagle3", seed=seed, num_speculative_steps=k)


class Shapes:
    """Every reference-attention plan built while active: (query rows per request Q, keys read per request C,
    block-table width M)."""

    def __init__(self, monkeypatch) -> None:
        self.seen: list[tuple[int, int, int]] = []
        orig = ATTN.reference_plan

        def probe(meta, cache, **kw):
            plan = orig(meta, cache, **kw)
            self.seen.append((plan.visible.shape[2], plan.visible.shape[3], meta.block_table.shape[1]))
            return plan

        monkeypatch.setattr(ATTN, "reference_plan", probe)

    def one_row(self) -> list[tuple[int, int, int]]:
        return [s for s in self.seen if s[0] == 1]


def whole_table(monkeypatch) -> None:
    """The behaviour before: tables sized for max_model_len, every step reading all of it."""
    monkeypatch.setattr(runner, "table_width", lambda n, *, block_size, max_blocks: max_blocks)
    prefill_module = sys.modules["fspec.serve.prefill"]
    monkeypatch.setattr(prefill_module, "table_width", lambda n, *, block_size, max_blocks: max_blocks)
    monkeypatch.setattr(ATTN, "_host_readable", lambda t: False)


def test_table_width_is_a_power_of_two_of_512_token_quanta_capped_at_max_model_len():
    """table_width: whole 512-token quanta, a power of two of them, at least one, at most max_blocks."""
    assert [table_width(n, block_size=16, max_blocks=512) for n in (0, 1, 512, 513, 1500, 2049, 9000)] == [
        32, 32, 32, 64, 128, 256, 512,
    ]  # fmt: skip
    assert table_width(100, block_size=4, max_blocks=12) == 12  # a 48-position model: its whole table
    assert table_width(600, block_size=3, max_blocks=10**4) == 342  # 1024 tokens in blocks of 3
    with pytest.raises(ValueError, match="block_size"):
        table_width(10, block_size=0, max_blocks=4)


def test_generate_sizes_the_block_table_by_the_call_not_max_model_len():
    """A 5-token prompt and 12 new tokens on an 8192-position model: a table of one 512-token quantum (not
    512 blocks), eager and compiled, target-only and speculative; the cache holds what the requests need."""
    target = long_target()
    draft = eagle3_head(target)
    for d, k in ((None, 0), (draft, 3)):
        for compile in (False, True):
            run = runner.Run(target, d, [PROMPTS[0]], dict(temperature=[0.0], seed=[0]), max_new_tokens=12,
                             compile=compile, stats=Stats(k), progress=False)  # fmt: skip
            assert run.max_blocks * run.bs == CONTEXT_QUANTUM, (d is None, compile, run.max_blocks)
            assert run.tcache.num_blocks <= 16 + 4 * (not compile), run.tcache.num_blocks
    long = runner.Run(target, None, [PROMPTS[0]], dict(temperature=[0.0], seed=[0]), max_new_tokens=3000,
                      compile=False, stats=Stats(0), progress=False)  # fmt: skip
    assert long.max_blocks * long.bs == 4096  # 3005 tokens: eight quanta (a power of two)


def test_prefill_block_table_holds_the_prompts_not_max_model_len():
    """fspec.prefill on an 8192-position model: a table one 512-token quantum wide for short prompts (not 512
    blocks), and a cache of the blocks the prompts and `room` need."""
    target = long_target()
    pre = fspec.prefill(target, eagle3_head(target), PROMPTS)
    assert pre.block_table.shape == (3, CONTEXT_QUANTUM // 16)
    assert pre.target_cache.num_blocks == sum(-(-(len(p) + 64) // 16) for p in PROMPTS)


def test_decode_and_draft_steps_attend_over_what_the_requests_hold(monkeypatch):
    """Every attention call of a generate run on an 8192-position model: one-row steps (target decode, draft
    steps 2..K) read the requests' length rounded up to 16 keys, multi-row steps (prefill, verification, a
    round's first draft step) one 512-key quantum, and no table is wider than 512 positions. The one-row
    shapes are the same with max_position_embeddings 2048: nothing depends on max_model_len."""
    target = long_target()
    reach = max(map(len, PROMPTS)) + 12 + 2 * 3 + 2  # the longest request's last position + 1, at most
    runs = {}
    for positions in (LONG, 2048):
        t = dataclasses.replace(
            target, cfg=dataclasses.replace(target.cfg, max_position_embeddings=positions)
        )
        d = eagle3_head(t)
        for name, head in (("target-only", None), ("speculative", d)):
            with monkeypatch.context() as patch:  # (not monkeypatch.undo: it would undo conftest's too)
                shapes = Shapes(patch)
                fspec.generate(t, head, PROMPTS, max_new_tokens=12, num_speculative_steps=3)
            assert shapes.seen and all(m * 16 <= CONTEXT_QUANTUM for _, _, m in shapes.seen), shapes.seen
            one = shapes.one_row()
            assert one and all(
                c <= DECODE_CONTEXT_QUANTUM * -(-reach // DECODE_CONTEXT_QUANTUM) for _, c, _ in one
            )
            assert all(c == CONTEXT_QUANTUM for q, c, _ in shapes.seen if q > 1), shapes.seen
            runs[positions, name] = one
    assert runs[LONG, "target-only"] == runs[2048, "target-only"]
    assert runs[LONG, "speculative"] == runs[2048, "speculative"]


@pytest.mark.parametrize(
    "heads, positions", [((4, 2, 8), LONG), ((9, 3, 64), 2048)], ids=["tiny", "smollm2-heads"]
)
def test_outputs_equal_attention_over_the_whole_table(monkeypatch, heads, positions):
    """Bit for bit what attention over the whole table (8192 positions; 2048 at SmolLM2's head shapes, to
    stay fast) gave: greedy and sampled tokens of target-only and speculative generate (one request, read
    in place, and three, gathered), the prefill's logits and the head's first proposal (probabilities
    included)."""
    target = long_target(heads=heads, positions=positions)
    draft = eagle3_head(target)

    def outputs():
        out = []
        for prompts in ([PROMPTS[2]], PROMPTS):
            for head in (None, draft):
                seeds = [4, 5, 6][: len(prompts)]
                for kw in ({}, {"temperature": 0.9, "seed": seeds}):
                    out.append(fspec.generate(target, head, prompts, max_new_tokens=7, **kw).tokens)
        pre = fspec.prefill(target, draft, PROMPTS, temperature=[0.0, 1.0, 0.7], seed=3)
        state, _ = fspec.propose(draft.params, pre.state, pre.draft_cache, cfg=pre.draft_cfg)
        return out, [pre.logits, pre.tokens, state.draft_tokens, state.draft_probs, state.hidden]

    tokens, tensors = outputs()
    whole_table(monkeypatch)
    shapes = Shapes(monkeypatch)
    want_tokens, want_tensors = outputs()
    assert {c for _, c, _ in shapes.seen} == {positions}  # the reference really read the whole table
    assert tokens == want_tokens
    for got, want in zip(tensors, want_tensors):
        assert torch.equal(got, want)


def test_a_lone_request_reads_its_blocks_in_place(monkeypatch):
    """One request of the engine owns consecutive blocks: its steps read K/V where they lie (no gather);
    several requests gather theirs."""
    target = long_target()
    plans = []
    orig = ATTN.reference_plan
    monkeypatch.setattr(ATTN, "reference_plan", lambda *a, **kw: plans.append(orig(*a, **kw)) or plans[-1])
    fspec.generate(target, None, [PROMPTS[1]], max_new_tokens=6)
    one_row = [p for p in plans if p.visible.shape[2] == 1]  # (the prefill's 512 keys outgrow the cache)
    assert one_row and all(p.first_block == 0 for p in one_row)
    plans.clear()
    fspec.generate(target, None, PROMPTS, max_new_tokens=6)
    assert plans and all(p.first_block is None for p in plans)


def test_context_quanta_keep_cpu_attention_bit_identical():
    """The property the quanta rest on (torch's CPU SDPA with a mask): one query row over keys cut at a
    multiple of 16, or several rows at a multiple of 512, equal the same attention over 2048 keys whose
    extra keys are masked."""
    gen = torch.Generator().manual_seed(0)
    cases = ((1, 1), (1, 37), (1, 300), (1, 700), (4, 300), (4, 1000), (22, 130), (130, 5))
    for threads, (q_rows, length) in [(t, c) for t in (1, 2) for c in cases]:
        torch.set_num_threads(threads)  # (the one_thread fixture restores the count)
        q = torch.randn(2, 9, q_rows, 64, generator=gen)
        k, v = (torch.randn(2, 2048, 3, 64, generator=gen).transpose(1, 2) for _ in range(2))
        pos = torch.arange(length - q_rows, length).clamp(min=-1)

        quantum = DECODE_CONTEXT_QUANTUM if q_rows == 1 else CONTEXT_QUANTUM
        outs = []
        for c in (quantum * -(-length // quantum), 2048):
            j = torch.arange(c)
            mask = ((j <= pos[:, None]) | (j == 0)).expand(2, 1, q_rows, c)
            outs.append(
                F.scaled_dot_product_attention(q, k[:, :, :c], v[:, :, :c], attn_mask=mask, enable_gqa=True)
            )
        assert torch.equal(*outs), (threads, q_rows, length)


def test_greedy_tokens_are_the_samplers_temperature_zero_tokens():
    """The engine's greedy shortcut (an eager CPU batch of temperature 0) picks gumbel_sample's tokens:
    argmax, ties to the smallest id, NaN as -inf, an all -inf row token 0."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    logits[1, [7, 250]] = 100.0  # a tie
    logits[2, 5] = float("nan")
    logits[3] = float("-inf")
    logits[4, :] = float("nan")
    logits[4, 17] = 3.0
    zeros, seeds, positions = torch.zeros(6), torch.arange(6), torch.arange(6) + 10
    want = fspec.gumbel_sample(logits, zeros, seeds, positions)
    assert greedy_tokens(logits).tolist() == want.tolist()
    assert want[1] == 7 and want[3] == 0 and want[4] == 17
