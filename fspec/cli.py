"""The `fspec` command line: `fspec demo` (the embedded default model on a held-out chat prompt),
`fspec generate` (local checkpoints: prompts, chats, a JSONL file; streamed or JSON) and `fspec distill`
(training-time-test distillation of a draft head).

Every bad input (a missing path, a bad number, a value `fspec.generate` refuses, a bad JSONL line) is one
line `fspec: error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from pathlib import Path


class UsageError(Exception):
    """A bad command line or input file: reported as one `fspec: error: ...` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are a `UsageError` (one line, exit code 2) instead of usage text."""

    def error(self, message):
        raise UsageError(message)


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


# --- fspec generate -----------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16", "float16")
# argparse dest -> `fspec.generate` keyword, passed only when the option is given (generate may not take
# them all: a given one it does not take is a usage error, not a TypeError)
OPTIONAL = {
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_id": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "min_new_tokens": "min_new_tokens",
    "eos_token_id": "eos_token_id",
}


def generate_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of `fspec.generate` that the command line sets: max_new_tokens, temperature,
    seed, compile and progress always; num_speculative_steps when -k is given; each of OPTIONAL's only when
    its option is given (stop and stop_token_ids as lists, ignore_eos as True)."""
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        compile=args.compile,
        progress=args.max_new_tokens >= 256 and not args.json,
    )
    if args.k is not None:
        kwargs["num_speculative_steps"] = args.k
    for dest, name in OPTIONAL.items():
        value = getattr(args, dest)
        if value is not None and value is not False:
            kwargs[name] = list(value) if isinstance(value, list) else value
    return kwargs


def _option(name: str) -> str:
    dest = {v: k for k, v in OPTIONAL.items()}.get(name, name)
    return "-k" if dest == "num_speculative_steps" else "--" + dest.replace("_", "-")


def _check_accepted(fn, kwargs: dict, what: str) -> None:
    """A UsageError naming the first option whose keyword `fn` does not take (none if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name in kwargs:
        if name not in params:
            raise UsageError(f"{_option(name)}: this version's {what} does not take {name!r}")


def read_prompts_file(path) -> list[dict]:
    """The requests of a JSONL file: one JSON object a line, {"prompt": str} or {"messages": [...]}, with
    optional "temperature" (a number) and "seed" (an int); blank lines are skipped. UsageError naming the
    file and line for anything else."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--prompts-file: expected a JSONL file, got {str(file)!r} (no such file)")
    out = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--prompts-file {file}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: expected one JSON object, got invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or len({"prompt", "messages"} & set(record)) != 1:
            raise UsageError(
                f"{where}: expected an object with 'prompt' or 'messages', got {line.strip():.80}"
            )
        extra = set(record) - {"prompt", "messages", "temperature", "seed"}
        if extra:
            raise UsageError(
                f"{where}: unexpected keys {sorted(extra)} (expected prompt or messages, temperature, seed)"
            )
        if "prompt" in record and not isinstance(record["prompt"], str):
            raise UsageError(f"{where}: 'prompt': expected a string, got {record['prompt']!r:.80}")
        if "messages" in record and not (isinstance(record["messages"], list) and record["messages"]):
            raise UsageError(
                f"{where}: 'messages': expected a non-empty list, got {record['messages']!r:.80}"
            )
        t, s = record.get("temperature"), record.get("seed")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))):
            raise UsageError(f"{where}: 'temperature': expected a number, got {t!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise UsageError(f"{where}: 'seed': expected an int, got {s!r}")
        out.append(record)
    if not out:
        raise UsageError(f"--prompts-file: expected at least one request in {file}, got none")
    return out


def _requests(args: argparse.Namespace) -> list[dict]:
    """Every request in order: --prompt, --tokens, then --prompts-file lines; --chat makes each prompt text
    one user message."""
    out = [{"prompt": text} for text in args.prompt or ()]
    for text in args.tokens or ():
        try:
            out.append({"prompt": [int(t) for t in text.replace(",", " ").split()]})
        except ValueError:
            raise UsageError(
                f"--tokens: expected token ids separated by spaces or commas, got {text!r}"
            ) from None
    if args.prompts_file:
        out.extend(read_prompts_file(args.prompts_file))
    if not out:
        raise UsageError("generate: expected --prompt TEXT, --tokens IDS or --prompts-file FILE.jsonl")
    for r in out:
        if "messages" in r:
            r["prompt"] = r.pop("messages")
        elif args.chat and isinstance(r["prompt"], str):
            r["prompt"] = [{"role": "user", "content": r["prompt"]}]
    return out


def _load(args: argparse.Namespace):
    import torch

    import fspec

    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads: expected a positive int, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        target = fspec.load_target(args.target, dtype=dtype, device=device)
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"--target: {e}") from None
    draft = None
    if args.draft:
        try:
            draft = fspec.load_draft(args.draft, target=target, num_speculative_steps=args.k)
        except (OSError, ValueError) as e:
            raise UsageError(f"--draft: {e}") from None
    return target, draft


