"""How much of the target's own output the shipped head's reduced draft vocabulary can draft, beside τ.

    python benchmarks/draft_vocab_coverage.py [--prompts 8] [--new-tokens 64] [--threads 2] [--head DIR]
        [--out FILE]

The default model (SmolLM2-135M-Instruct and its EAGLE-3 head, float32, CPU) answers the first --prompts
prompts of each held-out set (`fspec.train.prompts.HELDOUT`, chat template applied), greedy, K = 5, in one
batch per set. Per set: the share of the answers' tokens inside the draft vocabulary (the head's `t2d`: a
token outside it is never drafted, so a position's acceptance is at most that share), τ, and the acceptance
rate per position; and, for scale, the share of tokens whose ids are below each --id-cuts value (BPE ids
follow the tokenizer's merge order, roughly its training corpus's frequencies: a draft vocabulary chosen
without any held-out text). Greedy speculation emits the target's own greedy tokens, so the answers are the
target's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.train import prompts as P  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--id-cuts", type=int, nargs="*", default=[8192, 16384, 32768],
        help="also the share of tokens with ids below each cut (the tokenizer's order, no held-out text)",
    )  # fmt: skip
    p.add_argument("--head", default=None, help="another head directory for the default target")
    p.add_argument("--out", default="benchmarks/results/draft_vocab_coverage_cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, head = fspec.load_default()
    if args.head:
        head = fspec.load_draft(args.head, target=target, dtype=torch.float32)
    t2d = head.params["t2d"].detach()
    doc = results_io.header("draft_vocab_coverage.py", argv, "cpu")
    doc.update(draft_vocab_size=head.cfg.draft_vocab_size, k=5, new_tokens=args.new_tokens, rows=[])
    for name in P.HELDOUT:
        chats = [[{"role": "user", "content": q}] for q in P.heldout(name)[: args.prompts]]
        t0 = time.perf_counter()
        res = fspec.generate(target, head, chats, max_new_tokens=args.new_tokens, num_speculative_steps=5)
        tokens = torch.tensor([t for seq in res.tokens for t in seq], dtype=torch.int64)
        row = {
            "case": {"set": name, "prompts": len(chats)},
            "tokens": int(tokens.numel()),
            "coverage": int(t2d[tokens].sum()) / max(int(tokens.numel()), 1),
            "coverage_ids_below": {str(n): (tokens < n).float().mean().item() for n in args.id_cuts},
            "tau": res.stats["acceptance_length"],
            "acceptance_rate_per_position": res.stats["acceptance_rate_per_position"],
            "seconds": time.perf_counter() - t0,
        }
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
    results_io.write(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
