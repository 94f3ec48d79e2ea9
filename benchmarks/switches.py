"""One table from runs of bench_draft_loop.py and bench_call_overhead.py under different environment switches.

    python benchmarks/switches.py --out benchmarks/results/switches.json \
        RUN:TAG:ENV:DRAFT_JSON:OVERHEAD_JSON ...

ENV is the switches the two benchmarks ran under ("VAR=VALUE,VAR=VALUE", "-" for none); OVERHEAD_JSON "-"
when that benchmark did not run. Only rows of one RUN
(one GPU-host call: the same machine, the same minutes) compare with each other. Per row: the draft loop's
time per step issued back to back over its floor (8B- and 1B-shaped EAGLE-3 heads, B = 1, K = 5, context 2k)
and the tokens/s of warm generate calls (bench_call_overhead.py: forced full acceptance at K = 5 and
target-only, the median over its calls with Python's garbage collector as the process comes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def build(run: str, tag: str, env: str, draft_path: Path, overhead_path: Path) -> dict:
    draft = json.loads(draft_path.read_text())
    overhead = {"rows": []} if str(overhead_path) == "-" else json.loads(overhead_path.read_text())
    switches = {} if env == "-" else dict(kv.split("=") for kv in env.split(","))
    out = {"run": run, "variant": tag, "env": switches}
    out["date"], out["machine"] = draft["date"], draft["machine"]
    for r in draft["rows"]:
        head = r["case"]["head"]
        out[f"{head}_floor_us"] = r["floor_us"]
        out[f"{head}_back_to_back_us"] = r["compiled_loop_back_to_back_us"]
        out[f"{head}_back_to_back_over_floor"] = round(r["compiled_loop_back_to_back_us"] / r["floor_us"], 3)
        out[f"{head}_loop_over_floor"] = r["loop_over_floor"]
    for r in overhead["rows"]:
        if r["gc"] == "default":
            out[f"{r['case']}_tokens_per_s"] = round(r["tokens_per_s_median"], 1)
    out["sources"] = [str(draft_path), str(overhead_path)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", help="RUN:TAG:ENV:DRAFT_JSON:OVERHEAD_JSON")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/switches.json"))
    args = p.parse_args()
    rows = []
    for spec in args.specs:
        run, tag, env, draft_path, overhead_path = spec.split(":")
        rows.append(build(run, tag, env, Path(draft_path), Path(overhead_path)))
    first = json.loads(Path(args.specs[0].split(":")[3]).read_text())
    result = {k: first[k] for k in ("machine", "torch", "triton", "date")}
    result["command"] = "python benchmarks/switches.py --out " + str(args.out) + " " + " ".join(args.specs)
    result["rows"] = rows
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        ratios = r["8b_back_to_back_over_floor"], r["1b_back_to_back_over_floor"]
        rates = r.get("forced_tokens_per_s"), r.get("target_tokens_per_s")
        print(r["run"], r["variant"], r["env"], *ratios, *rates)


if __name__ == "__main__":
    main()
