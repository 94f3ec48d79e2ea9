"""The real model end to end: SmolLM2-135M-Instruct with its shipped EAGLE-3 head, against the target alone
and Hugging Face transformers, in one run on one GPU.

    python benchmarks/bench_real_model.py [--out benchmarks/results/real_model.json] [--batch 1 8 32]
        [--temperature 0 0.7] [--new-tokens 256] [--k 5] [--reps 3] [--dtype bfloat16] [--head DIR]

Prompts: the held-out sets of `fspec.train.prompts` (never trained on), rendered with the model's chat
template; a batch of B takes the first B prompts of the sets interleaved (code, chat, code, ...); B = 1 takes
the first --b1-prompts of them, one call each in sequence (one prompt would make a row of one answer's length
and acceptance), timed together, tau weighted by rounds. Each call
stops a request at EOS or after --new-tokens. tokens/s = new tokens of the batch (EOS included) / wall time of
one call, warm: every fspec call is made twice first (compiles, records CUDA graphs), then --reps times on the
same prompts; the median is reported (HF: one warm-up call for the dynamic cache, two for the static one,
then --reps - 1 timed calls, at least one). HF rows: transformers `generate` on the same weights (written by
`fspec.save_target`, loaded with AutoModelForCausalLM) greedy or sampled at the same temperature, dynamic
cache (`hf_tok_s`) and static cache (`hf_static_tok_s`, `cache_implementation="static"`, compiled by
transformers), at batch B with left padding. tau = acceptance length (tokens per target forward) of the
speculative call. Rows: {"case": {"B", "temperature"}, "spec_tok_s", "target_only_tok_s", "tau",
"hf_tok_s", "hf_static_tok_s", "speedup", "same_greedy_tokens", "draft_vocab_coverage" (the share of the
target-only tokens inside the head's draft vocabulary), ...}; written after every row. Every fspec row runs
first (--budget-s: none starts after that many seconds), then transformers fills in each row's peers in the
same run (--peer-budget-s bounds that phase): its static cache compiles per prompt shape, and at B = 1 it took
most of a 230 s budget before B = 8 could start.
"""

from __future__ import annotations

import argparse
import statistics
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/real_model.json")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--top-k", type=int, default=0, help="sampling filter for every row (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling filter for every row (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling filter for every row (0 = off)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--head", default=None, help="head directory (default: the shipped one)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no fspec row after this many seconds")
    p.add_argument(
        "--peer-budget-s",
        type=float,
        default=1e9,
        help="after the fspec rows: fill in transformers' figures for no further row after this many seconds",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--b1-prompts", type=int, default=8, help="B = 1: this many prompts, one call each, in sequence"
    )
    return p.parse_args(argv)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def batch_prompts(target, b: int) -> list[list[int]]:
    sets = [default_model.chat_ids(target, P.heldout(n), max_tokens=384) for n in P.HELDOUT]
    mixed = [row for group in zip(*sets) for row in group]
    return mixed[:b]


def timed(fn, reps: int, device, warmups: int = 2) -> tuple[float, object]:
    """(median seconds, last result) of `reps` calls after `warmups` warm-up calls."""
    for _ in range(warmups):
        fn()
    times, out = [], None
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def hf_model(target, dtype, device, tmp: str):
    import transformers

    fspec.save_target(target, tmp)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    return model


def hf_tokens(new: torch.Tensor, eos: set[int]) -> int:
    """New tokens per row up to and including the first EOS (what fspec counts)."""
    total = 0
    for row in new.tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos:
                n = i + 1
                break
        total += n
    return total


def hf_call(model, prompts, new_tokens: int, temperature: float, eos: set[int], filters: dict, **extra):
    width = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sample = {"temperature": temperature, **filters} if temperature else {}
    if sample and not sample.get("min_p"):
        sample.pop("min_p", None)  # transformers applies min_p whenever it is given

    def call():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                pad_token_id=pad,
                eos_token_id=sorted(eos),
                do_sample=bool(temperature),
                **sample,
                **extra,
            )
        return hf_tokens(out[:, width:], eos)

    return call


def run_fspec(target, head, prompts, *, one_by_one: bool, **kw):
    """(token lists, tau) of fspec.generate over prompts: one call, or with one_by_one one call per prompt
    (tau weighted by each call's rounds)."""
    if not one_by_one:
        res = fspec.generate(target, head, prompts, **kw)
        return res.tokens, res.stats["acceptance_length"], res.stats.get("acceptance_rate_per_position")
    tokens, weighted, rounds = [], 0.0, 0
    for p in prompts:
        res = fspec.generate(target, head, [p], **kw)
        tokens += res.tokens
        r = res.stats["rounds"]
        weighted, rounds = weighted + res.stats["acceptance_length"] * r, rounds + r
    return tokens, weighted / max(rounds, 1), None


