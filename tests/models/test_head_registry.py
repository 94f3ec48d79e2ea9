"""The head-kind registry: a kind defined outside fspec runs everywhere a built-in kind does, unknown kinds
and per-kind config rules fail by name where a DraftConfig meets a head, and nothing outside
fspec/models/heads/ branches on a kind's name."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fspec
from fspec.models import checkpoint as ck
from fspec.models import layers as L
from fspec.models import llama
from fspec.models.heads import HeadKind, base, head_kind, lookup, names, register

from draft_setup import naive_propose, scenario, tiny_draft, tiny_target

ROOT = Path(__file__).resolve().parents[2]
TOY = "toy-test-only"  # a name no fspec module registers

# --- a fourth head kind, defined here and nowhere in fspec --------------------------------------------------
#
# x = embed(ids) + mix(hidden), one Llama layer, a final norm, the target's lm_head. Its params: {"embed":
# [V, H] (target's), "mix": [H, H], "layer": {...}, "final_norm": [H], "lm_head": [V, H] (target's)}.


def toy_init(cfg, target_params: dict, *, seed: int, device=None) -> dict:
    embed = target_params["embed"]
    kw = {"dtype": embed.dtype, "device": embed.device if device is None else device}
    gen = torch.Generator().manual_seed(seed)
    h = cfg.model.hidden_size
    return {
        "embed": embed,
        "mix": L.normal(gen, h, h, std=0.3, **kw),
        "layer": L.init_layer(gen, cfg.model, attn_in=h, **kw),
        "final_norm": L.ones(h, **kw),
        "lm_head": llama.lm_head(target_params),
    }


def toy_project(params: dict, target_hidden, *, cfg) -> torch.Tensor:
    return target_hidden.last


def toy_hidden(params: dict, input_ids, hidden, positions, attend, *, cfg, rows=None) -> torch.Tensor:
    m, p = cfg.model, params["layer"]
    emb = F.embedding(input_ids, params["embed"])
    x = emb + L.linear(hidden.to(emb.dtype), params["mix"])
    cos, sin = L.rope_cos_sin(positions, cfg=m, dtype=x.dtype)
    attn_in = L.rms_norm(x, p["input_norm"], m.rms_norm_eps)
    return L.decoder_layer(p, attn_in, x, cos, sin, attend, cfg=m, layer=0, rows=rows)


def toy_pre_logits(params: dict, out: torch.Tensor, *, cfg) -> torch.Tensor:
    return L.rms_norm(out, params["final_norm"], cfg.model.rms_norm_eps)


def toy_logits(params: dict, out: torch.Tensor, *, cfg) -> torch.Tensor:
    return L.linear(toy_pre_logits(params, out, cfg=cfg), params["lm_head"])


@pytest.fixture
def toy_kind():
    kind = register(
        HeadKind(
            name=TOY,
            init=toy_init,
            project_target_hidden=toy_project,
            hidden=toy_hidden,
            pre_logits=toy_pre_logits,
            logits=toy_logits,
            param_keys=("embed", "mix", "layer", "final_norm", "lm_head"),
            checkpoint_keys={
                "embed": "embed_tokens.weight",
                "mix": "mix.weight",
                "final_norm": "norm.weight",
                "lm_head": "lm_head.weight",
            },
            dtype_key="mix",
            layer_prefix="layer.",
            hf_config=lambda cfg, params: {"architectures": ["ToyHead"]},
        )
    )
    try:
        yield kind
    finally:
        del base._REGISTRY[TOY]  # the test-only name leaves the registry as it was


def test_a_kind_registered_outside_fspec_drafts_saves_loads_and_serves(toy_kind, tmp_path):
    """init_draft -> propose (against the naive reference) -> save_draft / load_draft -> generate, for a kind
    that no fspec file names: the registry is all the rest of fspec reads."""
    assert lookup(TOY) is toy_kind and names()[-1] == TOY
    target = tiny_target()
    draft = tiny_draft(target, kind=TOY, k=3)
    assert draft.cfg.kind == TOY and draft.cfg.target_layer_ids == () and draft.shared == ("embed", "lm_head")
    sc = scenario(draft, context_lens=[3, 6, 9], live=[1, 4, 2], temperature=[0.0, 1.0, 0.7], seed=5)
    state, _ = fspec.propose(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    want_tokens, want_probs = naive_propose(sc)
    assert torch.equal(state.draft_tokens, want_tokens)
    torch.testing.assert_close(state.draft_probs, want_probs, rtol=1e-4, atol=1e-5)
    step, _ = fspec.draft_step(draft.params, sc.state, sc.cache, cfg=draft.cfg)
    assert int(step.step) == 1

    ck.save_draft(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["ToyHead"] and config["fspec_draft"]["kind"] == TOY
    assert config["torch_dtype"] == "float32"
    from safetensors.torch import load_file

    saved = set(load_file(tmp_path / "model.safetensors"))
    assert {"mix.weight", "norm.weight", "layer.self_attn.q_proj.weight"} <= saved
    assert not {"embed_tokens.weight", "lm_head.weight"} & saved  # the target's, not saved
    loaded = ck.load_draft(tmp_path, target=target, fuse=False)
    assert loaded.cfg == draft.cfg and loaded.shared == draft.shared
    for got, want in zip(fspec.tree.tree_leaves(loaded.params), fspec.tree.tree_leaves(draft.params)):
        assert torch.equal(got, want)

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    out = fspec.generate(target, ck.load_draft(tmp_path, target=target), prompts, max_new_tokens=8)
    plain = fspec.generate(target, None, prompts, max_new_tokens=8)
    assert out.tokens == plain.tokens  # greedy speculation is exact whatever the head


def test_lookup_of_an_unknown_kind_names_kind_the_kinds_and_the_value(tiny_draft_cfg):
    """lookup, and every boundary that meets a head, raise ValueError naming `kind`."""
    expected = "^kind: expected one of \\('eagle', 'eagle3', 'mtp'.*\\), got 'medusa'$"
    with pytest.raises(ValueError, match=expected):
        lookup("medusa")
    with pytest.raises(ValueError, match="^kind: expected one of .*got None"):
        lookup(None)
    medusa = dataclasses.replace(tiny_draft_cfg, kind="medusa")  # DraftConfig checks only the type
    with pytest.raises(ValueError, match=expected):
        head_kind(medusa)
    with pytest.raises(ValueError, match=expected):
        fspec.head_init(medusa, tiny_target().params, seed=0)
    with pytest.raises(ValueError, match=expected):
        fspec.init_draft(tiny_target(), kind="medusa")
    with pytest.raises(ValueError, match="^kind: expected a new head kind name, got 'eagle'"):
        register(lookup("eagle"))
    with pytest.raises(ValueError, match="^kind: expected a HeadKind"):
        register("eagle")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"draft_vocab_size": 50}, "draft_vocab_size"),  # only a reduced-vocabulary kind (EAGLE-3)
        ({"kind": "eagle3"}, "target_layer_ids"),  # EAGLE-3 reads three target layers
        ({"kind": "eagle3", "target_layer_ids": (0, -1, 1)}, "target_layer_ids"),
        ({"target_layer_ids": (0, 1, 2)}, "target_layer_ids"),  # EAGLE-1 reads none
        ({"kind": "mtp", "target_layer_ids": (0, 1, 2)}, "target_layer_ids"),
    ],
)
def test_a_kinds_config_rules_are_checked_where_the_config_meets_a_head(tiny_draft_cfg, change, field):
    """The rules DraftConfig's constructor used to check per kind (it cannot import the heads) raise the same
    ValueError, naming the field, from head_kind and from the heads' public entry points."""
    cfg = dataclasses.replace(tiny_draft_cfg, **change)  # constructs: only the kind-free fields are checked
    with pytest.raises(ValueError, match=f"^DraftConfig.{field}: expected"):
        head_kind(cfg)
    ids, hidden = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, cfg.model.hidden_size)
    with pytest.raises(ValueError, match=f"^DraftConfig.{field}: expected"):
        fspec.head_forward_dense({}, ids, hidden, cfg=cfg)
    good = fspec.DraftConfig(
        kind="eagle3", model=tiny_draft_cfg.model, draft_vocab_size=50, target_layer_ids=(0, 1, 1)
    )
    assert head_kind(good) is lookup("eagle3")
    assert head_kind(good).input_hidden_size(good) == 3 * good.target_hidden_size


