"""Where a warm `fspec.generate` call spends the time its rounds do not: cases of bench_generate.py (random
Llama-3.2-1B-shaped target, B = 1, 256 new tokens, compiled): `forced` (an EAGLE-3 head forced to full
acceptance, K = 5) and `target` (target-only decoding).

    python benchmarks/bench_call_overhead.py [--calls 8] [--cases forced,target] [--out PATH]

For each Python garbage-collector setting — `default` (as the process comes), `frozen` (gc.collect();
gc.freeze() once after warm-up: the compiled graphs' objects move out of the collected generations) and
`disabled` (gc.disable() for the timed calls) — it times --calls warm calls and records, per call, the wall
time and the time spent inside collections (gc.callbacks), with the collections' generations. Beside them:
one call split into setup / prefill / rounds (bench_generate.phase_seconds). Environment variables
of Inductor (TORCHINDUCTOR_*) apply and are recorded under "env".
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_generate as BG  # noqa: E402
import results_io as RIO  # noqa: E402

import fspec  # noqa: E402


class GcClock:
    """Seconds spent in collections (and their generations) since the last `reset`."""

    def __init__(self) -> None:
        self.seconds, self.generations, self._t0 = 0.0, [], None
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.generations.append(info["generation"])
            self._t0 = None

    def reset(self) -> None:
        self.seconds, self.generations = 0.0, []


def timed_calls(case, target, draft, prompts, s, clock: GcClock, n: int) -> list[dict]:
    """n warm calls under each garbage-collector setting (see the module docstring)."""
    rows = []
    for mode in ("default", "frozen", "disabled"):
        if mode == "frozen":
            gc.collect()
            gc.freeze()
        if mode == "disabled":
            gc.unfreeze()
            gc.disable()
        calls = []
        for _ in range(n):
            clock.reset()
            sec, res = BG.run_generate(target, draft, prompts, s)
            calls.append(
                {
                    "seconds": round(sec, 5),
                    "gc_seconds": round(clock.seconds, 5),
                    "gc_generations": clock.generations,
                    "tokens": res.stats["new_tokens"],
                }
            )
        gc.enable()
        walls = [c["seconds"] for c in calls]
        row = {
            "case": case,
            "gc": mode,
            "median_s": statistics.median(walls),
            "min_s": min(walls),
            "max_s": max(walls),
            "tokens_per_s_median": calls[0]["tokens"] / statistics.median(walls),
            "gc_seconds_total": round(sum(c["gc_seconds"] for c in calls), 5),
            "tracked_objects": len(gc.get_objects()),
            "calls": calls,
        }
        rows.append(row)
        print(
            f"{case} gc {mode:>8}: median {row['median_s'] * 1e3:.1f} ms (min {row['min_s'] * 1e3:.1f}, max "
            f"{row['max_s'] * 1e3:.1f}), {row['tokens_per_s_median']:.0f} tok/s, in gc "
            f"{row['gc_seconds_total'] * 1e3:.1f} ms over {n} calls",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--cases", default="forced,target", help="comma-separated: forced, target")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny float32 model on the CPU (eager)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/call_overhead.json"))
    args = p.parse_args(argv)
    bargs = ["--batch", "1", "--skip-hf"] + (["--cpu-smoke"] if args.cpu_smoke else [])
    s = BG.make_setup(BG.parse_args(bargs))
    models = BG.build_models(s)
    prompts = BG.prompts_for(1, s)
    clock = GcClock()
    rows, phases = [], {}
    cases = {"forced": (models.forced_target, models.forced_draft), "target": (models.target, None)}
    for case in args.cases.split(","):
        target, draft = cases[case]
        for _ in range(2):  # compile (the graphs run once eagerly), then record them: replays from here on
            BG.run_generate(target, draft, prompts, s)
        rows += timed_calls(case, target, draft, prompts, s, clock, args.calls)
        phases[case] = BG.phase_seconds(target, draft, 1, s)
        print(f"{case}: phases of one call: {phases[case]}", flush=True)
    device = torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu"
    doc = {
        **RIO.header("bench_call_overhead.py", argv, device),
        "setup": f"{s.label}; K = {s.k} (forced full acceptance), B = 1, {s.new_tokens} new tokens, "
        f"prompt {s.prompt_len}, compile={s.compile}",
        "fspec": fspec.__version__ if hasattr(fspec, "__version__") else None,
        "phases_s": phases,
        "rows": rows,
    }
    RIO.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
