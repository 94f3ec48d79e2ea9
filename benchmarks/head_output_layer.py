"""How far the shipped head's trained output layer is from the target's rows, and τ with the target's rows
swapped in untrained (CPU, greedy).

    python benchmarks/head_output_layer.py [--prompts 6] [--new-tokens 64] [--vocab 8192 32768 49152]
        [--threads 1] [--out benchmarks/results/head_output_layer_cpu.json]

The question behind `init_draft(tie_lm_head=True)`: could the shipped head draft through the target's own
output rows (any vocabulary size at no checkpoint bytes) without training for it? Reported:
* how the trained lm_head [Vd, H] differs from the target's lm_head rows of the same ids: relative Frobenius
  distance, mean row cosine, the best single scale between them, and the share of the difference's energy
  in its top singular directions (a low-rank delta would be a cheap way to ship a trained layer);
* τ at K = 5 on the first --prompts prompts of each held-out set (`fspec.train.prompts.HELDOUT`, chat template
  applied, one batch per set): the shipped head, then the same head with lm_head replaced by the target's rows
  (`fspec.models.heads.eagle3.tied_lm_head`) over the shipped draft vocabulary and over each larger --vocab
  (the shipped ids first, then the lowest other ids: BPE ids follow the merge order, roughly frequency).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.models import layers as L  # noqa: E402
from fspec.models import llama  # noqa: E402
from fspec.models.heads import eagle3  # noqa: E402
from fspec.train import prompts as P  # noqa: E402


def distance(own: torch.Tensor, rows: torch.Tensor, ranks=(32, 128, 256)) -> dict:
    own, rows = own.float(), rows.float()
    delta = own - rows
    energy = torch.linalg.svdvals(delta) ** 2
    share = energy.cumsum(0) / energy.sum()
    scale = float((own * rows).sum() / (rows * rows).sum())
    return {
        "relative_distance": float(delta.norm() / rows.norm()),
        "mean_row_cosine": float(torch.nn.functional.cosine_similarity(own, rows, dim=1).mean()),
        "best_scale": scale,
        "relative_distance_after_scale": float((own - scale * rows).norm() / own.norm()),
        "delta_energy_in_top": {str(r): float(share[r - 1]) for r in ranks if r <= share.numel()},
    }


def tied(head: fspec.Draft, target: fspec.Target, ids: torch.Tensor) -> fspec.Draft:
    """`head` with draft vocabulary `ids` (increasing target ids) and the target's rows as its lm_head."""
    d2t, t2d = eagle3.vocab_maps(ids, target.cfg.vocab_size)
    cfg = dataclasses.replace(head.cfg, draft_vocab_size=ids.numel())
    params = {**head.params, "d2t": L.param(d2t), "t2d": L.param(t2d)}
    params["lm_head"] = eagle3.tied_lm_head(cfg, params, target.params)
    return fspec.Draft(cfg=cfg, params=params, shared=(*head.shared, "lm_head"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768, 49152])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/head_output_layer_cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, head = fspec.load_default()
    v = target.cfg.vocab_size
    shipped = torch.arange(head.cfg.draft_vocab_size) + head.params["d2t"]
    doc = results_io.header("head_output_layer.py", argv, "cpu")
    doc["distance"] = distance(head.params["lm_head"], llama.lm_head(target.params)[shipped])
    print(json.dumps(doc["distance"]), flush=True)
    others = torch.tensor([i for i in range(v) if not bool(head.params["t2d"][i])])
    heads = {"shipped": head}
    for n in args.vocab:
        if not shipped.numel() <= n <= v:
            raise SystemExit(f"--vocab: expected sizes in [{shipped.numel()}, {v}], got {n}")
        ids = torch.cat((shipped, others[: n - shipped.numel()])).sort().values
        heads[f"target_rows_{n}"] = tied(head, target, ids)
    doc["rows"] = []
    for name, d in heads.items():
        row = {"case": {"head": name, "draft_vocab_size": d.cfg.draft_vocab_size}, "tau": {}}
        for s in P.HELDOUT:
            chats = [[{"role": "user", "content": q}] for q in P.heldout(s)[: args.prompts]]
            res = fspec.generate(target, d, chats, max_new_tokens=args.new_tokens, num_speculative_steps=5)
            row["tau"][s] = round(res.stats["acceptance_length"], 4)
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
        results_io.write(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