def _generate(args: argparse.Namespace) -> int:
    import fspec

    requests = _requests(args)
    kwargs = generate_kwargs(args)
    target, draft = _load(args)
    if draft is not None:
        kwargs.setdefault("num_speculative_steps", draft.cfg.num_speculative_steps)  # the head's K
    for key in ("temperature", "seed"):  # per-line values, the option's elsewhere
        if any(key in r for r in requests):
            kwargs[key] = [r.get(key, kwargs[key]) for r in requests]
    prompts = [r["prompt"] for r in requests]
    if hasattr(fspec, "stream") and len(prompts) == 1 and not args.json and not args.no_stream:
        return _stream(fspec.stream, target, draft, prompts[0], kwargs)
    _check_accepted(fspec.generate, kwargs, "fspec.generate")
    res = fspec.generate(target, draft, prompts, **kwargs)
    s = res.stats
    reasons = getattr(res, "finish_reason", None)
    for i, tokens in enumerate(res.tokens):
        text = res.text[i] if res.text is not None else None
        if args.json:
            record = {"index": i, "text": text, "tokens": tokens}
            if reasons is not None:
                record["finish_reason"] = reasons[i]
            record.update(acceptance_length=s["acceptance_length"], tokens_per_second=s["tokens_per_second"])
            print(json.dumps(record), flush=True)
        else:
            if len(prompts) > 1:
                print(f"--- prompt {i} ---")
            print(text if text is not None else " ".join(map(str, tokens)), flush=True)
    print(
        f"{len(prompts)} request(s), {s['new_tokens']} new tokens: acceptance length "
        f"{s['acceptance_length']:.2f} tokens per target forward, {s['tokens_per_second']:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def _stream(stream, target, draft, prompt, kwargs: dict) -> int:
    """Print the text of `fspec.stream` as it arrives (token ids when the target has no tokenizer)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "progress"}
    _check_accepted(stream, kwargs, "fspec.stream")
    n, reason = 0, None
    for chunk in stream(target, draft, prompt, **kwargs):
        tokens = list(getattr(chunk, "tokens", None) or ())
        text = getattr(chunk, "text", None)
        # without a tokenizer the chunks carry ids only: print those
        piece = (
            text if target.tokenizer is not None and text is not None else "".join(f"{t} " for t in tokens)
        )
        sys.stdout.write(piece)
        sys.stdout.flush()
        n += len(tokens)
        reason = getattr(chunk, "finish_reason", None) or reason
    print()
    print(f"{n} new tokens" + (f", finish reason {reason}" if reason else ""), file=sys.stderr)
    return 0


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate from a local checkpoint (HF directory or .gguf), with an optional draft head",
        description="Speculative generation (target-only without --draft) from a local HF directory or "
        "GGUF file. Prints each request's text (streamed when there is one request and fspec.stream "
        "exists), then the acceptance length and tokens/s on stderr; --json prints one JSON object per "
        "request instead (index, text, tokens, finish_reason where generate reports it, and the batch's "
        "acceptance_length and tokens_per_second).",
    )
    a = gen.add_argument
    a("--target", required=True, help="target: HF directory (config.json, *.safetensors) or .gguf file")
    a("--draft", default=None, help="draft head directory (EAGLE-1, EAGLE-3 or MTP layout)")
    a("--prompt", action="append", help="prompt text, repeatable (the target needs a tokenizer)")
    a("--tokens", action="append", help="prompt token ids separated by spaces or commas, repeatable")
    a(
        "--prompts-file",
        default=None,
        help='JSONL: {"prompt": str} or {"messages": [...]} a line, optional "temperature" and "seed"',
    )
    a("--chat", action="store_true", help="each prompt text is one user message through the chat template")
    a("--max-new-tokens", type=int, default=64, help="new tokens per request at most (default 64)")
    a("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    a("--seed", type=int, default=0, help="sampling seed (default 0)")
    a(
        "-k",
        "--num-speculative-steps",
        dest="k",
        type=int,
        default=None,
        help="draft tokens per round (default: the head's)",
    )
    a("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    a("--top-p", type=float, default=None, help="sample from the smallest set of probability >= p")
    a(
        "--min-p",
        type=float,
        default=None,
        help="drop tokens below min_p times the most likely one's probability",
    )
    a("--stop", action="append", default=None, help="stop string, repeatable")
    a("--stop-token-id", type=int, action="append", default=None, help="stop token id, repeatable")
    a("--ignore-eos", action="store_true", help="do not stop at the EOS tokens")
    a("--min-new-tokens", type=int, default=None, help="no EOS or stop before this many new tokens")
    a("--eos-token-id", type=int, default=None, help="the EOS token id (instead of the config's)")
    a("--compile", action="store_true", help="CUDA graphs (torch.compile) for the draft loop and the target")
    a("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    a("--dtype", choices=DTYPES, default=None, help="weights' dtype (default: the checkpoint's)")
    a("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a("--json", action="store_true", help="one JSON object a line per request")
    a("--no-stream", action="store_true", help="print the text at the end, even for one request")
    gen.set_defaults(func=_generate)


# --- fspec distill ------------------------------------------------------------------------------------------

DISTILL_USAGE = """Distill a draft head against a frozen target (`fspec.train.distill`; the same as
`python -m fspec.train.distill train`, which `fspec distill train ...` also spells). Training data: --data
(a text file, or a directory whose text files are read recursively), --tokens (a 1-D token file), --offline
(a store written by `fspec distill precompute`), else the standard library's training split."""


def _distill_common(p: argparse.ArgumentParser) -> None:
    from fspec.models.heads import names

    a = p.add_argument
    a("--target", required=True, help="HF directory (or .gguf file) of the frozen target")
    a("--out", required=True, help="output directory")
    a("--kind", default="eagle3", choices=names(), help="head kind")
    a(
        "--data",
        default=None,
        help="text file, or directory of text files (UTF-8; others skipped), tokenized "
        "with the target's tokenizer, each file followed by <|endoftext|> (else the config's EOS)",
    )
    a("--tokens", default=None, help="1-D token file (.npy or torch.save)")
    a("--max-files", type=int, default=0, help="use only the first N files of --data or the stdlib (0 = all)")
    a("--seq-len", type=int, default=512, help="tokens per training window")
    a("--device", default=None, help="torch device (None: cuda when available, else cpu)")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help (not for required options, which have none)."""

    def _get_help_string(self, action):
        return action.help if action.required else super()._get_help_string(action)


def _distill_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    fmt = _Defaults
    tr = _Parser(prog="fspec distill", description=DISTILL_USAGE, formatter_class=fmt)
    _distill_common(tr)
    a = tr.add_argument
    a("--offline", default=None, help="a store written by `fspec distill precompute` (instead of the target)")
    a(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="EAGLE-3: the most frequent N tokens (None: the whole vocabulary)",
    )
    a(
        "--tie-lm-head",
        action="store_true",
        help="EAGLE-3: the output layer is the target's lm_head rows of its vocabulary (frozen, not saved)",
    )
    a("--init", default=None, help="start from this head checkpoint")
    a("--resume", default=None, help="continue this checkpoint directory (train_state.pt) bit-exactly")
    a("--steps", type=int, default=1000, help="optimizer steps")
    a("--batch-size", type=int, default=8, help="sequences per step over all processes")
    a("--lr", type=float, default=1e-3, help="peak learning rate")
    a("--warmup-steps", type=int, default=50, help="linear warm-up steps")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("--max-grad-norm", type=float, default=0.5, help="gradient clipping norm")
    a("--ttt-steps", type=int, default=7, help="K, unrolled head steps")
    a("--step-weight", type=float, default=0.8, help="w, step j weighs w^j")
    a(
        "--feed",
        default="prediction",
        choices=("prediction", "data"),
        help="what the head reads at step j > 0",
    )
    a("--seed", type=int, default=0, help="data and initialization seed")
    a("--log-every", type=int, default=10, help="steps between log records")
    a("--save-every", type=int, default=0, help="steps between checkpoints (0 = at the end only)")
    a("--log-jsonl", default=None, help="append metric records to this file")
    a("--autocast", action="store_true", help="bf16 autocast on CUDA")
    a("--no-progress", action="store_true", help="no progress bar")
    pc = _Parser(
        prog="fspec distill precompute",
        description="Write the target's outputs for offline distillation (`fspec distill --offline DIR`).",
        formatter_class=fmt,
    )
    _distill_common(pc)
    pc.add_argument("--num-sequences", type=int, default=1024, help="windows to store")
    pc.add_argument("--batch-size", type=int, default=8, help="windows per target forward")
    return tr, pc


def data_tokens(path, tokenizer, eos: int | None, *, max_files: int = 0):
    """--data as one 1-D int64 tensor: the text file `path`, or every UTF-8 file under the directory `path`
    (sorted; the first max_files when > 0), each followed by `eos` (when not None)."""
    import torch

    from fspec.train.data import read_texts

    root = Path(path)
    if root.is_dir():
        files = sorted(f for f in root.rglob("*") if f.is_file() and not f.name.startswith("."))
    elif root.is_file():
        files = [root]
    else:
        raise UsageError(
            f"--data: expected a text file or a directory of them, got {str(root)!r} (no such path)"
        )
    texts = [t for t in read_texts(files[:max_files] if max_files else files) if t]
    if not texts:
        raise UsageError(f"--data: expected UTF-8 text under {str(root)!r}, found none")
    ends = [eos] if eos is not None else []
    return torch.tensor(
        [t for enc in tokenizer.encode_batch(texts) for t in enc.ids + ends], dtype=torch.int64
    )


def _data_to_token_file(args: argparse.Namespace, folder: str) -> None:
    """Replace --data by a --tokens file in `folder`, tokenized with the target's tokenizer."""
    import numpy as np

    if args.tokens or getattr(args, "offline", None):
        raise UsageError("--data: expected alone, got it with --tokens or --offline (one data source)")
    tok, eos = _target_tokenizer(args.target)
    end = tok.token_to_id("<|endoftext|>")
    tokens = data_tokens(args.data, tok, end if end is not None else eos, max_files=args.max_files)
    args.tokens = str(Path(folder) / "data_tokens.npy")
    np.save(args.tokens, tokens.numpy())
    print(f"--data: {tokens.numel()} tokens from {args.data}", file=sys.stderr)


def _target_tokenizer(path):
    """(tokenizer, first EOS id or None) of the target at `path`, without its weights for an HF directory."""
    from tokenizers import Tokenizer

    from fspec.models.checkpoint import load_target

    root = Path(path)
    try:
        if not root.is_dir():  # a .gguf file keeps its vocabulary among the weights
            target = load_target(root)
            tok, eos = target.tokenizer, (target.cfg.eos_token_ids or (None,))[0]
        else:
            file = root / "tokenizer.json"
            tok = Tokenizer.from_file(str(file)) if file.is_file() else None
            config = (
                json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
            )
            eos = config.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"--target: {e}") from None
    if tok is None:
        raise UsageError(f"--data: expected a target with a tokenizer (tokenizer.json), got none in {path}")
    return tok, eos


