"""CUDA-graph replay time of the sampling tail with and without top_k / top_p / min_p (GPU only).

    python benchmarks/bench_sampling_tail.py [--out benchmarks/results/sampling_tail.json]

For gumbel_sample at N in {1, 8, 32} rows and rejection_sample at B in {1, 8, 32} requests (K = 5 sampled
drafts), V = 49152 (SmolLM2), fp32 and bf16 logits, temperature 0.8, it times one replay of a CUDA graph of
the op (`triton.testing.do_bench_cudagraph`, median) in three variants:
  * `none`: no options (today's launches),
  * `off`: the options as tensors, all off (top_k 0, top_p 1, min_p 0): the filter launch exits at once,
  * `active`: top_k 50, top_p 0.9, min_p 0.05 in every row,
and the filter launch alone with the active options (`filter_us`). It prints a table and writes JSON:
{header..., "rows": [{"op", "N", "V", "dtype", "none_us", "off_us", "active_us", "filter_us"}]}.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton.testing
from results_io import header, write

from fspec.kernels import ops as kops
from fspec.kernels.salts import SALT_DRAFT

DEFAULT_OUT = Path(__file__).parent / "results" / "sampling_tail.json"
V, K, TEMPERATURE = 49152, 5, 0.8
ACTIVE = (50, 0.9, 0.05)  # top_k, top_p, min_p
OFF = (0, 1.0, 0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32], help="rows N / requests B")
    parser.add_argument("--rep", type=int, default=40, help="timing budget per measurement (ms)")
    return parser.parse_args(argv)


def options(n: int, values: tuple[int, float, float], dev: torch.device) -> tuple[torch.Tensor, ...]:
    top_k, top_p, min_p = values
    return (
        torch.full((n,), top_k, dtype=torch.int32, device=dev),
        torch.full((n,), top_p, device=dev),
        torch.full((n,), min_p, device=dev),
    )


def graph_us(fn, rep: int) -> float:
    """Median µs of one replay of a CUDA graph of `fn` (captured after a warm-up call compiles it)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


def bench_gumbel(n: int, dtype: torch.dtype, rep: int, dev: torch.device) -> dict:
    gen = torch.Generator(device=dev).manual_seed(n)
    logits = (torch.randn(n, V, device=dev, generator=gen) * 3).to(dtype)
    temperature = torch.full((n,), TEMPERATURE, device=dev)
    seed, positions = torch.arange(n, device=dev) * 7 + 1, torch.arange(n, device=dev) + 100
    base = (logits, temperature, seed, positions, SALT_DRAFT)
    active, off = options(n, ACTIVE, dev), options(n, OFF, dev)
    return {
        "op": "gumbel_sample",
        "none_us": graph_us(lambda: kops.gumbel_sample(*base), rep),
        "off_us": graph_us(lambda: kops.gumbel_sample(*base, *off), rep),
        "active_us": graph_us(lambda: kops.gumbel_sample(*base, *active), rep),
        "filter_us": graph_us(lambda: kops.sampling_filter(logits, temperature, *active), rep),
    }


def bench_rejection(b: int, dtype: torch.dtype, rep: int, dev: torch.device) -> dict:
    gen = torch.Generator(device=dev).manual_seed(b)
    target = (torch.randn(b, K + 1, V, device=dev, generator=gen) * 3).to(dtype)
    q = torch.softmax(torch.randn(b, K, V, device=dev, generator=gen) * 3, dim=-1)
    drafts = target[:, :K].float().argmax(-1)  # likely accepted: every slot's statistics are read
    temperature = torch.full((b,), TEMPERATURE, device=dev)
    seed, positions = torch.arange(b, device=dev) * 7 + 1, torch.arange(b, device=dev) + 100
    base = (target, drafts, q, temperature, seed, positions)
    active, off = options(b, ACTIVE, dev), options(b, OFF, dev)
    return {
        "op": "rejection_sample",
        "none_us": graph_us(lambda: kops.rejection_sample(*base), rep),
        "off_us": graph_us(lambda: kops.rejection_sample(*base, *off), rep),
        "active_us": graph_us(lambda: kops.rejection_sample(*base, *active), rep),
        "filter_us": graph_us(lambda: kops.sampling_filter(target, temperature, *active, K + 1), rep),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_sampling_tail.py needs a CUDA device")
    dev = torch.device("cuda")
    rows = []
    print(f"{'op':<17} {'N/B':>4} {'dtype':<9} {'none':>8} {'off':>8} {'active':>8} {'filter':>8}  (µs)")
    for dtype in (torch.float32, torch.bfloat16):
        for size in args.sizes:
            for bench in (bench_gumbel, bench_rejection):
                row = {
                    "N": size,
                    "V": V,
                    "dtype": str(dtype).removeprefix("torch."),
                    **bench(size, dtype, args.rep, dev),
                }
                rows.append(row)
                times = " ".join(
                    f"{row[key]:>8.1f}" for key in ("none_us", "off_us", "active_us", "filter_us")
                )
                print(f"{row['op']:<17} {size:>4} {row['dtype']:<9} {times}")
    doc = {**header("bench_sampling_tail.py", argv, torch.cuda.get_device_name()), "K": K, "rows": rows}
    doc["options_active"] = dict(zip(("top_k", "top_p", "min_p"), ACTIVE))
    write(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
