"""How full the slots stay when the head recipe answers its prompts: calls of N prompts against one run.

    python benchmarks/sim_generation_occupancy.py --stream STREAM.pt [--slots 256] [--prompts 8192]
        [--calls 1024 4096 0] [--out benchmarks/results/generation_occupancy.json]

The answer lengths are read from a training stream the recipe wrote (`default_model --stream FILE`: each
maximal run of loss-mask positions is one answer's drafted tokens). Target-only continuous batching is
simulated round by round: a slot holds one request, which emits one token per round and leaves after its
length; a free slot takes the next prompt of its call at once (`fspec.Refill()`'s default). A call of N
prompts ends when its last request does; 0 = all prompts in one run. Rows: {"case": {"per_call"}, "rounds",
"mean_occupancy"} (tokens / (rounds × slots)). The prompts are the stream's answers in order (the recipe
shuffles its prompts, so consecutive answers are not sorted by length).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402


def answer_lengths(mask: torch.Tensor) -> list[int]:
    """The lengths of the maximal runs of True in `mask` (a 1-d bool tensor)."""
    m = torch.cat([torch.zeros(1, dtype=torch.int8), mask.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    step = torch.diff(m.to(torch.int16))
    return ((step == -1).nonzero().flatten() - (step == 1).nonzero().flatten()).tolist()


def rounds_of(lengths: list[int], slots: int, per_call: int) -> int:
    """Rounds to answer `lengths` through `slots` slots, in calls of `per_call` prompts (0: one call)."""
    per_call = per_call or len(lengths)
    total = 0
    for lo in range(0, len(lengths), per_call):
        waiting = list(reversed(lengths[lo : lo + per_call]))
        left: list[int] = []
        while waiting or left:
            while waiting and len(left) < slots:
                left.append(waiting.pop())
            total += 1
            left = [x - 1 for x in left if x > 1]
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stream", required=True, help="a stream file the head recipe wrote (--stream)")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--prompts", type=int, default=8192)
    p.add_argument("--calls", type=int, nargs="+", default=[1024, 4096, 0])
    p.add_argument("--out", default="benchmarks/results/generation_occupancy.json")
    args = p.parse_args(argv)
    saved = torch.load(args.stream, weights_only=False)
    if saved.get("mask") is None:
        raise ValueError(f"stream: expected a stream with a loss mask, got none in {args.stream}")
    lengths = answer_lengths(saved["mask"])[: args.prompts]
    doc = results_io.header("sim_generation_occupancy.py", argv, "host (a simulation)")
    doc.update(
        slots=args.slots,
        answers=len(lengths),
        mean_length=sum(lengths) / len(lengths),
        max_length=max(lengths),
        rows=[],
    )
    for per_call in args.calls:
        rounds = rounds_of(lengths, args.slots, per_call)
        occupancy = sum(lengths) / (rounds * args.slots)
        doc["rows"].append({"case": {"per_call": per_call}, "rounds": rounds, "mean_occupancy": occupancy})
        print(f"per call {per_call or 'all'}: {rounds} rounds, occupancy {occupancy:.3f}", flush=True)
    results_io.write(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
