"""Launch configurations at SmolLM2-135M's shapes, at its longest prompt and the largest batch bucket: every
constexpr block a launcher derives from a runtime length (prompt tokens, batch, K, V, splits) stays under its
cap and every grid axis within CUDA's limits; compiled for the H200 (sm_90, on this CPU), no kernel asks for
more shared memory than an SM has, and a kernel's resources do not grow with the prompt.

The bug this guards against: a 129-token prompt made `_step_metadata_kernel`'s tile 128 x next_pow2(129) int64
values, 262144 bytes of shared memory against the H200's 232448 (`OutOfResources` at prefill). Only the
compiled kernel shows it: the interpreter has no shared memory.
"""

from __future__ import annotations

import pytest
import triton
from fresh_process import in_fresh_process

from fspec.core.config import size_bucket
from fspec.kernels import gumbel, rejection, rope_cos_sin, step_metadata
from fspec.kernels import paged_attention as pa
from fspec.kernels import value_flags as vf

# SmolLM2-135M (HF config): 30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab 49152, 8192 positions
HEADS, KV_HEADS, HEAD_DIM, VOCAB, MAX_POSITIONS = 9, 3, 64, 49152, 8192
BATCH, PROMPT, BLOCK_SIZE = 256, 8191, 16  # the largest batch bucket, the longest prompt with one new token
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535
H200_SHARED = 232448  # bytes of shared memory one program may take on an H200 (the error's "Hardware limit")


def _grid_ok(grid: tuple[int, ...]) -> bool:
    return 1 <= len(grid) <= 3 and grid[0] <= MAX_GRID_X and all(g <= MAX_GRID_YZ for g in grid[1:])


def test_step_metadata_launch_at_the_longest_prompt_and_largest_batch():
    """Prefill (MODE_FIRST, Q = the prompt and its compile bucket), decode and a 16-step rollout."""
    for q, steps in ((PROMPT, 1), (size_bucket(PROMPT), 1), (MAX_POSITIONS, 1), (1, 1), (1, 16), (17, 1)):
        cfg = step_metadata.launch_config(BATCH, q, steps)
        assert cfg.block_b * cfg.block_q <= step_metadata.MAX_TILE, (q, cfg)
        assert cfg.block_q <= step_metadata.MAX_BLOCK_Q and cfg.block_b <= step_metadata.BLOCK_B, (q, cfg)
        assert cfg.block_b * cfg.b_tiles >= BATCH + 1 and cfg.block_q * cfg.q_tiles >= q, (q, cfg)
        assert _grid_ok(cfg.grid), (q, cfg)


def test_paged_attention_launch_at_the_longest_prompt_and_largest_batch():
    """Prefill of 256 prompts of 8191 tokens (early_kv asked for, as the layers do), decode and a K + 1 = 17
    row verification: (query, head) rows, keys and head dim per program capped; each program's keys bounded
    by MAX_PARTITION; the early scan dropped for the prefill; splits, reduce chunks and every grid axis
    within bounds."""
    capacity_blocks = triton.cdiv(MAX_POSITIONS, BLOCK_SIZE)
    for num_query in (PROMPT, size_bucket(PROMPT), 1, 17):
        plan = pa.launch_plan(
            tokens=BATCH * num_query, batch=BATCH, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            num_query=num_query, max_blocks=capacity_blocks, block_size=BLOCK_SIZE, early_kv=True,
        )  # fmt: skip
        cfg = plan.config
        assert cfg.block_m <= pa.MAX_BLOCK_M and cfg.block_n <= 64 and plan.block_d <= 256, plan
        assert cfg.partition <= pa.MAX_PARTITION, plan  # keys one program reads
        assert plan.early_kv == (num_query <= pa.MAX_EARLY_KV_QUERY), plan
        assert plan.nq_pow2 <= pa.MAX_EARLY_KV_QUERY, plan
        assert plan.reduce_chunk * plan.block_d <= pa.REDUCE_TILE, plan
        assert _grid_ok(plan.grid) and plan.splits <= MAX_GRID_YZ, plan
        assert plan.reduce_grid is None or _grid_ok(plan.reduce_grid), plan


