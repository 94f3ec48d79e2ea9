"""fspec::skinny_linear against cuBLAS (F.linear) on the projections of a decode step, and the floor.

    python benchmarks/bench_skinny_linear.py [--sweep] [--rows 1 6 8 16] [--shapes large|smollm2] [--out PATH]
    python benchmarks/bench_skinny_linear.py --fusions --rows 1 6 [--sweep]  # the fused layer's four calls
    python benchmarks/bench_skinny_linear.py --dependent ...  # each call after a kernel it depends on
    python benchmarks/bench_skinny_linear.py --cpu-smoke      # tiny shapes through the Triton interpreter

Shapes (bf16, nn.Linear layout w [N, K]): the fused q/k/v, o, gate/up and down projections of a
Llama-3.2-1B-shaped target and of an EAGLE-3 head at Llama-3.1-8B shapes (its q/k/v reads 2 x 4096 inputs);
`--shapes smollm2`: SmolLM2-135M's four products instead (576 wide), where a B = 1 round's verification of
K + 1 = 6 rows cost 7.4 µs a product against 4.0 µs for one row (BENCHMARKS.md, "Where the B = 1 round goes
on the H100"), and the sweep adds shallow tiles, one- and two-stage pipelines and two warps.
Each time is a CUDA-graph replay of calls that cycle through enough copies of the weight to exceed the L2
cache (~50 MB on the H200), so every call reads its weight from HBM as in a real decode step; floor = (weight
+ x + y bytes) / measured copy bandwidth. --sweep also times a grid of launch configs at every shape.
--fusions times, at each --rows M, the calls of fspec.models.layers.fused_decoder_layer (q/k/v with the input
norm, o with the residual, gate/up with the post norm and SiLU * up, down with the residual) against the same
product without its fusions (skinny and cuBLAS): what a fusion costs inside the GEMV, to set against the ~1.5
µs launch plus gap of the unfused op it replaces; with --sweep, each fused call under every config of the grid
(for 2-8 rows the CUDA-core rows kernel's too): what a several-row default should be. Without --dependent the
graph holds consecutive calls of one kernel, which PDL lets overlap (a call's ramp-up under the previous
call's tail; cuBLAS's launches do not overlap), so fspec's times are optimistic against a decode step's;
--dependent runs a small kernel that rewrites x ahead of every call and subtracts its own time, so each call
starts after a kernel it depends on.
"""

from __future__ import annotations

import sys

if "--cpu-smoke" in sys.argv:  # before triton is imported: the kernel is built by the interpreter
    import os

    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402

import results_io as RIO  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from fspec.kernels.skinny_linear import (  # noqa: E402
    FMA_MAX_ROWS,
    GEMV_ELEMS_PER_THREAD,
    NORM_MAX_BLOCK_K,
    SkinnyConfig,
    default_config,
    gemv_block_k,
    rows_block_k,
    rows_tile_fits,
    skinny_linear,
)

SHAPES = {  # name: (N, K)
    "1B q/k/v": (3072, 2048),
    "1B o": (2048, 2048),
    "1B gate/up": (16384, 2048),
    "1B down": (2048, 8192),
    "8B head q/k/v": (6144, 8192),
    "8B head o": (4096, 4096),
    "8B head gate/up": (28672, 4096),
    "8B head down": (4096, 14336),
    "1B head LM head": (32000, 2048),  # an EAGLE-3 head's draft vocabulary (one-row products route here only
}  # up to SKINNY_ROW_MAX_OUT outputs)
SMOLLM2_SHAPES = {
    "SmolLM2 q/k/v": (960, 576),
    "SmolLM2 o": (576, 576),
    "SmolLM2 gate/up": (3072, 576),
    "SmolLM2 down": (576, 1536),
}
SMOKE_SHAPES = {"tiny a": (48, 64), "tiny b": (20, 100)}
FUSIONS = {  # shape: fusions of fused_decoder_layer's call on it
    "1B q/k/v": "norm",  # each call also timed with the tensor-core tile kernel (`fused_tile_us`)
    "1B o": "residual",
    "1B gate/up": "norm+silu",
    "1B down": "residual",
    "8B head o": "residual",
    "8B head gate/up": "norm+silu",
    "8B head down": "residual",
}
SMOLLM2_FUSIONS = {
    "SmolLM2 q/k/v": "norm",
    "SmolLM2 o": "residual",
    "SmolLM2 gate/up": "norm+silu",
    "SmolLM2 down": "residual",
}
SMOKE_FUSIONS = {"tiny a": "norm+silu", "tiny b": "residual"}
L2_BYTES = 64 << 20  # weights cycled per timed call sequence exceed this (the H200's L2 is ~50 MB)


