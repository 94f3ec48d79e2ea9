"""Host time of an eager call to each fspec op: through the dispatcher (`torch.ops.fspec.*`) and as fspec
calls it (the typed function `fspec.kernels.ops.<name>`, the implementation directly when nothing traces).

    python benchmarks/bench_dispatch.py [--device cuda|cpu] [--out benchmarks/results/dispatch.json]

Small decode-sized inputs (one request, V = 32000, K = 5; one token of a 2-request paged cache), so the
kernels themselves are short and the host cost shows. On CUDA each timing is the mean over many calls with
a synchronize only at the end: the host enqueues faster than the GPU drains only if the host is the cheaper
side, so the figure is the larger of the two, as an eager user sees it. On the CPU the references run.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import results_io as RIO
import torch

from fspec.kernels import ops as kops


def cases(dev: str, v: int) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    k = 5

    def t(x):
        return x.to(dev)

    logits = t(torch.randn(1, v, generator=g))
    row = (t(torch.tensor([0.8])), t(torch.tensor([3])), t(torch.tensor([40])))
    out_tokens, out_probs, col = (
        t(torch.zeros(1, k, dtype=torch.int64)),
        t(torch.zeros(1, k, v)),
        t(torch.tensor(2)),
    )
    target = t(torch.randn(1, k + 1, v, generator=g))
    drafts = t(torch.randint(0, v, (1, k), generator=g))
    q = t(torch.softmax(torch.randn(1, k, v, generator=g), -1))
    heads, kv_heads, d, blocks, bs = 32, 8, 64, 8, 16
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    kc, vc = (
        t(torch.randn(blocks, bs, kv_heads, d, generator=g)).to(dt),
        t(torch.zeros(blocks, bs, kv_heads, d)).to(dt),
    )
    qa, ka, va = (t(torch.randn(1, n, d, generator=g)).to(dt) for n in (heads, kv_heads, kv_heads))
    cos, sin = t(torch.ones(1, d)), t(torch.zeros(1, d))
    slot = t(torch.tensor([37]))
    table, seq_lens = (
        t(torch.tensor([[2, 3, 5, -1]], dtype=torch.int32)),
        t(torch.tensor([38], dtype=torch.int32)),
    )
    pos, qsl = t(torch.tensor([37])), t(torch.tensor([0, 1], dtype=torch.int32))
    x, w = t(torch.randn(1, 2048, generator=g)).to(dt), t(torch.randn(3072, 2048, generator=g)).to(dt)
    out = {
        "gumbel_sample": ((logits, *row, 0), {}),
        "gumbel_sample_into": ((logits, *row, 0, out_tokens, out_probs, col), {}),
        "rejection_sample": ((target, drafts, q, *row), {}),
        "kv_write": ((ka, va, kc, vc, slot), {}),
        "rope_kv_write": ((qa, ka, va, cos, sin, kc, vc, slot), {}),
        "paged_attention": ((qa, kc, vc, table, seq_lens, pos, qsl), {"scale": d**-0.5, "num_query": 1}),
    }
    if dev == "cuda":
        out["skinny_linear"] = ((x, w), {})
    return out


def equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(equal(x, y) for x, y in zip(a, b, strict=True))
    return b is None if a is None else torch.equal(a, b)


def per_call_us(fn, dev: str, n: int) -> float:
    for _ in range(20):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/dispatch.json"))
    a = p.parse_args(argv)
    rows = []
    for name, (args, kwargs) in cases(a.device, a.vocab).items():
        op = getattr(torch.ops.fspec, name)
        if not equal(op(*args, **kwargs), getattr(kops, name)(*args, **kwargs)):
            raise SystemExit(f"{name}: the direct call's result differs from the op's")
        via_op = per_call_us(functools.partial(op, *args, **kwargs), a.device, a.calls)
        direct = per_call_us(functools.partial(getattr(kops, name), *args, **kwargs), a.device, a.calls)
        rows.append(
            {
                "op": name,
                "same_result": True,
                "dispatcher_us": round(via_op, 2),
                "direct_us": round(direct, 2),
            }
        )
        print(f"{name:<20} dispatcher {via_op:8.1f} µs   direct {direct:8.1f} µs")
    res = {
        **RIO.header(
            "bench_dispatch.py", argv, torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        ),
        "rows": rows,
    }
    RIO.write(a.out, res)


if __name__ == "__main__":
    main()
