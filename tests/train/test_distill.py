"""Training-time-test distillation: the unrolled loss against references, torch.func composition, the loop
(resume, torchrun), offline data, and a real learning signal.

Naming convention: p = target distribution, q = draft distribution.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fspec
import fspec.draft
from fspec.core.cache import KVCache
from fspec.core.metadata import decode_metadata, first_step_metadata
from fspec.models import llama
from fspec.models.heads import head_forward, head_forward_dense, project_target_hidden
from fspec.train import distill as D
from fspec.train import ttt

V, H = 97, 32


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_target(*, seed: int = 0, layers: int = 4) -> fspec.Target:
    cfg = fspec.ModelConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return fspec.Target(cfg=cfg, params=llama.init(cfg, seed=seed))


def token_stream(n: int = 3000, *, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def tiny_draft(target: fspec.Target, *, kind: str = "eagle3", seed: int = 1, sharpen: bool = False):
    """A head; EAGLE-3 with a reduced vocabulary of 61 of 97 ids (so d2t/t2d are exercised)."""
    vd = 61 if kind == "eagle3" else None
    draft = D.new_draft(target, kind=kind, tokens=token_stream(), draft_vocab_size=vd, seed=seed)
    if sharpen:  # peaky attention and logits: a wrong mask or position moves the logits by O(1), not O(1e-3)
        with torch.no_grad():
            for layer in draft.params.get("layers", [draft.params.get("layer")]):
                layer["q"].mul_(6.0)
                layer["k"].mul_(6.0)
            if "lm_head" not in draft.shared:
                draft.params["lm_head"].mul_(30.0)
    return draft


def batch_for(target, draft, *, b: int = 2, s: int = 9, seed: int = 3) -> dict:
    ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))
    return D.target_batch(target, draft, ids)


def small_cfg(**kw) -> ttt.DistillConfig:
    base = dict(steps=4, batch_size=4, seq_len=12, ttt_steps=3, lr=1e-2, warmup_steps=2, log_every=1)
    return ttt.DistillConfig(**{**base, **kw})


# --- the loss -----------------------------------------------------------------------------------------------


def test_ttt_loss_at_k1_equals_next_token_distillation_by_hand():
    """K = 1: soft CE of the causal head against the target's renormalised next-token p (draft vocab)."""
    target = tiny_target()
    draft = tiny_draft(target, kind="eagle3")
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(5))
    batch = D.target_batch(target, draft, ids)
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    loss, metrics = ttt.ttt_loss(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=1, step_weight=0.8)
    # By hand: p over the full target vocabulary, restricted to the draft ids and renormalised.
    full_logits, hidden = llama.forward_dense(
        target.params, ids, cfg=target.cfg, aux_layer_ids=draft.cfg.target_layer_ids
    )
    draft_ids = torch.arange(61) + draft.params["d2t"]
    p = full_logits.softmax(-1)[:, 1:, draft_ids]  # target at positions 1..S-1 predicts tokens 2..S
    p = p / p.sum(-1, keepdim=True)
    h0 = project_target_hidden(draft.params, hidden, cfg=draft.cfg)
    q_logits, _ = head_forward_dense(
        draft.params, ids[:, 1:], h0[:, :-1], cfg=draft.cfg
    )  # pairs (h_i, x_{i+1})
    expected = -(p * q_logits.log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    agree = (q_logits.argmax(-1) == p.argmax(-1)).float().mean()
    torch.testing.assert_close(metrics["agreement"][0], agree)
    assert metrics["loss"].shape == (1,)


def test_ttt_loss_weights_steps_geometrically():
    """loss = sum_j w^j CE_j, with CE_j the per-step metric (checked at K = 3 for two weights)."""
    target = tiny_target()
    draft = tiny_draft(target, kind="mtp")
    batch = batch_for(target, draft)
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    for w in (0.8, 0.3):
        loss, metrics = ttt.ttt_loss(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=3, step_weight=w)
        ce = metrics["loss"]
        torch.testing.assert_close(loss, ce[0] + w * ce[1] + w**2 * ce[2])
    assert len(set(ce.tolist())) == 3  # the steps see different inputs, hence different losses


def test_ttt_mask_is_causal_block_then_diagonals():
    """Row i of step j sees step-0 keys at positions <= i and, in each later block, only its own row."""
    s, step = 5, 2
    mask = ttt.ttt_mask(s, step)
    assert mask.shape == (s, 3 * s) and mask.dtype == torch.bool
    for i in range(s):
        for block in range(3):
            for i2 in range(s):
                expected = i2 <= i if block == 0 else i2 == i
                assert bool(mask[i, block * s + i2]) == expected, (i, block, i2)


def serving_steps(draft, batch, *, row: int, k: int, feed: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Naive per-position reference: the serving path (head_forward over a paged KV cache, reference backend)
    for the prefix ending at `row`: a first step over rows 0..row, then k - 1 decode steps.
    Returns (logits [Vd], hidden [H]) per step."""
    cfg, params = draft.cfg, draft.params
    ids = batch["input_ids"][0]
    th = ttt.as_target_hidden(batch["hidden"][0, : row + 1], cfg=cfg)
    hidden = project_target_hidden(params, th, cfg=cfg)  # [row + 1, H]
    table = torch.arange(8, dtype=torch.int32)[None]  # 8 blocks of 4 positions
    cache = KVCache.create(cfg.model, num_blocks=8, block_size=4)
    meta = first_step_metadata(
        torch.tensor([0]), torch.tensor([row + 1]), table, num_query=row + 1, block_size=4
    )
    logits, out, cache = head_forward(
        params, ids[1 : row + 2], hidden, meta, cache, cfg=cfg, backend="reference"
    )
    steps = [(logits[row], out[row])]
    for j in range(1, k):
        if feed == "prediction":
            token = steps[-1][0].argmax(-1, keepdim=True)
            token = fspec.draft_to_target(token, params["d2t"]) if cfg.kind == "eagle3" else token
        else:
            token = ids[row + j + 1 : row + j + 2]
        meta = decode_metadata(torch.tensor([row + j]), table, block_size=4)
        logits, out, cache = head_forward(
            params, token, steps[-1][1][None], meta, cache, cfg=cfg, backend="reference"
        )
        steps.append((logits[0], out[0]))
    return steps


def _max_gap(draft, batch, *, k: int, s: int, feed: str) -> float:
    """Largest |unrolled - serving| hidden difference over rows and steps."""
    _, hiddens = ttt.unroll(draft.params, batch, cfg=draft.cfg, ttt_steps=k, feed=feed)
    gap = 0.0
    for row in range(s - k):
        for j, (_, ref) in enumerate(serving_steps(draft, batch, row=row, k=k, feed=feed)):
            gap = max(gap, float((hiddens[j][0, row] - ref).abs().max()))
    return gap


@pytest.mark.parametrize("kind,feed", [("eagle3", "prediction"), ("eagle", "prediction"), ("mtp", "data")])
def test_ttt_unroll_equals_serving_draft_loop_at_every_position(kind, feed, monkeypatch):
    """Step j of row i equals what the serving draft loop computes drafting j tokens after position i."""
    target = tiny_target()
    draft = tiny_draft(target, kind=kind, sharpen=True)
    k, s = 3, 9
    batch = batch_for(target, draft, b=1, s=s)
    with torch.no_grad():
        logits, hiddens = ttt.unroll(draft.params, batch, cfg=draft.cfg, ttt_steps=k, feed=feed)
        for row in range(s - k):  # rows whose data tokens exist for every step
            for j, (ref_logits, ref_hidden) in enumerate(
                serving_steps(draft, batch, row=row, k=k, feed=feed)
            ):
                torch.testing.assert_close(logits[j][0, row], ref_logits, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(hiddens[j][0, row], ref_hidden, atol=1e-5, rtol=1e-5)

        # The comparison sees a mask error: later steps attending causally over the other rows' drafts (as
        # step 0 does over the sequence) instead of their own chain move hiddens 100x past atol.
        real = fspec.draft.bind_chain
        like_step_0 = lambda step, cache: real(torch.zeros_like(step), cache)  # noqa: E731
        monkeypatch.setattr(fspec.draft, "bind_chain", like_step_0)
        assert _max_gap(draft, batch, k=k, s=s, feed=feed) > 1e-3


# --- torch.func ---------------------------------------------------------------------------------------------


def test_vmapped_gradients_over_three_heads_equal_per_head_gradients():
    """vmap(grad(ttt_loss)) over stacked trainable params equals three separate grad calls."""
    target = tiny_target()
    heads = [tiny_draft(target, kind="eagle3", seed=s) for s in (1, 2, 3)]
    batch = batch_for(target, heads[0], b=2, s=8)
    parts = [ttt.split_params(h.params, h.shared) for h in heads]
    frozen = parts[0][1]
    assert all(torch.equal(p[1]["d2t"], frozen["d2t"]) for p in parts)
    stacked = fspec.tree.tree_map(lambda *xs: torch.stack(xs), *[p[0] for p in parts])
    kw = dict(cfg=heads[0].cfg, ttt_steps=3, step_weight=0.8)
    grad_fn = torch.func.grad_and_value(ttt.ttt_loss, has_aux=True)
    with (
        warnings.catch_warnings()
    ):  # CPU SDPA has no vmap rule: a per-sample fallback (a performance warning)
        warnings.simplefilter("ignore", UserWarning)
        vgrads, (vloss, _) = torch.func.vmap(lambda t: grad_fn(t, frozen, batch, **kw))(stacked)
    for i, (trainable, _) in enumerate(parts):
        grads, (loss, _) = grad_fn(trainable, frozen, batch, **kw)
        torch.testing.assert_close(vloss[i], loss, atol=1e-5, rtol=1e-5)
        for a, b in zip(fspec.tree.tree_leaves(vgrads), fspec.tree.tree_leaves(grads)):
            torch.testing.assert_close(a[i], b, atol=1e-5, rtol=1e-5)
    assert float(vgrads["fc"][0].sub(vgrads["fc"][1]).abs().max()) > 1e-4  # the heads really differ


# --- optimizer ----------------------------------------------------------------------------------------------


def test_adamw_update_matches_torch_optim_adamw():
    """The functional AdamW (decay on matrices only) follows torch.optim.AdamW step for step."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    ref_w = torch.nn.Parameter(params["w"].clone())
    ref_b = torch.nn.Parameter(params["b"].clone())
    opt = torch.optim.AdamW(
        [{"params": [ref_w], "weight_decay": 0.1}, {"params": [ref_b], "weight_decay": 0.0}],
        lr=0.05,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    state = ttt.adamw_init(params)
    for _ in range(5):
        grads = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
        new, state = ttt.adamw_update(
            params, grads, state, lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
        )
        assert not torch.equal(new["w"], params["w"])  # a new tree; the input stays as it was
        params = new
        ref_w.grad, ref_b.grad = grads["w"].clone(), grads["b"].clone()
        opt.step()
    torch.testing.assert_close(params["w"], ref_w.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(params["b"], ref_b.detach(), atol=1e-6, rtol=1e-6)


def test_schedule_warms_up_linearly_then_decays_by_cosine_and_clipping_bounds_the_norm():
    """lr(t): linear to the peak over warm-up, half-way point of the cosine, floor at min_lr_ratio."""
    kw = dict(peak=1.0, warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert ttt.learning_rate(0, **kw) == pytest.approx(0.1)
    assert ttt.learning_rate(9, **kw) == pytest.approx(1.0)
    assert ttt.learning_rate(60, **kw) == pytest.approx(0.55)
    assert ttt.learning_rate(110, **kw) == pytest.approx(0.1)
    grads = {"a": torch.full((4,), 3.0), "b": torch.full((1,), 4.0)}  # norm sqrt(36 + 16) = 7.21
    clipped, norm = ttt.clip_by_global_norm(grads, 1.0)
    assert float(norm) == pytest.approx(52**0.5)
    assert float(torch.cat([clipped["a"], clipped["b"]]).norm()) == pytest.approx(1.0, rel=1e-5)
    same, _ = ttt.clip_by_global_norm(grads, 100.0)
    assert torch.equal(same["a"], grads["a"])


# --- the loop -----------------------------------------------------------------------------------------------


def test_resume_continues_bit_exactly(tmp_path: Path):
    """4 steps straight == 2 steps, checkpoint, resume, 2 steps (weights, moments and metrics)."""
    target = tiny_target()
    tokens = token_stream()
    cfg = small_cfg(steps=4)
    draft = tiny_draft(target)
    batches = D.online_batches(target, draft, tokens, cfg=cfg)
    straight, hist = D.distill_head(draft, batches, cfg=cfg, out=tmp_path / "a", progress=False)
    D.distill_head(draft, batches, cfg=cfg, out=tmp_path / "b", until=2, progress=False)
    assert torch.load(tmp_path / "b" / D.STATE_FILE)["step"] == 2
    resumed, hist2 = D.distill_head(
        draft, batches, cfg=cfg, out=tmp_path / "b", resume=tmp_path / "b", progress=False
    )
    a = torch.load(tmp_path / "a" / D.STATE_FILE)
    b = torch.load(tmp_path / "b" / D.STATE_FILE)
    assert a["step"] == b["step"] == 4 and a["opt"]["count"] == b["opt"]["count"] == 4
    for x, y in zip(
        fspec.tree.tree_leaves((a["trainable"], a["opt"])), fspec.tree.tree_leaves((b["trainable"], b["opt"]))
    ):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    assert [h["loss"] for h in hist[2:]] == pytest.approx([h["loss"] for h in hist2], abs=1e-6)
    assert not torch.equal(a["trainable"]["fc"], draft.params["fc"].float())  # it trained
    with pytest.warns(UserWarning, match="lr"):  # other settings: not a replay, and said so
        D.distill_head(draft, batches, cfg=small_cfg(steps=4, lr=0.5), resume=tmp_path / "b", progress=False)
    # The checkpoint is a head in its published layout.
    loaded = fspec.load_draft(tmp_path / "a", target=target)
    torch.testing.assert_close(loaded.params["fc"], straight.params["fc"])
    torch.testing.assert_close(resumed.params["lm_head"], straight.params["lm_head"], atol=1e-6, rtol=0)


def test_a_tied_head_trains_everything_but_its_output_layer(tmp_path: Path):
    """An EAGLE-3 head tied to the target's lm_head (`tie_lm_head=True`): distillation moves its own weights
    and lowers the loss, its output layer stays the target's rows; the checkpoint carries no lm_head and
    loads back with the same rows; a resumed run equals the straight one."""
    target = tiny_target()
    draft = D.new_draft(
        target, kind="eagle3", tokens=token_stream(), draft_vocab_size=61, seed=1, tie_lm_head=True
    )
    rows = draft.params["lm_head"].clone()
    ids = torch.arange(61) + draft.params["d2t"]
    assert torch.equal(rows, llama.lm_head(target.params)[ids])
    cfg = small_cfg(steps=6)
    batches = D.online_batches(target, draft, token_stream(), cfg=cfg)
    trained, hist = D.distill_head(draft, batches, cfg=cfg, out=tmp_path / "a", progress=False)
    assert "lm_head" not in torch.load(tmp_path / "a" / D.STATE_FILE)["trainable"]
    assert torch.equal(trained.params["lm_head"], rows) and "lm_head" in trained.shared
    assert not torch.equal(trained.params["fc"], draft.params["fc"])
    assert hist[-1]["loss"] < hist[0]["loss"]
    loaded = fspec.load_draft(tmp_path / "a", target=target)
    assert torch.equal(loaded.params["lm_head"], rows) and loaded.shared == trained.shared
    torch.testing.assert_close(loaded.params["fc"], trained.params["fc"])
    D.distill_head(draft, batches, cfg=cfg, out=tmp_path / "b", until=3, progress=False)
    resumed, _ = D.distill_head(
        draft, batches, cfg=cfg, out=tmp_path / "b", resume=tmp_path / "b", progress=False
    )
    torch.testing.assert_close(resumed.params["fc"], trained.params["fc"], atol=1e-6, rtol=0)


def test_carry_weights_moves_a_trained_head_to_another_vocabulary():
    """carry_weights(src, dst): dst keeps its vocabulary maps; every other param is src's; dst's output rows
    for the ids both vocabularies hold are src's trained rows, the others dst's own (the target's rows); a
    tied dst keeps the target's rows; heads configured otherwise are refused, naming src."""
    target = tiny_target()
    src = tiny_draft(target)  # 61 of the 97 ids
    with torch.no_grad():
        for leaf in fspec.tree.tree_leaves({k: v for k, v in src.params.items() if k not in src.shared}):
            if leaf.is_floating_point():
                leaf.add_(torch.randn(leaf.shape, generator=torch.Generator().manual_seed(leaf.numel())))
    dst = D.new_draft(target, kind="eagle3", tokens=token_stream(seed=5), draft_vocab_size=80, seed=9)
    out = D.carry_weights(src, dst)
    assert out.cfg == dst.cfg and out.shared == dst.shared
    for name in ("d2t", "t2d"):
        assert torch.equal(out.params[name], dst.params[name])
    for name in ("fc", "norm"):
        assert torch.equal(out.params[name], src.params[name])
    assert all(torch.equal(out.params["layer"][n], src.params["layer"][n]) for n in src.params["layer"])
    src_ids, dst_ids = ttt.vocab_ids(src).tolist(), ttt.vocab_ids(dst).tolist()
    both = set(src_ids) & set(dst_ids)
    assert 0 < len(both) < 80
    for row, t in enumerate(dst_ids):
        want = src.params["lm_head"][src_ids.index(t)] if t in both else dst.params["lm_head"][row]
        assert torch.equal(out.params["lm_head"][row], want), t
    tied = D.new_draft(target, kind="eagle3", tokens=token_stream(), draft_vocab_size=80, tie_lm_head=True)
    assert torch.equal(D.carry_weights(src, tied).params["lm_head"], tied.params["lm_head"])
    wide = D.new_draft(
        target, kind="eagle3", tokens=token_stream(), draft_vocab_size=80, intermediate_size=96
    )
    with pytest.raises(ValueError, match="^src: expected a head configured as dst but for its vocabulary"):
        D.carry_weights(src, wide)
    with pytest.raises(ValueError, match="^src, dst: expected two Drafts"):
        D.carry_weights(src.params, dst)


def test_torchrun_two_gloo_processes_equal_one_process(tmp_path: Path):
    """`torchrun --nproc_per_node=2 -m fspec.train.distill train` (gloo) ends where one process does, 3
    steps on."""
    target = tiny_target()
    fspec.save_target(target, tmp_path / "target")
    tokens = token_stream()
    np.save(tmp_path / "tokens.npy", tokens.numpy().astype(np.int32))
    args = ["--steps", "3", "--batch-size", "4", "--seq-len", "12", "--ttt-steps", "3", "--lr", "1e-2"]
    args += [
        "--warmup-steps",
        "1",
        "--kind",
        "eagle3",
        "--draft-vocab-size",
        "61",
        "--seed",
        "7",
        "--log-every",
        "1",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [
        "-m",
        "fspec.train.distill",
        "train",
        "--target",
        str(tmp_path / "target"),
        "--out",
        str(tmp_path / "ddp"),
    ]
    cmd += ["--tokens", str(tmp_path / "tokens.npy"), "--device", "cpu", "--no-progress"]
    cmd += ["--log-jsonl", str(tmp_path / "log.jsonl"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    ddp = torch.load(tmp_path / "ddp" / D.STATE_FILE)
    assert ddp["step"] == 3
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # rank 0 alone writes
    # One process on the same global batches.
    loaded = fspec.load_target(tmp_path / "target")
    cfg = small_cfg(steps=3, batch_size=4, seq_len=12, ttt_steps=3, lr=1e-2, warmup_steps=1, seed=7)
    draft = D.new_draft(loaded, kind="eagle3", tokens=tokens, draft_vocab_size=61, seed=7)
    one, hist = D.distill_head(
        draft, D.online_batches(loaded, draft, tokens, cfg=cfg), cfg=cfg, progress=False
    )
    for name in ("fc", "lm_head", "norm"):
        torch.testing.assert_close(ddp["trainable"][name], one.params[name].float(), atol=1e-5, rtol=1e-5)
    for key, value in ddp["trainable"]["layer"].items():
        torch.testing.assert_close(value, one.params["layer"][key].float(), atol=1e-5, rtol=1e-5)
    assert [r["loss"] for r in records] == pytest.approx([h["loss"] for h in hist], abs=1e-5)


def test_distillation_learns_a_copy_target():
    """A target that repeats its current token: step-0 top-1 agreement from chance to > 0.9 in 100 steps."""
    cfg = fspec.ModelConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    params = llama.init(cfg, seed=0)
    with torch.no_grad():  # layers add nothing; a large random embedding makes logits peak at the input token
        params["embed"].normal_(generator=torch.Generator().manual_seed(1))
        for layer in params["layers"]:
            layer["o"].zero_()
            layer["down"].zero_()
    target = fspec.Target(cfg=cfg, params=params)
    tokens = token_stream(5000, vocab=48)
    logits, _ = llama.forward_dense(params, tokens[None, :50], cfg=cfg)
    assert bool((logits.argmax(-1) == tokens[None, :50]).all()), "the target must copy its input token"
    draft = D.new_draft(target, kind="eagle3", tokens=tokens)
    dcfg = ttt.DistillConfig(
        steps=100, batch_size=8, seq_len=24, ttt_steps=2, lr=1e-2, warmup_steps=10, log_every=10
    )
    _, hist = D.distill_head(
        draft, D.online_batches(target, draft, tokens, cfg=dcfg), cfg=dcfg, progress=False
    )
    assert hist[0]["agreement"][0] < 0.2, hist[0]
    assert hist[-1]["agreement"][0] > 0.9, hist[-1]
    assert hist[-1]["loss_per_step"][0] < hist[0]["loss_per_step"][0] / 2


# --- offline data -------------------------------------------------------------------------------------------


def test_offline_store_gives_the_online_batch_in_bf16(tmp_path: Path):
    """precompute + offline_batches: the same hidden states and target logits as running the target."""
    target = tiny_target()
    draft = tiny_draft(target, kind="eagle3")
    tokens = token_stream(400)
    layer_ids = draft.cfg.target_layer_ids
    meta = D.precompute(
        target, tokens, tmp_path, aux_layer_ids=layer_ids, num_sequences=20, seq_len=12, batch_size=6
    )
    assert meta["num_sequences"] == 20 and meta["bytes_per_token"] == 4 + 8 * H
    stored = sum(
        np.load(tmp_path / f, mmap_mode="r").nbytes for f in ("input_ids.npy", "last.npy", "aux.npy")
    )
    assert stored == meta["bytes_per_token"] * 20 * 12
    cfg = small_cfg(seq_len=12, batch_size=4)
    batch = D.offline_batches(tmp_path, target, draft, cfg=cfg)(0)
    online = D.target_batch(target, draft, batch["input_ids"])
    assert batch["input_ids"].shape == (4, 12)
    assert torch.equal(
        batch["input_ids"][0], tokens[:240].view(20, 12)[_row_of(batch["input_ids"][0], tokens)]
    )
    torch.testing.assert_close(batch["hidden"].float(), online["hidden"], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(batch["target_logits"].float(), online["target_logits"], atol=2e-3, rtol=2e-2)
    # Training on it runs through the same loss.
    _, hist = D.distill_head(
        draft, D.offline_batches(tmp_path, target, draft, cfg=cfg), cfg=cfg, until=1, progress=False
    )
    assert np.isfinite(hist[0]["loss"])


def _row_of(seq: torch.Tensor, tokens: torch.Tensor) -> int:
    rows = tokens[:240].view(20, 12)
    return int((rows == seq).all(-1).nonzero()[0])


# --- errors -------------------------------------------------------------------------------------------------


def test_validation_records_the_loss_of_the_head_as_it_stands_and_leaves_training_untouched():
    """`validate` sees the head at each record: `agreement` of that head on held-out windows equals the
    TTT metrics recomputed by hand; training with it gives bit-identical weights and losses."""
    target = tiny_target()
    cfg = small_cfg(steps=4, log_every=2)
    draft = tiny_draft(target)
    batches = D.online_batches(target, draft, token_stream(), cfg=cfg)
    held = D.online_batches(target, draft, token_stream(seed=5), cfg=cfg)
    seen = []

    def validate(head):
        seen.append(head)
        return D.agreement(head, held, cfg=cfg, steps=range(2))

    plain, hist = D.distill_head(draft, batches, cfg=cfg, progress=False)
    checked, hist_v = D.distill_head(draft, batches, cfg=cfg, progress=False, validate=validate)
    assert len(seen) == len(hist_v) == 2 and [h["loss"] for h in hist] == [h["loss"] for h in hist_v]
    for x, y in zip(fspec.tree.tree_leaves(plain.params), fspec.tree.tree_leaves(checked.params)):
        assert torch.equal(x, y)
    trainable, frozen = ttt.split_params(seen[0].params, seen[0].shared)
    kw = dict(cfg=draft.cfg, ttt_steps=cfg.ttt_steps, step_weight=cfg.step_weight)
    by_hand = [ttt.ttt_loss(trainable, frozen, held(i), **kw)[1]["agreement"] for i in range(2)]
    expect = torch.stack(by_hand).mean(0)
    assert hist_v[0]["validation"]["agreement"] == pytest.approx(expect.tolist(), abs=1e-5)
    assert hist_v[0]["validation"] != hist_v[1]["validation"]  # the head moved between the records
    with pytest.raises(ValueError, match="validate"):
        D.distill_head(draft, batches, cfg=cfg, progress=False, validate=3)
    with pytest.raises(ValueError, match="steps"):
        D.agreement(draft, held, cfg=cfg, steps=range(0))


def test_bad_inputs_name_the_argument(tmp_path: Path):
    """K < 1, w <= 0, a short sequence, a missing checkpoint or store: errors that name the argument."""
    with pytest.raises(ValueError, match="ttt_steps"):
        ttt.DistillConfig(ttt_steps=0)
    with pytest.raises(ValueError, match="step_weight"):
        ttt.DistillConfig(step_weight=0.0)
    with pytest.raises(ValueError, match="step_weight"):
        ttt.DistillConfig(step_weight=-0.5)
    with pytest.raises(ValueError, match="seq_len"):
        ttt.DistillConfig(ttt_steps=7, seq_len=7)
    with pytest.raises(ValueError, match="feed"):
        ttt.DistillConfig(feed="teacher")
    target = tiny_target()
    draft = tiny_draft(target)
    trainable, frozen = ttt.split_params(draft.params, draft.shared)
    batch = batch_for(target, draft, s=4)
    with pytest.raises(ValueError, match="ttt_steps"):
        ttt.ttt_loss(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=0)
    with pytest.raises(ValueError, match="step_weight"):
        ttt.ttt_loss(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=2, step_weight=0)
    with pytest.raises(ValueError, match="input_ids"):
        ttt.ttt_loss(trainable, frozen, batch, cfg=draft.cfg, ttt_steps=4)
    cfg = small_cfg()
    batches = D.online_batches(target, draft, token_stream(), cfg=cfg)
    with pytest.raises(FileNotFoundError, match="resume"):
        D.distill_head(draft, batches, cfg=cfg, resume=tmp_path / "missing", progress=False)
    with pytest.raises(FileNotFoundError, match="path"):
        D.offline_batches(tmp_path / "missing", target, draft, cfg=cfg)
    with pytest.raises(ValueError, match="batch_size"):
        D.online_batches(target, draft, token_stream(), cfg=small_cfg(batch_size=3), rank=0, world=2)
    for bad in (torch.ones(10, dtype=torch.bool), torch.ones(3000), [True] * 3000):
        with pytest.raises(ValueError, match="loss_mask"):
            D.online_batches(target, draft, token_stream(), cfg=cfg, loss_mask=bad)
    with pytest.raises(ValueError, match="loss_mask"):
        D.check_batch({**batch, "loss_mask": torch.ones(batch["input_ids"].shape)}, draft)
    with pytest.raises(FileNotFoundError, match="path"):
        D.main(["train", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--device", "cpu"])


def test_online_batches_carry_the_loss_mask_of_the_same_windows():
    """With loss_mask, each batch's "loss_mask" is the mask at the very positions of its input_ids (a mask
    that is a function of the token id shows it), and the windows are those of the batches without it."""
    target = tiny_target()
    draft = tiny_draft(target)
    tokens = token_stream()
    mask = tokens % 3 == 0
    cfg = small_cfg()
    with_mask = D.online_batches(target, draft, tokens, cfg=cfg, loss_mask=mask)
    without = D.online_batches(target, draft, tokens, cfg=cfg)
    for step in range(3):
        batch = with_mask(step)
        assert torch.equal(batch["loss_mask"], batch["input_ids"] % 3 == 0)
        assert torch.equal(batch["input_ids"], without(step)["input_ids"])
        assert "loss_mask" not in without(step)
        D.check_batch(batch, draft)
