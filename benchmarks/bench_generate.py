"""Benchmark end-to-end generation: fspec target-only and EAGLE-3 speculative vs Hugging Face `generate`.

    python benchmarks/bench_generate.py [--out benchmarks/results/generate.json] [--batch 1 8]
        [--new-tokens 256] [--prompt-len 128] [--k 5] [--reps 3] [--budget-s 540]
        [--quick] [--skip-hf] [--skip-hf-static] [--cpu-smoke [--smoke-compile]]

Target: a Llama-3.2-1B-shaped model with RANDOM weights (vocab 128256, hidden 2048, intermediate 8192,
16 layers, 32 query / 8 KV heads of 64, RoPE llama3 theta 5e5 factor 32, tied embeddings), bf16, built with
`fspec.models.llama.init(cfg, seed=0)`. Prompts: random token ids (fixed seed). Greedy (temperature 0) and no
EOS, so every request gets exactly --new-tokens tokens. tokens/s = new tokens across the batch / wall time
of one call, median over --reps calls after a warm-up call (which compiles).

Rows, for each batch size B:
 1. fspec target-only, compile=True.
 2. fspec speculative with a random EAGLE-3 head (K = --k, draft vocab 32000, compile=True); acceptance
    length from result.stats (a random head accepts almost nothing: the row measures the overhead).
 3. fspec speculative at forced full acceptance: the same head with its lm_head zeroed, and the target
    rebuilt UNTIED for this row (the same embedding, layer and norm Parameters, plus an all-zero [V, H]
    lm_head), so every logit is 0 and greedy argmax picks token 0 for target and head alike: tau = K + 1
    exactly (checked). The matmuls are those of real weights: an untied lm_head reads the same [V, H]
    bytes per step as the tied embedding does.
 4. HF `generate` on the same weights (written by fspec.save_target, loaded with AutoModelForCausalLM):
    dynamic cache (eager), and static cache (`cache_implementation="static"`, which transformers compiles
    on its own on CUDA).
 5. HF assisted generation with the same model as its own assistant, num_assistant_tokens = K (constant
    schedule, confidence threshold off); transformers runs it at batch 1 only (B > 1 records its error).
Beside them:
 * floor: the target's weight bytes (the tied embedding counted once) / the copy bandwidth (a 1 GiB
   device-to-device copy, (bytes read + written) / time) is the time of one decode step; floor tokens/s =
   B / that step. KV-cache reads (< 5% here) are left out. Speculative rows may exceed it (ratio > 1).
 * round model (speculative rows): T_target(K+1), the target forward over K + 1 tokens per request (EAGLE-3
   aux layers included), plus T_propose, the whole K-step draft loop (fspec.compile.compile_propose), each
   compiled on its own and replayed alone at context prompt_len + new_tokens / 2; model tokens/s =
   B * tau / (T_target + T_propose). The forced row reuses the random-head row's parts (same shapes).
 * round graph: the engine's own round (fspec.serve.rounds.spec_round / decode_step: verification, rejection
   sampling, next drafts), replayed alone through the very graph `generate` compiled (no recompile); for
   target-only rows it is also the model (one decode step).
 * measured round = wall time / rounds (prefill included), and without the prefill (the time of a
   max_new_tokens=1 call subtracted). round_ratio = measured / model (target: <= 1.15),
   measured_over_graph = host overhead between graphs, graph_over_model = what one graph adds to the parts.
JSON: {"machine", "torch", "triton", "transformers", "date", "command", "copy_bandwidth_TBps", "target",
"rows": [{"case": {"system", "B", "K"}, "tokens_per_s", "acceptance_length", "floor_tokens_per_s",
"ratio_to_floor", "round_model_us", "round_measured_us", "error", ...}]}, written after every row.

--quick: batch 1, 64 new tokens, no HF static row. --cpu-smoke: the whole script on the CPU with a tiny
float32 model and compile=False (--smoke-compile: compile=True there too), to test the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import results_io
import torch

import fspec
from fspec.compile import compile_propose, jit
from fspec.compile.graph_capture import GraphCapture
from fspec.core.config import ModelConfig, env_switches
from fspec.core.metadata import first_step_metadata
from fspec.core.state import init_draft_state
from fspec.draft import propose
from fspec.models import layers as L
from fspec.models import llama
from fspec.models.heads import lookup, project_target_hidden
from fspec.serve import rounds, runner
from fspec.serve.engine import Stats

DEFAULT_OUT = Path(__file__).parent / "results" / "generate.json"
BLOCK_SIZE = 16  # fspec.generate's block size without a head; the heads here use the same
PROMPT_SEED = 1234
# Seconds a row may need at most on the H200 (compiles included): a row starts only if it fits the budget.
ROW_COST_S = {"fspec": 120, "hf_load": 40, "hf_eager": 40, "hf_static": 150}
RUN_CAP_S = 30.0  # stop repeating a row's timed calls past this many seconds (at least one call)

SYSTEMS = {
    "target": "fspec target-only",
    "spec": "fspec EAGLE-3 (random head)",
    "forced": "fspec EAGLE-3 forced full acceptance",
    "hf": "HF generate (dynamic cache)",
    "hf_assisted": "HF assisted (assistant = target)",
    "hf_static": "HF generate (static cache, compiled)",
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one benchmark run measures.

    Attributes:
        cfg: the target's ModelConfig (max_position_embeddings = the run's max_model_len).
        draft_vocab: the EAGLE-3 head's draft vocabulary Vd.
        new_tokens, prompt_len, k: tokens generated per request, prompt length, draft steps K.
        batches: batch sizes B.
        dtype, device: of every weight.
        compile: fspec.generate(compile=...).
        reps: timed calls per row (median), after one warm-up call.
        hf, hf_static: run the Hugging Face rows / the static-cache HF row.
        budget_s: a row starts only when its worst-case cost fits before this many seconds from the start.
        label: the JSON's "target" string.
        time_iters, time_repeats: graph replays per timing sample, samples per median (round model).
    """

    cfg: ModelConfig
    draft_vocab: int
    new_tokens: int
    prompt_len: int
    k: int
    batches: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    compile: bool
    reps: int
    hf: bool
    hf_static: bool
    budget_s: float
    label: str
    time_iters: int = 20
    time_repeats: int = 5
    fuse: bool = True
    profile: Path | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes B (default 1 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default 256)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    parser.add_argument("--k", type=int, default=5, help="draft steps K (and HF num_assistant_tokens)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per row (median)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip rows that would end past this")
    parser.add_argument("--quick", action="store_true", help="batch 1, 64 new tokens, no HF static row")
    parser.add_argument("--skip-hf", action="store_true", help="no Hugging Face rows")
    parser.add_argument("--skip-hf-static", action="store_true", help="no static-cache HF row")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny float32 model on the CPU")
    parser.add_argument("--smoke-compile", action="store_true", help="with --cpu-smoke: compile=True")
    parser.add_argument(
        "--fuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fspec rows with fused q/k/v and gate/up (fspec.fuse_projections), as fspec.load_target gives",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="append each fspec row's round-graph CUDA kernel table here",
    )
    return parser.parse_args(argv)


