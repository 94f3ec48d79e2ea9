"""Programmatic dependent launch (kernels/pdl.py): where it is on, the contract every kernel keeps, sm_90
code.

The contract that makes an early start safe is that a kernel waits on the one ahead of it before reading
anything another kernel wrote and before writing: checked on every kernel's source (the wait is the first
statement; skinny_linear may load a weight tile first), and on the PTX of compiled kernels.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys

import torch

from fspec.kernels import (
    gumbel,
    kv_write,
    paged_attention,
    pdl,
    rejection,
    rope_cos_sin,
    rope_kv_write,
    skinny_linear,
    step_metadata,
    value_flags,
)

MODULES = (
    gumbel,
    kv_write,
    paged_attention,
    rejection,
    rope_cos_sin,
    rope_kv_write,
    skinny_linear,
    step_metadata,
    value_flags,
)


def _kernels():
    for module in MODULES:
        for name, obj in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel") and hasattr(obj, "fn"):
                yield f"{module.__name__}.{name}", obj.fn


def test_every_kernel_takes_pdl_and_waits_before_touching_other_kernels_data():
    seen = 0
    for name, fn in _kernels():
        params = inspect.signature(fn).parameters
        assert "PDL" in params and params["PDL"].default is False, name
        body = ast.parse(inspect.getsource(fn)).body[0].body
        if name.endswith("_paged_attention_kernel"):
            _check_early_kv_attention(body)
            seen += 1
            continue
        if name.endswith("_paged_attention_reduce_kernel"):
            # the wait comes first either way; EARLY_RELEASE lets the next launch start just before it
            first = ast.unparse(body[0])
            assert first == (
                "if EARLY_RELEASE:\n    pdl_release_then_wait(PDL)\nelse:\n    pdl_enter(PDL)"
            ), first
            seen += 1
            continue
        calls = [
            i
            for i, stmt in enumerate(body)
            if isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and getattr(stmt.value.func, "id", None) == "pdl_enter"
        ]
        assert len(calls) == 1, name
        before = body[: calls[0]]
        skinny = ("_linear_kernel", "_gemv_kernel", "_rows_kernel", "_rows_tile_kernel")
        if name.endswith(tuple("_skinny" + tail for tail in skinny)):
            # index arithmetic and the first tile of w (constant weights: its gate rows and, for SiLU * up,
            # its up rows, an offset of the same pointer), no other load and no store
            nodes = [n for s in before for n in ast.walk(s) if isinstance(n, ast.Call)]
            loads = [n for n in nodes if ast.unparse(n.func) == "tl.load"]
            assert not [n for n in nodes if ast.unparse(n.func) in ("tl.store", "tl.atomic_add")], name
            bases = sorted(ast.unparse(n.args[0]).split(" ")[0] for n in loads)
            assert bases == ["u_rows", "w_rows"], (name, bases)
            assigns = {ast.unparse(n.targets[0]): ast.unparse(n.value) for s in before for n in ast.walk(s)
                       if isinstance(n, ast.Assign)}  # fmt: skip
            assert assigns["w_rows"].startswith("w_ptr + ") and assigns["u_rows"].startswith("w_rows + "), (
                name
            )
        else:
            assert calls[0] == 0, name
        seen += 1
    # gumbel 3, rejection 4, attention 2, kv_write, rope_kv_write, rope tables, metadata, linear 4, flags
    assert seen == 18


# What the attention may read before its wait under EARLY_KV: metadata and the cache rows older than the
# kernel ahead (through the early pointers); never q, the caches the kernel ahead writes, or any output.
EARLY_KV_READS = {
    "query_start_loc_ptr", "positions_ptr", "seq_lens_ptr", "block_table_ptr", "k_early_ptr", "v_early_ptr",
}  # fmt: skip


def _is_pdl_enter(stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and getattr(stmt.value.func, "id", None) == "pdl_enter"
    )


def _check_early_kv_attention(body) -> None:
    """The paged attention waits first unless EARLY_KV; with it, the statements before its one wait name
    only EARLY_KV_READS among the pointers and store nothing."""
    first = body[0]
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "not EARLY_KV", ast.unparse(first)
    assert len(first.body) == 1 and _is_pdl_enter(first.body[0]) and not first.orelse
    early = [i for i, s in enumerate(body) if isinstance(s, ast.If) and ast.unparse(s.test) == "EARLY_KV"]
    assert len(early) == 2  # the loads before the wait (and the wait), then the new rows' loads after it
    branch = body[early[0]].body
    waits = [i for i, s in enumerate(branch) if _is_pdl_enter(s)]
    assert len(waits) == 1
    before = body[1 : early[0]] + branch[: waits[0]]
    names = {n.id for s in before for n in ast.walk(s) if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
    assert names <= EARLY_KV_READS and {"k_early_ptr", "block_table_ptr"} <= names, names
    calls = {ast.unparse(n.func) for s in before for n in ast.walk(s) if isinstance(n, ast.Call)}
    assert not calls & {"tl.store", "tl.atomic_add", "tl.atomic_xchg"}, calls
    inside = [n for s in body for n in ast.walk(s) if _is_pdl_enter(n)]
    assert len(inside) == 2  # the two paths' waits, nothing else


def test_options_are_empty_off_the_gpu():
    assert pdl.options(torch.zeros(3)) == {}  # CPU tensors: the interpreter, no launch attribute


PROBE = """
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fspec.kernels.skinny_linear import _skinny_linear_kernel
from fspec.kernels.step_metadata import _step_metadata_kernel

