"""The sampling kernels' GPU-only paths compile for an H100/H200 (sm_90) on this CPU machine.

The interpreter never takes the FAST_LOG branches (libdevice has no interpreter twin), so without this a
broken GPU path would first show on the GPU host. Triton's wheel ships ptxas and nvdisasm: the kernels are
compiled ahead of time for sm_90 and their SASS is checked for the approximate log2 unit (MUFU.LG2) the fast
path exists for, and for its absence otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

NVDISASM = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "nvdisasm"

# Run in a fresh interpreter: this test session imports the kernels under TRITON_INTERPRET=1, whose kernel
# objects the compiler cannot take.
PROBE = """
import inspect, json, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fspec.kernels.gumbel import _gumbel_block_kernel
from fspec.kernels.rejection import _rejection_residual_kernel

INT64 = {"seed_ptr", "positions_ptr", "block_token_ptr", "draft_tokens_ptr", "res_token_ptr", "p_token_ptr",
         "num_accepted_ptr"}
fast = sys.argv[1] == "1"

def sm90_sass(kernel, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    def kind(n):
        if n in constexprs:
            return "constexpr"
        if n.endswith("_ptr"):
            return "*i64" if n in INT64 else "*fp32"
        return "i32"
    sig = {n: kind(n) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([sys.argv[2], "-c", f.name], capture_output=True, text=True, check=True).stdout

out = {
    "gumbel": sm90_sass(
        _gumbel_block_kernel, {"SALT": 3, "WITH_STATS": True, "BLOCK": 2048, "FAST_LOG": fast}
    ),
    "residual": sm90_sass(_rejection_residual_kernel, {"HAS_Q": True, "BLOCK": 2048, "FAST_LOG": fast}),
}
print(json.dumps(out))
"""


@pytest.mark.skipif(not NVDISASM.exists(), reason="this Triton wheel ships no nvdisasm")
@pytest.mark.parametrize("fast", [False, True])
def test_sampling_kernels_compile_for_sm90_with_and_without_the_fast_log(fast):
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if fast else "0", str(NVDISASM)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    for name, sass in json.loads(run.stdout).items():
        assert ("MUFU.LG2" in sass) == fast, name
        assert "IMAD.WIDE.U32" in sass, name  # Philox rounds: 32 x 32 -> 64-bit multiplies (philox.py)


# The step kernels (metadata, RoPE tables, rejection's decide / finalize programs, the Gumbel reduction with
# and without its id map): they compile for sm_90
# with the pointer types their launchers pass, in every constexpr variant the launchers use.
STEP_PROBE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fspec.kernels.gumbel import _gumbel_finish_kernel, _gumbel_reduce_kernel
from fspec.kernels.rejection import _rejection_decide_kernel, _rejection_finalize_kernel
from fspec.kernels.rope_cos_sin import _rope_cos_sin_kernel
from fspec.kernels.step_metadata import _step_metadata_kernel, launch_config

def compile_sm90(kernel, types, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    def kind(n):
        if n in constexprs:
            return "constexpr"
        return types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
    sig = {n: kind(n) for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

i64 = {n: "*i64" for n in ("seed_ptr", "positions_ptr", "draft_tokens_ptr", "block_token_ptr", "greedy_ptr",
                           "tokens_ptr", "num_accepted_ptr", "res_token_ptr", "p_token_ptr")}
for has_q in (True, False):
    compile_sm90(_rejection_decide_kernel, i64, {"HAS_Q": has_q, "K1_POW2": 8, "NB_POW2": 64})
compile_sm90(_rejection_finalize_kernel, i64, {"NB_POW2": 64})
reduce_types = {"block_token_ptr": "*i64", "tokens_ptr": "*i64", "out_tokens_ptr": "*i64", "col_ptr": "*i64",
                "next_col_ptr": "*i64", "d2t_ptr": "*i64", "mapped_ptr": "*i64", "logits_ptr": "*bf16"}
for mapped in (True, False):
    compile_sm90(_gumbel_reduce_kernel, reduce_types, {"MAP": mapped, "NB_POW2": 32})
    for next_col in (True, False):
        consts = {"MAP": mapped, "NEXT_COL": next_col, "NB_POW2": 32, "BLOCK": 2048}
        compile_sm90(_gumbel_finish_kernel, reduce_types, consts)
meta = {"start_ptr": "*i64", "count_ptr": "*i64", "block_table_ptr": "*i32", "positions_ptr": "*i64",
        "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "slot_mapping_ptr": "*i64"}
for mode, q in ((0, 1), (1, 1), (2, 6), (3, 1), (2, 129), (2, 8191)):
    cfg = launch_config(256, q)
    consts = {"Q": q, "Q_TILES": cfg.q_tiles, "MODE": mode, "BLOCK": cfg.block_b, "BLOCK_Q": cfg.block_q}
    compile_sm90(_step_metadata_kernel, meta, consts)
for dtype in ("bf16", "fp32"):
    rope = {"positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}"}
    compile_sm90(_rope_cos_sin_kernel, rope, {"HALF": 32, "HALF_POW2": 32, "BLOCK": 16})
print("ok")
"""


def test_step_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", STEP_PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


# The top_k / top_p / min_p filter (its while-loop bisections, fp32 and bf16 logits, int32 and int64 top_k)
# and the sampling / verification kernels' FILTER variants compile for sm_90.
FILTER_PROBE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fspec.kernels import gumbel, rejection
from fspec.kernels.sampling_filter import _sampling_filter_kernel

I64 = {"seed_ptr", "positions_ptr", "block_token_ptr", "draft_tokens_ptr", "res_token_ptr", "p_token_ptr",
       "num_accepted_ptr", "tokens_ptr", "mapped_ptr", "out_tokens_ptr", "col_ptr", "next_col_ptr", "d2t_ptr",
       "greedy_ptr"}

def compile_sm90(kernel, constexprs, logits="*fp32", top_k="*i32", warps=4):
    names = list(inspect.signature(kernel.fn).parameters)
    def kind(n):
        if n in constexprs:
            return "constexpr"
        if not n.endswith("_ptr"):
            return "i32"
        special = {"logits_ptr": logits, "top_k_ptr": top_k, "cut_ptr": "*i32"}
        return special.get(n, "*i64" if n in I64 else "*fp32")
    src = ASTSource(fn=kernel, signature={n: kind(n) for n in names}, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

for logits, top_k in (("*fp32", "*i32"), ("*bf16", "*i64")):
    compile_sm90(_sampling_filter_kernel, {"BLOCK": 1024, "NC": 16}, logits, top_k, warps=8)
compile_sm90(gumbel._gumbel_block_kernel, {"SALT": 3, "WITH_STATS": True, "BLOCK": 2048, "FAST_LOG": True,
                                           "FILTER": True}, "*bf16")
compile_sm90(gumbel._gumbel_finish_kernel, {"MAP": True, "NEXT_COL": True, "NB_POW2": 32, "BLOCK": 2048,
                                            "FILTER": True})
compile_sm90(rejection._rejection_stats_kernel, {"BLOCK": 2048, "FILTER": True}, "*bf16")
compile_sm90(rejection._rejection_decide_kernel, {"HAS_Q": True, "K1_POW2": 8, "NB_POW2": 32, "FILTER": True})
compile_sm90(rejection._rejection_residual_kernel, {"HAS_Q": False, "BLOCK": 2048, "FAST_LOG": True,
                                                    "FILTER": True})
print("ok")
"""


def test_filter_kernel_and_filtered_sampling_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", FILTER_PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
