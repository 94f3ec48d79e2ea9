"""Draft heads: each against a naive re-statement of its reference, paged against dense, and compiled."""

from __future__ import annotations

import math

import pytest
import torch

import fspec
from fspec.core.cache import KVCache
from fspec.core.metadata import decode_metadata, first_step_metadata
from fspec.models import checkpoint as ck
from fspec.models import llama
from fspec.models.heads import (
    draft_to_target,
    eagle3,
    head_forward,
    head_forward_dense,
    project_target_hidden,
)

KINDS = ("eagle", "eagle3", "mtp")


def make_target(layers: int = 4) -> ck.Target:
    cfg = fspec.ModelConfig(
        vocab_size=61,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=64,
        rope_theta=300.0,
        rms_norm_eps=1e-5,
    )
    return ck.Target(cfg, jitter(llama.init(cfg, seed=0), seed=1))


def jitter(tree, seed: int, skip: tuple = ()):
    """Every float leaf random (norms around 1), so that any misplaced weight changes the output."""
    gen = torch.Generator().manual_seed(seed)

    def visit(node, name=""):
        if isinstance(node, dict):
            for k, v in node.items():
                if k not in skip:
                    visit(v, k)
        elif isinstance(node, list):
            for v in node:
                visit(v, name)
        elif node.is_floating_point():
            noise = torch.randn(node.shape, generator=gen)
            node.data.copy_(1.0 + 0.3 * noise if "norm" in name else 0.3 * noise)

    visit(tree)
    return tree


def make_draft(kind: str, target: ck.Target) -> ck.Draft:
    kw = (
        {
            "draft_vocab_size": 40,
            "draft_ids": torch.randperm(61, generator=torch.Generator().manual_seed(2))[:40].sort().values,
        }
        if kind == "eagle3"
        else {}
    )
    draft = ck.init_draft(target, kind=kind, seed=3, block_size=4, max_model_len=32, **kw)
    jitter(
        draft.params,
        seed=4,
        skip=("embed", "lm_head", "d2t", "t2d") if kind != "eagle3" else ("embed", "d2t", "t2d"),
    )
    return draft


# --- a naive re-statement of each head (float64, per-position loops), written from the reference code ------