def ptx(kernel, types, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
           for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

bf16 = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"}
meta = {"start_ptr": "*i64", "count_ptr": "*i64", "block_table_ptr": "*i32", "positions_ptr": "*i64",
        "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "slot_mapping_ptr": "*i64"}
out = {}
for on in (False, True):
    out[f"linear{int(on)}"] = ptx(_skinny_linear_kernel, bf16,
        {"M_PAD": 16, "BLOCK_N": 16, "BLOCK_K": 256, "UPCAST": False, "NORM": False, "SILU": False,
         "RESIDUAL": False, "PDL": on, "ROPE_HEAD_DIM": 0, "TABLE_DTYPE": triton.language.float32})
    out[f"meta{int(on)}"] = ptx(_step_metadata_kernel, meta,
        {"Q": 1, "Q_TILES": 1, "MODE": 3, "BLOCK": 128, "BLOCK_Q": 1, "PDL": on})
print(json.dumps(out))
"""


def test_pdl_kernels_compile_for_sm90_with_the_wait_after_the_first_weight_load():
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    for name in ("linear", "meta"):
        assert "griddepcontrol" not in out[f"{name}0"], name
        on = out[f"{name}1"]
        assert on.count("griddepcontrol.wait") == 1 and on.count("griddepcontrol.launch_dependents") == 1, (
            name
        )
        assert on.index("griddepcontrol.wait") < on.index("griddepcontrol.launch_dependents"), name
    on = out["linear1"]
    wait = on.index("griddepcontrol.wait")
    assert "ld.global" in on[:wait]  # the first weight tile is in flight before the wait ...
    assert "st.global" not in on[:wait]  # ... and nothing is written before it
    meta = out["meta1"]
    assert "ld.global" not in meta[: meta.index("griddepcontrol.wait")]


def test_only_nvidia_hopper_or_later_launches_with_pdl(monkeypatch):
    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    pdl._hopper_or_later.cache_clear()
    try:
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        assert pdl._hopper_or_later(0) and not pdl._hopper_or_later(1)
        pdl._hopper_or_later.cache_clear()
        monkeypatch.setattr(torch.version, "cuda", "12.1")  # graphs without programmatic edges
        assert not pdl._hopper_or_later(0)
        pdl._hopper_or_later.cache_clear()
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(torch.version, "hip", "6.2")  # an MI300 reports (9, 4)
        assert not pdl._hopper_or_later(0)
    finally:
        pdl._hopper_or_later.cache_clear()
