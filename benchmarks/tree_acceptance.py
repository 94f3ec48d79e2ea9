"""How long a static draft tree would make the shipped head's accepted runs, against its chain (CPU, greedy).

    python benchmarks/tree_acceptance.py [--prompts 12] [--new-tokens 96] [--k 5] [--budgets 5 8 11 15]
        [--tree-prompts 24] [--threads 2] [--head DIR] [--out benchmarks/results/tree_acceptance_cpu.json]

Greedy speculation emits the target's greedy tokens whatever it drafts, and a draft node counts only while
every node above it was the target's token. So the head's distribution at each depth of the one path that can
be accepted is its teacher-forced distribution along the target's own answer (`fspec.train.ttt.unroll` with
feed "data": step j reads the answer's tokens, as drafting does while it is accepted). Per round start i and
depth j this script takes the rank r_j(i) of the target's token in the head's depth-j distribution over the
draft vocabulary (a token outside it: no rank). A static tree is a prefix-closed set of rank paths (Medusa's
"choices"); a round starting at i accepts the longest prefix of (r_0(i), r_1(i), ...) that the tree holds,
and the next round starts after the accepted tokens and the target's own (as the engine's rounds do).

Trees: for each node budget N (draft rows; the chain of K is the tree of the paths (0), (0, 0), ...) the N
rank paths most often matched on a separate set of prompts (`--tree-prompts` training prompts,
`fspec.train.prompts.train_prompts`: no held-out prompt chooses the tree) — prefix-closed, since a path is
matched at least as often as its extensions — then scored on each held-out set (`prompts.HELDOUT`).
A round's verification runs 1 + N rows; the several-row kernels take up to 16 (so N <= 15), at about one
row's cost where launches bound a round (BENCHMARKS.md, SmolLM2's several-row products).

Rows: per held-out set, `tau_chain` (the head's own K-chain), `tau_tree[N]` and `tau_chain_k[j]` (chains of
every length j up to the trees' depth: the head drafting j steps), tokens per round over the
rounds whose drafts (to the trees' depth) lie inside the answers (the answers run that many tokens past
--new-tokens for them). The chain
simulated over the whole answers must run the engine's rounds with the engine's acceptances
(`check_chain`; `rounds_engine`, B = 1 calls), or the script stops: that checks the ranks against what the
engine drafted. fp32 target and head on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402

import fspec  # noqa: E402
from fspec.models.heads import head_kind  # noqa: E402
from fspec.train import prompts as P  # noqa: E402
from fspec.train import ttt  # noqa: E402
from fspec.train.default_model import chat_ids  # noqa: E402

NO_RANK = 1 << 30


def answers(target, draft, texts: list[str], new_tokens: int, k: int) -> tuple[list[list[int]], list, list]:
    """(the templated prompts' ids, the target's greedy answers, per prompt the engine's per-position
    acceptance rates over its rounds): one user turn each, one `generate` call per prompt (B = 1)."""
    prompts = chat_ids(target, texts, max_tokens=target.cfg.max_position_embeddings)  # the recipe's own
    outs, rates = [], []
    for ids in prompts:
        res = fspec.generate(target, draft, [ids], max_new_tokens=new_tokens, num_speculative_steps=k)
        outs.append(res.tokens[0])
        rates.append(res.stats["acceptance_rate_per_position"])
    return prompts, outs, rates


def chain_of(k: int) -> set[tuple[int, ...]]:
    """The K-chain as a tree: the paths (0,), (0, 0), ... of depth <= k."""
    return {(0,) * d for d in range(1, k + 1)}


def check_chain(rank_rows: list[torch.Tensor], rates: list, k: int, new_tokens: int) -> int:
    """The engine's rounds, checked against the chain simulated over the ranks: per answer the same rounds
    and, at every depth, the same number of rounds that accepted past it; except in the last round of an
    answer cut at new_tokens, where the engine also verified drafts past the cut (one round more or fewer
    per depth). SystemExit naming the answer otherwise: the ranks are not what the engine drafted from."""
    chain = chain_of(k)
    total = 0
    for i, (r, rate) in enumerate(zip(rank_rows, rates)):
        acc = simulate(r, chain, whole=True)
        slack = 1 if r.shape[0] == new_tokens else 0
        for j in range(k):
            engine, sim = rate[j] * len(acc), sum(a > j for a in acc)
            if abs(engine - round(engine)) > 1e-6 or abs(round(engine) - sim) > slack:
                raise SystemExit(f"answer {i}, depth {j}: {engine:.3f} rounds took it, {sim} by the ranks")
        total += len(acc)
    return total


def ranks(target, draft, prompt: list[int], answer: list[int], k: int) -> torch.Tensor:
    """[len(answer), k] int64: row a (a round whose current token is answer[a], so its target hidden is at
    the position before it), column j: the rank of answer[a + 1 + j] in the head's teacher-forced depth-j
    distribution over the draft vocabulary; NO_RANK past the answer or outside the vocabulary."""
    ids = torch.tensor([prompt + answer], dtype=torch.int64)
    batch = ttt.target_batch(target, draft, ids)
    with torch.no_grad():
        logits, _ = ttt.unroll(draft.params, batch, cfg=draft.cfg, ttt_steps=k, feed="data")
    s, p = ids.shape[1], len(prompt)
    vocab = ttt.vocab_ids(draft)  # [Vd] target ids
    to_draft = torch.full((target.cfg.vocab_size,), -1, dtype=torch.int64)
    to_draft[vocab] = torch.arange(vocab.numel())
    out = torch.full((len(answer), k), NO_RANK, dtype=torch.int64)
    for a in range(len(answer)):
        i = p + a - 1  # the row whose step 0 pairs hidden i with token i + 1 = answer[a]
        for j in range(k):
            t = i + 2 + j
            if t >= s:
                break
            d = int(to_draft[ids[0, t]])
            if d < 0:
                continue
            row = logits[j][0, i].float()
            out[a, j] = int((row > row[d]).sum())  # ties broken towards the target's token: the argmax's rule
    return out


def paths_of(r: torch.Tensor) -> list[tuple[int, ...]]:
    """The rank prefixes one round row matches: (r_0,), (r_0, r_1), ... up to the first missing rank."""
    out, prefix = [], ()
    for x in r.tolist():
        if x >= NO_RANK:
            break
        prefix = (*prefix, x)
        out.append(prefix)
    return out


def choose_tree(rows: list[torch.Tensor], budget: int, k: int) -> set[tuple[int, ...]]:
    """The `budget` rank paths of depth <= k matched by the most rows (ties: shorter, then smaller ranks)."""
    counts: dict[tuple[int, ...], int] = {}
    for r in rows:
        for path in paths_of(r[:k]):
            counts[path] = counts.get(path, 0) + 1
    best = sorted(counts, key=lambda q: (-counts[q], len(q), q))[:budget]
    return set(best)


def simulate(r: torch.Tensor, tree: set[tuple[int, ...]], *, whole: bool = False) -> list[int]:
    """The accepted drafts of each round of greedy speculation with `tree` over one answer's rank rows: a
    round accepts the longest held prefix of its rank path, emits it plus the target's token and the next
    round starts after them. Only rounds whose K drafts lie inside the answer count (past its end a draft's
    fate is unknown); whole: every round to the answer's end (the engine's rounds, for `check_chain`)."""
    a, out = 0, []  # row a: the round whose current token is answer[a] (answer[0]: the prefill's)
    n, k = r.shape
    while a < n - 1 and (whole or a + k < n - 1):
        accepted = 0
        for path in paths_of(r[a]):
            if path not in tree:
                break
            accepted = len(path)
        out.append(accepted)
        a += min(accepted + 1, n - 1 - a)
    return out


def tau(rank_rows: list[torch.Tensor], tree: set[tuple[int, ...]]) -> float:
    """Tokens per round (accepted drafts + the target's token) over every answer's counted rounds."""
    acc = [a for r in rank_rows for a in simulate(r, tree)]
    return (sum(acc) + len(acc)) / max(len(acc), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts per set")
    p.add_argument("--tree-prompts", type=int, default=24, help="training prompts that choose the trees")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=5, help="the chain's K")
    p.add_argument("--depth", type=int, default=0, help="the trees' depth (0: K; at least K)")
    p.add_argument("--budgets", type=int, nargs="+", default=[5, 8, 11, 15], help="tree sizes N (draft rows)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--head", default=None, help="another head directory for the default target")
    p.add_argument("--out", default="benchmarks/results/tree_acceptance_cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = fspec.load_default()
    if args.head:
        draft = fspec.load_draft(args.head, target=target, dtype=torch.float32)
    if not head_kind(draft.cfg).reduced_vocab:
        raise SystemExit("tree_acceptance: expects an EAGLE-3 head (its d2t maps the ranks)")
    k = args.k
    depth = max(args.depth, k)
    t0 = time.perf_counter()
    texts = P.train_prompts(n_code=args.tree_prompts // 2, n_chat=args.tree_prompts - args.tree_prompts // 2)
    prompts, outs, _ = answers(target, draft, texts, args.new_tokens + depth, k)
    choosing = [ranks(target, draft, q, a, depth) for q, a in zip(prompts, outs) if len(a) > 1]
    trees = {n: choose_tree([row for r in choosing for row in r], n, depth) for n in args.budgets}
    chain = chain_of(k)
    print(f"trees chosen on {len(choosing)} training answers in {time.perf_counter() - t0:.0f} s", flush=True)
    doc = results_io.header("tree_acceptance.py", argv, "cpu")
    doc.update(
        k=k,
        depth=depth,
        new_tokens=args.new_tokens,
        tree_prompts=len(choosing),
        trees={str(n): sorted(trees[n]) for n in args.budgets},
        rows=[],
    )
    for name in P.HELDOUT:
        t1 = time.perf_counter()
        texts = P.heldout(name)[: args.prompts]
        prompts, outs, rates = answers(target, draft, texts, args.new_tokens + depth, k)
        rank_rows = [ranks(target, draft, q, a, depth) for q, a in zip(prompts, outs)]
        engine_rounds = check_chain(rank_rows, rates, k, args.new_tokens + depth)
        row = {
            "case": {"set": name, "prompts": len(prompts)},
            "tokens": sum(map(len, outs)),
            "rounds_engine": engine_rounds,
            "tau_chain": round(tau(rank_rows, chain), 4),
            "tau_tree": {str(n): round(tau(rank_rows, trees[n]), 4) for n in args.budgets},
            "tau_chain_k": {str(j): round(tau(rank_rows, chain_of(j)), 4) for j in range(1, depth + 1)},
            "seconds": round(time.perf_counter() - t1, 1),
        }
        doc["rows"].append(row)
        print(row, flush=True)
        results_io.write(Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
