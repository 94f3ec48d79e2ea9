"""A tiny target and an EAGLE-1 head that agrees with it most of the time, built by construction.

The target is close to a bigram model: its layers' output projections are scaled down, its embedding rows
have unit RMS (so the final RMSNorm nearly passes them through) and its lm_head is a scaled random matrix.
The head's fc passes the token embedding through (plus noise) and its layer adds nothing, so the head predicts
lm_head(e_t): the target's bigram part. Acceptance is high but not total — rounds exercise
acceptance, rejection and the bonus token alike — and the target's attention still matters.
"""

from __future__ import annotations

import torch

import fspec

from draft_setup import tiny_target


def aligned_pair(
    *, k: int = 3, layer_scale: float = 0.05, head_noise: float = 0.05, peak: float = 0.4, seed: int = 0
) -> tuple[fspec.Target, fspec.Draft]:
    target = tiny_target(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    p = target.params
    with torch.no_grad():
        e = torch.randn(p["embed"].shape, generator=gen)
        p["embed"].copy_(e / e.pow(2).mean(-1, keepdim=True).sqrt())
        p["lm_head"].copy_(torch.randn(p["lm_head"].shape, generator=gen) * peak)
        for layer in p["layers"]:
            layer["o"].mul_(layer_scale)
            layer["down"].mul_(layer_scale)
    draft = fspec.init_draft(
        target,
        kind="eagle",
        seed=seed + 1,
        num_speculative_steps=k,
        block_size=4,
        max_model_len=target.cfg.max_position_embeddings,
    )
    d = draft.params
    h = target.cfg.hidden_size
    with torch.no_grad():
        fc = torch.zeros(h, 2 * h)
        fc[:, :h] = torch.eye(h)
        d["fc"].copy_(fc + head_noise * torch.randn(h, 2 * h, generator=gen))
        d["fc_bias"].zero_()
        for layer in d["layers"]:
            layer["o"].zero_()
            layer["down"].zero_()
    return target, draft


def assert_table_matches_blocks(run) -> None:
    """The block table the host keeps row by row (`Run.table_h`) is each slot's blocks, then -1."""
    want = torch.full_like(run.table_h, -1)
    for b, blocks in enumerate(run.blocks):
        want[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    assert torch.equal(run.table_h, want), "the kept block table and the slots' blocks disagree"
