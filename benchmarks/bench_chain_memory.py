"""What one TTT loss keeps for its backward pass, with the chain cache's lean attention and with the dense
masked softmax it replaced: exact bytes of the tensors autograd saves (`saved_tensors_hooks`), on the CPU.

    python benchmarks/bench_chain_memory.py [--out benchmarks/results/chain_memory.json] [--smoke]

Cases (random heads, `bench_ttt_step.build_case`'s shapes at batch 1; saved bytes grow linearly with the
batch): SmolLM2 head shapes at S = 512, Llama-3.2-1B head shapes at S = 1024, K = 7, fp32, feed from
predictions. "dense" swaps `fspec.ops.chain_attention.chain_attention` for the materialised softmax
(tests/ops/test_chain_attention.py's reference): what `bind_chain` computed before the lean attention.
Rows: {"case": {"name", "seq_len"}, "lean_GB", "dense_GB", "ratio", "loss_equal"}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ttt_step  # noqa: E402
import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.ops import dense_cache  # noqa: E402
from fspec.train import ttt  # noqa: E402


def dense_chain_attention(q, ks, vs, kd, vd, mine, *, chunk=None):
    """The materialised form: one masked softmax over [S shared + Kc chain] keys."""
    s, d = q.shape[3], q.shape[4]
    shared = torch.einsum("bkgsd,bktd->bkgst", q, ks.to(q.dtype))
    own = torch.einsum("bkgsd,bkstd->bkgst", q, kd.to(q.dtype))
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    visible = torch.cat((causal, mine[None, :].expand(s, -1)), dim=-1)
    p = torch.cat((shared, own), dim=-1).mul(d**-0.5).masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("bkgst,bktd->bkgsd", p[..., :s], vs.to(q.dtype))
    return out + torch.einsum("bkgst,bkstd->bkgsd", p[..., s:], vd.to(q.dtype))


def saved_bytes(name: str, seq_len: int, *, dense: bool) -> tuple[int, float]:
    draft, trainable, _, frozen, batch, (_, _, k) = bench_ttt_step.build_case(name, torch.device("cpu"))
    batch = {key: v[:1, :seq_len] for key, v in batch.items()}
    trainable = fspec.tree.tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), trainable)
    kept: dict[int, int] = {}
    leaves = fspec.tree.tree_leaves((trainable, frozen, batch))
    inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}

    def pack(t):
        storage = t.untyped_storage()  # views of one tensor count once
        if storage.data_ptr() not in inputs:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    real = dense_cache.chain_attention
    dense_cache.chain_attention = dense_chain_attention if dense else real
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = ttt.ttt_loss(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=k, step_weight=0.8)
    finally:
        dense_cache.chain_attention = real
    return sum(kept.values()), float(loss.detach())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/chain_memory.json")
    p.add_argument("--smoke", action="store_true", help="the tiny shapes only")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cases = [("tiny", 32)] if args.smoke else [("smollm2", 512), ("1b", 1024)]
    doc = results_io.header("bench_chain_memory.py", argv, "cpu")
    doc["rows"] = []
    for name, s in cases:
        lean, loss_lean = saved_bytes(name, s, dense=False)
        dense, loss_dense = saved_bytes(name, s, dense=True)
        row = {
            "case": {"name": name, "seq_len": s, "batch": 1},
            "lean_GB": lean / 1e9,
            "dense_GB": dense / 1e9,
            "ratio": dense / lean,
            "loss_equal": abs(loss_lean - loss_dense) <= 1e-4 * abs(loss_dense),
        }
        doc["rows"].append(row)
        print(row, flush=True)
    results_io.write(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
