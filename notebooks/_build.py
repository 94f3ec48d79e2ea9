"""Generate (and optionally execute) the research notebooks from the Python cell lists below.

The .ipynb files are build outputs of this script: review and edit the cells here, then regenerate.

    python notebooks/_build.py                                      # write the notebooks, no outputs
    FSPEC_NOTEBOOK_FULL=1 python notebooks/_build.py --execute      # full size: the committed outputs
    python notebooks/_build.py --execute 01_pure_draft_step.ipynb   # one notebook, tiny size

Executed notebooks carry no timing metadata, and the build fails if an output contains an absolute path of
this machine (so committed outputs never leak a home directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent


def md(source: str) -> tuple[str, str]:
    return ("markdown", source)


def code(source: str) -> tuple[str, str]:
    return ("code", source)


# ----------------------------------------------------------------------------------------------------------
# 01_pure_draft_step.ipynb
# ----------------------------------------------------------------------------------------------------------

NB01: list[tuple[str, str]] = [
    md("""
    # 01 — The draft step is a pure function

    fspec's draft loop is `draft_step(params, state, cache, *, cfg) -> (state, cache)` over an immutable
    state pytree. On a tiny random Llama-family target with an EAGLE-3 head (CPU, PyTorch reference ops),
    this notebook shows:

    1. the state pytree and its leaves (`fspec.tree`);
    2. one `draft_step`, after which the input state is bit-identical (the KV cache is the one donated
       argument);
    3. the attention metadata advancing on the device: positions, `seq_lens` and the slot mapping crossing
       KV-cache block boundaries;
    4. `torch.func.vmap` over a batch of metadata states, and over several heads;
    5. `torch.func.grad` through one step of the dense head with respect to the head's parameters.

    Every claim in the text is an `assert` in a code cell, so CI fails when one stops being true. CI runs the
    notebook at tiny sizes; `FSPEC_NOTEBOOK_FULL=1` selects the size of the committed outputs.
    """),
    code("""
    import os
    import warnings

    import matplotlib.pyplot as plt
    import torch

    import fspec

    # vmap of CPU SDPA falls back to a loop over the batch and says so (with a path of this machine).
    warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
    FULL = os.environ.get("FSPEC_NOTEBOOK_FULL") == "1"
    if FULL:  # the committed outputs
        V, H, N, NKV, LAYERS, VD, K, BS, PROMPT_LENS = 512, 128, 8, 2, 8, 256, 7, 8, [5, 13, 22]
    else:  # CI
        V, H, N, NKV, LAYERS, VD, K, BS, PROMPT_LENS = 128, 32, 4, 2, 4, 64, 4, 4, [3, 6, 10]
    MAX_LEN = 64
    print(f"{'full' if FULL else 'tiny'} size: V={V}, H={H}, heads {N}/{NKV}, {LAYERS} target layers, "
          f"Vd={VD}, K={K}, block_size={BS}, prompt lengths {PROMPT_LENS}")


    def show_table(header, rows):
        \"\"\"Print rows as an aligned text table.\"\"\"
        cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(header)]
        widths = [max(map(len, c)) for c in cols]
        for j in range(len(rows) + 1):
            print("  ".join(c[j].rjust(w) for c, w in zip(cols, widths)))
            if j == 0:
                print("  ".join("-" * w for w in widths))


    def bits(tree):
        \"\"\"Each leaf's raw bytes: bit-identical is byte-identical (NaN payloads and -0.0 included).\"\"\"
        return [x.detach().reshape(-1).view(torch.uint8).clone() for x in fspec.tree.tree_leaves(tree)]


    def same(a, b):
        \"\"\"Two pytrees with equal leaves (shapes, dtypes and values).\"\"\"
        xs, ys = fspec.tree.tree_leaves(a), fspec.tree.tree_leaves(b)
        return len(xs) == len(ys) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(xs, ys))
    """),
    md("""
    ## A tiny target and an EAGLE-3 head

    Random weights: the drafts mean nothing, the mechanics are the real ones. `fspec.init_draft` builds a
    one-layer head with the target's layer shapes; EAGLE-3 reads the hidden states of three target layers and
    drafts over a reduced vocabulary of `Vd` target ids (`draft_ids`).
    """),
    code("""
    cfg = fspec.ModelConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS,
        num_attention_heads=N, num_key_value_heads=NKV, head_dim=H // N, max_position_embeddings=MAX_LEN,
    )
    target = fspec.Target(cfg=cfg, params=fspec.models.llama.init(cfg, seed=0))
    draft_ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:VD].sort().values


    def make_head(seed):
        return fspec.init_draft(
            target, kind="eagle3", seed=seed, num_speculative_steps=K, draft_vocab_size=VD,
            draft_ids=draft_ids, block_size=BS, max_model_len=MAX_LEN,
        )


    draft = make_head(seed=1)
    dcfg, dparams = draft.cfg, draft.params
    print(f"{dcfg.kind} head: reads target layers {dcfg.target_layer_ids}, K={dcfg.num_speculative_steps}, "
          f"Vd={dcfg.draft_vocab_size}, shares {draft.shared} with the target")
    """),
    md("""
    ## A paged KV cache and its block table

    Three requests with prompts of different lengths, and one padding row (a finished request, or filler up to
    the batch bucket: its positions and slots are -1). Blocks are handed out one at a time per request,
    round-robin, as an engine does while requests grow, so a request's blocks need not be adjacent in the
    cache.
    """),
    code("""
    B = len(PROMPT_LENS) + 1  # the last row is padding
    MAX_BLOCKS = MAX_LEN // BS
    alloc = fspec.BlockAllocator(num_blocks=B * MAX_BLOCKS)
    need = [fspec.blocks_needed(n + K + 1, BS) for n in PROMPT_LENS]  # prompt, first token, K drafts
    blocks = [[] for _ in PROMPT_LENS]
    for j in range(max(need)):
        for b in range(len(PROMPT_LENS)):
            if j < need[b]:
                blocks[b] += alloc.allocate(1)
    block_table = torch.stack([fspec.block_table_row(ids, max_blocks=MAX_BLOCKS) for ids in blocks + [[]]])
    print("block_table [B, max_blocks] (-1 = not allocated):")
    print(block_table)
    """),
    md("""
    ## Prefill, then the first draft state

    The target runs over the prompts — a ragged prefill: `first_step_metadata` gives each request
    `Q = max prompt length` rows, live ones first, padding -1 — and writes its own paged cache. Its greedy
    token at each request's last live row is the first new token. The head's first step runs over the same
    rows and pairs the target's hidden state at position i with the token at i + 1 (EAGLE's shift), so the
    new token lands in the last live row. `init_draft_state` allocates the `[B, K]` draft buffers once;
    per-request temperatures (0 = greedy) and seeds are tensors in the state.
    """),
    code("""
    gen = torch.Generator().manual_seed(2)
    Q = max(PROMPT_LENS)
    prompts = torch.zeros(B, Q, dtype=torch.int64)
    for b, n in enumerate(PROMPT_LENS):
        prompts[b, :n] = torch.randint(0, V, (n,), generator=gen)
    lens = torch.tensor(PROMPT_LENS + [0])
    starts = torch.tensor([0] * len(PROMPT_LENS) + [-1])  # -1: a padding request
    meta = fspec.first_step_metadata(starts, lens, block_table, num_query=Q, block_size=BS)

    tcache = fspec.KVCache.create(cfg, num_blocks=alloc.num_blocks, block_size=BS)
    logits, target_hidden, tcache = fspec.models.llama.forward(
        target.params, prompts.view(-1), meta, tcache, cfg=cfg, aux_layer_ids=dcfg.target_layer_ids,
        max_query_len=Q,
    )  # [B*Q, V], TargetHidden(last [B*Q, H], aux [B*Q, 3H])
    last = torch.arange(B) * Q + (lens - 1).clamp(min=0)  # each request's last live row
    first_token = logits[last].argmax(-1)  # [B]: greedy target

    shifted = torch.cat([prompts[:, 1:], torch.zeros(B, 1, dtype=torch.int64)], dim=1)
    shifted[torch.arange(B), (lens - 1).clamp(min=0)] = first_token
    hidden = fspec.project_target_hidden(dparams, target_hidden, cfg=dcfg)  # EAGLE-3: fc over 3 layers
    dcache = fspec.KVCache.create(dcfg.model, num_blocks=alloc.num_blocks, block_size=BS)
    state0 = fspec.init_draft_state(
        shifted.view(-1), hidden, meta, cfg=dcfg, temperature=[0.0, 0.8, 1.0, 0.0], seed=[11, 12, 13, 0]
    )
    print("first new token per request:", first_token[:-1].tolist())
    """),
    md("""
    ## The state pytree

    `DraftState` is a frozen dataclass registered twice: with optree under the namespace `"fspec"` (what
    `fspec.tree` walks) and with `torch.utils._pytree` (what `torch.func` and `torch.compile` walk). Both see
    the same twelve tensor leaves in the same order. At a round's first step it carries `T = B·Q` query rows.
    """),
    code("""
    paths, leaves, _ = fspec.tree.tree_flatten_with_path(state0)
    dtype_name = lambda x: str(x.dtype).removeprefix("torch.")
    show_table(
        ["leaf", "shape", "dtype"],
        [(".".join(map(str, p)), list(x.shape), dtype_name(x)) for p, x in zip(paths, leaves)],
    )
    assert len(leaves) == 12 and all(isinstance(x, torch.Tensor) for x in leaves)
    torch_leaves = torch.utils._pytree.tree_leaves(state0)
    assert len(torch_leaves) == len(leaves) and all(a is b for a, b in zip(leaves, torch_leaves))
    try:
        state0.step = torch.tensor(1)
    except AttributeError as e:  # dataclasses.FrozenInstanceError
        print(f"\\nassigning a field raises {type(e).__name__}: states change only through fspec.replace")
    else:
        raise AssertionError("DraftState should be frozen")
    """),
    md("""
    ## One draft step; the input state is untouched

    `draft_step` embeds the tokens, runs the head's decoder layer (writing K/V at `attn.slot_mapping`,
    attending over each request's blocks up to `seq_lens`), samples one token per request from its last live
    row into column `state.step` — the column comes from the tensor, not from a Python int — and returns a new
    state. Every leaf of the input state is bit-identical afterwards. The KV cache is donated, like
    `jax.jit(..., donate_argnums=...)`: written in place and returned; use the returned handle.

    Same inputs, same outputs: sampling noise is a counter-based function of (seed, position, token id), so
    calling the step again on the same state gives the same new state, bit for bit. And the column is data:
    the same state with `step = 2` writes the same token into column 2 and leaves the others untouched.
    """),
    code("""
    before = bits(state0)
    cache_before = dcache.k.clone()
    state1, dcache1 = fspec.draft_step(dparams, state0, dcache, cfg=dcfg)

    assert all(torch.equal(x, y) for x, y in zip(before, bits(state0))), "the input state changed"
    assert dcache1 is dcache and not torch.equal(cache_before, dcache.k), "the cache is donated"
    again, dcache = fspec.draft_step(dparams, state0, dcache1, cfg=dcfg)
    assert all(torch.equal(x, y) for x, y in zip(bits(state1), bits(again))), "same inputs, same outputs"
    col2, dcache = fspec.draft_step(dparams, fspec.replace(state0, step=torch.tensor(2)), dcache, cfg=dcfg)
    assert torch.equal(col2.draft_tokens[:, 2], state1.draft_tokens[:, 0]), "column 2, the same token"
    assert (col2.draft_tokens[:, [k for k in range(K) if k != 2]] == -1).all(), "other columns untouched"

    show_table(
        ["leaf", "state0 (first step)", "state1 (decode)"],
        [(".".join(map(str, p)), list(x.shape), list(y.shape))
         for p, x, y in zip(paths, leaves, fspec.tree.tree_leaves(state1))],
    )
    print("\\nstep:", int(state0.step), "->", int(state1.step))
    print("draft_tokens [B, K] after one step (target ids, -1 = not yet drafted):")
    print(state1.draft_tokens)
    """),
    md("""
    ## K steps: the metadata advances on the device

    Each step's metadata is a pure function of the previous step's, computed with tensor ops — no host work
    between steps, so a captured CUDA graph can never replay stale metadata. After the first step,
    `decode_after` places one row per request at position `seq_lens`; every later step is `advance`:
    positions + 1, `seq_lens` + 1, the slot mapping recomputed from the block table, padding rows kept at -1.
    Decode steps keep every leaf's shape, dtype and device (a change would recompile a captured graph), and
    `propose`, the whole K-step rollout, drafts exactly what K calls of `draft_step` draft.
    """),
    code("""
    states = [state0, state1]
    cache = dcache
    for _ in range(K - 1):
        nxt, cache = fspec.draft_step(dparams, states[-1], cache, cfg=dcfg)
        states.append(nxt)

    for s, t in zip(states[1:], states[2:]):
        for x, y in zip(fspec.tree.tree_leaves(s), fspec.tree.tree_leaves(t)):
            assert (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device)
    assert same(fspec.decode_after(state0.attn, block_size=BS, max_model_len=MAX_LEN), states[1].attn)
    for s, t in zip(states[1:], states[2:]):
        assert same(fspec.advance(s.attn, block_size=BS, max_model_len=MAX_LEN), t.attn)

    proposed, cache = fspec.propose(dparams, state0, cache, cfg=dcfg)
    assert torch.equal(proposed.draft_tokens, states[-1].draft_tokens)
    assert torch.equal(proposed.draft_probs, states[-1].draft_probs)
    print(f"draft_tokens [B, K] after {K} steps (the padding row drafts too; its tokens are ignored):")
    print(proposed.draft_tokens)
    """),
    md("""
    ### The metadata, step by step

    For each step that runs (0 .. K-1): the position, `seq_lens` and cache slot of the row each request
    writes (at step 0, its last live row). `*` marks a step whose row lies in a different cache block from
    the previous step's: the slot moves to the first slot of the request's next block, which need not be
    adjacent in the cache (the round-robin allocation above interleaves requests). The slot always
    equals `block_table[b, pos // block_size] * block_size + pos % block_size`, which the public
    `fspec.slot_mapping` computes too; two live rows never share a slot.
    """),
    code("""
    live_req = range(len(PROMPT_LENS))
    written = lambda i: last if i == 0 else slice(None)  # the rows step i writes: one per request
    pos = torch.stack([s.attn.positions[written(i)] for i, s in enumerate(states[:K])])  # [K, B]
    seq = torch.stack([s.attn.seq_lens for s in states[:K]])  # [K, B]
    slot = torch.stack([s.attn.slot_mapping[written(i)] for i, s in enumerate(states[:K])])  # [K, B]

    rows = []
    for i in range(K):
        for b in range(B):
            crossed = i > 0 and b in live_req and pos[i, b] // BS != pos[i - 1, b] // BS
            blk = int(block_table[b, pos[i, b] // BS]) if pos[i, b] >= 0 else "-"
            rows.append((i, b if b in live_req else f"{b} (pad)", int(pos[i, b]), int(seq[i, b]), blk,
                         int(slot[i, b]), "*" if crossed else ""))
    show_table(["step", "request", "position", "seq_lens", "block", "slot", "new block"], rows)

    lv = pos[:, : len(PROMPT_LENS)]
    assert torch.equal(lv[1:], lv[:-1] + 1), "live positions advance by one per step"
    assert torch.equal(seq[:, : len(PROMPT_LENS)].long(), lv + 1), "seq_lens = position + 1"
    expected = block_table[torch.arange(B), (pos.clamp(min=0) // BS)].long() * BS + pos.clamp(min=0) % BS
    assert torch.equal(slot[:, : len(PROMPT_LENS)], expected[:, : len(PROMPT_LENS)])
    assert torch.equal(slot.T, fspec.slot_mapping(block_table, pos.T, BS)), "fspec.slot_mapping agrees"
    assert (pos[:, -1] == -1).all() and (seq[:, -1] == 0).all() and (slot[:, -1] == -1).all(), "padding"
    assert slot[:, : len(PROMPT_LENS)].unique().numel() == K * len(PROMPT_LENS), "no slot written twice"
    crossings = [(i, b) for b in live_req for i in range(1, K) if lv[i, b] // BS != lv[i - 1, b] // BS]
    assert {b for _, b in crossings} == set(live_req), "every request crosses a block boundary"
    assert all(slot[i, b] % BS == 0 for i, b in crossings), "a crossing lands on a block's first slot"
    assert any(slot[i, b] != slot[i - 1, b] + 1 for i, b in crossings), "some land in a non-adjacent block"
    """),
    code("""
    fig, (ax_pos, ax_slot) = plt.subplots(1, 2, figsize=(11, 4))
    steps = list(range(K))
    for b in range(B):
        pad = b not in live_req
        style = dict(color="0.6", linestyle="--", marker="x") if pad else dict(marker="o")
        label = f"request {b}" + (" (padding)" if pad else f" (prompt {PROMPT_LENS[b]})")
        ax_pos.plot(steps, pos[:, b], label=label, **style)
        line, = ax_slot.plot(steps, slot[:, b], label=label, **style)
        marks = [i for i, r in crossings if r == b]
        ax_slot.scatter(marks, slot[marks, b], s=160, facecolors="none", edgecolors=line.get_color())
    ax_pos.set(title="position of the row each request writes", xlabel="draft step", ylabel="position")
    ax_slot.set(title="its KV-cache slot (circles: first slot of a new block)", xlabel="draft step",
                ylabel="slot = block * block_size + offset")
    for ax in (ax_pos, ax_slot):
        ax.set_xticks(steps)
        ax.grid(alpha=0.3)
    fig.legend(*ax_pos.get_legend_handles_labels(), loc="lower center", ncol=B, fontsize=9)
    fig.suptitle(f"metadata advance over K={K} draft steps, block_size={BS}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    plt.show()
    """),
    md("""
    ## `vmap` over a batch of states

    `torch.func.vmap` walks the same pytree. Stack the decode metadata of steps 1 .. K-1 into one
    `AttnMetadata` with a leading batch axis and advance all of them in a single call: the result equals the
    stacked metadata of steps 2 .. K.
    """),
    code("""
    stack = lambda trees: fspec.tree.tree_map(lambda *xs: torch.stack(xs), *trees)
    batched = stack([s.attn for s in states[1:K]])
    advanced = torch.func.vmap(lambda m: fspec.advance(m, block_size=BS, max_model_len=MAX_LEN))(batched)
    assert same(advanced, stack([s.attn for s in states[2 : K + 1]]))
    show_table(["leaf", "batched shape"],
               [(".".join(map(str, p)), list(x.shape))
                for p, x in zip(*fspec.tree.tree_flatten_with_path(advanced)[:2])])
    """),
    md("""
    Several heads at once: stack the parameters of three heads (seeds 1, 2, 3) and `vmap` the dense,
    differentiable head step over them — the pattern for training several heads in one program
    (`torch.func.stack_module_state` does this for modules; fspec's parameters are already a dict pytree).
    The inputs are what distillation feeds a head: tokens at i + 1 paired with the target's hidden states at
    i, from the target's dense forward.
    """),
    code("""
    S = 16 if FULL else 6
    seqs = torch.randint(0, V, (2, S + 1), generator=gen)  # 2 training sequences of S + 1 tokens
    target_logits, th = fspec.models.llama.forward_dense(
        target.params, seqs, cfg=cfg, aux_layer_ids=dcfg.target_layer_ids
    )  # [2, S+1, V], TargetHidden(aux [2, S+1, 3H])
    ids_in = seqs[:, 1:]  # [2, S]: the token at i + 1 ...
    aux_in = fspec.models.TargetHidden(last=th.last[:, :-1], aux=th.aux[:, :-1])  # ... with the target at i

    heads = [make_head(seed).params for seed in (1, 2, 3)]
    dense = lambda p: fspec.head_forward_dense(
        p, ids_in, fspec.project_target_hidden(p, aux_in, cfg=dcfg), cfg=dcfg
    )
    logits_v, out_v = torch.func.vmap(dense)(stack(heads))  # [3, 2, S, Vd], [3, 2, S, H]
    for i, p in enumerate(heads):
        lg, out = dense(p)
        assert torch.allclose(logits_v[i], lg, atol=1e-5) and torch.allclose(out_v[i], out, atol=1e-5)
    print("vmapped logits", list(logits_v.shape), "= 3 heads x 2 sequences x S positions x Vd")
    """),
    md("""
    ## `grad` through one step of the dense head

    The loss is the cross-entropy of the head's draft-vocabulary logits against the target's next-token
    distribution over the same ids (row i predicts the token at i + 2, which the target predicts at i + 1) —
    one step of EAGLE-3's training-time test. `torch.func.grad` differentiates with respect to the head's own
    float parameters (the fc over the target's three layers, the decoder layer, the norm and the lm_head); the
    shared target embedding and the integer `d2t` / `t2d` maps stay fixed. The gradient equals
    `torch.autograd`'s, leaves the parameters untouched, and one small step along it lowers the loss.
    """),
    code("""
    p_target = target_logits[:, 1:].softmax(-1)[..., draft_ids]  # [2, S, Vd]
    fixed = {k: v for k, v in dparams.items() if k in ("embed", "d2t", "t2d")}
    trainable = {k: v for k, v in dparams.items() if k not in fixed}


    def loss_fn(trainable):
        logits, _ = dense({**fixed, **trainable})  # [2, S, Vd]
        return -(p_target * logits.log_softmax(-1)).sum(-1).mean()


    params_before = bits(trainable)
    grads, loss = torch.func.grad_and_value(loss_fn)(trainable)
    assert all(torch.equal(x, y) for x, y in zip(params_before, bits(trainable))), "parameters untouched"

    gpaths, gleaves, _ = fspec.tree.tree_flatten_with_path(grads)
    norms = [float(g.norm()) for g in gleaves]
    names = [".".join(map(str, p)) for p in gpaths]
    show_table(["parameter", "shape", "grad norm"],
               [(n, list(g.shape), f"{x:.3e}") for n, g, x in zip(names, gleaves, norms)])
    print(f"\\nloss {float(loss):.4f}")

    for g, w in zip(gleaves, fspec.tree.tree_leaves(trainable)):
        assert g.shape == w.shape and torch.isfinite(g).all() and g.norm() > 0
    leaf_copies = fspec.tree.tree_map(lambda w: w.detach().clone().requires_grad_(), trainable)
    loss_fn(leaf_copies).backward()
    for g, w in zip(gleaves, fspec.tree.tree_leaves(leaf_copies)):
        assert torch.allclose(g, w.grad, rtol=1e-4, atol=1e-7), "torch.func.grad == torch.autograd"
    lr = 1e-2 / max(norms)
    stepped = fspec.tree.tree_map(lambda w, g: w - lr * g, trainable, grads)
    assert loss_fn(stepped) < loss, "a small step along -grad lowers the loss"
    """),
    code("""
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(names) + 1.2))
    ax.barh(names, norms)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set(title="gradient norm per head parameter (one dense step, EAGLE-3 head)",
           xlabel="||dL/dw|| (log scale)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## What this shows

    - A draft step is a function: the input state is bit-identical after the call, and the same inputs give
      the same outputs. The KV cache is the one donated argument.
    - The attention metadata of step i+1 is `advance` (or, after the first step, `decode_after`) of step i:
      computed on the device with fixed shapes, correct across block boundaries, with padding rows inert.
    - fspec's pytrees — the state, its metadata, the parameter dicts — go straight through `fspec.tree`,
      `torch.utils._pytree`, `torch.func.vmap` and `torch.func.grad`.
    """),
]

# ----------------------------------------------------------------------------------------------------------
# 04_performance.ipynb
# ----------------------------------------------------------------------------------------------------------

BENCHMARKS = ("attention", "sampling", "draft_loop", "generate")


def _command(cmd: str) -> str:
    """A benchmark command, absolute paths (the GPU host's directories) shortened to their file name."""
    return " ".join(Path(t).name if t.startswith("/") else t for t in cmd.split())


def provenance_markdown(results: Path = HERE.parent / "benchmarks" / "results") -> str:
    """The markdown cell that states where each JSON file's numbers come from (regenerated by the build)."""
    import json

    lines = [
        "## Where the numbers come from",
        "",
        "| benchmark | machine | date | torch | triton | copy bandwidth | command |",
        "|---|---|---|---|---|---:|---|",
    ]
    for name in BENCHMARKS:
        path = results / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | — | — | — | — | — | not run yet: `{name}.json` is absent |")
            continue
        d = json.loads(path.read_text())
        lines.append(
            f"| {name} | {d['machine']} | {d['date']} | {d.get('torch', '-')} | {d.get('triton', '-')} "
            f"| {d.get('copy_bandwidth_TBps', '-')} TB/s | `{_command(d['command'])}` |"
        )
    lines += [
        "",
        "This table is written by `notebooks/_build.py` from the JSON files; `tests/test_notebooks.py` fails",
        "when it no longer matches them (rebuild the notebook after a new benchmark run).",
    ]
    return "\n".join(lines)


NB04: list[tuple[str, str]] = [
    md("""
    # 04 — Performance: fspec against its baselines and the bandwidth floor

    The GPU benchmarks in `benchmarks/` each write `benchmarks/results/<name>.json`; this notebook reads them
    and plots fspec beside the baselines that ran in the same process and beside the **bandwidth floor**:
    the bytes a call must move divided by the copy bandwidth measured on the same GPU. Absolute times drift
    between machines; ratios to the floor and to the baselines are what count. A file that is absent (a
    benchmark not run yet) is skipped.

    CI executes this notebook with the first few rows of each file; `FSPEC_NOTEBOOK_FULL=1` plots every row
    (the committed outputs).
    """),
    ("markdown", "@PROVENANCE@"),
    code("""
    import json
    import os
    from pathlib import Path

    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    FULL = os.environ.get("FSPEC_NOTEBOOK_FULL") == "1"
    MAX_ROWS = None if FULL else 6  # CI: the first rows of each file


    def find_results():
        \"\"\"benchmarks/results in the working directory or above it (nbclient runs in notebooks/).\"\"\"
        if os.environ.get("FSPEC_BENCH_RESULTS"):  # another set of results (tests use it)
            return Path(os.environ["FSPEC_BENCH_RESULTS"])
        for d in [Path.cwd(), *Path.cwd().parents]:
            if (d / "benchmarks" / "results").is_dir():
                return d / "benchmarks" / "results"
        raise FileNotFoundError("no benchmarks/results directory in the working directory or above it")


    # The fields each plot reads: a format change in a benchmark script fails here, not in a plot.
    CASE_KEYS = {"attention": ["B", "ctx", "num_query"], "sampling": ["op", "B", "V"],
                 "draft_loop": ["head", "B", "K"], "generate": ["system", "B"]}
    ROW_KEYS = {"attention": ["floor_us", "fspec_graph_us", "flex_us", "sdpa_gather_us"],
                "sampling": ["floor_us", "fspec_graph_us", "fspec_us"],
                "draft_loop": ["floor_us", "compiled_loop_us", "eager_us"],
                "generate": ["tokens_per_s", "floor_tokens_per_s", "acceptance_length", "error"]}


    def load(name):
        path = RESULTS / f"{name}.json"
        if not path.exists():
            print(f"{name}.json: absent, skipped")
            return None
        d = json.loads(path.read_text())
        for key in ("machine", "date", "command", "rows"):
            assert key in d, f"{name}.json: no {key!r}"
        for r in d["rows"]:
            missing = [k for k in CASE_KEYS[name] if k not in r["case"]]
            missing += [k for k in ROW_KEYS[name] if k not in r]
            assert not missing, f"{name}.json: a row without {missing}: {r['case']}"
        d["rows"] = d["rows"][:MAX_ROWS]
        command = " ".join(Path(t).name if t.startswith("/") else t for t in d["command"].split())
        print(f"{name}.json: {len(d['rows'])} rows from {d['machine']}, {d['date']} "
              f"(torch {d.get('torch', '?')}): {command}")
        return d


    def num(x):
        \"\"\"A measured number (a baseline that failed or was skipped records None).\"\"\"
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


    def log_x_ticks(ax, values, fmt=str):
        \"\"\"A log x axis with a tick, labelled by `fmt`, at each measured value only.\"\"\"
        ax.set_xscale("log")
        ax.set_xticks(values, [fmt(v) for v in values])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)


    def log_y(ax):
        \"\"\"A log y axis with plain-number labels: 1-2-5 steps over a narrow range, else decades.\"\"\"
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if hi / lo < 300 else (1.0,)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


    RESULTS = find_results()
    data = {name: load(name) for name in ("attention", "sampling", "draft_loop", "generate")}
    """),
    md("""
    ## Attention: paged decode

    One query row per request over `ctx` cached tokens (32 query / 8 KV heads of 128, bf16, block size 16,
    random non-contiguous block tables). fspec's Triton kernel replayed from a CUDA graph, against
    FlexAttention (compiled, over the same paged cache), SDPA after gathering each request's blocks into a
    dense tensor, and the floor (every K/V byte read once). Both axes are logarithmic. The floor is a model —
    bytes over the bandwidth of a large device-to-device copy measured in the same run — not a hard bound, so
    a ratio can land a little below 1. The table below the plot adds the multi-query rows (the first draft
    step and verification read K + 1 query rows per request).
    """),
    code("""
    ATT_SERIES = [
        ("fspec_graph_us", "fspec (CUDA-graph replay)", dict(marker="o", lw=2.2, color="C0")),
        ("flex_us", "FlexAttention (compiled)", dict(marker="s", color="C1")),
        ("sdpa_gather_us", "SDPA + gather", dict(marker="^", color="C2")),
        ("floor_us", "bandwidth floor", dict(ls="--", color="k")),
    ]
    att = data["attention"]
    if att is None:
        print("nothing to plot: attention.json is absent")
    else:
        dec = [r for r in att["rows"] if r["case"]["num_query"] == 1]
        bs = sorted({r["case"]["B"] for r in dec})
        fig, axes = plt.subplots(1, len(bs), figsize=(3.4 * len(bs) + 1.5, 3.8), squeeze=False)
        for ax, b in zip(axes[0], bs):
            rows = sorted((r for r in dec if r["case"]["B"] == b), key=lambda r: r["case"]["ctx"])
            ctx = [r["case"]["ctx"] for r in rows]
            for key, label, style in ATT_SERIES:
                pts = [(c, r[key]) for c, r in zip(ctx, rows) if num(r.get(key))]
                if pts:
                    ax.plot(*zip(*pts), label=label, **style)
            for c, r in zip(ctx, rows):
                if not num(r.get("flex_us")):
                    ax.annotate("Flex: no result", (c, r["floor_us"]), textcoords="offset points",
                                xytext=(-62, 14), fontsize=7, color="C1")
            log_x_ticks(ax, ctx, lambda c: f"{c // 1024}k")
            log_y(ax)
            ax.set(title=f"B = {b}", xlabel="context tokens per request")
            ax.grid(which="major", alpha=0.3)
        axes[0][0].set_ylabel("µs per call (log scale)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"Paged decode attention — {att['machine']}, {att['date']}")
        fig.tight_layout()
        plt.show()

        print(f"{'B':>4} {'ctx':>6} {'q rows':>6} {'fspec µs':>9} {'floor µs':>9} {'fspec/floor':>11} "
              f"{'best baseline µs':>16} {'fspec/best':>10}")
        for r in att["rows"]:
            c = r["case"]
            base = [r[k] for k in ("flex_us", "sdpa_gather_us") if num(r.get(k))]
            best = min(base) if base else float("nan")
            us = r["fspec_graph_us"]
            print(f"{c['B']:>4} {c['ctx']:>6} {c['num_query']:>6} {us:>9.1f} {r['floor_us']:>9.1f} "
                  f"{us / r['floor_us']:>11.2f} {best:>16.1f} {us / best:>10.2f}")
    """),
    md("""
    ## Sampling and verification

    Time of fspec's sampling ops replayed from a CUDA graph, divided by the floor (the logits read once,
    plus the probabilities `gumbel_sample_into` writes; target logits and draft probabilities read once for
    `rejection_sample`), by batch size `B` and vocabulary `V`. Dashed: `torch.multinomial(softmax(l / T))`
    called eagerly, the usual PyTorch way to sample, over the same floor. 1 on the y axis is the floor. At
    B = 1 the floor is a small fraction of a microsecond (one row of logits), so any fixed per-call cost
    dominates the ratio there; the ratios that matter are those at large B.
    """),
    code("""
    smp = data["sampling"]
    if smp is None:
        print("nothing to plot: sampling.json is absent")
    else:
        ops = list(dict.fromkeys(r["case"]["op"] for r in smp["rows"]))
        vs = sorted({r["case"]["V"] for r in smp["rows"]})
        fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops) + 1, 3.9), squeeze=False)
        for ax, op in zip(axes[0], ops):
            k = None
            for i, v in enumerate(vs):
                rows = sorted((r for r in smp["rows"] if r["case"]["op"] == op and r["case"]["V"] == v),
                              key=lambda r: r["case"]["B"])
                if not rows:
                    continue
                k = rows[0]["case"].get("K")
                b = [r["case"]["B"] for r in rows]
                ax.plot(b, [r["fspec_graph_us"] / r["floor_us"] for r in rows], marker="o", color=f"C{i}",
                        label=f"fspec, graph replay, V = {v:,}")
                mult = [(r["case"]["B"], r["torch_multinomial_us"] / r["floor_us"])
                        for r in rows if num(r.get("torch_multinomial_us"))]
                if mult:
                    ax.plot(*zip(*mult), ls="--", marker="x", color=f"C{i}",
                            label=f"torch.multinomial, V = {v:,}")
            ax.axhline(1.0, color="k", ls=":", lw=1, label="floor")
            bs = sorted({r["case"]["B"] for r in smp["rows"] if r["case"]["op"] == op})
            log_x_ticks(ax, bs)
            log_y(ax)
            ax.set(title=op + (f" (K = {k})" if k else ""), xlabel="batch size B")
            ax.grid(which="major", alpha=0.3)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("time / bandwidth floor (log scale)")
        fig.suptitle(f"Sampling ops — {smp['machine']}, {smp['date']}")
        fig.tight_layout()
        plt.show()
    """),
    md("""
    ## Draft loop

    µs per draft step of an EAGLE-3 head (`propose` ÷ K) with `ctx` tokens per request already cached:
    the whole K-step loop compiled into one CUDA graph (fspec's primary path), one compiled step replayed K
    times, eager PyTorch, and the floor (the head's weights and the K/V read once per step).
    """),
    code("""
    dl = data["draft_loop"]
    if dl is None:
        print("nothing to plot: draft_loop.json is absent (run benchmarks/bench_draft_loop.py on a GPU)")
    else:
        DL_SERIES = [
            ("compiled_loop_us", "compiled whole loop (one graph)", dict(marker="o", lw=2.2, color="C0")),
            ("compiled_step_us", "compiled step, replayed K times", dict(marker="s", color="C1")),
            ("eager_us", "eager", dict(marker="^", color="C3")),
            ("floor_us", "bandwidth floor", dict(ls="--", color="k")),
        ]
        heads = list(dict.fromkeys(r["case"]["head"] for r in dl["rows"]))
        ks = sorted({r["case"]["K"] for r in dl["rows"]})
        fig, axes = plt.subplots(len(heads), len(ks), figsize=(3.6 * len(ks) + 1.5, 3.3 * len(heads)),
                                 squeeze=False)
        for row_axes, head in zip(axes, heads):
            for ax, k in zip(row_axes, ks):
                rows = sorted((r for r in dl["rows"] if r["case"]["head"] == head and r["case"]["K"] == k),
                              key=lambda r: r["case"]["B"])
                for key, label, style in DL_SERIES:
                    pts = [(r["case"]["B"], r[key]) for r in rows if num(r.get(key))]
                    if pts:
                        ax.plot(*zip(*pts), label=label, **style)
                if rows:
                    log_x_ticks(ax, [r["case"]["B"] for r in rows])
                log_y(ax)
                ax.set(title=f"{head} head, K = {k}", xlabel="batch size B")
                ax.grid(which="major", alpha=0.3)
            row_axes[0].set_ylabel("µs per draft step (log scale)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Draft loop, ctx = {dl.get('ctx', '?')} — {dl['machine']}, {dl['date']}")
        fig.tight_layout()
        plt.show()
    """),
    md("""
    ## End-to-end generation

    New tokens per second of each system at each batch size (log scale), with τ (acceptance length: tokens
    per target forward) for speculative rows. The dashed line is the floor of plain decoding: one step reads
    the target's weights once. Speculative decoding can pass it, since one target forward yields up to K + 1
    tokens. Rows the benchmark skipped (time budget) or that failed are listed with their reason.
    """),
    code("""
    gen = data["generate"]
    if gen is None:
        print("nothing to plot: generate.json is absent")
    else:
        systems = list(dict.fromkeys(r["case"]["system"] for r in gen["rows"]))
        bs = sorted({r["case"]["B"] for r in gen["rows"]})
        top = max([r["tokens_per_s"] for r in gen["rows"] if num(r.get("tokens_per_s"))]
                  + [r["floor_tokens_per_s"] for r in gen["rows"] if num(r.get("floor_tokens_per_s"))])
        fig, axes = plt.subplots(1, len(bs), figsize=(5 * len(bs) + 3, 0.55 * len(systems) + 1.8),
                                 sharey=True, squeeze=False)
        for ax, b in zip(axes[0], bs):
            by_system = {r["case"]["system"]: r for r in gen["rows"] if r["case"]["B"] == b}
            for y, name in enumerate(systems):
                r = by_system.get(name)
                if r is not None and num(r.get("tokens_per_s")):
                    tps, tau = r["tokens_per_s"], r.get("acceptance_length")
                    ax.barh(y, tps, color="C0" if name.startswith("fspec") else "C7")
                    ax.text(tps * 1.1, y, f"{tps:,.0f}" + (f" (τ = {tau:.1f})" if num(tau) else ""),
                            va="center", fontsize=8)
                else:
                    why = "not run" if r is None else (r.get("error") or "no result").split(":")[0]
                    ax.text(13, y, why, va="center", fontsize=8, color="0.4", style="italic")
            floors = [r["floor_tokens_per_s"] for r in by_system.values() if num(r.get("floor_tokens_per_s"))]
            title = f"B = {b}"
            if floors:
                ax.axvline(floors[0], color="k", ls="--")
                title += f" — floor of plain decoding (dashed): {floors[0]:,.0f} tokens/s"
            ax.set_xscale("log")
            ax.set_xlim(10, 8 * top)
            ax.set_ylim(len(systems) - 0.5, -0.5)  # first system on top
            ax.set(title=title, xlabel="new tokens / s (log scale)")
            ax.title.set_fontsize(9)
            ax.grid(axis="x", which="major", alpha=0.3)
        axes[0][0].set_yticks(range(len(systems)), systems)
        fig.suptitle(f"Generation: {gen.get('target', 'target')} — {gen['machine']}, {gen['date']}",
                     fontsize=10)
        fig.tight_layout()
        plt.show()
        for note in gen.get("notes", []):
            print("note:", note)
    """),
    md("""
    ## The ratios, from the data

    Computed from whatever rows were loaded above, so they follow the JSON files.
    """),
    code("""
    if att is not None:
        r = [x for x in att["rows"] if x["case"]["num_query"] == 1]
        ratio = [x["fspec_graph_us"] / x["floor_us"] for x in r]
        baselines = ("flex_us", "sdpa_gather_us")
        wins = [x for x in att["rows"] if all(x["fspec_graph_us"] < x[k] for k in baselines if num(x.get(k)))]
        big = max(r, key=lambda x: x["floor_us"])
        lo, hi, at_big = min(ratio), max(ratio), big["fspec_graph_us"] / big["floor_us"]
        print(f"attention: fspec / floor from {lo:.2f} to {hi:.2f} over {len(r)} decode shapes ({at_big:.2f} "
              f"at the largest, B={big['case']['B']}, ctx={big['case']['ctx']}); faster than every baseline "
              f"that ran in {len(wins)} of {len(att['rows'])} shapes")
    if smp is not None:
        for op in dict.fromkeys(x["case"]["op"] for x in smp["rows"]):
            rows = [x for x in smp["rows"] if x["case"]["op"] == op]
            ratio = sorted(x["fspec_graph_us"] / x["floor_us"] for x in rows)
            print(f"sampling: {op}: graph replay / floor from {ratio[0]:.1f} to {ratio[-1]:.1f} "
                  f"over {len(rows)} shapes")
    if dl is not None:
        ratio = [x["compiled_loop_us"] / x["floor_us"] for x in dl["rows"]]
        eager = [x["eager_us"] / x["compiled_loop_us"] for x in dl["rows"]]
        print(f"draft loop: compiled loop / floor from {min(ratio):.2f} to {max(ratio):.2f}; "
              f"eager is {min(eager):.1f}x to {max(eager):.1f}x slower")
    if gen is not None:
        for b in sorted({x["case"]["B"] for x in gen["rows"]}):
            tps = {x["case"]["system"]: x["tokens_per_s"] for x in gen["rows"]
                   if x["case"]["B"] == b and num(x.get("tokens_per_s"))}
            line = ", ".join(f"{k}: {v:,.0f}" for k, v in tps.items())
            print(f"generate, B={b}: {line} tokens/s")
    """),
]

# ----------------------------------------------------------------------------------------------------------

#: notebook file name -> its cells, each ("markdown" | "code", source).
NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "01_pure_draft_step.ipynb": NB01,
    "04_performance.ipynb": NB04,
}

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook `name` without outputs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, source) in enumerate(NOTEBOOKS[name]):
        if source == "@PROVENANCE@":
            source = provenance_markdown()
        source = textwrap.dedent(source).strip("\n")
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(source)
        cell["id"] = f"cell-{i:02d}"  # stable ids: regenerating does not churn the diff
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def execute(nb: nbformat.NotebookNode, *, timeout: int = 600) -> nbformat.NotebookNode:
    """Run `nb` top to bottom, in place, in an ipykernel of THIS interpreter, with cwd = notebooks/.

    The kernel spec is written to a temporary directory for `sys.executable` and looked up there only: a
    "python3" kernel spec elsewhere on the machine (a user-wide one, another venv's) may name another
    interpreter, one without fspec. Raises nbclient's CellExecutionError at the first failing cell.
    """
    import tempfile

    from ipykernel.kernelspec import install
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory() as tmp:
        install(prefix=tmp, kernel_name="python3")  # argv[0] = sys.executable
        specs = KernelSpecManager(kernel_dirs=[str(Path(tmp, "share", "jupyter", "kernels"))])
        km = KernelManager(kernel_name="python3", kernel_spec_manager=specs)
        NotebookClient(
            nb,
            km=km,
            timeout=timeout,
            kernel_name="python3",
            record_timing=False,  # no timestamps in the committed files
            resources={"metadata": {"path": str(HERE)}},
        ).execute()
    return nb


def absolute_paths(nb: nbformat.NotebookNode) -> list[str]:
    """Output lines that contain an absolute path of this checkout or of the home directory."""
    needles = {str(HERE.parent), str(Path.home()) + "/", "site-packages"}
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [
                v for k, v in out.get("data", {}).items() if k.startswith("text/")
            ]
            texts += out.get("traceback", [])
            for text in texts:
                text = "".join(text) if isinstance(text, list) else text
                found += [line for line in text.splitlines() if any(n in line for n in needles)]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"notebooks to build (default: all of {list(NOTEBOOKS)})")
    p.add_argument("--execute", action="store_true", help="execute and keep the outputs")
    p.add_argument("--script", action="store_true", help="print the code cells as one script (debugging)")
    args = p.parse_args(argv)
    if args.script:
        for name in args.names or list(NOTEBOOKS):
            for kind, source in NOTEBOOKS[Path(name).name]:
                if kind == "code":
                    print(textwrap.dedent(source).strip("\n") + "\n")
        return 0
    full = os.environ.get("FSPEC_NOTEBOOK_FULL") == "1"
    for name in args.names or list(NOTEBOOKS):
        name = Path(name).name
        nb = build(name)
        if args.execute:
            print(f"executing {name} ({'full' if full else 'tiny'} size) ...", flush=True)
            execute(nb)
            leaks = absolute_paths(nb)
            if leaks:
                print(f"{name}: outputs contain absolute paths:\n  " + "\n  ".join(leaks[:10]))
                return 1
        nbformat.write(nb, HERE / name)
        print(f"wrote notebooks/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