def sweep_configs(
    rows: int, k: int | None = None, *, small: bool = False, silu: bool = False
) -> list[SkinnyConfig]:
    """The tile kernel's grid, and for one row the CUDA-core kernel's (`fma`) and, where a reduction of
    depth k fits in one tile (`gemv_block_k`), the one-tile kernel's (`one_tile`), and both with the
    reduction split over 2-8 programs per column block (`split_k`). `small` (a narrow model: few column
    blocks, a shallow reduction): the tile grid spans 64- to 1024-deep tiles, 1 to 4 stages, 2 to 8 warps.
    Several rows also get the CUDA-core kernels: the rows tile kernel (`fma` + `one_tile`, 16 or 32 columns,
    4-16 warps) where its tile of depth k fits (`rows_tile_fits`, two tiles with `silu`), and for 2..8 rows
    the rows kernel."""
    if small:
        tiles = [
            SkinnyConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
            for bn in (16, 32)
            for bk in (64, 128, 256, 512, 1024)
            for w, st in ((2, 1), (4, 1), (4, 2), (4, 3), (4, 4), (8, 1), (8, 3))
        ]
    else:
        tiles = [
            SkinnyConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
            for bn in (16, 32, 64)
            for bk in (128, 256, 512)
            for w, st in ((4, 3), (4, 4), (8, 3))
        ]
    gemv = [
        SkinnyConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=1, fma=True)
        for bn in (16, 32, 64)
        for bk in (128, 256, 512, 1024)  # 1024: twice the bytes in flight per program (16 x 1024, 8 warps)
        for w in (4, 8)
        if bn * bk <= GEMV_ELEMS_PER_THREAD * 32 * w  # the launcher would shrink BLOCK_K to this anyway
    ]
    one_tile = [
        SkinnyConfig(block_n=16, block_k=512, num_warps=w, num_stages=1, fma=True, one_tile=True)
        for w in (8, 16)
    ]
    split = [  # the reduction cut over 2-8 programs per column block: a loop per split, or one tile
        SkinnyConfig(block_n=16, block_k=bk, num_warps=w, num_stages=1, fma=True, split_k=s)
        for s in (2, 4, 8)
        for bk, w in ((256, 4), (512, 8))
    ]
    split += [
        SkinnyConfig(block_n=16, block_k=512, num_warps=8, num_stages=1, fma=True, one_tile=True, split_k=s)
        for s in (2, 4, 8)
    ]
    one_tile += [c for c in split if c.one_tile]
    one_tile = [c for c in one_tile if k is not None and gemv_block_k(c, k)[1]]
    rows_tile = [
        SkinnyConfig(block_n=bn, block_k=512, num_warps=w, num_stages=1, fma=True, one_tile=True)
        for bn in (16, 32)
        for w in (4, 8, 16)
    ]
    if rows >= 2 and k is not None:
        tiles = tiles + [c for c in rows_tile if rows_tile_fits(c, k, silu_mul=silu)]
    if 2 <= rows <= FMA_MAX_ROWS:  # the CUDA-core rows kernel, each distinct effective BLOCK_K once
        seen, fma_rows = set(), []
        for bn in (16, 32):
            for w in (2, 4, 8):
                for bk in (64, 128, 256):
                    cfg = SkinnyConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=1, fma=True)
                    key = (bn, w, rows_block_k(cfg, rows, k or bk))
                    if key not in seen:
                        seen.add(key)
                        fma_rows.append(cfg)
        return tiles + fma_rows
    return tiles + (gemv + [c for c in split if not c.one_tile] + one_tile if rows == 1 else [])


def tile_config(n: int, k: int, kw: dict) -> SkinnyConfig:
    """The tensor-core tile kernel's default launch (as `skinny_linear` adjusts it for its fusions)."""
    cfg = default_config(n, k)
    if kw.get("silu_mul"):
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    if "norm_weight" in kw:
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, NORM_MAX_BLOCK_K))
    return cfg


_ALONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # `before` -> its own time per call, µs


