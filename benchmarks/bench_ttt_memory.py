"""Activation memory of one TTT loss evaluation: bytes kept for the backward pass, before and after.

    python benchmarks/bench_ttt_memory.py [--out benchmarks/results/ttt_memory.json]
    python benchmarks/bench_ttt_memory.py --cuda [--out ...]   # also time each variant on the GPU
    python benchmarks/bench_ttt_memory.py --smoke              # tiny shapes, timed on the CPU

Counts the distinct storages that autograd saves while `fspec.train.ttt.ttt_loss` runs forward (a
`saved_tensors_hooks` pack hook), on the meta device: nothing is allocated, so full Llama-3.2-1B / 3.1-8B
EAGLE-3 shapes fit on any machine and the count is exact. fp32 throughout (distillation without
`--autocast`; bf16 halves every row). Four variants of the same loss (equal values and gradients, tested in
tests/ops/test_ttt_attention.py and tests/train/test_distill.py):

* dense: the unrolled steps attend through SDPA with a boolean `ttt_mask` over the concatenated keys, run by
  PyTorch's math backend (what CUDA SDPA falls back to for a boolean mask with grouped-query heads in
  torch 2.11: flash takes no mask, memory-efficient attention no GQA), and the soft cross-entropy is the
  plain -(softmax(p) * log_softmax(q)).sum(-1).mean();
* + lean attention: steps >= 1 through `fspec.ops.ttt_attention.ttt_attention`;
* + lean CE: and the cross-entropy through `fspec.train.ttt.soft_cross_entropy` (keeps only the logits);
* + fused lm_head CE: the lm_head matmul and the cross-entropy in chunks of rows
  (`fspec.train.ttt.linear_soft_cross_entropy`), keeping no logits at all (fspec's default).

With --cuda each variant also runs for real on the GPU (random bf16 batch, bf16 autocast as `--autocast`
trains, one `torch.func.grad_and_value` of the loss per step): median seconds per step and peak allocated
memory (`torch.cuda.max_memory_allocated`); a variant that runs out of memory says so.

Step 0 is plain causal attention in every variant (SDPA without a mask: flash for bf16 on CUDA; the math
backend here, as for fp32 on CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import llama_1b_config  # noqa: E402

import fspec  # noqa: E402
from fspec.models import llama  # noqa: E402
from fspec.models.heads import head_logits  # noqa: E402
from fspec.ops.attention import dense_attention  # noqa: E402
from fspec.train import ttt  # noqa: E402

SHAPES = {
    "1b": dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, layers=16),
    "8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, layers=32),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2),  # --smoke
}


def _with_logits(ce_fn):
    """A `ttt.head_cross_entropy` that materialises the head's logits and applies `ce_fn` to them."""

    def head_ce(params, out, p_logits, *, cfg):
        logits = head_logits(params, out, cfg=cfg)
        return ce_fn(logits, p_logits), logits.detach().argmax(-1)

    return head_ce


def plain_ce(q_logits: torch.Tensor, p_logits: torch.Tensor) -> torch.Tensor:
    return -(p_logits.float().softmax(-1) * q_logits.float().log_softmax(-1)).sum(-1).mean()


PLAIN_CE, LEAN_CE = _with_logits(plain_ce), _with_logits(ttt.soft_cross_entropy)


def dense_ttt_attention(q, keys, values, chunk=None):
    mask = ttt.ttt_mask(q.shape[1], len(keys) - 1, device=q.device)[None]
    return dense_attention(q, torch.cat(keys, 1), torch.cat(values, 1), mask=mask)


def saved_bytes(fn) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        storages[id(st)] = st.nbytes()
        return t

    keep = []  # storages stay alive (ids unique) until counted
    with torch.autograd.graph.saved_tensors_hooks(lambda t: keep.append(t) or pack(t), lambda t: t):
        fn()
    return sum(storages.values())


