"""The benchmark scripts' CPU smoke modes: they run end to end and write what BENCHMARKS.md's tables read,
so a GPU run does not spend its time discovering a broken script. Each also asserts its own invariant."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The tests that run a script in a subprocess are `slow` (run them before a GPU run:
# `python -m pytest -q -m slow tests/test_benchmarks.py`): the fspec code they drive has its own tests. The
# others read the scripts' helpers and committed results in-process, and stay in the default run.


def _run(script: str, *args: str, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, f"{script} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
def test_ttt_step_smoke_times_the_train_step_and_distillation(tmp_path):
    d = _run("bench_ttt_step.py", "--smoke", out=tmp_path / "ttt_step.json")
    step, distill = d["rows"]
    assert [r["case"]["name"] for r in d["rows"]] == ["tiny_train_step", "toy_distill_head"]
    for row in (step, distill):
        assert "error" not in row and row["s_per_step"] > 0 and math.isfinite(row["loss"]) and row["loss"] > 0
        tokens = row["case"]["batch"] * row["case"]["seq_len"]
        assert math.isclose(row["tok_s"], tokens / row["s_per_step"], rel_tol=1e-9)


@pytest.mark.slow
def test_distill_random_smoke_times_distill_head_on_a_random_smollm2_shaped_target(tmp_path):
    row = _run("bench_distill_random.py", "--steps", "4", "--layers", "2", out=tmp_path / "distill.json")
    assert row["case"]["name"] == "smollm2_shaped_random_distill_head" and row["case"]["layers"] == 2
    assert row["case"]["target_vocab"] == 49152 and row["case"]["draft_vocab"] == 8192
    assert "error" not in row and row["s_per_step"] > 0 and math.isfinite(row["loss"])


@pytest.mark.slow
def test_host_round_smoke_splits_a_call_into_a_fixed_part_and_a_part_per_token(tmp_path):
    args = ("--new-tokens", "6", "--reps", "2", "--top", "5")
    row = _run("bench_host_round.py", *args, out=tmp_path / "host.json")
    assert row["case"]["name"] == "target_only_host_round" and row["tokens"] == [6, 6]
    assert row["fixed_ms"] > 0 and len(row["one_token_ms_all"]) == 2
    assert math.isclose(row["ms_per_token"], 1e3 / row["tok_s"], rel_tol=1e-9)
    assert sum("under cProfile" in line for line in row["profile"]) == 2  # one call of each length


@pytest.mark.slow
def test_draft_vocab_coverage_smoke_reports_every_held_out_set(tmp_path):
    args = ("--prompts", "1", "--new-tokens", "4", "--id-cuts", "8192", "49152")
    d = _run("draft_vocab_coverage.py", *args, out=tmp_path / "coverage.json")
    assert [r["case"]["set"] for r in d["rows"]] == ["code", "chat", "health"]
    for row in d["rows"]:
        assert row["tokens"] == 4 and 0 <= row["coverage"] <= 1 and row["tau"] >= 1
        assert row["coverage_ids_below"]["49152"] == 1.0  # every id is below the vocabulary size


@pytest.mark.slow
def test_gpu_soak_smoke_checks_every_call_s_blocks(tmp_path):
    d = _run("gpu_soak.py", "--smoke", out=tmp_path / "soak.json")
    assert d["failure"] is None and d["calls"] == 12 and d["blocks_checked"] >= 12


@pytest.mark.slow
def test_distill_scaling_smoke_two_gloo_processes_match_one(tmp_path):
    d = _run("bench_distill_scaling.py", "--cpu-smoke", out=tmp_path / "scaling.json")
    assert d["equality"]["relative_distance"] < 1e-4 and d["equality"]["loss_1"] == d["equality"]["loss_2"]
    assert d["throughput"]["1"]["tokens_per_s"] > 0 and d["throughput"]["2"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_generate_smoke_forced_row_accepts_everything(tmp_path):
    prof = tmp_path / "profile.txt"
    d = _run(
        "bench_generate.py", "--cpu-smoke", "--skip-hf", "--batch", "1", "--profile", str(prof),
        out=tmp_path / "gen.json",
    )  # fmt: skip
    rows = {r["case"]["system"]: r for r in d["rows"]}
    forced = next(r for name, r in rows.items() if "forced" in name)
    assert forced["acceptance_length"] == d["config"]["K"] + 1  # tau = K + 1 exactly, by construction
    # every part of every row ran: no row, round graph or round model recorded an error
    assert [(n, k) for n, r in rows.items() for k in r if k.endswith("error") and r[k]] == []
    assert all(r["tokens_per_s"] > 0 and r["round_graph_us"] > 0 for r in rows.values())
    assert all(min(r["phases_s"].values()) > 0 for r in rows.values())  # setup, prefill, rounds
    assert prof.read_text().count("round graph:") == len(rows)
    # one forward per new token target-only (the prefill's included); full acceptance wastes no round either
    k, n = d["config"]["K"], d["config"]["new_tokens"]
    launched = {name: r["phases_s"]["rounds_launched"] for name, r in rows.items()}
    assert launched[next(name for name in rows if "target-only" in name)] == n - 1
    assert launched[next(name for name in rows if "forced" in name)] == -(-(n - 1) // (k + 1))


@pytest.mark.slow
def test_call_overhead_smoke_times_every_case_and_gc_setting(tmp_path):
    d = _run("bench_call_overhead.py", "--cpu-smoke", "--calls", "2", out=tmp_path / "co.json")
    assert [(r["case"], r["gc"]) for r in d["rows"]] == [
        (c, g) for c in ("forced", "target") for g in ("default", "frozen", "disabled")
    ]
    assert all(len(r["calls"]) == 2 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in d["rows"])
    assert all(r["tokens_per_s_median"] > 0 for r in d["rows"])
    assert d["phases_s"]["forced"]["rounds_launched"] < d["phases_s"]["target"]["rounds_launched"]


@pytest.mark.slow
def test_acceptance_scores_a_built_model_on_a_cut_grid(tmp_path):
    """--model / --ks / --trained-only (how gpu_run.sh's heads stage scores builds): only those rows, and
    no theory columns without the K = 1 and K = 7 runs they need."""
    from fspec.train import toy_model

    d = _run(
        "bench_acceptance.py", "--model", str(toy_model.ASSETS), "--prompts", "2", "--ks", "5",
        "--trained-only", "--new-tokens", "8", out=tmp_path / "acc.json",
    )  # fmt: skip
    assert [(r["case"]["head"], r["case"]["temperature"], r["case"]["K"]) for r in d["rows"]] == [
        ("trained", 0.0, 5),
        ("trained", 1.0, 5),
    ]
    assert d["prompts"] == 2 and all(1.0 <= r["acceptance_length"] <= 6.0 for r in d["rows"])
    assert not any("theory_iid" in r or "theory_per_position" in r for r in d["rows"])
    assert "fspec/assets/toy" in d["model"]


@pytest.mark.slow
def test_skinny_linear_smoke_agrees_with_cublas_path_on_every_row(tmp_path):
    """The interpreter run covers every shape x row count and the kernel equals F.linear on each."""
    d = _run("bench_skinny_linear.py", "--cpu-smoke", "--rows", "1", "6", out=tmp_path / "sk.json")
    assert [(r["shape"], r["M"]) for r in d["rows"]] == [(s, m) for s in ("tiny a", "tiny b") for m in (1, 6)]
    assert all(r["max_abs_diff_vs_cublas"] < 1e-4 and r["skinny_us"] > 0 for r in d["rows"])


@pytest.mark.slow
def test_skinny_linear_dependent_smoke_times_calls_after_a_kernel_they_depend_on(tmp_path):
    """--dependent: every call runs after x is rewritten, that kernel's own time subtracted; the file says
    so, and the results still equal F.linear's."""
    d = _run("bench_skinny_linear.py", "--cpu-smoke", "--rows", "1", "--dependent", out=tmp_path / "skd.json")
    assert d["dependent"] is True and [r["M"] for r in d["rows"]] == [1, 1]
    assert all(r["max_abs_diff_vs_cublas"] < 1e-4 for r in d["rows"])
    assert all(math.isfinite(r["skinny_us"]) and math.isfinite(r["cublas_us"]) for r in d["rows"])


def test_dependent_timing_runs_the_dependency_before_every_call_and_subtracts_it_once(monkeypatch):
    """time_per_call_us(before=...): `before` runs ahead of each call of each timed pass, its own time is
    measured once per dependency (cached) and subtracted."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bsl", ROOT / "benchmarks" / "bench_skinny_linear.py")
    bsl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bsl)
    order = []
    monkeypatch.setattr(bsl.time, "perf_counter", lambda: len(order))  # a fake clock: 1 s per event

    def before():
        order.append("before")

    weights = [object(), object()]
    us = bsl.time_per_call_us(lambda w: order.append("call"), weights, True, before=before)
    # 4 passes of the calls (one warm-up, 3 timed), then 4 passes of the dependency alone
    assert order[:16] == ["before", "call"] * 8 and order[16:] == ["before"] * 8
    # per call: 2 s with the dependency (before + call), 1 s for the dependency alone
    assert us == 1e6
    count = len(order)
    bsl.time_per_call_us(lambda w: order.append("call"), weights, True, before=before)
    assert order[count:] == ["before", "call"] * 8  # the dependency's own time is measured once


def test_skinny_sweep_grid_adds_the_cuda_core_kernels_for_several_rows(monkeypatch):
    """sweep_configs: for 2..MAX_ROWS rows the rows tile kernel's configs join the tile grid where they fit,
    and for 2..FMA_MAX_ROWS rows the CUDA-core rows kernel's, each (block_n, warps, effective BLOCK_K) once;
    one row gets the one-row kernel's instead."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bsl", ROOT / "benchmarks" / "bench_skinny_linear.py")
    bsl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bsl)
    sixteen = bsl.sweep_configs(16, 576, small=True)
    tiles = [c for c in sixteen if not c.fma]
    assert tiles and [c for c in sixteen if c.fma] == [c for c in sixteen if c.one_tile]
    # the rows tile kernel at 2..16 rows where its [block_n, 1024] tile fits 128 values per thread: not 32
    # columns at 4 warps; with SiLU * up's two tiles neither 16 at 4 nor 32 at 8
    got = {(c.block_n, c.num_warps) for c in sixteen if c.one_tile}
    assert got == {(16, 4), (16, 8), (16, 16), (32, 8), (32, 16)}
    silu = bsl.sweep_configs(6, 576, small=True, silu=True)
    assert {(c.block_n, c.num_warps) for c in silu if c.one_tile} == {(16, 8), (16, 16), (32, 16)}
    six = bsl.sweep_configs(6, 576, small=True)
    fma = [c for c in six if c.fma and not c.one_tile]
    assert [c for c in six if not c.fma or c.one_tile] == sixteen and fma
    keys = [(c.block_n, c.num_warps, bsl.rows_block_k(c, 6, 576)) for c in fma]
    assert len(set(keys)) == len(keys) == len(fma)
    assert {c.num_warps for c in fma} == {2, 4, 8} and {c.block_n for c in fma} == {16, 32}
    one = bsl.sweep_configs(1, 576, small=True)
    assert all(c.num_stages == 1 and c.split_k >= 1 for c in one if c.fma) and any(c.fma for c in one)


