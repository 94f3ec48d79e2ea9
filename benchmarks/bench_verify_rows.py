"""Which kernels a B = 1 speculative round should run its several-row layers on, on the real model: the round
cost of SmolLM2-135M-Instruct with its shipped head, compiled, greedy, one held-out prompt per call.

    python benchmarks/bench_verify_rows.py [--prompts 8] [--k 3 5] [--new-tokens 256] [--out FILE]

A round's verification forward runs K + 1 rows per request through the target, and its first draft step
K + 1 rows through the head. fspec runs one-row layers (decode, later draft steps) as the fused layer of
`fspec::skinny_linear` launches (`fspec.models.layers.use_fused_layer`) and several-row layers unfused: cuBLAS
products with the norms, SiLU * up and residual adds as separate kernels. On a 1B-shaped target the fused
layer for several rows lost (docs/experiments.md); at SmolLM2's width (576) every product is a few µs
whatever its kernel, so each launch saved may count more than the kernel's speed. Variants, each in a fresh
`fspec.Generator` after `torch._dynamo.reset()` (the choice is made when a round is traced):

* `unfused`: several-row layers unfused (cuBLAS), one-row layers fused (the library before 81a862b);
* `fused_tile`: the fused layer for up to 16 rows, several-row products on the tensor-core tile kernel (what
  the library now does for models at most `FUSED_ROWS_MAX_HIDDEN` wide);
* `fused_fma`: the same with the 2..8-row CUDA-core kernel (`_skinny_rows_kernel`);
* `rope_apart`: `fused_tile` with the several-row q/k/v product's RoPE and cache write as a launch of their
  own (`fspec::rope_pos_kv_write`; the library before the several-row `qkv_rope_write`);
* `rows_tile`: `fused_tile` with the several-row products on `_skinny_rows_tile_kernel` (the one-row
  kernel's one-tile product, the weight tile loaded once for all the rows; 16 columns, eight warps) where
  the tile fits, q/k/v with its RoPE epilogue too;
* `swept` (with --swept FILE, a `bench_skinny_linear.py --fusions --sweep` result): `fused_tile` with each
  swept product's fastest config at the swept row count (the tile or the CUDA-core rows kernel), the input
  norm's BLOCK_K cap lifted for them.

The variants are set by replacing `use_fused_layer` / `use_qkv_rope` / `default_config` in this process
only. Rows:
{"case": {"variant", "k"}, "spec_tok_s", "target_only_tok_s", "round_us", "tau", "same_tokens_as_unfused"};
tokens/s over --prompts held-out prompts (code, chat, health interleaved), one call each, after two warm-up
passes; round_us = wall time / target forwards of the speculative calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.kernels import qkv_rope_write as qrw  # noqa: E402
from fspec.kernels import skinny_linear as sk  # noqa: E402
from fspec.models import layers  # noqa: E402
from fspec.train import default_model  # noqa: E402
from fspec.train import prompts as P  # noqa: E402

ORIGINAL = (layers.use_fused_layer, sk.default_config, layers.use_qkv_rope, sk.NORM_MAX_BLOCK_K)


def fused_any_rows(p, x, cfg, *, cuda=None):
    """`use_fused_layer` for up to the skinny kernels' 16 rows whatever the model's width."""
    if not (x.is_cuda if cuda is None else cuda):
        return False
    if not 1 <= math.prod(x.shape[:-1]) <= layers.SKINNY_ROWS:
        return False
    one = x.reshape(-1, x.shape[-1])[:1]
    return ORIGINAL[0](p, one, cfg, cuda=cuda) and layers._skinny_inference(x, p["qkv"], cuda=cuda)


def one_row_only(p, x, cfg, *, cuda=None):
    """`use_fused_layer` for one row only (the library before several rows of narrow models were fused)."""
    return math.prod(x.shape[:-1]) == 1 and ORIGINAL[0](p, x, cfg, cuda=cuda)


def fma_rows_config(n, k, *, one_row=False):
    """`default_config` with 2..8 rows on `_skinny_rows_kernel`."""
    cfg = ORIGINAL[1](n, k, one_row=one_row)
    if one_row:
        return cfg
    return dataclasses.replace(cfg, fma=True, num_stages=1, block_n=16)


def one_row_qkv_rope(x, w, cfg, *, cuda=None):
    """`use_qkv_rope` for one row only (several rows: the product, then `rope_pos_kv_write`)."""
    return math.prod(x.shape[:-1]) == 1 and ORIGINAL[2](x, w, cfg, cuda=cuda)


def swept_configs(path: Path) -> dict[tuple[int, int], sk.SkinnyConfig]:
    """(N, K) of each weight -> the fastest config of a `bench_skinny_linear.py --fusions --sweep` result
    (several rows), as `default_config` must return it: a SiLU * up product's block_n doubled (the launcher
    halves it again for the gate and up rows)."""
    out = {}
    for row in json.loads(path.read_text())["rows"]:
        if row["M"] > 1 and "best_config" in row:
            cfg = sk.SkinnyConfig(**row["best_config"])
            if "silu" in row.get("fusion", ""):
                cfg = dataclasses.replace(cfg, block_n=2 * cfg.block_n)
            out[(row["N"], row["K"])] = cfg
    return out


def restore() -> None:
    """The library's own functions and cap back."""
    layers.use_fused_layer, sk.default_config, layers.use_qkv_rope, sk.NORM_MAX_BLOCK_K = ORIGINAL
    qrw.default_config, qrw.NORM_MAX_BLOCK_K = ORIGINAL[1], ORIGINAL[3]