def test_sampling_launches_at_the_vocabulary_and_largest_batch():
    """Gumbel sampling of 256 x 17 rows, rejection sampling of K = 16 drafts per request and the value
    checks over the 49152-token vocabulary: blocks per load capped, grids within bounds, also at the
    smallest block the launchers allow and at philox.MAX_VOCAB."""
    k = 16
    for v, asked in ((VOCAB, None), (VOCAB, 4), (1 << 24, None), (1 << 24, 4)):
        block, nb, nb_load = gumbel.vocab_blocks(v, gumbel.launch_block(asked))
        assert block * nb >= v and nb_load <= gumbel.MAX_REDUCE_BLOCKS and block <= max(2048, v // 65535 * 2)
        for rows in (BATCH, BATCH * (k + 1)):
            assert _grid_ok((rows, nb)), (v, asked)  # block, finish and value-check kernels
        k1_pow2, decide_nb = rejection.decide_tiles(k + 1, nb_load)
        assert k1_pow2 <= rejection.MAX_DECIDE_SLOTS and k1_pow2 * decide_nb <= rejection.MAX_DECIDE_TILE
        assert vf.draft_block(k) <= vf.MAX_DRAFTS_PER_LOAD
    assert gumbel.vocab_blocks(VOCAB, gumbel.launch_block(None)) == (2048, 24, 32)  # the default: one load
    assert rejection.decide_tiles(17, 32) == (32, 32)
    # RoPE tables of every prefill token: BLOCK_T positions per program on grid axis 0
    assert rope_cos_sin.BLOCK_T <= 16 and triton.cdiv(BATCH * PROMPT, rope_cos_sin.BLOCK_T) <= MAX_GRID_X


# ----------------------------------------------------------------------------------------------------------
# sm_90 compile (fresh process: the kernel tests' interpreter cannot compile)
# ----------------------------------------------------------------------------------------------------------


def _sm90(kernel, types: dict, constexprs: dict, **options) -> tuple[int, int]:
    """(shared bytes, stack bytes per thread: register spills and local arrays) of `kernel` compiled for
    sm_90; stack 0 where this Triton wheel ships no cuobjdump."""
    import inspect
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {
        n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
        for n in names
    }
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, **options},
    )
    stack = 0
    tool = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "cuobjdump"
    if tool.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        stack = sum(int(w.split(":")[1]) for w in out.split() if w.startswith(("STACK:", "LOCAL:")))
    return compiled.metadata.shared, stack


META_TYPES = {"start_ptr": "*i64", "count_ptr": "*i64", "block_table_ptr": "*i32", "positions_ptr": "*i64",
              "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "slot_mapping_ptr": "*i64"}  # fmt: skip
ATTN_TYPES = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "positions_ptr": "*i64",
              "query_start_loc_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
              "part_acc_ptr": "*fp32", "scale_log2": "fp32", "q_ptr": "*bf16",
              "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16"}  # fmt: skip


def _metadata_usage(q: int) -> tuple[int, int]:
    cfg = step_metadata.launch_config(BATCH, q)
    consts = {"Q": q, "Q_TILES": cfg.q_tiles, "MODE": step_metadata.MODE_FIRST if q > 1 else 1,
              "BLOCK": cfg.block_b, "BLOCK_Q": cfg.block_q}  # fmt: skip
    return _sm90(step_metadata._step_metadata_kernel, META_TYPES, consts)


def _attention_usage(num_query: int) -> tuple[tuple[int, int], tuple[int, int]]:
    plan = pa.launch_plan(
        tokens=BATCH * num_query, batch=BATCH, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_query=num_query, max_blocks=MAX_POSITIONS // BLOCK_SIZE, block_size=BLOCK_SIZE, early_kv=True,
    )  # fmt: skip
    cfg = plan.config
    consts = dict(
        NUM_QUERY=num_query, GROUP=HEADS // KV_HEADS, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,
        BLOCK_SIZE=BLOCK_SIZE, SPLIT=plan.splits > 1, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=plan.block_d, UPCAST=False,
        EARLY_KV=plan.early_kv, NQ_POW2=plan.nq_pow2,
    )  # fmt: skip
    main = _sm90(pa._paged_attention_kernel, ATTN_TYPES, consts, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)  # fmt: skip
    reduce_consts = dict(NUM_HEADS=HEADS, HEAD_DIM=HEAD_DIM, SPLITS_POW2=plan.reduce_chunk,
                         BLOCK_D=plan.block_d)  # fmt: skip
    reduce = _sm90(pa._paged_attention_reduce_kernel, ATTN_TYPES, reduce_consts, num_warps=pa.REDUCE_WARPS)
    return main, reduce


