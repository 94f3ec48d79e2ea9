"""One TTT training step through the draft loop's own step over a `ChainKVCache`: time and peak memory.

    python3 benchmarks/bench_ttt_step.py [--reps 10] [--out benchmarks/results/ttt_step.json]
    python3 benchmarks/bench_ttt_step.py --real-model [--steps 60] [--out $OUT/ttt_step.json]   # H200
    python3 benchmarks/bench_ttt_step.py --smoke --out /tmp/ttt_step_smoke.json   # tiny shapes, CPU

At commit b9097a0, the last before the reference loop over the head's layers (`via_draft_step=False`) was
deleted, this script ran that loop beside the draft step in one process: the old-beside-new figures of
results/ttt_step.json come from there. It now runs the remaining path only.

A step is what distillation runs: `fspec.train.ttt.train_step` (`torch.func.grad_and_value` of `ttt_loss`
under bf16 autocast, as `--autocast` trains, gradient clipping, AdamW) on fp32 master weights, feed
"prediction", K = 7. Each call starts from the same (weights, AdamW state). Heads are fresh EAGLE-3 heads
(`fspec.init_draft` through `fspec.train.distill.new_draft`, random weights) at:

* smollm2: the shipped recipe's head (`fspec.train.default_model.Recipe`): target SmolLM2-135M (hidden 576,
  9 query / 3 KV heads of 64, intermediate 1536, 30 layers, vocabulary 49152), head hidden 576, draft
  vocabulary 8192, batch 32 x 512;
* 1b: Llama-3.2-1B shapes (hidden 2048, 32 / 8 heads of 64, intermediate 8192,
  vocabulary 128256), draft vocabulary 32000, batch 16 x 1024.

The target is never run for these cases: its embedding is real (random, bf16 as a bf16 target's), its layers
live on the meta device; the batch is random (ids, aux hidden states and target logits in bf16).

Timing: 3 warm-up steps, then `--reps` timed steps; seconds per step = the median, with
torch.cuda.synchronize around each step; tokens/s = batch · seq / seconds. Peak memory:
`torch.cuda.max_memory_allocated()` of each step (after empty_cache and reset_peak_memory_stats), the largest
over the repetitions; "base_gib" is what is allocated before a step (weights, AdamW state, batch).

--real-model: also `fspec.train.distill.distill_head` for `--steps` steps on the real SmolLM2-135M target
(`fspec.load_default(dtype=torch.bfloat16, device="cuda")`, its shipped head as the starting point) fed by
`online_batches` over a random token stream, DistillConfig(batch_size=32, seq_len=512, autocast=True);
tokens/s of the records after the first (the first holds the warm-up), peak memory of the whole run.

--smoke: tiny shapes on the CPU (fp32, no autocast, no memory figures, 2 repetitions; the distillation part
on `fspec.load_toy()`'s model), to check the script.

Rows: {"case", "s_per_step", "peak_gib", "tok_s", "loss"} ("loss": the step's loss; the distillation row's
is the last record's), or "error" when the case failed (out of memory, say).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402
from bench_generate import llama_1b_config  # noqa: E402

import fspec  # noqa: E402
from fspec.models import llama  # noqa: E402
from fspec.train import distill as D  # noqa: E402
from fspec.train import ttt  # noqa: E402

GIB = 2**30

# (target config for a max_len, draft vocabulary, batch, seq_len, ttt_steps)
CASES = {
    "smollm2": (
        lambda max_len: fspec.ModelConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            max_position_embeddings=max_len,
        ),
        8192,
        32,
        512,
        7,
    ),
    "1b": (llama_1b_config, 32000, 16, 1024, 7),
    "tiny": (  # --smoke
        lambda max_len: fspec.ModelConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            max_position_embeddings=max_len,
        ),
        64,
        2,
        32,
        3,
    ),
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _fresh_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else None


def _error(e: Exception) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of memory: {str(e).splitlines()[0][:160]}"
    traceback.print_exc()
    return f"{type(e).__name__}: {e}"[:300]


def build_case(name: str, dev: torch.device, *, seed: int = 0):
    """(draft, trainable, opt_state, frozen, batch, (batch, seq_len, ttt_steps)): a random head, batch."""
    make_cfg, vd, b, s, k = CASES[name]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # a bf16 target's embedding
    cfg = dataclasses.replace(make_cfg(2 * s), torch_dtype="float32")
    params = llama.init(cfg, seed=seed, device="meta", dtype=dtype)  # the target's layers are never run
    gen = torch.Generator(device=dev).manual_seed(seed)
    v, ht = cfg.vocab_size, cfg.hidden_size
    params["embed"] = (torch.randn(v, ht, device=dev, generator=gen) * 0.02).to(dtype)
    target = fspec.Target(cfg=cfg, params=params)
    tokens = torch.randint(0, v, (1 << 16,), generator=torch.Generator().manual_seed(seed))
    draft = D.new_draft(target, kind="eagle3", tokens=tokens, draft_vocab_size=vd, seed=seed)
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    del target, params
    batch = {
        "input_ids": torch.randint(0, v, (b, s), device=dev, generator=gen),
        "hidden": torch.randn(b, s, 3 * ht, device=dev, generator=gen).to(dtype),
        "target_logits": (torch.randn(b, s, vd, device=dev, generator=gen) * 3).to(dtype),
    }
    return draft, trainable, ttt.adamw_init(trainable), frozen, batch, (b, s, k)


def measure_step(name: str, dev: torch.device, *, reps: int, warmup: int = 3) -> dict:
    """Median s/step, peak GiB and tokens/s of one `train_step`."""
    draft, trainable, opt, frozen, batch, (b, s, k) = build_case(name, dev)
    vd = CASES[name][1]
    case = {
        "name": f"{name}_train_step",
        "target_hidden": draft.cfg.target_hidden_size,
        "head_hidden": draft.cfg.model.hidden_size,
        "heads": draft.cfg.model.num_attention_heads,
        "kv_heads": draft.cfg.model.num_key_value_heads,
        "head_dim": draft.cfg.model.head_dim,
        "intermediate": draft.cfg.model.intermediate_size,
        "draft_vocab": vd,
        "target_vocab": draft.cfg.model.vocab_size,
        "ttt_steps": k,
        "batch": b,
        "seq_len": s,
        "autocast": dev.type == "cuda",
        "feed": "prediction",
        "device": str(dev),
    }
    dcfg = ttt.DistillConfig(ttt_steps=k, batch_size=b, seq_len=s, autocast=True, steps=1000, warmup_steps=50)
    _sync(dev)
    case["base_gib"] = torch.cuda.memory_allocated(dev) / GIB if dev.type == "cuda" else None
    times, peaks, loss = [], [], None
    try:
        for i in range(warmup + reps):
            _fresh_peak(dev)
            _sync(dev)
            t0 = time.perf_counter()
            out = ttt.train_step(trainable, opt, frozen, batch, step=100, cfg=draft.cfg, dcfg=dcfg)
            _sync(dev)
            dt = time.perf_counter() - t0
            loss = float(out[2]["loss"])
            del out
            if i >= warmup:
                times.append(dt)
                peak = _peak_gib(dev)
                if peak is not None:
                    peaks.append(peak)
    except Exception as e:  # out of memory, say: the row records it and the next case still runs
        _fresh_peak(dev)
        return {"case": case, "error": _error(e)}
    _fresh_peak(dev)
    return _row(case, times, peaks, tokens=b * s, loss=loss)


def _row(case: dict, times: list[float], peaks: list[float], *, tokens: int, loss: float) -> dict:
    sec = statistics.median(times)
    return {
        "case": case,
        "s_per_step": sec,
        "peak_gib": max(peaks) if peaks else None,
        "tok_s": tokens / sec if sec else None,
        "loss": loss,
    }


def measure_distill(dev: torch.device, *, steps: int, smoke: bool) -> dict:
    """distill_head on the real SmolLM2 target (--smoke: the toy model): tokens/s of the records after the
    first, peak GiB of the run."""
    if smoke:
        target, head = fspec.load_toy()
        b, s, k, name = 2, 32, 3, "toy_distill_head"
    else:
        target, head = fspec.load_default(dtype=torch.bfloat16, device=dev)
        b, s, k, name = 32, 512, 7, "smollm2_real_distill_head"
    log_every = max(steps // 6, 1)
    if steps < 2 * log_every:
        raise ValueError(f"--steps: expected at least 2 records' worth of steps, got {steps}")
    v = target.cfg.vocab_size
    tokens = torch.randint(0, v, (1 << 20,), generator=torch.Generator().manual_seed(0)).to(dev)
    case = {
        "name": name,
        "target_vocab": v,
        "draft_vocab": head.cfg.draft_vocab_size,
        "head_hidden": head.cfg.model.hidden_size,
        "ttt_steps": k,
        "batch": b,
        "seq_len": s,
        "steps": steps,
        "log_every": log_every,
        "autocast": dev.type == "cuda",
        "device": str(dev),
        "data": "random token stream through the target (online_batches)",
    }
    cfg = ttt.DistillConfig(
        ttt_steps=k,
        batch_size=b,
        seq_len=s,
        steps=steps,
        lr=2e-3,
        warmup_steps=min(10, steps - 1),
        log_every=log_every,
        autocast=True,
    )
    batches = D.online_batches(target, head, tokens, cfg=cfg)
    _fresh_peak(dev)
    try:
        _, hist = D.distill_head(head, batches, cfg=cfg, progress=False)
    except Exception as e:
        _fresh_peak(dev)
        return {"case": case, "error": _error(e)}
    _sync(dev)
    seconds, timed = 0.0, 0
    for prev, rec in zip(hist, hist[1:]):  # the records after the first (which holds the warm-up)
        n = rec["step"] - prev["step"]
        seconds, timed = seconds + n * b * s / rec["tokens_per_s"], timed + n
    peak = _peak_gib(dev)
    _fresh_peak(dev)
    return _row(
        case, [seconds / timed], [peak] if peak is not None else [], tokens=b * s, loss=hist[-1]["loss"]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/ttt_step.json")
    p.add_argument("--reps", type=int, default=10, help="timed train steps (after 3 warm-ups)")
    p.add_argument("--cases", nargs="+", default=["smollm2", "1b"], choices=["smollm2", "1b"])
    p.add_argument("--real-model", action="store_true", help="also distill_head on the real SmolLM2 target")
    p.add_argument("--steps", type=int, default=60, help="--real-model: distill_head steps")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    p.add_argument(
        "--chain",
        choices=["auto", "chunks"],
        default="auto",
        help="the chain attention's causal block: the library's choice (the flash kernel in half precision "
        "on CUDA) or the fp32 chunks (what main ran before the kernel), patched in this process only",
    )
    args = p.parse_args(argv)
    if args.chain == "chunks":
        from fspec.ops import dense_cache

        dense_cache.chain_attention = functools.partial(dense_cache.chain_attention, fused=False)
    if args.smoke:
        torch.set_num_threads(1)
        dev, cases, reps, steps = torch.device("cpu"), ["tiny"], 2, 4
    else:
        if not torch.cuda.is_available():
            print("bench_ttt_step.py needs a CUDA device (or --smoke); nothing to do here.")
            return 1
        dev, cases, reps, steps = torch.device("cuda"), args.cases, args.reps, args.steps
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    doc = results_io.header("bench_ttt_step.py", argv, name)
    doc.update(
        what="one TTT train_step through the draft loop's own step over a ChainKVCache",
        reps=reps,
        warmup=3,
        chain=args.chain,
        rows=[],
    )
    out = Path(args.out)
    began = time.perf_counter()
    jobs = [(c, lambda c=c: measure_step(c, dev, reps=reps)) for c in cases]
    if args.real_model or args.smoke:
        jobs.append(("distill", lambda: measure_distill(dev, steps=steps, smoke=args.smoke)))
    for label, job in jobs:
        t0 = time.perf_counter()
        try:
            row = job()
        except Exception as e:
            row = {"case": {"name": label}, "error": _error(e)}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        doc["rows"].append(row)
        results_io.write(out, doc)  # after every row: a partial result survives a time limit
        print(json.dumps(row), flush=True)
    doc["wall_s"] = round(time.perf_counter() - began, 1)
    results_io.write(out, doc)
    print(f"wrote {out} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