def test_verify_rows_swept_variant_takes_each_products_fastest_several_row_config(monkeypatch, tmp_path):
    """bench_verify_rows --swept: the fastest config of each several-row sweep row keyed by its weight's
    (N, K) (a SiLU * up product's block_n doubled for the launcher to halve; one-row rows ignored), routed
    through `default_config` of skinny_linear and of qkv_rope_write with the norm's BLOCK_K cap lifted; the
    other variants put the library's own functions back, and `restore` all of them."""
    import importlib.util
    import json

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bvr", ROOT / "benchmarks" / "bench_verify_rows.py")
    bvr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bvr)
    from fspec.kernels import qkv_rope_write as qrw
    from fspec.kernels import skinny_linear as sk
    from fspec.models import layers

    best = {"block_n": 32, "block_k": 1024, "num_warps": 2, "num_stages": 1, "fma": False, "one_tile": False,
            "split_k": 1}  # fmt: skip
    rows = [
        {"N": 960, "K": 576, "M": 6, "fusion": "norm", "best_config": best},
        {"N": 3072, "K": 576, "M": 6, "fusion": "norm+silu", "best_config": dict(best, block_n=16, fma=True)},
        {"N": 576, "K": 576, "M": 1, "fusion": "residual", "best_config": dict(best, block_n=64)},
        {"N": 576, "K": 1536, "M": 6, "fusion": "residual"},  # every config failed: no best
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows}))
    table = bvr.swept_configs(path)
    assert set(table) == {(960, 576), (3072, 576)}
    assert table[(960, 576)] == sk.SkinnyConfig(**best)
    assert table[(3072, 576)] == sk.SkinnyConfig(**dict(best, block_n=32, fma=True))
    original = (sk.default_config, layers.use_qkv_rope, sk.NORM_MAX_BLOCK_K, layers.use_fused_layer)
    try:
        bvr.set_variant("swept", table)
        assert sk.default_config(960, 576) == qrw.default_config(960, 576) == table[(960, 576)]
        assert sk.default_config(576, 576) == original[0](576, 576)  # not swept: the library's
        assert sk.default_config(960, 576, one_row=True) == original[0](960, 576, one_row=True)
        assert sk.NORM_MAX_BLOCK_K >= 1024 and qrw.NORM_MAX_BLOCK_K >= 1024
        assert qrw.rows_config(960, 576, 64, norm=True) == table[(960, 576)]
        bvr.set_variant("rope_apart")
        assert layers.use_qkv_rope is not original[1] and sk.default_config is original[0]
        bvr.set_variant("rows_tile")  # several rows on the rows tile kernel where it fits, q/k/v's RoPE too
        assert sk.default_config(960, 576) == qrw.rows_config(960, 576, 64, norm=True) == bvr.ROWS_TILE
        assert sk.default_config(960, 576, one_row=True) == original[0](960, 576, one_row=True)
        assert sk.default_config(4096, 4096) == original[0](4096, 4096)  # a deep reduction: the library's
    finally:
        bvr.restore()
    assert (sk.default_config, layers.use_qkv_rope, sk.NORM_MAX_BLOCK_K, layers.use_fused_layer) == original
    assert qrw.default_config is original[0] and qrw.NORM_MAX_BLOCK_K == original[2]