def _before(x: torch.Tensor, dependent: bool):
    """With --dependent, the kernel every timed call waits for: x rewritten in place (x * 1)."""
    return (lambda: x.mul_(1.0)) if dependent else None


def time_per_call_us(call, weights: list[torch.Tensor], smoke: bool, before=None) -> float:
    """Median time of one call, each call on the next weight copy (graph replay on CUDA). `before` (with
    --dependent: a small kernel that rewrites x) runs ahead of every call and its own time, measured alone,
    is subtracted: the call then starts after a kernel it depends on, as in a decode step, instead of
    overlapping the previous call of itself (fspec's kernels launch with PDL, cuBLAS's do not)."""

    def run():
        for w in weights:
            if before is not None:
                before()
            call(w)

    if smoke:
        run()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            samples.append((time.perf_counter() - start) / len(weights) * 1e6)
        us = statistics.median(samples)
    else:
        us = 1e3 * triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median") / len(weights)
    if before is None:
        return us
    if before not in _ALONE:  # once per dependency (per shape and row count)
        _ALONE[before] = time_per_call_us(lambda w: before(), weights, smoke)
    return us - _ALONE[before]


def fusion_rows(
    smoke: bool,
    bandwidth: float | None,
    gen: torch.Generator,
    dependent: bool,
    *,
    shapes: str = "large",
    row_counts: tuple[int, ...] = (1,),
    sweep: bool = False,
    only: tuple[str, ...] = (),
    on_row=None,
) -> list[dict]:
    """Each fused call of the decode layer at each row count M (the model's layer at M rows: 1 for a decode
    step, K + 1 for a batch-1 verification) against the plain product on the same weight; with `sweep`, also
    the grid of `sweep_configs` for the fused call. `only`: the shapes whose names contain one of these words
    (all when empty); `on_row(rows)` after each row (the results so far written out)."""
    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    table = SMOKE_SHAPES if smoke else SMOLLM2_SHAPES if shapes == "smollm2" else SHAPES
    fusions = SMOKE_FUSIONS if smoke else SMOLLM2_FUSIONS if shapes == "smollm2" else FUSIONS
    rows = []
    for name, fusion in fusions.items():
        if only and not any(word in name for word in only):
            continue
        n, k = table[name]
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = 1 if smoke else max(2, -(-2 * L2_BYTES // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k**-0.5 for _ in range(copies)]
        out = n // 2 if "silu" in fusion else n
        norm = torch.rand(k, device=dev, generator=gen).to(dtype) + 0.5
        for m in row_counts:
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            timed = functools.partial(
                time_per_call_us, weights=weights, smoke=smoke, before=_before(x, dependent)
            )
            kw = {"silu_mul": "silu" in fusion}
            if "norm" in fusion:
                kw.update(norm_weight=norm, eps=1e-5)
            if "residual" in fusion:
                kw.update(residual=torch.randn(m, out, device=dev, dtype=dtype, generator=gen))
            row = {
                "shape": name,
                "fusion": fusion,
                "N": n,
                "K": k,
                "M": m,
                "weight_copies": copies,
                "fused_us": timed(lambda w, x=x, kw=kw: skinny_linear(x, w, **kw)),
                "fused_tile_us": timed(
                    lambda w, x=x, kw=kw, c=tile_config(n, k, kw): skinny_linear(x, w, config=c, **kw)
                ),
                "skinny_us": timed(lambda w, x=x: skinny_linear(x, w)),
                "cublas_us": timed(lambda w, x=x: F.linear(x, w)),
            }
            if bandwidth:
                floor = (n * k + m * k + m * out) * torch.finfo(dtype).bits / 8 / (bandwidth * 1e12) * 1e6
                row["floor_us"] = floor
                row["fused_over_floor"] = row["fused_us"] / floor
            if sweep and not smoke:
                row.update(_sweep(timed, x, kw, m, k, small=shapes == "smollm2", smoke=smoke))
            rows.append(row)
            print(
                f"{name:>16} {fusion:>10} M={m:>2}: fused {row['fused_us']:8.2f} us"
                f" (tensor-core tile {row['fused_tile_us']:.2f}),"
                f" plain skinny {row['skinny_us']:8.2f},"
                f" cuBLAS {row['cublas_us']:8.2f}"
                + (f", floor {row['floor_us']:.2f} us" if bandwidth else "")
                + (f", best {row['best_us']:.2f} us {row['best_config']}" if "best_us" in row else ""),
                flush=True,
            )
            if on_row is not None:
                on_row(rows)
        del weights
    return rows


def _sweep(timed, x: torch.Tensor, kw: dict, m: int, k: int, *, small: bool, smoke: bool) -> dict:
    """The call on x (with the fusions kw) timed under each config of `sweep_configs`: the list, and the
    fastest config and time."""
    results = []
    for cfg in sweep_configs(m, k, small=small, silu=bool(kw.get("silu_mul"))):
        try:
            us = timed(lambda w, c=cfg, x=x: skinny_linear(x, w, config=c, **kw))
        except Exception as e:  # a config that does not compile (shared memory) is skipped
            results.append({"config": vars(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        results.append({"config": vars(cfg), "us": us})
    ok = [t for t in results if "us" in t]
    out: dict = {"sweep": results}
    if ok:
        best = min(ok, key=lambda t: t["us"])
        out.update(best_config=best["config"], best_us=best["us"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6, 8, 16], help="rows M of x")
    p.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    p.add_argument("--shapes", choices=("large", "smollm2"), default="large", help="which models' products")
    p.add_argument("--fusions", action="store_true", help="only the fused layer's calls (at each --rows)")
    p.add_argument("--only", nargs="+", default=[], help="(--fusions) shapes whose names contain a word")
    p.add_argument(
        "--dependent",
        action="store_true",
        help="each call after a small kernel rewriting x, whose own time is subtracted (as in a decode step)",
    )
    p.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes, Triton interpreter, no timing claims"
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/skinny_linear.json"))
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_skinny_linear: needs a CUDA device (or --cpu-smoke)")
    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    bandwidth = None if smoke else RIO.copy_bandwidth_tbps()
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def save(rows: list[dict]) -> None:
        doc = {
            **RIO.header(
                "bench_skinny_linear.py",
                argv,
                "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name(),
            ),
            "copy_bandwidth_TBps": bandwidth,
            "dependent": args.dependent,
            "shapes": args.shapes,
            "dtype": str(dtype).removeprefix("torch."),
            "rows": rows,
        }
        RIO.write(args.out, doc)

    if args.fusions:
        rows = fusion_rows(
            smoke, bandwidth, gen, args.dependent, shapes=args.shapes, row_counts=tuple(args.rows),
            sweep=args.sweep, only=tuple(args.only), on_row=save,
        )  # fmt: skip
    shapes = SMOKE_SHAPES if smoke else SMOLLM2_SHAPES if args.shapes == "smollm2" else SHAPES
    for name, (n, k) in {} if args.fusions else shapes.items():
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = 1 if smoke else max(2, -(-2 * L2_BYTES // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k**-0.5 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            timed = functools.partial(
                time_per_call_us, weights=weights, smoke=smoke, before=_before(x, args.dependent)
            )
            err = (skinny_linear(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max().item()
            row = {
                "shape": name,
                "N": n,
                "K": k,
                "M": m,
                "weight_copies": copies,
                "max_abs_diff_vs_cublas": err,
                "cublas_us": timed(lambda w, x=x: F.linear(x, w)),
                "default_config": vars(default_config(n, k, one_row=m == 1)),
                "skinny_us": timed(lambda w, x=x: skinny_linear(x, w)),
            }
            if bandwidth:
                floor = (n * k + m * k + m * n) * torch.finfo(dtype).bits / 8 / (bandwidth * 1e12) * 1e6
                row.update(floor_us=floor, cublas_over_floor=row["cublas_us"] / floor)
                row["skinny_over_floor"] = row["skinny_us"] / floor
            if args.sweep and not smoke:
                row.update(_sweep(timed, x, {}, m, k, small=args.shapes == "smollm2", smoke=smoke))
                if bandwidth and "best_us" in row:
                    row["best_over_floor"] = row["best_us"] / row["floor_us"]
            rows.append(row)
            print(
                f"{name:>16} M={m:>2}: cuBLAS {row['cublas_us']:8.2f} us, skinny {row['skinny_us']:8.2f} us"
                + (f", floor {row['floor_us']:.2f} us" if bandwidth else "")
                + (f", best {row['best_us']:.2f} us {row['best_config']}" if "best_us" in row else ""),
                flush=True,
            )
        del weights
    save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
