"""Reliability: every public function refuses bad input with a ValueError that names the argument, before any
kernel runs; the documented edge behaviours (NaN / inf logits, empty batches, strided inputs, broken heads)
hold; the same seeds give the same tokens; a long mixed run leaks no cache block. See RELIABILITY.md.

Only what the other test files do not already check is here (gumbel_sample / rejection_sample argument
tables: test_sampling.py, test_verify.py; state leaves: test_state.py; generate requests: test_engine.py).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from types import SimpleNamespace

import pytest
import torch

import fspec
from fspec.core.metadata import _slot_mapping
from fspec.serve.engine import Stats
from fspec.serve.runner import Run

from draft_setup import scenario as draft_scenario
from draft_setup import tiny_draft, tiny_target
from engine_setup import aligned_pair, assert_table_matches_blocks

R = dataclasses.replace
INF, NAN = float("inf"), float("nan")

# --- shared set-up ------------------------------------------------------------------------------------------


@functools.cache
def _models():
    target = tiny_target()
    return target, tiny_draft(target, kind="eagle", k=3)


@functools.cache
def _engine_models():
    target, draft = aligned_pair(k=3)
    return target, draft, tiny_draft(target, kind="eagle3", k=3)


@pytest.fixture
def ctx() -> SimpleNamespace:
    """A first-step draft state (2 requests x 4 rows) over a filled head cache (24 blocks of 4), and more."""
    target, draft = _models()
    sc = draft_scenario(draft, context_lens=[5, 9], live=[2, 4], temperature=[0.0, 1.0])
    st, t = sc.state, sc.state.attn.num_tokens
    gen = torch.Generator().manual_seed(0)
    return SimpleNamespace(
        target=target,
        draft=draft,
        params=draft.params,
        cfg=draft.cfg,
        state=st,
        cache=sc.cache,
        meta=st.attn,
        t=t,
        q=torch.randn(t, 4, 8, generator=gen),
        k=torch.randn(t, 2, 8, generator=gen),
        table=torch.arange(8, dtype=torch.int32).view(2, 4),
        decode=fspec.decode_metadata(
            torch.tensor([3, 5]), torch.arange(8, dtype=torch.int32).view(2, 4), block_size=4
        ),
    )


def _on_meta(params: dict) -> dict:
    return fspec.tree.tree_map(lambda x: x.to("meta"), params)


def _cache_like(c, **model_changes) -> fspec.KVCache:
    block_size = model_changes.pop("block_size", 4)
    num_blocks = model_changes.pop("num_blocks", 48)
    device = model_changes.pop("device", "cpu")
    model = R(c.cfg.model, **model_changes)
    return fspec.KVCache.create(model, num_blocks=num_blocks, block_size=block_size, device=device)


def _state_at(c, positions: list[int], table: torch.Tensor) -> fspec.DraftState:
    """A decode state (no validation) at `positions` over `table`, for metadata the builders allow."""
    meta = fspec.decode_metadata(torch.tensor(positions), table, block_size=4)
    b = len(positions)
    return R(
        c.state,
        input_ids=torch.ones(b, dtype=torch.int64),
        hidden=torch.zeros(b, 32),
        attn=meta,
        draft_tokens=torch.full((b, 3), -1, dtype=torch.int64),
        draft_probs=torch.zeros(b, 3, 97),
        sampling=fspec.SamplingParams.create(b),
    )


def _duplicate_position_meta() -> fspec.AttnMetadata:
    pos = torch.tensor([3, 3])
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    return fspec.AttnMetadata(
        positions=pos,
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        seq_lens=torch.tensor([4], dtype=torch.int32),
        block_table=table,
        slot_mapping=_slot_mapping(table, pos, 4, torch.zeros(2, dtype=torch.int64)),
    )


def _distill(c, batch: dict):
    cfg = fspec.DistillConfig(ttt_steps=2, steps=1, batch_size=1, seq_len=8, log_every=1)
    return fspec.distill_head(c.draft, lambda step: batch, cfg=cfg, progress=False)


def _batch(**changes) -> dict:
    batch = {
        "input_ids": torch.randint(0, 97, (1, 8)),
        "hidden": torch.randn(1, 8, 32),
        "target_logits": torch.randn(1, 8, 97),
    }
    batch.update(changes)
    return {k: v for k, v in batch.items() if v is not None}


def _generate(**kwargs):
    target, draft, _ = _engine_models()
    args = {"target": target, "draft": draft, "prompts": [[1, 2, 3]], "max_new_tokens": 2, **kwargs}
    return fspec.generate(args.pop("target"), args.pop("draft"), args.pop("prompts"), **args)


def _eagle3_with_layers(layers: tuple[int, int, int]) -> fspec.Draft:
    _, _, d3 = _engine_models()
    return R(d3, cfg=R(d3.cfg, target_layer_ids=layers))


# --- 1. bad input: ValueError naming the argument, nothing written ------------------------------------------
#
# (argument named at the start of the message, the call). Every call would otherwise crash deeper (IndexError,
# RuntimeError, a device-side assert on the GPU) or, worse, return a silently wrong result.

BAD_CALLS = [
    # decode_metadata / first_step_metadata / advance / decode_after
    ("positions", lambda c: fspec.decode_metadata(torch.tensor([1.0, 0.0]), c.table, block_size=4)),
    ("positions", lambda c: fspec.decode_metadata(torch.tensor([[1, 0]]), c.table, block_size=4)),
    ("positions", lambda c: fspec.decode_metadata(torch.tensor([-3, 0]), c.table, block_size=4)),
    ("positions", lambda c: fspec.decode_metadata(torch.tensor([1, 0, 2]), c.table, block_size=4)),
    ("positions", lambda c: fspec.decode_metadata(torch.tensor([1, 0]), c.table.to("meta"), block_size=4)),
    ("block_size", lambda c: fspec.decode_metadata(torch.tensor([1, 0]), c.table, block_size=0)),
    ("block_table", lambda c: fspec.decode_metadata(torch.tensor([1, 0]), c.table.float(), block_size=4)),
    (
        "num_tokens",
        lambda c: fspec.first_step_metadata(
            torch.tensor([0, 0]), torch.tensor([5, 1]), c.table, num_query=2, block_size=4
        ),
    ),
    (
        "num_tokens",
        lambda c: fspec.first_step_metadata(
            torch.tensor([0, 0]), torch.tensor([-1, 1]), c.table, num_query=2, block_size=4
        ),
    ),
    (
        "num_tokens",
        lambda c: fspec.first_step_metadata(
            torch.tensor([0, 0]), torch.tensor([1]), c.table, num_query=2, block_size=4
        ),
    ),
    (
        "num_query",
        lambda c: fspec.first_step_metadata(
            torch.tensor([0, 0]), torch.tensor([0, 0]), c.table, num_query=0, block_size=4
        ),
    ),
    (
        "start_positions",
        lambda c: fspec.first_step_metadata(
            torch.tensor([-2, 0]), torch.tensor([1, 1]), c.table, num_query=2, block_size=4
        ),
    ),
    (
        "start_positions",
        lambda c: fspec.first_step_metadata(
            torch.tensor([0.0, 0.0]), torch.tensor([1, 1]), c.table, num_query=2, block_size=4
        ),
    ),
    (
        "block_table",
        lambda c: fspec.first_step_metadata(
            torch.tensor([0, 0]), torch.tensor([1, 1]), c.table[:1], num_query=2, block_size=4
        ),
    ),
    ("meta", lambda c: fspec.advance("metadata", block_size=4, max_model_len=16)),
    ("block_size", lambda c: fspec.advance(c.decode, block_size=0, max_model_len=16)),
    ("max_model_len", lambda c: fspec.advance(c.decode, block_size=4, max_model_len=0)),
    ("meta.positions", lambda c: fspec.advance(c.meta, block_size=4, max_model_len=48)),  # T = B·Q, not B
    (
        "meta.seq_lens",
        lambda c: fspec.decode_after(
            R(c.decode, seq_lens=c.decode.seq_lens.float()), block_size=4, max_model_len=16
        ),
    ),
    ("block_size", lambda c: fspec.decode_after(c.decode, block_size=0, max_model_len=16)),
    # validate_attn_metadata
    ("block_size", lambda c: fspec.validate_attn_metadata(c.decode, block_size=0, max_model_len=16)),
    ("max_model_len", lambda c: fspec.validate_attn_metadata(c.decode, block_size=4, max_model_len=0)),
    (
        "num_blocks",
        lambda c: fspec.validate_attn_metadata(c.decode, block_size=4, max_model_len=16, num_blocks=0),
    ),
    (
        "attn.positions",
        lambda c: fspec.validate_attn_metadata(  # a strided view: kernels read unit stride
            R(c.decode, positions=torch.tensor([[3, 0], [5, 0]])[:, 0]), block_size=4, max_model_len=16
        ),
    ),
    (
        "attn.block_table",
        lambda c: fspec.validate_attn_metadata(  # block 0 shared by both requests
            fspec.decode_metadata(
                torch.tensor([1, 2]), torch.tensor([[0, 1], [0, 2]], dtype=torch.int32), block_size=4
            ),
            block_size=4,
            max_model_len=8,
        ),
    ),
    (
        "attn.positions",
        lambda c: fspec.validate_attn_metadata(  # two live tokens on one slot
            _duplicate_position_meta(), block_size=4, max_model_len=8
        ),
    ),
    # init_draft_state / validate_draft_state
    (
        "seed",
        lambda c: fspec.init_draft_state(
            c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, seed=torch.tensor([1.5, 2.5])
        ),
    ),
    (
        "seed",
        lambda c: fspec.init_draft_state(c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, seed=1.5),
    ),
    (
        "seed",
        lambda c: fspec.init_draft_state(c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, seed=True),
    ),
    (
        "seed",
        lambda c: fspec.init_draft_state(c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, seed=2**63),
    ),
    (
        "seed",
        lambda c: fspec.init_draft_state(
            c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, seed=[1.0, 2.0]
        ),
    ),
    (
        "seed",
        lambda c: fspec.init_draft_state(
            c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, seed=torch.tensor([1, 2, 3])
        ),
    ),
    (
        "temperature",
        lambda c: fspec.init_draft_state(
            c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, temperature=torch.tensor([1.0, 2.0, 3.0])
        ),
    ),
    (
        "temperature",
        lambda c: fspec.init_draft_state(
            c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, temperature=torch.tensor([True, False])
        ),
    ),
    (
        "temperature",
        lambda c: fspec.init_draft_state(
            c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, temperature="hot"
        ),
    ),
    (
        "input_ids",
        lambda c: fspec.init_draft_state(c.state.input_ids.float(), c.state.hidden, c.meta, cfg=c.cfg),
    ),
    (
        "state.hidden",
        lambda c: fspec.init_draft_state(c.state.input_ids, c.state.hidden[:, :5], c.meta, cfg=c.cfg),
    ),
    ("cfg", lambda c: fspec.init_draft_state(c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg.model)),
    (
        "state.draft_tokens",
        lambda c: fspec.validate_draft_state(
            R(c.state, draft_tokens=torch.full((3, 2), -1, dtype=torch.int64).t()), cfg=c.cfg
        ),
    ),
    ("cfg", lambda c: fspec.validate_draft_state(c.state, cfg=None)),
    # a position past the table or on an unallocated block: the builders give slot -1, the state is refused
    (
        "state.attn.seq_lens",
        lambda c: fspec.validate_draft_state(
            _state_at(c, [20, 3], torch.arange(8, dtype=torch.int32).view(2, 4)), cfg=c.cfg
        ),
    ),
    (
        "state.attn.block_table",
        lambda c: fspec.validate_draft_state(
            _state_at(c, [5, 3], torch.tensor([[0, -1, -1, -1], [2, 3, -1, -1]], dtype=torch.int32)),
            cfg=c.cfg,
        ),
    ),
    # draft_step / propose: the cache and params must fit the config and the state
    ("cache", lambda c: fspec.draft_step(c.params, c.state, _cache_like(c, block_size=2), cfg=c.cfg)),
    ("cache", lambda c: fspec.draft_step(c.params, c.state, _cache_like(c, num_hidden_layers=2), cfg=c.cfg)),
    (
        "cache",
        lambda c: fspec.draft_step(c.params, c.state, _cache_like(c, num_key_value_heads=4), cfg=c.cfg),
    ),
    ("cache", lambda c: fspec.draft_step(c.params, c.state, _cache_like(c, device="meta"), cfg=c.cfg)),
    ("cache", lambda c: fspec.draft_step(c.params, c.state, None, cfg=c.cfg)),
    ("params", lambda c: fspec.draft_step(_on_meta(c.params), c.state, c.cache, cfg=c.cfg)),
    ("params", lambda c: fspec.draft_step(c.params, c.state, c.cache, cfg=R(c.cfg, kind="mtp"))),
    ("max_context", lambda c: fspec.draft_step(c.params, c.state, c.cache, cfg=c.cfg, max_context=0)),
    (
        "state.attn.block_table",
        lambda c: fspec.draft_step(c.params, c.state, _cache_like(c, num_blocks=3), cfg=c.cfg),
    ),
    ("cache", lambda c: fspec.propose(c.params, c.state, _cache_like(c, block_size=2), cfg=c.cfg)),
    ("params", lambda c: fspec.propose(_on_meta(c.params), c.state, c.cache, cfg=c.cfg)),
    (
        "state.draft_probs",
        lambda c: fspec.propose(
            c.params, R(c.state, draft_probs=torch.zeros(97, 3, 2).permute(2, 1, 0)), c.cache, cfg=c.cfg
        ),
    ),
    # rejection_sample / gumbel_sample: values the kernels cannot use
    (
        "draft_probs",
        lambda c: fspec.rejection_sample(
            torch.randn(2, 3, 10),
            torch.zeros(2, 2, dtype=torch.int64),
            torch.full((2, 2, 10), NAN),
            torch.ones(2),
            torch.arange(2),
            torch.arange(2),
        ),
    ),
    (
        "draft_probs",
        lambda c: fspec.rejection_sample(
            torch.randn(2, 3, 10),
            torch.zeros(2, 2, dtype=torch.int64),
            torch.full((2, 2, 10), -0.1),
            torch.ones(2),
            torch.arange(2),
            torch.arange(2),
        ),
    ),
    (
        "target_logits",
        lambda c: fspec.rejection_sample(
            torch.tensor([[[0.0, INF, 0.0], [0.0, 0.0, 0.0]]]),
            torch.tensor([[1]]),
            None,
            torch.ones(1),
            torch.arange(1),
            torch.arange(1),
        ),
    ),
    (
        "temperature",
        lambda c: fspec.rejection_sample(  # 3000 / 1e-38 overflows: the softmax would be NaN
            torch.tensor([[[1000.0, 3000.0, -200.0]] * 2]),
            torch.tensor([[1]]),
            None,
            torch.tensor([1e-38]),
            torch.arange(1),
            torch.arange(1),
        ),
    ),
    (
        "logits",
        lambda c: fspec.gumbel_sample(
            torch.tensor([[0.0, INF, 1.0]]), torch.ones(1), torch.arange(1), torch.arange(1)
        ),
    ),
    (
        "temperature",
        lambda c: fspec.gumbel_sample(
            torch.tensor([[1000.0, 3000.0, -200.0]]), torch.tensor([1e-38]), torch.arange(1), torch.arange(1)
        ),
    ),
    # attention
    ("layer", lambda c: fspec.attention(c.q, c.k, c.k, c.meta, c.cache, layer=5, max_query_len=4)),
    ("layer", lambda c: fspec.attention(c.q, c.k, c.k, c.meta, c.cache, layer=-1, max_query_len=4)),
    ("meta.positions", lambda c: fspec.attention(c.q[:3], c.k[:3], c.k[:3], c.meta, c.cache, layer=0)),
    (
        "k",
        lambda c: fspec.attention(
            c.q, torch.randn(c.t, 4, 8), torch.randn(c.t, 4, 8), c.meta, c.cache, layer=0
        ),
    ),
    ("k", lambda c: fspec.attention(torch.randn(c.t, 3, 8), c.k, c.k, c.meta, c.cache, layer=0)),
    ("k", lambda c: fspec.attention(torch.randn(c.t, 4, 6), c.k, c.k, c.meta, c.cache, layer=0)),
    ("k", lambda c: fspec.attention(c.q.to("meta"), c.k, c.k, c.meta, c.cache, layer=0)),
    ("k", lambda c: fspec.attention(c.q, c.k.double(), c.k.double(), c.meta, c.cache, layer=0)),
    ("q", lambda c: fspec.attention(c.q.long(), c.k, c.k, c.meta, c.cache, layer=0)),
    ("max_query_len", lambda c: fspec.attention(c.q, c.k, c.k, c.meta, c.cache, layer=0, max_query_len=1)),
    ("max_context", lambda c: fspec.attention(c.q, c.k, c.k, c.meta, c.cache, layer=0, max_context=0)),
    ("cache", lambda c: fspec.attention(c.q, c.k, c.k, c.meta, None, layer=0, backend="reference")),
    ("cache", lambda c: fspec.attention(c.q, c.k, c.k, c.meta, _cache_like(c, device="meta"), layer=0)),
    (
        "meta.block_table",
        lambda c: fspec.attention(c.q, c.k, c.k, c.meta, _cache_like(c, num_blocks=3), layer=0),
    ),
    (
        "meta.slot_mapping",
        lambda c: fspec.attention(
            c.q, c.k, c.k, R(c.meta, slot_mapping=c.meta.slot_mapping + 1), c.cache, layer=0
        ),
    ),
    ("backend", lambda c: fspec.attention(c.q, c.k, c.k, c.meta, c.cache, layer=0, backend="flash")),
    # dense_attention
    ("q", lambda c: fspec.dense_attention(torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8))),
    (
        "k",
        lambda c: fspec.dense_attention(
            torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 6), torch.randn(2, 5, 2, 6)
        ),
    ),
    (
        "k",
        lambda c: fspec.dense_attention(
            torch.randn(2, 5, 3, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)
        ),
    ),
    (
        "k",
        lambda c: fspec.dense_attention(
            torch.randn(2, 5, 4, 8), torch.randn(3, 5, 2, 8), torch.randn(3, 5, 2, 8)
        ),
    ),
    (
        "v",
        lambda c: fspec.dense_attention(
            torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 4, 2, 8)
        ),
    ),
    (
        "mask",
        lambda c: fspec.dense_attention(
            torch.randn(2, 5, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
        ),
    ),
    (
        "mask",
        lambda c: fspec.dense_attention(
            torch.randn(2, 5, 4, 8),
            torch.randn(2, 6, 2, 8),
            torch.randn(2, 6, 2, 8),
            mask=torch.ones(2, 5, 6),
        ),
    ),
    (
        "mask",
        lambda c: fspec.dense_attention(
            torch.randn(2, 5, 4, 8),
            torch.randn(2, 6, 2, 8),
            torch.randn(2, 6, 2, 8),
            mask=torch.ones(2, 5, 7, dtype=torch.bool),
        ),
    ),
    # write_kv (24 blocks of 4: slots 0..95 live, 96.. the scratch block)
    ("slot_mapping", lambda c: fspec.write_kv(c.cache, 0, c.k, c.k, torch.full((c.t,), 10**6))),
    ("slot_mapping", lambda c: fspec.write_kv(c.cache, 0, c.k, c.k, torch.full((c.t,), 96))),
    ("slot_mapping", lambda c: fspec.write_kv(c.cache, 0, c.k, c.k, torch.full((c.t,), -5))),
    ("slot_mapping", lambda c: fspec.write_kv(c.cache, 0, c.k, c.k, torch.arange(c.t, dtype=torch.int32))),
    ("slot_mapping", lambda c: fspec.write_kv(c.cache, 0, c.k, c.k, torch.arange(c.t + 1))),
    ("slot_mapping", lambda c: fspec.write_kv(c.cache, 0, c.k[:2], c.k[:2], torch.tensor([3, 3]))),
    ("layer", lambda c: fspec.write_kv(c.cache, 3, c.k, c.k, torch.arange(c.t))),
    ("layer", lambda c: fspec.write_kv(c.cache, -1, c.k, c.k, torch.arange(c.t))),
    ("k", lambda c: fspec.write_kv(c.cache, 0, torch.randn(c.t, 4, 8), c.k, torch.arange(c.t))),
    ("k", lambda c: fspec.write_kv(c.cache, 0, c.k.to("meta"), c.k, torch.arange(c.t))),
    ("v", lambda c: fspec.write_kv(c.cache, 0, c.k, c.k[:3], torch.arange(c.t))),
    ("cache", lambda c: fspec.write_kv("cache", 0, c.k, c.k, torch.arange(c.t))),
    # head_forward / head_forward_dense / project_target_hidden / draft_to_target / vocab_maps
    (
        "input_ids",
        lambda c: fspec.head_forward(
            c.params, c.state.input_ids + 97, c.state.hidden, c.meta, c.cache, cfg=c.cfg
        ),
    ),
    (
        "input_ids",
        lambda c: fspec.head_forward(
            c.params, c.state.input_ids - 200, c.state.hidden, c.meta, c.cache, cfg=c.cfg
        ),
    ),
    (
        "input_ids",
        lambda c: fspec.head_forward(
            c.params, c.state.input_ids.int(), c.state.hidden, c.meta, c.cache, cfg=c.cfg
        ),
    ),
    (
        "hidden",
        lambda c: fspec.head_forward(
            c.params, c.state.input_ids, c.state.hidden[:, :5], c.meta, c.cache, cfg=c.cfg
        ),
    ),
    (
        "meta.positions",
        lambda c: fspec.head_forward(
            c.params, c.state.input_ids[:3], c.state.hidden[:3], c.meta, c.cache, cfg=c.cfg
        ),
    ),
    (
        "logit_rows",
        lambda c: fspec.head_forward(
            c.params,
            c.state.input_ids,
            c.state.hidden,
            c.meta,
            c.cache,
            cfg=c.cfg,
            logit_rows=torch.tensor([100]),
        ),
    ),
    (
        "params",
        lambda c: fspec.head_forward(
            _on_meta(c.params), c.state.input_ids, c.state.hidden, c.meta, c.cache, cfg=c.cfg
        ),
    ),
    (
        "params",
        lambda c: fspec.head_forward(
            c.params, c.state.input_ids, c.state.hidden, c.meta, c.cache, cfg=R(c.cfg, kind="mtp")
        ),
    ),
    (
        "cache",
        lambda c: fspec.head_forward(
            c.params,
            c.state.input_ids,
            c.state.hidden,
            c.meta,
            _cache_like(c, num_key_value_heads=4),
            cfg=c.cfg,
        ),
    ),
    (
        "meta.slot_mapping",
        lambda c: fspec.head_forward(
            c.params,
            c.state.input_ids,
            c.state.hidden,
            R(c.meta, slot_mapping=c.meta.slot_mapping + 1),
            c.cache,
            cfg=c.cfg,
        ),
    ),
    (
        "max_query_len",
        lambda c: fspec.head_forward(
            c.params, c.state.input_ids, c.state.hidden, c.meta, c.cache, cfg=c.cfg, max_query_len=1
        ),
    ),
    (
        "input_ids",
        lambda c: fspec.head_forward_dense(
            c.params, torch.full((1, 4), 97), torch.randn(1, 4, 32), cfg=c.cfg
        ),
    ),
    (
        "input_ids",
        lambda c: fspec.head_forward_dense(c.params, torch.full((4,), 2), torch.randn(4, 32), cfg=c.cfg),
    ),
    (
        "hidden",
        lambda c: fspec.head_forward_dense(c.params, torch.full((1, 4), 2), torch.randn(1, 4, 5), cfg=c.cfg),
    ),
    ("target_hidden", lambda c: fspec.project_target_hidden(c.params, torch.randn(3, 32), cfg=c.cfg)),
    (
        "target_hidden.last",
        lambda c: fspec.project_target_hidden(
            c.params, fspec.TargetHidden(last=torch.randn(3, 5), aux=torch.randn(3, 0)), cfg=c.cfg
        ),
    ),
    ("ids", lambda c: fspec.draft_to_target(torch.tensor([61]), torch.zeros(61, dtype=torch.int64))),
    ("ids", lambda c: fspec.draft_to_target(torch.tensor([1.0]), torch.zeros(61, dtype=torch.int64))),
    ("d2t", lambda c: fspec.draft_to_target(torch.tensor([1]), torch.zeros(61, 2, dtype=torch.int64))),
    ("draft_ids", lambda c: fspec.vocab_maps(torch.tensor([0.5, 1.5]), 97)),
    ("vocab_size", lambda c: fspec.vocab_maps(torch.tensor([0, 1]), 0)),
    # cache helpers
    ("block_ids", lambda c: fspec.block_table_row([-3, 2], max_blocks=4)),
    ("block_ids", lambda c: fspec.block_table_row([1, 1], max_blocks=4)),
    ("max_blocks", lambda c: fspec.block_table_row([1], max_blocks=0)),
    ("num_tokens", lambda c: fspec.blocks_needed(-5, 4)),
    ("block_size", lambda c: fspec.blocks_needed(5, 0)),
    ("dtype", lambda c: fspec.KVCache.create(c.cfg.model, num_blocks=2, block_size=4, dtype=torch.int64)),
    ("cfg", lambda c: fspec.KVCache.create(c.cfg, num_blocks=2, block_size=4)),
    ("cache", lambda c: fspec.mark_static("cache")),
    # generate
    ("prompts[0]", lambda c: _generate(prompts=[None])),
    ("prompts[0]", lambda c: _generate(prompts=[5])),
    ("prompts[0]", lambda c: _generate(prompts=[torch.tensor([[1, 2]])])),
    ("prompts[1]", lambda c: _generate(prompts=[[1], [2, -1]])),
    ("draft", lambda c: _generate(draft=R(_engine_models()[1], params=_on_meta(_engine_models()[1].params)))),
    ("draft", lambda c: _generate(draft=_eagle3_with_layers((1, 2, 9)))),
    ("compile", lambda c: _generate(compile="yes")),
    ("progress", lambda c: _generate(progress=1)),
    ("temperature[0]", lambda c: _generate(temperature=1e-38)),
    ("temperature[0]", lambda c: _generate(temperature=float("inf"))),
    ("seed[0]", lambda c: _generate(seed=2**64)),
    # distill_head and its batch sources
    ("batch", lambda c: _distill(c, _batch(hidden=None))),
    ("batch['hidden']", lambda c: _distill(c, _batch(hidden=torch.randn(1, 8, 31)))),
    ("batch['target_logits']", lambda c: _distill(c, _batch(target_logits=torch.randn(1, 8, 96)))),
    ("batch['input_ids']", lambda c: _distill(c, _batch(input_ids=torch.randint(0, 97, (1, 8)).int()))),
    ("batch['input_ids']", lambda c: _distill(c, _batch(input_ids=torch.full((1, 8), 97)))),
    (
        "tokens",
        lambda c: fspec.train.distill.online_batches(
            c.target,
            c.draft,
            torch.arange(200),
            cfg=fspec.DistillConfig(ttt_steps=2, batch_size=1, seq_len=8),
        ),
    ),
]


@pytest.mark.parametrize("name, call", BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_input_raises_value_error_naming_the_argument_before_writing(ctx, name, call):
    """Each bad call raises ValueError `<argument>: expected ..., got ...` and leaves the cache untouched."""
    k, v = ctx.cache.k.clone(), ctx.cache.v.clone()
    with pytest.raises(ValueError) as err:
        call(ctx)
    msg = str(err.value)
    assert msg.startswith(name), f"the message should name {name!r} first: {msg}"
    assert "expected" in msg and ("got" in msg or "missing" in msg), f"no expected/actual in: {msg}"
    assert torch.equal(ctx.cache.k, k) and torch.equal(ctx.cache.v, v), "a refused call wrote the cache"


def test_the_valid_baselines_of_the_bad_calls_pass(ctx):
    """The unmodified arguments the table perturbs are accepted (so each failure is the perturbation's)."""
    c = ctx
    fspec.validate_attn_metadata(c.decode, block_size=4, max_model_len=16, num_blocks=8)
    fspec.first_step_metadata(torch.tensor([0, 0]), torch.tensor([2, 1]), c.table, num_query=2, block_size=4)
    fspec.advance(c.decode, block_size=4, max_model_len=16)
    fspec.decode_after(c.meta, block_size=4, max_model_len=48)
    fspec.init_draft_state(
        c.state.input_ids, c.state.hidden, c.meta, cfg=c.cfg, seed=[1, 2], temperature=[0, 1]
    )
    fspec.init_draft_state(c.state.input_ids.int(), c.state.hidden, c.meta, cfg=c.cfg, seed=torch.tensor(3))
    fspec.attention(c.q, c.k, c.k, c.meta, c.cache, layer=0, max_query_len=4)
    fspec.dense_attention(torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8))
    fspec.head_forward(
        c.params, c.state.input_ids, c.state.hidden, c.meta, c.cache, cfg=c.cfg, max_query_len=4
    )
    fspec.head_forward_dense(c.params, torch.full((1, 4), 2), torch.randn(1, 4, 32), cfg=c.cfg)
    fspec.propose(c.params, c.state, c.cache, cfg=c.cfg)
    fspec.write_kv(c.cache, 0, c.k, c.k, torch.arange(c.t))
    fspec.draft_to_target(torch.tensor([60, -1]), torch.zeros(61, dtype=torch.int64))
    assert fspec.blocks_needed(0, 4) == 0
    _distill(c, _batch())
    fspec.gumbel_sample(
        torch.tensor([[1000.0, 3000.0, -200.0]]), torch.tensor([1e-3]), torch.arange(1), torch.arange(1)
    )
    assert _generate(temperature=1e-6, seed=2**63 - 1).tokens