def test_back_to_back_time_is_the_median_window_and_every_window_is_kept(monkeypatch):
    """bench_draft_loop's back-to-back figure: BACK_TO_BACK_WINDOWS windows of `reps` calls each, the median
    window's time per call returned and each window's kept, so one stalled window cannot decide it."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bdl", ROOT / "benchmarks" / "bench_draft_loop.py")
    bdl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bdl)
    window_ms = iter([2.0, 2.2, 9.0, 2.1, 1.9])  # one stalled window (9 ms for 20 calls)

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return next(window_ms)

    calls = []
    monkeypatch.setattr(bdl.torch.cuda, "Event", Event)
    monkeypatch.setattr(bdl.torch.cuda, "synchronize", lambda: None)
    host, per_call, windows = bdl.host_and_back_to_back_us(lambda: calls.append(1), 20)
    assert bdl.BACK_TO_BACK_WINDOWS == 5 and len(calls) == 20 + 5 * 20  # host-timed calls, then the windows
    assert windows == [100.0, 110.0, 450.0, 105.0, 95.0]  # µs per call
    assert per_call == 105.0 and host >= 0


@pytest.mark.slow
def test_dispatch_smoke_times_every_op_both_ways_with_equal_results(tmp_path):
    d = _run(
        "bench_dispatch.py", "--device", "cpu", "--calls", "2", "--vocab", "300", out=tmp_path / "d.json"
    )
    names = ["gumbel_sample", "gumbel_sample_into", "rejection_sample", "kv_write", "rope_kv_write"]
    assert [r["op"] for r in d["rows"]] == [*names, "paged_attention"]
    assert all(r["same_result"] and r["dispatcher_us"] > 0 and r["direct_us"] > 0 for r in d["rows"])


def test_draft_vocab_coverage_is_the_share_of_target_tokens_the_head_can_draft(monkeypatch):
    import importlib.util
    import types

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("brm", ROOT / "benchmarks" / "bench_real_model.py")
    brm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(brm)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[2, 5]] = True
    head = types.SimpleNamespace(params={"t2d": t2d})
    assert brm.draft_vocab_coverage(head, [[2, 3, 5], [5, 9]]) == 3 / 5
    assert brm.draft_vocab_coverage(head, [[], []]) is None
    assert brm.draft_vocab_coverage(types.SimpleNamespace(params={}), [[1]]) is None


def test_switches_table_is_rebuilt_from_its_committed_sources():
    """benchmarks/results/switches.json: every row follows from the two benchmark files it names."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("switches", ROOT / "benchmarks" / "switches.py")
    switches = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(switches)
    committed = json.loads((ROOT / "benchmarks/results/switches.json").read_text())
    assert committed["rows"]
    for row in committed["rows"]:
        draft, overhead = (ROOT / p if p != "-" else Path(p) for p in row["sources"])
        env = ",".join(f"{k}={v}" for k, v in row["env"].items()) or "-"
        rebuilt = switches.build(row["run"], row["variant"], env, draft, overhead)
        rebuilt["sources"] = [str(p) for p in row["sources"]]
        assert rebuilt == row
        assert row["1b_back_to_back_over_floor"] == round(row["1b_back_to_back_us"] / row["1b_floor_us"], 3)


