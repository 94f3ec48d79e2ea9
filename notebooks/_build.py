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
    `fspec.prefill` does all of this in one call — it is what `fspec.generate` runs before its first round —
    with contiguous blocks of its own and no padding request. Its rows for the three requests are the ones
    built above (greedy first tokens: temperature 0 is its default).
    """),
    code("""
    R = len(PROMPT_LENS)
    pre = fspec.prefill(target, draft, [prompts[b, :n].tolist() for b, n in enumerate(PROMPT_LENS)])
    assert torch.equal(pre.tokens, first_token[:R])
    assert torch.equal(pre.state.input_ids.view(R, Q), shifted[:R])
    torch.testing.assert_close(pre.state.hidden.view(R, Q, -1), hidden.view(B, Q, -1)[:R])
    print("fspec.prefill: the same first tokens, token rows and hidden rows; its block table:")
    print(pre.block_table)
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
# 02_acceptance.ipynb
# ----------------------------------------------------------------------------------------------------------

NB02: list[tuple[str, str]] = [
    md("""
    # 02 — Acceptance length of the embedded default model

    The acceptance length τ is the mean number of tokens one target forward emits: the accepted drafts plus
    the target's own replacement (or bonus) token, so 1 ≤ τ ≤ K + 1 with K drafts per round. This notebook
    measures τ of the embedded default model (`fspec.load_toy()`: a 4-layer Llama target and the EAGLE-3
    head fspec distilled for it, both trained on the Python standard library's source) on held-out files
    of the standard library, for K = 1 .. 7 and temperatures 0, 0.7 and 1.0, and sets it against

    1. the i.i.d. model: if every draft were accepted with the same probability α, independently,
       τ = 1 + α + α² + … + α^K = (1 − α^{K+1}) / (1 − α), with α the acceptance rate measured at K = 1;
    2. the identity τ = 1 + Σ_k Π_{i≤k} α_i, with α_i the conditional rate P(draft i accepted | draft i − 1
       accepted) of the same run. Draft k counts only when drafts 1 .. k − 1 were accepted, so this holds
       exactly: it checks the bookkeeping, not a model;
    3. an untrained head of the same shape (random weights, the same draft vocabulary): the floor.

    Every claim in the text is an `assert` in a code cell. CI runs the notebook at tiny size (2 prompts, 24
    new tokens, K ∈ {1, 3}); the committed outputs are full size (8 prompts, 128 new tokens, K = 1 .. 7),
    the setting of `benchmarks/bench_acceptance.py` with one more temperature.
    """),
    code("""
    import os

    import matplotlib.pyplot as plt
    import torch

    import fspec
    from fspec import data

    # A 4M-parameter model: its matmuls are small, and on a shared CPU one thread is faster than several
    # (no OpenMP spin-waits; ~10x on the 2-core machine that ran the committed outputs).
    torch.set_num_threads(1)
    FULL = os.environ.get("FSPEC_NOTEBOOK_FULL") == "1"
    if FULL:  # the committed outputs
        N_PROMPTS, NEW_TOKENS, KS = 8, 128, [1, 2, 3, 4, 5, 6, 7]
    else:  # CI
        N_PROMPTS, NEW_TOKENS, KS = 2, 24, [1, 3]
    PROMPT_LEN, TEMPS = 64, [0.0, 0.7, 1.0]
    print(f"{'full' if FULL else 'tiny'} size: {N_PROMPTS} held-out prompts of {PROMPT_LEN} tokens, "
          f"{NEW_TOKENS} new tokens each, K in {KS}, temperatures {TEMPS}")


    def show_table(header, rows):
        \"\"\"Print rows as an aligned text table.\"\"\"
        cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(header)]
        widths = [max(map(len, c)) for c in cols]
        for j in range(len(rows) + 1):
            print("  ".join(c[j].rjust(w) for c, w in zip(cols, widths)))
            if j == 0:
                print("  ".join("-" * w for w in widths))
    """),
    md("""
    ## The model, an untrained head, and held-out prompts

    The untrained head is `fspec.init_draft` with the trained head's shape, draft vocabulary (all 4096 ids)
    and target layers, so the two differ only in their weights. The prompts are the first
    `PROMPT_LEN` tokens of held-out files: `fspec.data` holds out files by a hash of their path, and neither
    the target nor the head saw them in training.
    """),
    code("""
    target, trained = fspec.load_toy()
    dc = trained.cfg
    untrained = fspec.init_draft(
        target, kind="eagle3", seed=1, num_speculative_steps=max(KS), draft_vocab_size=dc.draft_vocab_size,
        block_size=dc.block_size, max_model_len=dc.max_model_len,
        draft_ids=fspec.draft_to_target(torch.arange(dc.draft_vocab_size), trained.params["d2t"]),
        target_layer_ids=dc.target_layer_ids, intermediate_size=dc.model.intermediate_size,
    )
    HEADS = {"trained": trained, "untrained": untrained}


    def own_params(d):
        return sum(x.numel() for k, v in d.params.items() if k not in d.shared
                   for x in fspec.tree.tree_leaves(v) if x.is_floating_point())


    tc = target.cfg
    print(f"target: Llama, {tc.num_hidden_layers} layers, hidden {tc.hidden_size}, vocab {tc.vocab_size}, "
          f"{sum(x.numel() for x in fspec.tree.tree_leaves(target.params)):,} parameters")
    print(f"head: {dc.kind}, reads target layers {dc.target_layer_ids}, draft vocabulary "
          f"{dc.draft_vocab_size}, {own_params(trained):,} parameters of its own (embedding: the target's)")

    root = data.stdlib_root()
    _, held_files = data.split_files(data.stdlib_files())
    prompts, names = [], []
    for f in held_files:
        for text in data.read_texts([f]):  # skips the few files that are not UTF-8
            ids = target.tokenizer.encode(text).ids
            if len(ids) >= PROMPT_LEN:
                prompts.append(ids[:PROMPT_LEN])
                names.append(f.relative_to(root).as_posix())
        if len(prompts) == N_PROMPTS:
            break
    assert len(prompts) == N_PROMPTS and all(data.is_held_out(n) for n in names), "held-out files only"
    print(f"\\n{len(held_files)} held-out files; prompts from: {', '.join(names)}")
    print("\\nthe first prompt:\\n" + target.tokenizer.decode(prompts[0]))
    """),
    md("""
    ## The sweep

    One `fspec.generate` call per (head, temperature, K), over all prompts at once, with one seed per prompt;
    and one target-only call (`draft=None`), greedy, as the reference. `stats` carries τ
    (`acceptance_length`), the rate at which draft k was accepted over all request-rounds
    (`acceptance_rate_per_position`) and the conditional rates (`conditional_acceptance_per_position`).
    """),
    code("""
    plain = fspec.generate(target, None, prompts, max_new_tokens=NEW_TOKENS)
    runs = {}
    for head_name, head in HEADS.items():
        for temp in TEMPS:
            for k in KS:
                res = fspec.generate(
                    target, head, prompts, max_new_tokens=NEW_TOKENS, temperature=temp,
                    seed=list(range(N_PROMPTS)), num_speculative_steps=k,
                )
                runs[head_name, temp, k] = res.tokens, res.stats
    print(f"{len(runs) + 1} generate calls")  # no timings: re-running gives byte-identical outputs
    """),
    md("""
    ## Greedy speculative decoding emits the target's own tokens, up to rounding ties

    At temperature 0 the verification accepts a draft exactly when it is the target's argmax, and the
    replacement is the target's argmax: the output is target-only greedy decoding, for every K and for both
    heads — the untrained one just takes one target forward per token to get there. Token for token, with
    one caveat: the model runs in bf16, and the verification forward (K + 1 rows per request) rounds
    differently from a one-row decode step. Where the target's two best logits are within a bf16 rounding
    step of each other, the two runs may pick different tokens, and from there on they continue different
    (equally greedy) texts. So the cell checks: each greedy output equals the target-only output, or first
    differs from it at a position where the target's top two tokens are exactly the two tokens the runs
    picked, with logits at most two bf16 ulps apart (recomputed by a third forward, the dense one). And τ
    stays within its bounds: at least the one token the target always emits, at most K + 1.
    """),
    code("""
    EPS = torch.finfo(torch.bfloat16).eps  # 2^-7: a bf16 ulp at |x| is at most EPS * |x|
    equal, ties, total = 0, {}, 0
    for (head_name, temp, k), (tokens, stats) in runs.items():
        assert 1.0 <= stats["acceptance_length"] <= k + 1, (head_name, temp, k)
        if temp != 0.0:
            continue
        for i, (spec, ref) in enumerate(zip(tokens, plain.tokens)):
            total += 1
            j = next((n for n, (a, b) in enumerate(zip(spec, ref)) if a != b), None)
            if j is None:
                assert spec == ref, (head_name, k, i)  # same tokens; EOS would end both at the same place
                equal += 1
            else:
                ties.setdefault((i, j, ref[j], spec[j]), []).append(f"{head_name} K={k}")
    rows = []
    for (i, j, ref_tok, spec_tok), where in sorted(ties.items()):
        ids = torch.tensor([prompts[i] + plain.tokens[i][:j]])
        with torch.no_grad():
            logits, _ = fspec.models.llama.forward_dense(target.params, ids, cfg=target.cfg)
        top = logits[0, -1].float().topk(2)
        margin = float(top.values[0] - top.values[1])
        assert set(top.indices.tolist()) == {ref_tok, spec_tok}, (i, j, top.indices.tolist())
        assert margin <= 2 * EPS * abs(float(top.values[0])), (i, j, margin)
        ref_text, spec_text = (repr(target.tokenizer.decode([t])) for t in (ref_tok, spec_tok))
        rows.append((i, f"{j} / {len(plain.tokens[i])}", ref_text, spec_text, f"{float(top.values[0]):.4f}",
                     f"{margin:.4f}", f"{len(where)} runs"))
    print(f"{equal} of {total} greedy (run, prompt) outputs equal the target-only output token for token")
    if rows:
        print("the others first differ at a rounding tie of the target (margin: top-1 minus top-2 logit):\\n")
        show_table(["prompt", "position", "target-only", "speculative", "top logit", "margin", "in"], rows)
    print(f"\\n1 <= tau <= K + 1 in all {len(runs)} runs")
    print("\\ntarget-only greedy, first prompt's continuation:\\n" + plain.text[0])
    """),
    md("""
    ## τ against the two predictions

    For each run: the measured τ; 1 + Σ Π α_i from the same run's conditional rates (equal to the measured
    τ to rounding: the identity); the i.i.d. prediction (1 − α^{K+1}) / (1 − α) with α from the K = 1 run of
    the same head and temperature; and the per-position acceptance rates P(draft k accepted). The rates never
    increase with k, since draft k + 1 is accepted only when draft k was. (The ceiling K + 1 is far above
    every curve in the plot below, and left out of it.) At T > 0 each run samples its own text, so its τ
    carries sampling noise that the greedy runs do not have.
    """),
    code("""
    def tau_from_conditional(cond):
        \"\"\"1 + sum_k prod_{i<=k} alpha_i.\"\"\"
        tau, prod = 1.0, 1.0
        for a in cond:
            prod *= a
            tau += prod
        return tau


    def tau_iid(alpha, k):
        \"\"\"(1 - alpha^(K+1)) / (1 - alpha): K drafts, each accepted with probability alpha, independently
        (once the previous one was).\"\"\"
        return k + 1.0 if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


    alpha = {(h, t): runs[h, t, 1][1]["acceptance_rate_per_position"][0] for h in HEADS for t in TEMPS}
    rows, worst_identity = [], 0.0
    for (head_name, temp, k), (_, s) in runs.items():
        tau, rates = s["acceptance_length"], s["acceptance_rate_per_position"]
        ident = tau_from_conditional(s["conditional_acceptance_per_position"])
        worst_identity = max(worst_identity, abs(tau - ident))
        assert abs(tau - ident) <= 1e-9, (head_name, temp, k, tau, ident)
        assert all(a >= b for a, b in zip(rates, rates[1:])), "rates never increase with the position"
        iid = tau_iid(alpha[head_name, temp], k)
        rows.append((head_name, temp, k, f"{tau:.3f}", f"{ident:.3f}", f"{iid:.3f}",
                     ", ".join(f"{r:.2f}" for r in rates)))
    show_table(["head", "T", "K", "tau", "1 + sum prod a_i", "iid (a from K=1)", "P(draft k accepted)"], rows)
    print(f"\\n|tau - (1 + sum prod a_i)| <= {worst_identity:.1e} over {len(runs)} runs (tolerance 1e-9)")
    """),
    code("""
    fig, axes = plt.subplots(1, len(TEMPS), figsize=(4.2 * len(TEMPS), 3.8), sharey=True)
    for ax, temp in zip(axes, TEMPS):
        for head_name, color in (("trained", "C0"), ("untrained", "C7")):
            a = alpha[head_name, temp]
            ax.plot(KS, [runs[head_name, temp, k][1]["acceptance_length"] for k in KS], "o-", color=color,
                    label=f"{head_name} head, measured")
            ax.plot(KS, [tau_iid(a, k) for k in KS], "--", color=color, alpha=0.7,
                    label=f"{head_name}: (1 - a^(K+1)) / (1 - a), a = {a:.2f}")
        top = max(runs["trained", t, k][1]["acceptance_length"] for t in TEMPS for k in KS)
        ax.set_ylim(0.9, max(2.0, top + 0.4))
        ax.set_xticks(KS)
        ax.set(title=f"temperature {temp}", xlabel="K (drafts per round)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("acceptance length tau (tokens / target forward)")
    fig.suptitle(f"Embedded default model on {N_PROMPTS} held-out files, {NEW_TOKENS} new tokens each")
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## Per-position acceptance

    At the largest K, the trained head's rate of acceptance at each draft position (bars), with the i.i.d.
    model's α^k (dashed), and the conditional rates P(draft k accepted | draft k − 1 accepted) (right), which
    the i.i.d. model takes to be α at every position. Two things separate the model from the measurement:
    the conditional rates vary with depth, and the first draft's rate can depend on K. With K drafts per
    round, a round ends at a rejected draft (unless all K were accepted), so the next round's first draft
    continues text the head just got wrong; at K = 1, a round follows an accepted draft as often as a draft
    is accepted. The table under the plot lists P(draft 1 accepted) for every K, and the cell prints the
    i.i.d. prediction minus the measured greedy τ. Compare both with the same quantities over every held-out
    file (`benchmarks/bench_acceptance.py`, BENCHMARKS.md): there the first draft's rate falls from 0.77 at
    K = 1 to 0.69 at K = 7 and the i.i.d. formula overestimates τ at every K ≥ 3 (3.43 against 3.10 at
    K = 5); a handful of prompts is too few to show either reliably.
    """),
    code("""
    kmax = max(KS)
    pos = range(1, kmax + 1)
    width = 0.8 / len(TEMPS)
    fig, (ax_rate, ax_cond) = plt.subplots(1, 2, figsize=(12, 4))
    for i, temp in enumerate(TEMPS):
        s, a = runs["trained", temp, kmax][1], alpha["trained", temp]
        x = [p - 0.4 + width * (i + 0.5) for p in pos]
        ax_rate.bar(x, s["acceptance_rate_per_position"], width, color=f"C{i}", label=f"T = {temp}, measured")
        ax_rate.plot(pos, [a**p for p in pos], "--", color=f"C{i}", label=f"T = {temp}, a^k (a = {a:.2f})")
        ax_cond.plot(pos, s["conditional_acceptance_per_position"], "o-", color=f"C{i}", label=f"T = {temp}")
        ax_cond.axhline(a, ls="--", color=f"C{i}", alpha=0.5)
    ax_rate.set(title=f"P(draft k accepted), trained head, K = {kmax}", xlabel="draft position k",
                ylabel="fraction of request-rounds")
    ax_cond.set(title="P(draft k accepted | draft k-1 accepted); dashed: a from K = 1",
                xlabel="draft position k", ylim=(0, 1))
    for ax in (ax_rate, ax_cond):
        ax.set_xticks(list(pos))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

    print("P(draft 1 accepted), trained head, by K:")
    show_table(["T"] + [f"K={k}" for k in KS],
               [(t, *(f"{runs['trained', t, k][1]['acceptance_rate_per_position'][0]:.3f}" for k in KS))
                for t in TEMPS])
    greedy = {k: runs["trained", 0.0, k][1] for k in KS}
    gaps = {k: tau_iid(alpha["trained", 0.0], k) - greedy[k]["acceptance_length"] for k in KS if k >= 2}
    if gaps:
        print("greedy: i.i.d. prediction minus measured tau, K >= 2: "
              + ", ".join(f"K={k}: {g:+.3f}" for k, g in gaps.items()))
    """),
    md("""
    ## Trained against untrained

    Distillation is what makes drafts worth verifying: the trained head's τ is above the untrained head's for
    every temperature and K. The untrained head's drafts are essentially never the target's argmax (greedy
    τ below 1.05, asserted); sampling accepts a draft with probability Σ min(p, q), which a random q earns
    by chance only rarely. Sampling lowers the trained head's τ too (asserted at full size, T = 1 against
    greedy; the tiny run's 48 tokens are too few): at T > 0 a draft is accepted with probability
    min(1, p/q), not by matching an argmax.
    """),
    code("""
    rows = []
    for temp in TEMPS:
        for k in KS:
            t_tau, u_tau = (runs[h, temp, k][1]["acceptance_length"] for h in ("trained", "untrained"))
            assert t_tau > u_tau, (temp, k, t_tau, u_tau)
            rows.append((temp, k, f"{t_tau:.2f}", f"{u_tau:.2f}", f"{t_tau / u_tau:.2f}x"))
    show_table(["T", "K", "tau trained", "tau untrained", "ratio"], rows)
    for k in KS:
        assert runs["untrained", 0.0, k][1]["acceptance_length"] < 1.05
        if FULL:
            greedy_tau = runs["trained", 0.0, k][1]["acceptance_length"]
            assert greedy_tau > runs["trained", 1.0, k][1]["acceptance_length"], "sampling lowers tau"
    """),
    md("""
    ## What this shows

    - Greedy speculative decoding emits the target's own greedy tokens for every K and both heads; where an
      output differs from the target-only run, it first differs at a bf16 rounding tie of the target's top
      two logits (the verification forward and the one-row decode round differently), never elsewhere.
    - τ = 1 + Σ_k Π_{i≤k} α_i holds to rounding in every run: acceptance is a prefix, so τ is the sum of the
      per-position acceptance rates, plus one.
    - The i.i.d. formula with α from K = 1 is a model, not an identity: exact at K = 1 by construction,
      off by up to a few tenths elsewhere, with a sign that depends on the prompts when there are only a few
      (over every held-out file it overestimates, BENCHMARKS.md); the per-position plot shows where the two
      part.
    - The trained head beats the untrained one everywhere, and greedy decoding gets more from it than
      sampling at T = 1. `BENCHMARKS.md` (the acceptance section) reports the same measurement for T ∈ {0, 1}.
    """),
]