def _compile_at_smollm2_shapes_body():
    # 1. Step metadata: every prompt length within the H200's shared memory and without spills, the same
    #    shared memory for 1025 rows (past one query tile) as for 8191 and 8192 (was 262144 bytes at 129).
    usage = {q: _metadata_usage(q) for q in (1, 6, 129, 1025, PROMPT, MAX_POSITIONS)}
    for q, (shared, stack) in usage.items():
        assert shared <= H200_SHARED and stack == 0, (q, usage)
    assert usage[1025] == usage[PROMPT] == usage[MAX_POSITIONS], usage
    # ... and the check rejects the old launch: all 129 rows of 128 requests in one tile
    old = {"Q": 129, "Q_TILES": 1, "MODE": step_metadata.MODE_FIRST, "BLOCK": 128, "BLOCK_Q": 256}
    assert _sm90(step_metadata._step_metadata_kernel, META_TYPES, old)[0] == 262144 > H200_SHARED
    # 2. Paged attention at prefill (its early loads dropped) and decode: within shared memory, and the
    #    main and reduce kernels' shared memory and stack the same at 129 query rows as at 8191 (the
    #    prompt's length reaches no tile; the main kernel's 80 bytes of stack at BLOCK_M = 64 are its own).
    attn = {q: _attention_usage(q) for q in (1, 129, PROMPT)}
    for q, kernels in attn.items():
        for shared, _ in kernels:
            assert shared <= H200_SHARED, (q, kernels)
    assert attn[129] == attn[PROMPT], attn
    # 3. Sampling reductions at the default block (one load) and the decide kernel at K = 16.
    names = ("seed_ptr", "positions_ptr", "draft_tokens_ptr", "block_token_ptr", "greedy_ptr", "tokens_ptr",
             "num_accepted_ptr", "res_token_ptr", "p_token_ptr", "out_tokens_ptr", "col_ptr", "next_col_ptr",
             "d2t_ptr", "mapped_ptr")  # fmt: skip
    i64 = {n: "*i64" for n in names}
    _, _, nb_load = gumbel.vocab_blocks(VOCAB, gumbel.launch_block(None))
    k1_pow2, decide_nb = rejection.decide_tiles(17, nb_load)
    for kernel, consts in (
        (rejection._rejection_decide_kernel, {"HAS_Q": True, "K1_POW2": k1_pow2, "NB_POW2": decide_nb}),
        (rejection._rejection_finalize_kernel, {"NB_POW2": nb_load}),
        (gumbel._gumbel_finish_kernel, {"MAP": True, "NEXT_COL": True, "NB_POW2": nb_load, "BLOCK": 2048}),
    ):
        shared, _ = _sm90(kernel, i64, consts)
        assert shared <= H200_SHARED, (kernel, shared)


def test_kernels_compiled_for_the_h200_at_smollm2_shapes_fit_and_do_not_grow_with_the_prompt():
    """sm_90 compiles at SmolLM2's shapes, batch 256: shared memory within the H200's 232448 bytes for every
    prompt length up to 8192, and the metadata and attention kernels' shared memory, registers and stack
    the same at 8191 tokens as at a length just past their tile caps."""
    in_fresh_process(__file__, globals(), "_compile_at_smollm2_shapes_body")


# ----------------------------------------------------------------------------------------------------------
# GPU (H200): the fixed kernels at SmolLM2's long-prompt shapes against their references
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_kernels_at_the_longest_prompt_and_largest_batch_equal_their_references():
    """On the H200: the prefill metadata of 256 prompts of up to 8191 tokens (the launch that crashed),
    and the paged attention of a 8191-token prefill and of 3 ragged prompts (early_kv asked for, as the
    layers do), equal their references."""
    in_fresh_process(__file__, globals(), "_gpu_long_prompt_body")


def _gpu_long_prompt_body():
    import torch

    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    # 1. step metadata, MODE_FIRST, B = 256, Q = 8191: ragged counts, a padding request, a shuffled table
    q, blocks = PROMPT, MAX_POSITIONS // BLOCK_SIZE
    table = torch.randperm(BATCH * blocks, generator=gen)[: BATCH * blocks].view(BATCH, blocks).int()
    count = torch.randint(0, q + 1, (BATCH,), generator=gen)
    count[0] = q
    start = torch.zeros(BATCH, dtype=torch.int64)
    start[7] = -1
    kw = dict(num_query=q, block_size=BLOCK_SIZE, max_model_len=MAX_POSITIONS, mode=step_metadata.MODE_FIRST)
    args = [x.to(dev) for x in (start, count, table)]
    got = step_metadata.step_metadata(*args, **kw)
    want = step_metadata.step_metadata_ref(*args, **kw)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # 2. paged attention of prefills: one 8191-token prompt; 1000, 129 and 2500 tokens padded to 2500
    for lens in ([PROMPT], [1000, 129, 2500]):
        nq, b = max(lens), len(lens)
        table = torch.randperm(b * blocks, generator=gen).view(b, blocks).int()
        positions = torch.arange(nq)[None, :].expand(b, nq)
        positions = torch.where(positions < torch.tensor(lens)[:, None], positions, -1).reshape(-1)
        qsl = torch.arange(b + 1, dtype=torch.int32) * nq
        kc = torch.randn(b * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        vc = torch.randn(b * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        qq = torch.randn(b * nq, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        seq = torch.tensor(lens, dtype=torch.int32)
        a = [x.to(dev) for x in (qq, kc, vc, table, seq, positions, qsl)]
        out = pa.paged_attention(*a, scale=HEAD_DIM**-0.5, num_query=nq, early_kv=True, early_release=True)
        ref = pa.paged_attention_ref(*a, scale=HEAD_DIM**-0.5, num_query=nq)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        assert bool((out[a[5] < 0] == 0).all())