@pytest.mark.slow
def test_skinny_linear_fusions_smoke_times_each_fused_call(tmp_path):
    """--fusions: one row per fused call of the decode layer, timed fused, plain skinny and cuBLAS."""
    args = ("--cpu-smoke", "--fusions", "--rows", "1", "3")
    d = _run("bench_skinny_linear.py", *args, out=tmp_path / "skf.json")
    assert [(r["shape"], r["fusion"], r["M"]) for r in d["rows"]] == [
        ("tiny a", "norm+silu", 1),
        ("tiny a", "norm+silu", 3),
        ("tiny b", "residual", 1),
        ("tiny b", "residual", 3),
    ]
    assert all(
        r["fused_us"] > 0 and r["fused_tile_us"] > 0 and r["skinny_us"] > 0 and r["cublas_us"] > 0
        for r in d["rows"]
    )


_FAKE_PEER = """
from vllm.triton_utils import tl, triton  # the stand-in's two names


def gumbel_sample(logits, mapping, temperature, seed, pos, apply_temperature, processed_logits_out=None):
    assert triton.cdiv(5, 2) == 3 and tl.constexpr is not None
    processed_logits_out.copy_(logits / temperature.clamp(min=1e-6)[:, None])
    return logits.argmax(-1)
"""


def test_peer_loader_imports_a_peer_file_with_stand_in_vllm_modules_and_leaves_none_behind(tmp_path):
    """benchmarks/peers.py imports a vLLM file whose only vLLM import is `vllm.triton_utils` through
    stand-in modules that exist only while it imports; an absent file gives None (no peer row)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert peers.vllm_gumbel(tmp_path / "absent.py") is None
    fake = tmp_path / "gumbel.py"
    fake.write_text(_FAKE_PEER)
    before = {n for n in sys.modules if n == "vllm" or n.startswith("vllm.")}
    module = peers.vllm_gumbel(fake)
    assert {n for n in sys.modules if n == "vllm" or n.startswith("vllm.")} == before
    import torch

    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    temp = torch.tensor([0.5, 1.0])
    call = peers.vllm_gumbel_call(module, logits, temp, torch.arange(2), torch.arange(2))
    assert call().tolist() == [1, 0]


@pytest.mark.slow
def test_host_overhead_smoke_times_every_piece_of_an_eager_sampling_call(tmp_path):
    """Every piece of an eager gumbel_sample_into (allocations, each launch, launcher, dispatch, validation,
    public function) gets a host time per call and one with the drain, on every shape."""
    fake = tmp_path / "gumbel.py"  # a peer file as benchmarks/peers.py loads it (vLLM's needs its wheel)
    fake.write_text(_FAKE_PEER)
    d = _run("bench_host_overhead.py", "--cpu-smoke", "--vllm", str(fake), out=tmp_path / "ho.json")
    pieces = ["empty", "scratch", "launch_block", "launch_finish", "launcher", "call", "op"]
    pieces += ["validate", "public", "vllm"]
    assert d["vllm_gumbel"] == str(fake)
    assert [(r["B"], r["V"]) for r in d["rows"]] == [(1, 50), (3, 70)]
    for r in d["rows"]:
        for p in pieces:
            assert 0 < r[f"{p}_us"] <= r[f"{p}_drained_us"], p


@pytest.mark.slow
def test_cpu_round_profile_times_every_piece_of_the_demo_round(tmp_path):
    """profile_cpu_round.py on the default model: every piece timed, each forward's components add up to
    its wall time (`other` is the rest, never negative), the floor is below every forward."""
    d = _run("profile_cpu_round.py", "--reps", "1", "--round", "1", out=tmp_path / "cpu_round.json")
    assert set(d["timings"]) >= {"round", "decode_forward", "verify_forward", "rejection", "drafts"}
    assert all(0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"] for t in d["timings"].values())
    for parts in d["breakdown"].values():
        assert parts["other"] >= 0 and math.isclose(sum(parts.values()) - parts["wall"], parts["wall"])
        assert parts["lm_head"] > 0 and parts["attention"] > 0
    assert 0 < d["floor"]["weights_read_ms"] < d["timings"]["decode_forward"]["median_ms"]
    assert d["attention_ops"]["verify"]["sdpa"] > 0


def test_benchmarks_md_tables_are_the_rendered_results():
    """Every `### name` section of BENCHMARKS.md with a benchmarks/results/<name>.json is exactly what
    make_tables.py renders from that file (heading, command line, table): a new benchmark run cannot leave
    a stale table behind."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tables", ROOT / "benchmarks" / "make_tables.py")
    make_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tables)
    md = (ROOT / "BENCHMARKS.md").read_text()
    rendered = {name: make_tables.section(name) for name in make_tables.NAMES}
    assert sum(text is not None for text in rendered.values()) >= 15
    for name, text in rendered.items():
        if text is not None:
            assert text.strip() in md, f"BENCHMARKS.md: the {name} section differs from make_tables.py {name}"


