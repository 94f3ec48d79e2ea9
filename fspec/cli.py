"""The `fspec` command line: `fspec demo` (the embedded default model on a held-out chat prompt),
`fspec generate` (local HF checkpoints) and `fspec distill` (training-time-test distillation of a draft
head)."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    import time

    import torch

    import fspec
    from fspec.train import prompts as P

    # One thread by default: torch's two threads on a busy 2-core machine scattered the speed-up from 0.34x
    # to 8.68x across runs; one thread gave a stable 1.5x (measured on the toy model).
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    target, draft = fspec.load_default()
    loaded = time.perf_counter() - began
    text = (
        args.prompt if args.prompt is not None else P.heldout(args.set)[args.index % len(P.heldout(args.set))]
    )
    chat = fspec.render_chat(target, [{"role": "user", "content": text}])
    ids = target.tokenizer.encode(chat, add_special_tokens=False).ids
    settings = dict(temperature=args.temperature, seed=args.seed, num_speculative_steps=args.k)
    for model in (draft, None):  # one short call each first: neither timed run pays the first-call costs
        fspec.generate(target, model, [ids], max_new_tokens=2, **settings)
    res = fspec.generate(target, draft, [ids], max_new_tokens=args.max_new_tokens, **settings)
    # the same prompt decoded by the target alone: the speed-up, and (greedy) the same tokens
    plain = fspec.generate(target, None, [ids], max_new_tokens=args.max_new_tokens, **settings)
    s, p = res.stats, plain.stats
    same = res.tokens[0] == plain.tokens[0] if args.temperature == 0 else None
    speedup = s["tokens_per_second"] / p["tokens_per_second"]
    print(
        f"--- user ({len(ids)} prompt tokens with the chat template; SmolLM2-135M-Instruct, loaded in "
        f"{loaded:.1f} s) ---"
    )
    print(text)
    print(
        f"--- assistant ({len(res.tokens[0])} new tokens, K = {args.k}, temperature {args.temperature}) ---"
    )
    print(res.text[0])
    print("---")
    print(
        f"acceptance length {s['acceptance_length']:.2f} tokens per target forward "
        f"(per-position acceptance {', '.join(f'{a:.2f}' for a in s['acceptance_rate_per_position'])}); "
        f"speculative {s['tokens_per_second']:.1f} tokens/s on {args.threads} CPU thread(s)"
    )
    verdict = {True: "the same tokens", False: "DIFFERENT tokens (a bug: greedy speculation is lossless)"}
    print(
        f"target alone: {p['tokens_per_second']:.1f} tokens/s in {p['target_forwards']} target forwards "
        f"(speculative: {s['target_forwards']}), speed-up {speedup:.2f}x"
        + (
            f", {verdict[same]}"
            if same is not None
            else " (sampled: equal in distribution, not token for token)"
        )
    )
    print(
        json.dumps(
            {
                "demo": "smollm2-135m-instruct",
                "prompt": text,
                "k": args.k,
                "temperature": args.temperature,
                "threads": args.threads,
                "acceptance_length": s["acceptance_length"],
                "tokens_per_second": s["tokens_per_second"],
                "target_only_tokens_per_second": p["tokens_per_second"],
                "speedup": speedup,
                "same_tokens": same,
                "tokens": res.tokens[0],
                "stats": s,
            }
        )
    )
    return 0 if same is not False else 1


def _generate(args: argparse.Namespace) -> int:
    import fspec

    target = fspec.load_target(args.target)
    draft = fspec.load_draft(args.draft, target=target, num_speculative_steps=args.k) if args.draft else None
    if args.tokens is not None:
        prompts = [[int(t) for t in args.tokens.replace(",", " ").split()]]
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        raise SystemExit("fspec generate: give --prompt TEXT or --tokens IDS")
    res = fspec.generate(
        target,
        draft,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        num_speculative_steps=args.k,
        progress=args.max_new_tokens >= 256,
    )
    if res.text is not None:
        print(res.text[0])
    else:
        print(" ".join(map(str, res.tokens[0])))
    s = res.stats
    print(
        f"acceptance length {s['acceptance_length']:.2f} tokens per target forward, "
        f"{s['tokens_per_second']:.1f} tokens/s",
        file=sys.stderr,
    )
    print(json.dumps({"tokens": res.tokens[0], "stats": s}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fspec", description="Speculative decoding as a pure step function."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="speculative generation with the embedded default model (SmolLM2-135M-Instruct) on the CPU",
        description="Loads the embedded default model (SmolLM2-135M-Instruct and the EAGLE-3 head fspec "
        "trained for it), answers a held-out chat prompt (chat template applied) and prints the answer, the "
        "acceptance length and tokens/s; then answers the same prompt with the target alone and prints its "
        "tokens/s, the speed-up and (greedy) whether the tokens are the same (exit code 1 if not); then one "
        "line of JSON.",
    )
    demo.add_argument("-k", type=int, default=5, help="draft tokens per round (default 5)")
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--prompt", default=None, help="your own user message (default: a held-out prompt)")
    demo.add_argument("--set", default="chat", help="held-out set of the default prompt (chat or code)")
    demo.add_argument("--index", type=int, default=0, help="which prompt of that set (default 0)")
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable speed)")
    demo.set_defaults(func=_demo)
    gen = sub.add_parser(
        "generate",
        help="generate from a local HF checkpoint, with an optional draft head",
        description="Speculative generation (target-only without --draft) from local HF-layout directories. "
        "Prints the text (or token ids), the acceptance length and tokens/s, then one line of JSON.",
    )
    gen.add_argument("--target", required=True, help="target model directory (config.json, *.safetensors)")
    gen.add_argument("--draft", help="draft head directory (EAGLE-1, EAGLE-3 or MTP layout)")
    gen.add_argument("--prompt", help="prompt text (the target needs tokenizer.json)")
    gen.add_argument("--tokens", help="prompt token ids, separated by spaces or commas")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("-k", type=int, default=3, help="draft tokens per round (default 3)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.set_defaults(func=_generate)
    dist = sub.add_parser(
        "distill", help="train a draft head (see `python -m fspec.train.distill --help`)", add_help=False
    )
    dist.set_defaults(func=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distill"]:
        from fspec.train.distill import main as distill_main

        return distill_main(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