# ----------------------------------------------------------------------------------------------------------
# 03_distill_a_head.ipynb
# ----------------------------------------------------------------------------------------------------------

NB03: list[tuple[str, str]] = [
    md("""
    # 03 — Distill an EAGLE-3 head, and what unrolling buys

    A draft head is trained against a frozen target: the target's distribution p over the next token is the
    soft label, the head's q is fitted to it. At serving time, though, the head's step k ≥ 2 does not read the
    target's hidden state and the true token: it reads its own previous output and its own previous draft.
    EAGLE-3's training-time test (TTT) trains for exactly that: the head step is unrolled K times per batch,
    step j reading step j − 1's hidden state and argmax, and the loss is Σ_j w^j · CE(p_j, q_j)
    (`fspec.ttt.ttt_loss`; K = `ttt_steps`, w = `step_weight` = 0.8).

    This notebook trains two EAGLE-3 heads from scratch against the embedded default target
    (`fspec.load_toy()`), on a slice of the standard library's source, with the same initialisation,
    the same batches and the same number of optimizer steps:

    - **unrolled**: `ttt_steps = 5`, the K it is evaluated at;
    - **K = 1**: `ttt_steps = 1`, plain next-token distillation (each step costs ~1/4 as much).

    It plots the loss and the acceptance length τ (`fspec.generate`, greedy, K = 5, held-out prompts) over
    training, and the held-out top-1 agreement with the target at each unrolled depth at the end.

    **Budget.** At full size (the committed outputs) each head trains for 400 steps of 8 × 128 tokens, which
    with the evaluations fits about 10 minutes on 2 CPU cores with one thread: on the shared machine that
    ran the committed outputs the unrolled head trained at ~0.8 s a step, the K = 1 head at ~0.2 s, and the
    whole notebook took 8 minutes (no timings are printed, so that re-running gives byte-identical
    outputs). The shipped head had 4.4 minutes on an H200 at ~140k tokens/s, about 105x the tokens (printed
    below), with a wider MLP and the whole vocabulary (`fspec/toy_model.py`). CI runs a tiny size (24
    steps of 2 × 32 tokens, a few seconds) and checks only the mechanics there.
    """),
    code("""
    import json
    import math
    import os
    from pathlib import Path

    import matplotlib.pyplot as plt
    import torch

    import fspec
    from fspec import data, distill, ttt

    # A 4M-parameter target and a 1.6M-parameter head: small matmuls, one thread is fastest on a shared CPU.
    torch.set_num_threads(1)
    FULL = os.environ.get("FSPEC_NOTEBOOK_FULL") == "1"
    if FULL:  # the committed outputs: about 10 minutes on 2 CPU cores
        FILES, STEPS, BATCH, SEQ_LEN, WARMUP = 200, 400, 8, 128, 20
        CHECKPOINTS = [0, 25, 50, 100, 200, 300, 400]
        EVAL_PROMPTS, EVAL_NEW, FINAL_PROMPTS, FINAL_NEW, HELD_WINDOWS = 4, 64, 8, 128, 16
    else:  # CI: seconds
        FILES, STEPS, BATCH, SEQ_LEN, WARMUP = 10, 24, 2, 32, 4
        CHECKPOINTS = [0, 12, 24]
        EVAL_PROMPTS, EVAL_NEW, FINAL_PROMPTS, FINAL_NEW, HELD_WINDOWS = 2, 16, 2, 24, 4
    LR, VD, EVAL_K, PROMPT_LEN = 3e-3, 2048, 5, 64
    print(f"{'full' if FULL else 'tiny'} size: {STEPS} steps of {BATCH} x {SEQ_LEN} tokens per head, "
          f"lr {LR}, draft vocabulary {VD}, tau at K = {EVAL_K} at steps {CHECKPOINTS}")


    def show_table(header, rows):
        \"\"\"Print rows as an aligned text table.\"\"\"
        cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(header)]
        widths = [max(map(len, c)) for c in cols]
        for j in range(len(rows) + 1):
            print("  ".join(c[j].rjust(w) for c, w in zip(cols, widths)))
            if j == 0:
                print("  ".join("-" * w for w in widths))
    """),
    md("""
    ## The target and the data

    The target is the embedded one, frozen. Training text is the first `FILES` files of the standard
    library's training split (`fspec.data.split_files`); evaluation uses held-out files only: prompts for
    `fspec.generate`, and consecutive windows for the per-depth agreement.
    """),
    code("""
    target, shipped = fspec.load_toy()
    train_files, held_files = data.split_files(data.stdlib_files())
    train_tokens = data.encode_files(target.tokenizer, train_files[:FILES]).long()
    held_tokens = data.encode_files(target.tokenizer, held_files).long()

    prompts = []
    for text in data.read_texts(held_files):
        ids = target.tokenizer.encode(text).ids
        if len(ids) >= PROMPT_LEN:
            prompts.append(ids[:PROMPT_LEN])
        if len(prompts) == max(EVAL_PROMPTS, FINAL_PROMPTS):
            break
    held_ids = held_tokens[: HELD_WINDOWS * SEQ_LEN].view(HELD_WINDOWS, SEQ_LEN)
    seen = STEPS * BATCH * SEQ_LEN
    print(f"training slice: {FILES} of {len(train_files)} training files, {train_tokens.numel():,} tokens; "
          f"{seen:,} tokens seen per head ({seen / train_tokens.numel():.2f} epochs)")
    print(f"held out: {len(held_files)} files, {held_tokens.numel():,} tokens; {len(prompts)} prompts of "
          f"{PROMPT_LEN} tokens, {HELD_WINDOWS} windows of {SEQ_LEN} for the agreement")

    # The shipped head's training run, for scale (its log ships next to the weights).
    shipped_log = json.loads(Path(fspec.__file__).with_name("assets").joinpath("toy", "train_log.json")
                             .read_text())
    r, shipped_steps = shipped_log["recipe"], shipped_log["draft"]["records"][-1]["step"]
    shipped_tokens = shipped_steps * r["draft_batch"] * r["draft_seq_len"]
    print(f"the shipped head: ttt_steps={r['ttt_steps']}, {shipped_steps} steps of {r['draft_batch']} x "
          f"{r['draft_seq_len']} tokens = {shipped_tokens:,} tokens ({shipped_log['device']}), "
          f"{shipped_tokens / seen:.0f}x what each head here sees")
    """),
    md("""
    ## Training, one pure step at a time

    `fspec.distill_head` runs this loop; here it is written out so that τ can be measured at checkpoints
    while training runs. `fspec.distill.new_draft` makes a fresh head whose draft vocabulary is the `VD` most
    frequent tokens of the slice; `online_batches` maps a step number to a batch (windows of the slice run
    through the frozen target), a pure function of (seed, step), so both heads see the same batches;
    `fspec.ttt.train_step` is one pure AdamW step on the TTT loss (`torch.func.grad_and_value`).
    `fspec.distill.to_draft` turns the fp32 master weights into a servable `Draft` at each checkpoint.

    At each checkpoint: τ with `fspec.generate` (greedy, K = 5) on held-out prompts, and the head's top-1
    agreement with the target at each of 5 unrolled depths on held-out windows (`ttt_loss`'s metrics, with
    `ttt_steps = 5` whatever the head was trained with).
    """),
    code("""
    def held_out_agreement(head):
        \"\"\"Top-1 agreement with the target at unrolled depths 1..EVAL_K on the held-out windows.\"\"\"
        trainable, frozen = ttt.split_params(head.params, head.shared)
        with torch.no_grad():
            _, m = ttt.ttt_loss(trainable, frozen, ttt.target_batch(target, head, held_ids), cfg=head.cfg,
                                ttt_steps=EVAL_K)
        return m["agreement"].tolist()


    def generate_stats(head, n_prompts, new_tokens):
        \"\"\"`fspec.generate`'s stats, greedy, K = EVAL_K, on the first n_prompts held-out prompts.\"\"\"
        res = fspec.generate(target, head, prompts[:n_prompts], max_new_tokens=new_tokens,
                             num_speculative_steps=EVAL_K)
        return res.stats


    def train_head(ttt_steps):
        cfg = fspec.DistillConfig(ttt_steps=ttt_steps, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, lr=LR,
                                  warmup_steps=WARMUP, seed=0)
        draft = distill.new_draft(target, kind="eagle3", tokens=train_tokens, draft_vocab_size=VD, seed=0,
                                  num_speculative_steps=EVAL_K)
        batches = distill.online_batches(target, draft, train_tokens, cfg=cfg)
        trainable, frozen = ttt.split_params(draft.params, draft.shared)
        opt = ttt.adamw_init(trainable)
        log = {"loss": [], "ce": [], "checkpoints": [], "tau": [], "agreement": []}
        for step in range(STEPS + 1):
            if step in CHECKPOINTS:
                head = distill.to_draft(draft, trainable)
                log["checkpoints"].append(step)
                log["tau"].append(generate_stats(head, EVAL_PROMPTS, EVAL_NEW)["acceptance_length"])
                log["agreement"].append(held_out_agreement(head))
            if step == STEPS:
                break
            trainable, opt, m = ttt.train_step(
                trainable, opt, frozen, batches(step), step=step, cfg=draft.cfg, dcfg=cfg
            )
            log["loss"].append(float(m["loss"]))  # sum_j w^j CE_j over this batch
            log["ce"].append(m["loss_per_step"].tolist())  # CE_j, j = 0 .. ttt_steps - 1
        return distill.to_draft(draft, trainable), log


    heads, logs = {}, {}
    for name, ttt_steps in (("unrolled", EVAL_K), ("K=1", 1)):
        heads[name], logs[name] = train_head(ttt_steps)
        print(f"{name} head (ttt_steps={ttt_steps}), {STEPS} steps; tau at K={EVAL_K} by checkpoint: "
              + ", ".join(f"{s}: {t:.2f}" for s, t in zip(logs[name]["checkpoints"], logs[name]["tau"])))
    """),
    md("""
    ## Mechanics

    Both heads started from the same weights (the same seed) and took the same number of steps on the same
    batches; every loss is finite, τ stays within [1, K + 1], training changed the head's own weights and
    left the shared embedding (the target's) alone. The loss goes down from the first steps to the last
    (means of the first and last tenth of the run, so one noisy batch does not decide it).
    """),
    code("""
    first = {n: logs[n]["agreement"][0] for n in logs}
    assert first["unrolled"] == first["K=1"], "the same initial head"
    for name, log in logs.items():
        assert len(log["loss"]) == STEPS and all(math.isfinite(x) for x in log["loss"])
        assert log["checkpoints"] == CHECKPOINTS
        assert all(1.0 <= t <= EVAL_K + 1 for t in log["tau"])
        n = max(STEPS // 10, 3)
        start, end = sum(log["loss"][:n]) / n, sum(log["loss"][-n:]) / n
        assert end < start, (name, start, end)
        print(f"{name}: loss {start:.3f} -> {end:.3f} (mean of the first and last {n} steps)")
    initial = distill.new_draft(target, kind="eagle3", tokens=train_tokens, draft_vocab_size=VD, seed=0)
    for head in heads.values():
        assert not torch.equal(head.params["fc"], initial.params["fc"]), "training changed the weights"
        assert torch.equal(head.params["embed"], target.params["embed"]), "the embedding is the target's"
    """),
    code("""
    def smooth(xs, n=max(STEPS // 20, 1)):
        \"\"\"Trailing moving average over n steps (batches of 8 sequences are noisy).\"\"\"
        return [sum(xs[max(i - n + 1, 0) : i + 1]) / (i + 1 - max(i - n + 1, 0)) for i in range(len(xs))]


    steps = range(1, STEPS + 1)
    fig, (ax_loss, ax_ce, ax_tau) = plt.subplots(1, 3, figsize=(16, 4.2))
    ax_loss.plot(steps, smooth(logs["unrolled"]["loss"]), color="C0",
                 label=f"unrolled: sum_j 0.8^j CE_j over {EVAL_K} steps")
    ax_loss.plot(steps, smooth(logs["K=1"]["loss"]), color="C1", label="K = 1: CE_0")
    ax_loss.set(title="training loss (moving average)", xlabel="optimizer step", ylabel="nats")
    ce = logs["unrolled"]["ce"]
    for j in range(EVAL_K):
        ax_ce.plot(steps, smooth([c[j] for c in ce]), color=plt.cm.Blues(0.35 + 0.65 * (EVAL_K - j) / EVAL_K),
                   label=f"unrolled, depth {j + 1}")
    ax_ce.plot(steps, smooth([c[0] for c in logs["K=1"]["ce"]]), color="C1", ls="--", label="K = 1, depth 1")
    ax_ce.set(title="training cross-entropy per unrolled depth", xlabel="optimizer step", ylabel="nats")
    for name, color in (("unrolled", "C0"), ("K=1", "C1")):
        ax_tau.plot(logs[name]["checkpoints"], logs[name]["tau"], "o-", color=color, label=f"{name} head")
    ax_tau.set(title=f"tau at K = {EVAL_K}, greedy, {EVAL_PROMPTS} held-out prompts x {EVAL_NEW} tokens",
               xlabel="optimizer step", ylabel="tokens / target forward")
    for ax in (ax_loss, ax_ce, ax_tau):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## What unrolling buys

    After the same number of steps: each head's held-out top-1 agreement with the target at each unrolled
    depth, and, from `fspec.generate` on more prompts and longer outputs, τ at K = 5 with its conditional
    acceptance rates α_k = P(draft k accepted | draft k − 1 accepted). The shipped head (`ttt_steps = 7`,
    about 105x the tokens, a 4x wider MLP) is the reference.

    The K = 1 head puts all of its training into depth 1, where the unrolled head gives only a weight of 1 in
    1 + 0.8 + … + 0.8⁴ ≈ 3.4. From depth 2 on, a head drafts from its own previous hidden state and its own
    previous draft: inputs the K = 1 head never saw in training, and its agreement there is a fraction of the
    unrolled head's. τ = 1 + α_1 + α_1·α_2 + … weighs both effects: the K = 1 head tends to win the first
    factor, the unrolled head the later ones, and α_1 multiplies everything after it. How they net out at
    this budget is the τ column below.

    At full size the notebook asserts that the K = 1 head's held-out agreement at every depth ≥ 2 is below
    the unrolled head's, and so is its α_2 in generation, and that both heads from scratch stay below the
    shipped head's τ; at tiny size (a few dozen steps) neither head has learned enough for a comparison to
    mean anything, and only the mechanics are checked.
    """),
    code("""
    final = {name: heads[name] for name in ("unrolled", "K=1")} | {"shipped (reference)": shipped}
    agreement = {name: held_out_agreement(h) for name, h in final.items()}
    stats = {name: generate_stats(h, FINAL_PROMPTS, FINAL_NEW) for name, h in final.items()}
    taus = {name: s["acceptance_length"] for name, s in stats.items()}
    cond = {name: s["conditional_acceptance_per_position"] for name, s in stats.items()}
    depth_cols = [f"d{j + 1}" for j in range(EVAL_K)]
    show_table(["head", f"tau (K={EVAL_K})"] + [f"a_{j + 1}" for j in range(EVAL_K)] + depth_cols,
               [(n, f"{taus[n]:.3f}", *(f"{a:.2f}" for a in cond[n]), *(f"{a:.3f}" for a in agreement[n]))
                for n in final])
    print(f"\\ntau, a_k = P(draft k accepted | draft k-1 accepted): fspec.generate, greedy, K = {EVAL_K}, "
          f"{FINAL_PROMPTS} held-out prompts x {FINAL_NEW} new tokens")
    print(f"d_j: top-1 agreement with the target at unrolled depth j on {HELD_WINDOWS} held-out windows of "
          f"{SEQ_LEN} tokens")
    assert all(1.0 <= t <= EVAL_K + 1 for t in taus.values())
    if FULL:
        deep = [(j + 1, agreement["K=1"][j], agreement["unrolled"][j]) for j in range(1, EVAL_K)]
        assert all(k1 < un for _, k1, un in deep), deep
        assert cond["K=1"][1] < cond["unrolled"][1], (cond["K=1"], cond["unrolled"])  # alpha_2
        assert max(taus["unrolled"], taus["K=1"]) < taus["shipped (reference)"]
        print("\\nK=1 / unrolled agreement at depths 2..5: "
              + ", ".join(f"{k1 / un:.2f}" for _, k1, un in deep))
    """),
    code("""
    fig, (ax_agree, ax_cond, ax_ckpt) = plt.subplots(1, 3, figsize=(17, 4.2))
    depths = range(1, EVAL_K + 1)
    width = 0.8 / len(final)
    for i, (name, color) in enumerate(zip(final, ("C0", "C1", "C7"))):
        x = [d - 0.4 + width * (i + 0.5) for d in depths]
        ax_agree.bar(x, agreement[name], width, color=color, label=name)
        ax_cond.bar(x, cond[name], width, color=color, label=f"{name}: tau {taus[name]:.2f}")
    ax_agree.set(title=f"held-out top-1 agreement with the target after {STEPS} steps",
                 xlabel="unrolled depth", ylabel="fraction of positions")
    ax_cond.set(title=f"generate, K = {EVAL_K}: P(draft k accepted | draft k-1 accepted)",
                xlabel="draft position k", ylabel="fraction of request-rounds", ylim=(0, 1))
    for ax in (ax_agree, ax_cond):
        ax.set_xticks(list(depths))
    for name, color in (("unrolled", "C0"), ("K=1", "C1")):
        deep = [sum(a[1:]) / (EVAL_K - 1) for a in logs[name]["agreement"]]
        ax_ckpt.plot(logs[name]["checkpoints"], [a[0] for a in logs[name]["agreement"]], "o-", color=color,
                     label=f"{name}: depth 1")
        ax_ckpt.plot(logs[name]["checkpoints"], deep, "s--", color=color, label=f"{name}: mean of depths 2-5")
    ax_ckpt.set(title="held-out agreement over training", xlabel="optimizer step",
                ylabel="fraction of positions")
    for ax in (ax_agree, ax_cond, ax_ckpt):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## What this shows

    - fspec's distillation is a pure step (`fspec.ttt.train_step`) over dict pytrees, fed by a batch function
      of the step number; `fspec.distill_head` is this loop with logging, checkpoints and torchrun.
    - Unrolling trains the depths the draft loop runs at serving time. Trained at depth 1 only, a head's
      agreement with the target from depth 2 on is a fraction of the unrolled head's. The price is paid at
      depth 1 (a third of the loss weight goes there, not all of it) and in compute (an unrolled step runs
      the head K times); τ, a sum of products led by α_1, weighs both.
    - With a CPU budget of minutes, a head from scratch gets part of the way to the shipped head, which saw
      about 70x the tokens.
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
    "02_acceptance.ipynb": NB02,
    "03_distill_a_head.ipynb": NB03,
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
