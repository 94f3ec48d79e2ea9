"""A one-minute check of the real model's interactive path on the GPU before the long runs.

    python benchmarks/gpu_smoke.py

SmolLM2-135M-Instruct with its shipped head, fp32, B = 1, greedy: `Generator.warmup(max_batch=1)` (its time
and CUDA graphs), then four distinct held-out chat prompts compiled and eagerly (64 new tokens each): tokens
per second, whether compiled and eager tokens agree, and the graphs recorded after the warm-up (0 expected).
"""

from __future__ import annotations

import time

import torch

import fspec
from fspec.train import default_model
from fspec.train import prompts as P


def main() -> None:
    target, head = default_model.load_default(dtype=torch.float32, device="cuda")
    gen = fspec.Generator()
    t0 = time.perf_counter()
    report = gen.warmup(target, head, max_batch=1, sampled=False)
    print(f"warmup {time.perf_counter() - t0:.1f} s {report}", flush=True)
    graphs = gen.recorded_graphs
    texts = [t for pair in zip(P.heldout("code"), P.heldout("chat")) for t in pair][:4]
    for text in texts:
        chat = [{"role": "user", "content": text}]
        row = {}
        for compile in (True, False):
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = gen.generate(target, head, [chat], max_new_tokens=64, temperature=0.0, compile=compile)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            row[compile] = r
            tau = r.stats["acceptance_length"]
            print(f"  compile={compile}: {len(r.tokens[0]) / dt:7.1f} tok/s  tau {tau:.2f}")
        print(f"  same tokens: {row[True].tokens == row[False].tokens}", flush=True)
    print(f"graphs recorded after warm-up: {gen.recorded_graphs - graphs}")


if __name__ == "__main__":
    main()
