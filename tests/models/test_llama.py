"""The functional Llama-family target against transformers, and its paged path against its dense path."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import fspec
from fspec.core.cache import BlockAllocator, KVCache, block_table_row
from fspec.core.metadata import _slot_mapping, decode_metadata
from fspec.models import checkpoint as ck
from fspec.models import layers as L
from fspec.models import llama

ROPES = {
    "default": {},
    "linear": {"rope_type": "linear", "rope_factor": 2.0},
    # theta 500, D = 8: wavelengths 6.3, 30, 140, 660; original_max 64 makes the bands < 16 (kept), 16..64
    # (smoothed) and > 64 (divided by the factor): every branch of llama3 scaling is exercised
    "llama3": {"rope_type": "llama3", "rope_factor": 8.0, "rope_original_max_position_embeddings": 64},
}


def tiny_cfg(model_type: str = "llama", rope: str = "default", tied: bool = False, layers: int = 3):
    return fspec.ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        model_type=model_type,
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
        **ROPES[rope],
    )


def jittered(cfg, seed: int = 0) -> dict:
    """Random parameters where every leaf matters: norms around 1 (not exactly 1), biases non-zero."""
    params = llama.init(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def fill(tree):
        for name, leaf in tree.items():
            noise = torch.randn(leaf.shape, generator=gen)
            leaf.data.copy_(1.0 + 0.3 * noise if "norm" in name else 0.3 * noise)

    fill({k: v for k, v in params.items() if k != "layers"})
    for layer in params["layers"]:
        fill(layer)
    return params


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    ("model_type", "rope", "tied", "writer"),
    [
        ("llama", "default", False, "fspec"),
        ("llama", "llama3", True, "fspec"),
        ("llama", "linear", False, "hf"),
        ("llama", "llama3", False, "hf"),
        ("qwen2", "default", False, "fspec"),
        ("qwen3", "llama3", True, "hf"),
        ("mistral", "default", False, "hf"),
    ],
)
def test_target_logits_match_transformers(tmp_path, model_type, rope, tied, writer):
    """load_target of a random checkpoint gives transformers' logits (fp32, 1e-4), whoever wrote the files.

    "fspec" = save_target (rope_theta/rope_scaling config); "hf" = transformers' save_pretrained of that model
    (rope_parameters config, sharded), loaded back with load_target.
    """
    cfg = tiny_cfg(model_type, rope, tied)
    ck.save_target(ck.Target(cfg, jittered(cfg)), tmp_path / "a")
    path = tmp_path / "a"
    if writer == "hf":
        transformers.AutoModelForCausalLM.from_pretrained(path).save_pretrained(
            tmp_path / "b", max_shard_size="20KB"
        )
        path = tmp_path / "b"
        config = json.loads((path / "config.json").read_text())
        assert "rope_parameters" in config and (path / "model.safetensors.index.json").is_file()
    target = ck.load_target(path)
    assert (
        target.cfg.rope_type == ROPES[rope].get("rope_type", "default")
        and ("lm_head" in target.params) != tied
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    want = hf_logits(path, ids)
    got, hidden = llama.forward_dense(target.params, ids, cfg=target.cfg)
    assert got.shape == (2, 11, cfg.vocab_size) and hidden.last.shape == (2, 11, 32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert want.std() > 0.5  # logits are far from uniform, so a wrong weight could not pass unnoticed


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
def test_rope_inv_freq_equals_transformers(rope):
    """Inverse frequencies equal transformers' (bit for bit), including `_compute_llama3_parameters`."""
    cfg = tiny_cfg(rope=rope)
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf())
    default = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters
    want, scaling = ROPE_INIT_FUNCTIONS[rope](hf_cfg, "cpu") if rope != "default" else default(hf_cfg)
    assert scaling == 1.0
    torch.testing.assert_close(L.rope_inv_freq(cfg, "cpu"), want, atol=0, rtol=0)
    if rope == "llama3":  # all three bands are exercised: kept, smoothed, divided by factor
        base = L.rope_inv_freq(tiny_cfg(), "cpu")
        ratio = (base / want).tolist()
        assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and ratio[-1] == pytest.approx(8.0)


def test_compiled_rope_tables_hold_no_inv_freq_computation():
    """A traced `rope_cos_sin` holds no arange / pow / reciprocal: the inverse frequencies are kept by the
    `fspec::rope_tables` op per rope parameters and device (computed once), not a kernel of every compiled
    forward or draft step; the tables equal the reference's."""
    from fspec.kernels import rope_cos_sin as rcs

    cfg = tiny_cfg(rope="llama3")
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm

    tables = torch.compile(
        lambda p: L.rope_cos_sin(p, cfg=cfg, dtype=torch.float32), backend=backend, fullgraph=True
    )
    positions = torch.tensor([0, 3, 17])
    cos, sin = tables(positions)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    computed = [t for t in targets if any(w in t for w in ("arange", "pow", "reciprocal", "truediv"))]
    assert not computed and any("rope_tables" in t for t in targets), targets
    want = rcs.rope_cos_sin_ref(positions, L.rope_inv_freq(cfg, "cpu"), torch.float32)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    kept = rcs.cached_inv_freq(L.rope_key(cfg), torch.device("cpu"))
    assert kept is rcs.cached_inv_freq(L.rope_key(cfg), torch.device("cpu"))  # computed once
    assert torch.equal(kept, L.rope_inv_freq(cfg, "cpu"))
    other = rcs.cached_inv_freq(L.rope_key(tiny_cfg(rope="default")), torch.device("cpu"))
    assert not torch.equal(other, kept)  # keyed by the parameters


