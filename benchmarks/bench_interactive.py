"""Interactive use, as a notebook user makes it: one request at a time (B = 1, greedy) on the real model,
SmolLM2-135M-Instruct with its shipped EAGLE-3 head, fspec compiled and eager against Hugging Face
transformers on the same weights.

    python benchmarks/bench_interactive.py [--out benchmarks/results/interactive.json] [--device cuda]
        [--dtype float32] [--new-tokens 128] [--calls 32] [--modes compiled eager hf_eager hf_static
        hf_prompt_lookup] [--max-len N] [--max-prompt-tokens 1024] [--budget-s S] [--head DIR]

Prompts: --calls distinct prompts of the held-out sets of `fspec.train.prompts` (never trained on),
interleaved code, chat, health, each one user turn of a chat; prompts whose templated length exceeds
--max-prompt-tokens are left out. Two further prompts of the same list are the warm-up prompts (never among
the timed ones). Every call: one prompt, greedy, at most --new-tokens new tokens, EOS stops it.

A mode's warm-up comes first (`warmup_s`, its wall time), then one call per prompt; tok_s = new tokens of all
calls (EOS included) / wall time of all calls (CUDA synchronized before and after each). Then the first prompt
is called 3 more times: `warm_same_prompt_tok_s` is the median tok/s of those. Modes:
* compiled: a fresh `fspec.Generator()`, warm-up `gen.warmup(target, head, max_batch=1, max_len=--max-len,
  sampled=False)` (--max-len unset: the model's max_model_len), then `compile=True` calls;
  `graphs_recorded_after_warmup` = CUDA graphs the generator recorded during the calls (`recorded_graphs`);
* eager: a fresh `fspec.Generator()`, `compile=False`, warm-up one call on a warm-up prompt;
* hf_eager: transformers `generate` with its default dynamic cache on the weights written by
  `fspec.save_target` (loaded with AutoModelForCausalLM in the same dtype), warm-up one call;
* hf_static: the same with `cache_implementation="static"` (transformers compiles the forward on CUDA),
  warm-up two calls;
* hf_prompt_lookup: prompt-lookup decoding (`prompt_lookup_num_tokens=10`), dynamic cache, warm-up one call.
Every mode records `dynamo_compiles_after_warmup`: torch.compile graphs compiled during the calls
(`torch._dynamo.utils.counters["stats"]["unique_graphs"]`). tau = mean acceptance length (tokens per target
forward) over the calls, fspec modes. A mode that fails records "error" and the run goes on.

Rows: {"case": {"mode"}, "tok_s", "warm_same_prompt_tok_s", "warmup_s", "calls", "new_tokens",
"prompt_tokens": [min, median, max], "eos_stops", "call_s": [min, median, max], "first_call_s", ...};
written after every row. After the modes: "greedy_agreement" (on how many prompts compiled and eager fspec
gave the same tokens, and each HF mode and eager fspec) and "targets" (each ratio with its measured value,
its bound and whether it is met).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.train import default_model  # noqa: E402
from fspec.train import prompts as P  # noqa: E402

MODES = ("compiled", "eager", "hf_eager", "hf_static", "hf_prompt_lookup")
OWN_MODES = ("compiled", "eager")
HF_EXTRA = {
    "hf_eager": {},
    "hf_static": {"cache_implementation": "static"},
    "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10},
}
HF_WARMUPS = {"hf_eager": 1, "hf_static": 2, "hf_prompt_lookup": 1}
SAME_PROMPT_REPS = 3
WARMUP_PROMPTS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/interactive.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument(
        "--max-len", type=int, default=None, help="compiled warm-up's max_len (default: the model's)"
    )
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop adding modes after this many seconds")
    p.add_argument("--head", default=None, help="head directory (default: the shipped one)")
    return p.parse_args(argv)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def dynamo_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def prompt_lists(target, calls: int, max_tokens: int) -> tuple[list[list[dict]], list[list[int]], int]:
    """(chats, their templated token ids, prompts left out as too long): the first calls + WARMUP_PROMPTS
    distinct held-out prompts, interleaved code, chat, health, of at most max_tokens templated tokens."""
    sets = [P.heldout(name) for name in ("code", "chat", "health")]
    chats, ids, seen, skipped = [], [], set(), 0
    for group in zip(*sets):
        for text in group:
            if text in seen:
                continue
            seen.add(text)
            chat = [{"role": "user", "content": text}]
            row = list(target.tokenizer.apply_chat_template(chat))
            if len(row) > max_tokens:
                skipped += 1
                continue
            chats.append(chat)
            ids.append(row)
            if len(chats) == calls + WARMUP_PROMPTS:
                return chats, ids, skipped
    raise ValueError(f"--calls: the held-out sets have fewer than {calls + WARMUP_PROMPTS} usable prompts")


def cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (what fspec returns)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def fspec_caller(mode: str, gen, target, head, new_tokens: int):
    """A function of one chat that returns (new tokens, acceptance length) of one fspec call."""

    def call(chat):
        res = gen.generate(
            target, head, [chat], max_new_tokens=new_tokens, temperature=0.0, compile=mode == "compiled"
        )
        return res.tokens[0], res.stats["acceptance_length"]

    return call


def hf_caller(model, extra: dict, new_tokens: int, eos: set[int]):
    """A function of one prompt's token ids that returns (new tokens cut at EOS, None) of one transformers
    `generate` call, greedy."""

    def call(ids):
        x = torch.tensor([ids], device=model.device)
        with torch.no_grad():
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=sorted(eos),
                **extra,
            )
        return cut_at_eos(out[0, len(ids) :].tolist(), eos), None

    return call


def timed_call(call, prompt, device) -> tuple[float, list[int], float | None]:
    sync(device)
    t0 = time.perf_counter()
    tokens, tau = call(prompt)
    sync(device)
    return time.perf_counter() - t0, tokens, tau


def run_mode(mode: str, args, target, head, hf, chats, ids) -> tuple[dict, list[list[int]]]:
    """The row of `mode` and its tokens per timed prompt."""
    device, n = args.device, args.calls
    eos = set(target.cfg.eos_token_ids)
    row: dict = {"case": {"mode": mode}}
    if mode in OWN_MODES:
        gen = fspec.Generator()
        call = fspec_caller(mode, gen, target, head, args.new_tokens)
        prompts, warm = chats[:n], chats[n:]
    else:
        call = hf_caller(hf(), HF_EXTRA[mode], args.new_tokens, eos)
        prompts, warm = ids[:n], ids[n:]
    sync(device)
    t0 = time.perf_counter()
    if mode == "compiled":
        if not hasattr(gen, "warmup"):
            raise AttributeError("fspec.Generator has no warmup (the compiled mode needs Generator.warmup)")
        info = gen.warmup(target, head, max_batch=1, max_len=args.max_len, sampled=False)
        row.update(warmup_reported_s=info.get("seconds"), warmup_graphs=info.get("graphs"))
    elif mode == "eager":
        call(warm[0])
    else:
        for prompt in warm[: HF_WARMUPS[mode]]:
            call(prompt)
    sync(device)
    row["warmup_s"] = time.perf_counter() - t0
    graphs0 = getattr(gen, "recorded_graphs", None) if mode == "compiled" else None
    compiles0 = dynamo_graphs()
    times, tokens, taus = [], [], []
    for prompt in prompts:
        s, toks, tau = timed_call(call, prompt, device)
        times.append(s)
        tokens.append(toks)
        taus.append(tau)
    compiles1 = dynamo_graphs()
    if mode == "compiled":
        graphs1 = getattr(gen, "recorded_graphs", None)
        row["recorded_graphs"] = {"after_warmup": graphs0, "after_calls": graphs1}
        row["graphs_recorded_after_warmup"] = None if graphs0 is None else graphs1 - graphs0
    same = [timed_call(call, prompts[0], device) for _ in range(SAME_PROMPT_REPS)]
    new = sum(map(len, tokens))
    row.update(
        tok_s=new / sum(times),
        warm_same_prompt_tok_s=statistics.median(len(t) / s for s, t, _ in same),
        calls=len(prompts),
        new_tokens=new,
        prompt_tokens=[min(map(len, ids[:n])), statistics.median(map(len, ids[:n])), max(map(len, ids[:n]))],
        eos_stops=sum(1 for t in tokens if t and t[-1] in eos),
        call_s=[min(times), statistics.median(times), max(times)],
        first_call_s=times[0],
        dynamo_compiles_after_warmup=compiles1 - compiles0,
    )
    if mode in OWN_MODES:
        row["tau"] = statistics.mean(taus)
    return row, tokens


def ratio(rows: dict, a: str, a_key: str, b: str, b_key: str) -> float | None:
    x, y = rows.get(a, {}).get(a_key), rows.get(b, {}).get(b_key)
    return None if x is None or not y else x / y


def targets(rows: dict) -> dict:
    """Each target: {"value": measured (None when a mode it needs did not run), "bound", "met"}."""

    def at_least(v, bound):
        return {"value": v, "at_least": bound, "met": v is not None and v >= bound}

    warmup = rows.get("compiled", {}).get("warmup_s")
    return {
        "compiled_tok_s_over_warm_same_prompt": at_least(
            ratio(rows, "compiled", "tok_s", "compiled", "warm_same_prompt_tok_s"), 0.8
        ),
        "compiled_over_hf_eager": at_least(ratio(rows, "compiled", "tok_s", "hf_eager", "tok_s"), 20.0),
        "compiled_warmup_s": {"value": warmup, "at_most": 60.0, "met": warmup is not None and warmup <= 60.0},
        "eager_over_hf_eager": at_least(ratio(rows, "eager", "tok_s", "hf_eager", "tok_s"), 1.0),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    dtype = getattr(torch, args.dtype)
    target, head = default_model.load_default(args.head, dtype=dtype, device=device)
    chats, ids, skipped = prompt_lists(target, args.calls, args.max_prompt_tokens)
    doc = results_io.header(
        "bench_interactive.py", argv, torch.cuda.get_device_name() if device == "cuda" else device
    )
    doc.update(
        model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        dtype=args.dtype,
        new_tokens=args.new_tokens,
        calls=args.calls,
        max_len=args.max_len,
        max_prompt_tokens=args.max_prompt_tokens,
        prompts="fspec.train.prompts held-out sets code, chat, health interleaved, as one user turn",
        prompts_left_out_too_long=skipped,
        rows=[],
    )
    out = Path(args.out)
    hf_cache: list = []

    def hf():
        if not hf_cache:
            import transformers

            tmp = tempfile.mkdtemp()
            fspec.save_target(target, tmp)
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
            hf_cache.append(model.to(device).eval())
        return hf_cache[0]

    began = time.perf_counter()
    done: dict[str, dict] = {}
    tokens: dict[str, list[list[int]]] = {}
    for mode in args.modes:
        if time.perf_counter() - began > args.budget_s:
            print(f"budget spent: skipping {mode}", flush=True)
            continue
        try:
            row, tokens[mode] = run_mode(mode, args, target, head, hf, chats, ids)
            done[mode] = row
            tau = f"{row['tau']:.2f}" if "tau" in row else "-"
            print(
                f"{mode:17s} {row['tok_s']:8.1f} tok/s  warm same prompt {row['warm_same_prompt_tok_s']:8.1f}"
                f"  warm-up {row['warmup_s']:6.1f} s  tau {tau}"
                f"  compiles {row['dynamo_compiles_after_warmup']}"
                f"  graphs {row.get('graphs_recorded_after_warmup', '-')}",
                flush=True,
            )
        except Exception as e:  # recorded, not hidden: the row says which mode failed and why
            row = {"case": {"mode": mode}, "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{mode:17s} error: {row['error']}", flush=True)
        doc["rows"].append(row)
        results_io.write(out, doc)
    if "compiled" in tokens and "eager" in tokens:
        pairs = list(zip(tokens["compiled"], tokens["eager"]))
        doc["greedy_agreement"] = {
            "same_tokens_compiled_eager": sum(a == b for a, b in pairs),
            "of": len(pairs),
            "differing_prompts": [i for i, (a, b) in enumerate(pairs) if a != b],
        }
    if "eager" in tokens:  # the other modes against fspec eager, for information (no target)
        for mode in tokens.keys() - {"eager", "compiled"}:
            same = sum(a == b for a, b in zip(tokens[mode], tokens["eager"]))
            doc.setdefault("greedy_agreement", {})[f"same_tokens_{mode}_eager"] = same
    doc["targets"] = targets(done)
    results_io.write(out, doc)
    for name, t in doc["targets"].items():
        print(f"target {name}: {t['value']} met={t['met']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