# --- nothing outside fspec/models/heads/ compares with a kind's name ----------------------------------------


def _name_literals(node: ast.AST, kinds: set[str]) -> list[str]:
    """The head-kind names among the string constants of `node` (a tuple/list/set of them included)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in kinds:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for elt in node.elts for name in _name_literals(elt, kinds)]
    return []


def kind_comparisons(source: str, kinds: set[str], where: str = "<string>") -> list[str]:
    """'where:line: code' of every comparison (==, !=, in, is, in any if / ternary / assert / boolean
    expression) and every `match` case against a head kind's name string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        if any(_name_literals(x, kinds) for x in operands):
            found.append(f"{where}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_code_outside_the_heads_branches_on_a_kind_name():
    """Every kind-dependent choice outside fspec/models/heads/ reads a HeadKind property or hook; kind names
    appear there only as data (a default argument, a CLI default)."""
    kinds = set(names())
    assert kind_comparisons('if cfg.kind == "eagle3":\n    pass', kinds)  # the check sees what it looks for
    assert kind_comparisons('x = 1 if "mtp" != kind else 2', kinds)
    assert kind_comparisons('assert kind not in ("eagle", "x")', kinds)
    assert kind_comparisons('match kind:\n    case "eagle":\n        pass', kinds)
    assert not kind_comparisons('init_draft(target, kind="eagle3")\npath / "eagle3"', kinds)
    heads = ROOT / "fspec" / "models" / "heads"
    found = []
    for path in sorted((ROOT / "fspec").rglob("*.py")):
        if heads in path.parents or "kernels" in path.relative_to(ROOT / "fspec").parts[:1]:
            continue
        found += kind_comparisons(path.read_text(), kinds, str(path.relative_to(ROOT)))
    assert not found, "branches on a head kind's name outside fspec/models/heads/:\n" + "\n".join(found)
