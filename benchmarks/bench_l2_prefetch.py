"""What an L2 prefetch buys a one-row product: fspec::skinny_linear reading its weight cold from HBM, after
`l2_prefetch` of it (or of its leading part) followed by an idle stretch, and warm (read just before).

    python benchmarks/bench_l2_prefetch.py [--idle-us 10] [--reps 50] [--out PATH]

Each sample: a 256 MiB write evicts the L2, then (prefetched cases) `fspec.kernels.l2_prefetch.l2_prefetch`
asks for the first `fraction` of the weight, then `torch.cuda._sleep` holds the stream for --idle-us (long
enough for the host to queue the events and the product behind it, so that the events time the kernel and
not the launch; the prefetch has long finished: this measures what an L2-resident weight is worth, not
whether a decode step's ~10 µs window suffices, which the `switches` runs measure), then the product runs
between two CUDA events. Shapes (bf16): a 1B layer's o and
gate/up (with the post norm and SiLU * up), and an EAGLE-3 head's q/k/v with the input norm (2 x 2048
inputs). Floor: weight bytes / measured copy bandwidth. Median over --reps samples.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import results_io as RIO
import torch

from fspec.kernels.l2_prefetch import l2_prefetch
from fspec.kernels.skinny_linear import skinny_linear

SHAPES = {  # name: (rows of w, K, fused ops)
    "1B o (residual)": (2048, 2048, "residual"),
    "1B gate/up (norm, SiLU * up)": (16384, 2048, "silu"),
    "EAGLE-3 1B head q/k/v (norm)": (3072, 4096, "norm"),
}


def sample(x, w, kw: dict, flush, cycles: int, case: str, fraction: float) -> float:
    """µs of one product after the L2 was evicted, then (case) warmed by the product or prefetched for the
    leading `fraction` of w (of both halves with SiLU * up), then an idle stretch of `cycles`."""
    flush.fill_(1)
    n = w.shape[0]
    if case == "warm":
        skinny_linear(x, w, **kw)
    elif case == "prefetched":
        if kw.get("silu_mul"):  # the leading rows of both halves, as fspec.models.layers does
            r = int(n // 2 * fraction)
            l2_prefetch([w[:r], w[n // 2 : n // 2 + r]] if r else [])
        else:
            r = int(n * fraction)
            l2_prefetch([w[:r]] if r else [])
    torch.cuda._sleep(cycles)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    skinny_linear(x, w, **kw)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-us", type=float, default=300.0)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/l2_prefetch.json"))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = RIO.copy_bandwidth_tbps(dev) * 1e12  # bytes per second
    flush = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    cycles = int(args.idle_us * 1e-6 * torch.cuda.get_device_properties(dev).clock_rate * 1e3)
    rows = []
    for name, (n, k, fused) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        kw = {}
        if fused == "residual":
            kw["residual"] = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
        elif fused == "silu":
            kw.update(norm_weight=torch.ones(k, device=dev, dtype=torch.bfloat16), silu_mul=True)
        else:
            kw["norm_weight"] = torch.ones(k, device=dev, dtype=torch.bfloat16)
        nbytes = w.numel() * w.element_size()

        cases = [("cold", 0.0), ("warm", 1.0)] + [("prefetched", f) for f in (0.25, 0.5, 1.0)]
        for case, fraction in cases:
            run = (x, w, kw, flush, cycles, case, fraction)
            for _ in range(3):
                sample(*run)
            us = statistics.median(sample(*run) for _ in range(args.reps))
            row = {"shape": name, "weight_mib": round(nbytes / 2**20, 1), "case": case, "fraction": fraction}
            row.update(us=round(us, 2), floor_us=round(nbytes / bw * 1e6, 2))
            rows.append(row)
            print(row, flush=True)
    doc = RIO.header("bench_l2_prefetch.py", argv, torch.cuda.get_device_name(dev))
    doc.update(copy_bandwidth_TBps=round(bw / 1e12, 3), idle_us=args.idle_us, rows=rows)
    RIO.write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
