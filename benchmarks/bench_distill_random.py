"""`distill_head` at the real target's shapes without its weights: a tree's `measure_distill` on a random
SmolLM2-shaped target and a fresh EAGLE-3 head.

    python3 benchmarks/bench_distill_random.py [--steps 40] [--layers 30] [--out FILE]
    (cd OLD_TREE && PYTHONPATH=$PWD python3 NEW_TREE/benchmarks/bench_distill_random.py ...)   # an old commit

`measure_distill` times `distill_head` on `fspec.load_default()`'s target, which needs the GGUF (98 MB, two
uploads to the GPU host). This script replaces `fspec.load_default`, in its own process only, by a random
target with SmolLM2-135M's config (30 layers, bf16 on CUDA) and a fresh head (`new_draft`, draft vocabulary
8192 from a random stream), then calls the `measure_distill` of the tree it runs in: main's, or an old
commit's (b9097a0's times its layer loop beside its draft step). Same batch (32 x 512), K = 7, bf16 autocast
and step count as `bench_ttt_step.py --real-model`. On a machine without CUDA it runs a tiny batch (1 x 16),
a check of the script only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd() / "benchmarks"))  # the bench of the tree this runs in

import bench_ttt_step as bench  # noqa: E402

import fspec  # noqa: E402
from fspec.models import llama  # noqa: E402
from fspec.train import distill as D  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=30, help="the random target's layers (SmolLM2: 30)")
    p.add_argument("--out", default=None, help="write the row as JSON here too")
    args = p.parse_args(argv)

    def random_default(dtype=torch.float32, device="cpu", **_):
        cfg = dataclasses.replace(
            bench.CASES["smollm2"][0](8192), torch_dtype="bfloat16", num_hidden_layers=args.layers
        )
        target = fspec.Target(cfg=cfg, params=llama.init(cfg, seed=0, dtype=dtype, device=device))
        tokens = torch.randint(0, cfg.vocab_size, (1 << 16,), generator=torch.Generator().manual_seed(0))
        return target, D.new_draft(target, kind="eagle3", tokens=tokens, draft_vocab_size=8192, seed=0)

    fspec.load_default = random_default
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":  # a check of the script only
        config = bench.ttt.DistillConfig
        bench.ttt.DistillConfig = lambda **kw: config(**(kw | {"batch_size": 1, "seq_len": 16}))
    row = bench.measure_distill(dev, steps=args.steps, smoke=False)
    row["case"].update(name="smollm2_shaped_random_distill_head", layers=args.layers)
    print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