# --- 2. documented edge behaviours --------------------------------------------------------------------------


def test_nan_and_minus_inf_logits_count_as_minus_inf_in_both_samplers():
    """NaN never wins (greedy or sampled); a row with no finite logit gives token 0 and a one-hot q."""
    logits = torch.tensor([[NAN, 2.0, NAN, 1.0], [NAN] * 4, [-INF, NAN, -INF, -INF], [0.5, NAN, 3.0, -INF]])
    n = logits.shape[0]
    for temp in (0.0, 1.0):
        out_t, out_p = torch.full((n, 1), -1), torch.zeros(n, 1, 4)
        tokens = fspec.gumbel_sample(
            logits,
            torch.full((n,), temp),
            torch.arange(n),
            torch.arange(n),
            out_tokens=out_t,
            out_probs=out_p,
            col=torch.tensor(0),
        )
        assert tokens[1] == 0 and tokens[2] == 0, "a row without a finite logit returns token 0"
        assert tokens[0] in (1, 3) and tokens[3] in (0, 2), f"NaN or -inf won: {tokens.tolist()}"
        assert torch.isfinite(out_p).all() and torch.equal(out_p[1, 0], torch.tensor([1.0, 0, 0, 0]))
        if temp == 0.0:
            assert tokens.tolist() == [1, 0, 0, 2]
    # verification: a target slot of NaN only is a one-hot at token 0, whatever the draft
    target = torch.randn(2, 3, 5)
    target[0, 0] = NAN
    for temp in (0.0, 1.0):
        tokens, accepted = fspec.rejection_sample(
            target,
            torch.tensor([[3, 1], [2, 2]]),
            None,
            torch.full((2,), temp),
            torch.arange(2),
            torch.arange(2),
        )
        assert tokens[0, 0] == 0 and accepted[0] == 0


