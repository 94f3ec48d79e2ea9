"""Data-parallel scaling of `fspec.train.distill`: one process vs `torchrun --nproc_per_node=N`, same global
batch.

    python benchmarks/bench_distill_scaling.py [--out benchmarks/results/distill_scaling.json] [--gpus 2]
        [--steps 30] [--batch-size 16] [--seq-len 1024] [--equality-steps 8]
    python benchmarks/bench_distill_scaling.py --cpu-smoke     # tiny model, gloo, 2 CPU processes

Setup: a Llama-3.2-1B-shaped target with RANDOM weights (bf16, `benchmarks/bench_generate.llama_1b_config`)
and a fresh EAGLE-3 head at its shapes (hidden 2048, draft vocabulary 32000, layers (2, 8, 13)), trained
online (the target runs in the loop on each process's rows) on random token ids. Both runs are the command
line a user types, with the same flags:

    python -m fspec.train.distill train --target T --tokens ids.npy --kind eagle3 --draft-vocab-size 32000 ...
    python -m torch.distributed.run --standalone --nproc_per_node=N -m fspec.train.distill train ...

1. Throughput: bf16 autocast (`--autocast`), `--steps` steps of `--batch-size` sequences of `--seq-len`
   tokens (the global batch: each of N processes takes batch/N rows). tokens/s = global tokens of the logged
   intervals after the first (warm-up) / their wall time, from the runs' JSONL logs. scaling = tokens/s with
   N GPUs / tokens/s with one.
2. Equality: fp32 (no autocast, TF32 off), `--equality-steps` steps of `--equality-batch-size` sequences
   of `--equality-seq-len` tokens (fp32 activations need about twice the memory), 1 vs N processes; the
   saved fp32 master weights (train_state.pt) are compared tensor by tensor: max |a - b|, and the relative
   distance ||a - b|| / ||a - a0|| (a0: the initial weights), i.e. the disagreement as a fraction of how
   far training moved the weights. Data-parallel training is the same computation up to the order of
   floating-point sums (each process's gradient is a mean over its rows; the all-reduce averages them), so
   the distance is rounding, not a different trajectory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import llama_1b_config, tiny_config  # noqa: E402

import fspec  # noqa: E402
from fspec.models import llama  # noqa: E402

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/distill_scaling.json")
    p.add_argument("--gpus", type=int, default=2, help="processes of the data-parallel run")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--equality-steps", type=int, default=8)
    p.add_argument("--equality-batch-size", type=int, default=8, help="fp32 runs need more memory")
    p.add_argument("--equality-seq-len", type=int, default=512)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny float32 model, gloo on the CPU")
    p.add_argument("--workdir", default=None, help="default: a temporary directory")
    return p.parse_args(argv)


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "-"


def make_target(work: Path, smoke: bool) -> Path:
    cfg = tiny_config(4096) if smoke else llama_1b_config(8192)
    params = llama.init(cfg, seed=0, dtype=torch.float32 if smoke else torch.bfloat16)
    path = work / "target"
    fspec.save_target(fspec.Target(cfg=cfg, params=params), path)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=2_000_000 if not smoke else 50_000, dtype=np.int32)
    np.save(work / "ids.npy", ids)
    return path


def run_distill(
    work: Path, name: str, procs: int, args, *, steps: int, autocast: bool, smoke: bool, timed: bool
) -> dict:
    """One `fspec.train.distill train` run (torchrun when procs > 1); returns its records and wall time."""
    batch = args.batch_size if timed else args.equality_batch_size
    seq_len = args.seq_len if timed else args.equality_seq_len
    out, log = work / name, work / f"{name}.jsonl"
    flags = [
        "train", "--target", str(work / "target"), "--out", str(out), "--tokens", str(work / "ids.npy"),
        "--kind", "eagle3", "--draft-vocab-size", str(256 if smoke else 32000),
        "--seq-len", str(seq_len), "--batch-size", str(batch), "--steps", str(steps),
        "--ttt-steps", str(args.ttt_steps), "--log-every", str(args.log_every if timed else steps),
        "--log-jsonl", str(log), "--no-progress", "--seed", "0",
    ]  # fmt: skip
    if autocast:
        flags.append("--autocast")
    if smoke:
        flags += ["--device", "cpu"]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
        cmd += ["-m", "fspec.train.distill", *flags]
    else:
        cmd = [sys.executable, "-m", "fspec.train.distill", *flags]
    env = {**os.environ, **NCCL_ENV, "PYTHONUNBUFFERED": "1"}
    if procs == 1 and not smoke:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {"records": records, "wall_s": wall, "out": out, "command": " ".join(cmd[1:])}


def throughput(run: dict, args) -> dict:
    recs = run["records"]
    if len(recs) < 2:
        raise RuntimeError("need at least two logged intervals (raise --steps or lower --log-every)")
    first, last = recs[0], recs[-1]
    tokens = (last["step"] - first["step"]) * args.batch_size * args.seq_len
    secs = last["elapsed_s"] - first["elapsed_s"]
    return {
        "tokens_per_s": tokens / secs,
        "s_per_step": secs / (last["step"] - first["step"]),
        "measured_steps": last["step"] - first["step"],
        "wall_s": run["wall_s"],
        "final_loss": last["loss"],
        "command": run["command"],
    }


def compare(one: Path, many: Path) -> dict:
    a = torch.load(one / "train_state.pt", weights_only=True)["trainable"]
    b = torch.load(many / "train_state.pt", weights_only=True)["trainable"]
    la, spec = fspec.tree.tree_flatten(a)
    lb, spec_b = fspec.tree.tree_flatten(b)
    if spec != spec_b:
        raise RuntimeError("the two runs saved different parameter trees")
    rows, worst_abs, return_tensors = [], 0.0, {}
    for i, (x, y) in enumerate(zip(la, lb)):
        d = (x.double() - y.double()).abs()
        rows.append({"leaf": i, "shape": list(x.shape), "max_abs": float(d.max())})
        worst_abs = max(worst_abs, float(d.max()))
        return_tensors[i] = (x, y)
    return {"max_abs_diff": worst_abs, "leaves": rows, "_tensors": return_tensors}


def main(argv=None) -> int:
    args = parse_args(argv)
    smoke = args.cpu_smoke
    if smoke:
        args.seq_len, args.batch_size, args.steps, args.log_every = 32, 4, 6, 2
        args.equality_steps, args.ttt_steps = 3, 3
        args.equality_batch_size, args.equality_seq_len = 4, 32
    elif torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} CUDA devices")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fspec-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    make_target(work, smoke)
    print(f"target written in {time.perf_counter() - t0:.1f} s", flush=True)
    n = args.gpus
    result = {
        "benchmark": "distill_scaling",
        "date": datetime.date.today().isoformat(),
        "machine": "cpu (gloo)" if smoke else f"{n}x {torch.cuda.get_device_name(0)}",
        "command": "python " + " ".join(sys.argv),
        "gpus": n,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "setup": (
            "random-weight Llama-3.2-1B-shaped target (bf16), fresh EAGLE-3 head (draft vocab 32000), online "
            "distillation on random token ids"
            if not smoke
            else "tiny random target, float32, CPU smoke"
        ),
        "global_batch": args.batch_size,
        "seq_len": args.seq_len,
        "ttt_steps": args.ttt_steps,
        "steps": args.steps,
    }
    # 1. throughput
    kw = dict(steps=args.steps, autocast=not smoke, smoke=smoke, timed=True)
    one = throughput(run_distill(work, "tp1", 1, args, **kw), args)
    many = throughput(run_distill(work, f"tp{n}", n, args, **kw), args)
    result["throughput"] = {"1": one, str(n): many, "scaling": many["tokens_per_s"] / one["tokens_per_s"]}
    print(json.dumps(result["throughput"], indent=1), flush=True)
    # 2. equality (fp32); the initial weights a0 are rebuilt exactly as `fspec.train.distill train` does
    es = args.equality_steps
    kw = dict(steps=es, autocast=False, smoke=smoke, timed=False)
    e1 = run_distill(work, "eq1", 1, args, **kw)
    en = run_distill(work, f"eq{n}", n, args, **kw)
    init = init_weights(work, smoke)
    cmp = compare(e1["out"], en["out"])
    rel = moved_from(init, cmp)
    cmp.pop("_tensors")
    result["equality"] = {
        "steps": es,
        "global_batch": args.equality_batch_size,
        "seq_len": args.equality_seq_len,
        "dtype": "float32 (no autocast, TF32 off)",
        **rel,
        "max_abs_diff": cmp["max_abs_diff"],
        "loss_1": e1["records"][-1]["loss"],
        f"loss_{n}": en["records"][-1]["loss"],
    }
    print(json.dumps(result["equality"], indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", flush=True)
    return 0


def init_weights(work: Path, smoke: bool) -> list[torch.Tensor]:
    """The head's initial trainable weights, as `fspec.train.distill train` builds them (same seed,
    vocabulary)."""
    from fspec.train import distill as D
    from fspec.train.ttt import split_params

    target = fspec.load_target(work / "target", device="cpu")
    ids = torch.from_numpy(np.load(work / "ids.npy")).long()
    draft = D.new_draft(target, kind="eagle3", tokens=ids, draft_vocab_size=256 if smoke else 32000, seed=0)
    draft = dataclasses.replace(draft, params=fspec.tree.tree_map(lambda p: p.float(), draft.params))
    trainable, _ = split_params(draft.params, draft.shared)
    return fspec.tree.tree_flatten(trainable)[0]


def moved_from(init: list[torch.Tensor], cmp: dict) -> dict:
    """||a - b|| / ||a - a0|| over all trainable leaves."""
    num = den = 0.0
    for i, (x, y) in cmp["_tensors"].items():
        num += float(((x.double() - y.double()) ** 2).sum())
        den += float(((x.double() - init[i].double()) ** 2).sum())
    return {"relative_distance": (num**0.5) / max(den**0.5, 1e-30), "update_norm": den**0.5}


if __name__ == "__main__":
    raise SystemExit(main())
