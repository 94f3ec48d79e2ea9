"""Host time of an eager sampling call, piece by piece: where the microseconds of `fspec_launch_us` go.

    python benchmarks/bench_host_overhead.py [--out benchmarks/results/host_overhead.json] [--calls 400]
    python benchmarks/bench_host_overhead.py --cpu-smoke   # tiny shapes, interpreter, no timing claims

An eager `gumbel_sample_into` (the op vLLM's Gumbel kernel is compared with, table `sampling`) is the
public function's validation, then the launcher: per-row inputs made contiguous, the result and scratch
tensors allocated, two Triton launches (three before the reduction and the probability write became one). At
small shapes the GPU finishes each kernel in a few µs, so the call costs what the host spends. Per piece this
times `--calls` back-to-back calls with the host clock and no synchronisation inside the loop (the GPU work
of each is tiny: the loop is host-bound), and reports µs per call, plus the same with the final drain
(`..._drained_us`), which exceeds it where the GPU was the bound. Run it alone on the host: another process
compiling at the same time inflates every figure.

Pieces (gumbel_sample_into, fp32 logits, K = 5 columns): `empty` one torch.empty, `scratch` the launcher's
one-allocation scratch of four tensors, `launch_block` / `launch_finish` each Triton launch alone
(`kernel[grid](...)` with ready arguments; older results have `launch_reduce` / `launch_probs`, the two
launches `launch_finish` replaced), `launch_block_compiled` the first of them through the compiled kernel's C
launcher alone (CUDA only; the difference is what `JITFunction.run` adds per launch), `launcher` the whole
launcher (kernels/gumbel.py), `call` through the typed function fspec.kernels.ops.gumbel_sample_into (what
fspec's code runs), `op` through torch.ops.fspec (the dispatcher), `validate` the public function's input
checks alone (one device sync), `public` the public function (validation + launcher), and, where
`benchmarks/gpu_prepare.sh` extracted it (benchmarks/peers.py), `vllm` one eager call of vLLM's Gumbel
sampler in the same run (temperature applied, processed logits written: the call a speculative round of
vLLM makes).
"""

from __future__ import annotations

import sys

if "--cpu-smoke" in sys.argv:  # before triton is imported: the kernels run in the interpreter
    import os

    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import peers  # noqa: E402
import results_io as RIO  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402

import fspec  # noqa: E402
from fspec.kernels import gumbel, pdl  # noqa: E402
from fspec.kernels import ops as kops  # noqa: E402
from fspec.ops.sampling import _validate_gumbel  # noqa: E402

K = 5
SHAPES = [(1, 32000), (1, 128256), (8, 128256), (64, 128256)]
SMOKE_SHAPES = [(1, 50), (3, 70)]