def test_empty_batches_give_empty_results_where_documented_and_value_errors_elsewhere():
    """N = 0 rows sample nothing, B = 0 metadata is empty; a draft state and generate need a request."""
    empty_i = torch.zeros(0, dtype=torch.int64)
    assert fspec.gumbel_sample(torch.randn(0, 7), torch.ones(0), empty_i, empty_i).shape == (0,)
    tokens, accepted = fspec.rejection_sample(
        torch.randn(0, 3, 7), torch.zeros(0, 2, dtype=torch.int64), None, torch.ones(0), empty_i, empty_i
    )
    assert tokens.shape == (0, 3) and accepted.shape == (0,)
    table = torch.zeros(0, 4, dtype=torch.int32)
    assert fspec.slot_mapping(table, empty_i, 4).shape == (0,)
    meta = fspec.decode_metadata(empty_i, table, block_size=4)
    assert meta.num_requests == 0 and meta.num_tokens == 0
    fspec.validate_attn_metadata(meta, block_size=4, max_model_len=16)
    cfg = _models()[1].cfg
    with pytest.raises(ValueError, match="state.attn: expected at least one request, got an empty batch"):
        fspec.init_draft_state(empty_i, torch.zeros(0, 32), meta, cfg=cfg)
    with pytest.raises(ValueError, match="prompts: expected a non-empty list"):
        _generate(prompts=[])


