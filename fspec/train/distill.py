"""Training-time-test distillation of draft heads against a frozen target: data, loop, checkpoints, torchrun.

    python -m fspec.train.distill train --target DIR --out DIR [--kind eagle3 --draft-vocab-size 32000] ...
    torchrun --nproc_per_node=N -m fspec.train.distill train ...      # N processes, gradients averaged
    python -m fspec.train.distill precompute --target DIR --out DIR --kind eagle3 ...   # offline data

The loss and the pure optimizer step are in `fspec.train.ttt`; this module feeds them.

Data. A batch source is a function `step -> batch` (the dict `fspec.train.ttt` describes) whose value is a
pure function of (seed, step): the global batch of step t is drawn with a generator seeded by (seed, t), and
process r of W takes rows [r·B/W, (r+1)·B/W). Resuming replays the same batches, and W processes see
exactly the rows one process would.
* online (`online_batches`): windows of a token stream (`fspec.train.data`: the standard library's source, or
  any 1-D token file) run through the frozen target inside the loop;
* offline (`precompute` + `offline_batches`): the target's outputs written once to .npy files and
  memory-mapped back. Stored per token: the token id (int32, 4 B), the target's final-normed last hidden
  (bf16, 2·Ht B) and, for EAGLE-3, the three aux hidden states (bf16, 6·Ht B). The target logits are NOT
  stored: they are recomputed as last @ lm_head[draft vocab]^T, exactly what the target computes, at the
  cost of one [Ht x Vd] matmul per token (the head's own lm_head costs the same). Logits over a draft
  vocabulary would take 2·Vd B/token (64 KB at Vd = 32000, more than all the hidden states of an 8B
  target), and top-k logits drop the tail of p (a biased soft target). Llama-3.1-8B (Ht = 4096), EAGLE-3:
  4 + 8·4096 = 32772 B/token; EAGLE-1/MTP: 4 + 2·4096 = 8196 B/token.

Scale-out. Parameters are dict pytrees and gradients come from `torch.func.grad_and_value`, which never
runs the autograd hooks DDP's reducer listens to (DDP needs an nn.Module whose Parameters accumulate
`.grad`). So we do what DDP does ourselves: one all-reduce of all gradients flattened into one buffer (DDP's
buckets), divided by W. Every process holds the same rows per step and the same row count per loss, so the
mean of the per-process mean losses is the global mean loss and its gradient the global gradient.
Backend: NCCL on CUDA, gloo on CPU.

Checkpoints. `out/` holds the head in its published layout (`save_draft`: config.json and model.safetensors,
loadable with `fspec.load_draft`) and train_state.pt (step, fp32 master weights, AdamW moments, settings).
`resume=out` continues bit-exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fspec.core.pytree import tree
from fspec.models import layers as L
from fspec.models import llama
from fspec.models.checkpoint import Draft, Target, init_draft, load_draft, load_target, save_draft
from fspec.models.heads import head_kind, lookup, names
from fspec.train import data
from fspec.train.data import window_index
from fspec.train.ttt import (
    DistillConfig,
    adamw_init,
    split_params,
    target_batch,
    train_step,
    ttt_loss,
    vocab_ids,
)

STATE_FILE = "train_state.pt"
Batches = Callable[[int], dict]

# --- data ---------------------------------------------------------------------------------------------------


def frequent_tokens(tokens: torch.Tensor, *, vocab_size: int, k: int) -> torch.Tensor:
    """[k] int64, increasing: the k most frequent ids of `tokens` (ties: the smaller id); an EAGLE-3 draft
    vocabulary."""
    if not 0 < k <= vocab_size:
        raise ValueError(f"k: expected a draft vocabulary size in [1, {vocab_size}], got {k}")
    counts = torch.bincount(tokens.reshape(-1).long().cpu(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:k].sort().values


def new_draft(
    target: Target,
    *,
    kind: str,
    tokens: torch.Tensor | None = None,
    draft_vocab_size: int | None = None,
    **kw,
) -> Draft:
    """`init_draft` whose EAGLE-3 draft vocabulary is the `draft_vocab_size` most frequent ids of `tokens`."""
    if lookup(kind).reduced_vocab and draft_vocab_size and draft_vocab_size < target.cfg.vocab_size:
        if tokens is None:
            raise ValueError("tokens: expected a token stream to pick the draft vocabulary from, got None")
        kw["draft_ids"] = frequent_tokens(tokens, vocab_size=target.cfg.vocab_size, k=draft_vocab_size)
    return init_draft(target, kind=kind, draft_vocab_size=draft_vocab_size, **kw)


VOCAB_PARAMS = ("lm_head", "d2t", "t2d")  # what a head's draft vocabulary decides (EAGLE-3)


def carry_weights(src: Draft, dst: Draft) -> Draft:
    """`dst` (a fresh head, its draft vocabulary and output layer already chosen) with `src`'s trained
    weights wherever the two heads are alike: every param but the output layer and the vocabulary maps, and,
    unless dst's lm_head is the target's (tied), src's trained output rows for the target ids both draft
    vocabularies hold (dst's other rows stay as dst has them). A build that changes a trained head's
    vocabulary starts there instead of from scratch. ValueError naming `src` unless both are heads of one
    kind with equal configs but for the vocabulary, and equal shapes."""
    if not isinstance(src, Draft) or not isinstance(dst, Draft):
        raise ValueError(f"src, dst: expected two Drafts, got {type(src).__name__}, {type(dst).__name__}")
    vocab_free = dict(
        draft_vocab_size=0, num_speculative_steps=1, greedy_drafts=False, max_model_len=1, block_size=1
    )
    a, b = (dataclasses.replace(d.cfg, **vocab_free) for d in (src, dst))
    if a != b:
        raise ValueError(f"src: expected a head configured as dst but for its vocabulary, got {src.cfg}")
    params = dict(dst.params)
    for name, value in src.params.items():
        if name in VOCAB_PARAMS or name in dst.shared:
            continue
        shapes = [tuple(t.shape) for t in tree.tree_leaves(value)]
        if shapes != [tuple(t.shape) for t in tree.tree_leaves(dst.params[name])]:
            raise ValueError(f"src: param {name!r} expected dst's shapes, got {shapes[:4]}")
        params[name] = tree.tree_map(lambda s, d: L.param(s.detach().to(d).clone()), value, dst.params[name])
    if "lm_head" in src.params and "lm_head" not in dst.shared and "lm_head" not in src.shared:
        src_ids, dst_ids = vocab_ids(src).cpu(), vocab_ids(dst).cpu()
        at = torch.full((dst.cfg.model.vocab_size,), -1, dtype=torch.int64)
        at[dst_ids] = torch.arange(dst_ids.numel())
        rows_dst = at[src_ids]
        keep = rows_dst >= 0
        rows = params["lm_head"].detach().clone()
        src_rows = src.params["lm_head"].detach().index_select(0, keep.nonzero().squeeze(1).to(rows.device))
        rows[rows_dst[keep].to(rows.device)] = src_rows.to(rows)
        params["lm_head"] = L.param(rows)
    return dataclasses.replace(dst, params=params)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step `step`'s global batch."""
    return torch.Generator().manual_seed(seed * 2**32 + step)  # distinct for every (seed, step < 2^32)


def _rows(global_batch: int, rank: int, world: int) -> slice:
    if global_batch % world:
        raise ValueError(f"batch_size: expected a multiple of the {world} processes, got {global_batch}")
    n = global_batch // world
    return slice(rank * n, (rank + 1) * n)


def online_batches(
    target: Target,
    draft: Draft,
    tokens: torch.Tensor,
    *,
    cfg: DistillConfig,
    rank: int = 0,
    world: int = 1,
    loss_mask: torch.Tensor | None = None,
) -> Batches:
    """step -> this process's batch: windows of the 1-D `tokens` through the target, in the loop.

    loss_mask: None, or a 1-D bool tensor as long as `tokens`: True where the target's distribution at that
    position is a training target (`fspec.train.ttt`); each batch then carries its windows as "loss_mask"."""
    rows = _rows(cfg.batch_size, rank, world)
    device = target.params["embed"].device
    v = target.cfg.vocab_size
    _check_tokens(tokens, longer_than=cfg.seq_len)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v):
        raise ValueError(
            f"tokens: expected token ids in [0, {v}) (the target's vocabulary), "
            f"got min {int(tokens.min())}, max {int(tokens.max())}"
        )
    if loss_mask is not None and (
        not isinstance(loss_mask, torch.Tensor)
        or loss_mask.dtype != torch.bool
        or tuple(loss_mask.shape) != tuple(tokens.shape)
    ):
        got = (
            f"shape {tuple(loss_mask.shape)}, {loss_mask.dtype}"
            if isinstance(loss_mask, torch.Tensor)
            else type(loss_mask).__name__
        )
        raise ValueError(
            f"loss_mask: expected None or a bool tensor of shape {tuple(tokens.shape)}, got {got}"
        )

    def batches(step: int) -> dict:
        gen = step_generator(cfg.seed, step)
        idx = window_index(tokens.numel(), batch_size=cfg.batch_size, seq_len=cfg.seq_len, generator=gen)
        idx = idx[rows]  # [B/W, S]
        batch = target_batch(target, draft, tokens[idx].long().to(device), autocast=cfg.autocast)
        if loss_mask is not None:
            batch["loss_mask"] = loss_mask[idx].to(device)
        return batch

    return batches


