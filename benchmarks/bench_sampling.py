"""Benchmark fspec's sampling and verification kernels against eager PyTorch and torch.multinomial (GPU only).

    python benchmarks/bench_sampling.py [--out benchmarks/results/sampling.json] [--batch 1 8 64 256]

For B in {1, 8, 64, 256} and V in {32000, 128256} (fp32 logits, temperature 0.8) it times, as medians over
many repetitions after warm-up (`triton.testing.do_bench`, and `do_bench_cudagraph` for the graph-captured
rows):
  * gumbel_sample: the fspec Triton op, its PyTorch reference in eager mode, and
    torch.multinomial(softmax(l / T)); three eager fspec figures: `fspec_us` the public function with
    its input validation (one device sync), `fspec_launch_us` the launch as fspec's code calls it
    (`fspec.kernels.dispatch.call`: no validation, no dispatcher; comparable with vLLM's kernel call, whose
    reported figures ride along on the `_into` rows), `fspec_op_us` the launch through torch.ops.fspec;
  * gumbel_sample_into (K = 5 columns): the op that also writes processed probabilities, vs its reference;
  * rejection_sample at K = 5 with sampled drafts: the Triton op vs its reference.
The floor is the bytes that must move (logits read once, plus the probabilities written by the `_into`
variant; target logits and draft probabilities read once for rejection sampling) divided by the copy
bandwidth measured here with a large device-to-device copy (bytes read + bytes written over time).
It prints a table and writes JSON: {"machine", "torch", "triton", "date", "command", "copy_bandwidth_TBps",
"rows": [{"case", "floor_us", "fspec_us", ...}]}.
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing
from results_io import copy_bandwidth_tbps

import fspec
from fspec.core.config import env_switches
from fspec.kernels import gumbel, rejection
from fspec.kernels import ops as kops

DEFAULT_OUT = Path(__file__).parent / "results" / "sampling.json"
K = 5  # draft tokens per request for the `_into` and rejection rows
TEMPERATURE = 0.8
# vLLM's Gumbel sampling kernel on this H200 host, an eager call writing processed logits (figures given in
# the sampling issue; vLLM is not installed here): {(V, B): µs}
VLLM_EAGER_US = {
    (128256, 1): 17.5, (128256, 8): 27.6, (128256, 64): 97.8, (128256, 256): 332.6,
    (32000, 1): 27.3, (32000, 8): 25.8, (32000, 64): 38.3, (32000, 256): 99.0,
}  # fmt: skip
DEVICE = "cuda"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256], help="batch sizes B")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes V")
    parser.add_argument("--rep", type=int, default=200, help="timing budget per measurement (ms)")
    parser.add_argument(
        "--blocks",
        type=int,
        nargs="*",
        default=[],
        help="also time fspec's kernels (graph replay) at these tokens per program (the launchers' block)",
    )
    return parser.parse_args(argv)


def block_sweep(blocks: list[int], vocab: list[int], batch: list[int], rep: int, bandwidth: float) -> list:
    """Graph-replay time of each fspec kernel launch per tokens-per-program value (the launchers' `block`;
    the ops launch at `gumbel.DEFAULT_BLOCK`); floor as in the main table."""
    out = []
    for block in blocks:
        for v in vocab:
            for b in batch:
                for row in [*bench_gumbel(b, v, rep, bandwidth, baselines=False, block=block),
                            bench_rejection(b, v, rep, bandwidth, baselines=False, block=block)]:  # fmt: skip
                    us, floor = row["fspec_graph_us"], row["floor_us"]
                    entry = {"op": row["case"]["op"], "B": b, "V": v, "block": block}
                    out.append(
                        {**entry, "fspec_graph_us": us, "floor_us": floor, "fspec_over_floor": us / floor}
                    )
                torch.cuda.empty_cache()
    return out


def _time_us(fn, rep: int, graph: bool = False) -> float:
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, rep=rep, return_mode="median")


def _agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The GPU path's approximate logs may flip a near-tie (keys within ~8e-7): at most 1 row in 100."""
    bad, n = int((got != want).sum()), got.shape[0]
    assert bad <= max(1, n // 100), f"{what}: {bad} of {n} rows differ from the reference"


def bench_gumbel(
    b: int, v: int, rep: int, bandwidth: float, baselines: bool = True, block: int | None = None
) -> list[dict]:
    """The gumbel rows; with `block`, the launcher at that many tokens per program instead of the op."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(b, v, device=DEVICE, generator=gen) * 3
    temperature = torch.full((b,), TEMPERATURE, device=DEVICE)
    seed, positions = torch.arange(b, device=DEVICE), torch.arange(b, device=DEVICE) + 100
    out_tokens = torch.zeros(b, K, dtype=torch.int64, device=DEVICE)
    out_probs = torch.zeros(b, K, v, device=DEVICE)
    col = torch.tensor(2, device=DEVICE)
    op, op_into = torch.ops.fspec.gumbel_sample, torch.ops.fspec.gumbel_sample_into
    logit_bytes = b * v * 4
    sample = lambda: op(logits, temperature, seed, positions, 0)
    sample_into = lambda: op_into(logits, temperature, seed, positions, 0, out_tokens, out_probs, col)
    if block is not None:
        next_col = torch.empty_like(col)
        sample = lambda: gumbel.gumbel_sample(logits, temperature, seed, positions, salt=0, block=block)
        sample_into = lambda: gumbel.gumbel_sample(
            logits, temperature, seed, positions, salt=0, out_tokens=out_tokens, out_probs=out_probs, col=col,
            block=block, next_col=next_col,
        )  # fmt: skip
    eager = {  # (public function with its validation, the launch alone as fspec's code calls it)
        "gumbel_sample": (
            lambda: fspec.gumbel_sample(logits, temperature, seed, positions, salt=0),
            lambda: kops.gumbel_sample(logits, temperature, seed, positions, 0),
        ),
        "gumbel_sample_into": (
            lambda: fspec.gumbel_sample(
                logits,
                temperature,
                seed,
                positions,
                salt=0,
                out_tokens=out_tokens,
                out_probs=out_probs,
                col=col,
            ),
            lambda: kops.gumbel_sample_into(
                logits, temperature, seed, positions, 0, out_tokens, out_probs, col
            ),
        ),
    }
    ref = lambda: gumbel.gumbel_sample_ref(logits, temperature, seed, positions)
    ref_into = lambda: gumbel.gumbel_sample_ref(
        logits, temperature, seed, positions, out_tokens=out_tokens, out_probs=out_probs, col=col
    )
    multinomial = lambda: torch.multinomial(torch.softmax(logits / TEMPERATURE, dim=-1), 1)
    # gpt-fast's sync-free "exponential race": argmax(p / Exp(1)) samples from p.
    race = lambda: torch.argmax(
        torch.softmax(logits / TEMPERATURE, dim=-1) / torch.empty(b, v, device=DEVICE).exponential_(1), dim=-1
    )
    _agree(sample(), ref(), "gumbel_sample")
    rows = []
    for name, fn, fn_ref, nbytes in [
        ("gumbel_sample", sample, ref, logit_bytes),
        ("gumbel_sample_into", sample_into, ref_into, 2 * logit_bytes),  # + probs written
    ]:
        row = {"case": {"op": name, "B": b, "V": v, "K": K if "into" in name else None}}
        row["floor_us"] = nbytes / (bandwidth * 1e12) * 1e6
        row["fspec_graph_us"] = _time_us(fn, rep, graph=True)
        if not baselines:
            rows.append(row)
            continue
        row["fspec_us"] = _time_us(eager[name][0], rep)
        row["fspec_launch_us"] = _time_us(eager[name][1], rep)
        row["fspec_op_us"] = _time_us(fn, rep)
        row["ref_eager_us"] = _time_us(fn_ref, rep)
        if name == "gumbel_sample_into" and (v, b) in VLLM_EAGER_US:
            row["vllm_reported_eager_us"] = VLLM_EAGER_US[v, b]
        if name == "gumbel_sample":
            row["torch_multinomial_us"] = _time_us(multinomial, rep)
            row["torch_multinomial_graph_us"] = _time_us(multinomial, rep, graph=True)
            row["exponential_race_us"] = _time_us(race, rep)
            row["exponential_race_graph_us"] = _time_us(race, rep, graph=True)
        rows.append(row)
    return rows


def bench_rejection(
    b: int, v: int, rep: int, bandwidth: float, baselines: bool = True, block: int | None = None
) -> dict:
    """The rejection row; with `block`, the launcher at that many tokens per program instead of the op."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    target = torch.randn(b, K + 1, v, device=DEVICE, generator=gen) * 3
    temperature = torch.full((b,), TEMPERATURE, device=DEVICE)
    seed, positions = torch.arange(b, device=DEVICE), torch.arange(b, device=DEVICE) + 100
    draft_logits = target[:, :K] + torch.randn(b, K, v, device=DEVICE, generator=gen)
    drafts = torch.zeros(b, K, dtype=torch.int64, device=DEVICE)
    q = torch.zeros(b, K, v, device=DEVICE)
    for i in range(K):
        col = torch.tensor(i, device=DEVICE)
        gumbel.gumbel_sample(
            draft_logits[:, i], temperature, seed, positions + i, out_tokens=drafts, out_probs=q, col=col
        )
    op = lambda: torch.ops.fspec.rejection_sample(target, drafts, q, temperature, seed, positions)
    if block is not None:
        op = lambda: rejection.rejection_sample(target, drafts, q, temperature, seed, positions, block=block)
    ref = lambda: rejection.rejection_sample_ref(target, drafts, q, temperature, seed, positions)
    got, want = op(), ref()
    _agree(got[0].flatten(), want[0].flatten(), "rejection_sample tokens")
    nbytes = target.numel() * 4 + q.numel() * 4  # target logits and draft probabilities read once
    row = {
        "case": {"op": "rejection_sample", "B": b, "V": v, "K": K},
        "floor_us": nbytes / (bandwidth * 1e12) * 1e6,
        "fspec_graph_us": _time_us(op, rep, graph=True),
        "mean_accepted": float(got[1].float().mean()),
    }
    if baselines:
        public = lambda: fspec.rejection_sample(target, drafts, q, temperature, seed, positions)
        launch = lambda: kops.rejection_sample(target, drafts, q, temperature, seed, positions)
        row.update(
            fspec_us=_time_us(public, rep),
            fspec_launch_us=_time_us(launch, rep),
            fspec_op_us=_time_us(op, rep),
            ref_eager_us=_time_us(ref, rep),
        )
    return row


def add_ratios(row: dict) -> dict:
    """Ratios against the graph-replayed fspec time: what counts across machines (absolute times drift)."""
    fspec = row["fspec_graph_us"]
    row["fspec_over_floor"] = round(fspec / row["floor_us"], 3)
    row["ref_over_fspec"] = round(row["ref_eager_us"] / fspec, 3)
    if "torch_multinomial_us" in row:
        row["multinomial_over_fspec"] = round(row["torch_multinomial_us"] / fspec, 3)
    return row


def print_table(rows: list[dict]) -> None:
    head = f"{'op':<20}{'B':>5}{'V':>8}{'floor':>9}{'fspec':>9}{'graph':>9}{'ref':>10}{'multin.':>10}"
    print(head + f"{'fspec/floor':>13}{'ref/fspec':>11}")
    for r in rows:
        c = r["case"]
        multinomial = f"{r['torch_multinomial_us']:>10.1f}" if "torch_multinomial_us" in r else f"{'-':>10}"
        print(
            f"{c['op']:<20}{c['B']:>5}{c['V']:>8}{r['floor_us']:>9.1f}{r['fspec_us']:>9.1f}"
            f"{r['fspec_graph_us']:>9.1f}{r['ref_eager_us']:>10.1f}{multinomial}"
            f"{r['fspec_over_floor']:>13.2f}{r['ref_over_fspec']:>11.2f}"
        )
    print("times in us (medians); graph = fspec op replayed from a CUDA graph; ratios use the graph time")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampling: needs a CUDA device (none found); nothing measured", file=sys.stderr)
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("bench_sampling: unset TRITON_INTERPRET to time the compiled kernels", file=sys.stderr)
        return 1
    bandwidth = copy_bandwidth_tbps(DEVICE)
    rows = []
    for v in args.vocab:
        for b in args.batch:
            rows += bench_gumbel(b, v, args.rep, bandwidth)
            rows.append(bench_rejection(b, v, args.rep, bandwidth))
            torch.cuda.empty_cache()
    rows = [add_ratios(r) for r in rows]
    sweep = block_sweep(args.blocks, args.vocab, args.batch, args.rep, bandwidth)
    print(f"copy bandwidth {bandwidth:.2f} TB/s on {torch.cuda.get_device_name()}")
    print_table(rows)
    for r in sweep:
        print(f"block {r['block']:>6} {r['op']:<20}{r['B']:>5}{r['V']:>8} graph {r['fspec_graph_us']:8.1f} us"
              f"  {r['fspec_over_floor']:.2f}x floor")  # fmt: skip
    result = {
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "env": env_switches(),
        "copy_bandwidth_TBps": round(bandwidth, 3),
        "rows": rows,
        "block_sweep": sweep,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
