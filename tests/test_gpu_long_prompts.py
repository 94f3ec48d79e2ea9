"""Long prompts at SmolLM2-135M's shapes: greedy `fspec.generate` on CUDA, eager and compiled, gives the CPU
reference path's tokens for prompts of 1 to 8191 tokens, alone and mixed in one batch (@pytest.mark.gpu: the
H200 host); on any machine, the reference prefill of 129- and 1000-token prompts equals a dense recomputation.

Why: prompts past 128 tokens crashed the GPU prefill (`_step_metadata_kernel` asked for 262144 bytes of shared
memory, the H200 has 232448), and tests used toy prompts of a few tokens. The target is random, with
SmolLM2's head counts and dims (9 query / 3 KV heads of 64, hidden 576, MLP 1536, vocab 49152, tied
embeddings, 8192 positions) but 4 layers instead of 30, so the CPU reference stays a few seconds per prompt.
"""

from __future__ import annotations

import pytest
import torch

import fspec
from fspec.models import llama

MAX_POSITIONS = 8192
NEW_TOKENS = 8  # per request, fewer where the prompt leaves less room (prompt + new <= 8192)
LENGTHS = [1, 127, 129, 1000, 4096, 8191]
MIXED = [1000, 129, 2500, 1]  # one batch: ragged prompts padded to the longest


def smollm2_shaped_target(layers: int = 4, seed: int = 0) -> fspec.Target:
    """A random target with SmolLM2-135M's shapes (HF config), `layers` layers."""
    cfg = fspec.ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    return fspec.Target(cfg=cfg, params=llama.init(cfg, seed=seed))


@pytest.fixture(scope="module")
def models() -> tuple[fspec.Target, fspec.Draft]:
    target = smollm2_shaped_target()
    draft = fspec.init_draft(
        target, kind="eagle3", seed=1, num_speculative_steps=3, block_size=16, max_model_len=MAX_POSITIONS
    )
    return target, draft


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _new_tokens(prompts: list[list[int]]) -> int:
    return min(NEW_TOKENS, MAX_POSITIONS - max(map(len, prompts)))


# ----------------------------------------------------------------------------------------------------------
# CPU: the reference prefill against a dense forward (runs everywhere)
# ----------------------------------------------------------------------------------------------------------


def test_reference_prefill_of_long_prompts_equals_a_dense_recomputation(models):
    """Prompts of 129 and 1000 tokens in one batch (the first padded to the second), through the reference
    path (step metadata, paged cache write and attention over the block table): each last position's logits
    equal a dense causal forward over the prompt alone, the first new token is their argmax (greedy), and
    the head's first state holds every prompt position."""
    target, draft = models
    prompts = [_prompt(129, 1), _prompt(1000, 2)]
    pre = fspec.prefill(target, draft, prompts, room=NEW_TOKENS)
    assert pre.logits.shape == (2, 49152) and pre.block_table.shape[0] == 2
    for b, p in enumerate(prompts):
        dense, _ = llama.forward_dense(target.params, torch.tensor([p]), cfg=target.cfg)  # [1, S, V]
        torch.testing.assert_close(pre.logits[b], dense[0, -1].float(), rtol=1e-4, atol=1e-4)
        assert int(pre.tokens[b]) == int(dense[0, -1].argmax())
    assert pre.state.attn.positions.numel() == 2 * 1000  # [B * Q] rows of the head's first step
    live = pre.state.attn.positions.view(2, 1000) >= 0
    assert live.sum(1).tolist() == [129, 1000]


# ----------------------------------------------------------------------------------------------------------
# GPU: CUDA eager and compiled against the CPU reference
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_models(models):
    from test_gpu import _on_cuda

    return _on_cuda(*models)


_CPU_TOKENS: dict[tuple, list[list[int]]] = {}