def host_us(fn, calls: int, sync) -> tuple[float, float]:
    """(µs per call on the host clock without a sync in the loop, µs per call including the final drain)."""
    for _ in range(max(3, calls // 20)):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    drained = time.perf_counter()
    return (issued - start) / calls * 1e6, (drained - start) / calls * 1e6


def compiled_launch(launch, t: torch.Tensor):
    """The floor of a Triton launch from Python: the CompiledKernel that `launch` (one `kernel[grid](...)`
    call of `_gumbel_block_kernel`) ran, called again through its C launcher with the same grid, stream and
    bound arguments, without `JITFunction.run` (argument binding, specialisation key, cache lookup, device
    and stream queries): what a launcher that kept its compiled kernel would pay per launch."""
    jit, captured = gumbel._gumbel_block_kernel, {}

    def spy(*args, grid, warmup, **kwargs):  # as JITFunction.run binds them (triton 3.6)
        kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = jit.device_caches[triton.runtime.driver.active.get_current_device()][4]
        captured["args"] = list(binder(*args, **kwargs)[0].values())
        captured["grid"] = tuple(grid) + (1,) * (3 - len(grid))
        captured["kernel"] = type(jit).run(jit, *args, grid=grid, warmup=warmup, **kwargs)
        return captured["kernel"]

    jit.run = spy  # the instance attribute shadows JITFunction.run for this one launch
    try:
        launch()
    finally:
        del jit.run
    compiled, grid, args = captured["kernel"], captured["grid"], captured["args"]
    stream = torch.cuda.current_stream(t.device).cuda_stream

    def run():
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    return run


def pieces(b: int, v: int, device: str, gen: torch.Generator, vllm=None) -> dict:
    """name -> zero-argument callable, for one (B, V)."""
    logits = torch.randn(b, v, device=device, generator=gen)
    temp = torch.full((b,), 0.8, device=device)
    seed, pos = torch.arange(b, device=device), torch.arange(b, device=device) + 100
    tokens_out = torch.zeros(b, K, dtype=torch.int64, device=device)
    probs_out = torch.zeros(b, K, v, device=device)
    col = torch.tensor(1, device=device)
    block = gumbel.launch_block(None)
    nb = triton.cdiv(v, block)
    (block_token,) = gumbel.scratch(torch.int64, logits.device, (b, nb))
    block_key, block_hot, block_max, block_sum = gumbel.scratch(torch.float32, logits.device, *[(b, nb)] * 4)
    tokens = torch.empty(b, dtype=torch.int64, device=device)
    next_col = torch.empty_like(col)
    launch = pdl.options(logits)
    fast_log = logits.is_cuda

    def launch_block():
        gumbel._gumbel_block_kernel[(b, nb)](
            logits, logits.stride(0), temp, seed, pos, block_key, block_token, block_max, block_sum,
            block_hot, tokens, tokens, v, nb, SALT=0, WITH_STATS=True, BLOCK=block, FAST_LOG=fast_log,
            **launch,
        )  # fmt: skip

    def launch_finish():
        gumbel._gumbel_finish_kernel[(b, nb)](
            logits, logits.stride(0), temp, block_key, block_token, block_max, block_sum, block_hot, tokens,
            tokens_out, probs_out, col, next_col, tokens, tokens, tokens, tokens, v, nb, K, MAP=False,
            NEXT_COL=True,
            NB_POW2=triton.next_power_of_2(nb), BLOCK=block, **launch,
        )  # fmt: skip

    into = dict(out_tokens=tokens_out, out_probs=probs_out, col=col)
    direct = {}
    if vllm is not None:
        direct["vllm"] = peers.vllm_gumbel_call(vllm, logits, temp, seed, pos)
    if device != "cpu":
        try:
            direct["launch_block_compiled"] = compiled_launch(launch_block, logits)
        except Exception as e:  # private Triton API: a measurement, never the reason the stage fails
            print(f"launch_block_compiled skipped: {type(e).__name__}: {e}", flush=True)
    return {
        "empty": lambda: torch.empty(b, dtype=torch.int64, device=device),
        "scratch": lambda: gumbel.scratch(torch.float32, logits.device, *[(b, nb)] * 4),
        "launch_block": launch_block,
        "launch_finish": launch_finish,
        **direct,
        "launcher": lambda: gumbel.gumbel_sample(logits, temp, seed, pos, **into),
        "call": lambda: kops.gumbel_sample_into(logits, temp, seed, pos, 0, tokens_out, probs_out, col),
        "op": lambda: torch.ops.fspec.gumbel_sample_into(
            logits, temp, seed, pos, 0, tokens_out, probs_out, col
        ),
        "validate": lambda: _validate_gumbel(logits, temp, seed, pos, 0, tokens_out, probs_out, col),
        "public": lambda: fspec.gumbel_sample(logits, temp, seed, pos, salt=0, **into),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400, help="timed calls per piece")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreter, no timing claims")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/host_overhead.json"))
    p.add_argument(
        "--vllm", type=Path, default=peers.VLLM_GUMBEL, help="vLLM's gumbel.py (absent: no vllm row)"
    )
    args = p.parse_args(argv)
    vllm = peers.vllm_gumbel(args.vllm)
    print(f"vLLM's Gumbel sampler: {args.vllm if vllm is not None else 'not prepared (no vllm piece)'}")
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_host_overhead: needs a CUDA device (or --cpu-smoke)")
    device = "cpu" if smoke else "cuda"
    sync = torch.cuda.synchronize if not smoke else (lambda: None)
    calls = 2 if smoke else args.calls
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for b, v in SMOKE_SHAPES if smoke else SHAPES:
        row = {"B": b, "V": v}
        timed = pieces(b, v, device, gen, vllm)
        for name, fn in timed.items():
            row[f"{name}_us"], row[f"{name}_drained_us"] = host_us(fn, calls, sync)
        rows.append(row)
        print(f"B={b:>3} V={v:>6}: " + ", ".join(f"{n} {row[n + '_us']:.1f}" for n in timed), flush=True)
    doc = {
        **RIO.header(
            "bench_host_overhead.py",
            argv,
            "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name(),
        ),
        "calls": calls,
        "vllm_gumbel": str(args.vllm) if vllm is not None else None,
        "rows": rows,
    }
    RIO.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
