"""Where a speculative round's time goes on the real model (SmolLM2-135M-Instruct, its head), compiled, B = 1.

    python benchmarks/profile_round.py [--head DIR] [--k 5] [--new-tokens 256] [--out DIR]

One warm `fspec.generate` call (compiled, greedy, K drafts per round) on the first held-out code prompt, and
the same call target-only, each under torch.profiler (CPU and CUDA activities) after two unprofiled warm-up
calls. Written to --out: `profile_round.json` (per call: wall time, rounds = target forwards, GPU-busy time
= the sum of kernel and memcpy durations, and the 25 CUDA kernels with the most total time, with
counts and µs per round) and the profiler's own tables (`profile_spec.txt`, `profile_target_only.txt`).
Round cost = wall / rounds (also the median of three unprofiled calls: `round_us_unprofiled`); GPU share =
busy / wall: a share well below 1 means the host or launch gaps
bound the round, not the kernels (it can pass 1: programmatic dependent launch overlaps a kernel's start with
its predecessor's end). The profiler's "## Call CompiledFxGraph" rows wrap kernels listed on their own and are
left out of the busy time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.train import default_model  # noqa: E402
from fspec.train import prompts as P  # noqa: E402


def summarise(prof, wall: float, rounds: int, top: int = 25) -> dict:
    rows = []
    busy = 0.0
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        if dev <= 0:
            continue
        if not e.key.startswith("## Call CompiledFxGraph"):  # a wrapper: its kernels are listed too
            busy += dev
        rows.append({"name": e.key[:120], "count": e.count, "total_us": dev})
    rows.sort(key=lambda r: -r["total_us"])
    for r in rows:
        r["us_per_round"] = r["total_us"] / max(rounds, 1)
        r["count_per_round"] = r["count"] / max(rounds, 1)
    return {
        "wall_s": wall,
        "rounds": rounds,
        "round_us": wall / max(rounds, 1) * 1e6,
        "gpu_busy_us_per_round": busy / max(rounds, 1),
        "gpu_share": busy * 1e-6 / wall,
        "kernels": rows[:top],
        "distinct_kernels": len(rows),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", default=None)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    target, head = default_model.load_default(args.head, dtype=torch.bfloat16, device="cuda")
    prompt = default_model.chat_ids(target, P.heldout("code")[:1], max_tokens=1024)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = results_io.header("profile_round.py", argv, torch.cuda.get_device_name())
    doc.update(k=args.k, new_tokens=args.new_tokens, prompt_tokens=len(prompt[0]), calls={})
    for name, draft in (("spec", head), ("target_only", None)):

        def call(draft=draft):
            return fspec.generate(
                target,
                draft,
                prompt,
                max_new_tokens=args.new_tokens,
                num_speculative_steps=args.k,
                compile=True,
            )

        call()
        call()
        torch.cuda.synchronize()
        plain = []  # the same call without the profiler: its overhead is not the round's
        for _ in range(3):
            t0 = time.perf_counter()
            res = call()
            torch.cuda.synchronize()
            plain.append((time.perf_counter() - t0) / max(res.stats.get("target_forwards") or 1, 1) * 1e6)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            res = call()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rounds = res.stats.get("target_forwards") or res.stats.get("rounds") or 0
        s = summarise(prof, wall, rounds)
        s["round_us_unprofiled"] = sorted(plain)[1]
        s["new_tokens"] = sum(map(len, res.tokens))
        s["tau"] = res.stats.get("acceptance_length")
        s["stats"] = {k: v for k, v in res.stats.items() if isinstance(v, (int, float))}
        doc["calls"][name] = s
        averages = prof.key_averages()
        table = averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
        (out / f"profile_{name}.txt").write_text(table)
        print(
            f"{name}: {s['new_tokens']} tokens, {rounds} rounds, {s['round_us']:.0f} us/round, "
            f"GPU busy {s['gpu_busy_us_per_round']:.0f} us/round ({s['gpu_share']:.2f} of wall), "
            f"unprofiled {s['round_us_unprofiled']:.0f} us/round",
            flush=True,
        )
    results_io.write(out / "profile_round.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
