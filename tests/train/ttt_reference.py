"""A plain reference of the training-time test (TTT), for tests to hold `fspec.train.ttt` against.

The head's layers run K times over the whole batch [B, S]. Step 0 pairs hidden i with token i + 1 at
position i (EAGLE's shift). Step j >= 1 feeds row i its own output hidden of step j - 1 and, at position
i + j, either its own prediction of step j - 1 (feed "prediction": the argmax mapped to target ids) or the
data's token i + j + 1 (feed "data"). Row i of step j attends to the step-0 keys at positions <= i and to its
own keys of steps 1..j (`fspec.train.ttt.ttt_mask`).

The attention is written out here as one dense masked softmax over the keys of steps 0..j concatenated: the
[B, N, S, (j + 1)·S] scores are materialised, which is fine at test sizes. The cross-entropy is the plain
-sum_x p(x) log q(x) over materialised logits. Nothing here runs the draft loop's step, the chain cache or
the fused lm_head cross-entropy, which are what the library's loss goes through.
"""

from __future__ import annotations

import math

import torch

import fspec
from fspec.core.config import DraftConfig
from fspec.models.heads import head_hidden, head_logits, lookup, project_target_hidden
from fspec.ops.attention import rope_qk
from fspec.train.ttt import as_target_hidden, check_ttt, merge_params, ttt_mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over the keys where mask [S, Sk] is True: q [B, S, N, D], k/v
    [B, Sk, Nkv, D] -> [B, S, N, D]. Query head n reads KV head n // (N / Nkv)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bsnd,btnd->bnst", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bnst,btnd->bsnd", scores.softmax(-1), v)


def _attend(kv: dict, step: int):
    """The `Attend` of step `step`: rotate q and k, keep this step's k/v per layer in kv, attend under
    ttt_mask(S, step) over the keys of steps 0..step."""

    def attend(q, k, v, layer, cos, sin):
        q, k = rope_qk(q, k, cos, sin)
        keys, values = kv.setdefault(layer, ([], []))
        keys.append(k)
        values.append(v)
        mask = ttt_mask(q.shape[1], step, device=q.device)
        return masked_attention(q, torch.cat(keys, 1), torch.cat(values, 1), mask)

    return attend


def unroll(
    params: dict, batch: dict, *, cfg: DraftConfig, ttt_steps: int, feed: str = "prediction"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(K logits [B, S, Vd], K output hiddens [B, S, H]): the contract of `fspec.train.ttt.unroll`."""
    ids = batch["input_ids"]  # [B, S]
    b, s = ids.shape
    pad = ids.new_zeros(b, ttt_steps + 1)  # tokens past the sequence end: their rows have no target
    hidden = project_target_hidden(params, as_target_hidden(batch["hidden"], cfg=cfg), cfg=cfg)
    tokens = torch.cat((ids[:, 1:], pad[:, :1]), 1)  # row i reads token i + 1
    positions = torch.arange(s, device=ids.device).expand(b, s)
    kv: dict = {}
    all_logits, all_hidden = [], []
    for j in range(ttt_steps):
        out = head_hidden(params, tokens, hidden, positions + j, _attend(kv, j), cfg=cfg)  # [B, S, H]
        logits = head_logits(params, out, cfg=cfg)  # [B, S, Vd]
        all_logits.append(logits)
        all_hidden.append(out)
        if feed == "prediction":
            pred = logits.detach().argmax(-1)
            tokens = fspec.draft_to_target(pred, params["d2t"]) if lookup(cfg.kind).reduced_vocab else pred
        else:  # the data's token after the one this step read: position i + (j + 1) + 1
            tokens = torch.cat((ids[:, j + 2 :], pad[:, : j + 2]), 1)
        hidden = out
    return all_logits, all_hidden


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
    """(loss, {"loss": [K] CE per step, "agreement": [K]}): the contract of `fspec.train.ttt.ttt_loss`.

    Row i of step j predicts token i + j + 2 against p = softmax(target_logits[i + j + 1]); rows with
    i + j + 1 >= S have no target. loss = sum_j w^j · mean over rows of -sum_x p(x) log q(x); with
    batch["loss_mask"], the mean over the rows whose target position i + j + 1 the mask keeps."""
    check_ttt(ttt_steps, step_weight, feed)
    params = merge_params(trainable, frozen)
    logits, _ = unroll(params, batch, cfg=cfg, ttt_steps=ttt_steps, feed=feed)
    p_logits = batch["target_logits"]
    s = p_logits.shape[1]
    total, losses, agree = 0.0, [], []
    for j, q in enumerate(logits):
        n = s - 1 - j
        p, q = p_logits[:, j + 1 :], q[:, :n]
        rows = -(p.softmax(-1) * q.log_softmax(-1)).sum(-1)  # [B, n]
        hit = (q.argmax(-1) == p.argmax(-1)).float()
        if "loss_mask" in batch:
            keep = batch["loss_mask"][:, j + 1 :]
            rows, hit = rows[keep], hit[keep]
        ce = rows.mean() if rows.numel() else rows.sum()
        total = total + step_weight**j * ce
        losses.append(ce.detach())
        agree.append((hit.mean() if hit.numel() else hit.sum()).detach())
    return total, {"loss": torch.stack(losses), "agreement": torch.stack(agree)}