def test_strided_temperature_seed_and_positions_sample_as_contiguous_ones_in_the_kernels(monkeypatch):
    """The Triton kernels (interpreted here) read per-row inputs at ptr + row: strided or expanded views are
    copied to unit stride first, so they give the tokens of their contiguous copies (they did not before)."""
    from fspec.kernels.ops import kernels_interpreted

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not kernels_interpreted():
        pytest.skip("the Triton interpreter is not active (CUDA present)")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    temp = torch.tensor([0.0, 9.0, 1.0, 9.0, 0.0, 9.0, 1.0, 9.0])[::2]  # [0, 0, ...] read as [0, 9, 1, 9]
    seed = torch.tensor([5]).expand(4)  # stride 0: read past its one element
    pos = torch.arange(8)[::2]
    want = fspec.gumbel_sample(logits, temp.contiguous(), seed.contiguous(), pos.contiguous())
    assert torch.equal(fspec.gumbel_sample(logits, temp, seed, pos), want)
    target = torch.randn(3, 3, 10, generator=gen)
    drafts = torch.randint(0, 10, (3, 2), generator=gen)
    temp3 = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])[::2]  # [1, 1, 0] read as [1, 0, 1]
    seed3 = torch.arange(6)[::2]
    pos3 = torch.tensor([4]).expand(3)
    want_r = fspec.rejection_sample(
        target, drafts, None, temp3.contiguous(), seed3.contiguous(), pos3.contiguous()
    )
    got_r = fspec.rejection_sample(target, drafts, None, temp3, seed3, pos3)
    assert torch.equal(got_r[0], want_r[0]) and torch.equal(got_r[1], want_r[1])