def test_aux_hidden_is_the_input_of_the_requested_layers(tmp_path):
    """aux = the hidden entering layers (i, j, k), in order (HF hidden_states[i]; id L is HF's
    hidden_states[L], the normed output); last = normed output."""
    cfg = tiny_cfg()
    ck.save_target(ck.Target(cfg, jittered(cfg)), tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # L + 1 entries, the last after the norm
    _, hidden = llama.forward_dense(ck.load_target(tmp_path).params, ids, cfg=cfg, aux_layer_ids=(2, 0, 3))
    assert len(hs) == 4  # L = 3
    torch.testing.assert_close(hidden.aux, torch.cat([hs[2], hs[0], hs[3]], dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.last, hs[-1], atol=1e-5, rtol=1e-5)
    _, plain = llama.forward_dense(ck.load_target(tmp_path).params, ids, cfg=cfg)
    assert plain.aux.shape == (1, 7, 0)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        llama.forward_dense(ck.load_target(tmp_path).params, ids, cfg=cfg, aux_layer_ids=(4,))


def test_eagle3_layer_ids_follow_the_reference_and_clamp_for_tiny_models():
    """(2, L//2, L-3) as in EAGLE's modeling_llama_kv.py; clamped and sorted for L < 6."""
    assert llama.eagle3_layer_ids(32) == (2, 16, 29)
    assert llama.eagle3_layer_ids(28) == (2, 14, 25)
    assert llama.eagle3_layer_ids(4) == (1, 2, 2)
    assert llama.eagle3_layer_ids(2) == (0, 1, 1)
    assert llama.eagle3_layer_ids(1) == (0, 0, 0)
    with pytest.raises(ValueError, match="num_layers"):
        llama.eagle3_layer_ids(0)


def _ragged_prefill_meta(prompts: list[list[int]], tables: torch.Tensor, *, block_size: int, pad: int):
    """A prefill of ragged prompts plus one padding request holding `pad` padding tokens."""
    positions = [p for prompt in prompts for p in range(len(prompt))] + [-1] * pad
    lens = [len(p) for p in prompts] + [pad]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.tensor(positions)
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return fspec.AttnMetadata(
        positions=pos,
        query_start_loc=qsl,
        seq_lens=torch.tensor([len(p) for p in prompts] + [0], dtype=torch.int32),
        block_table=tables,
        slot_mapping=_slot_mapping(tables, pos, block_size, req),
    )


@pytest.mark.parametrize(("model_type", "max_query_len"), [("llama", None), ("qwen3", 9), ("qwen2", 9)])
def test_paged_prefill_then_decode_matches_dense(model_type, max_query_len):
    """Ragged prompts prefilled in one batch, then 6 decode steps across block boundaries, equal forward_dense
    on each full sequence (logits, last and aux hidden), with scattered blocks and a padding row."""
    cfg, bs = tiny_cfg(model_type), 4
    params = jittered(cfg, seed=5)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 1, 9)]
    alloc = BlockAllocator(24)
    alloc.allocate(3)  # blocks 0-2 belong to nobody here: the requests' blocks do not start at 0
    rows = [block_table_row(alloc.allocate(4)[::-1], max_blocks=5) for _ in prompts]  # reversed: non-monotone
    tables = torch.stack([*rows, torch.full((5,), -1, dtype=torch.int32)])  # [4, 5], last row = padding
    cache = KVCache.create(cfg, num_blocks=24, block_size=bs)
    aux_ids = (0, 1, 2)
    meta = _ragged_prefill_meta(prompts, tables, block_size=bs, pad=2)
    ids = torch.tensor([t for p in prompts for t in p] + [0, 0])
    logits, hidden, out_cache = llama.forward(
        params, ids, meta, cache, cfg=cfg, aux_layer_ids=aux_ids, max_query_len=max_query_len
    )
    assert out_cache is cache and torch.isfinite(logits).all()
    seqs = [list(p) for p in prompts]
    starts = meta.query_start_loc.tolist()
    got = {
        b: [(logits[starts[b] + i], hidden.aux[starts[b] + i]) for i in range(len(p))]
        for b, p in enumerate(prompts)
    }
    for _ in range(6):
        nxt = [int(got[b][-1][0].argmax()) for b in range(3)]
        for b in range(3):
            seqs[b].append(nxt[b])
        positions = torch.tensor([len(s) - 1 for s in seqs] + [-1])
        step_meta = decode_metadata(positions, tables, block_size=bs)
        step_logits, step_hidden, _ = llama.forward(
            params, torch.tensor([*nxt, 0]), step_meta, cache, cfg=cfg, aux_layer_ids=aux_ids, max_query_len=1
        )
        assert torch.isfinite(step_logits).all()
        for b in range(3):
            got[b].append((step_logits[b], step_hidden.aux[b]))
    assert max(len(s) for s in seqs) == 15  # the longest request crossed into its 4th block
    for b, seq in enumerate(seqs):
        want_logits, want_hidden = llama.forward_dense(
            params, torch.tensor([seq]), cfg=cfg, aux_layer_ids=aux_ids
        )
        got_logits = torch.stack([g[0] for g in got[b]])
        torch.testing.assert_close(got_logits, want_logits[0, : len(got[b])], atol=1e-4, rtol=1e-4)
        got_aux = torch.stack([g[1] for g in got[b]])
        torch.testing.assert_close(got_aux, want_hidden.aux[0, : len(got[b])], atol=1e-4, rtol=1e-4)


