"""A GPU soak of `fspec.generate` on the real model: many calls with random prompt lengths, batch sizes,
temperatures and sampling options, checking after every call that each KV block went back to its allocator
and that device memory stays flat.

    python benchmarks/gpu_soak.py [--calls 2000] [--seconds 1e9] [--max-prompt 4096] [--max-batch 64]
        [--out benchmarks/results/gpu_soak.json]

Model: SmolLM2-135M-Instruct in bf16 with its shipped EAGLE-3 head (`fspec.load_default`); `--smoke`: the
4-layer toy model on the CPU, a few calls (checks the script). Call i (seeded by --seed + i): temperature 0 or
in (0, 1.5], top_k / top_p / min_p each on with probability 1/3, max_new_tokens in 1..16, speculative with
probability 3/4, else the target alone. A share --compiled-share of the calls is compiled: B in 1..--max-
compiled-batch, prompt lengths log-uniform in 1..--max-prompt (chunked prefill: no length records a graph), K
the head's, so compiled rounds replay their graphs with changing lengths, batches and options (after
`Generator.warmup(max_batch=--max-compiled-batch, max_len=--max-prompt + 16)` with the head and again without
(greedy, sampled and filtered rounds), which fixes the KV pool; each row counts the CUDA graphs its call
recorded, which after the warm-up should be none). The others are eager: B uniform in 1..
--max-batch, each prompt's length log-uniform in 1..--max-prompt (total tokens capped at --max-tokens), K in
1..5. Prompts are random token ids. Checks, every call: every `BlockAllocator` the call made has all its
blocks free; `torch.cuda.memory_allocated()` after the call at most the value after the first --warmup-calls
calls + --slack-mib. The run stops at the first failure (rc 1), after --calls calls, or when --seconds have
passed since the script started (model load and warm-up included, so a time limit around the whole run can
be met); the JSON records the calls made, and is rewritten every 100 calls.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.core import cache as cache_mod  # noqa: E402
from fspec.serve import runner  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=1e9, help="no call starts after this (from the start)")
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16384, help="cap on a call's prompt tokens in total")
    p.add_argument("--compiled-share", type=float, default=0.75)
    p.add_argument("--max-compiled-batch", type=int, default=8)
    p.add_argument("--warmup-calls", type=int, default=100)
    p.add_argument("--slack-mib", type=float, default=64.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/gpu_soak.json")
    p.add_argument("--smoke", action="store_true", help="the toy model on the CPU, 12 short calls")
    args = p.parse_args(argv)
    if args.smoke:
        args.calls, args.max_prompt, args.max_batch, args.max_tokens = 12, 64, 4, 128
        args.max_compiled_batch, args.warmup_calls, args.compiled_share = 2, 4, 0.0
    return args


class _Books(cache_mod.BlockAllocator):
    """A BlockAllocator that registers itself, so the soak can read every allocator's books after a call."""

    made: list = []

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        _Books.made.append(self)