def test_a_broken_draft_head_never_changes_greedy_output():
    """NaN weights in the head: its logits are NaN (count as -inf: every draft is token 0); verification
    rejects what the target disagrees with, so greedy speculation still equals target-only decoding."""
    target, draft, _ = _engine_models()
    params = dict(draft.params)
    params["fc"] = torch.nn.Parameter(torch.full_like(params["fc"], NAN), requires_grad=False)
    broken = R(draft, params=params)
    prompts = [[1, 2, 3], [40, 41], list(range(10, 30))]
    want = fspec.generate(target, None, prompts, max_new_tokens=10)
    got = fspec.generate(target, broken, prompts, max_new_tokens=10)
    assert got.tokens == want.tokens
    assert got.stats["acceptance_length"] < 1.5, "NaN drafts should almost never be accepted"


# --- 3. determinism -----------------------------------------------------------------------------------------

DET_PROMPTS = [[5, 17, 33], [1, 2, 3, 4, 5, 6, 7, 8], [90], list(range(20, 41)), [7, 7, 7, 7]]
DET_TEMPS = [0.9, 0.0, 1.3, 0.6, 0.0]
DET_SEEDS = [11, 12, 13, 2**40 + 5, -7]


def assert_tokens_depend_on_the_request_only(target, head) -> list[list[int]]:
    """Generate DET_PROMPTS (sampled and greedy mixed) and check every request gets the same tokens in a
    repeated run, in a reversed batch, alone (bucket 1) and among eleven strangers (bucket 16); returns them.
    Shared by the CPU test below and its H200 twin in tests/test_gpu.py."""

    def run(prompts, temps, seeds):
        return fspec.generate(target, head, prompts, max_new_tokens=12, temperature=temps, seed=seeds).tokens

    base = run(DET_PROMPTS, DET_TEMPS, DET_SEEDS)
    assert run(DET_PROMPTS, DET_TEMPS, DET_SEEDS) == base
    assert run(DET_PROMPTS[::-1], DET_TEMPS[::-1], DET_SEEDS[::-1]) == base[::-1]
    for i in range(len(DET_PROMPTS)):
        assert run([DET_PROMPTS[i]], [DET_TEMPS[i]], [DET_SEEDS[i]]) == [base[i]]
    rng = random.Random(0)
    strangers = [[rng.randrange(97) for _ in range(rng.randint(1, 30))] for _ in range(11)]
    mixed_p = strangers[:6] + DET_PROMPTS + strangers[6:]
    mixed_t = [1.0] * 6 + DET_TEMPS + [0.5] * 5
    mixed_s = list(range(100, 106)) + DET_SEEDS + list(range(200, 205))
    assert run(mixed_p, mixed_t, mixed_s)[6:11] == base
    return base


