"""Compiled draft loops on CPU: equal to eager, one graph per bucket, no recompiles across steps and calls."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fspec
from fspec.compile import compile_propose, compile_step, pad_to_bucket, unpad

from draft_setup import leaves_snapshot, scenario, tiny_draft, tiny_target

TARGET = tiny_target()
DRAFT = tiny_draft(TARGET, kind="eagle3", k=3)


def _scenarios():
    # Two batches of one bucket (3 requests + 1 padding row): other contexts, live rows, seeds, temperatures.
    a = scenario(
        DRAFT, context_lens=[3, 6, 9], live=[1, 4, 2], temperature=[0.0, 1.0, 0.7], seed=1, padding_rows=1
    )
    b = scenario(
        DRAFT, context_lens=[7, 2, 12], live=[4, 3, 1], temperature=[1.2, 0.0, 0.3], seed=2, padding_rows=1
    )
    return a, b


def _compare(compiled_fn):
    for sc in _scenarios():
        before = leaves_snapshot(sc.state)
        state, _ = pad_to_bucket(sc.state, cfg=DRAFT.cfg)
        want, _ = fspec.propose(DRAFT.params, state, _fresh_cache_copy(sc), cfg=DRAFT.cfg)
        got, cache = compiled_fn(DRAFT.params, state, sc.cache)
        assert cache is sc.cache
        assert torch.equal(unpad(got, 4).draft_tokens, unpad(want, 4).draft_tokens)
        torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-4, atol=1e-5)
        for x, y in zip(before, fspec.tree.tree_leaves(sc.state)):
            assert torch.equal(x, y), "the compiled loop changed its input state"


def _fresh_cache_copy(sc):
    return fspec.KVCache(k=sc.cache.k.clone(), v=sc.cache.v.clone())


def test_compiled_whole_loop_equals_eager_without_recompiling_across_calls():
    """compile_propose: tokens equal eager's, q close; a second batch of the same bucket reuses the graph."""
    torch._dynamo.reset()
    counters.clear()
    _compare(compile_propose(cfg=DRAFT.cfg))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_step_replay_equals_eager_with_two_graphs():
    """compile_step: one graph for the first step's shape, one for decode steps, reused K - 1 times and across
    calls."""
    torch._dynamo.reset()
    counters.clear()
    _compare(compile_step(cfg=DRAFT.cfg))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_staged_inputs_copy_every_call_into_the_same_static_tensors_and_hand_back_the_callers():
    """compile_propose's inputs go through `StagedInputs`: one set of static-address copies per shape set,
    refreshed with the caller's values on every call (a stale copy would give the second batch the first
    batch's tokens: `_compare` above), and the result passes the caller's own temperature, seeds and block
    table through, not the copies the next call overwrites."""
    from fspec.compile import StagedInputs

    a, b = (pad_to_bucket(sc.state, cfg=DRAFT.cfg)[0] for sc in _scenarios())
    staged = StagedInputs()
    sa = staged.stage(a)
    first = [t.data_ptr() for t in fspec.tree.tree_leaves(sa.attn)] + [sa.hidden.data_ptr()]
    sb = staged.stage(b)
    assert [t.data_ptr() for t in fspec.tree.tree_leaves(sb.attn)] + [sb.hidden.data_ptr()] == first
    for name in ("input_ids", "hidden"):
        assert torch.equal(getattr(sb, name), getattr(b, name)) and getattr(sb, name) is not getattr(b, name)
    for x, y in zip(fspec.tree.tree_leaves(sb.sampling), fspec.tree.tree_leaves(b.sampling)):
        assert torch.equal(x, y) and x is not y
    for x, y in zip(fspec.tree.tree_leaves(sb.attn), fspec.tree.tree_leaves(b.attn)):
        assert torch.equal(x, y) and x is not y
    assert sb.draft_probs is b.draft_probs and sb.step is b.step  # not read by propose: not staged

    torch._dynamo.reset()
    sc = _scenarios()[1]
    state, _ = pad_to_bucket(sc.state, cfg=DRAFT.cfg)
    got, _ = compile_propose(cfg=DRAFT.cfg)(DRAFT.params, state, sc.cache)
    assert got.sampling.temperature is state.sampling.temperature and got.sampling.seed is state.sampling.seed
    assert got.attn.block_table is state.attn.block_table


def test_cuda_graph_mode_off_cuda_is_the_compiled_loop_and_bad_modes_are_refused():
    """mode="cuda-graph" compiles in Inductor's default mode (fspec captures the graphs, on CUDA only): on the
    CPU it is the compiled loop, equal to eager with one graph per bucket. Unknown modes, cuda-graph for the
    per-step path and a bad warm-up count are ValueErrors naming the argument."""
    from fspec.compile.graph_capture import GraphCapture

    torch._dynamo.reset()
    counters.clear()
    _compare(compile_propose(cfg=DRAFT.cfg, mode="cuda-graph"))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    with pytest.raises(ValueError, match="mode: expected one of .*'fast'"):
        compile_propose(cfg=DRAFT.cfg, mode="fast")
    with pytest.raises(ValueError, match="mode: expected one of .*'cuda-graph'"):
        compile_step(cfg=DRAFT.cfg, mode="cuda-graph")
    with pytest.raises(ValueError, match="warmup: expected an int >= 1.*got 0"):
        GraphCapture(lambda x: x, warmup=0)
    with pytest.raises(ValueError, match="args: expected pytrees of CUDA tensors, got a leaf Tensor on cpu"):
        GraphCapture(lambda x: x)(torch.zeros(3))


def test_staged_inputs_with_placeholders_keep_every_leaf_at_one_address():
    """With placeholders (the cuda-graph mode) the leaves propose never reads (step, draft buffers) are
    swapped for tensors allocated once, so a staged state of one bucket has the same leaf addresses on every
    call: what the captured graphs are keyed on."""
    from fspec.compile import StagedInputs

    a, b = (pad_to_bucket(sc.state, cfg=DRAFT.cfg)[0] for sc in _scenarios())
    staged = StagedInputs(placeholders=True)
    ptrs = [[t.data_ptr() for t in fspec.tree.tree_leaves(staged.stage(s))] for s in (a, b)]
    assert ptrs[0] == ptrs[1]
    sb = staged.stage(b)
    assert sb.draft_probs is not b.draft_probs and sb.draft_probs.shape == b.draft_probs.shape
    # the placeholders are the stager's own tensors (no caller's storage is kept alive or aliased), with
    # values a state may hold (eager `propose` validates the step)
    callers = {
        t.untyped_storage().data_ptr() for s in (a, b) for t in (s.step, s.draft_tokens, s.draft_probs)
    }
    assert not callers & {t.untyped_storage().data_ptr() for t in (sb.step, sb.draft_tokens, sb.draft_probs)}
    assert 0 <= int(sb.step) <= DRAFT.cfg.num_speculative_steps
    assert torch.equal(sb.hidden, b.hidden) and torch.equal(sb.attn.block_table, b.attn.block_table)
