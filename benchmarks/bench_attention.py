"""Paged decode attention on the H200: fspec's Triton kernel vs the bandwidth floor, FlexAttention and SDPA.

    python benchmarks/bench_attention.py --sweep --check          # the full table (~5-8 min on an H200)
    python benchmarks/bench_attention.py --quick                  # a 3-row subset

Shapes: 32 query / 8 KV heads, head dim 128, bf16, block_size 16, random non-contiguous block tables, every
request holding `ctx` tokens; decode (num_query = 1) at B in {1, 8, 64, 256} x ctx in {1k, 4k, 16k}, plus
num_query = 4 (the first draft step / verification with K = 3) at B in {8, 64}, ctx 4k.

Columns (medians over --reps timed calls after warm-up, CUDA events, L2 flushed before every call):
  floor_us        bytes that must move (K/V of every context token, q, out) / measured copy bandwidth
  fspec_us        kernels/paged_attention.py with its default (heuristic) config, launched eagerly
  fspec_graph_us  the same call captured once in a CUDA graph and replayed (how the draft loop runs it)
  fspec_best_us   --sweep: the best of a few launch configs (best_config says which)
  flex_us         torch.compile(flex_attention) over the same paged cache through
                  torch.nn.attention.experimental._paged_attention.PagedAttention's block-mask conversion
  sdpa_gather_us  gather each request's blocks into dense [B, Nkv, ctx, D], then SDPA (enable_gqa); both timed
A baseline that cannot run a case records why under "errors". Writes JSON (--out) after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from results_io import copy_bandwidth_tbps

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
FLUSH_BYTES = 512 << 20  # > the H200's 60 MB L2; zeroed before every timed call


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="a 3-row subset (B 8/64 at 4k, and num_query 4 at B 8)"
    )
    p.add_argument("--out", default="benchmarks/results/attention.json", help="JSON output path")
    p.add_argument(
        "--check", action="store_true", help="check fspec (and flex) against SDPA first: rel. error"
    )
    p.add_argument("--sweep", action="store_true", help="also time a few launch configs, report the best")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline (saves compiles)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing of fspec")
    p.add_argument("--reps", type=int, default=50, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    p.add_argument("--batch", type=int, nargs="*", help="restrict to these batch sizes")
    p.add_argument("--ctx", type=int, nargs="*", help="restrict to these context lengths")
    return p.parse_args(argv)


def cases(quick: bool) -> list[dict]:
    if quick:
        return [
            dict(B=8, ctx=4096, num_query=1),
            dict(B=64, ctx=4096, num_query=1),
            dict(B=8, ctx=4096, num_query=4),
        ]
    rows = [dict(B=b, ctx=c, num_query=1) for b in (1, 8, 64, 256) for c in (1024, 4096, 16384)]
    return rows + [dict(B=b, ctx=4096, num_query=4) for b in (8, 64)]


# ----------------------------------------------------------------------------------------------------------
# Inputs (device-agnostic: a tiny CPU run checks the baselines' setup against the reference)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    q: torch.Tensor  # [T, N, D], T = B * num_query
    k_cache: torch.Tensor  # [num_blocks, block_size, Nkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, ctx / block_size] int32, a random permutation of the blocks
    seq_lens: torch.Tensor  # [B] int32, all ctx
    positions: torch.Tensor  # [T] int64: ctx - num_query .. ctx - 1 per request
    query_start_loc: torch.Tensor  # [B+1] int32
    num_query: int
    scale: float


def make_case(b: int, ctx: int, num_query: int, *, device, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
              block_size=BLOCK_SIZE, dtype=DTYPE, seed=0) -> Case:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    max_blocks = ctx // block_size
    num_blocks = b * max_blocks + 1  # one block nobody owns, so no table is the identity layout
    perm = torch.randperm(num_blocks, generator=gen, device=device)[: b * max_blocks]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    pos = ctx - num_query + torch.arange(num_query, device=device)
    return Case(
        q=torch.randn(b * num_query, heads, head_dim, generator=gen, device=device, dtype=dtype),
        k_cache=torch.randn(shape, generator=gen, device=device, dtype=dtype),
        v_cache=torch.randn(shape, generator=gen, device=device, dtype=dtype),
        block_table=perm.view(b, max_blocks).int(),
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=device),
        positions=pos.repeat(b).long(),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device) * num_query,
        num_query=num_query,
        scale=head_dim**-0.5,
    )


def floor_bytes(b: int, ctx: int, num_query: int) -> int:
    kv = b * ctx * 2 * KV_HEADS * HEAD_DIM * 2  # K and V of every context token, bf16
    q_out = 2 * b * num_query * HEADS * HEAD_DIM * 2
    return kv + q_out


def fspec_fn(case: Case, config=None):
    from fspec.kernels.paged_attention import paged_attention

    c = case
    return lambda: paged_attention(
        c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, c.positions, c.query_start_loc,
        scale=c.scale, num_query=c.num_query, config=config,
    )  # fmt: skip


def sdpa_gather_fn(case: Case):
    """Gather every request's blocks into [B, Nkv, ctx, D], then SDPA (lower-right causal, num_query > 1)."""
    from torch.nn.attention.bias import causal_lower_right

    c = case
    b, max_blocks = c.block_table.shape
    ctx = max_blocks * c.k_cache.shape[1]
    nq, n, d = c.num_query, c.q.shape[1], c.q.shape[2]
    q4 = c.q.view(b, nq, n, d).transpose(1, 2)  # [B, N, Q, D]
    mask = causal_lower_right(nq, ctx) if nq > 1 else None
    table = c.block_table.long()

    def run():
        k = c.k_cache[table].view(b, ctx, -1, d).transpose(1, 2)  # the gather: [B, Nkv, ctx, D]
        v = c.v_cache[table].view(b, ctx, -1, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=c.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * nq, n, d)

    return run