def test_sampling_blocks_table_has_one_row_per_shape_and_names_its_fastest_block():
    """make_tables.sampling_blocks pivots bench_sampling.py's --blocks sweep: one row per (op, B, V) in sweep
    order, one column per block size in ascending order (a size missing from a shape shows as "-"), and the
    fastest size of the row, whichever order the sweep ran in."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tables", ROOT / "benchmarks" / "make_tables.py")
    make_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tables)
    sweep = [
        {"op": "gumbel_sample", "B": 64, "V": 32000, "block": 2048, "fspec_graph_us": 7.8, "floor_us": 1.9},
        {"op": "gumbel_sample", "B": 64, "V": 32000, "block": 512, "fspec_graph_us": 9.3, "floor_us": 1.9},
        {"op": "rejection_sample", "B": 1, "V": 7, "block": 512, "fspec_graph_us": 3.0, "floor_us": 0.1},
        {"op": "gumbel_sample", "B": 64, "V": 32000, "block": 1024, "fspec_graph_us": 7.6, "floor_us": 1.9},
    ]
    lines = make_tables.sampling_blocks({"block_sweep": sweep})
    assert lines[0] == (
        "| op | B | V | floor µs | 512 tokens, graph µs | 1024 tokens, graph µs | 2048 tokens, graph µs "
        "| fastest |"
    )
    assert lines[2] == "| gumbel_sample | 64 | 32000 | 1.9 | 9.3 | 7.6 | 7.8 | 1024 |"
    assert lines[3] == "| rejection_sample | 1 | 7 | 0.1 | 3.0 | - | - | 512 |"
    assert len(lines) == 4


@pytest.mark.slow
def test_chain_memory_smoke_counts_both_forms_with_equal_losses(tmp_path):
    d = _run("bench_chain_memory.py", "--smoke", out=tmp_path / "chain.json")
    (row,) = d["rows"]
    assert row["loss_equal"] and row["dense_GB"] > row["lean_GB"] > 0


@pytest.mark.slow
def test_cpu_packed_smoke_runs_both_parts_and_keeps_tokens(tmp_path):
    args = ("--prompts", "1", "--new-tokens", "6", "--skip-hf")
    d = _run("bench_cpu_packed.py", *args, out=tmp_path / "p.json")
    products = [r for r in d["rows"] if r["case"]["part"] == "products"]
    assert [r["case"]["rows"] for r in products] == [1, 2, 3, 4, 6, 8]
    assert all(r["f_linear_ms"] > 0 and r["packed_ms"] > 0 for r in products)
    spec = [r for r in d["rows"] if r["case"].get("mode") == "spec"]
    assert len(spec) == 2 * 4 * 2  # sets x K x prepack
    assert all(r["same_tokens"] and r["tau_mean"] >= 1.0 for r in spec)


@pytest.mark.slow
def test_continuous_smoke_runs_the_chosen_modes_and_profiles_the_host(tmp_path):
    args = ("--device", "cpu", "--dtype", "float32", "--batch", "4", "--prompts", "6", "--new-tokens", "4",
            "--skip-hf", "--modes", "continuous", "continuous_grouped", "--profile-host")  # fmt: skip
    d = _run("bench_continuous.py", *args, out=tmp_path / "continuous.json")
    assert [r["case"]["mode"] for r in d["rows"]] == ["continuous", "continuous_grouped"]
    for row in d["rows"]:
        assert row["new_tokens"] > 0 and math.isclose(row["tok_s"], row["new_tokens"] / row["seconds"])
        assert row["target_forwards"] > row["rounds"] > 0  # the prefills are forwards too
    assert "cumulative" in (tmp_path / "continuous_host_4.txt").read_text()


def test_generation_occupancy_simulation_counts_rounds_of_calls_and_of_one_run():
    """The simulation behind the recipe's one-run generation: answers are the runs of the loss mask, and a
    call ends when its slowest request does (lengths 3, 1, 2 through 2 slots: 3 rounds in one run, 3 + 1 + 2
    in calls of one prompt)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("sgo", ROOT / "benchmarks" / "sim_generation_occupancy.py")
    sgo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sgo)
    mask = torch.tensor([False, True, True, True, False, True, False, False, True, True])
    assert sgo.answer_lengths(mask) == [3, 1, 2]
    assert sgo.rounds_of([3, 1, 2], 2, 0) == 3 and sgo.rounds_of([3, 1, 2], 2, 1) == 6
    assert sgo.rounds_of([3, 1, 2], 2, 2) == 3 + 2 and sgo.rounds_of([5] * 4, 2, 0) == 10


