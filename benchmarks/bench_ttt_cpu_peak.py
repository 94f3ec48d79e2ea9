"""Peak memory and time of one TTT `train_step` on the CPU at SmolLM2 head shapes: a check of the training
step's memory that needs no GPU (peak resident growth of the process during the step, `ru_maxrss`).

    python benchmarks/bench_ttt_cpu_peak.py --batch 4 --label now --out benchmarks/results/ttt_cpu_peak.json
    # an older tree beside it (its fspec first on the path; --via-draft-step for commits that had the switch):
    PYTHONPATH=OLD_TREE python benchmarks/bench_ttt_cpu_peak.py --label old --via-draft-step 0 --out ...

The head and batch are `bench_ttt_step.build_case("smollm2")`'s (random EAGLE-3 head, hidden 576, 9 / 3 heads,
draft vocabulary 8192, S = 512, K = 7, fp32, feed "prediction"), the first `--batch` sequences. One step,
`torch.func.grad_and_value` as distillation runs it; each run is a fresh process (the peak is the process's),
and rows are appended to `--out` (one row per run: label, batch, peak growth in MiB, seconds of the step;
the median of `--reps` steps after the first).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ttt_step  # noqa: E402
import results_io  # noqa: E402

from fspec.train import ttt  # noqa: E402


def measure(batch_size: int, reps: int, via: int | None) -> dict:
    cpu = torch.device("cpu")
    draft, trainable, opt, frozen, batch, (_, s, k) = bench_ttt_step.build_case("smollm2", cpu)
    batch = {key: v[:batch_size].contiguous() for key, v in batch.items()}
    kw = dict(steps=10, batch_size=batch_size, seq_len=s, ttt_steps=k)
    if via is not None:
        kw["via_draft_step"] = bool(via)  # the switch of commits before the reference loop was deleted
    dcfg = ttt.DistillConfig(**kw)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(reps + 1):
        began = time.perf_counter()
        ttt.train_step(trainable, opt, frozen, batch, step=0, cfg=draft.cfg, dcfg=dcfg)
        times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_growth_mib": (peak - base) / 1024, "s_per_step": statistics.median(times[1:])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/ttt_cpu_peak.json")
    p.add_argument("--label", required=True, help="what this tree is (a commit, 'now')")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--via-draft-step", type=int, choices=(0, 1), default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = {"case": {"label": args.label, "batch": args.batch, "via_draft_step": args.via_draft_step}}
    row.update(measure(args.batch, args.reps, args.via_draft_step))
    print(json.dumps(row))
    row["command"] = results_io.header("bench_ttt_cpu_peak.py", argv, "cpu")["command"]
    out = Path(args.out)
    if out.is_file():
        doc = json.loads(out.read_text())
    else:
        doc = results_io.header("bench_ttt_cpu_peak.py", argv, f"CPU, {args.threads} threads")
        doc.update(what="one TTT train_step on the CPU, SmolLM2 head shapes", rows=[])
    doc["rows"].append(row)
    results_io.write(out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