ROWS_TILE = sk.SkinnyConfig(block_n=16, block_k=512, num_warps=8, num_stages=1, fma=True, one_tile=True)


def rows_tile_config(n, k, *, one_row=False):
    """`default_config` with several rows on `_skinny_rows_tile_kernel` where its tile fits (two tiles: a
    SiLU * up product's too), else the library's."""
    if one_row or not sk.rows_tile_fits(ROWS_TILE, k, silu_mul=True):
        return ORIGINAL[1](n, k, one_row=one_row)
    return ROWS_TILE


def set_variant(name: str, swept: dict | None = None) -> None:
    layers.use_fused_layer = one_row_only if name == "unfused" else fused_any_rows
    layers.use_qkv_rope = one_row_qkv_rope if name in ("unfused", "rope_apart") else ORIGINAL[2]
    config = {"fused_fma": fma_rows_config, "rows_tile": rows_tile_config}.get(name, ORIGINAL[1])
    cap = ORIGINAL[3]
    if name == "swept":
        table = dict(swept or {})

        def config(n, k, *, one_row=False):
            return ORIGINAL[1](n, k, one_row=True) if one_row else table.get((n, k)) or ORIGINAL[1](n, k)

        cap = 1 << 20
    sk.default_config = qrw.default_config = config
    sk.NORM_MAX_BLOCK_K = qrw.NORM_MAX_BLOCK_K = cap


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--variants", nargs="+", default=["unfused", "rope_apart", "fused_tile"])
    p.add_argument("--swept", type=Path, help="bench_skinny_linear --fusions --sweep output (swept)")
    p.add_argument("--out", default="benchmarks/results/verify_rows.json")
    args = p.parse_args(argv)
    target, head = default_model.load_default(dtype=torch.bfloat16, device="cuda")
    sets = [default_model.chat_ids(target, P.heldout(n), max_tokens=384) for n in P.HELDOUT]
    prompts = [row for group in zip(*sets) for row in group][: args.prompts]
    doc = results_io.header("bench_verify_rows.py", argv, torch.cuda.get_device_name())
    doc.update(
        model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), bf16, shipped head",
        prompt_tokens=[len(q) for q in prompts],
        new_tokens=args.new_tokens,
        rows=[],
    )
    baseline: dict[int, list] = {}

    def run_all(gen, draft, k):
        tokens, forwards, taus = [], 0, []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for q in prompts:
            res = gen.generate(
                target, draft, [q], max_new_tokens=args.new_tokens, num_speculative_steps=k, compile=True
            )
            tokens += res.tokens
            forwards += res.stats["target_forwards"]
            taus.append((res.stats["acceptance_length"], res.stats["rounds"]))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        tau = sum(a * r for a, r in taus) / max(sum(r for _, r in taus), 1)
        return tokens, wall, forwards, tau

    swept = swept_configs(args.swept) if args.swept else None
    if "swept" in args.variants and not swept:
        raise SystemExit("bench_verify_rows: the swept variant needs --swept FILE with several-row sweeps")
    doc["swept_configs"] = {f"{n}x{k}": vars(c) for (n, k), c in (swept or {}).items()}
    for variant in args.variants:
        set_variant(variant, swept)
        torch._dynamo.reset()
        gen = fspec.Generator(max_batch=1)
        t0 = time.perf_counter()
        for k in args.k:
            run_all(gen, head, k)
        run_all(gen, None, args.k[0])
        warm = time.perf_counter() - t0
        plain = [run_all(gen, None, args.k[0]) for _ in range(3)]
        plain_s = statistics.median(w for _, w, _, _ in plain)
        for k in args.k:
            reps = [run_all(gen, head, k) for _ in range(3)]
            tokens, _, forwards, tau = reps[-1]
            wall = statistics.median(w for _, w, _, _ in reps)
            n = sum(map(len, tokens))
            row = {
                "case": {"variant": variant, "k": k},
                "spec_tok_s": n / wall,
                "target_only_tok_s": sum(map(len, plain[-1][0])) / plain_s,
                "round_us": wall / forwards * 1e6,
                "target_only_step_us": plain_s / plain[-1][2] * 1e6,
                "tau": tau,
                "warmup_s": warm,
                "same_tokens_as_unfused": None if k not in baseline else tokens == baseline[k],
                "same_tokens_as_target_only": tokens == plain[-1][0],
            }
            baseline.setdefault(k, tokens)
            row["speedup"] = row["spec_tok_s"] / row["target_only_tok_s"]
            doc["rows"].append(row)
            results_io.write(Path(args.out), doc)
            print(
                f"{variant:11s} K={k}: spec {row['spec_tok_s']:7.1f} tok/s, target-only "
                f"{row['target_only_tok_s']:7.1f} (x{row['speedup']:.2f}), round {row['round_us']:6.0f} us, "
                f"step {row['target_only_step_us']:5.0f} us, tau {tau:.2f}, "
                f"same {row['same_tokens_as_unfused']}",
                flush=True,
            )
    restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