def _tree_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tree_acceptance
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return tree_acceptance


def test_tree_simulation_accepts_the_longest_held_rank_path_and_chooses_the_most_matched_paths():
    """tree_acceptance.py: a round accepts the longest prefix of its rank path that the tree holds (a missing
    rank, the token outside the draft vocabulary, ends it), emits it plus the target's token and starts
    after them; the rounds counted stop where a round's K drafts would pass the answer (whole: every round,
    cut at the end); a tree of budget N is the N paths most rows match, prefix-closed."""
    import torch

    ta = _tree_module()
    x = ta.NO_RANK
    r = torch.tensor([[0, 0, 1], [1, 0, x], [0, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [x, 0, 0], [0, 0, 0]])
    chain = ta.chain_of(3)
    assert chain == {(0,), (0, 0), (0, 0, 0)}
    assert ta.paths_of(r[1]) == [(1,), (1, 0)] and ta.paths_of(r[6]) == []
    # chain: row 0 accepts 2 (rank 1 at depth 2 is not held) -> 3 tokens, next row 3 accepts 3 -> 4 tokens,
    # next row 7 is the last: no round starts there (nothing left to emit)
    assert ta.simulate(r, chain, whole=True) == ta.simulate(r, chain) == [2, 3]
    # six rows: row 3's drafts would reach row 6, past the answer: not counted, but run when whole
    assert ta.simulate(r[:6], chain) == [2] and ta.simulate(r[:6], chain, whole=True) == [2, 3]
    tree = chain | {(1,), (1, 0), (0, 0, 1)}
    assert ta.simulate(r, tree, whole=True) == [3, 3]  # row 0 now takes (0, 0, 1): 4 tokens, then row 4
    assert ta.simulate(r[:1].repeat(5, 1), tree) == [3]
    rows = [torch.tensor(v) for v in ([0, 0, x], [0, 1, x], [0, 1, 0], [1, x, x], [2, 0, x])]
    assert ta.choose_tree(rows, 1, 3) == {(0,)}
    assert ta.choose_tree(rows, 3, 3) == {(0,), (0, 1), (1,)}  # ties: the shorter path first
    assert ta.choose_tree(rows, 3, 1) == {(0,), (1,), (2,)}  # depth <= k
    assert ta.tau([r], chain) == 3.5 and ta.tau([r], set()) == 1.0
    # the check against the engine: rates over the same rounds; one round of slack per depth at the cut
    assert ta.check_chain([r], [[1.0, 1.0, 0.5]], 3, new_tokens=99) == 2
    with pytest.raises(SystemExit, match="answer 0, depth 2: 2.000 rounds took it, 1 by the ranks"):
        ta.check_chain([r], [[1.0, 1.0, 1.0]], 3, new_tokens=99)
    assert ta.check_chain([r], [[1.0, 1.0, 1.0]], 3, new_tokens=8) == 2  # r is cut at 8 tokens
    with pytest.raises(SystemExit, match="depth 0: 1.333 rounds"):  # another number of rounds
        ta.check_chain([r], [[2 / 3, 1 / 3, 0.0]], 3, new_tokens=99)


@pytest.mark.slow
def test_tree_acceptance_smoke_checks_its_ranks_against_the_engine(tmp_path):
    """On the default model: the chain simulated over the ranks runs the engine's rounds (else the script
    stops), and a larger tree never accepts less than a smaller one chosen from the same counts."""
    args = "--prompts 1 --tree-prompts 2 --new-tokens 12 --budgets 5 9 --threads 1".split()
    d = _run("tree_acceptance.py", *args, out=tmp_path / "ta.json")
    assert [r["case"]["set"] for r in d["rows"]] == ["code", "chat", "health"]
    for r in d["rows"]:
        assert r["rounds_engine"] > 0 and 1 <= r["tau_chain"] <= 6
        assert r["tau_tree"]["9"] >= r["tau_tree"]["5"] >= 1
        chains = [r["tau_chain_k"][str(j)] for j in range(1, 6)]
        assert chains[4] == r["tau_chain"] and all(1 <= t <= j + 1 for j, t in enumerate(chains, 1))


@pytest.mark.slow
def test_head_output_layer_smoke_measures_the_distance_and_runs_each_swapped_head(tmp_path):
    """head_output_layer.py: the trained rows' distance to the target's (a cosine in [-1, 1], energy shares
    increasing in the rank), then τ for the shipped head and each swapped-in vocabulary on every set."""
    args = "--prompts 1 --new-tokens 8 --vocab 8192 9000".split()
    d = _run("head_output_layer.py", *args, out=tmp_path / "hol.json")
    dist = d["distance"]
    assert dist["relative_distance"] > 0 and -1 <= dist["mean_row_cosine"] <= 1
    shares = list(dist["delta_energy_in_top"].values())
    assert shares == sorted(shares) and 0 < shares[0] <= shares[-1] <= 1
    assert [r["case"]["draft_vocab_size"] for r in d["rows"]] == [8192, 8192, 9000]
    for r in d["rows"]:
        assert set(r["tau"]) == {"code", "chat", "health"} and all(1 <= t <= 6 for t in r["tau"].values())
