"""Reliability at the loading and training boundary (issue 34): checkpoints, config.json fields, EAGLE-3's
d2t, resuming distillation and DistillConfig each refuse bad input with a ValueError (or FileNotFoundError)
that names the argument or the file, the expected and the actual value. See RELIABILITY.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import fspec
from fspec.models import checkpoint as ck
from fspec.models.heads import head_kind
from fspec.train.distill import STATE_FILE

from draft_setup import tiny_draft, tiny_target

R = dataclasses.replace
NAN, INF = float("nan"), float("inf")

# --- shared set-up ------------------------------------------------------------------------------------------


@functools.cache
def _target() -> fspec.Target:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return R(tiny_target(), tokenizer=tok)


@functools.cache
def _drafts() -> dict[str, fspec.Draft]:
    return {kind: tiny_draft(_target(), kind=kind, k=2) for kind in ("eagle", "eagle3")}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    """A saved toy target (with tokenizer.json) and an EAGLE-1 and EAGLE-3 head, written once."""
    root = tmp_path_factory.mktemp("ckpt")
    fspec.save_target(_target(), root / "target")
    for kind, draft in _drafts().items():
        fspec.save_draft(draft, root / kind)
    return {"target": root / "target", **{k: root / k for k in _drafts()}}


def _copy(dirs: dict, name: str, tmp_path):
    dst = tmp_path / name
    shutil.copytree(dirs[name], dst)
    return dst


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _eagle3_with_d2t(d2t) -> fspec.Draft:
    d3 = _drafts()["eagle3"]
    return R(d3, params={**d3.params, "d2t": d2t})


def _good_d2t() -> torch.Tensor:
    return _drafts()["eagle3"].params["d2t"].detach().clone()


# --- 1. EAGLE-3's d2t: integer [Vd] offsets onto distinct target ids in [0, V) -----------------------------

BAD_D2T = {
    "repeated id": lambda d: d.index_put_((torch.tensor([1]),), d[0] - 1),  # 1 + d[1] == 0 + d[0]
    "offset past vocab": lambda d: d.index_put_((torch.tensor([60]),), torch.tensor(97)),
    "negative target id": lambda d: d.index_put_((torch.tensor([0]),), torch.tensor(-1)),
    "float": lambda d: d.float(),
    "bool": lambda d: d.bool(),
    "wrong length": lambda d: d[:-1],
    "2-D": lambda d: d[None],
}


def test_repeated_id_fixture_really_repeats():
    """The 'repeated id' case maps draft ids 0 and 1 to one target id (what the check must catch)."""
    d = BAD_D2T["repeated id"](_good_d2t())
    assert int(d[0]) == int(d[1]) + 1  # 0 + d[0] == 1 + d[1]


@pytest.mark.parametrize("case", sorted(BAD_D2T))
def test_save_draft_refuses_a_bad_d2t(case, tmp_path):
    """save_draft refuses a d2t that is not an injective integer [Vd] map into [0, V), naming d2t."""
    draft = _eagle3_with_d2t(BAD_D2T[case](_good_d2t()))
    with pytest.raises(ValueError, match=r"^draft\.params\.d2t: expected"):
        fspec.save_draft(draft, tmp_path / "h")


@pytest.mark.parametrize("case", sorted(BAD_D2T))
def test_load_draft_refuses_a_bad_d2t_in_the_file(case, dirs, tmp_path):
    """load_draft checks the file's d2t before any cast (a float d2t would otherwise become int64)."""
    from safetensors.torch import load_file, save_file

    path = _copy(dirs, "eagle3", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["d2t"] = BAD_D2T[case](tensors["d2t"].clone()).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r": d2t: expected") as err:
        fspec.load_draft(path, target=_target())
    assert str(path) in str(err.value)


def test_check_d2t_accepts_the_heads_own_map_and_init_draft_checks_it():
    """A map built by init_draft passes (and init_draft runs the same check on what it built)."""
    from fspec.models.heads.eagle3 import check_d2t

    check_d2t(_good_d2t(), draft_vocab_size=61, vocab_size=97)
    with pytest.raises(ValueError, match="^d2t: expected distinct target ids"):
        check_d2t(BAD_D2T["repeated id"](_good_d2t()), draft_vocab_size=61, vocab_size=97)


# --- 2. corrupt files: ValueError naming the file ----------------------------------------------------------


