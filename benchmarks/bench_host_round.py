"""Target-only decoding's host cost per round: compiled `fspec.generate` on a random SmolLM2-shaped target.

    python3 benchmarks/bench_host_round.py [--layers 30] [--new-tokens 256] [--reps 5] [--out FILE]
    (cd OLD_TREE && PYTHONPATH=$PWD python3 NEW_TREE/benchmarks/bench_host_round.py ...)   # an old commit

At B = 1 a SmolLM2-135M decode step takes ~0.45 ms on the GPU, so the host's work per round (launching the
captured round, reading its token back, the stop checks, the bookkeeping) decides whether the GPU waits. The
real model's target-only tok/s fell 8% after the sampling pytree while its graphs did not (BENCHMARKS.md,
"Before and after the sampling pytree"); this script splits such a loss into a part per call and a part per
token ("The target-only gap, split"). By default it runs without the GGUF: a random target with
SmolLM2-135M-Instruct's config (30 layers, bf16 on CUDA) decodes a 128-token prompt greedily, compiled, one
request (`--reps` calls after two warm-up calls; the median call's tok/s). Calls of one new token split a
call's time into a fixed part (set-up, prefill, the last read-back: `fixed_ms`) and a part per token
(`per_token_ms` = the difference over the other tokens). Then one call of each length runs under cProfile
(host functions by own time, `--top` rows; the one-token call also by cumulative time). `--gguf FILE` decodes
with a real checkpoint instead (EOS ignored, so every call makes the same number of tokens; a step's work does
not depend on the weights). Works in any tree that has `fspec.generate(target, None, prompts,
max_new_tokens=..., compile=True)`: run it from an old commit's tree for the figure before a change.
On a machine without CUDA it runs a 2-layer eager model, a check of the script only.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

import fspec
from fspec.models import llama
from fspec.models.layers import fuse_projections


def smollm2_shaped(layers: int, dtype: torch.dtype, device: str) -> fspec.Target:
    """A random target with SmolLM2-135M-Instruct's HF config (EOS 2, as the real model's), q/k/v and gate/up
    fused as `fspec.load_target` fuses a checkpoint's (unfused, a decode step took 0.72 ms on the H100
    against the real model's 0.44)."""
    cfg = fspec.ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, eos_token_ids=(2,),
    )  # fmt: skip
    params = fuse_projections(llama.init(cfg, seed=0, dtype=dtype, device=device))  # as `load_target` does
    return fspec.Target(cfg=cfg, params=params)


def kernel_table(fn, top: int) -> dict:
    """GPU kernels of one fn() under torch.profiler (kernels inside replayed CUDA graphs included): the total
    count and µs, and the `top` names by GPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    rows = [
        (e.key, e.count, e.self_device_time_total)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[2])
    return {
        "count": sum(r[1] for r in rows),
        "us": sum(r[2] for r in rows),
        "top": [{"name": k[:100], "count": c, "us": round(t, 1)} for k, c, t in rows[:top]],
        "all": {k[:100]: [c, t] for k, c, t in rows},
    }


def per_round(one: dict, more: dict, rounds: int, top: int) -> dict:
    """GPU kernels per decode round: a call of rounds + 1 tokens minus a call of one, by name, / rounds."""
    names = set(one["all"]) | set(more["all"])
    diff = [
        (n, *(more["all"].get(n, [0, 0.0])[i] - one["all"].get(n, [0, 0.0])[i] for i in (0, 1)))
        for n in names
    ]
    diff.sort(key=lambda r: -r[2])
    return {
        "count": (more["count"] - one["count"]) / rounds,
        "us": (more["us"] - one["us"]) / rounds,
        "top": [{"name": n, "count": c / rounds, "us": round(t / rounds, 2)} for n, c, t in diff[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=30, help="profile rows (host functions by own time)")
    p.add_argument("--gguf", default=None, help="a real checkpoint (.gguf) instead of random weights")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="torch.profiler traces of a 1- and a 17-token call: GPU kernels by name, per call and per round",
    )
    p.add_argument("--label", default="", help="a name for the tree, kept in the row")
    p.add_argument("--out", default=None, help="write the row as JSON here too")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    layers = args.layers if cuda else 2
    if args.gguf:
        target = fspec.load_target(args.gguf, dtype=dtype, device=device)
        target = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, eos_token_ids=()))
        if getattr(target, "generation", None) is not None:  # its EOS ids would stop the calls
            target = dataclasses.replace(target, generation=None)
        layers = target.cfg.num_hidden_layers
    else:
        target = smollm2_shaped(layers, dtype, device)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 49152, (args.prompt_tokens,), generator=gen).tolist()

    def call(new: int) -> tuple[int, float]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = fspec.generate(target, None, [prompt], max_new_tokens=new, compile=cuda)
        if cuda:
            torch.cuda.synchronize()
        return len(res.tokens[0]), time.perf_counter() - t0

    for _ in range(2):
        call(args.new_tokens)
        call(1)
    runs = [call(args.new_tokens) for _ in range(args.reps)]
    ones = [call(1)[1] for _ in range(args.reps)]
    rates = [n / s for n, s in runs]
    fixed = statistics.median(ones)
    long = statistics.median(s for _, s in runs)
    profiles = []
    for new in (args.new_tokens, 1):
        prof = cProfile.Profile()
        prof.enable()
        n_prof, s_prof = call(new)
        prof.disable()
        text = io.StringIO()
        text.write(f"--- one call of {new} new tokens under cProfile: {s_prof * 1e3:.2f} ms\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        if new == 1:  # where a call's fixed host time goes, by function and what it calls
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.top)
        profiles += text.getvalue().splitlines()
    kernels = rounds = None
    if args.kernels and cuda:
        kernels = kernel_table(lambda: call(1), args.top)
        rounds = per_round(kernels, kernel_table(lambda: call(17), args.top), 16, args.top)
        kernels.pop("all")
    row = {
        "case": {
            "name": "target_only_host_round", "label": args.label, "layers": layers, "B": 1,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "device": device,
            "dtype": str(dtype).removeprefix("torch."), "compile": cuda, "reps": args.reps,
        },
        "tok_s": statistics.median(rates), "tok_s_all": rates, "tokens": [n for n, _ in runs],
        "ms_per_token": 1e3 / statistics.median(rates),
        "fixed_ms": 1e3 * fixed, "per_token_ms": 1e3 * (long - fixed) / max(args.new_tokens - 1, 1),
        "one_token_ms_all": [1e3 * s for s in ones],
        "profile": profiles[:800],
        "kernels_one_token_call": kernels,
        "kernels_per_decode_round": rounds,  # (a 17-token call's kernels - a 1-token call's) / 16
    }  # fmt: skip
    print(json.dumps({k: v for k, v in row.items() if k != "profile"}))
    print("\n".join(row["profile"]), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