def draft_vocab_coverage(head, sequences: list[list[int]]) -> float | None:
    """The share of the target's own tokens (target-only output) that the head's reduced draft vocabulary
    holds (`t2d`): a token outside it is never drafted, so it bounds each position's acceptance."""
    t2d = head.params.get("t2d")
    tokens = [t for seq in sequences for t in seq]
    if t2d is None or not tokens:
        return None
    held = t2d.detach().cpu()[torch.tensor(tokens)]
    return int(held.sum()) / len(tokens)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    dtype = getattr(torch, args.dtype)
    target, head = default_model.load_default(args.head, dtype=dtype, device=device)
    eos = set(target.cfg.eos_token_ids)
    doc = results_io.header(
        "bench_real_model.py", argv, torch.cuda.get_device_name() if device == "cuda" else device
    )
    doc.update(
        model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        dtype=args.dtype,
        k=args.k,
        new_tokens=args.new_tokens,
        prompts="fspec.train.prompts held-out sets " + ", ".join(P.HELDOUT),
        rows=[],
    )
    out = Path(args.out)
    tmp = tempfile.mkdtemp()
    began = time.perf_counter()
    pending = []  # (row, prompts, temperature, filters, one call per prompt): the rows the peers fill in
    for b in args.batch:
        one_by_one = b == 1 and args.b1_prompts > 1
        prompts = batch_prompts(target, args.b1_prompts if one_by_one else b)
        for t in args.temperature:
            if time.perf_counter() - began > args.budget_s:
                print(f"budget spent: skipping B={b} T={t}", flush=True)
                continue
            filters = dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
            kw = dict(
                max_new_tokens=args.new_tokens, temperature=t, seed=list(range(b)), compile=True, **filters
            )
            case = {"B": b, "temperature": t}
            if t and (args.top_k, args.top_p, args.min_p) != (0, 1.0, 0.0):
                case.update(filters)
            row: dict = {"case": case, "prompt_tokens": [len(p) for p in prompts]}
            if one_by_one:
                kw["seed"] = [0]
            s_spec, spec = timed(
                lambda prompts=prompts, kw=kw, one=one_by_one: run_fspec(
                    target, head, prompts, one_by_one=one, num_speculative_steps=args.k, **kw
                ),
                args.reps,
                device,
            )
            s_plain, plain = timed(
                lambda prompts=prompts, kw=kw, one=one_by_one: run_fspec(
                    target, None, prompts, one_by_one=one, **kw
                ),
                args.reps,
                device,
            )
            n_spec, n_plain = sum(map(len, spec[0])), sum(map(len, plain[0]))
            row.update(
                spec_tok_s=n_spec / s_spec,
                target_only_tok_s=n_plain / s_plain,
                tau=spec[1],
                new_tokens_spec=n_spec,
                new_tokens_target_only=n_plain,
            )
            if spec[2] is not None:
                row["acceptance_rate_per_position"] = spec[2]
            row["draft_vocab_coverage"] = draft_vocab_coverage(head, plain[0])
            if one_by_one:
                row["calls"] = len(prompts)
            row["speedup"] = row["spec_tok_s"] / row["target_only_tok_s"]
            if t == 0:
                row["same_greedy_tokens"] = spec[0] == plain[0]
            doc["rows"].append(row)
            results_io.write(out, doc)
            pending.append((row, prompts, t, filters, one_by_one))
            print(
                f"B={b:3d} T={t}: spec {row['spec_tok_s']:8.1f} tok/s"
                f"  target-only {row['target_only_tok_s']:8.1f}  x{row['speedup']:.2f}  tau {row['tau']:.2f}",
                flush=True,
            )
    # The peers once every fspec row is in: transformers' static cache compiles per prompt shape, which
    # could otherwise spend the budget before the larger batches' fspec rows ran.
    hf = (
        None
        if args.skip_hf or not pending or args.peer_budget_s <= 0
        else hf_model(target, dtype, device, tmp)
    )
    peers_began = time.perf_counter()
    for row, prompts, t, filters, one_by_one in pending if hf is not None else []:
        if time.perf_counter() - peers_began > args.peer_budget_s:
            print(f"peer budget spent: no transformers figures for {row['case']}", flush=True)
            break
        add_peers(row, hf, prompts, t, filters, one_by_one, eos, args, device)
        results_io.write(out, doc)
        print(
            f"{row['case']}: hf {row.get('hf_tok_s') or 0:7.1f}"
            f"  hf-static {row.get('hf_static_tok_s') or 0:7.1f}",
            flush=True,
        )
    return 0


def add_peers(row: dict, hf, prompts, t: float, filters: dict, one_by_one: bool, eos, args, device) -> None:
    """transformers' tokens/s on the row's prompts (`hf_tok_s`, `hf_static_tok_s`), or the error it raised
    (`hf_error`, `hf_static_error`: recorded, not hidden). HF eager needs no warm-up beyond one call; the
    static cache compiles in its first call."""
    peers = (("hf_tok_s", {}, 1), ("hf_static_tok_s", {"cache_implementation": "static"}, 2))
    for name, extra, warmups in peers:
        try:
            calls = [hf_call(hf, [q], args.new_tokens, t, eos, filters, **extra) for q in prompts]
            if not one_by_one:
                calls = [hf_call(hf, prompts, args.new_tokens, t, eos, filters, **extra)]
            sec, n = timed(
                lambda calls=calls: sum(c() for c in calls), max(args.reps - 1, 1), device, warmups
            )
            row[name] = n / sec
        except Exception as e:
            row[name] = None
            row[name.replace("tok_s", "error")] = f"{type(e).__name__}: {e}"[:300]


if __name__ == "__main__":
    sys.exit(main())
