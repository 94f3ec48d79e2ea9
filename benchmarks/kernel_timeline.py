"""Kernel timeline of one replay (GPU): every kernel and copy of a compiled call in launch order, with its
duration and the idle gap before it, so one sees where a step's time goes between kernels as well as in them.

    python benchmarks/kernel_timeline.py OUT_DIR [--what draft decode] [--k 3] [--batch 1] [--min-partition N]

draft:  the compiled whole-loop `propose` of the 1B-shaped EAGLE-3 head (bench_draft_loop's setup, ctx 2048)
decode: the compiled target decode step of the 1B-shaped Llama (dump_decode_code's setup, context 150)

Writes OUT_DIR/timeline_<what>.txt: one line per device activity (start offset µs, duration µs, gap µs,
name), then totals: busy time, idle time, count, and the call's median time over 50 CUDA-event-timed calls
without the profiler. `--min-partition` sets the paged-attention kernel's smallest split (context tokens per
program; `kernels.paged_attention.MIN_PARTITION`) before compiling, to see what short-context splits buy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_draft_loop import time_us  # noqa: E402  (CUDA-event median of one call)


def _timeline(fn, calls: int = 1) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of the device activities of the last of `calls` calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    events = [
        (e.time_range.start, e.time_range.end - e.time_range.start, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    events.sort()
    # the last call: activities after the largest idle gap (the host sync between calls)
    gaps = [(events[i][0] - (events[i - 1][0] + events[i - 1][1]), i) for i in range(1, len(events))]
    split = sorted(gaps)[-(calls - 1) :] if calls > 1 else []
    first = max(i for _, i in split) if split else 0
    return events[first:]


def _write(path: Path, title: str, events: list[tuple[float, float, str]], median_us: float) -> None:
    from fspec.core.config import env_switches

    t0 = events[0][0]
    switches = " ".join(f"{k}={v}" for k, v in env_switches().items()) or "none"
    lines, busy, idle, end = [title, f"switches: {switches}"], 0.0, 0.0, t0
    for start, dur, name in events:
        gap = max(0.0, start - end)
        lines.append(f"{start - t0:9.1f} {dur:8.2f} {gap:7.2f}  {name[:110]}")
        busy += dur
        idle += gap
        end = max(end, start + dur)
    lines.append(
        f"{path.stem}: activities {len(events)}  busy {busy:.1f} us  idle {idle:.1f} us  "
        f"span {end - t0:.1f} us (profiled); median call {median_us:.1f} us (not profiled)"
    )
    path.write_text("\n".join(lines) + "\n")
    print(lines[-1])


def draft(out: Path, k: int, b: int, tag: str) -> None:
    import dataclasses

    from bench_draft_loop import build

    import fspec
    from fspec.compile import compile_propose

    d, cache, state, _, _ = build("1b", b, k, 2048)
    d = dataclasses.replace(d, params=fspec.fuse_projections(d.params))
    whole = compile_propose(cfg=d.cfg)
    fn = lambda: whole(d.params, state, cache)  # noqa: E731
    events = _timeline(fn)
    title = f"propose, 1B EAGLE-3 head, B = {b}, K = {k}, ctx 2048"
    _write(out / f"timeline_draft{tag}.txt", title, events, time_us(fn, 50))


def decode(out: Path, b: int, tag: str) -> None:
    from bench_generate import llama_1b_config

    import fspec
    from fspec.models import llama
    from fspec.serve import rounds
    from fspec.serve.resources import Resources

    cfg = llama_1b_config(400)
    params = fspec.fuse_projections(llama.init(cfg, seed=0, dtype=torch.bfloat16, device="cuda"))
    cache = Resources().cache(cfg, 32 * b, 16, torch.bfloat16, torch.device("cuda"), True)
    step = rounds.compiled_decode_step(cfg, 16, 400)
    cuda = {"device": "cuda"}
    table = torch.arange(25 * b, dtype=torch.int32, **cuda).view(b, 25)
    cur, n = torch.full((b,), 5, **cuda), torch.full((b,), 150, **cuda)
    live = torch.ones(b, dtype=torch.bool, **cuda)
    sampling = fspec.SamplingParams.create(b, device="cuda")

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        step(params, cur, n, live, table, sampling, cache)

    title = f"target decode step, 1B Llama, B = {b}, ctx 150"
    _write(out / f"timeline_decode{tag}.txt", title, _timeline(call), time_us(call, 50))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--what", nargs="+", default=["draft", "decode"], choices=["draft", "decode"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--min-partition", type=int, help="paged attention's MIN_PARTITION")
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_timeline.py needs a CUDA device; nothing to do here.")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    if args.min_partition:
        from fspec.kernels import paged_attention

        paged_attention.MIN_PARTITION = args.min_partition
        tag = tag or f"_p{args.min_partition}"
    if "draft" in args.what:
        draft(out, args.k, args.batch, tag)
    if "decode" in args.what:
        decode(out, args.batch, tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
