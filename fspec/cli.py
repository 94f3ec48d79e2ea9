"""The `fspec` command line: `fspec demo` (the embedded default model on held-out text), `fspec generate`
(local HF checkpoints) and `fspec distill` (training-time-test distillation of a draft head)."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    import fspec
    from fspec import data

    target, draft = fspec.load_default()
    # A held-out file of this interpreter's standard library: text the model never saw in training.
    files = data.stdlib_files()
    _, held = data.split_files(files)
    text = next(data.read_texts(held[args.file % len(held) : args.file % len(held) + 1]))
    ids = target.tokenizer.encode(text).ids[: args.prompt_tokens]
    prompt = target.tokenizer.decode(ids)
    settings = dict(temperature=args.temperature, seed=args.seed, num_speculative_steps=args.k)
    for model in (draft, None):  # one short call each first: neither timed run pays the first-call costs
        fspec.generate(target, model, [ids], max_new_tokens=min(4, args.max_new_tokens), **settings)
    res = fspec.generate(
        target,
        draft,
        [ids],
        max_new_tokens=args.max_new_tokens,
        progress=args.max_new_tokens >= 512,
        **settings,
    )
    # the same prompt decoded by the target alone: the speed-up, and (greedy) the same tokens
    plain = fspec.generate(target, None, [ids], max_new_tokens=args.max_new_tokens, **settings)
    s, p = res.stats, plain.stats
    same = res.tokens[0] == plain.tokens[0] if args.temperature == 0 else None
    speedup = s["tokens_per_second"] / p["tokens_per_second"]
    print(f"--- prompt ({len(ids)} tokens of held-out {held[args.file % len(held)].name}) ---")
    print(prompt)
    print(f"--- {len(res.tokens[0])} new tokens, K = {args.k}, temperature {args.temperature} ---")
    print(res.text[0])
    print("---")
    print(
        f"acceptance length {s['acceptance_length']:.2f} tokens per target forward "
        f"(per-position acceptance {', '.join(f'{a:.2f}' for a in s['acceptance_rate_per_position'])}); "
        f"{s['tokens_per_second']:.1f} tokens/s on {target.params['embed'].device}"
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
                "demo": "default-model",
                "file": held[args.file % len(held)].name,
                "k": args.k,
                "temperature": args.temperature,
                "tokens": res.tokens[0],
                "stats": s,
                "target_only": {"stats": p, "same_tokens": same},
                "speedup": speedup,
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
        help="speculative generation with the embedded default model on held-out Python source (CPU)",
        description="Loads the embedded default model (a small Llama trained by fspec on the Python standard "
        "library's source, and its distilled EAGLE-3 head), continues a held-out standard-library file, and "
        "prints the text, the acceptance length and tokens/s; then decodes the same prompt with the target "
        "alone and prints its tokens/s, the speed-up and (greedy) whether the tokens are the same (exit code "
        "1 if not); then one line of JSON.",
    )
    demo.add_argument("-k", type=int, default=5, help="draft tokens per round (default 5)")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--file", type=int, default=0, help="which held-out file (index, default 0)")
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
        "distill", help="train a draft head (see `python -m fspec.distill --help`)", add_help=False
    )
    dist.set_defaults(func=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distill"]:
        from fspec.distill import main as distill_main

        return distill_main(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
