"""The `fspec` command line.

`fspec demo` shows, on CPU, what runs today: a draft state pytree and its attention metadata advancing on
the device across a KV-cache block boundary. Speculative generation on the embedded default model will
replace it when the engine lands (see README.md, "Status").
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _demo(args: argparse.Namespace) -> int:
    import fspec

    model = fspec.ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    cfg = fspec.DraftConfig(
        kind="eagle", model=model, num_speculative_steps=args.k, block_size=args.block_size, max_model_len=64
    )
    # Two requests and one padding row; request 0 starts two tokens before a block boundary.
    positions = torch.tensor([args.block_size - 2, 5, -1])
    table = torch.tensor([[3, 7, 1, 0], [2, 6, 4, 5], [-1, -1, -1, -1]], dtype=torch.int32)
    meta = fspec.decode_metadata(positions, table, block_size=cfg.block_size)
    state = fspec.init_draft_state(
        torch.tensor([1, 2, 0]),
        torch.zeros(3, model.hidden_size),
        meta,
        cfg=cfg,
        temperature=[0.0, 0.8, 0.0],
        seed=[1, 2, 0],
    )
    rows = []
    for step in range(cfg.num_speculative_steps):
        rows.append(
            {
                "step": step,
                "positions": state.attn.positions.tolist(),
                "seq_lens": state.attn.seq_lens.tolist(),
                "slot_mapping": state.attn.slot_mapping.tolist(),
            }
        )
        attn = fspec.advance(state.attn, block_size=cfg.block_size, max_model_len=cfg.max_model_len)
        state = fspec.replace(state, attn=attn, step=state.step + 1)
    print(
        f"draft state: {len(fspec.tree.tree_leaves(state))} tensor leaves, K={cfg.num_speculative_steps}, "
        f"block_size={cfg.block_size}; row 2 is padding"
    )
    for r in rows:
        print(
            f"  step {r['step']}: positions {r['positions']}  seq_lens {r['seq_lens']}  "
            f"slots {r['slot_mapping']}"
        )
    print(json.dumps({"demo": "metadata", "steps": rows}))
    return 0


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
        help="show a draft state and its metadata advancing across a block boundary (CPU)",
        description="Builds a small draft state and advances its attention metadata K times on the device, "
        "printing positions, sequence lengths and KV-cache slots, then one line of JSON.",
    )
    demo.add_argument("-k", type=int, default=4, help="draft steps to show (default 4)")
    demo.add_argument("--block-size", type=int, default=4, help="KV-cache block size (default 4)")
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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