def llama_1b_config(max_len: int) -> ModelConfig:
    """Llama-3.2-1B's shape (random weights here), no EOS so that no request stops early."""
    return ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_type="llama3",
        rope_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=8192,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )


def tiny_config(max_len: int) -> ModelConfig:
    """A CPU-sized model with the same structure (GQA, llama3 RoPE, tied embeddings)."""
    return dataclasses.replace(
        llama_1b_config(max_len),
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        torch_dtype="float32",
    )


def make_setup(args: argparse.Namespace) -> Setup:
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit(
            "bench_generate: needs a CUDA device (none found); use --cpu-smoke to test the script"
        )
    new_tokens = args.new_tokens or (8 if smoke else 64 if args.quick else 256)
    prompt_len = args.prompt_len or (16 if smoke else 128)
    batches = tuple(args.batch or ([1] if args.quick else [1, 8]))
    # Every request's sequence fits with room for a round's verification (K + 1 rows) and drafting (K more);
    # a tight max_model_len keeps the block table, and the paged-attention grid sized from it, small.
    max_len = -(-(prompt_len + new_tokens + 2 * args.k + 2) // BLOCK_SIZE) * BLOCK_SIZE
    return Setup(
        cfg=tiny_config(max_len) if smoke else llama_1b_config(max_len),
        draft_vocab=128 if smoke else 32000,
        new_tokens=new_tokens,
        prompt_len=prompt_len,
        k=args.k,
        batches=batches,
        dtype=torch.float32 if smoke else torch.bfloat16,
        device=torch.device("cpu" if smoke else "cuda"),
        compile=args.smoke_compile if smoke else True,
        reps=2 if smoke else args.reps,
        hf=not args.skip_hf,
        hf_static=not (args.skip_hf or args.skip_hf_static or args.quick),
        budget_s=args.budget_s,
        label="random-weight tiny Llama (CPU smoke), float32"
        if smoke
        else "random-weight Llama-3.2-1B shape, bf16 (random weights, tied embeddings)",
        time_iters=2 if smoke else 20,
        time_repeats=2 if smoke else 5,
        fuse=args.fuse,
        profile=args.profile,
    )


# --- helpers ------------------------------------------------------------------------------------------------

_START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _START:7.1f}s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn: Callable[[], object], s: Setup) -> float:
    """Median over samples of (wall time of `time_iters` back-to-back calls, synced) / time_iters, in us.

    Three untimed calls first: CUDA graph trees warm up, then record, on their first calls.
    """
    for _ in range(3):
        fn()
    sync(s.device)
    samples = []
    for _ in range(s.time_repeats):
        start = time.perf_counter()
        for _ in range(s.time_iters):
            fn()
        sync(s.device)
        samples.append((time.perf_counter() - start) / s.time_iters * 1e6)
    return statistics.median(samples)