@pytest.mark.parametrize("speculative", [True, False])
def test_same_seeds_give_the_same_tokens_across_runs_and_batch_compositions(speculative):
    """A request's tokens are a function of (prompt, temperature, seed) only: the same in a repeated run,
    alone (bucket 1), in a reversed batch, and among eleven strangers (bucket 16), sampled and greedy."""
    target, draft, _ = _engine_models()
    head = draft if speculative else None
    base = assert_tokens_depend_on_the_request_only(target, head)
    # a different seed changes the sampled requests (the seeds matter), never the greedy ones
    seeds = [s + 1 for s in DET_SEEDS]
    other = fspec.generate(
        target, head, DET_PROMPTS, max_new_tokens=12, temperature=DET_TEMPS, seed=seeds
    ).tokens
    assert other[1] == base[1] and other[4] == base[4]
    assert other[0] != base[0] or other[2] != base[2] or other[3] != base[3]


# --- 4. soak: many rounds, staggered finishes, blocks freed and reused, no leak -----------------------------


class _CheckedRun(Run):
    """A Run that checks the allocator's books after every processed round."""

    def _process(self, record) -> None:
        super()._process(record)
        held = [blk for blocks in self.blocks for blk in blocks]
        pending = [blk for blocks in self.free_at.values() for blk in blocks]
        assert len(set(held)) == len(held), "a block is held by two requests"
        assert not set(held) & set(pending), "a block is held and waiting to be freed"
        assert self.alloc._used == set(held) | set(pending), "allocator and requests disagree: a leak"
        assert all(not self.blocks[b] for b in range(self.b) if self.done[b]), (
            "a finished request holds blocks"
        )
        assert_table_matches_blocks(self)
        self.rounds_checked += 1


