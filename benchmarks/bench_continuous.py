"""Continuous batching against static batches: many prompts of mixed lengths through B slots.

    python benchmarks/bench_continuous.py [--out benchmarks/results/continuous.json] [--batch 64 256]
        [--prompts 512] [--new-tokens 128] [--dtype bfloat16] [--device cuda] [--compile] [--skip-hf]
        [--profile-host] [--modes MODE ...]

SmolLM2-135M-Instruct with its shipped head; the prompts are the held-out sets of `fspec.train.prompts`
(code, chat, health interleaved, chat template applied, repeated to --prompts), greedy, each request stopped
at EOS or after --new-tokens, so requests end at different rounds. Modes, each one call of all prompts;
with --compile, `Generator.warmup(max_batch=B)` with the head and without records every graph first (the
rows' "warmup_s" and "graphs", the CUDA graphs a timed call recorded: 0 after it), else one warm-up call of
the mode on B prompts:
  * continuous: `fspec.Generator(max_batch=B).generate(...)`: a finished request's slot and blocks go to the
    next waiting prompt in the round it frees (the default `fspec.Refill`);
  * continuous_grouped: the same with `fspec.Refill(share=0.125)`: admission waits until an eighth of the
    slots are free, or one has been free 8 rounds, so that one prefill takes several requests;
  * static: the same generator called on consecutive chunks of B prompts: each chunk runs to its slowest
    request, as `generate` ran chunks of 256 before continuous batching;
  * target_only: continuous batching without the head;
  * hf: transformers `generate` (dynamic cache) on chunks of B prompts with left padding (--skip-hf: not run).
tokens/s = new tokens (EOS included) / wall time. Rows: {"case": {"B", "mode"}, "tok_s", "seconds",
"new_tokens", "tau", "graphs", "warmup_s"} and, for the continuous modes, "rounds" (verification rounds)
and "target_forwards" (rounds plus prefill chunks); written after every row. --profile-host: then one more
continuous call with the head under cProfile, its top host functions beside --out (`<stem>_host_B.txt`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.train import default_model  # noqa: E402
from fspec.train import prompts as P  # noqa: E402

MODES = ("continuous", "continuous_grouped", "static", "target_only", "hf")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/continuous.json")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true", help="compile=True for the fspec modes")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--modes", nargs="+", default=None, choices=MODES, help="run only these modes (default: all)"
    )
    p.add_argument(
        "--profile-host", action="store_true",
        help="then one more continuous call under cProfile: the host's top functions to <out>_host_B.txt",
    )  # fmt: skip
    return p.parse_args(argv)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_generate(model, prompts, new_tokens: int, eos: set[int], b: int) -> int:
    """New tokens (up to and including the first EOS per row) of transformers `generate` on chunks of b."""
    total = 0
    for lo in range(0, len(prompts), b):
        chunk = prompts[lo : lo + b]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                pad_token_id=0, eos_token_id=sorted(eos),
            )  # fmt: skip
        for row in out[:, width:].tolist():
            stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            total += stop
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, head = default_model.load_default(dtype=dtype, device=args.device)
    sets = [default_model.chat_ids(target, P.heldout(n), max_tokens=512) for n in P.HELDOUT]
    mixed = [row for group in zip(*sets) for row in group]
    prompts = (mixed * (-(-args.prompts // len(mixed))))[: args.prompts]
    eos = set(target.cfg.eos_token_ids)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    doc = results_io.header("bench_continuous.py", argv, device_name)
    doc.update(dtype=args.dtype, new_tokens=args.new_tokens, prompts=len(prompts), compile=args.compile,
               prompt_tokens=[min(map(len, prompts)), max(map(len, prompts))], rows=[])  # fmt: skip
    hf = None
    if not args.skip_hf and (args.modes is None or "hf" in args.modes):
        import transformers

        tmp = tempfile.mkdtemp()
        fspec.save_target(target, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(args.device).eval()
    kw = dict(max_new_tokens=args.new_tokens, temperature=0.0, compile=args.compile)
    counts = {}  # the latest continuous call's rounds and target forwards (prefill chunks included)
    for b in args.batch:
        gen = fspec.Generator(max_batch=b)

        def continuous(draft, gen=gen, counts=counts, refill=fspec.Refill()):
            gen.refill = refill  # the policy is read per call: both policies replay the same graphs
            r = gen.generate(target, draft, prompts, **kw)
            counts.update(rounds=r.stats["rounds"], target_forwards=r.stats["target_forwards"])
            return sum(map(len, r.tokens)), r.stats["acceptance_length"]

        def static(gen=gen, b=b):
            n, taus = 0, []
            for lo in range(0, len(prompts), b):
                r = gen.generate(target, head, prompts[lo : lo + b], **kw)
                n += sum(map(len, r.tokens))
                taus.append(r.stats["acceptance_length"])
            return n, sum(taus) / len(taus)

        modes = {
            "continuous": lambda: continuous(head),
            "continuous_grouped": lambda: continuous(head, refill=fspec.Refill(share=0.125)),
            "static": static,
            "target_only": lambda: continuous(None),
        }
        if hf is not None:
            modes["hf"] = lambda b=b: (hf_generate(hf, prompts, args.new_tokens, eos, b), None)
        modes = {m: fn for m, fn in modes.items() if args.modes is None or m in args.modes}
        warm_s = 0.0
        if args.compile:  # every round and prefill-chunk graph of batches up to b, as a server would
            longest = max(map(len, prompts)) + args.new_tokens + 16
            for d in (head, None) if "target_only" in modes else (head,):
                warm_s += gen.warmup(target, d, max_batch=b, max_len=longest, sampled=False)["seconds"]
        for mode, fn in modes.items():
            if mode != "hf" and not args.compile:
                gen.generate(target, head if mode != "target_only" else None, prompts[:b], **kw)  # warm-up
            sync(args.device)
            graphs = gen.recorded_graphs
            counts.clear()
            t0 = time.perf_counter()
            n, tau = fn()
            sync(args.device)
            dt = time.perf_counter() - t0
            row = {
                "case": {"B": b, "mode": mode},
                "tok_s": n / dt,
                "seconds": dt,
                "new_tokens": n,
                "tau": tau,
                "graphs": gen.recorded_graphs - graphs if mode != "hf" else None,
                "warmup_s": round(warm_s, 1) if args.compile else None,
                **counts,
            }
            doc["rows"].append(row)
            results_io.write(Path(args.out), doc)
            print(f"B={b:4d} {mode:12s} {n / dt:9.1f} tok/s  {dt:7.1f} s  tau {tau} {counts}", flush=True)
        if args.profile_host:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            continuous(head)
            sync(args.device)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            pstats.Stats(prof, stream=text).sort_stats("cumtime").print_stats(40)
            Path(args.out).with_name(f"{Path(args.out).stem}_host_{b}.txt").write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