def _truncate(file, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


CORRUPTIONS = {
    "model.safetensors truncated": ("model.safetensors", lambda f: _truncate(f, 0.5)),
    "model.safetensors header cut": ("model.safetensors", lambda f: _truncate(f, 0.001)),
    "model.safetensors empty": ("model.safetensors", lambda f: f.write_bytes(b"")),
    "config.json invalid": ("config.json", lambda f: f.write_text('{"vocab_size": 97,')),
    "config.json not an object": ("config.json", lambda f: f.write_text("[1, 2]")),
    "config.json not utf-8": ("config.json", lambda f: f.write_bytes(b"\xff\xfe{")),
}
TARGET_ONLY = {
    "tokenizer.json invalid": ("tokenizer.json", lambda f: _truncate(f, 0.5)),
    "tokenizer.json wrong object": ("tokenizer.json", lambda f: f.write_text('{"model": 3}')),
}


@pytest.mark.parametrize("case", sorted({**CORRUPTIONS, **TARGET_ONLY}))
def test_load_target_names_a_corrupt_file(case, dirs, tmp_path):
    """A truncated, empty or invalid file of a target directory is a ValueError naming that file."""
    name, corrupt = {**CORRUPTIONS, **TARGET_ONLY}[case]
    path = _copy(dirs, "target", tmp_path)
    corrupt(path / name)
    with pytest.raises(ValueError) as err:
        fspec.load_target(path)
    assert str(path / name) in str(err.value) and "expected" in str(err.value)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_load_draft_names_a_corrupt_file(case, kind, dirs, tmp_path):
    """The same corruptions of a head directory."""
    name, corrupt = CORRUPTIONS[case]
    path = _copy(dirs, kind, tmp_path)
    corrupt(path / name)
    with pytest.raises(ValueError) as err:
        fspec.load_draft(path, target=_target())
    assert str(path / name) in str(err.value)


@pytest.mark.parametrize("keep", [0.0, 0.3, 0.9])
def test_load_draft_names_a_corrupt_pytorch_model_bin(keep, dirs, tmp_path):
    """Published EAGLE heads ship pytorch_model.bin: a truncated or empty one is named."""
    from safetensors.torch import load_file

    path = _copy(dirs, "eagle", tmp_path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    fspec.load_draft(path, target=_target())  # the intact .bin loads
    _truncate(path / "pytorch_model.bin", keep)
    with pytest.raises(ValueError, match="pytorch_model.bin: expected"):
        fspec.load_draft(path, target=_target())


# --- 3. DistillConfig: real bools, real ints, finite floats in range ----------------------------------------

BAD_DISTILL = [
    ("eps", NAN),
    ("eps", -1.0),
    ("eps", 0.0),
    ("max_grad_norm", NAN),
    ("weight_decay", INF),
    ("lr", "1e-3"),
    ("min_lr_ratio", NAN),
    ("betas", (1.5, 0.9)),
    ("betas", (0.9,)),
    ("betas", [0.9, 0.95]),
    ("betas", (0.9, NAN)),
    ("seed", 1.5),
    ("seed", True),
    ("seed", -1),
    ("seed", 2**40),
    ("autocast", "yes"),
    ("autocast", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD_DISTILL)
def test_distill_config_refuses_a_bad_field(field, value):
    """DistillConfig names the field: no NaN or negative eps, no (1.5, 0.9) betas, no float seed, no 'yes'."""
    with pytest.raises(ValueError, match=rf"^DistillConfig\.{field}: expected"):
        fspec.DistillConfig(**{field: value})


# --- 4. distill_head(resume=...): the state must fit the head, checked before training ----------------------


def _distill_cfg(**changes) -> fspec.DistillConfig:
    return fspec.DistillConfig(ttt_steps=2, steps=2, batch_size=1, seq_len=8, log_every=1, **changes)


def _batch_for(draft: fspec.Draft) -> dict:
    gen = torch.Generator().manual_seed(0)
    cfg = draft.cfg
    width = head_kind(cfg).input_hidden_size(cfg)
    return {
        "input_ids": torch.randint(0, 97, (1, 8), generator=gen),
        "hidden": torch.randn(1, 8, width, generator=gen),
        "target_logits": torch.randn(1, 8, cfg.draft_vocab_size, generator=gen),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """One distilled step of each head kind, checkpointed (train_state.pt beside the head)."""
    root = tmp_path_factory.mktemp("distill")
    for kind, draft in _drafts().items():
        batch = _batch_for(draft)
        cfg = _distill_cfg()
        fspec.distill_head(draft, lambda s, b=batch: b, cfg=cfg, out=root / kind, until=1, progress=False)
    return {kind: root / kind for kind in _drafts()}


def _edit_state(path, edit) -> None:
    state = torch.load(path / STATE_FILE, weights_only=True)
    edit(state)
    torch.save(state, path / STATE_FILE)


BAD_STATES = {
    "truncated": (lambda p: _truncate(p / STATE_FILE, 0.5), "unreadable"),
    "empty": (lambda p: (p / STATE_FILE).write_bytes(b""), "unreadable"),
    "not a dict": (lambda p: torch.save([1, 2], p / STATE_FILE), "to hold a dict"),
    "no trainable": (lambda p: _edit_state(p, lambda s: s.pop("trainable")), r"missing \['trainable'\]"),
    "no opt": (lambda p: _edit_state(p, lambda s: s.pop("opt")), r"missing \['opt'\]"),
    "step -4": (lambda p: _edit_state(p, lambda s: s.update(step=-4)), "'step' an int in"),
    "step past total": (lambda p: _edit_state(p, lambda s: s.update(step=3)), "'step' an int in"),
    "step float": (lambda p: _edit_state(p, lambda s: s.update(step=1.0)), "'step' an int in"),
    "fc wrong shape": (
        lambda p: _edit_state(p, lambda s: s["trainable"].update(fc=s["trainable"]["fc"][:, :-1])),
        r"trainable\['fc'\]: expected a float tensor of shape",
    ),
    "moment wrong shape": (
        lambda p: _edit_state(p, lambda s: s["opt"]["m"].update(fc=s["opt"]["m"]["fc"][:1])),
        r"m\['fc'\]: expected a float tensor of shape",
    ),
    "count negative": (lambda p: _edit_state(p, lambda s: s["opt"].update(count=-1)), "count"),
}


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_resume_refuses_a_bad_train_state_before_training(case, trained, tmp_path):
    """A truncated, empty or ill-fitting train_state.pt is a ValueError naming resume, before any step."""
    edit, match = BAD_STATES[case]
    path = tmp_path / "ck"
    shutil.copytree(trained["eagle"], path)
    edit(path)
    draft = _drafts()["eagle"]
    batch, steps = _batch_for(draft), []
    with pytest.raises(ValueError, match=rf"^resume: .*{match}"):
        fspec.distill_head(
            draft, lambda s: steps.append(s) or batch, cfg=_distill_cfg(), resume=path, progress=False
        )
    assert steps == [], "validation must happen before the first batch is drawn"


def test_resume_refuses_an_eagle3_state_for_an_eagle1_head(trained):
    """An EAGLE-3 train_state.pt cannot resume an EAGLE-1 head (other weight names and shapes)."""
    draft = _drafts()["eagle"]
    batch = _batch_for(draft)
    with pytest.raises(ValueError, match=r"^resume: .*trainable.*expected keys"):
        fspec.distill_head(
            draft, lambda s: batch, cfg=_distill_cfg(), resume=trained["eagle3"], progress=False
        )


def test_resume_of_a_good_state_still_runs(trained):
    """The intact checkpoint resumes (the checks refuse nothing valid)."""
    draft = _drafts()["eagle"]
    batch = _batch_for(draft)
    _, history = fspec.distill_head(
        draft, lambda s: batch, cfg=_distill_cfg(), resume=trained["eagle"], progress=False
    )
    assert [r["step"] for r in history] == [2]


# --- 5. config.json field types, and load_target / load_draft / init_draft arguments ------------------------

BAD_CONFIG_FIELDS = [
    ("rope_parameters", [1, 2], "rope_parameters"),
    ("rope_scaling", "llama3", "rope_scaling"),
    ("rope_theta", "1e4", "rope_theta"),
    ("rms_norm_eps", None, "rms_norm_eps"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps"),
    ("eos_token_id", [1, None], "eos_token_id"),
    ("eos_token_id", 1.7, "eos_token_id"),
    ("eos_token_id", True, "eos_token_id"),
    ("bos_token_id", 1.5, "bos_token_id"),
    ("num_attention_heads", 0, "num_attention_heads"),
    ("num_attention_heads", None, "num_attention_heads"),
    ("hidden_size", "32", "hidden_size"),
    ("num_key_value_heads", 0, "num_key_value_heads"),
    ("head_dim", 8.0, "head_dim"),
    ("max_position_embeddings", -1, "max_position_embeddings"),
    ("tie_word_embeddings", "no", "tie_word_embeddings"),
    ("attention_bias", "false", "attention_bias"),
    ("torch_dtype", 16, "torch_dtype"),
    # fields fspec does not implement: refused, never silently ignored
    ("hidden_act", "gelu", "hidden_act"),
    ("mlp_bias", True, "mlp_bias"),
]


@pytest.mark.parametrize(("field", "value", "named"), BAD_CONFIG_FIELDS)
def test_load_target_refuses_a_bad_config_field(field, value, named, dirs, tmp_path):
    """A config.json field of the wrong type or an unsupported value is refused, naming the field."""
    path = _copy(dirs, "target", tmp_path)
    _edit_config(path, **{field: value})
    with pytest.raises(ValueError, match=rf"config\.{named}(\.\w+)?: expected"):
        fspec.load_target(path)


def test_tie_word_embeddings_false_and_int_eos_still_load(dirs, tmp_path):
    """The checks accept what HF writes: false flags, an int or a list of ints as eos, a null head_dim."""
    path = _copy(dirs, "target", tmp_path)
    _edit_config(path, tie_word_embeddings=False, eos_token_id=[1, 2], head_dim=None, hidden_act="silu")
    target = fspec.load_target(path)
    assert target.cfg.eos_token_ids == (1, 2) and target.cfg.tie_word_embeddings is False


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("fspec_draft", [1], r"config\.fspec_draft: expected"),
        ("bias", "no", r"config\.bias: expected"),
        ("hidden_act", "relu", r"config\.hidden_act: expected"),
    ],
)
def test_load_draft_refuses_a_bad_config_field(field, value, match, dirs, tmp_path):
    """Head config.json fields are checked like the target's (EAGLE-1's "bias": "no" is not True)."""
    path = _copy(dirs, "eagle", tmp_path)
    _edit_config(path, **{field: value})
    with pytest.raises(ValueError, match=match):
        fspec.load_draft(path, target=_target())


def test_load_draft_refuses_a_non_bool_greedy_drafts(dirs, tmp_path):
    """A recorded greedy_drafts "no" is not stored truthy."""
    path = _copy(dirs, "eagle3", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["fspec_draft"]["greedy_drafts"] = "no"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"DraftConfig\.greedy_drafts: expected True or False"):
        fspec.load_draft(path, target=_target())


BAD_LOAD_ARGS = [
    ("path", lambda d: fspec.load_target(None)),
    ("path", lambda d: fspec.load_target(3)),
    ("dtype", lambda d: fspec.load_target(d["target"], dtype="float16")),
    ("dtype", lambda d: fspec.load_target(d["target"], dtype=torch.int8)),
    (
        "device",
        lambda d: fspec.load_target(d["target"], device="cuda:7" if torch.cuda.is_available() else "cuda"),
    ),
    ("device", lambda d: fspec.load_target(d["target"], device="gpu")),
    ("device", lambda d: fspec.load_target(d["target"], device=0.5)),
    ("target", lambda d: fspec.load_draft(d["eagle"], target=None)),
    ("dtype", lambda d: fspec.load_draft(d["eagle"], target=_target(), dtype=torch.int64)),
    ("path", lambda d: fspec.load_draft(None, target=_target())),
    ("target", lambda d: fspec.init_draft(None, kind="eagle")),
    ("DraftConfig.max_model_len", lambda d: fspec.init_draft(_target(), kind="eagle", max_model_len=0)),
    ("DraftConfig.greedy_drafts", lambda d: fspec.init_draft(_target(), kind="eagle", greedy_drafts="no")),
    ("steps", lambda d: fspec.decode_rollout(_decode_meta(), 2**62, block_size=4, max_model_len=32)),
    ("steps", lambda d: fspec.decode_rollout(_decode_meta(), 33, block_size=4, max_model_len=32)),
    ("block_size", lambda d: fspec.decode_rollout(_decode_meta(), 2, block_size=2**70, max_model_len=32)),
    ("block_size", lambda d: fspec.decode_metadata(torch.tensor([1]), _table(), block_size=2**70)),
    ("max_model_len", lambda d: fspec.decode_after(_decode_meta(), block_size=4, max_model_len=2**70)),
]


def _table() -> torch.Tensor:
    return torch.arange(8, dtype=torch.int32).view(1, 8)


def _decode_meta() -> fspec.AttnMetadata:
    return fspec.decode_metadata(torch.tensor([3]), _table(), block_size=4)


@pytest.mark.parametrize(
    ("name", "call"), BAD_LOAD_ARGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_LOAD_ARGS)]
)
def test_loading_and_metadata_arguments_are_refused_by_name(name, call, dirs):
    """Bad arguments are a ValueError naming the argument (never TypeError, AssertionError or a hang)."""
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        call(dirs)


def test_decode_rollout_of_max_model_len_steps_still_runs():
    """The bound allows every step max_model_len permits."""
    assert len(fspec.decode_rollout(_decode_meta(), 32, block_size=4, max_model_len=32)) == 32


def test_load_target_accepts_the_float_dtypes(dirs):
    """The three float dtypes are accepted (the refusal lists them)."""
    for dtype in ck.LOAD_DTYPES:
        assert fspec.load_target(dirs["target"], dtype=dtype).params["norm"].dtype == dtype


# --- 6. generate's sampling options and prompts; the training data sources ---------------------------------


def _gen(**kwargs):
    args = {"prompts": [[1, 2, 3], [4, 5]], "max_new_tokens": 3, **kwargs}
    return fspec.generate(_target(), None, args.pop("prompts"), **args).tokens


def test_generate_takes_0d_and_1d_tensors_as_numbers():
    """temperature=tensor(0.5), seed=tensor(5) are one number for every request, as HF takes them; a [B]
    tensor is one value per request."""
    assert _gen(temperature=torch.tensor(0.5), seed=torch.tensor(5)) == _gen(temperature=0.5, seed=5)
    assert _gen(temperature=torch.tensor([0.5, 0.7]), seed=torch.tensor([5, 6])) == _gen(
        temperature=[0.5, 0.7], seed=[5, 6]
    )


BAD_GENERATE = [
    ("temperature[0]", {"temperature": 1e39}),
    ("temperature[1]", {"temperature": [0.5, 1e5]}),
    ("temperature", {"temperature": torch.ones(2, 1)}),
    ("temperature", {"temperature": torch.tensor([0.5, 0.5, 0.5])}),
    ("seed[0]", {"seed": torch.tensor(1.5)}),
    ("seed", {"seed": torch.zeros(1, 2, dtype=torch.int64)}),
    ("prompts[0]", {"prompts": ["\ud800"]}),
    ("prompts[1]", {"prompts": ["w1 w2", "w3 \udfff"]}),
]


@pytest.mark.parametrize(
    ("name", "kwargs"), BAD_GENERATE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_GENERATE)]
)
def test_generate_refuses_absurd_options_and_invalid_strings(name, kwargs):
    """temperature above MAX_TEMPERATURE (1e4), tensors of the wrong rank or length, float seeds and strings
    with lone surrogates are ValueErrors naming the argument."""
    with pytest.raises(ValueError, match="^" + re.escape(name) + ": expected"):
        _gen(**kwargs)


def test_training_data_sources_refuse_bad_tokens_and_lengths(tmp_path):
    """precompute(seq_len=0) and online_batches over a list are ValueErrors naming the argument."""
    from fspec.train import distill as D

    tokens = torch.randint(0, 97, (64,))
    with pytest.raises(ValueError, match="^seq_len: expected a positive int, got 0"):
        D.precompute(_target(), tokens, tmp_path / "p", num_sequences=2, seq_len=0)
    with pytest.raises(ValueError, match="^tokens: expected a 1-D integer tensor"):
        D.precompute(_target(), tokens.tolist(), tmp_path / "p", num_sequences=2, seq_len=8)
    for bad in (tokens.tolist(), tokens.float(), tokens[None], tokens[:8]):
        with pytest.raises(ValueError, match="^tokens: expected a 1-D integer tensor"):
            D.online_batches(_target(), _drafts()["eagle"], bad, cfg=_distill_cfg())
