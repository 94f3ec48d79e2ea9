"""Training-time test (TTT): EAGLE-3's unrolled distillation loss and a pure optimizer step.

Naming convention: p = target distribution, q = draft distribution.

A batch is a dict of the target's outputs over sequences [B, S] (see `fspec.train.distill` for how it is
made):

    {"input_ids": [B, S] int64,
     "hidden": [B, S, Hin]          what `project_target_hidden` reads: the aux states [.., 3·Ht] for EAGLE-3
                                    (fc is a trained head parameter, so it is applied inside the loss), the
                                    final-normed last hidden [.., Ht] for EAGLE-1 / MTP,
     "target_logits": [B, S, Vd],   the target's logits restricted to the draft vocabulary (EAGLE-3: the Vd
                                    columns of d2t; others: all V); `target_batch` makes one
     "loss_mask": [B, S] bool}      optional: True where the target's distribution at that position is a
                                    training target (the self-distillation recipe marks the positions inside
                                    the target's answers, so prompt text, which a head never drafts, costs no
                                    capacity); absent = every position

The head step is unrolled as K calls of the draft loop's own step (`fspec.draft.dense_step`, what
`draft_step` runs over a dense cache) over a `ChainKVCache` of B·S one-row chains, so serving and training
share one head step:

* step 0 is the causal pass over pairs (hidden_i, token_{i+1}) at positions i (EAGLE's shift);
* step j >= 1 feeds row i its own output hidden of step j-1 and its own prediction (argmax of step j-1's
  logits, mapped to target ids through d2t; no gradient through the argmax) at position i + j. Its query
  sees the step-0 keys at positions <= i and the keys of steps 1..j of the same row: exactly the cache a
  serving draft loop has when it drafts j tokens after position i (tests compare against `head_forward`
  over a paged cache);
* row i of step j predicts token i + j + 2, whose target distribution is p = softmax(target_logits[i+j+1]);
  rows with i + j + 1 >= S have no target and are left out of the loss.

loss = sum_j w^j · CE(p_j, q_j), CE(p, q) = -sum_x p(x) log q(x) (soft targets), averaged over rows (over the
rows whose target position the loss mask keeps, when the batch has one). The loss
computes each step's lm_head and CE together in chunks of rows (`linear_soft_cross_entropy`), so no step's
[B, S, Vd] logits are kept for the backward pass; `unroll` returns them for inspection and tests.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from einops import rearrange
from torch.autograd.function import once_differentiable

from fspec.core.cache import ChainKVCache
from fspec.core.config import DraftConfig
from fspec.core.metadata import _first_step_metadata, decode_rollout
from fspec.core.pytree import tree
from fspec.core.sampling_params import SamplingParams
from fspec.core.state import DraftState
from fspec.draft import dense_step
from fspec.models import llama
from fspec.models.checkpoint import Draft, Target
from fspec.models.heads import (
    head_kind,
    head_logits,
    head_pre_logits,
    lookup,
    project_target_hidden,
)
from fspec.models.llama import TargetHidden
from fspec.ops.attention import autocast_enabled, autocast_off

FEEDS = ("prediction", "data")
NEVER_TRAINED = ("d2t", "t2d")  # integer/bool vocabulary maps of EAGLE-3 heads


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Static settings of TTT distillation (the loss, the optimizer, the data shape, the loop).

    Attributes:
        ttt_steps: K, head steps unrolled per batch (EAGLE-3 uses 7).
        step_weight: w, the loss of step j is weighted w^j (EAGLE-3 uses 0.8).
        feed: "prediction" (step j >= 1 reads the head's own argmax, as at serving time) or "data" (the
            sequence's next token, as EAGLE-3's and SpecForge's trainers do; equal on target-generated text).
        steps: optimizer steps in total.
        batch_size: sequences per step over all processes (each of W processes takes batch_size / W).
        seq_len: S, tokens per sequence; must exceed ttt_steps (step K-1 needs a row with a target).
        lr: peak learning rate; linear warm-up over warmup_steps, then cosine down to lr · min_lr_ratio.
        warmup_steps, min_lr_ratio: the schedule.
        betas, eps, weight_decay: AdamW (decay on matrices only, decoupled, scaled by the learning rate).
        max_grad_norm: clip the global gradient norm to this (0 = no clipping).
        seed: data order (batch of step t is a pure function of (seed, t): resuming replays it exactly).
        log_every: record metrics every this many steps (each record costs one host sync).
        save_every: checkpoint every this many steps (0 = only at the end).
        autocast: run target and head under bf16 autocast on CUDA (master weights stay fp32).
    """

    ttt_steps: int = 7
    step_weight: float = 0.8
    feed: str = "prediction"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    seed: int = 0
    log_every: int = 10
    save_every: int = 0
    autocast: bool = False

    def __post_init__(self) -> None:
        check_ttt(self.ttt_steps, self.step_weight, self.feed)
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DistillConfig.{name}: expected a positive int, got {value!r}")
        for name in ("warmup_steps", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DistillConfig.{name}: expected an int >= 0, got {value!r}")
        if self.seq_len <= self.ttt_steps:
            raise ValueError(
                f"DistillConfig.seq_len: expected more than ttt_steps={self.ttt_steps} tokens, "
                f"got {self.seq_len}"
            )
        _check_number("lr", self.lr, low=0.0, low_open=True)
        _check_number("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _check_number("eps", self.eps, low=0.0, low_open=True)
        _check_number("weight_decay", self.weight_decay, low=0.0)
        _check_number("max_grad_norm", self.max_grad_norm, low=0.0)
        betas = self.betas
        if (
            not isinstance(betas, tuple)
            or len(betas) != 2
            or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"DistillConfig.betas: expected a tuple of two numbers in [0, 1), got {betas!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(
                "DistillConfig.seed: expected an int in [0, 2^32) (step_generator seeds with "
                f"seed · 2^32 + step), got {self.seed!r}"
            )
        if not isinstance(self.autocast, bool):
            raise ValueError(f"DistillConfig.autocast: expected True or False, got {self.autocast!r}")


def _check_number(
    name: str, value: object, *, low: float, high: float = math.inf, low_open: bool = False
) -> None:
    """ValueError naming DistillConfig.<name> unless value is a finite real number in its range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        lo = f"({low}" if low_open else f"[{low}"
        hi = f"{high}]" if math.isfinite(high) else "inf)"
        raise ValueError(f"DistillConfig.{name}: expected a finite number in {lo}, {hi}, got {value!r}")


def check_ttt(ttt_steps: int, step_weight: float, feed: str = "prediction") -> None:
    """ValueError naming `ttt_steps` (K >= 1), `step_weight` (w > 0) or `feed` when out of range."""
    if isinstance(ttt_steps, bool) or not isinstance(ttt_steps, int) or ttt_steps < 1:
        raise ValueError(f"ttt_steps: expected an int >= 1 (K, unrolled head steps), got {ttt_steps!r}")
    if isinstance(step_weight, bool) or not isinstance(step_weight, (int, float)) or not step_weight > 0:
        raise ValueError(f"step_weight: expected a number > 0 (w, step j weighs w^j), got {step_weight!r}")
    if not math.isfinite(step_weight):
        raise ValueError(f"step_weight: expected a finite number, got {step_weight!r}")
    if feed not in FEEDS:
        raise ValueError(f"feed: expected one of {FEEDS}, got {feed!r}")


# --- the unrolled head --------------------------------------------------------------------------------------


def ttt_mask(seq_len: int, step: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """[S, (step+1)·S] bool, True = may attend: what row i of step `step` sees of steps 0..step's keys.

    Block 0 (step-0 keys) is causal: positions <= i. Block m in 1..step holds step m's keys; row i sees only
    its own (the diagonal): the tokens drafted after position i along its own chain. The loss does not build
    it: the chain cache's attention (`fspec.ops.dense_cache.bind_chain`) sees the same keys by construction;
    the tests' dense reference attends under this mask.
    """
    s = seq_len
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(s, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def vocab_ids(draft: Draft) -> torch.Tensor:
    """[Vd] int64: the target ids of the head's output vocabulary (EAGLE-3: through d2t; others: all V)."""
    if head_kind(draft.cfg).reduced_vocab:
        d2t = draft.params["d2t"]
        return torch.arange(d2t.numel(), device=d2t.device) + d2t
    return torch.arange(draft.cfg.model.vocab_size, device=draft.params["embed"].device)


def target_batch(target: Target, draft: Draft, input_ids: torch.Tensor, *, autocast: bool = False) -> dict:
    """The frozen target over input_ids [B, S] as a batch: input_ids, hidden (aux or last), target_logits."""
    cfg = draft.cfg
    with (
        torch.no_grad(),
        torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and input_ids.is_cuda),
    ):
        logits, hidden = llama.forward_dense(
            target.params, input_ids, cfg=target.cfg, aux_layer_ids=cfg.target_layer_ids
        )
        if cfg.draft_vocab_size != target.cfg.vocab_size:
            logits = logits.index_select(-1, vocab_ids(draft))  # [B, S, Vd]
    return {
        "input_ids": input_ids,
        "hidden": hidden.aux if head_kind(cfg).reads_aux_layers else hidden.last,
        "target_logits": logits,
    }


def as_target_hidden(hidden: torch.Tensor, *, cfg: DraftConfig) -> TargetHidden:
    """The batch's stored hidden as the `TargetHidden` field the head reads (aux for EAGLE-3, else last)."""
    empty = hidden[..., :0]
    if lookup(cfg.kind).reads_aux_layers:
        return TargetHidden(last=empty, aux=hidden)
    return TargetHidden(last=hidden, aux=empty)


def ttt_start(
    params: dict, batch: dict, *, cfg: DraftConfig, ttt_steps: int
) -> tuple[DraftState, ChainKVCache, DraftConfig]:
    """(state, cache, cfg) of the training-time test as a draft loop: R = B·S one-row requests, request
    b·S + i the chain forked at position i of sequence b (its step-0 row pairs hidden i with token i + 1),
    over a zeroed `ChainKVCache`, with greedy drafts (the argmax feeds the next step) and room for K steps.
    The metadata's block table is a formality (the chain cache has no blocks): distinct ids per request."""
    ids = batch["input_ids"]  # [B, S]
    b, s = ids.shape
    r, device = b * s, ids.device
    hidden = project_target_hidden(params, as_target_hidden(batch["hidden"], cfg=cfg), cfg=cfg)  # [B, S, H]
    scfg = dataclasses.replace(
        cfg, num_speculative_steps=ttt_steps, greedy_drafts=True, max_model_len=s + ttt_steps
    )
    m = scfg.max_blocks_per_request
    table = torch.arange(r * m, dtype=torch.int32, device=device).view(r, m)
    starts = torch.arange(s, device=device).repeat(b)  # [R]: chain b·S + i starts at position i
    meta = _first_step_metadata(
        starts, torch.ones_like(starts), table, num_query=1, block_size=scfg.block_size
    )
    state = DraftState(
        input_ids=torch.cat((ids[:, 1:], ids.new_zeros(b, 1)), 1).flatten(),  # row i reads token i + 1
        hidden=rearrange(hidden, "b s h -> (b s) h"),
        attn=meta,
        step=torch.zeros((), dtype=torch.int64, device=device),
        draft_tokens=torch.full((r, ttt_steps), -1, dtype=torch.int64, device=device),
        draft_probs=torch.zeros((r, ttt_steps, 0), dtype=torch.float32, device=device),
        sampling=SamplingParams.create(r, device=device),
    )
    cache = ChainKVCache.create(
        cfg.model, batch_size=b, seq_len=s, chain_len=ttt_steps, dtype=hidden.dtype, device=device
    )
    return state, cache, scfg


def _unroll_steps(params: dict, batch: dict, *, cfg: DraftConfig, ttt_steps: int, feed: str, score) -> None:
    """The K head steps as K calls of the draft loop's own step (`fspec.draft.dense_step`, what `draft_step`
    runs over a dense cache) over a `ChainKVCache`: `score(j, out)` sees step j's output hidden [B, S, H];
    the next step reads the step's own argmax (feed "prediction") or the data's next token ("data")."""
    ids = batch["input_ids"]  # [B, S]
    b, s = ids.shape
    state, cache, scfg = ttt_start(params, batch, cfg=cfg, ttt_steps=ttt_steps)
    nexts = decode_rollout(
        state.attn, ttt_steps, block_size=scfg.block_size, max_model_len=scfg.max_model_len
    )
    for j, nxt in enumerate(nexts):
        state, cache = dense_step(params, state, cache, cfg=scfg, nxt=nxt)
        score(j, rearrange(state.hidden, "(b s) h -> b s h", b=b))
        if feed == "data":  # the data's token after the one this step read: position i + (j + 1) + 1
            data = torch.cat((ids[:, j + 2 :], ids.new_zeros(b, min(j + 2, s))), 1)[:, :s]
            state = dataclasses.replace(state, input_ids=data.flatten())


def unroll(
    params: dict, batch: dict, *, cfg: DraftConfig, ttt_steps: int, feed: str = "prediction"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(K logits [B, S, Vd], K output hiddens [B, S, H]) of the unrolled head (see the module docstring)."""
    out_logits, out_hidden = [], []

    def keep(j: int, out: torch.Tensor) -> None:
        out_logits.append(head_logits(params, out, cfg=cfg))  # [B, S, Vd]
        out_hidden.append(out)

    _unroll_steps(params, batch, cfg=cfg, ttt_steps=ttt_steps, feed=feed, score=keep)
    return out_logits, out_hidden


class _SoftCrossEntropy(torch.autograd.Function):
    """mean over rows of CE(softmax(p_logits), softmax(q_logits)), computed in fp32, saving only its inputs.

    The plain expression -(p.softmax(-1) * q.log_softmax(-1)).sum(-1).mean() keeps softmax(p) and
    log_softmax(q) for the backward pass: two more [rows, Vd] fp32 tensors per unrolled step on top of the
    logits (2.1 GB each at 16 x 1024 rows and Vd = 32000). Here the backward pass recomputes them from the
    logits, which are kept anyway (q's by the lm_head matmul's graph, p's by the batch):
    CE = logsumexp(q) - sum_x p(x) q(x), dCE/dq = softmax(q) - p.
    """

    generate_vmap_rule = True  # composes with torch.func.vmap (heads stacked over a leading dim)

    @staticmethod
    def forward(q_logits, p_logits):
        q, p = q_logits.float(), p_logits.float()
        return (torch.logsumexp(q, -1) - (p.softmax(-1) * q).sum(-1)).mean()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    @once_differentiable  # no graph of its own ops under torch.func.grad (see _LinearSoftCrossEntropy)
    def backward(ctx, grad):
        q_logits, p_logits = ctx.saved_tensors
        rows = q_logits.numel() // q_logits.shape[-1]
        dq = (q_logits.float().softmax(-1) - p_logits.float().softmax(-1)) * (grad / rows)
        return dq.to(q_logits.dtype), None


def head_cross_entropy(
    params: dict,
    out: torch.Tensor,
    p_logits: torch.Tensor,
    *,
    cfg: DraftConfig,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean soft cross-entropy of the head's q for output hidden `out` [B, n, H] against
    p = softmax(p_logits) [B, n, Vd] (weighted by `weight` [B, n] when given), the head's argmax [B, n])
    without keeping q's logits: `linear_soft_cross_entropy` over the head's pre-logits and lm_head."""
    h = head_pre_logits(params, out, cfg=cfg)
    return linear_soft_cross_entropy(h, params["lm_head"], p_logits, weight=weight)


# Logits per chunk of rows: B·rows·V values, 2^26 (256 MB in fp32) at a time.
_CE_CHUNK_ELEMENTS = 1 << 26


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    kind = h.device.type
    return torch.get_autocast_dtype(kind) if autocast_enabled(kind) else h.dtype


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """mean CE(softmax(p_logits), softmax(h @ w^T)) and argmax(h @ w^T), in chunks of rows, keeping only h,
    w and p_logits for the backward pass (which recomputes each chunk's logits). The matmuls run in the
    autocast dtype when autocast is on (as F.linear would), the softmax arithmetic in fp32.

    Both backward passes here are `once_differentiable`: under `torch.func.grad` a Function's backward
    otherwise runs with grad on and keeps every chunk's [B, c, V] temporaries in a graph until it ends
    (fspec/ops/chain_attention.py measured what that cost its attention). No second derivative is taken."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h, w, p_logits, weight, dtype, chunk):
        acc = torch.promote_types(dtype, torch.float32)  # softmax arithmetic (fp64 stays fp64)
        with autocast_off(h.device.type):
            wt = w.to(dtype).transpose(-1, -2)  # [H, V]
            total = torch.zeros((), dtype=acc, device=h.device)
            preds = []
            for lo in range(0, h.shape[1], chunk):
                q = (h[:, lo : lo + chunk].to(dtype) @ wt).to(acc)  # [B, c, V]
                p = p_logits[:, lo : lo + chunk].to(acc).softmax(-1)
                ce = torch.logsumexp(q, -1) - (p * q).sum(-1)  # [B, c]
                total = total + (ce if weight is None else ce * weight[:, lo : lo + chunk].to(acc)).sum()
                preds.append(q.argmax(-1))
            return total / _ce_denominator(h, weight), torch.cat(preds, dim=1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, w, p_logits, weight, dtype, chunk = inputs
        ctx.save_for_backward(h, w, p_logits, weight)
        ctx.dtype, ctx.chunk = dtype, chunk
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    @once_differentiable  # no graph of its own ops under torch.func.grad (class docstring)
    def backward(ctx, grad, _grad_pred):
        h, w, p_logits, weight = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        acc = torch.promote_types(dtype, torch.float32)
        with autocast_off(h.device.type):
            wd = w.to(dtype)  # [V, H]
            g = grad / _ce_denominator(h, weight)
            dh, dw = [], torch.zeros(w.shape, dtype=acc, device=w.device)
            for lo in range(0, h.shape[1], chunk):
                hc = h[:, lo : lo + chunk].to(dtype)
                q = (hc @ wd.transpose(-1, -2)).to(acc)
                gc = g if weight is None else g * weight[:, lo : lo + chunk, None].to(acc)
                dq = ((q.softmax(-1) - p_logits[:, lo : lo + chunk].to(acc).softmax(-1)) * gc).to(dtype)
                dh.append((dq @ wd).to(h.dtype))
                if ctx.needs_input_grad[1]:
                    dw = dw + (dq.flatten(0, 1).transpose(0, 1) @ hc.flatten(0, 1)).to(acc)
            d_w = dw.to(w.dtype) if ctx.needs_input_grad[1] else None
            return torch.cat(dh, dim=1), d_w, None, None, None, None


def _ce_denominator(h: torch.Tensor, weight: torch.Tensor | None):
    """What the summed cross-entropy is divided by: the row count, or the weights' sum (at least 1e-6 of a
    row, so a batch whose weights are all zero gives a zero loss, not NaN)."""
    if weight is None:
        return max(h.shape[0] * h.shape[1], 1)
    return weight.sum().to(torch.promote_types(weight.dtype, torch.float32)).clamp(min=1e-6)


def linear_soft_cross_entropy(
    h: torch.Tensor,
    w: torch.Tensor,
    p_logits: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over rows of -sum_x softmax(p)(x) log softmax(h @ w^T)(x), argmax(h @ w^T) [B, n]) for h
    [B, n, H], w [V, H], p_logits [B, n, V] (no gradient to p). Equals `soft_cross_entropy(F.linear(h, w),
    p_logits)` without materialising the [B, n, V] logits for the backward pass. `weight` [B, n] (>= 0, no
    gradient): the weighted mean sum_r weight_r CE_r / sum_r weight_r instead (0 when every weight is 0);
    a 0/1 weight is a loss mask. `chunk`: rows per chunk (default: about 2^26 logits at a time)."""
    for name, x, dims in (("h", h, 3), ("w", w, 2), ("p_logits", p_logits, 3)):
        if not isinstance(x, torch.Tensor) or x.dim() != dims or not x.is_floating_point():
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a float {dims}-d tensor, got {got}")
    b, n, v = p_logits.shape
    if h.shape[:2] != (b, n) or w.shape != (v, h.shape[2]):
        raise ValueError(
            f"w: expected h [B, n, H], w [V, H], p_logits [B, n, V] with matching sizes, got h "
            f"{tuple(h.shape)}, w {tuple(w.shape)}, p_logits {tuple(p_logits.shape)}"
        )
    if weight is not None and (
        not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (b, n) or weight.is_complex()
    ):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected None or a real [{b}, {n}] tensor, got {got}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk: expected a positive int or None, got {chunk!r}")
    if chunk is None:
        chunk = max(1, min(n, _CE_CHUNK_ELEMENTS // max(b * v, 1)))
    if weight is not None:
        weight = weight.detach().to(torch.promote_types(h.dtype, torch.float32))
    return _LinearSoftCrossEntropy.apply(h, w, p_logits, weight, _compute_dtype(h), chunk)


def soft_cross_entropy(q_logits: torch.Tensor, p_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_x softmax(p)(x) log softmax(q)(x) for logits [..., V] (no gradient to p)."""
    return _SoftCrossEntropy.apply(q_logits, p_logits)


def ttt_loss(
    trainable: dict,
    frozen: dict,
    batch: dict,
    *,
    cfg: DraftConfig,
    ttt_steps: int = 7,
    step_weight: float = 0.8,
    feed: str = "prediction",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics): loss = sum_j w^j CE(p_j, q_j); metrics "loss" [K] (CE per step) and "agreement" [K]
    (fraction of rows where argmax q == argmax p), detached; both over the rows `batch["loss_mask"]` keeps
    when present. Differentiable in `trainable`; composes with
    torch.func.grad and vmap (vmap over stacked `trainable` with in_dims None for `frozen` and `batch`).

    The head steps are K calls of the draft loop's own step over a `ChainKVCache` (`_unroll_steps`, the
    step `draft_step` runs), so serving and training share one head step. tests/train/test_ttt_draft_step.py
    checks loss and gradients against a plain dense-attention reference (tests/train/ttt_reference.py). On
    the H200 at the shipped SmolLM2 head's shapes (32 x 512, K = 7, bf16 autocast) this step took 1.05x the
    time and 0.90x the peak memory of the loop over the head's layers it replaced
    (benchmarks/results/ttt_step.json).
    """
    check_ttt(ttt_steps, step_weight, feed)
    s = batch["input_ids"].shape[1]
    if s <= ttt_steps:
        raise ValueError(f"batch['input_ids']: expected more than ttt_steps={ttt_steps} tokens, got {s}")
    params = merge_params(trainable, frozen)
    p_logits = batch["target_logits"]  # [B, S, Vd]
    mask = batch.get("loss_mask")  # [B, S] bool or None: which positions' distributions are targets
    terms, losses, agree = [], [], []

    def score(j: int, out: torch.Tensor) -> None:
        n = s - 1 - j  # rows i whose target distribution exists: position i + j + 1 <= S - 1
        p_j = p_logits[:, j + 1 :]  # [B, n, Vd], a view
        w_j = None if mask is None else mask[:, j + 1 :].float()  # [B, n]
        ce, pred = head_cross_entropy(params, out[:, :n], p_j, cfg=cfg, weight=w_j)
        terms.append(step_weight**j * ce)
        losses.append(ce.detach())
        hit = (pred == p_j.argmax(-1)).float()
        agree.append((hit.mean() if w_j is None else (hit * w_j).sum() / w_j.sum().clamp(min=1)).detach())

    _unroll_steps(params, batch, cfg=cfg, ttt_steps=ttt_steps, feed=feed, score=score)
    total = torch.stack(terms).sum()
    return total, {"loss": torch.stack(losses), "agreement": torch.stack(agree)}


# --- parameters ---------------------------------------------------------------------------------------------


def split_params(params: dict, shared: tuple[str, ...], *, dtype=torch.float32) -> tuple[dict, dict]:
    """(trainable, frozen) top-level parts of a head's params.

    Frozen: the target's shared weights (`Draft.shared`: embedding, EAGLE-1/MTP lm_head), EAGLE-3's d2t/t2d.
    Trainable: everything else, as fresh `dtype` tensors (the master copy the optimizer updates). Frozen float
    weights are cast to `dtype` too (the same objects when already `dtype`), so a bf16 target can train an
    fp32 head without autocast.
    """
    keep = set(shared) | set(NEVER_TRAINED)
    trainable = {
        k: tree.tree_map(lambda t: t.detach().to(dtype).clone(), v)
        for k, v in params.items()
        if k not in keep
    }
    frozen = {
        k: v.detach().to(dtype) if v.is_floating_point() else v.detach()
        for k, v in params.items()
        if k in keep
    }
    return trainable, frozen


def merge_params(trainable: dict, frozen: dict) -> dict:
    """The head's full params from its two parts."""
    return {**frozen, **trainable}


# --- optimizer ----------------------------------------------------------------------------------------------


def learning_rate(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to `peak` over warmup_steps, then cosine down to peak · min_ratio at total_steps."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    frac = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def adamw_init(params: dict) -> dict:
    """AdamW state for `params`: {"m": zeros tree, "v": zeros tree, "count": 0}."""
    zeros = tree.tree_map(torch.zeros_like, params)
    return {"m": zeros, "v": tree.tree_map(torch.zeros_like, params), "count": 0}


def adamw_update(
    params: dict,
    grads: dict,
    state: dict,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> tuple[dict, dict]:
    """One decoupled AdamW step (Loshchilov & Hutter): new (params, state); inputs are not modified.

    Multi-tensor `_foreach` ops: one launch per operation over all leaves instead of one per leaf (a 4-layer
    target has ~40 leaves, so ~10 launches instead of ~400). Weight decay applies to matrices only.
    """
    leaves, spec = tree.tree_flatten(params)
    g = tree.tree_leaves(grads)
    m, v = tree.tree_leaves(state["m"]), tree.tree_leaves(state["v"])
    count = state["count"] + 1
    b1, b2 = betas
    m = torch._foreach_lerp(m, g, 1 - b1)  # m + (1 - b1)(g - m) = b1 m + (1 - b1) g
    v = torch._foreach_mul(v, b2)
    v = torch._foreach_addcmul(v, g, g, value=1 - b2)
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(v), math.sqrt(1 - b2**count)), eps)
    step = torch._foreach_div(m, denom)
    if weight_decay > 0:
        leaves = [p * (1 - lr * weight_decay) if p.dim() >= 2 else p for p in leaves]
    new = torch._foreach_add(leaves, step, alpha=-lr / (1 - b1**count))
    return (
        tree.tree_unflatten(spec, new),
        {"m": tree.tree_unflatten(spec, m), "v": tree.tree_unflatten(spec, v), "count": count},
    )


def clip_by_global_norm(grads: dict, max_norm: float) -> tuple[dict, torch.Tensor]:
    """(grads scaled so that their global L2 norm is at most max_norm, the norm before clipping); no sync."""
    leaves, spec = tree.tree_flatten(grads)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves)).float())
    if max_norm <= 0:
        return grads, norm
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return tree.tree_unflatten(spec, torch._foreach_mul(leaves, scale.to(leaves[0].dtype))), norm


def train_step(
    trainable: dict,
    opt_state: dict,
    frozen: dict,
    batch: dict,
    *,
    step: int,
    cfg: DraftConfig,
    dcfg: DistillConfig,
    reduce=None,
) -> tuple[dict, dict, dict]:
    """One optimizer step: (trainable, opt_state, metrics); pure (inputs untouched).

    reduce(tree) -> tree averages gradients and metrics over processes (DDP's all-reduce); None = one process.
    metrics: loss, loss_per_step [K], agreement [K], grad_norm (device tensors), lr (float).
    """
    grad_fn = torch.func.grad_and_value(ttt_loss, has_aux=True)
    kw = {"cfg": cfg, "ttt_steps": dcfg.ttt_steps, "step_weight": dcfg.step_weight, "feed": dcfg.feed}
    autocast = dcfg.autocast and batch["input_ids"].is_cuda
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        grads, (loss, aux) = grad_fn(trainable, frozen, batch, **kw)
    metrics = {"loss": loss.detach(), "loss_per_step": aux["loss"], "agreement": aux["agreement"]}
    if reduce is not None:
        grads, metrics = reduce((grads, metrics))
    grads, norm = clip_by_global_norm(grads, dcfg.max_grad_norm)
    lr = learning_rate(
        step,
        peak=dcfg.lr,
        warmup_steps=dcfg.warmup_steps,
        total_steps=dcfg.steps,
        min_ratio=dcfg.min_lr_ratio,
    )
    trainable, opt_state = adamw_update(
        trainable, grads, opt_state, lr=lr, betas=dcfg.betas, eps=dcfg.eps, weight_decay=dcfg.weight_decay
    )
    return trainable, opt_state, {**metrics, "grad_norm": norm, "lr": lr}
