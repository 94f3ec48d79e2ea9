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
    4. the functional dense KV cache (`fspec.DenseKVCache`), over which `draft_step` and `propose` are pure
       and draft what the paged path drafts;
    5. `torch.func.vmap` of `propose` itself over an ensemble of three heads and over a batch of
       (state, cache);
    6. `torch.func.grad_and_value` through `propose` of an acceptance-weighted loss against the target's
       probabilities, w.r.t. the head's parameters, and `torch.compile` of the dense `propose`;
    7. what composes with what: the dense cache for torch.func, the paged cache for serving.

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
    per-request sampling settings (temperature, 0 = greedy; seed; top_k, top_p, min_p) are tensors in the state
    (`state.sampling`, a `SamplingParams`).
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
    the same seventeen tensor leaves in the same order (seven of them the `SamplingParams` of `state.sampling`). At a round's first step it carries `T = B·Q` query rows.
    """),
    code("""
    paths, leaves, _ = fspec.tree.tree_flatten_with_path(state0)
    dtype_name = lambda x: str(x.dtype).removeprefix("torch.")
    show_table(
        ["leaf", "shape", "dtype"],
        [(".".join(map(str, p)), list(x.shape), dtype_name(x)) for p, x in zip(paths, leaves)],
    )
    assert len(leaves) == 17 and all(isinstance(x, torch.Tensor) for x in leaves)
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
    ## The dense KV cache: the same step, out of place

    The paged cache above is donated: written in place, which is what serving wants and what `torch.func`
    cannot trace. `fspec.DenseKVCache` — `[B, layers, Nkv, max_len, D]` buffers, one row of positions per
    request, made by `DenseKVCache.create(cfg, batch_size=, max_len=)` or by
    `fspec.prefill(..., cache="dense")` — is the functional twin: `draft_step` and `propose` dispatch on the cache's type, write K/V out of place
    (`torch.where` over a position one-hot) and attend with a masked softmax, so `(params, state, cache) ->
    (state, new cache)` is a pure function. Same seeds, same sampler arithmetic: over the same prompts its
    drafts are the paged path's, token for token (q to float32 rounding), and the input cache is untouched.
    """),
    code("""
    R = len(PROMPT_LENS)
    prompt_lists = [prompts[b, :n].tolist() for b, n in enumerate(PROMPT_LENS)]
    TEMPS, SEEDS = [0.0, 0.8, 1.0], [11, 12, 13]
    pre_p = fspec.prefill(target, draft, prompt_lists, temperature=TEMPS, seed=SEEDS)
    pre_d = fspec.prefill(target, draft, prompt_lists, temperature=TEMPS, seed=SEEDS, cache="dense")
    kcfg, dense0 = pre_d.draft_cfg, pre_d.draft_cache
    assert isinstance(dense0, fspec.DenseKVCache) and dense0.batch_size == R
    print("DenseKVCache k and v [B, layers, Nkv, max_len, D]:", list(dense0.k.shape))

    cache_bits = bits(dense0)
    out_d, dense1 = fspec.propose(dparams, pre_d.state, dense0, cfg=kcfg)
    out_p, _ = fspec.propose(dparams, pre_p.state, pre_p.draft_cache, cfg=pre_p.draft_cfg)
    assert all(torch.equal(x, y) for x, y in zip(cache_bits, bits(dense0))), "the input cache is untouched"
    assert dense1 is not dense0 and not torch.equal(dense1.k, dense0.k), "a new cache comes back"
    assert torch.equal(out_d.draft_tokens, out_p.draft_tokens), "the paged path's drafts, token for token"
    torch.testing.assert_close(out_d.draft_probs, out_p.draft_probs, rtol=0, atol=1e-5)
    again, _ = fspec.propose(dparams, pre_d.state, dense0, cfg=kcfg)
    assert same(again, out_d), "same inputs, same outputs"
    print("draft_tokens [B, K] over the dense cache (= over the paged one):")
    print(out_d.draft_tokens)
    """),
    md("""
    ## `vmap` of `propose` over an ensemble of heads

    Stack the parameters of three heads (seeds 1, 2, 3; fspec's parameters are a dict pytree, so stacking is a
    `tree_map`) and `vmap` the whole K-step `propose` over them, with one state and one dense cache shared by
    all three: three heads' drafts, q and new caches in one call, equal to a Python loop over the heads. (The
    state's hidden rows were projected by head 1's `fc` in `prefill`; the ensemble shares them.)
    """),
    code("""
    stack = lambda trees: fspec.tree.tree_map(lambda *xs: torch.stack(xs), *trees)
    unstack = lambda tree, i: fspec.tree.tree_map(lambda x: x[i], tree)


    def assert_close_states(got, want):
        assert torch.equal(got.draft_tokens, want.draft_tokens) and torch.equal(got.step, want.step)
        torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=0, atol=1e-5)
        assert same(got.attn, want.attn)


    heads = [make_head(seed).params for seed in (1, 2, 3)]
    ensemble = lambda p: fspec.propose(p, pre_d.state, dense0, cfg=kcfg)
    states_e, caches_e = torch.func.vmap(ensemble)(stack(heads))
    for i, p in enumerate(heads):
        want, want_cache = ensemble(p)  # the loop
        assert_close_states(unstack(states_e, i), want)
        torch.testing.assert_close(caches_e.k[i], want_cache.k, rtol=0, atol=1e-5)
    print("vmapped draft_tokens", list(states_e.draft_tokens.shape), "= 3 heads x B x K:")
    print(states_e.draft_tokens)
    """),
    md("""
    ## `vmap` over a batch of (state, cache)

    The other axis: one head, three independent batches — three `prefill` calls over fresh random prompts of
    the same lengths, so their states and dense caches have equal shapes — stacked leaf by leaf into one
    `DraftState` and one `DenseKVCache` with a leading axis. `vmap(propose)` over them equals three calls, and
    so does one vmapped `draft_step` (column 0 of the same drafts).
    """),
    code("""
    def dense_batch(seed):
        g = torch.Generator().manual_seed(seed)
        ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in PROMPT_LENS]
        pre = fspec.prefill(target, draft, ps, temperature=TEMPS, seed=[10 * seed + b for b in range(R)],
                            cache="dense")
        return pre.state, pre.draft_cache


    batches = [dense_batch(seed) for seed in (3, 4, 5)]
    states_b, caches_b = stack([s for s, _ in batches]), stack([c for _, c in batches])
    run = lambda s, c: fspec.propose(dparams, s, c, cfg=kcfg)
    out_b, new_caches_b = torch.func.vmap(run)(states_b, caches_b)
    for i, (s, c) in enumerate(batches):
        want, want_cache = run(s, c)  # the loop
        assert_close_states(unstack(out_b, i), want)
        torch.testing.assert_close(new_caches_b.v[i], want_cache.v, rtol=0, atol=1e-5)
    one, _ = torch.func.vmap(lambda s, c: fspec.draft_step(dparams, s, c, cfg=kcfg))(states_b, caches_b)
    assert torch.equal(one.step, torch.ones(3, dtype=torch.int64))
    assert torch.equal(one.draft_tokens[..., 0], out_b.draft_tokens[..., 0])
    show_table(["leaf", "batched shape"],
               [(".".join(map(str, p)), list(x.shape))
                for p, x in zip(*fspec.tree.tree_flatten_with_path((out_b, new_caches_b))[:2])])
    """),
    md("""
    ## `grad` through `propose`: an acceptance-weighted loss

    A head is useful in proportion to how many of its drafts the target accepts. With rejection sampling,
    draft k (drawn from q_k) is accepted with probability a_k = min(1, p_k(x_k) / q_k(x_k)) once drafts
    1 .. k-1 were, so step k is verified at all with probability r_k = a_1 ⋯ a_{k-1}, and Σ_k a_1 ⋯ a_k is
    the expected number of accepted drafts along this draft path. The loss weights each step's cross-entropy
    of q_k to the target's p_k by r_k, computed once at the current parameters and held constant:

    L(θ) = mean over requests of Σ_k r_k · H(p_k, q_k(θ)).

    p_k is the target's real distribution at the draft positions: the tiny target runs over each prompt, its
    first new token and the K drafts (`fspec.models.llama.forward_dense`), and its next-token probabilities
    at positions n .. n + K - 1 are restricted to the draft vocabulary (not renormalised: the head
    can never draft the rest). Every request samples at temperature
    1 here (a greedy row's q is one-hot and carries no gradient). `torch.func.grad_and_value`
    differentiates `propose` itself w.r.t. the head's decoder layer, norm and lm_head: the gradient flows
    through the hidden states and q, not through the sampled tokens (Gumbel-max is piecewise constant; the
    noise is fixed by the state's seeds, so the drafts under `grad` are the ones drafted without it). The
    shared embedding, the integer vocabulary maps and `fc` (which projects the target's hidden states in
    `prefill`, before the first step) stay fixed. The gradient equals `torch.autograd`'s, leaves the
    parameters untouched, and a small step along it lowers the loss.
    """),
    code("""
    pre_g = fspec.prefill(target, draft, prompt_lists, temperature=1.0, seed=[21, 22, 23], cache="dense")
    drafted, _ = fspec.propose(dparams, pre_g.state, pre_g.draft_cache, cfg=kcfg)


    def target_p(b):
        \"\"\"[K, Vd]: the target's p at request b's K draft positions, over the draft vocabulary.\"\"\"
        seq = prompt_lists[b] + [int(pre_g.tokens[b])] + drafted.draft_tokens[b].tolist()
        logits, _ = fspec.models.llama.forward_dense(target.params, torch.tensor([seq]), cfg=cfg)
        n = PROMPT_LENS[b]  # position n holds the first new token; its logits give p of draft 1
        return logits[0, n : n + K].softmax(-1)[:, draft_ids]


    p_target = torch.stack([target_p(b) for b in range(R)])  # [B, K, Vd]
    xi = torch.searchsorted(draft_ids, drafted.draft_tokens)  # [B, K]: each draft's draft-vocabulary index
    assert torch.equal(draft_ids[xi], drafted.draft_tokens)
    p_x = p_target.gather(-1, xi[..., None]).squeeze(-1)  # [B, K]: p of each draft
    q_x = drafted.draft_probs.gather(-1, xi[..., None]).squeeze(-1)  # [B, K]: q of each draft
    accept = (p_x / q_x).clamp(max=1)  # a_k
    reach = torch.cat([torch.ones(R, 1), accept[:, :-1].cumprod(-1)], dim=1)  # r_k = a_1 ... a_{k-1}
    accepted = accept.cumprod(-1).sum(-1)  # [B]: expected accepted drafts along these draft paths
    fixed = {k: v for k, v in dparams.items() if k in ("embed", "fc", "d2t", "t2d")}
    trainable = {k: v for k, v in dparams.items() if k not in fixed}


    def loss_fn(trainable):
        out, _ = fspec.propose({**fixed, **trainable}, pre_g.state, pre_g.draft_cache, cfg=kcfg)
        cross_entropy = -(p_target * out.draft_probs.log()).sum(-1)  # [B, K]: H(p_k, q_k), differentiable
        return (reach * cross_entropy).sum(-1).mean(), out.draft_tokens


    params_before = bits(trainable)
    grads, (loss, tokens) = torch.func.grad_and_value(loss_fn, has_aux=True)(trainable)
    assert all(torch.equal(x, y) for x, y in zip(params_before, bits(trainable))), "parameters untouched"
    assert torch.equal(tokens, drafted.draft_tokens), "the same drafts under grad: the noise is the seeds'"

    gpaths, gleaves, _ = fspec.tree.tree_flatten_with_path(grads)
    norms = [float(g.norm()) for g in gleaves]
    names = [".".join(map(str, p)) for p in gpaths]
    show_table(["parameter", "shape", "grad norm"],
               [(n, list(g.shape), f"{x:.3e}") for n, g, x in zip(names, gleaves, norms)])
    print(f"\\nloss {float(loss):.4f}; expected accepted drafts along these paths (of K={K}):",
          [round(float(a), 3) for a in accepted])

    for g, w in zip(gleaves, fspec.tree.tree_leaves(trainable)):
        assert g.shape == w.shape and torch.isfinite(g).all() and g.norm() > 0
    leaf_copies = fspec.tree.tree_map(lambda w: w.detach().clone().requires_grad_(), trainable)
    loss_fn(leaf_copies)[0].backward()
    for g, w in zip(gleaves, fspec.tree.tree_leaves(leaf_copies)):
        assert torch.allclose(g, w.grad, rtol=1e-4, atol=1e-7), "torch.func.grad == torch.autograd"
    lr = 1e-2 / max(norms)
    stepped = fspec.tree.tree_map(lambda w, g: w - lr * g, trainable, grads)
    new_loss, new_tokens = loss_fn(stepped)
    assert torch.equal(new_tokens, tokens) and new_loss < loss, "a small step along -grad lowers the loss"
    print(f"after one step of lr {lr:.2e} along -grad: loss {float(new_loss):.4f}")
    """),
    code("""
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(names) + 1.2))
    ax.barh(names, norms)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set(title="gradient norm per head parameter (acceptance-weighted loss through propose, EAGLE-3)",
           xlabel="||dL/dw|| (log scale)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## `torch.compile` of the dense `propose`

    The dense step has no custom op, no in-place write, no host read and no Python branch on tensor values,
    so the whole K-step rollout compiles as one graph (`fullgraph=True`; the `aot_eager` backend here keeps
    the CPU run short: it traces through AOTAutograd without generating code) and gives the eager drafts.
    """),
    code("""
    compiled = torch.compile(lambda p, s, c: fspec.propose(p, s, c, cfg=kcfg), fullgraph=True,
                             backend="aot_eager")
    got, _ = compiled(dparams, pre_d.state, dense0)
    assert_close_states(got, out_d)
    print("compiled dense propose == eager:", got.draft_tokens.tolist() == out_d.draft_tokens.tolist())
    """),
    md("""
    ## What composes with what

    | cache | the step | composes with |
    |---|---|---|
    | `fspec.DenseKVCache` (`DenseKVCache.create`, `prefill(..., cache="dense")`) | out of place: a new cache comes back, the input is untouched; masked-softmax attention, O(B·Q·max_len) a layer | `torch.func.grad` / `grad_and_value` (through the hidden states and q, not through the argmax / Gumbel-max token choice); `torch.func.vmap` over a stacked (state, cache) or over stacked params; `torch.compile` |
    | `fspec.KVCache` (paged; `prefill`'s default) | donated: K/V and the draft buffers written in place by fused kernels | serving (`fspec.generate`); `torch.compile` and CUDA graphs (`fspec.compile`, reduce-overhead); no grad |

    This notebook asserts the dense row (grad, both vmaps, compile). The paged row's compile and CUDA-graph
    claims are checked by `tests/compile/` and the GPU tests; its gradient is not defined (in-place custom
    ops): train through the dense cache. Both caches draft the same tokens from the same state and seeds.
    """),
    md("""
    ## What this shows

    - A draft step is a function: the input state is bit-identical after the call, and the same inputs give
      the same outputs. The paged KV cache is the one donated argument; with a `DenseKVCache` nothing is
      donated and `(params, state, cache) -> (state, cache)` is pure.
    - The attention metadata of step i+1 is `advance` (or, after the first step, `decode_after`) of step i:
      computed on the device with fixed shapes, correct across block boundaries, with padding rows inert.
    - `draft_step` and `propose` themselves — not a stand-in — go through `torch.func.vmap` (over an ensemble
      of heads, or over a batch of states and caches), `torch.func.grad_and_value` (an acceptance-weighted
      loss, equal to `torch.autograd`'s gradient) and `torch.compile`, over the dense cache.
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
    measures τ of the embedded default model — SmolLM2-135M-Instruct with the EAGLE-3 head fspec distilled
    for it (`fspec.train.default_model.load_default()`, head in `fspec/assets/smollm2_eagle3`) — for K = 1, 2, 3, 5
    and temperatures 0 and 0.7, on prompts of the three held-out sets of `fspec.train.prompts` (`HELDOUT`):
    **code** (HumanEval's function stubs), **chat** (TruthfulQA's questions) and **health** (LiveQA and
    MedicationQA questions), each rendered with the model's chat template. The head was trained on the
    target's answers to `fspec.train.prompts.train_prompts()`, which never overlap these sets (asserted below). τ is
    set against

    1. the i.i.d. model: if every draft were accepted with the same probability α, independently,
       τ = 1 + α + α² + … + α^K = (1 − α^{K+1}) / (1 − α), with α the acceptance rate measured at K = 1;
    2. the identity τ = 1 + Σ_k Π_{i≤k} α_i, with α_i the conditional rate P(draft i accepted | draft i − 1
       accepted) of the same run. Draft k counts only when drafts 1 .. k − 1 were accepted, so this holds
       exactly: it checks the bookkeeping, not a model;
    3. an untrained head of the same shape (random weights, the same draft vocabulary): the floor.

    **float32.** The model runs in float32 on the CPU. Greedy speculative decoding emits the target's own
    greedy tokens, but the verification forward (K + 1 rows per request) and a one-row decode step accumulate
    their matmuls in different orders. In bf16 (8 bits of mantissa, rounded after every op of 30 layers) that
    can flip the target's choice where its two best logits are close, after which the two outputs continue
    different texts (BENCHMARKS.md, the real-model section, saw it on the GPU). float32's rounding step is
    2¹⁶ times finer, and the check here is exact: every greedy output equals the target-only output token for
    token.

    Every claim in the text is an `assert` in a code cell. CI runs the notebook at tiny size (one prompt per
    set, 16 new tokens, K ∈ {1, 3}); the committed outputs are full size (three prompts per set, 48 new
    tokens, K ∈ {1, 2, 3, 5}).
    """),
    code("""
    import json
    import os

    import matplotlib.pyplot as plt
    import torch

    import fspec
    import fspec.train.prompts
    from fspec.train import default_model

    # One thread: the sizes below are budgeted for one core of a shared 2-core CPU.
    torch.set_num_threads(1)
    FULL = os.environ.get("FSPEC_NOTEBOOK_FULL") == "1"
    if FULL:  # the committed outputs
        PER_SET, NEW_TOKENS, KS = 3, 48, [1, 2, 3, 5]
    else:  # CI
        PER_SET, NEW_TOKENS, KS = 1, 16, [1, 3]
    TEMPS = [0.0, 0.7]
    print(f"{'full' if FULL else 'tiny'} size: {PER_SET} prompt(s) from each held-out set "
          f"{fspec.train.prompts.HELDOUT}, {NEW_TOKENS} new tokens each, K in {KS}, temperatures {TEMPS}")


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

    The untrained head is `fspec.init_draft` with the shipped head's configuration: the same draft
    vocabulary (its ids, from its `d2t` map), target layers, MLP width, block size and maximum length,
    so the two differ only in their weights. The prompts are the first `PER_SET` of each held-out set, as one
    user turn through the chat template (`default_model.chat_ids`, the same rendering the head's build
    used); none of them is among the training prompts of the shipped head's recipe (its build log names
    the `train_prompts` arguments), compared after `fspec.train.prompts.normalise` as the prompt module's own
    overlap rule does. For reference, the cell also prints the shipped head's own
    evaluation on the same sets from its build log (more prompts and longer answers, in bf16 on a GPU).
    """),
    code("""
    target, trained = default_model.load_default(dtype=torch.float32, device="cpu")
    dc = trained.cfg
    untrained = fspec.init_draft(
        target, kind="eagle3", seed=1, num_speculative_steps=max(KS), draft_vocab_size=dc.draft_vocab_size,
        block_size=dc.block_size, max_model_len=dc.max_model_len,
        draft_ids=fspec.draft_to_target(torch.arange(dc.draft_vocab_size), trained.params["d2t"]),
        target_layer_ids=dc.target_layer_ids, intermediate_size=dc.model.intermediate_size,
    )
    HEADS = {"trained": trained, "untrained": untrained}
    assert torch.equal(untrained.params["d2t"], trained.params["d2t"]), "the same draft vocabulary"


    def own_params(d):
        return sum(x.numel() for k, v in d.params.items() if k not in d.shared
                   for x in fspec.tree.tree_leaves(v) if x.is_floating_point())


    tc = target.cfg
    print(f"target: SmolLM2-135M-Instruct, {tc.num_hidden_layers} layers, hidden {tc.hidden_size}, vocab "
          f"{tc.vocab_size}, {sum(x.numel() for x in fspec.tree.tree_leaves(target.params)):,} parameters, "
          f"{target.params['embed'].dtype}")
    print(f"head: {dc.kind}, reads target layers {dc.target_layer_ids}, draft vocabulary "
          f"{dc.draft_vocab_size}, {own_params(trained):,} parameters of its own (embedding: the target's)")

    texts, names = [], []
    for set_name in fspec.train.prompts.HELDOUT:
        for i, text in enumerate(fspec.train.prompts.heldout(set_name)[:PER_SET]):
            texts.append(text)
            names.append(f"{set_name}[{i}]")
    prompts = default_model.chat_ids(target, texts, max_tokens=default_model.EVAL_MAX_PROMPT_TOKENS)
    assert len(prompts) == len(texts), "no prompt dropped for length"
    build_log = json.loads((default_model.ASSETS / "train_log.json").read_text())
    r = build_log["recipe"]  # the shipped head's build: its training prompts are train_prompts(...) of these
    training = fspec.train.prompts.train_prompts(n_code=r["n_code"], n_chat=r["n_chat"],
                                           code_phrasings=r["code_phrasings"])
    training = {fspec.train.prompts.normalise(t) for t in training[: r["train_prompts"] or None]}
    assert not training & {fspec.train.prompts.normalise(t) for t in texts}, "held-out prompts only"
    print(f"\\n{len(prompts)} held-out prompts ({', '.join(names)}), {min(map(len, prompts))} to "
          f"{max(map(len, prompts))} tokens after the chat template; none of the {len(training):,} training "
          "prompts of the shipped head's recipe")
    chat = prompts[names.index("chat[0]")]
    print("\\nthe chat prompt, rendered:\\n" + target.tokenizer.decode(chat, skip_special_tokens=False))

    print(f"\\nthe shipped head's build log, tau at K = {r['eval_k']} ({r['eval_prompts']} prompts per set, "
          f"{r['eval_new_tokens']} new tokens, {r['target_dtype']}, {build_log['gpu']}):")
    show_table(["set", "greedy", "T = 0.7"],
               [(name, f"{row['tau_T0.0']:.2f}", f"{row['tau_T0.7']:.2f}")
                for name, row in build_log["held_out"].items()])
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


    def sweep(head_name):
        \"\"\"One `fspec.generate` call per (temperature, K) with HEADS[head_name], into `runs`.\"\"\"
        for temp in TEMPS:
            for k in KS:
                res = fspec.generate(
                    target, HEADS[head_name], prompts, max_new_tokens=NEW_TOKENS, temperature=temp,
                    seed=list(range(len(prompts))), num_speculative_steps=k,
                )
                runs[head_name, temp, k] = res.tokens, res.stats


    sweep("trained")
    """),
    code("""
    sweep("untrained")  # a cell of its own: each cell of a full-size run stays within the build's time limit
    print(f"{len(runs) + 1} generate calls")  # no timings: re-running gives byte-identical outputs
    """),
    md("""
    ## Greedy speculative decoding emits the target's own tokens

    At temperature 0 the verification accepts a draft exactly when it is the target's argmax, and the
    replacement is the target's argmax: the output is target-only greedy decoding, for every K and for both
    heads — the untrained one just takes one target forward per token to get there. In float32 this holds
    token for token (asserted exactly, every prompt, every greedy run). And τ stays within its bounds: at
    least the one token the target always emits, at most K + 1.
    """),
    code("""
    greedy_runs = 0
    for (head_name, temp, k), (tokens, stats) in runs.items():
        assert 1.0 <= stats["acceptance_length"] <= k + 1, (head_name, temp, k)
        if temp == 0.0:
            differ = [names[i] for i, (a, b) in enumerate(zip(tokens, plain.tokens)) if a != b]
            assert len(tokens) == len(plain.tokens) and not differ, (head_name, k, differ)
            greedy_runs += 1
    print(f"{greedy_runs} greedy speculative runs x {len(prompts)} prompts: every output equals the "
          f"target-only output token for token ({sum(map(len, plain.tokens))} tokens per run)")
    print(f"1 <= tau <= K + 1 in all {len(runs)} runs")
    print("\\ntarget-only greedy, the chat prompt's answer:\\n" + plain.text[names.index("chat[0]")])
    """),
    md("""
    ## τ against the two predictions

    For each run: the measured τ; 1 + Σ Π α_i from the same run's conditional rates (equal to the measured
    τ to rounding: the identity); the i.i.d. prediction (1 − α^{K+1}) / (1 − α) with α from the K = 1 run of
    the same head and temperature (exact at K = 1, where τ = 1 + α by definition); and the per-position
    acceptance rates P(draft k accepted). The rates never increase with k, since draft k + 1 is accepted only
    when draft k was. (The ceiling K + 1 is far above every curve in the plot below, and left out of it.) At
    T > 0 each run samples its own text, so its τ carries sampling noise that the greedy runs do not have.
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
        if k == 1:
            assert abs(iid - tau) <= 1e-9, (head_name, temp, iid, tau)  # tau = 1 + alpha at K = 1
        rows.append((head_name, temp, k, f"{tau:.3f}", f"{ident:.3f}", f"{iid:.3f}",
                     ", ".join(f"{r:.2f}" for r in rates)))
    show_table(["head", "T", "K", "tau", "1 + sum prod a_i", "iid (a from K=1)", "P(draft k accepted)"], rows)
    print(f"\\n|tau - (1 + sum prod a_i)| <= {worst_identity:.1e} over {len(runs)} runs (tolerance 1e-9)")
    """),
    code("""
    fig, axes = plt.subplots(1, len(TEMPS), figsize=(4.8 * len(TEMPS), 3.8), sharey=True)
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
    fig.suptitle(f"SmolLM2-135M-Instruct + shipped EAGLE-3 head, {len(prompts)} held-out prompts, "
                 f"{NEW_TOKENS} new tokens each")
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
    i.i.d. prediction minus the measured greedy τ. Nine prompts of 48 tokens are too few to pin either down;
    the shipped head's build log above has the larger sample.
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
    print("greedy: i.i.d. prediction minus measured tau, K >= 2: "
          + ", ".join(f"K={k}: {g:+.3f}" for k, g in gaps.items()))
    """),
    md("""
    ## Trained against untrained

    Distillation is what makes drafts worth verifying: the trained head's τ is above the untrained head's for
    every temperature and K. The untrained head's drafts are essentially never accepted (τ below 1.05 at both
    temperatures, asserted): greedy verification needs the target's argmax, and sampling accepts a draft
    with probability Σ min(p, q), which a near-uniform q over the draft vocabulary earns almost nowhere.
    """),
    code("""
    rows = []
    for temp in TEMPS:
        for k in KS:
            t_tau, u_tau = (runs[h, temp, k][1]["acceptance_length"] for h in ("trained", "untrained"))
            assert t_tau > u_tau, (temp, k, t_tau, u_tau)
            assert u_tau < 1.05, (temp, k, u_tau)
            rows.append((temp, k, f"{t_tau:.2f}", f"{u_tau:.3f}", f"{t_tau / u_tau:.2f}x"))
    show_table(["T", "K", "tau trained", "tau untrained", "ratio"], rows)
    """),
    md("""
    ## What this shows

    - Greedy speculative decoding emits the target's own greedy tokens, token for token in float32, for every
      K and both heads.
    - τ = 1 + Σ_k Π_{i≤k} α_i holds to rounding in every run: acceptance is a prefix, so τ is the sum of the
      per-position acceptance rates, plus one.
    - The i.i.d. formula with α from K = 1 is a model, not an identity: exact at K = 1 by construction, and
      elsewhere off by what the printed gaps show; the per-position plot shows where the two part.
    - The shipped head beats an untrained head of the same shape at every K and temperature; the untrained
      head is accepted almost never (τ < 1.05). How far the shipped head's τ is from its targets, and why,
      is in BENCHMARKS.md (the real-model section).
    """),
]

# ----------------------------------------------------------------------------------------------------------
# 03_distill_a_head.ipynb
# ----------------------------------------------------------------------------------------------------------

NB03: list[tuple[str, str]] = [
    md("""
    # 03 — Distill an EAGLE-3 head for SmolLM2, and what unrolling buys

    A draft head is trained against a frozen target: the target's distribution p over the next token is the
    soft label, the head's q is fitted to it. At serving time, though, the head's step k ≥ 2 does not read the
    target's hidden state and the true token: it reads its own previous output and its own previous draft.
    EAGLE-3's training-time test (TTT) trains for exactly that: the head step is unrolled K times per batch,
    step j reading step j − 1's hidden state and argmax, and the loss is Σ_j w^j · CE(p_j, q_j)
    (`fspec.train.ttt.ttt_loss`; K = `ttt_steps`, w = `step_weight` = 0.8).

    This notebook trains two EAGLE-3 heads from scratch for the embedded default target, SmolLM2-135M-Instruct
    (`fspec.train.default_model.load_default()`, frozen), with the same initialisation, the same batches and the
    same number of optimizer steps:

    - **unrolled**: `ttt_steps = 5`, the K it is evaluated at;
    - **K = 1**: `ttt_steps = 1`, plain next-token distillation (each step costs a fraction as much).

    **Data.** Self-distillation, as the shipped head was built (`fspec/train/default_model.py`): training prompts
    from `fspec.train.prompts.train_prompts()` (code requests written from the standard library's docstrings, and
    chat prompts: HealthSearchQA and NQ-open questions, XSum articles to summarise, sentences to translate),
    rendered with the chat template (`default_model.chat_ids`), answered by the target itself, greedy
    (`default_model.answers`), and concatenated into one token stream (`default_model.stream_of`).
    **Evaluation** uses only the held-out sets of `fspec.train.prompts` (`HELDOUT`: code = HumanEval, chat =
    TruthfulQA, health = LiveQA + MedicationQA), which the training prompts never overlap (asserted): τ with
    `fspec.generate` (greedy, K = 5), and each head's top-1 agreement with the target at each unrolled depth
    on the target's own greedy answers to held-out prompts. The shipped head is the reference.

    **Budget.** The target runs in bf16, the dtype the shipped head was built with (no claim here is about
    exact tokens), the heads train in fp32, and their draft vocabulary is 2048 ids, a quarter of the shipped
    head's (asserted). At full size (the committed outputs) each head trains for 120 steps of 4 × 128 tokens
    on the target's answers to 64 training prompts, on one CPU thread (notebooks/README.md gives the run
    time; no timings are printed, so that re-running gives byte-identical outputs). The shipped head saw far
    more tokens (printed below). CI runs a tiny size (8 answers of 16 tokens, 6 steps of 2 × 32 tokens) and
    checks only the mechanics there.
    """),
    code("""
    import contextlib
    import io
    import json
    import math
    import os

    import matplotlib.pyplot as plt
    import torch

    import fspec
    import fspec.train.prompts
    from fspec.train import default_model, distill, ttt

    # One thread: the sizes below are budgeted for one core of a shared 2-core CPU.
    torch.set_num_threads(1)
    FULL = os.environ.get("FSPEC_NOTEBOOK_FULL") == "1"
    if FULL:  # the committed outputs: about 10 minutes
        N_CODE, N_CHAT, ANSWER_TOKENS = 32, 32, 64
        STEPS, BATCH, SEQ_LEN, WARMUP = 120, 4, 128, 10
        CHECKPOINTS = [0, 30, 60, 90, 120]
        HELD_PER_SET, HELD_NEW, EVAL_NEW, FINAL_NEW = 3, 64, 32, 48
    else:  # CI: seconds
        N_CODE, N_CHAT, ANSWER_TOKENS = 4, 4, 16
        STEPS, BATCH, SEQ_LEN, WARMUP = 6, 2, 32, 2
        CHECKPOINTS = [0, 6]
        HELD_PER_SET, HELD_NEW, EVAL_NEW, FINAL_NEW = 1, 32, 6, 12
    LR, VD, EVAL_K, MAX_PROMPT_TOKENS = 3e-3, 2048, 5, 384
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
    ## The target, its answers, and the held-out sets

    The training stream is prompt + answer + EOS for every training prompt, the answers the target's own
    (greedy, `ANSWER_TOKENS` at most). The held-out data is built the same way from the first `HELD_PER_SET`
    prompts of each held-out set: their windows of `SEQ_LEN` tokens measure the agreement, and the prompts
    themselves are what `fspec.generate` measures τ on. Agreement counts the positions whose next token is
    part of an answer (or its EOS): the text a draft head drafts at serving time, not the prompts.
    """),
    code("""
    target, shipped = default_model.load_default(dtype=torch.bfloat16, device="cpu")
    train_texts = fspec.train.prompts.train_prompts(n_code=N_CODE, n_chat=N_CHAT)
    held_texts = [t for s in fspec.train.prompts.HELDOUT for t in fspec.train.prompts.heldout(s)[:HELD_PER_SET]]
    held_set = {fspec.train.prompts.normalise(t) for s in fspec.train.prompts.HELDOUT for t in fspec.train.prompts.heldout(s)}
    assert not held_set & {fspec.train.prompts.normalise(t) for t in train_texts}, "no held-out prompt in training"

    train_ids = default_model.chat_ids(target, train_texts, max_tokens=MAX_PROMPT_TOKENS)
    held_ids = default_model.chat_ids(target, held_texts, max_tokens=default_model.EVAL_MAX_PROMPT_TOKENS)
    assert len(held_ids) == len(held_texts), "no held-out prompt dropped for length"
    greedy = default_model.Recipe(new_tokens=ANSWER_TOKENS, greedy_share=1.0, gen_batch=len(train_ids))
    with contextlib.redirect_stdout(io.StringIO()):  # answers() prints its progress with timings
        train_answers, info = default_model.answers(target, train_ids, greedy, seed=0)
    stream = default_model.stream_of(target, train_ids, train_answers)
    held_plain = fspec.generate(target, None, held_ids, max_new_tokens=HELD_NEW)
    held_stream = default_model.stream_of(target, held_ids, held_plain.tokens).long()
    answer_next = torch.zeros(held_stream.numel(), dtype=torch.bool)  # [t]: token t + 1 is in an answer
    start = 0
    for p, a in zip(held_ids, held_plain.tokens):
        row = len(p) + len(a) + (0 if a and a[-1] in target.cfg.eos_token_ids else 1)
        answer_next[start + len(p) - 1 : start + row - 1] = True
        start += row
    assert start == held_stream.numel()
    n_windows = held_stream.numel() // SEQ_LEN
    held_windows = held_stream[: n_windows * SEQ_LEN].view(n_windows, SEQ_LEN)
    held_answer = answer_next[: n_windows * SEQ_LEN].view(n_windows, SEQ_LEN)

    seen = STEPS * BATCH * SEQ_LEN
    print(f"training: {len(train_ids)} of {len(train_texts)} prompts (<= {MAX_PROMPT_TOKENS} tokens), "
          f"{info['new_tokens']:,} answer tokens, a stream of {stream.numel():,} tokens; {seen:,} tokens "
          f"seen per head ({seen / stream.numel():.1f} epochs)")
    print(f"held out: {len(held_ids)} prompts ({HELD_PER_SET} per set of {fspec.train.prompts.HELDOUT}), "
          f"{sum(map(len, held_plain.tokens)):,} answer tokens, {n_windows} windows of {SEQ_LEN} "
          f"({int(held_answer.sum()):,} positions before an answer token)")
    print("\\na training prompt:\\n" + train_texts[0][:300])
    print("\\nits answer:\\n" + target.tokenizer.decode(train_answers[0]))

    # The shipped head's build, for scale (its log ships next to the weights).
    build_log = json.loads((default_model.ASSETS / "train_log.json").read_text())
    r = build_log["recipe"]
    shipped_tokens = build_log["distill"]["steps"] * r["batch_size"] * r["seq_len"]
    print(f"\\nthe shipped head: ttt_steps={r['ttt_steps']}, draft vocabulary {r['draft_vocab_size']}, "
          f"{build_log['answers']['answers']} answers, {build_log['distill']['steps']} steps of "
          f"{r['batch_size']} x {r['seq_len']} tokens = {shipped_tokens:,} tokens ({build_log['gpu']}), "
          f"{shipped_tokens / seen:.0f}x what each head here sees")
    assert shipped.cfg.draft_vocab_size == 4 * VD, "a quarter of the shipped head's draft vocabulary"
    """),
    md("""
    ## Training, one pure step at a time

    `fspec.distill_head` runs this loop; here it is written out so that both heads train in lockstep and are
    measured at checkpoints. `fspec.train.distill.new_draft` makes a fresh head whose draft vocabulary is the `VD`
    most frequent tokens of the stream; `online_batches` maps a step number to a batch (windows of the stream
    run through the frozen target), a pure function of (seed, step); each step's batch is made once and both
    heads take their step on it. `fspec.train.ttt.train_step` is one pure AdamW step on the TTT loss
    (`torch.func.grad_and_value`); `fspec.train.distill.to_draft` turns the fp32 master weights into a servable
    `Draft` at each checkpoint.

    At each checkpoint: τ with `fspec.generate` (greedy, K = 5) on one held-out prompt per set, and the
    head's top-1 agreement with the target at each of 5 unrolled depths on the held-out windows. Agreement
    here is measured over the target's whole vocabulary: at depth j the head drafts from its own j − 1
    previous drafts (`fspec.train.ttt.unroll`, as at serving time), and its draft, mapped to a target id, counts
    when it is the target's argmax there — the token greedy verification would accept — so heads with
    different draft vocabularies compare on the same footing.
    """),
    code("""
    with torch.no_grad():
        held_logits, held_hidden = fspec.models.llama.forward_dense(
            target.params, held_windows, cfg=target.cfg, aux_layer_ids=shipped.cfg.target_layer_ids
        )
    held_argmax = held_logits.argmax(-1)  # [windows, SEQ_LEN]: the target's greedy token after each position


    def held_out_agreement(head):
        \"\"\"Top-1 agreement of the head's drafts with the target's argmax at unrolled depths 1..EVAL_K, over
        the positions before an answer token.\"\"\"
        assert head.cfg.target_layer_ids == shipped.cfg.target_layer_ids
        ids = ttt.vocab_ids(head)  # draft id -> target id
        batch = {"input_ids": held_windows, "hidden": held_hidden.aux,
                 "target_logits": held_logits.index_select(-1, ids)}
        with torch.no_grad():
            logits, _ = ttt.unroll(head.params, batch, cfg=head.cfg, ttt_steps=EVAL_K)
        out = []
        for j, lg in enumerate(logits):  # row i of depth j drafts the token the target predicts at i + j + 1
            hit = ids[lg[:, : SEQ_LEN - 1 - j].argmax(-1)] == held_argmax[:, j + 1 :]
            mask = held_answer[:, j + 1 :]
            out.append(float((hit & mask).sum() / mask.sum()))
        return out


    def generate_stats(head, prompt_ids, new_tokens):
        \"\"\"`fspec.generate`'s stats, greedy, K = EVAL_K.\"\"\"
        return fspec.generate(target, head, prompt_ids, max_new_tokens=new_tokens,
                              num_speculative_steps=EVAL_K).stats


    eval_ids = held_ids[::HELD_PER_SET]  # one prompt per held-out set
    draft = distill.new_draft(target, kind="eagle3", tokens=stream, draft_vocab_size=VD, seed=0,
                              num_speculative_steps=EVAL_K)
    TTT_STEPS = {"unrolled": EVAL_K, "K=1": 1}
    cfgs = {name: fspec.DistillConfig(ttt_steps=k, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, lr=LR,
                                      warmup_steps=WARMUP, seed=0)
            for name, k in TTT_STEPS.items()}
    batches = distill.online_batches(target, draft, stream, cfg=cfgs["unrolled"])
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    state = {name: (trainable, ttt.adamw_init(trainable)) for name in TTT_STEPS}  # the same initial head
    logs = {name: {"loss": [], "ce": [], "checkpoints": [], "tau": [], "agreement": []} for name in TTT_STEPS}
    for step in range(STEPS + 1):
        if step in CHECKPOINTS:
            for name, (params, _) in state.items():
                head = distill.to_draft(draft, params)
                logs[name]["checkpoints"].append(step)
                logs[name]["tau"].append(generate_stats(head, eval_ids, EVAL_NEW)["acceptance_length"])
                logs[name]["agreement"].append(held_out_agreement(head))
        if step == STEPS:
            break
        batch = batches(step)  # one target forward, both heads
        for name, (params, opt) in state.items():
            params, opt, m = ttt.train_step(params, opt, frozen, batch, step=step, cfg=draft.cfg,
                                            dcfg=cfgs[name])
            state[name] = params, opt
            logs[name]["loss"].append(float(m["loss"]))  # sum_j w^j CE_j over this batch
            logs[name]["ce"].append(m["loss_per_step"].tolist())  # CE_j, j = 0 .. ttt_steps - 1
    heads = {name: distill.to_draft(draft, params) for name, (params, _) in state.items()}
    for name, log in logs.items():
        print(f"{name} head (ttt_steps={TTT_STEPS[name]}), {STEPS} steps; tau at K={EVAL_K} by checkpoint: "
              + ", ".join(f"{s}: {t:.2f}" for s, t in zip(log["checkpoints"], log["tau"])))
    """),
    md("""
    ## Mechanics

    Both heads started from the same weights and took the same number of steps on the same batches; every
    loss is finite, τ stays within [1, K + 1], training changed the head's own weights and left the shared
    embedding (the target's) alone. The loss goes down from the first steps to the last (means of the first
    and last tenth of the run, so one noisy batch does not decide it).
    """),
    code("""
    first = {n: logs[n]["agreement"][0] for n in logs}
    assert first["unrolled"] == first["K=1"] and logs["unrolled"]["tau"][0] == logs["K=1"]["tau"][0]
    for name, log in logs.items():
        assert len(log["loss"]) == STEPS and all(math.isfinite(x) for x in log["loss"])
        assert log["checkpoints"] == CHECKPOINTS
        assert all(1.0 <= t <= EVAL_K + 1 for t in log["tau"])
        n = max(STEPS // 10, 2)
        start, end = sum(log["loss"][:n]) / n, sum(log["loss"][-n:]) / n
        assert end < start, (name, start, end)
        print(f"{name}: loss {start:.3f} -> {end:.3f} (mean of the first and last {n} steps)")
    for head in heads.values():
        assert not torch.equal(head.params["fc"], draft.params["fc"]), "training changed the weights"
        assert head.params["embed"] is target.params["embed"], "the embedding is the target's"
    """),
    code("""
    def smooth(xs, n=max(STEPS // 20, 1)):
        \"\"\"Trailing moving average over n steps (batches of a few sequences are noisy).\"\"\"
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
    ax_tau.set(title=f"tau at K = {EVAL_K}, greedy, {len(eval_ids)} held-out prompts x {EVAL_NEW} tokens",
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
    depth, and, from `fspec.generate` on all the held-out prompts and longer outputs, τ at K = 5 with its
    conditional acceptance rates α_k = P(draft k accepted | draft k − 1 accepted). The shipped head (its
    build printed above: more unrolled steps, far more tokens, a 4x larger draft vocabulary) is the
    reference.

    The K = 1 head puts all of its training into depth 1, where the unrolled head gives only a weight of 1 in
    1 + 0.8 + … + 0.8⁴ ≈ 3.4. From depth 2 on, a head drafts from its own previous hidden state and its own
    previous draft: inputs the K = 1 head never saw in training. τ = 1 + α_1 + α_1·α_2 + … weighs both
    effects, and α_1 multiplies everything after it.

    At full size the notebook asserts that the K = 1 head's held-out agreement at every depth ≥ 2 is below
    the unrolled head's, that training raised both heads' τ above that of their common random start, and
    that both stay below the shipped head's τ; at tiny size (a few steps) neither head has learned enough for
    a comparison to mean anything, and only the mechanics are checked.
    """),
    code("""
    final = {name: heads[name] for name in ("unrolled", "K=1")} | {"shipped (reference)": shipped}
    agreement = {name: held_out_agreement(h) for name, h in final.items()}
    stats = {name: generate_stats(h, held_ids, FINAL_NEW) for name, h in final.items()}
    taus = {name: s["acceptance_length"] for name, s in stats.items()}
    cond = {name: s["conditional_acceptance_per_position"] for name, s in stats.items()}
    depth_cols = [f"d{j + 1}" for j in range(EVAL_K)]
    show_table(["head", f"tau (K={EVAL_K})"] + [f"a_{j + 1}" for j in range(EVAL_K)] + depth_cols,
               [(n, f"{taus[n]:.3f}", *(f"{a:.2f}" for a in cond[n]), *(f"{a:.3f}" for a in agreement[n]))
                for n in final])
    print(f"\\ntau, a_k = P(draft k accepted | draft k-1 accepted): fspec.generate, greedy, K = {EVAL_K}, "
          f"{len(held_ids)} held-out prompts x {FINAL_NEW} new tokens")
    print(f"d_j: top-1 agreement with the target's argmax at unrolled depth j on {n_windows} held-out "
          f"windows of {SEQ_LEN} tokens (positions before an answer token)")
    assert all(1.0 <= t <= EVAL_K + 1 for t in taus.values())
    if FULL:
        deep = [(j + 1, agreement["K=1"][j], agreement["unrolled"][j]) for j in range(1, EVAL_K)]
        assert all(k1 < un for _, k1, un in deep), deep
        assert max(taus["unrolled"], taus["K=1"]) < taus["shipped (reference)"]
        assert all(logs[n]["tau"][-1] > logs[n]["tau"][0] for n in logs), "training raised tau"
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

    - fspec's distillation is a pure step (`fspec.train.ttt.train_step`) over dict pytrees, fed by a batch function
      of the step number; `fspec.distill_head` is this loop with logging, checkpoints and torchrun.
    - Unrolling trains the depths the draft loop runs at serving time. Trained at depth 1 only, a head
      agrees with the target less from depth 2 on than the unrolled head does. Unrolling costs compute (an
      unrolled step runs the head K times) and loss weight at depth 1 (a third of it goes there, not all of
      it); τ, a sum of products led by α_1, weighs both.
    - With a CPU budget of minutes, a head from scratch raises τ above its random start but stays below the
      shipped head.
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