def flex_fn(case: Case, *, compiled: bool = True):
    """flex_attention over the physical cache (a [1, Nkv, num_blocks * block_size, D] view, no copy): the
    logical causal block mask (block size 16 = the page size) is mapped to pages by PagedAttention."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    c = case
    b, max_blocks = c.block_table.shape
    num_blocks, block_size, nkv, d = c.k_cache.shape
    ctx, nq, n = max_blocks * block_size, c.num_query, c.q.shape[1]
    dev = c.q.device
    paged = PagedAttention(n_pages=num_blocks, page_size=block_size, max_batch_size=b, device=str(dev))
    table = c.block_table.long()
    paged.page_table[:, :max_blocks] = table
    paged.physical_to_logical.scatter_(
        1, table, torch.arange(max_blocks, device=dev).expand(b, -1).contiguous()
    )
    offset = ctx - nq  # query row i sits at position offset + i (all requests hold ctx tokens)

    def causal(bi, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    logical = create_block_mask(causal, b, None, nq, ctx, device=dev, BLOCK_SIZE=(128, block_size))
    block_mask = paged.convert_logical_block_mask(logical, kv_len=c.seq_lens.long())
    q4 = c.q.view(b, nq, n, d).transpose(1, 2)
    k = c.k_cache.view(1, num_blocks * block_size, nkv, d).transpose(1, 2)  # [1, Nkv, S, D], a view
    v = c.v_cache.view(1, num_blocks * block_size, nkv, d).transpose(1, 2)
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def run():
        out = flex(q4, k, v, block_mask=block_mask, scale=c.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * nq, n, d)

    return run


def resolved_config(case: Case, override=None):
    """The launch config the launcher uses for `case` (heuristic fields filled in)."""
    from fspec.kernels.paged_attention import default_config

    b, max_blocks = case.block_table.shape
    nkv = case.k_cache.shape[2]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if case.q.is_cuda else 132
    n, d = case.q.shape[1:]
    return default_config(
        batch=b, kv_heads=nkv, group=n // nkv, num_query=case.num_query, head_dim=d,
        capacity=max_blocks * case.k_cache.shape[1], num_sms=sms, override=override,
    )  # fmt: skip


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------------
# Timing (GPU)
# ----------------------------------------------------------------------------------------------------------


def time_us(fn, *, reps: int, warmup: int, flush: torch.Tensor) -> float:
    """Median of `reps` calls, each bracketed by CUDA events after an L2 flush (the flush is not timed)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def graphed(fn):
    """Capture fn once in a CUDA graph (after a warm-up on a side stream); returns the replay function."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sweep_configs():
    """Tile shapes at the heuristic partition, then partitions at the best tile (two-stage, ~17 configs)."""
    from fspec.kernels.paged_attention import AttentionConfig

    tiles = [
        AttentionConfig(block_n=bn, num_warps=w, num_stages=s)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3)
    ]
    return tiles, (256, 512, 1024, 2048, 1 << 30)


def run_sweep(case: Case, args, flush, ref: torch.Tensor) -> tuple[float | None, dict | None, list]:
    """Time every sweep config that compiles and agrees with the default config's output; best first."""
    tiles, partitions = sweep_configs()
    tried: list[dict] = []

    def attempt(cfg) -> float:
        entry = {"config": dataclasses.asdict(resolved_config(case, cfg))}
        try:
            fn = fspec_fn(case, cfg)
            err = rel_err(fn(), ref)
            if not err < 2e-2:
                raise RuntimeError(f"wrong result: rel. error {err:.2e} vs the default config")
            entry["us"] = round(time_us(fn, reps=max(10, args.reps // 2), warmup=args.warmup, flush=flush), 2)
        except Exception as e:  # out of shared memory, compile errors: record and go on
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        tried.append(entry)
        return entry.get("us", math.inf)

    best_tile = min(tiles, key=attempt)
    ctx = case.block_table.shape[1] * case.k_cache.shape[1]
    for part in sorted({min(p, ctx) for p in partitions}):
        attempt(dataclasses.replace(best_tile, partition=part))
    timed = [t for t in tried if "us" in t]
    if not timed:
        return None, None, tried
    best = min(timed, key=lambda t: t["us"])
    return best["us"], best["config"], tried


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def bench_case(spec: dict, args, flush, bw: float) -> dict:
    b, ctx, nq = spec["B"], spec["ctx"], spec["num_query"]
    case = make_case(b, ctx, nq, device="cuda")
    row: dict = {"case": dict(spec), "errors": {}}
    floor = floor_bytes(b, ctx, nq) / (bw * 1e12) * 1e6
    row["floor_us"] = round(floor, 3)
    row["default_config"] = dataclasses.asdict(resolved_config(case))
    fspec = fspec_fn(case)
    out = fspec()
    baselines = {"sdpa_gather_us": sdpa_gather_fn}
    if not args.no_flex:
        baselines["flex_us"] = flex_fn
    fns = {}
    for key, make in baselines.items():
        try:
            fns[key] = make(case)
            ref_out = fns[key]()
            if args.check:
                row[key.replace("_us", "_rel_err_vs_fspec")] = rel_err(ref_out, out)
        except Exception as e:
            row[key] = None
            row["errors"][key] = f"{type(e).__name__}: {e}"[:500]
            fns.pop(key, None)
    if args.check and "sdpa_gather_us" in fns:
        row["check_rel_err"] = rel_err(out, fns["sdpa_gather_us"]())
        print(
            f"  check B={b} ctx={ctx} nq={nq}: fspec vs SDPA rel. error {row['check_rel_err']:.2e}",
            flush=True,
        )
    row["fspec_us"] = round(time_us(fspec, reps=args.reps, warmup=args.warmup, flush=flush), 2)
    if not args.no_graph:
        try:
            row["fspec_graph_us"] = round(
                time_us(graphed(fspec), reps=args.reps, warmup=args.warmup, flush=flush), 2
            )
        except Exception as e:
            row["fspec_graph_us"] = None
            row["errors"]["fspec_graph_us"] = f"{type(e).__name__}: {e}"[:500]
    for key, fn in fns.items():
        try:
            row[key] = round(time_us(fn, reps=args.reps, warmup=args.warmup, flush=flush), 2)
        except Exception as e:
            row[key] = None
            row["errors"][key] = f"{type(e).__name__}: {e}"[:500]
    if args.sweep:
        row["fspec_best_us"], row["best_config"], row["sweep"] = run_sweep(case, args, flush, out)
    fastest = min(v for v in (row["fspec_us"], row.get("fspec_graph_us"), row.get("fspec_best_us")) if v)
    # targets: <= 1.5x the floor where B * ctx >= 64k tokens; never slower than the best baseline
    row["fspec_over_floor"] = round(row["fspec_us"] / floor, 3)
    row["best_fspec_over_floor"] = round(fastest / floor, 3)
    base = [row[k] for k in ("flex_us", "sdpa_gather_us") if row.get(k)]
    row["best_baseline_us"] = min(base) if base else None
    row["fspec_over_best_baseline"] = round(row["fspec_us"] / min(base), 3) if base else None
    del case, fns, out
    torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict]) -> None:
    cols = (
        "B",
        "ctx",
        "nq",
        "floor",
        "fspec",
        "graph",
        "best",
        "flex",
        "sdpa+gath",
        "fspec/floor",
        "best/floor",
    )
    print(" ".join(f"{c:>11}" for c in cols))
    for r in rows:
        c = r["case"]
        vals = (c["B"], c["ctx"], c["num_query"], r["floor_us"], r["fspec_us"], r.get("fspec_graph_us"),
                r.get("fspec_best_us"), r.get("flex_us"), r.get("sdpa_gather_us"), r["fspec_over_floor"],
                r["best_fspec_over_floor"])  # fmt: skip
        print(" ".join(f"{'-' if v is None else v:>11}" for v in vals))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_attention.py: needs a CUDA GPU (an H200); nothing measured on this machine",
            file=sys.stderr,
        )
        return 1
    import triton

    for name, value in (
        ("recompile_limit", 64),
        ("accumulated_recompile_limit", 512),
    ):  # a flex compile per case
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    bw = copy_bandwidth_tbps()
    print(f"copy bandwidth {bw:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    result = {
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python "
        + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "copy_bandwidth_TBps": round(bw, 3),
        "rows": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in cases(args.quick):
        if (args.batch and spec["B"] not in args.batch) or (args.ctx and spec["ctx"] not in args.ctx):
            continue
        print(f"case {spec}", flush=True)
        try:
            row = bench_case(spec, args, flush, bw)
        except Exception as e:  # e.g. out of memory: record the case and continue
            row = {"case": spec, "errors": {"case": f"{type(e).__name__}: {e}"[:500]}}
            torch.cuda.empty_cache()
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1) + "\n")  # after every row: a timeout keeps what was done
        if "fspec_us" in row:
            print_table([row])
    print()
    print_table([r for r in result["rows"] if "fspec_us" in r])
    for r in result["rows"]:
        for key, err in r.get("errors", {}).items():
            print(f"  {r['case']}: {key}: {err}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
