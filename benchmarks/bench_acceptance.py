"""Acceptance length τ of the embedded default model's EAGLE-3 head on held-out standard-library files.

For K ∈ {1, 3, 5, 7}, greedy and temperature 1: the measured τ (mean tokens per target forward), the
per-position acceptance rates, and two predictions — the i.i.d. formula (1 − α^{K+1}) / (1 − α) with α
the K = 1 acceptance rate, and 1 + Σ_k Π_{i≤k} α_i with the conditional rates measured at K = 7 — beside
an untrained head of the same shape. Runs on any device (CPU is fine: the model is 4M parameters).
Prompts: a window from the middle of each of --prompts held-out files spread evenly over the sorted
held-out list (`fspec.train.data.spread_starts`), so no single file dominates.

    python benchmarks/bench_acceptance.py [--prompts 0] [--new-tokens 128] [--device cpu] [--out PATH]
        [--model DIR] [--ks 1,3,5,7] [--trained-only]

--model scores another build of `python -m fspec.train.toy_model` (default: the shipped one); --ks and
--trained-only cut the grid for quick comparisons of builds (the theory columns need K = 1 and K = 7).

--prompts 0 (the default) takes one prompt from every held-out file of at least --prompt-len tokens; N > 0
takes N files spread evenly over the sorted list.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

import fspec
from fspec.train import data, toy_model


def prompts_from_held_out(tokenizer, n: int, length: int) -> tuple[list[list[int]], list[str]]:
    """n prompts of `length` tokens from held-out files spread evenly over the sorted held-out list, from
    the middle of each file (`data.spread_starts`), and the paths of those files."""
    root = data.stdlib_root()
    _, held = data.split_files(data.stdlib_files(), root)
    held = [f for f in held if next(data.read_texts([f]), None) is not None]  # as encode_files reads them
    ids = data.encode_files(tokenizer, held)
    eos = tokenizer.token_to_id(data.SPECIAL_TOKENS[0])
    if n == 0:  # one per file long enough (the files `spread_starts` keeps)
        bounds = [-1, *(ids == eos).nonzero().flatten().tolist()]
        n = sum(b - a - 1 >= length for a, b in zip(bounds, bounds[1:]))
    starts = data.spread_starts(ids, count=n, length=length, eos=eos)
    ends = (ids == eos).nonzero().flatten()
    names = [held[int((ends < s).sum())].relative_to(root).as_posix() for s in starts]
    return [ids[s : s + length].tolist() for s in starts], names


def _shown(model: str) -> str:
    return "fspec/assets/toy" if Path(model).resolve() == toy_model.ASSETS.resolve() else model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: one per held-out file)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/acceptance.json")
    p.add_argument("--model", default=str(toy_model.ASSETS), help="a built default-model directory")
    p.add_argument("--ks", default="1,3,5,7", help="comma-separated K values")
    p.add_argument("--trained-only", action="store_true", help="skip the untrained head")
    args = p.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))
    if not ks or min(ks) < 1:
        p.error(f"--ks: expected comma-separated K >= 1, got {args.ks!r}")
    torch.manual_seed(0)
    dev = torch.device(args.device)
    target = fspec.load_target(Path(args.model) / "target", device=dev)
    trained = fspec.load_draft(Path(args.model) / "eagle3", target=target)
    untrained = fspec.init_draft(
        target,
        kind="eagle3",
        seed=1,
        num_speculative_steps=7,
        draft_vocab_size=trained.cfg.draft_vocab_size,
        block_size=trained.cfg.block_size,
        max_model_len=trained.cfg.max_model_len,
        draft_ids=fspec.draft_to_target(
            torch.arange(trained.cfg.draft_vocab_size, device=dev), trained.params["d2t"]
        ),
        target_layer_ids=trained.cfg.target_layer_ids,
        intermediate_size=trained.cfg.model.intermediate_size,
    )
    prompts, files = prompts_from_held_out(target.tokenizer, args.prompts, args.prompt_len)
    data_files = len(data.split_files(data.stdlib_files())[1])
    print(f"prompts from: {', '.join(files)}", flush=True)
    rows = []
    heads = (("trained", trained),) if args.trained_only else (("trained", trained), ("untrained", untrained))
    for head_name, head in heads:
        for temp in (0.0, 1.0):
            alpha1, cond7 = None, None
            for k in ks:
                res = fspec.generate(
                    target,
                    head,
                    prompts,
                    max_new_tokens=args.new_tokens,
                    temperature=temp,
                    seed=list(range(len(prompts))),
                    num_speculative_steps=k,
                )
                s = res.stats
                if k == 1:
                    alpha1 = s["acceptance_rate_per_position"][0]
                if k == 7:
                    cond7 = s["conditional_acceptance_per_position"]
                rows.append(
                    {
                        "case": {"head": head_name, "temperature": temp, "K": k},
                        "acceptance_length": s["acceptance_length"],
                        "acceptance_rate_per_position": s["acceptance_rate_per_position"],
                        "conditional_acceptance_per_position": s["conditional_acceptance_per_position"],
                        "rounds": s["rounds"],
                        "new_tokens": s["new_tokens"],
                    }
                )
                print(json.dumps(rows[-1]["case"]), f"tau {s['acceptance_length']:.2f}", flush=True)
            for r in rows:
                c = r["case"]
                if c["head"] != head_name or c["temperature"] != temp:
                    continue
                k = c["K"]
                a = alpha1
                if a is not None:
                    r["theory_iid"] = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
                if cond7 is not None:
                    prod, tau = 1.0, 1.0
                    for i in range(k):
                        prod *= cond7[i]
                        tau += prod
                    r["theory_per_position"] = tau
    out = {
        "machine": platform.processor() or platform.machine(),
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": "-",
        "held_out_files": data_files,
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/bench_acceptance.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "copy_bandwidth_TBps": None,
        "model": f"embedded default ({_shown(args.model)}): 4-layer Llama, EAGLE-3 head, draft vocab "
        f"{trained.cfg.draft_vocab_size}",
        "prompts": len(prompts),
        "prompt_files": files,
        "prompt_selection": f"a {args.prompt_len}-token window from the middle of each of {len(prompts)} "
        f"held-out files (of {data_files}, this Python's) spread evenly over the sorted held-out list "
        "(fspec.train.data.spread_starts); generated "
        "_sysconfigdata* files are not in the corpus",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'head':>9} {'T':>4} {'K':>2} {'tau':>6} {'iid':>6} {'perpos':>6}")
    for r in rows:
        c = r["case"]
        print(
            f"{c['head']:>9} {c['temperature']:>4} {c['K']:>2} {r['acceptance_length']:>6.2f} "
            f"{r.get('theory_iid', float('nan')):>6.2f} {r.get('theory_per_position', float('nan')):>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