def _cpu_tokens(models, prompts: list[list[int]]) -> list[list[int]]:
    """The CPU reference run's greedy tokens (kept for the eager and the compiled comparison)."""
    key = tuple(map(tuple, prompts))
    if key not in _CPU_TOKENS:
        target, draft = models
        out = fspec.generate(target, draft, prompts, max_new_tokens=_new_tokens(prompts))
        _CPU_TOKENS[key] = out.tokens
    return _CPU_TOKENS[key]


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("length", LENGTHS)
def test_long_prompt_greedy_tokens_on_gpu_equal_the_cpu_reference(models, cuda_models, length, compile):
    """One prompt of `length` tokens: `fspec.generate` greedy on CUDA (eager, and compile=True with its
    prefill graph of the prompt's bucket) emits the CPU run's tokens; the 8191-token prompt fills the
    8192 positions with its one new token."""
    prompts = [_prompt(length, length)]
    want = _cpu_tokens(models, prompts)
    target, draft = cuda_models
    got = fspec.generate(target, draft, prompts, max_new_tokens=_new_tokens(prompts), compile=compile)
    assert got.tokens == want
    assert len(want[0]) == _new_tokens(prompts)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_mixed_long_prompts_in_one_batch_on_gpu_equal_the_cpu_reference(models, cuda_models, compile):
    """B = 4 ragged prompts (1000, 129, 2500 and 1 tokens) padded into one prefill: every request's tokens
    on CUDA equal the CPU run's, and equal its tokens alone (batch composition changes nothing)."""
    prompts = [_prompt(n, n) for n in MIXED]
    want = _cpu_tokens(models, prompts)
    target, draft = cuda_models
    got = fspec.generate(target, draft, prompts, max_new_tokens=_new_tokens(prompts), compile=compile)
    assert got.tokens == want
    alone = fspec.generate(target, draft, [prompts[2]], max_new_tokens=_new_tokens(prompts), compile=compile)
    assert alone.tokens[0] == want[2]


@pytest.mark.gpu
def test_after_warmup_no_prompt_length_or_batch_records_a_graph(models, cuda_models):
    """`Generator.warmup(max_batch=4, max_len=4096)` on CUDA records the round graphs of buckets 1, 2, 4 and
    the prefill chunks of every length; afterwards compiled calls of 1 to 4 prompts of 1 to 3000 tokens (one
    chunk, several chunks of mixed lengths, ragged batches) record no CUDA graph and compile nothing, and
    their greedy tokens equal the CPU reference's."""
    from torch._dynamo.utils import counters

    target, draft = cuda_models
    gen = fspec.Generator()
    report = gen.warmup(target, draft, max_batch=4, max_len=4096, sampled=False)
    assert report["graphs"] == gen.recorded_graphs > 0
    graphs, compiles = gen.recorded_graphs, counters["stats"]["unique_graphs"]
    for lengths in ([1], [63], [65], [300], [1500, 2], [3000, 129, 64], [1000, 129, 700, 1]):
        prompts = [_prompt(n, n + 7) for n in lengths]
        got = gen.generate(target, draft, prompts, max_new_tokens=NEW_TOKENS, compile=True)
        cpu = fspec.generate(*models, prompts, max_new_tokens=NEW_TOKENS)
        assert got.tokens == cpu.tokens, lengths
    assert gen.recorded_graphs == graphs and counters["stats"]["unique_graphs"] == compiles


@pytest.mark.gpu
def test_continuous_refills_after_warmup_record_no_graph(models, cuda_models):
    """A compiled call of more prompts than slots (`Generator(max_batch=4)`, 11 prompts of 1 to 1500 tokens)
    whose requests end at different rounds (stop ids: the first tokens of three requests, which end at once,
    while the others run to max_new_tokens): each finished request's slot is refilled by a prefill of the
    waiting requests that fit. After `warmup(max_batch=4)` with the head and without, those refills record no
    CUDA graph and compile nothing, speculative and target-only, and the tokens equal the CPU reference's."""
    from torch._dynamo.utils import counters

    target, draft = cuda_models
    lengths = [700, 3, 65, 1500, 1, 300, 64, 129, 1000, 17, 250]
    prompts = [_prompt(n, n + 11) for n in lengths]
    ref = fspec.generate(*models, prompts, max_new_tokens=9).tokens
    stops = sorted({ref[i][0] for i in (1, 5, 8)})
    want = fspec.generate(*models, prompts, max_new_tokens=9, stop_token_ids=stops).tokens
    assert sum(len(t) == 1 for t in want) >= 2 and sum(len(t) == 9 for t in want) >= 4  # ends differ
    gen = fspec.Generator(max_batch=4)
    for head in (draft, None):
        gen.warmup(target, head, max_batch=4, max_len=1600, sampled=False)
    graphs, compiles = gen.recorded_graphs, counters["stats"]["unique_graphs"]
    for head in (draft, None):
        got = gen.generate(target, head, prompts, max_new_tokens=9, stop_token_ids=stops, compile=True)
        assert got.tokens == want, head is None
    assert gen.recorded_graphs == graphs and counters["stats"]["unique_graphs"] == compiles