def _distill(argv: list[str]) -> int:
    from fspec.train import distill

    train, precompute = _distill_parsers()
    if argv[:1] == ["precompute"]:
        args, run = precompute.parse_args(argv[1:]), distill._precompute
    else:
        args, run = train.parse_args(argv[1:] if argv[:1] == ["train"] else argv), distill._train
    with tempfile.TemporaryDirectory() as folder:
        if args.data:
            _data_to_token_file(args, folder)
        return run(args)


# --- entry point --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the command line on `argv` (default: sys.argv[1:]); returns the exit code (2: a bad input, reported
    as one `fspec: error: ...` line on stderr)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["distill"]:
            return _distill(argv[1:])
        args = _parser().parse_args(argv)
        return args.func(args)
    except (UsageError, ValueError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"fspec: error: {message}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fspec", description="Speculative decoding as a pure step function.")
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
    demo.add_argument(
        "-k",
        type=int,
        default=3,
        help="draft tokens per round (default 3: on the CPU K + 1 verification rows cost more as K grows, "
        "and 3 gave the best speed-up of K = 2..5 over held-out prompts 1-6 of both sets, docs/serve.md)",
    )
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--prompt", default=None, help="your own user message (default: a held-out prompt)")
    demo.add_argument("--set", default="chat", help="held-out set of the default prompt (chat or code)")
    demo.add_argument("--index", type=int, default=0, help="which prompt of that set (default 0)")
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable speed)")
    demo.set_defaults(func=_demo)
    _add_generate(sub)
    sub.add_parser("distill", help="distill a draft head (`fspec distill --help`)", add_help=False)
    return parser


if __name__ == "__main__":
    sys.exit(main())