def call_args(rng: random.Random, i: int, args, vocab: int) -> dict:
    compiled = rng.random() < args.compiled_share
    b = rng.randint(1, args.max_compiled_batch if compiled else args.max_batch)
    lengths = [max(1, int(math.exp(rng.uniform(0, math.log(args.max_prompt))))) for _ in range(b)]
    while sum(lengths) > args.max_tokens:
        lengths[lengths.index(max(lengths))] //= 2
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    temp = [0.0 if rng.random() < 0.4 else rng.uniform(0.05, 1.5) for _ in range(b)]
    opts = dict(temperature=temp, seed=[rng.randrange(1 << 31) for _ in range(b)])
    if rng.random() < 1 / 3:
        opts["top_k"] = [rng.choice([0, 1, 5, 50, 1000]) for _ in range(b)]
    if rng.random() < 1 / 3:
        opts["top_p"] = [rng.choice([1.0, 0.9, 0.5, 0.05]) for _ in range(b)]
    if rng.random() < 1 / 3:
        opts["min_p"] = [rng.choice([0.0, 0.05, 0.3]) for _ in range(b)]
    spec = rng.random() < 0.75
    return dict(
        prompts=prompts,
        max_new_tokens=rng.randint(1, 16),
        spec=spec,
        k=rng.randint(1, 5) if spec and not compiled else None,
        compile=compiled,
        **opts,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    runner.BlockAllocator = _Books  # the allocator generate's runs make, counted
    if args.smoke:
        torch.set_num_threads(1)
        target, head = fspec.load_toy()
    else:
        target, head = fspec.load_default(dtype=torch.bfloat16, device="cuda")
    cuda = not args.smoke
    vocab = target.cfg.vocab_size
    gen = fspec.Generator()
    warm = {}
    if cuda and args.compiled_share > 0:  # fixes the KV pool and records the round graphs, as a server would
        warm = gen.warmup(target, head, max_batch=args.max_compiled_batch, max_len=args.max_prompt + 16)
        print("warm-up", warm, flush=True)
        alone = gen.warmup(target, None, max_batch=args.max_compiled_batch, max_len=args.max_prompt + 16)
        print("warm-up, target-only", alone, flush=True)
        warm = {k: round(warm[k] + alone[k], 3) for k in warm}
    rng = random.Random(args.seed)
    rows, base, peak, failure, blocks_checked = [], None, 0, None, 0
    start = time.perf_counter()

    def record() -> dict:
        out = dict(
            header=results_io.header("gpu_soak.py", argv, torch.cuda.get_device_name() if cuda else "cpu"),
            calls=len(rows),
            seconds=round(time.perf_counter() - start, 1),
            failure=failure,
            base_allocated_mib=None if base is None else round(base / 2**20, 1),
            peak_allocated_mib=round(peak / 2**20, 1),
            max_reserved_mib=round(torch.cuda.max_memory_reserved() / 2**20, 1) if cuda else 0.0,
            compiled_calls=sum(r["compile"] for r in rows),
            graphs_after_warmup=sum(r["graphs"] for r in rows),
            warmup=warm,
            blocks_checked=blocks_checked,
            rows=rows,
        )
        results_io.write(Path(args.out), out)
        return out

    for i in range(args.calls):
        if time.perf_counter() - began > args.seconds:
            break
        a = call_args(rng, i, args, vocab)
        _Books.made.clear()
        graphs0 = gen.recorded_graphs
        t0 = time.perf_counter()
        res = gen.generate(
            target,
            head if a["spec"] else None,
            a["prompts"],
            max_new_tokens=a["max_new_tokens"],
            num_speculative_steps=a["k"],
            compile=a["compile"],
            **{k: a[k] for k in ("temperature", "seed", "top_k", "top_p", "min_p") if k in a},
        )
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        books = [(x.num_blocks, x.num_free, len(x._used)) for x in _Books.made]
        blocks_checked += len(books)
        leaks = [b for b in books if b[2] or b[1] != b[0]]
        mem = torch.cuda.memory_allocated() if cuda else 0
        if i == args.warmup_calls - 1:
            base = mem
        peak = max(peak, mem) if base is not None else peak
        row = dict(
            call=i,
            B=len(a["prompts"]),
            max_prompt=max(map(len, a["prompts"])),
            new_tokens=sum(map(len, res.tokens)),
            spec=a["spec"],
            compile=a["compile"],
            seconds=round(dt, 4),
            allocated_mib=round(mem / 2**20, 1),
            graphs=gen.recorded_graphs - graphs0,
        )
        rows.append(row)
        if leaks:
            failure = f"call {i}: blocks not returned (num_blocks, free, used): {leaks}"
        elif base is not None and mem > base + args.slack_mib * 2**20:
            failure = f"call {i}: allocated {mem / 2**20:.1f} MiB > {base / 2**20:.1f} + {args.slack_mib}"
        if i % 50 == 0 or failure:
            print(row, flush=True)
        if failure:
            print("FAIL", failure, flush=True)
            break
        if i % 100 == 99:
            record()
    out = record()
    print({k: v for k, v in out.items() if k not in ("rows", "header")})
    return 1 if failure else 0


if __name__ == "__main__":
    raise SystemExit(main())