def _check_tokens(tokens: object, *, longer_than: int) -> None:
    """ValueError naming `tokens` unless it is a 1-D integer tensor of more than `longer_than` ids."""
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 1
        or tokens.is_floating_point()
        or tokens.is_complex()
        or tokens.dtype == torch.bool
        or tokens.numel() <= longer_than
    ):
        got = (
            f"shape {tuple(tokens.shape)}, {tokens.dtype}"
            if isinstance(tokens, torch.Tensor)
            else type(tokens).__name__
        )
        raise ValueError(f"tokens: expected a 1-D integer tensor of more than {longer_than} ids, got {got}")


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy()


def precompute(
    target: Target,
    tokens: torch.Tensor,
    out,
    *,
    aux_layer_ids: tuple[int, ...] = (),
    num_sequences: int,
    seq_len: int,
    batch_size: int = 8,
    progress: bool = False,
) -> dict:
    """Write the target's outputs over consecutive windows of `tokens` to `out` (see the module docstring).

    aux_layer_ids: EAGLE-3's target layers (`eagle3_layer_ids`); () stores what EAGLE-1 / MTP read.
    Returns the store's meta.json dict (with bytes_per_token).
    """
    from tqdm.auto import tqdm

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len: expected a positive int, got {seq_len!r}")
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences <= 0:
        raise ValueError(f"num_sequences: expected a positive int, got {num_sequences!r}")
    _check_tokens(tokens, longer_than=0)
    n = min(num_sequences, tokens.numel() // seq_len)
    if n <= 0:
        raise ValueError(f"tokens: expected at least seq_len={seq_len} tokens, got {tokens.numel()}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ht, device = target.cfg.hidden_size, target.params["embed"].device
    seqs = tokens[: n * seq_len].reshape(n, seq_len).to(torch.int32)
    np.save(out / "input_ids.npy", seqs.numpy())
    fmt = np.lib.format
    last = fmt.open_memmap(out / "last.npy", mode="w+", dtype=np.int16, shape=(n, seq_len, ht))
    aux = None
    if aux_layer_ids:
        shape = (n, seq_len, len(aux_layer_ids) * ht)
        aux = fmt.open_memmap(out / "aux.npy", mode="w+", dtype=np.int16, shape=shape)
    for lo in tqdm(range(0, n, batch_size), disable=not progress, desc="precompute"):
        ids = seqs[lo : lo + batch_size].long().to(device)
        with torch.no_grad():
            _, hidden = llama.forward_dense(target.params, ids, cfg=target.cfg, aux_layer_ids=aux_layer_ids)
        last[lo : lo + len(ids)] = _bf16_bits(hidden.last)
        if aux is not None:
            aux[lo : lo + len(ids)] = _bf16_bits(hidden.aux)
    last.flush()
    if aux is not None:
        aux.flush()
    meta = {
        "num_sequences": n,
        "seq_len": seq_len,
        "target_hidden_size": ht,
        "vocab_size": target.cfg.vocab_size,
        "aux_layer_ids": list(aux_layer_ids),
        "dtype": "bfloat16",
        "bytes_per_token": 4 + 2 * ht * (1 + len(aux_layer_ids)),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def offline_batches(
    path, target: Target, draft: Draft, *, cfg: DistillConfig, rank: int = 0, world: int = 1
) -> Batches:
    """step -> this process's batch from a `precompute` store (memory-mapped; cfg.seq_len must match)."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"path: expected a precomputed store with meta.json, got {str(path)!r}")
    meta = json.loads((path / "meta.json").read_text())
    dc = draft.cfg
    reads_aux = head_kind(dc).reads_aux_layers
    if meta["target_hidden_size"] != target.cfg.hidden_size or meta["seq_len"] != cfg.seq_len:
        raise ValueError(
            f"path: store has target_hidden_size={meta['target_hidden_size']}, seq_len={meta['seq_len']}; "
            f"expected {target.cfg.hidden_size}, {cfg.seq_len}"
        )
    if reads_aux and tuple(meta["aux_layer_ids"]) != dc.target_layer_ids:
        raise ValueError(
            f"path: store has aux_layer_ids={meta['aux_layer_ids']}, "
            f"the head reads {list(dc.target_layer_ids)}"
        )
    ids_all = np.load(path / "input_ids.npy", mmap_mode="r")
    last_all = np.load(path / "last.npy", mmap_mode="r")
    aux_all = np.load(path / "aux.npy", mmap_mode="r") if reads_aux else None
    rows = _rows(cfg.batch_size, rank, world)
    device = target.params["embed"].device
    lm_rows = llama.lm_head(target.params).detach().index_select(0, vocab_ids(draft))  # [Vd, Ht]

    def load(arr, idx):  # rows of a memory-mapped bf16 array as a bf16 tensor
        return torch.from_numpy(np.ascontiguousarray(arr[idx])).view(torch.bfloat16).to(device)

    def batches(step: int) -> dict:
        idx = torch.randint(0, len(ids_all), (cfg.batch_size,), generator=step_generator(cfg.seed, step))
        idx = idx[rows].numpy()
        last = load(last_all, idx)  # [B/W, S, Ht]
        return {
            "input_ids": torch.from_numpy(np.ascontiguousarray(ids_all[idx])).long().to(device),
            "hidden": load(aux_all, idx) if aux_all is not None else last,
            "target_logits": F.linear(last.to(lm_rows.dtype), lm_rows),  # [B/W, S, Vd]
        }

    return batches


# --- the loop -----------------------------------------------------------------------------------------------


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_mean(values):
    """The mean of a pytree of tensors over all processes: one all-reduce of one flat fp32 buffer."""
    leaves, spec = tree.tree_flatten(values)
    flat = torch.cat([x.reshape(-1).float() for x in leaves])
    dist.all_reduce(flat)
    flat = flat / dist.get_world_size()
    out, offset = [], 0
    for x in leaves:
        out.append(flat[offset : offset + x.numel()].view(x.shape).to(x.dtype))
        offset += x.numel()
    return tree.tree_unflatten(spec, out)


def to_draft(draft: Draft, trainable: dict) -> Draft:
    """`draft` with its trainable weights replaced (cast to the dtypes they had; frozen Parameters)."""
    params = dict(draft.params)
    for name, value in trainable.items():
        params[name] = tree.tree_map(
            lambda new, old: L.param(new.detach().to(old.dtype).clone()), value, params[name]
        )
    return dataclasses.replace(draft, params=params)


def save_checkpoint(path, draft: Draft, trainable: dict, opt_state: dict, *, step: int, cfg: DistillConfig):
    """The head (`save_draft` layout) and train_state.pt (fp32 master weights, AdamW state, step)."""
    path = Path(path)
    save_draft(to_draft(draft, trainable), path)
    state = {"step": step, "trainable": trainable, "opt": opt_state, "config": dataclasses.asdict(cfg)}
    torch.save(
        tree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, state),
        path / STATE_FILE,
    )


def load_train_state(path, *, device) -> dict:
    """train_state.pt of a checkpoint directory, tensors on `device`."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"resume: expected a checkpoint directory with {STATE_FILE}, got {str(path)!r}"
        )
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except Exception as e:  # truncated / empty / not a torch file: RuntimeError, EOFError, UnpicklingError
        raise ValueError(f"resume: expected a readable {file}, got an unreadable file ({e})") from None
    return state


def check_train_state(state: object, trainable: dict, *, file, steps: int) -> None:
    """ValueError naming `resume` unless `state` (a loaded train_state.pt) fits the head being trained: the
    keys save_checkpoint writes, trainable weights and AdamW moments of the head's names, shapes and float
    dtypes (an EAGLE-3 state cannot resume an EAGLE-1 head), a step in [0, steps], before training starts."""
    if not isinstance(state, dict):
        raise ValueError(f"resume: expected {file} to hold a dict, got {type(state).__name__}")
    missing = [k for k in ("step", "trainable", "opt", "config") if k not in state]
    if missing:
        raise ValueError(f"resume: expected {file} with keys step, trainable, opt, config, missing {missing}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= steps:
        raise ValueError(f"resume: expected {file} 'step' an int in [0, cfg.steps={steps}], got {step!r}")
    if not isinstance(state["config"], dict):
        raise ValueError(f"resume: expected {file} 'config' a dict, got {type(state['config']).__name__}")
    opt = state["opt"]
    if not isinstance(opt, dict) or sorted(opt) != ["count", "m", "v"]:
        got = sorted(opt) if isinstance(opt, dict) else type(opt).__name__
        raise ValueError(f"resume: expected {file} 'opt' with keys count, m, v, got {got}")
    count = opt["count"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"resume: expected {file} opt['count'] an int >= 0, got {count!r}")
    for name in ("trainable", "m", "v"):
        saved = state["trainable"] if name == "trainable" else opt[name]
        _check_like(saved, trainable, f"resume: {file} {name}")


def _check_like(saved: object, want: object, where: str) -> None:
    """`saved` has `want`'s dict / list structure and, at each leaf, a float tensor of its shape."""
    if isinstance(want, dict):
        if not isinstance(saved, dict) or sorted(saved) != sorted(want):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"{where}: expected keys {sorted(want)} (this head's), got {got}")
        for k in want:
            _check_like(saved[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(want):
            raise ValueError(
                f"{where}: expected a list of {len(want)} (this head's), got {type(saved).__name__}"
            )
        for i, (s, w) in enumerate(zip(saved, want)):
            _check_like(s, w, f"{where}[{i}]")
    elif not isinstance(saved, torch.Tensor) or not saved.is_floating_point() or saved.shape != want.shape:
        got = f"shape {list(saved.shape)}, {saved.dtype}" if isinstance(saved, torch.Tensor) else saved
        raise ValueError(f"{where}: expected a float tensor of shape {list(want.shape)}, got {got}")


def agreement(draft: Draft, batches: Batches, *, cfg: DistillConfig, steps: range) -> dict:
    """The TTT loss and per-depth agreement of `draft` averaged over `batches(i)` for i in `steps`, without
    gradients (a validation measure: pass batches of data the head does not train on)."""
    if len(steps) == 0:
        raise ValueError(f"steps: expected a non-empty range, got {steps!r}")
    trainable, frozen = split_params(draft.params, draft.shared)
    kw = {"cfg": draft.cfg, "ttt_steps": cfg.ttt_steps, "step_weight": cfg.step_weight, "feed": cfg.feed}
    loss, agree = [], []
    for i in steps:
        batch = batches(i)
        autocast = cfg.autocast and batch["input_ids"].is_cuda
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _, aux = ttt_loss(trainable, frozen, batch, **kw)
        loss.append(aux["loss"].float())
        agree.append(aux["agreement"].float())
    return {
        "loss_per_step": [round(float(x), 5) for x in torch.stack(loss).mean(0)],
        "agreement": [round(float(x), 5) for x in torch.stack(agree).mean(0)],
    }


def distill_head(
    draft: Draft,
    batches: Batches,
    *,
    cfg: DistillConfig,
    out=None,
    resume=None,
    until: int | None = None,
    time_limit_s: float | None = None,
    log_path=None,
    progress: bool = True,
    validate=None,
) -> tuple[Draft, list[dict]]:
    """Train `draft` on `batches` (see the module docstring) from step 0, or from the checkpoint `resume`.

    Runs steps up to `until` (default cfg.steps; the schedule always spans cfg.steps), stopping early after
    time_limit_s seconds (one process only). Under torchrun, gradients are averaged over processes and only
    rank 0 writes. Returns (the trained head, metric records: step, lr, loss, loss_per_step, agreement,
    grad_norm, tokens_per_s, elapsed_s); writes the checkpoint to `out` and the records to `log_path` (JSONL).
    validate: called with the head as it stands at every record (rank 0); what it returns is the record's
    "validation" (for example `agreement(...)` on answers the head never trains on).
    """
    if validate is not None and not callable(validate):
        got = type(validate).__name__
        raise ValueError(f"validate: expected a callable (Draft -> dict) or None, got {got}")
    rank, world = _world()
    if world > 1 and time_limit_s is not None:  # ranks would stop at different steps and hang in all_reduce
        raise ValueError("time_limit_s: expected None under torchrun (pass `until` instead)")
    until = cfg.steps if until is None else until
    device = draft.params["embed"].device
    trainable, frozen = split_params(draft.params, draft.shared)
    opt_state, start = adamw_init(trainable), 0
    if resume is not None:
        state = load_train_state(resume, device=device)
        check_train_state(state, trainable, file=Path(resume) / STATE_FILE, steps=cfg.steps)
        trainable, opt_state, start = state["trainable"], state["opt"], state["step"]
        _warn_if_changed(state["config"], dataclasses.asdict(cfg))
    reduce = all_reduce_mean if world > 1 else None
    from tqdm.auto import tqdm

    bar = tqdm(
        range(start, until),
        disable=not progress or rank != 0,
        desc=f"distill {draft.cfg.kind}",
        mininterval=2.0,
    )
    history: list[dict] = []
    began = last_t = time.perf_counter()
    last_step, step = start, start - 1
    for step in bar:
        batch = batches(step)
        check_batch(batch, draft, values=step == start)
        trainable, opt_state, m = train_step(
            trainable, opt_state, frozen, batch, step=step, cfg=draft.cfg, dcfg=cfg, reduce=reduce
        )
        done = step + 1 == until or (time_limit_s is not None and time.perf_counter() - began > time_limit_s)
        if (step + 1) % cfg.log_every == 0 or done:
            now = time.perf_counter()
            rec = _record(
                step, m, tokens=(step + 1 - last_step) * cfg.batch_size * cfg.seq_len, dt=now - last_t
            )
            rec["elapsed_s"] = now - began
            if validate is not None and rank == 0:
                rec["validation"] = validate(to_draft(draft, trainable))
                now = time.perf_counter()  # the next record's tokens/s leaves the validation out
            last_t, last_step = now, step + 1
            history.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", agree0=f"{rec['agreement'][0]:.2f}")
            if log_path is not None and rank == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        if out is not None and rank == 0 and cfg.save_every and (step + 1) % cfg.save_every == 0:
            save_checkpoint(out, draft, trainable, opt_state, step=step + 1, cfg=cfg)
        if done:
            break
    if out is not None and rank == 0:
        save_checkpoint(out, draft, trainable, opt_state, step=step + 1, cfg=cfg)
    return to_draft(draft, trainable), history


def check_batch(batch: object, draft: Draft, *, values: bool = True) -> None:
    """ValueError naming the key unless `batch` is the dict `fspec.train.ttt` describes for `draft`.

    Shapes, dtypes and devices are checked for every batch (no host sync); token ids in [0, V) only when
    `values` (distill_head: the first batch of a run, one sync, not one per step).
    """
    cfg = draft.cfg
    if not isinstance(batch, dict):
        raise ValueError(
            f"batch: expected a dict with input_ids, hidden, target_logits, got {type(batch).__name__}"
        )
    missing = [k for k in ("input_ids", "hidden", "target_logits") if k not in batch]
    if missing:
        raise ValueError(f"batch: expected keys input_ids, hidden, target_logits, missing {missing}")
    ids, device = batch["input_ids"], draft.params["embed"].device
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dim() != 2
        or ids.dtype != torch.int64
        or ids.device != device
    ):
        got = (
            f"shape {tuple(ids.shape)}, {ids.dtype} on {ids.device}" if isinstance(ids, torch.Tensor) else ids
        )
        raise ValueError(f"batch['input_ids']: expected a [B, S] int64 tensor on {device}, got {got}")
    b, s = ids.shape
    hin = head_kind(cfg).input_hidden_size(cfg)
    for key, width in (("hidden", hin), ("target_logits", cfg.draft_vocab_size)):
        x = batch[key]
        if (
            not isinstance(x, torch.Tensor)
            or tuple(x.shape) != (b, s, width)
            or not x.is_floating_point()
            or x.device != device
        ):
            got = f"shape {tuple(x.shape)}, {x.dtype} on {x.device}" if isinstance(x, torch.Tensor) else x
            raise ValueError(
                f"batch[{key!r}]: expected a float [{b}, {s}, {width}] tensor on {device}, got {got}"
            )
    mask = batch.get("loss_mask")
    if mask is not None and (
        not isinstance(mask, torch.Tensor)
        or tuple(mask.shape) != (b, s)
        or mask.dtype != torch.bool
        or mask.device != device
    ):
        got = (
            f"shape {tuple(mask.shape)}, {mask.dtype} on {mask.device}"
            if isinstance(mask, torch.Tensor)
            else mask
        )
        raise ValueError(
            f"batch['loss_mask']: expected absent or a bool [{b}, {s}] tensor on {device}, got {got}"
        )
    v = cfg.model.vocab_size
    if values and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise ValueError(
            f"batch['input_ids']: expected token ids in [0, {v}), "
            f"got min {int(ids.min())}, max {int(ids.max())}"
        )


def _warn_if_changed(saved: dict, now: dict) -> None:
    """Resuming replays the same run only with the same settings (the schedule spans cfg.steps).

    `via_draft_step`, a setting of earlier releases, chose the loop the loss ran through; both gave the same
    loss and gradients, and only the draft step's remains. True (or absent) is ignored; False gives one
    warning.
    """
    if saved.get("via_draft_step", True) is False:
        warnings.warn(
            "resume: the checkpoint's settings have via_draft_step=False (the reference TTT loop over the "
            "head's layers), which is gone; training continues through the draft step (the same loss and "
            "gradients)",
            stacklevel=3,
        )
    # a setting the checkpoint predates (a field added since) had its default then
    defaults = {f.name: f.default for f in dataclasses.fields(DistillConfig)}
    changed = sorted(
        k for k in now if k not in ("log_every", "save_every") and saved.get(k, defaults.get(k)) != now[k]
    )
    if changed:
        warnings.warn(f"resume: settings differ from the checkpoint's: {changed}; not a replay", stacklevel=3)


def _record(step: int, m: dict, *, tokens: int, dt: float) -> dict:
    return {
        "step": step + 1,
        "lr": m["lr"],
        "loss": float(m["loss"]),
        "loss_per_step": [round(x, 5) for x in m["loss_per_step"].tolist()],
        "agreement": [round(x, 5) for x in m["agreement"].tolist()],
        "grad_norm": float(m["grad_norm"]),
        "tokens_per_s": tokens / dt if dt > 0 else 0.0,
    }


# --- command line -------------------------------------------------------------------------------------------


def _setup_device(name: str | None) -> torch.device:
    """The process's device; under torchrun (WORLD_SIZE > 1) also joins the process group."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _tokens(args, target: Target) -> torch.Tensor:
    """The training token stream: --tokens FILE (.npy or torch.save), else the stdlib's training split."""
    if args.tokens:
        file = Path(args.tokens)
        if not file.is_file():
            raise FileNotFoundError(f"--tokens: expected a token file, got {str(file)!r}")
        t = torch.from_numpy(np.load(file)) if file.suffix == ".npy" else torch.load(file, weights_only=True)
        return t.reshape(-1).long()
    if target.tokenizer is None:
        raise ValueError("--target: expected a tokenizer.json next to the weights (or pass --tokens FILE)")
    train, _ = data.split_files(data.stdlib_files())
    return data.encode_files(target.tokenizer, train[: args.max_files] if args.max_files else train).long()


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF directory of the frozen target")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--kind", default="eagle3", choices=names())
    p.add_argument(
        "--tokens",
        help="1-D token file (.npy or torch.save); default: the stdlib's train split, source code, not the "
        "target's answers: for a head that pays, self-distill with `python -m fspec.train.default_model "
        "--target DIR --out HEAD`",
    )
    p.add_argument("--max-files", type=int, default=0, help="use only the first N stdlib files (0 = all)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default=None, help="default: cuda when available")


def _train(args) -> int:
    device = _setup_device(args.device)
    rank, world = _world()
    target = load_target(args.target, device=device)
    cfg = DistillConfig(
        ttt_steps=args.ttt_steps,
        step_weight=args.step_weight,
        feed=args.feed,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        log_every=args.log_every,
        save_every=args.save_every,
        autocast=args.autocast,
    )
    tokens = None if args.offline else _tokens(args, target)
    if args.resume or args.init:
        draft = load_draft(args.resume or args.init, target=target, dtype=torch.float32)
    else:
        if tokens is None:  # the draft vocabulary comes from the stored sequences
            tokens = torch.from_numpy(np.load(Path(args.offline) / "input_ids.npy"))
        draft = new_draft(
            target,
            kind=args.kind,
            tokens=tokens,
            draft_vocab_size=args.draft_vocab_size,
            seed=args.seed,
            tie_lm_head=args.tie_lm_head,
        )
    if args.offline:
        batches = offline_batches(args.offline, target, draft, cfg=cfg, rank=rank, world=world)
    else:
        batches = online_batches(target, draft, tokens, cfg=cfg, rank=rank, world=world)
    _, history = distill_head(
        draft,
        batches,
        cfg=cfg,
        out=args.out,
        resume=args.resume,
        log_path=args.log_jsonl,
        progress=not args.no_progress,
    )
    if rank == 0 and history:
        print(json.dumps({"out": args.out, "steps": history[-1]["step"], "last": history[-1]}))
    if dist.is_initialized():
        # Every rank waits for the others (rank 0 writes the checkpoint after the last all-reduce): a rank
        # tearing gloo down while another is still at work aborted the process now and then under load
        # ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _precompute(args) -> int:
    device = _setup_device(args.device)
    target = load_target(args.target, device=device)
    ids = lookup(args.kind).target_layer_ids(None, target.cfg.num_hidden_layers)  # the kind's default layers
    meta = precompute(
        target,
        _tokens(args, target),
        args.out,
        aux_layer_ids=ids,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        progress=True,
    )
    print(json.dumps(meta))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fspec.train.distill", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="distill a draft head (online, or --offline DIR)")
    _add_common(tr)
    tr.add_argument("--offline", help="a store written by `precompute` (instead of running the target)")
    tr.add_argument("--draft-vocab-size", type=int, default=None, help="EAGLE-3: most frequent N tokens")
    tr.add_argument("--tie-lm-head", action="store_true", help="EAGLE-3: the target's lm_head rows, frozen")
    tr.add_argument("--init", help="start from this head checkpoint")
    tr.add_argument("--resume", help="continue this checkpoint directory (train_state.pt) bit-exactly")
    tr.add_argument("--steps", type=int, default=1000)
    tr.add_argument("--batch-size", type=int, default=8, help="sequences per step over all processes")
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--warmup-steps", type=int, default=50)
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--max-grad-norm", type=float, default=0.5)
    tr.add_argument("--ttt-steps", type=int, default=7, help="K, unrolled head steps")
    tr.add_argument("--step-weight", type=float, default=0.8, help="w, step j weighs w^j")
    tr.add_argument("--feed", default="prediction", choices=("prediction", "data"))
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--log-every", type=int, default=10)
    tr.add_argument("--save-every", type=int, default=0)
    tr.add_argument("--log-jsonl", default=None, help="append metric records to this file")
    tr.add_argument("--autocast", action="store_true", help="bf16 autocast on CUDA")
    tr.add_argument("--no-progress", action="store_true")
    tr.set_defaults(func=_train)
    pc = sub.add_parser("precompute", help="write the target's outputs for offline distillation")
    _add_common(pc)
    pc.add_argument("--num-sequences", type=int, default=1024)
    pc.add_argument("--batch-size", type=int, default=8)
    pc.set_defaults(func=_precompute)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
