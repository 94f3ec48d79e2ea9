"""Checkpoints: HF target directories, published draft-head layouts, round trips and the errors users see."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import fspec
from fspec.models import checkpoint as ck
from fspec.models import llama

LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
]
PUBLISHED_KEYS = {
    "eagle": {"fc.weight", "fc.bias", *(f"layers.0.{k}" for k in LAYER)},
    "eagle3": {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        *(f"midlayer.{k}" for k in LAYER),
    },
    "mtp": {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "input_layernorm.weight",
        *LAYER,
    },
}


def tiny_target(model_type: str = "llama", tied: bool = False, dtype=torch.float32) -> ck.Target:
    cfg = fspec.ModelConfig(
        vocab_size=53,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        tie_word_embeddings=tied,
        model_type=model_type,
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
    )
    params = llama.init(cfg, seed=1, dtype=dtype)
    for i, leaf in enumerate(fspec.tree.tree_leaves(params)):
        leaf.data.copy_(torch.randn(leaf.shape, generator=torch.Generator().manual_seed(i)).to(dtype))
    return ck.Target(cfg, params)


def leaves_equal(a, b) -> bool:
    la, lb = fspec.tree.tree_leaves(a), fspec.tree.tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


def test_target_round_trips_sharded_with_tokenizer(tmp_path):
    """save_target (sharded) then load_target is bit-exact, keeps the tokenizer and the chat template, and
    writes HF's index."""
    target = tiny_target("qwen3", tied=True)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["def f(x): return x + 1", "import torch"] * 5, trainers.BpeTrainer(vocab_size=50)
    )
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    ck.save_target(
        ck.Target(target.cfg, target.params, tok, chat_template=template), tmp_path, max_shard_bytes=2000
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and "lm_head.weight" not in index["weight_map"]
    assert "model.layers.2.self_attn.q_norm.weight" in index["weight_map"]
    loaded = ck.load_target(tmp_path, fuse=False)
    assert loaded.cfg == target.cfg and leaves_equal(loaded.params, target.params)
    assert loaded.tokenizer.encode("def f(x)").ids == tok.encode("def f(x)").ids
    assert loaded.chat_template == template  # chat_template.jinja
    assert (
        ck.render_chat(loaded, [{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<user>hi"
    )


def test_target_dtype_is_kept_or_cast(tmp_path):
    """A bf16 checkpoint loads as bf16 unless a dtype is asked for."""
    ck.save_target(tiny_target(dtype=torch.bfloat16), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert ck.load_target(tmp_path).params["layers"][0]["qkv"].dtype == torch.bfloat16
    assert ck.load_target(tmp_path, dtype=torch.float32).params["norm"].dtype == torch.float32


def test_load_target_reports_missing_files(tmp_path):
    """Missing directory, config.json, weights or shard: FileNotFoundError naming the path."""
    with pytest.raises(FileNotFoundError, match="no such directory"):
        ck.load_target(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ck.load_target(tmp_path)
    ck.save_target(tiny_target(), tmp_path, max_shard_bytes=2000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        ck.load_target(tmp_path)
    for f in tmp_path.glob("model*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        ck.load_target(tmp_path)


def _rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            r"missing key 'model.layers.1.mlp.up_proj.weight'",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.ones(17)}),
            r"'model.norm.weight' expected shape \[16\], got \[17\]",
        ),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(16)}), "unexpected keys"),
    ],
)
def test_load_target_names_bad_keys(tmp_path, change, match):
    """A missing, mis-shaped or unexpected key raises ValueError naming it (and the shapes)."""
    ck.save_target(tiny_target(), tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(ValueError, match=match):
        ck.load_target(tmp_path)


def test_load_target_rejects_unsupported_architectures(tmp_path):
    """A non-Llama-family config raises ValueError naming the model_type."""
    ck.save_target(tiny_target(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2"]})
    )
    with pytest.raises(ValueError, match="gpt2"):
        ck.load_target(tmp_path)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_draft_round_trips_bit_exactly_in_the_published_layout(tmp_path, kind):
    """save_draft writes exactly the published key set (no shared target weight); load_draft restores every
    leaf bit for bit, re-links shared weights to the target's objects, and the loop settings."""
    target = tiny_target()
    draft = ck.init_draft(
        target,
        kind=kind,
        seed=2,
        num_speculative_steps=5,
        block_size=8,
        max_model_len=48,
        greedy_drafts=True,
        **({"draft_vocab_size": 20} if kind == "eagle3" else {}),
    )
    for leaf in fspec.tree.tree_leaves({k: v for k, v in draft.params.items() if k not in draft.shared}):
        if leaf.is_floating_point():
            leaf.data.normal_()
    ck.save_draft(draft, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == PUBLISHED_KEYS[kind]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["fspec_draft"]["kind"] == kind
    if kind == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 20
    loaded = ck.load_draft(tmp_path, target=target, fuse=False)
    assert loaded.cfg == draft.cfg and loaded.shared == draft.shared
    assert leaves_equal(loaded.params, draft.params)
    for name in loaded.shared:
        assert loaded.params[name] is draft.params[name]
    assert ck.load_draft(tmp_path, target=target, num_speculative_steps=2).cfg.num_speculative_steps == 2


def test_published_heads_without_fspec_metadata_load(tmp_path):
    """Kinds are inferred from architecture / weight names; EAGLE-1 "bias": false drops fc.bias; a head that
    ships its own embedding keeps it (and saves it again); pytorch_model.bin is read too."""
    target = tiny_target()
    for kind in ("eagle", "eagle3", "mtp"):
        ck.save_draft(ck.init_draft(target, kind=kind), tmp_path / kind)
        config = json.loads((tmp_path / kind / "config.json").read_text())
        del config["fspec_draft"]
        (tmp_path / kind / "config.json").write_text(json.dumps(config))
        assert ck.load_draft(tmp_path / kind, target=target).cfg.kind == kind
    e1 = tmp_path / "eagle"
    config = json.loads((e1 / "config.json").read_text())
    (e1 / "config.json").write_text(json.dumps({**config, "bias": False}))
    tensors = load_file(e1 / "model.safetensors")
    del tensors["fc.bias"]
    tensors["embed_tokens.weight"] = torch.randn(53, 16)
    (e1 / "model.safetensors").unlink()
    torch.save(tensors, e1 / "pytorch_model.bin")
    head = ck.load_draft(e1, target=target)
    assert "fc_bias" not in head.params and head.shared == ("lm_head",)
    assert torch.equal(head.params["embed"], tensors["embed_tokens.weight"])
    ck.save_draft(head, tmp_path / "again")
    assert set(load_file(tmp_path / "again" / "model.safetensors")) == PUBLISHED_KEYS["eagle"] - {
        "fc.bias"
    } | {"embed_tokens.weight"}


def test_load_draft_names_bad_checkpoints(tmp_path):
    """Missing or mis-shaped keys, a vocabulary that is not the target's, or an unknown layout: ValueError."""
    target = tiny_target()
    ck.save_draft(ck.init_draft(target, kind="eagle3", draft_vocab_size=20), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing key 'd2t'"):
        ck.load_draft(tmp_path, target=target)
    save_file({**tensors, "fc.weight": torch.zeros(16, 47)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'fc.weight' expected shape \[16, 48\], got \[16, 47\]"):
        ck.load_draft(tmp_path, target=target)
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 99}))
    with pytest.raises(ValueError, match="vocab_size"):
        ck.load_draft(tmp_path, target=target)
    (tmp_path / "config.json").write_text(json.dumps({**config, "fspec_draft": {"kind": "medusa"}}))
    with pytest.raises(ValueError, match="medusa"):
        ck.load_draft(tmp_path, target=target)
    with pytest.raises(FileNotFoundError):
        ck.load_draft(tmp_path / "missing", target=target)


def test_eagle3_head_with_chosen_layers_and_width_round_trips_and_runs(tmp_path):
    """init_draft(target_layer_ids=, intermediate_size=) gives a head that reads those target layers (id
    L = 3: the target's final normed hidden) and has that MLP width; both survive save/load (config.json),
    the head drafts, bad values name the argument."""
    target = tiny_target()
    draft = ck.init_draft(
        target, kind="eagle3", seed=3, draft_vocab_size=20, target_layer_ids=(0, 1, 3), intermediate_size=40
    )
    assert draft.cfg.target_layer_ids == (0, 1, 3) and draft.cfg.model.intermediate_size == 40
    assert draft.params["layer"]["gate"].shape == (40, 16) and draft.params["layer"]["down"].shape == (16, 40)
    assert ck.init_draft(target, kind="eagle3").cfg.target_layer_ids == llama.eagle3_layer_ids(3)
    ck.save_draft(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3] and config["intermediate_size"] == 40
    loaded = ck.load_draft(tmp_path, target=target, fuse=False)
    assert loaded.cfg == draft.cfg and leaves_equal(loaded.params, draft.params)
    out = fspec.generate(target, loaded, [[1, 2, 3]], max_new_tokens=6, num_speculative_steps=2)
    plain = fspec.generate(target, None, [[1, 2, 3]], max_new_tokens=6)
    assert out.tokens == plain.tokens  # greedy speculation is exact whatever the head reads
    bad = [
        ({"target_layer_ids": (0, 1)}, "^target_layer_ids: expected three target layer ids in \\[0, 3\\]"),
        ({"target_layer_ids": (0, 1, 4)}, "^target_layer_ids: expected three"),
        ({"intermediate_size": 0}, "^intermediate_size: expected a positive int, got 0"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            ck.init_draft(target, kind="eagle3", **kwargs)
    # A checkpoint, or a config, naming a layer past L (= 3) is refused at load and at generate.
    config["eagle_aux_hidden_state_layer_ids"] = config["fspec_draft"]["target_layer_ids"] = [0, 1, 4]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="target_layer_ids: expected ids in \\[0, 3\\], got \\(0, 1, 4\\)"):
        ck.load_draft(tmp_path, target=target)
    past = dataclasses.replace(draft, cfg=dataclasses.replace(draft.cfg, target_layer_ids=(0, 1, 4)))
    match = "^draft: expected target_layer_ids in \\[0, 3\\].*got \\(0, 1, 4\\)"
    with pytest.raises(ValueError, match=match):
        fspec.generate(target, past, [[1, 2, 3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="^target_layer_ids: expected None for kind='mtp'"):
        ck.init_draft(target, kind="mtp", target_layer_ids=(0, 1, 2))


def test_eagle3_head_tied_to_the_target_lm_head_saves_no_output_layer_and_rebuilds_it(tmp_path):
    """init_draft(tie_lm_head=True): the output layer is the target's lm_head rows of the draft vocabulary
    (the target's own tensor for the whole vocabulary in order), listed in `shared` (frozen in training);
    save_draft writes no lm_head.weight and records the tie; load_draft rebuilds the rows from the target in
    the head's dtype; speculation stays exact."""
    target = tiny_target()
    ids = torch.tensor([0, 2, 3, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 52])
    draft = ck.init_draft(target, kind="eagle3", seed=4, draft_vocab_size=16, draft_ids=ids, tie_lm_head=True)
    assert "lm_head" in draft.shared and "embed" in draft.shared
    assert torch.equal(draft.params["lm_head"], llama.lm_head(target.params)[ids])
    untied = ck.init_draft(target, kind="eagle3", seed=4, draft_vocab_size=16, draft_ids=ids)
    assert "lm_head" not in untied.shared and leaves_equal(
        {k: v for k, v in draft.params.items() if k != "lm_head"},
        {k: v for k, v in untied.params.items() if k != "lm_head"},
    )
    ck.save_draft(draft, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == PUBLISHED_KEYS["eagle3"] - {"lm_head.weight"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["fspec_draft"]["tie_lm_head"] is True
    loaded = ck.load_draft(tmp_path, target=target, fuse=False)
    assert loaded.cfg == draft.cfg and loaded.shared == draft.shared
    assert leaves_equal(loaded.params, draft.params)
    half = ck.load_draft(tmp_path, target=target, dtype=torch.bfloat16)
    assert half.params["lm_head"].dtype == torch.bfloat16
    assert torch.equal(half.params["lm_head"], llama.lm_head(target.params)[ids].to(torch.bfloat16))
    out = fspec.generate(target, loaded, [[1, 2, 3]], max_new_tokens=6, num_speculative_steps=2)
    assert out.tokens == fspec.generate(target, None, [[1, 2, 3]], max_new_tokens=6).tokens
    whole = ck.init_draft(target, kind="eagle3", tie_lm_head=True)  # Vd = V, ids 0..V-1: no copy at all
    assert whole.params["lm_head"] is llama.lm_head(target.params)
    ck.save_draft(untied, tmp_path / "untied")
    assert "tie_lm_head" not in json.loads((tmp_path / "untied" / "config.json").read_text())["fspec_draft"]


def test_tie_lm_head_names_the_argument_where_a_head_cannot_tie(tmp_path):
    """A kind that drafts through the target's lm_head already, a non-bool, a head narrower than its target,
    and checkpoints whose record contradicts their tensors: ValueError naming tie_lm_head."""
    target = tiny_target()
    with pytest.raises(ValueError, match="^tie_lm_head: expected False for kind='eagle'"):
        ck.init_draft(target, kind="eagle", tie_lm_head=True)
    with pytest.raises(ValueError, match="^tie_lm_head: expected True or False, got 1"):
        ck.init_draft(target, kind="eagle3", tie_lm_head=1)
    draft = ck.init_draft(target, kind="eagle3", draft_vocab_size=20, tie_lm_head=True)
    narrow = dataclasses.replace(
        draft.cfg, model=dataclasses.replace(draft.cfg.model, hidden_size=8), target_hidden_size=16
    )
    from fspec.models.heads import eagle3

    with pytest.raises(
        ValueError, match=r"^tie_lm_head: expected a head as wide as its target \(H = Ht = 16\)"
    ):
        eagle3.tied_lm_head(narrow, draft.params, target.params)
    ck.save_draft(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "fspec_draft": {**config["fspec_draft"], "tie_lm_head": "yes"}})
    )
    with pytest.raises(ValueError, match="fspec_draft.tie_lm_head: expected true or false, got 'yes'"):
        ck.load_draft(tmp_path, target=target)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "lm_head.weight": torch.zeros(20, 16)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'lm_head.weight': expected no such key"):
        ck.load_draft(tmp_path, target=target)