def copy_bandwidth_tbps(s: Setup) -> float:
    """Copy bandwidth in TB/s: (bytes read + bytes written) / median time of a large copy; on a GPU the
    shared measurement of every benchmark (`results_io.copy_bandwidth_tbps`), on the CPU a 64 MiB copy."""
    if s.device.type == "cuda":
        bw = results_io.copy_bandwidth_tbps(s.device)
        torch.cuda.empty_cache()
        return bw
    src = torch.empty(1 << 24, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (time_us(lambda: dst.copy_(src), s) * 1e-6) / 1e12


def weight_bytes(params) -> int:
    """Bytes of every distinct parameter (a tied embedding, one tensor, counted once)."""
    seen, total = set(), 0
    for t in fspec.tree.tree_leaves(params):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def prompts_for(b: int, s: Setup) -> list[list[int]]:
    """b random prompts of prompt_len token ids; the first rows are the same for every b."""
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    ids = torch.randint(0, s.cfg.vocab_size, (max(s.batches), s.prompt_len), generator=gen)
    return ids[:b].tolist()


def prefix_match(tokens: list[list[int]], ref: list[list[int]] | None) -> float | None:
    """Mean fraction of each request's tokens equal to the reference before the first difference."""
    if not ref or len(ref) != len(tokens):
        return None
    fractions = []
    for got, want in zip(tokens, ref):
        n = 0
        while n < min(len(got), len(want)) and got[n] == want[n]:
            n += 1
        fractions.append(n / max(len(want), 1))
    return round(sum(fractions) / len(fractions), 4)


def counter_snapshot() -> dict[str, int]:
    """torch._dynamo counters that tell about compiles and CUDA-graph skips."""
    from torch._dynamo.utils import counters

    out = {f"inductor.{k}": v for k, v in counters["inductor"].items() if "cudagraph" in k}
    out.update({f"stats.{k}": v for k, v in counters["stats"].items()})
    out.update({f"frames.{k}": v for k, v in counters["frames"].items()})
    out["graph_breaks"] = sum(counters["graph_break"].values())
    return out


def counter_delta(before: dict[str, int]) -> dict[str, int]:
    after = counter_snapshot()
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


class SkipLog(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." warnings for the JSON."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg not in self.messages and len(self.messages) < 50:
            self.messages.append(msg[:500])


# --- the report ---------------------------------------------------------------------------------------------


class Report:
    """The JSON document, written again after every row; the time budget rows check before starting."""

    def __init__(self, out: Path, header: dict, budget_s: float) -> None:
        self.out, self.doc, self.budget_s = out, {**header, "rows": []}, budget_s
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def fits(self, cost_s: float) -> bool:
        return time.monotonic() - _START + cost_s <= self.budget_s

    def add(self, row: dict) -> None:
        self.doc["rows"].append(row)
        self.write()
        log(f"row done: {summary(row)}")

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - _START, 1)
        self.out.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")


def new_row(system: str, b: int, k: int | None) -> dict:
    keys = ("tokens_per_s", "acceptance_length", "floor_tokens_per_s", "ratio_to_floor")
    keys += ("round_model_us", "round_measured_us", "error")
    return {"case": {"system": SYSTEMS[system], "B": b, "K": k}, **dict.fromkeys(keys)}


def guarded(row: dict, report: Report, cost_s: float, fn: Callable[[dict], None], device) -> None:
    """Fill `row` with fn(row) unless the budget is spent; record any exception in row["error"]."""
    if not report.fits(cost_s):
        row["error"] = f"skipped: would not finish within --budget-s {report.budget_s:.0f} s"
        report.add(row)
        return
    before = counter_snapshot()
    start = time.monotonic()
    try:
        fn(row)
    except Exception as e:  # noqa: BLE001 (a failing row is data, not the end of the run)
        traceback.print_exc(limit=-3)
        row["error"] = f"{type(e).__name__}: {e}"[:1000]
        try:
            sync(device)
        except Exception as e2:  # noqa: BLE001
            row["error"] += f" | then: {type(e2).__name__}: {e2}"[:500]
    row["row_seconds"] = round(time.monotonic() - start, 1)
    row["dynamo_counters"] = counter_delta(before)
    report.add(row)


def repeat(call: Callable[[], tuple[float, object]], reps: int) -> tuple[float, list[float], object]:
    """Call `call` (-> (seconds, result)) reps times (fewer past RUN_CAP_S); (median, all, last result)."""
    times, result = [], None
    for _ in range(max(reps, 1)):
        sec, result = call()
        times.append(sec)
        if sum(times) > RUN_CAP_S:
            break
    return statistics.median(times), times, result


def set_floor(row: dict, b: int, floor_step_s: float) -> None:
    row["floor_tokens_per_s"] = b / floor_step_s
    if row.get("tokens_per_s"):
        row["ratio_to_floor"] = round(row["tokens_per_s"] / row["floor_tokens_per_s"], 4)


# --- fspec rows ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Models:
    """target (tied), draft (random EAGLE-3 head), forced_target (untied, zero lm_head), forced_draft (zero
    lm_head): see the module docstring."""

    target: fspec.Target
    draft: fspec.Draft
    forced_target: fspec.Target
    forced_draft: fspec.Draft


def build_models(s: Setup) -> Models:
    params = llama.init(s.cfg, seed=0, dtype=s.dtype, device=s.device)
    target = fspec.Target(cfg=s.cfg, params=params)
    draft = fspec.init_draft(
        target,
        kind="eagle3",
        seed=1,
        num_speculative_steps=s.k,
        draft_vocab_size=s.draft_vocab,
        block_size=BLOCK_SIZE,
        max_model_len=s.cfg.max_position_embeddings,
    )
    v, vd, h = s.cfg.vocab_size, s.draft_vocab, s.cfg.hidden_size
    kw = {"dtype": s.dtype, "device": s.device}
    forced_target = fspec.Target(
        cfg=dataclasses.replace(s.cfg, tie_word_embeddings=False),
        params={**params, "lm_head": L.zeros(v, h, **kw)},  # embedding, layers, norm: the same Parameters
    )
    forced_draft = fspec.Draft(
        cfg=draft.cfg, params={**draft.params, "lm_head": L.zeros(vd, h, **kw)}, shared=draft.shared
    )
    if s.fuse:  # one matmul for q/k/v and one for gate/up per layer; shared Parameters stay shared
        tp, dp = fspec.fuse_projections(params), fspec.fuse_projections(draft.params)
        target = fspec.Target(cfg=s.cfg, params=tp)
        forced_target = dataclasses.replace(
            forced_target, params={**tp, "lm_head": forced_target.params["lm_head"]}
        )
        draft = dataclasses.replace(draft, params=dp)
        forced_draft = dataclasses.replace(
            forced_draft, params={**dp, "lm_head": forced_draft.params["lm_head"]}
        )
    return Models(target, draft, forced_target, forced_draft)


def run_generate(target, draft, prompts, s: Setup, max_new: int | None = None) -> tuple[float, object]:
    kw = {"max_new_tokens": max_new or s.new_tokens, "temperature": 0.0, "seed": 0, "compile": s.compile}
    if draft is not None:
        kw["num_speculative_steps"] = s.k
    sync(s.device)
    start = time.perf_counter()
    result = fspec.generate(target, draft, prompts, **kw)
    sync(s.device)
    return time.perf_counter() - start, result


def _engine_run(target, draft, b: int, s: Setup) -> runner.Run:
    """A (never run) fspec.serve.runner.Run for b prompts: caches, bucket, max_len, temperature and seed
    tensors shaped exactly as the ones `generate` hands its compiled graphs, so replaying those graphs
    recompiles nothing. Its caches are already marked static when compiling."""
    k = draft.cfg.num_speculative_steps if draft is not None else 0
    return runner.Run(
        target,
        draft,
        prompts_for(b, s),
        dict(temperature=[0.0] * b, seed=[0] * b),
        max_new_tokens=s.new_tokens,
        compile=s.compile,
        stats=Stats(k),
        progress=False,
    )


def phase_seconds(target, draft, b: int, s: Setup) -> dict[str, float]:
    """One warm greedy call split into phases (the device synchronised at each boundary): `setup` (the
    runner: caches, bucket, device tensors), `prefill` (prefill, first token and first proposal, up to the
    first token on the host), `rounds` (the round loop, including the pipelined loop's one extra round)."""
    sync(s.device)
    start = time.perf_counter()
    run = _engine_run(target, draft, b, s)
    sync(s.device)
    marks = {"setup": time.perf_counter()}
    prefill = run._prefill

    def timed_prefill(*args, **kwargs):  # the first admission's prefill (every request is admitted in it)
        out = prefill(*args, **kwargs)
        sync(s.device)
        marks.setdefault("prefill", time.perf_counter())
        return out

    run._prefill = timed_prefill
    run.go()
    sync(s.device)
    end = time.perf_counter()
    return {
        "setup": round(marks["setup"] - start, 5),
        "prefill": round(marks["prefill"] - marks["setup"], 5),
        "rounds": round(end - marks["prefill"], 5),
        "rounds_launched": run.rounds_launched,
    }


def _table(run: runner.Run, b: int, device) -> torch.Tensor:
    """[bucket, max_blocks] int32: request i owns an equal share of the cache's blocks; padding rows -1."""
    per = min(run.tcache.num_blocks // b, run.max_blocks)
    table = torch.full((run.b, run.max_blocks), -1, dtype=torch.int32)
    for i in range(b):
        table[i, :per] = torch.arange(i * per, (i + 1) * per, dtype=torch.int32)
    return table.to(device)


def _mid_position(s: Setup) -> int:
    return s.prompt_len + s.new_tokens // 2  # every request in the middle of a run


def engine_round_us(target, draft, b: int, s: Setup) -> float:
    """One round of the engine's own device function (`fspec.serve.rounds.spec_round` / `decode_step`),
    replayed alone: with compile, the very graph `generate` compiled (no host bookkeeping, no sync per
    round)."""
    run = _engine_run(target, draft, b, s)
    dev, bucket = s.device, run.b
    table = _table(run, b, dev)
    n = torch.tensor([_mid_position(s)] * b + [0] * (bucket - b), dtype=torch.int64, device=dev)
    live = torch.tensor([True] * b + [False] * (bucket - b), device=dev)
    gen = torch.Generator().manual_seed(7)
    cur = torch.randint(0, target.cfg.vocab_size, (bucket,), generator=gen).to(dev)
    if draft is None:
        args = (target.params, cur, n, live, table, run.sampling, run.tcache)
        if s.compile:
            fn = run.res.graph(rounds.compiled_decode_step, target.cfg, run.bs, run.max_len)
        else:
            fn = functools.partial(
                rounds.decode_step, tcfg=target.cfg, block_size=run.bs, max_len=run.max_len
            )
    else:
        k, dcfg = run.k, draft.cfg
        d_tok = torch.randint(0, target.cfg.vocab_size, (bucket, k), generator=gen).to(dev)
        vd = 0 if dcfg.greedy_drafts else dcfg.draft_vocab_size
        d_prob = torch.zeros(bucket, k, vd, dtype=torch.float32, device=dev)
        args = (target.params, draft.params, cur, n, live, table, d_tok, d_prob, run.sampling)
        args += (run.tcache, run.dcache)
        if s.compile:
            # the engine's graph advances n (and cur, and the drafts) in place: each call starts n back at
            # the middle of the run (one 8-byte-per-request copy, launched before the replay)
            graph = run.res.graph(rounds.compiled_spec_round, target.cfg, dcfg, run.max_len, run.captured)
            if run.captured:  # fspec's own graph, keyed once as the engine does (`Run._replay`)
                graph = functools.partial(graph, key=GraphCapture.layout_key(args))
            n0 = n.clone()

            def fn(*a):
                n.copy_(n0)
                return graph(*a)

        else:
            fn = functools.partial(rounds.spec_round, tcfg=target.cfg, dcfg=dcfg, max_len=run.max_len)

    def call():
        if s.compile:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(*args)

    us = time_us(call, s)
    if s.profile is not None:
        profile_calls(call, s, f"round graph: {'target-only' if draft is None else 'speculative'}, B = {b}")
    return us


def profile_calls(call: Callable[[], object], s: Setup, title: str) -> None:
    """Append the CUDA kernel table (top 40 by total time) of 10 calls of `call` to s.profile."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if s.device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(10):
            call()
        sync(s.device)
    sort = "cuda_time_total" if s.device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
    with open(s.profile, "a") as f:
        f.write(f"\n{title} (10 calls)\n{table}\n")


@functools.cache
def _target_piece(cfg: ModelConfig, aux: tuple[int, ...], q: int):
    """The target forward over q tokens per request alone, compiled like the engine's round."""

    def run(params, ids, meta, cache):
        logits, hidden, _ = llama.forward(
            params, ids, meta, cache, cfg=cfg, aux_layer_ids=aux, max_query_len=q
        )
        return logits, hidden

    return jit(run)


@functools.cache
def _propose_piece(cfg):
    return compile_propose(cfg=cfg)


def piece_times(target, draft, b: int, s: Setup) -> dict:
    """The round-cost model's parts, each compiled on its own and replayed alone (us): T_target(K+1), the
    target forward over K + 1 tokens per request (with the EAGLE-3 aux layers), and T_propose, the whole
    K-step draft loop (`fspec.compile.compile_propose`) from K + 1 verified rows per request."""
    run = _engine_run(target, draft, b, s)
    dev, bucket, k = s.device, run.b, run.k
    q = k + 1
    table = _table(run, b, dev)
    starts = torch.tensor([_mid_position(s)] * b + [-1] * (bucket - b), dtype=torch.int64, device=dev)
    meta = first_step_metadata(starts, torch.full_like(starts, q), table, num_query=q, block_size=run.bs)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, target.cfg.vocab_size, (bucket * q,), generator=gen).to(dev)
    aux = lookup(draft.cfg.kind).aux_layer_ids(draft.cfg)
    if s.compile:
        fwd = _target_piece(target.cfg, aux, q)

        def target_call():
            torch.compiler.cudagraph_mark_step_begin()
            return fwd(target.params, ids, meta, run.tcache)

    else:

        def target_call():
            out = llama.forward(
                target.params, ids, meta, run.tcache, cfg=target.cfg, aux_layer_ids=aux, max_query_len=q
            )
            return out[:2]

    _, hidden = target_call()
    h = project_target_hidden(draft.params, hidden, cfg=draft.cfg)  # eager: later replays keep it intact
    del hidden  # graph outputs: the next replay overwrites them
    out = {"t_target_us": time_us(target_call, s)}
    state = init_draft_state(ids, h, meta, cfg=draft.cfg, sampling=run.sampling)
    if s.compile:
        prop = _propose_piece(draft.cfg)
        propose_call = lambda: prop(draft.params, state, run.dcache)
    else:
        propose_call = lambda: propose(draft.params, state, run.dcache, cfg=draft.cfg)
    out["t_propose_us"] = time_us(propose_call, s)
    return out


@contextlib.contextmanager
def note_failure(row: dict, key: str):
    """Record an exception of an optional part of a row under row[key] and carry on with the row."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(limit=-3)
        row[key] = f"{type(e).__name__}: {e}"[:1000]


def add_round_ratios(row: dict, b: int) -> None:
    model_us, graph_us = row.get("round_model_us"), row.get("round_graph_us")
    measured_us, excl_us = row["round_measured_us"], row["round_measured_excl_prefill_us"]
    if model_us:
        row["model_tokens_per_s"] = b * (row["acceptance_length"] or 1.0) / model_us * 1e6
        row["round_ratio"] = round(measured_us / model_us, 3)
        row["round_ratio_excl_prefill"] = round(excl_us / model_us, 3)
    if graph_us:
        row["measured_over_graph"] = round(measured_us / graph_us, 3)
        row["measured_excl_prefill_over_graph"] = round(excl_us / graph_us, 3)
    if model_us and graph_us:
        row["graph_over_model"] = round(graph_us / model_us, 3)


def fspec_row(kind: str, target, draft, b: int, s: Setup, ctx: dict) -> Callable[[dict], None]:
    """The work of one fspec row (kind "target", "spec" or "forced") at batch b."""
    prompts = prompts_for(b, s)

    def fill(row: dict) -> None:
        log(f"{row['case']['system']} B={b}: warm-up call (compiles)")
        row["warmup_s"] = round(run_generate(target, draft, prompts, s)[0], 2)
        # CUDA-graph trees run a new graph once eagerly, record it on its second call and replay it from the
        # third: a second warm-up call keeps the recording out of the timed calls (it was ~38 ms of one).
        row["record_call_s"] = round(run_generate(target, draft, prompts, s)[0], 4)
        med, times, res = repeat(lambda: run_generate(target, draft, prompts, s), s.reps)
        st = res.stats
        new = sum(map(len, res.tokens))
        if new != b * s.new_tokens:
            raise RuntimeError(f"expected {b * s.new_tokens} new tokens, got {new}")
        row.update(tokens_per_s=new / med, runs_s=[round(t, 4) for t in times], rounds=st["rounds"])
        row["target_forwards"] = st["target_forwards"]
        set_floor(row, b, ctx["floor_step_s"])
        row["round_measured_us"] = med / st["rounds"] * 1e6
        # setup + prefill + first proposal, no round; twice, because a new cache size compiles its graphs
        run_generate(target, draft, prompts, s, max_new=1)
        prefill_s = run_generate(target, draft, prompts, s, max_new=1)[0]
        row["prefill_call_s"] = round(prefill_s, 4)
        row["phases_s"] = phase_seconds(target, draft, b, s)  # a warm call of the timed size, split
        row["round_measured_excl_prefill_us"] = (med - prefill_s) / st["rounds"] * 1e6
        if kind == "target":
            ctx["ref_tokens"][b] = res.tokens
        else:
            row["acceptance_length"] = st["acceptance_length"]
            row["acceptance_rate_per_position"] = [round(r, 4) for r in st["acceptance_rate_per_position"]]
        if kind == "forced":
            row["expected_acceptance_length"] = s.k + 1
            row["forced_check_ok"] = st["acceptance_length"] == s.k + 1 and all(
                t == 0 for toks in res.tokens for t in toks
            )
            if not row["forced_check_ok"]:
                seen = sorted({t for toks in res.tokens for t in toks})[:8]
                row["error"] = (
                    f"forced acceptance: expected acceptance_length {s.k + 1} and only token 0, got "
                    f"{st['acceptance_length']} and tokens {seen}"
                )
        else:
            row["prefix_match_vs_target_only"] = prefix_match(res.tokens, ctx["ref_tokens"].get(b))
        log(f"{row['case']['system']} B={b}: round graph and round model")
        with note_failure(row, "round_graph_error"):
            before = counter_snapshot()
            row["round_graph_us"] = engine_round_us(target, draft, b, s)
            row["graph_dynamo_counters"] = counter_delta(before)  # nonzero frames: the replay recompiled
        if kind == "target":
            row["round_model_us"] = row.get("round_graph_us")  # one decode step
        else:
            with note_failure(row, "round_model_error"):
                pieces = ctx["pieces"].get(b) if kind == "forced" else None
                if pieces is None:
                    pieces = piece_times(target, draft, b, s)
                    if kind == "spec":
                        ctx["pieces"][b] = pieces
                else:
                    row["pieces_from"] = "the random-head row (same shapes, same matmuls)"
                row.update(pieces)
                row["round_model_us"] = pieces["t_target_us"] + pieces["t_propose_us"]
        add_round_ratios(row, b)

    return fill


# --- Hugging Face rows --------------------------------------------------------------------------------------


def load_hf(target: fspec.Target, s: Setup, tmp: str):
    import transformers

    fspec.save_target(target, tmp)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=s.dtype)
    except TypeError:  # older spelling
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=s.dtype)
    model = model.to(s.device).eval()
    model.generation_config.eos_token_id = None  # random weights, no EOS: every request runs to the end
    model.generation_config.pad_token_id = 0
    log(f"HF model loaded: {type(model).__name__}, {next(model.parameters()).dtype}")
    return model


def hf_generate(model, ids: torch.Tensor, n: int, s: Setup, **extra) -> tuple[float, list[list[int]]]:
    sync(s.device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        **extra,
    )
    sync(s.device)
    sec = time.perf_counter() - start
    new = out[:, ids.shape[1] :]
    if tuple(new.shape) != (ids.shape[0], n):
        raise RuntimeError(f"expected {n} new tokens per request, got shape {tuple(new.shape)}")
    return sec, new.tolist()


class AssistantCalls:
    """Counts the assistant's `generate` calls inside HF assisted generation: one per target verification.

    The assistant is the target itself, so the count wraps the instance's `generate`: nested calls are the
    assistant's drafting rounds. `remove()` restores the class method.
    """

    def __init__(self, model) -> None:
        self.model, self.inner, self.depth, self.nested = model, model.generate, 0, 0
        model.generate = self._generate

    def _generate(self, *args, **kwargs):
        self.nested += self.depth > 0
        self.depth += 1
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.depth -= 1

    def remove(self) -> None:
        del self.model.generate


def hf_row(kind: str, model, b: int, s: Setup, ctx: dict) -> Callable[[dict], None]:
    """The work of one HF row (kind "hf", "hf_assisted" or "hf_static") at batch b."""
    ids = torch.tensor(prompts_for(b, s), dtype=torch.int64, device=s.device)
    extra: dict = {}
    if kind == "hf_static":
        extra["cache_implementation"] = "static"
    if kind == "hf_assisted":
        extra.update(assistant_model=model, num_assistant_tokens=s.k)

    def fill(row: dict) -> None:
        if kind == "hf_assisted":
            gc = model.generation_config  # the assistant's config: what its candidate generator reads
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = s.k, "constant"
            gc.assistant_confidence_threshold = 0.0  # random logits are never "confident": keep all K drafts
        # The static cache's compiled graph depends on the length: warm up at full length; eager at 16 tokens.
        warm = s.new_tokens if kind == "hf_static" else min(16, s.new_tokens)
        log(f"{row['case']['system']} B={b}: warm-up call")
        row["warmup_s"] = round(hf_generate(model, ids, warm, s, **extra)[0], 2)
        counter = AssistantCalls(model) if kind == "hf_assisted" else None
        try:
            med, times, tokens = repeat(lambda: hf_generate(model, ids, s.new_tokens, s, **extra), s.reps)
        finally:
            if counter is not None:
                counter.remove()
        row.update(tokens_per_s=b * s.new_tokens / med, runs_s=[round(t, 4) for t in times])
        set_floor(row, b, ctx["floor_step_s"])
        row["prefix_match_vs_fspec_target_only"] = prefix_match(tokens, ctx["ref_tokens"].get(b))
        if kind == "hf_static":
            row["hf_compiled"] = getattr(model, "_compiled_call", None) is not None
        if counter is not None and counter.nested:
            # Each drafting round is one target verification (the last may come without a draft).
            row["assistant_rounds_per_call"] = counter.nested / len(times)
            row["acceptance_length_est"] = round(s.new_tokens * len(times) / counter.nested, 3)

    return fill


# --- main ---------------------------------------------------------------------------------------------------


def header(s: Setup, bandwidth: float, models: Models, floor_step_s: float) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    machine = (
        torch.cuda.get_device_name()
        if s.device.type == "cuda"
        else f"CPU {platform.processor() or platform.machine()}"
    )
    return {
        "machine": machine,
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": hf_version,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "env": env_switches(),
        "copy_bandwidth_TBps": round(bandwidth, 4),
        "target": s.label,
        "config": {
            "target_cfg": dataclasses.asdict(s.cfg),
            "dtype": str(s.dtype),
            "new_tokens": s.new_tokens,
            "prompt_len": s.prompt_len,
            "K": s.k,
            "draft_vocab_size": s.draft_vocab,
            "batches": list(s.batches),
            "fspec_compile": s.compile,
            "fused_projections": s.fuse,
            "weight_bytes": weight_bytes(models.target.params),
            "draft_weight_bytes": weight_bytes(models.draft.params)
            - weight_bytes(models.target.params["embed"]),
            "floor_step_us": floor_step_s * 1e6,
            "temperature": 0.0,
            "dynamo_recompile_limit": getattr(torch._dynamo.config, "recompile_limit", None),
            "cudagraph_or_error": getattr(torch._inductor.config.triton, "cudagraph_or_error", None),
        },
        "notes": [
            "random weights: the tokens and the acceptance of rows 1, 2 and 4 mean nothing; "
            "the speed does not depend on them",
            "forced row: target rebuilt untied (same embedding/layers/norm Parameters) with a zero [V, H] "
            "lm_head and the head's lm_head zeroed; every logit is 0, greedy argmax = token 0, tau = K + 1",
            "floor: weight bytes (tied embedding once) / copy bandwidth per decode step; KV reads left out",
            "round_measured_us = wall / rounds (prefill included); _excl_prefill subtracts a "
            "max_new_tokens=1 call; round_model_us = T_target(K+1) + T_propose, each compiled and replayed "
            "alone; round_graph_us = the engine's own round graph replayed alone",
            "HF assisted: assistant_model = the target itself, constant num_assistant_tokens = K, "
            "confidence threshold 0; acceptance_length_est = new tokens / the assistant's drafting rounds",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = make_setup(args)
    # Every (config, batch, query length) of the target forward is a recompile of one code object: keep
    # well above the 8 default so that no variant silently falls back to eager.
    for name in ("recompile_limit", "cache_size_limit"):  # the name moved between torch versions
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    skips = SkipLog()
    try:  # inductor logs every CUDA-graph skip (with its reason) as a warning on this logger
        from torch._inductor.cudagraph_utils import cudagraphs_log

        cudagraphs_log.addHandler(skips)
    except ImportError as e:
        log(f"cannot collect cudagraph skip messages: {e}")
    log(f"setup: {s.label}, B {list(s.batches)}, {s.new_tokens} new tokens, prompt {s.prompt_len}, K {s.k}")
    bandwidth = copy_bandwidth_tbps(s)
    log(f"copy bandwidth {bandwidth:.3f} TB/s")
    models = build_models(s)
    floor_step_s = weight_bytes(models.target.params) / (bandwidth * 1e12)
    log(f"models built; target weights {weight_bytes(models.target.params) / 1e9:.3f} GB")
    report = Report(args.out, header(s, bandwidth, models, floor_step_s), s.budget_s)
    report.write()
    ctx = {"floor_step_s": floor_step_s, "ref_tokens": {}, "pieces": {}}
    for b in s.batches:
        for kind, target, draft in (
            ("target", models.target, None),
            ("spec", models.target, models.draft),
            ("forced", models.forced_target, models.forced_draft),
        ):
            row = new_row(kind, b, s.k if draft is not None else None)
            guarded(row, report, ROW_COST_S["fspec"], fspec_row(kind, target, draft, b, s, ctx), s.device)
    if s.hf:
        hf_rows(models.target, s, ctx, report)
    report.doc["cudagraph_skip_messages"] = skips.messages
    report.doc["dynamo_counters"] = counter_snapshot()
    report.write()
    print_table(report.doc["rows"], report.doc)
    log(f"wrote {args.out}")
    return 0


def hf_rows(target: fspec.Target, s: Setup, ctx: dict, report: Report) -> None:
    kinds = [("hf", b) for b in s.batches] + [("hf_assisted", b) for b in s.batches]
    kinds += [("hf_static", b) for b in s.batches] if s.hf_static else []
    model, error = None, None
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        if report.fits(ROW_COST_S["hf_load"] + ROW_COST_S["hf_eager"]):
            log("HF: saving the target and loading it with transformers")
            try:
                model = load_hf(target, s, tmp)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                error = f"loading with transformers: {type(e).__name__}: {e}"[:1000]
        else:
            error = f"skipped: would not finish within --budget-s {report.budget_s:.0f} s"
        for kind, b in kinds:
            row = new_row(kind, b, s.k if kind == "hf_assisted" else None)
            if model is None:
                row["error"] = error
                report.add(row)
                continue
            cost = ROW_COST_S["hf_static" if kind == "hf_static" else "hf_eager"]
            guarded(row, report, cost, hf_row(kind, model, b, s, ctx), s.device)


def summary(row: dict) -> str:
    c = row["case"]
    tps = row.get("tokens_per_s")
    out = f"{c['system']} B={c['B']}: " + (f"{tps:.1f} tok/s" if tps else "no number")
    if row.get("acceptance_length") is not None:
        out += f", tau {row['acceptance_length']:.3f}"
    if row.get("round_ratio") is not None:
        out += f", measured/model round {row['round_ratio']:.2f}"
    if row.get("error"):
        out += f", error: {row['error'][:200]}"
    return out


def print_table(rows: list[dict], doc: dict) -> None:
    def num(v, fmt: str, width: int) -> str:
        return (
            f"{v:>{width}{fmt}}"
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            else f"{'-':>{width}}"
        )

    head = f"{'system':<38}{'B':>3}{'K':>3}{'tok/s':>10}{'tau':>7}{'floor':>9}{'/floor':>8}"
    print(head + f"{'model us':>10}{'graph us':>10}{'meas us':>10}{'m/model':>9}{'-prefill':>9}  error")
    for r in rows:
        c = r["case"]
        tau = r.get("acceptance_length") or r.get("acceptance_length_est")
        excl = r.get("round_ratio_excl_prefill")
        print(
            f"{c['system']:<38}{c['B']:>3}{num(c['K'], 'd', 3)}{num(r.get('tokens_per_s'), '.1f', 10)}"
            f"{num(tau, '.2f', 7)}{num(r.get('floor_tokens_per_s'), '.0f', 9)}"
            f"{num(r.get('ratio_to_floor'), '.3f', 8)}{num(r.get('round_model_us'), '.0f', 10)}"
            f"{num(r.get('round_graph_us'), '.0f', 10)}"
            f"{num(r.get('round_measured_us'), '.0f', 10)}{num(r.get('round_ratio'), '.2f', 9)}"
            f"{num(excl, '.2f', 9)}  {(r.get('error') or '')[:60]}"
        )
    print(
        f"{doc['machine']}, copy bandwidth {doc['copy_bandwidth_TBps']:.2f} TB/s; {doc['target']}; "
        "tokens/s = new tokens / wall time (median); floor = B / (weight bytes / bandwidth); us = one round "
        "(one step without a head): model = T_target(K+1) + T_propose, graph = the engine's round graph, "
        "meas = wall / rounds; m/model = meas / model, -prefill = the same without the prefill"
    )


if __name__ == "__main__":
    sys.exit(main())