def test_padding_tokens_neither_write_nor_produce_nan():
    """Tokens at position -1 leave every live block unchanged and give finite outputs."""
    cfg = tiny_cfg()
    params = jittered(cfg)
    cache = KVCache.create(cfg, num_blocks=4, block_size=4)
    cache.k.normal_()
    cache.v.normal_()
    before_k, before_v = cache.k[:, :4].clone(), cache.v[:, :4].clone()
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    meta = decode_metadata(torch.tensor([-1, -1]), tables, block_size=4)
    logits, hidden, cache = llama.forward(params, torch.tensor([5, 6]), meta, cache, cfg=cfg)
    assert torch.isfinite(logits).all() and torch.isfinite(hidden.last).all()
    assert torch.equal(cache.k[:, :4], before_k) and torch.equal(cache.v[:, :4], before_v)


def test_dense_backend_over_flat_tokens_matches_forward_dense():
    """backend="dense" attends among a call's ragged tokens by request and position, no cache needed."""
    cfg = tiny_cfg("qwen3")
    params = jittered(cfg, seed=2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 6)]
    tables = torch.full((3, 2), -1, dtype=torch.int32)
    meta = _ragged_prefill_meta(prompts, tables, block_size=4, pad=1)
    logits, _, cache = llama.forward(
        params, torch.tensor([*prompts[0], *prompts[1], 0]), meta, None, cfg=cfg, backend="dense"
    )
    assert cache is None
    for b, prompt in enumerate(prompts):
        want, _ = llama.forward_dense(params, torch.tensor([prompt]), cfg=cfg)
        start = meta.query_start_loc[b]
        torch.testing.assert_close(logits[start : start + len(prompt)], want[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="backend"):
        llama.forward(
            params,
            torch.tensor([1]),
            decode_metadata(torch.tensor([0]), tables[:1], block_size=4),
            None,
            cfg=cfg,
            backend="flash",
        )


def test_init_is_reproducible_and_frozen():
    """Same seed, same parameters; every leaf a frozen Parameter; tied models have no lm_head leaf."""
    cfg = tiny_cfg("qwen2", tied=True)
    a, b = llama.init(cfg, seed=4), llama.init(cfg, seed=4)
    leaves = fspec.tree.tree_leaves(a)
    assert all(isinstance(x, torch.nn.Parameter) and not x.requires_grad for x in leaves)
    assert all(torch.equal(x, y) for x, y in zip(leaves, fspec.tree.tree_leaves(b)))
    assert (
        "lm_head" not in a
        and set(a["layers"][0]) >= {"q_bias", "k_bias", "v_bias"}
        and "o_bias" not in a["layers"][0]
    )
    assert not torch.equal(a["embed"], llama.init(cfg, seed=5)["embed"])


def test_compiled_paged_forward_traces_once_without_graph_breaks():
    """fullgraph compile of the paged target step: no break, one graph for two steps at new positions, and
    the same logits and cache writes as eager."""
    cfg = tiny_cfg("qwen3", rope="llama3", layers=2)
    params = jittered(cfg, seed=8)
    tables = torch.tensor([[0, 1], [2, 3], [-1, -1]], dtype=torch.int32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(params, ids, meta, cache):
        return llama.forward(params, ids, meta, cache, cfg=cfg, aux_layer_ids=(0, 1), max_query_len=1)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager_cache, compiled_cache = (KVCache.create(cfg, num_blocks=4, block_size=4) for _ in range(2))
    for positions in ([0, 3, -1], [1, 4, -1]):
        meta = decode_metadata(torch.tensor(positions), tables, block_size=4)
        ids = torch.tensor([3, 8, 0])
        want_logits, want_hidden, _ = step(params, ids, meta, eager_cache)
        got_logits, got_hidden, _ = compiled(params, ids, meta, compiled_cache)
        torch.testing.assert_close(got_logits, want_logits)
        torch.testing.assert_close(got_hidden.aux, want_hidden.aux)
    assert len(graphs) == 1
    assert torch.equal(compiled_cache.k, eager_cache.k) and compiled_cache.k.abs().sum() > 0
