"""The benchmark scripts' CPU smoke modes: they run end to end and write what BENCHMARKS.md's tables read,
so a GPU session does not spend its time discovering a broken script. Each also asserts its own invariant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, f"{script} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_ttt_memory_smoke_counts_less_for_each_lean_variant(tmp_path):
    d = _run("bench_ttt_memory.py", "--smoke", out=tmp_path / "ttt.json")
    (row,) = d["rows"]
    sizes = [row[f"{n}_GB"] for n in ("dense", "lean_attention", "lean_attention_and_ce", "fused_ce")]
    assert all(a > b > 0 for a, b in zip(sizes, sizes[1:])), sizes
    assert all(row[f"{n}_cpu"]["s_per_step"] > 0 for n in ("dense", "fused_ce"))


def test_distill_scaling_smoke_two_gloo_processes_match_one(tmp_path):
    d = _run("bench_distill_scaling.py", "--cpu-smoke", out=tmp_path / "scaling.json")
    assert d["equality"]["relative_distance"] < 1e-4 and d["equality"]["loss_1"] == d["equality"]["loss_2"]
    assert d["throughput"]["1"]["tokens_per_s"] > 0 and d["throughput"]["2"]["tokens_per_s"] > 0


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
