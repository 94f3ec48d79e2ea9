"""The real-model path under compute-sanitizer memcheck: SmolLM2-135M-Instruct with its shipped EAGLE-3 head,
prompts up to 4096 tokens, batches up to 64, eager and compiled.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        python benchmarks/gpu_memcheck_real.py eager
    compute-sanitizer --tool memcheck python benchmarks/gpu_memcheck_real.py compiled

`eager` runs with the caching allocator off, so every tensor is its own allocation and an access past any
tensor's end is reported; CUDA-graph capture cannot allocate with the allocator off, so `compiled` runs with
it on (accesses past a tensor but inside the allocator's segment go unseen there; the eager run covers the
same kernels). `bash benchmarks/gpu_real_model.sh memcheck` runs both and keeps each log's ERROR SUMMARY.
Each case prints one line: its name, batch, longest prompt, new tokens and seconds. Prompts are random token
ids (seeded); a case fails (rc 1) when a request returns no token.

Cases, bf16 (the serving dtype):
* eager: B = 1 with a 4096-token prompt (speculative, greedy); B = 64 of mixed lengths up to 48
  (log-uniform; speculative, sampled, top_k / top_p / min_p on); B = 8 target-only up to 256, sampled;
  B = 3 speculative at K = 1 and K = 5 with min_new_tokens.
* compiled: B = 4 with prompts up to 4096 (chunked prefill, speculative, sampled with the options), the same
  batch shape with other lengths (graphs replayed), B = 64 of lengths up to 48 (speculative, greedy), B = 1
  target-only.
Under memcheck a 4096-token prefill takes about a minute on the H200, so the batches of 64 are short.
"""

from __future__ import annotations

import math
import random
import sys
import time

import torch

import fspec


def _prompts(rng: random.Random, b: int, longest: int, vocab: int, *, one_longest: bool) -> list[list[int]]:
    lengths = [max(1, int(math.exp(rng.uniform(0, math.log(longest))))) for _ in range(b)]
    if one_longest:
        lengths[0] = longest
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run(mode: str) -> int:
    target, head = fspec.load_default(dtype=torch.bfloat16, device="cuda")
    vocab = target.cfg.vocab_size
    rng = random.Random(0)
    gen = fspec.Generator()
    opts = dict(top_k=[rng.choice([0, 5, 50]) for _ in range(64)])
    compiled = mode == "compiled"

    def options(b: int) -> dict:
        return dict(
            temperature=[rng.uniform(0.3, 1.2) for _ in range(b)],
            seed=list(range(b)),
            top_k=opts["top_k"][:b],
            top_p=[rng.choice([1.0, 0.9, 0.5]) for _ in range(b)],
            min_p=[rng.choice([0.0, 0.05]) for _ in range(b)],
        )

    if compiled:
        cases = [
            (
                "B4 up to 4096, sampled + options",
                head,
                _prompts(rng, 4, 4096, vocab, one_longest=True),
                options(4),
            ),
            ("B4 other lengths (replay)", head, _prompts(rng, 4, 1000, vocab, one_longest=False), options(4)),
            ("B64 up to 48, greedy", head, _prompts(rng, 64, 48, vocab, one_longest=True), {}),
            ("B1 target-only", None, _prompts(rng, 1, 200, vocab, one_longest=True), {}),
        ]
    else:
        cases = [
            ("B1 4096, greedy", head, _prompts(rng, 1, 4096, vocab, one_longest=True), {}),
            (
                "B64 up to 48, sampled + options",
                head,
                _prompts(rng, 64, 48, vocab, one_longest=True),
                options(64),
            ),
            (
                "B8 target-only, sampled",
                None,
                _prompts(rng, 8, 256, vocab, one_longest=True),
                dict(temperature=0.8, seed=3),
            ),
            (
                "B3 K=1, min_new_tokens",
                head,
                _prompts(rng, 3, 100, vocab, one_longest=False),
                dict(num_speculative_steps=1, min_new_tokens=8),
            ),
            (
                "B3 K=5, min_new_tokens",
                head,
                _prompts(rng, 3, 100, vocab, one_longest=False),
                dict(num_speculative_steps=5, min_new_tokens=8),
            ),
        ]
    bad = 0
    for name, draft, prompts, kw in cases:
        t0 = time.perf_counter()
        res = gen.generate(target, draft, prompts, max_new_tokens=12, compile=compiled, **kw)
        torch.cuda.synchronize()
        empty = sum(1 for t in res.tokens if not t)
        bad += empty
        longest = max(map(len, prompts))
        row = f"{mode}: {name}: B {len(prompts)}, longest {longest}, new {sum(map(len, res.tokens))}"
        flag = f", EMPTY {empty}" if empty else ""
        print(f"{row}, {time.perf_counter() - t0:.1f} s{flag}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("eager", "compiled"):
        raise SystemExit("usage: gpu_memcheck_real.py eager|compiled")
    raise SystemExit(run(sys.argv[1]))
