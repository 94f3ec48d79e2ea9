"""Where an eager `generate` call's time goes on the real model: host functions, syncs, kernel launches.

    python benchmarks/profile_eager_call.py [--out DIR] [--new-tokens 64] [--dtype float32]

SmolLM2-135M-Instruct with its shipped head, B = 1, greedy, distinct prompts of the held-out sets (one call
each, after one warm-up call on another prompt, so Triton's compile cache is warm for the common shapes):
per call the wall time and tokens/s; for one call the cProfile top functions by own time, the number of
host-device syncs (`torch.cuda.set_sync_debug_mode`) and of CUDA kernels launched (torch.profiler).
Writes DIR/profile_eager_call.json and DIR/profile_eager_call.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fspec  # noqa: E402
from fspec.train import default_model  # noqa: E402
from fspec.train import prompts as P  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--calls", type=int, default=4)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, a.dtype)
    target, head = default_model.load_default(dtype=dtype, device="cuda")
    prompts = [t for pair in zip(P.heldout("code"), P.heldout("chat")) for t in pair][: a.calls + 3]
    chats = [[{"role": "user", "content": t}] for t in prompts]
    kw = dict(max_new_tokens=a.new_tokens, temperature=0.0)
    compiles: list[str] = []

    def on_compile(*, key, repr, fn, compile, **_):
        compiles.append(f"{fn.name} {compile['constants']}")

    triton.knobs.runtime.jit_post_compile_hook = on_compile  # Triton JIT compiles, logged per call
    fspec.generate(target, head, [chats[-1]], **kw)  # warm-up: another prompt
    rows = []
    for chat in chats[: a.calls]:
        compiles.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fspec.generate(target, head, [chat], **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = len(target.tokenizer.apply_chat_template(chat))
        row = dict(seconds=dt, tokens=len(r.tokens[0]), tok_s=len(r.tokens[0]) / dt, prompt_tokens=n)
        row.update(tau=r.stats["acceptance_length"], rounds=r.stats["rounds"], triton_compiles=list(compiles))
        rows.append(row)
        print({k: v for k, v in row.items() if k != "triton_compiles"}, flush=True)
        print("  compiled:", [c[:300] for c in compiles], flush=True)
    triton.knobs.runtime.jit_post_compile_hook = None
    # syncs
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = fspec.generate(target, head, [chats[0]], **kw)
    torch.cuda.set_sync_debug_mode(0)
    sync_sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            sync_sites[key] = sync_sites.get(key, 0) + 1
    # host profile
    prof = cProfile.Profile()
    prof.enable()
    r = fspec.generate(target, head, [chats[1]], **kw)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    s2 = io.StringIO()
    pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(45)
    # kernels
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kp:
        r = fspec.generate(target, head, [chats[2]], **kw)
        torch.cuda.synchronize()
    events = kp.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = events.table(sort_by="self_cpu_time_total", row_limit=40)
    result = {
        "calls": rows,
        "profiled_rounds": r.stats["rounds"],
        "sync_sites": sync_sites,
        "syncs": sum(sync_sites.values()),
        "cuda_kernels_one_call": kernels,
    }
    (out / "profile_eager_call.json").write_text(json.dumps(result, indent=1))
    (out / "profile_eager_call.txt").write_text(s.getvalue() + "\n\n" + s2.getvalue() + "\n\n" + table)
    print(json.dumps({k: v for k, v in result.items() if k != "sync_sites"}, indent=1))
    print(sorted(sync_sites.items(), key=lambda kv: -kv[1])[:20])
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