def _rms(x, w, eps):
    return w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):  # x [n, D] at integer position pos
    d = x.shape[-1]
    inv = [1.0 / theta ** (2 * i / d) for i in range(d // 2)]
    out = x.clone()
    for i, f in enumerate(inv):
        c, s = math.cos(pos * f), math.sin(pos * f)
        a, b = x[:, i], x[:, i + d // 2]
        out[:, i], out[:, i + d // 2] = a * c - b * s, b * c + a * s
    return out


def _naive_layer(p, attn_in, residual, m):
    s, d, g = attn_in.shape[0], m.head_dim, m.num_attention_heads // m.num_key_value_heads
    q = (attn_in @ p["q"].double().T).view(s, -1, d)
    k = (attn_in @ p["k"].double().T).view(s, -1, d)
    v = (attn_in @ p["v"].double().T).view(s, -1, d)
    q = torch.stack([_rope(q[i], i, m.rope_theta) for i in range(s)])
    k = torch.stack([_rope(k[i], i, m.rope_theta) for i in range(s)])
    out = torch.zeros_like(q)
    for i in range(s):
        for h in range(q.shape[1]):
            w = torch.softmax(k[: i + 1, h // g] @ q[i, h] / math.sqrt(d), 0)
            out[i, h] = w @ v[: i + 1, h // g]
    h = residual + out.reshape(s, -1) @ p["o"].double().T
    y = _rms(h, p["post_norm"], m.rms_norm_eps)
    return (
        h
        + (torch.nn.functional.silu(y @ p["gate"].double().T) * (y @ p["up"].double().T))
        @ p["down"].double().T
    )


def naive_head(kind, params, ids, hidden, m):
    """(logits, new_hidden) of one sequence ids [S], hidden [S, H] (positions 0..S-1)."""
    emb, hidden, eps = params["embed"].double()[ids], hidden.double(), m.rms_norm_eps
    if kind == "eagle":  # cnets1.py: fc with bias, layer 0 without input norm, lm_head without final norm
        x = torch.cat([emb, hidden], -1) @ params["fc"].double().T + params["fc_bias"].double()
        out = _naive_layer(params["layers"][0], x, x, m)
        return out @ params["lm_head"].double().T, out
    p = params["layer"]
    if (
        kind == "eagle3"
    ):  # cnets.py: cat(input_layernorm(emb), hidden_norm(h)), residual h, lm_head(norm(out))
        attn_in = torch.cat([_rms(emb, p["input_norm"], eps), _rms(hidden, p["hidden_norm"], eps)], -1)
        out = _naive_layer(p, attn_in, hidden, m)
        return _rms(out, params["norm"], eps) @ params["lm_head"].double().T, out
    emb[0] = 0.0  # vLLM deepseek_mtp.py: embeddings at position 0 masked
    x = (
        torch.cat([_rms(emb, params["enorm"], eps), _rms(hidden, params["hnorm"], eps)], -1)
        @ params["eh_proj"].double().T
    )
    out = _naive_layer(p, _rms(x, p["input_norm"], eps), x, m)
    return _rms(out, params["final_norm"], eps) @ params["lm_head"].double().T, out


@pytest.mark.parametrize("kind", KINDS)
def test_dense_head_matches_naive_reference(kind):
    """forward_dense of each head equals a per-position float64 re-statement of the reference head."""
    target = make_target()
    draft = make_draft(kind, target)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 61, (2, 7), generator=gen)
    hidden = torch.randn(2, 7, 24, generator=gen)
    logits, new_hidden = head_forward_dense(draft.params, ids, hidden, cfg=draft.cfg)
    vd = 40 if kind == "eagle3" else 61
    assert logits.shape == (2, 7, vd) and new_hidden.shape == (2, 7, 24)
    for b in range(2):
        want_logits, want_hidden = naive_head(kind, draft.params, ids[b], hidden[b], draft.cfg.model)
        torch.testing.assert_close(logits[b].double(), want_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(new_hidden[b].double(), want_hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_paged_propose_matches_dense_over_the_fed_sequence(kind):
    """A first step over ragged verified tokens, then 3 decode steps on the head's own hidden, through the
    paged cache, equals forward_dense over the tokens and hiddens that were fed (with a padding request)."""
    target = make_target()
    draft = make_draft(kind, target)
    cfg, k1 = draft.cfg, 4
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 61, (2, k1), generator=gen)
    _, th = llama.forward_dense(target.params, prompt, cfg=target.cfg, aux_layer_ids=cfg.target_layer_ids)
    first_hidden = project_target_hidden(draft.params, th, cfg=cfg)  # [2, K+1, H]
    assert first_hidden.shape == (2, k1, 24)
    tables = torch.tensor([[5, 2], [0, 7], [-1, -1]], dtype=torch.int32)
    num_tokens = torch.tensor([4, 2, 0])  # request 1 has only 2 live tokens, request 2 is padding
    meta = first_step_metadata(torch.tensor([0, 0, -1]), num_tokens, tables, num_query=k1, block_size=4)
    cache = KVCache.create(cfg.model, num_blocks=8, block_size=4)
    ids = torch.cat([prompt, torch.zeros(1, k1, dtype=torch.int64)]).flatten()
    hid = torch.cat([first_hidden, torch.zeros(1, k1, 24)]).flatten(0, 1)
    logits, new_hidden, cache = head_forward(draft.params, ids, hid, meta, cache, cfg=cfg, max_query_len=k1)
    fed = {
        b: (ids[b * k1 : b * k1 + n].tolist(), list(hid[b * k1 : b * k1 + n])) for b, n in enumerate([4, 2])
    }
    outs = {b: [(logits[b * k1 + i], new_hidden[b * k1 + i]) for i in range(n)] for b, n in enumerate([4, 2])}
    step_meta = fspec.decode_after(meta, block_size=4, max_model_len=cfg.max_model_len)
    for _ in range(3):
        tok = [int(outs[b][-1][0].argmax()) for b in range(2)]
        if kind == "eagle3":  # the head speaks draft ids; its next input is the target id
            tok = draft_to_target(torch.tensor(tok), draft.params["d2t"]).tolist()
        h = [outs[b][-1][1] for b in range(2)]
        for b in range(2):
            fed[b][0].append(tok[b])
            fed[b][1].append(h[b])
        step_logits, step_hidden, cache = head_forward(
            draft.params,
            torch.tensor([*tok, 0]),
            torch.stack([*h, torch.zeros(24)]),
            step_meta,
            cache,
            cfg=cfg,
            max_query_len=1,
        )
        assert torch.isfinite(step_logits).all()
        for b in range(2):
            outs[b].append((step_logits[b], step_hidden[b]))
        step_meta = fspec.advance(step_meta, block_size=4, max_model_len=cfg.max_model_len)
    assert [len(outs[b]) for b in range(2)] == [
        7,
        5,
    ]  # request 0 crossed from its first block into its second
    for b in range(2):
        want_logits, want_hidden = head_forward_dense(
            draft.params, torch.tensor([fed[b][0]]), torch.stack(fed[b][1])[None], cfg=cfg
        )
        torch.testing.assert_close(torch.stack([o[0] for o in outs[b]]), want_logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.stack([o[1] for o in outs[b]]), want_hidden[0], atol=1e-4, rtol=1e-4)


def test_heads_share_the_targets_embedding_and_lm_head_objects():
    """EAGLE-1/MTP reuse the target's Parameters; EAGLE-3 reuses the embedding and owns a reduced lm_head."""
    target = make_target()
    for kind in KINDS:
        draft = make_draft(kind, target)
        assert draft.params["embed"] is target.params["embed"]
        assert (draft.params["lm_head"] is target.params["lm_head"]) == (kind != "eagle3")
        assert draft.shared == (("embed", "lm_head") if kind != "eagle3" else ("embed",))
    e1 = make_draft("eagle", target).params
    assert "input_norm" not in e1["layers"][0] and e1["fc"].shape == (24, 48) and e1["fc_bias"].shape == (24,)
    e3 = make_draft("eagle3", target)
    assert e3.params["fc"].shape == (24, 72) and e3.params["layer"]["q"].shape == (24, 48)
    assert e3.params["lm_head"].shape == (40, 24) and e3.cfg.target_layer_ids == (1, 2, 2)
    fresh = ck.init_draft(target, kind="eagle3", draft_vocab_size=40, draft_ids=torch.arange(5, 45))
    torch.testing.assert_close(
        fresh.params["lm_head"], target.params["lm_head"][5:45]
    )  # starts as target rows


def test_draft_to_target_maps_through_d2t_and_keeps_padding():
    """target = draft + d2t[draft] for every draft id, each mapped id is in t2d, -1 stays -1."""
    draft_ids = torch.tensor([1, 4, 5, 9, 20])
    d2t, t2d = eagle3.vocab_maps(draft_ids, 25)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 5
    ids = torch.tensor([[0, 4, -1], [3, 2, 1]])
    assert draft_to_target(ids, d2t).tolist() == [[1, 20, -1], [9, 5, 4]]
    assert t2d[draft_to_target(torch.arange(5), d2t)].all()
    with pytest.raises(ValueError, match="strictly increasing"):
        eagle3.vocab_maps(torch.tensor([3, 3]), 25)
    with pytest.raises(ValueError, match="ids in"):
        eagle3.vocab_maps(torch.tensor([3, 30]), 25)


def test_eagle3_first_step_needs_the_targets_aux_hidden():
    """project_target_hidden applies fc to aux [.., 3Ht] and names the fix when aux was not requested."""
    target = make_target()
    draft = make_draft("eagle3", target)
    ids = torch.tensor([[1, 2, 3]])
    _, plain = llama.forward_dense(target.params, ids, cfg=target.cfg)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        project_target_hidden(draft.params, plain, cfg=draft.cfg)
    _, th = llama.forward_dense(target.params, ids, cfg=target.cfg, aux_layer_ids=draft.cfg.target_layer_ids)
    torch.testing.assert_close(
        project_target_hidden(draft.params, th, cfg=draft.cfg), th.aux @ draft.params["fc"].T
    )


def test_head_init_rejects_a_mismatched_target():
    """A config whose kind or sizes disagree with the target raises ValueError naming the field."""
    target = make_target()
    draft = make_draft("eagle", target)
    with pytest.raises(ValueError, match="cfg.kind"):
        eagle3.init(draft.cfg, target.params, seed=0)
    other = fspec.DraftConfig(
        kind="eagle",
        model=fspec.ModelConfig(
            vocab_size=61,
            hidden_size=16,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        ),
        target_hidden_size=24,
    )
    with pytest.raises(ValueError, match="hidden_size"):
        fspec.models.heads.head_init(other, target.params, seed=0)


def test_compiled_head_step_has_no_graph_break_and_matches_eager():
    """torch.compile(fullgraph=True) of an EAGLE-3 paged step traces (no break) and gives eager's outputs."""
    target = make_target(layers=2)
    draft = make_draft("eagle3", target)
    meta = decode_metadata(
        torch.tensor([3, -1, 6]), torch.tensor([[0, 1], [-1, -1], [2, 3]], dtype=torch.int32), block_size=4
    )
    ids, hidden = torch.tensor([4, 0, 9]), torch.randn(3, 24, generator=torch.Generator().manual_seed(0))

    def step(params, ids, hidden, meta, cache):
        return head_forward(params, ids, hidden, meta, cache, cfg=draft.cfg, max_query_len=1)

    caches = [KVCache.create(draft.cfg.model, num_blocks=4, block_size=4) for _ in range(2)]
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(1)))
        c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(2)))
    want = step(draft.params, ids, hidden, meta, caches[0])
    got = torch.compile(step, fullgraph=True, backend="eager")(draft.params, ids, hidden, meta, caches[1])
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert got[2] is caches[1] and torch.equal(caches[1].k, caches[0].k)  # written in place, same values


@pytest.mark.parametrize("kind,layers", [("eagle", 1), ("eagle", 2), ("eagle3", 1), ("mtp", 1)])
def test_rows_only_computes_the_sampled_rows_as_the_full_step_does(kind, layers):
    """`_head_forward(..., rows_only=True)` (what a draft step runs: after the attention only the rows it
    samples from) gives those rows' logits and hidden as the full step does, and writes the same K/V for
    every row of every layer; a two-layer EAGLE head drops rows in its last layer only (dropping them
    earlier would change the last layer's K/V of the dropped rows)."""
    import copy
    import dataclasses

    from fspec.models.heads import _head_forward

    target = make_target()
    draft = make_draft(kind, target)
    params, cfg = draft.params, draft.cfg
    if layers == 2:
        second = jitter(copy.deepcopy(params["layers"][0]), seed=9)
        second["input_norm"] = 1.0 + 0.1 * torch.randn(cfg.model.hidden_size)
        params = {**params, "layers": [params["layers"][0], second]}
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_hidden_layers=2))
    k1, h = 4, cfg.model.hidden_size
    gen = torch.Generator().manual_seed(11)
    ids = torch.cat([torch.randint(0, 61, (2 * k1,), generator=gen), torch.zeros(k1, dtype=torch.int64)])
    hid = torch.cat([torch.randn(2 * k1, h, generator=gen), torch.zeros(k1, h)])
    tables = torch.tensor([[5, 2], [0, 7], [-1, -1]], dtype=torch.int32)
    meta = first_step_metadata(
        torch.tensor([3, 0, -1]), torch.tensor([4, 2, 0]), tables, num_query=k1, block_size=4
    )
    rows = torch.tensor([3, 5, 8])  # each request's last live row (the padding request: its first)
    got, want = (KVCache.create(cfg.model, num_blocks=8, block_size=4) for _ in range(2))
    kw = dict(cfg=cfg, max_query_len=k1, logit_rows=rows)
    logits, new_hidden, got = _head_forward(params, ids, hid, meta, got, rows_only=True, **kw)
    full_logits, full_hidden, want = _head_forward(params, ids, hid, meta, want, **kw)
    assert new_hidden.shape == (3, h) and full_hidden.shape == (3 * k1, h)
    torch.testing.assert_close(logits, full_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_hidden, full_hidden[rows], atol=1e-5, rtol=1e-5)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