SOAK_WAVES = [  # (prompt seed, max_new_tokens, K, temperature)
    (3, 40, 3, 0.0),
    (4, 12, 5, 0.0),
    (5, 30, 2, 0.8),
]


@pytest.mark.parametrize("pipeline", [True, False])
def test_soak_many_rounds_with_staggered_finishes_frees_and_reuses_every_block(pipeline):
    """Three waves of 40 requests (bucket 64): prompts of 1..46 tokens near max_model_len 48, four frequent
    EOS tokens, so requests end at EOS, at max_new_tokens or at max_model_len in different rounds. Blocks are
    allocated as requests grow, freed as they finish and handed out again; after every round the books
    balance (no block held twice, none lost); at the end every block is free; greedy output equals
    target-only decoding token for token, and sampled output equals `generate`'s."""
    target, draft, _ = _engine_models()
    rounds = reused = 0
    for wave_seed, max_new, k, temp in SOAK_WAVES:
        rng = random.Random(wave_seed)
        lengths = [rng.choice([1, 3, 9, 20, 33, 40, 44, 46]) for _ in range(40)]
        prompts = [[rng.randrange(97) for _ in range(n)] for n in lengths]
        free = fspec.generate(target, None, prompts, max_new_tokens=max_new)
        counts: dict[int, int] = {}
        for toks in free.tokens:
            for tok in toks[1:]:
                counts[tok] = counts.get(tok, 0) + 1
        eos = tuple(sorted(counts, key=lambda t: -counts[t])[:4])  # frequent tokens: staggered EOS stops
        t_eos = R(target, cfg=R(target.cfg, eos_token_ids=eos))
        head = R(draft, cfg=R(draft.cfg, num_speculative_steps=k))
        seeds = list(range(40))
        if temp == 0.0:
            want = fspec.generate(t_eos, None, prompts, max_new_tokens=max_new).tokens
        else:
            want = fspec.generate(
                t_eos,
                head,
                prompts,
                max_new_tokens=max_new,
                temperature=temp,
                seed=seeds,
                num_speculative_steps=k,
            ).tokens
        run = _CheckedRun(
            t_eos, head, prompts, dict(temperature=[temp] * 40, seed=seeds), max_new_tokens=max_new,
            compile=False, stats=Stats(k), progress=False,
        )  # fmt: skip
        run.pipeline, run.rounds_checked = pipeline, 0
        allocated: list[int] = []
        allocate = run.alloc.allocate
        run.alloc.allocate = lambda n, allocate=allocate, log=allocated: (
            log.extend(allocate(n)) or log[len(log) - n :]
        )
        total = run.alloc.num_free
        got = run.go()
        assert got == want, f"wave {wave_seed}: speculative output differs from the reference"
        finish_lengths = sorted({len(t) for t in got})
        assert len(finish_lengths) >= 4, f"wave {wave_seed}: finishes not staggered: {finish_lengths}"
        assert any(t[-1] in eos for t in got) and any(len(p) + len(t) == 48 for p, t in zip(prompts, got))
        assert run.alloc.num_free == total and not run.alloc._used and all(not b for b in run.blocks), "leak"
        reused += len(allocated) - len(set(allocated))
        rounds += run.rounds_checked
    assert rounds >= 40, rounds
    assert reused > 0, "no freed block was ever handed out again"


def test_value_checks_skip_vmapped_ids_but_apply_eagerly():
    """head_forward_dense under torch.func.vmap over batched ids runs (a data-dependent check cannot), and
    the same out-of-vocabulary ids are refused eagerly."""
    _, draft = _models()
    ids = torch.randint(0, 97, (3, 2, 5), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(3, 2, 5, 32)
    logits = torch.func.vmap(lambda i, h: fspec.head_forward_dense(draft.params, i, h, cfg=draft.cfg)[0])(
        ids, hidden
    )
    want = torch.stack(
        [fspec.head_forward_dense(draft.params, i, h, cfg=draft.cfg)[0] for i, h in zip(ids, hidden)]
    )
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"^input_ids: expected token ids in \[0, 97\)"):
        fspec.head_forward_dense(draft.params, ids[0] + 97, hidden[0], cfg=draft.cfg)