def measure(
    shape: str, *, batch: int, seq_len: int, vocab: int, ttt_steps: int, time_on: str | None = None
) -> dict:
    sh = SHAPES[shape]
    cfg = dataclass_replace(
        llama_1b_config(seq_len * 2),
        hidden_size=sh["hidden"],
        num_attention_heads=sh["heads"],
        num_key_value_heads=sh["kv_heads"],
        head_dim=sh["head_dim"],
        intermediate_size=sh["intermediate"],
        num_hidden_layers=sh["layers"],
        torch_dtype="float32",
    )
    target = fspec.Target(cfg=cfg, params=llama.init(cfg, seed=0, device="meta", dtype=torch.float32))
    draft = fspec.init_draft(target, kind="eagle3", draft_vocab_size=vocab, draft_ids=torch.arange(vocab))
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    trainable = fspec.tree.tree_map(lambda x: x.requires_grad_(True), trainable)
    b, s = batch, seq_len
    data = {
        "input_ids": torch.zeros(b, s, dtype=torch.int64, device="meta"),
        "hidden": torch.zeros(b, s, 3 * sh["hidden"], device="meta"),
        "target_logits": torch.zeros(b, s, vocab, device="meta"),
    }

    def run():
        ttt.ttt_loss(trainable, frozen, data, cfg=draft.cfg, ttt_steps=ttt_steps)

    out = {"head": shape, "batch": b, "seq_len": s, "draft_vocab": vocab, "ttt_steps": ttt_steps}
    variants = (
        ("dense", dense_ttt_attention, PLAIN_CE),
        ("lean_attention", ttt.ttt_attention, PLAIN_CE),
        ("lean_attention_and_ce", ttt.ttt_attention, LEAN_CE),
        ("fused_ce", ttt.ttt_attention, ttt.head_cross_entropy),
    )
    for name, attn, ce in variants:
        saved = ttt.ttt_attention, ttt.head_cross_entropy
        ttt.ttt_attention, ttt.head_cross_entropy = attn, ce
        try:
            with sdpa_kernel(SDPBackend.MATH) if name == "dense" else contextlib.nullcontext():
                out[f"{name}_GB"] = saved_bytes(run) / 1e9
        finally:
            ttt.ttt_attention, ttt.head_cross_entropy = saved
    out["reduction"] = out["dense_GB"] / out["fused_ce_GB"]
    if time_on is not None:
        for name, attn, ce in variants:
            out[f"{name}_{time_on}"] = time_variant(
                draft, torch.device(time_on), batch=b, seq_len=s, vocab=vocab, k=ttt_steps, attn=attn, ce=ce
            )
    return out


def time_variant(
    draft, dev: torch.device, *, batch: int, seq_len: int, vocab: int, k: int, attn, ce, reps: int = 5
) -> dict:
    """Median s/step (and peak GB on CUDA) of grad_and_value(ttt_loss) with this attention and CE, under
    bf16 autocast as `--autocast` distillation runs."""
    import statistics
    import time

    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def real(x: torch.Tensor) -> torch.Tensor:  # meta -> random weights (integer maps: identity, zeros)
        if x.is_floating_point():
            return torch.randn(x.shape, device=dev, generator=gen) * 0.02
        return torch.zeros(x.shape, dtype=x.dtype, device=dev)

    params = fspec.tree.tree_map(real, draft.params)
    trainable, frozen = ttt.split_params(params, draft.shared)
    data = {
        "input_ids": torch.randint(0, vocab, (batch, seq_len), device=dev, generator=gen),
        "hidden": torch.randn(
            batch, seq_len, 3 * draft.cfg.target_hidden_size, device=dev, generator=gen
        ).bfloat16(),
        "target_logits": torch.randn(batch, seq_len, vocab, device=dev, generator=gen).bfloat16(),
    }
    grad = torch.func.grad_and_value(ttt.ttt_loss, has_aux=True)
    saved = ttt.ttt_attention, ttt.head_cross_entropy
    ttt.ttt_attention, ttt.head_cross_entropy = attn, ce
    times = []
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(reps + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                g, _ = grad(trainable, frozen, data, cfg=draft.cfg, ttt_steps=k)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del g
        row = {"s_per_step": statistics.median(times[1:])}
        if cuda:
            row["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        return row
    except torch.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0][:160]}"}
    finally:
        ttt.ttt_attention, ttt.head_cross_entropy = saved
        if cuda:
            torch.cuda.empty_cache()


def dataclass_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/ttt_memory.json")
    p.add_argument("--cuda", action="store_true", help="also run each variant on the GPU (time, peak memory)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, timed on the CPU (checks the script)")
    args = p.parse_args(argv)
    cases = [("1b", 16, 1024, 32000, 7), ("1b", 8, 2048, 32000, 7), ("8b", 8, 2048, 32000, 7)]
    time_on = "cuda" if args.cuda else None
    if args.smoke:
        cases, time_on = [("tiny", 2, 32, 128, 3)], "cpu"
    rows = []
    for shape, b, s, v, k in cases:
        row = measure(shape, batch=b, seq_len=s, vocab=v, ttt_steps=k, time_on=time_on)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        "machine": "meta device (no allocation; exact saved-tensor bytes)"
        + (f"; timings on {torch.cuda.get_device_name(0)}" if args.cuda else ""),
        "torch": torch.__version__,
        "triton": "-",
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
