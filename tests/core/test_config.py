"""Static configs: HF parsing in both RoPE spellings, hashing, validation that names the field."""

from __future__ import annotations

import re

import pytest

import fspec

LLAMA3_OLD = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}


def _new_style(old: dict) -> dict:
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new["rope_parameters"] = dict(old["rope_scaling"], rope_theta=old["rope_theta"])
    new["dtype"] = old["torch_dtype"]
    return new


def test_from_hf_reads_both_rope_spellings_identically():
    """rope_theta + rope_scaling (transformers 4) and rope_parameters (transformers 5) give one config."""
    old = fspec.ModelConfig.from_hf(LLAMA3_OLD)
    new = fspec.ModelConfig.from_hf(_new_style(LLAMA3_OLD))
    assert old == new and hash(old) == hash(new)
    assert old.rope_type == "llama3" and old.rope_theta == 500000.0 and old.rope_factor == 8.0
    assert old.head_dim == 128 and old.num_queries_per_kv == 4
    assert old.eos_token_ids == (128001, 128008, 128009) and old.torch_dtype == "bfloat16"


def test_from_hf_defaults_and_qwen_flags():
    """Missing optional keys take HF's defaults; qwen2 has attention bias, qwen3 has q/k norm."""
    base = {k: LLAMA3_OLD[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    base["num_attention_heads"] = 32
    cfg = fspec.ModelConfig.from_hf(base)
    assert cfg.num_key_value_heads == 32 and cfg.rope_type == "default" and cfg.rope_theta == 10000.0
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.eos_token_ids == ()
    assert fspec.ModelConfig.from_hf(dict(base, model_type="qwen2")).attention_bias
    q3 = fspec.ModelConfig.from_hf(dict(base, model_type="qwen3", head_dim=64))
    assert q3.qk_norm and q3.head_dim == 64


def test_to_hf_round_trips():
    """from_hf(to_hf(cfg)) == cfg."""
    cfg = fspec.ModelConfig.from_hf(LLAMA3_OLD)
    assert fspec.ModelConfig.from_hf(cfg.to_hf()) == cfg
    plain = fspec.ModelConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        tie_word_embeddings=True,
    )
    assert fspec.ModelConfig.from_hf(plain.to_hf()) == plain


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"rope_type": "yarn"}, "rope_type"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"eos_token_ids": (200,)}, "eos_token_ids"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"vocab_size": True}, "vocab_size"),
    ],
)
def test_model_config_rejects_bad_fields_by_name(tiny_model_cfg, change, field):
    """Each bad field raises ValueError naming it."""
    import dataclasses

    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        dataclasses.replace(tiny_model_cfg, **change)


def test_from_hf_rejects_unsupported_architectures_and_missing_keys():
    """A non-Llama model_type or a missing key is named."""
    with pytest.raises(ValueError, match="model_type.*gpt2"):
        fspec.ModelConfig.from_hf(dict(LLAMA3_OLD, model_type="gpt2"))
    with pytest.raises(ValueError, match="config.hidden_size"):
        fspec.ModelConfig.from_hf({k: v for k, v in LLAMA3_OLD.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="rope_type"):
        fspec.ModelConfig.from_hf(dict(LLAMA3_OLD, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kind": ""}, "kind"),
        ({"kind": None}, "kind"),
        ({"num_speculative_steps": 0}, "num_speculative_steps"),
        ({"num_speculative_steps": 17}, "num_speculative_steps"),
        ({"block_size": -4}, "block_size"),
        ({"draft_vocab_size": 200}, "draft_vocab_size"),
    ],
)
def test_draft_config_rejects_bad_fields_by_name(tiny_draft_cfg, change, field):
    """DraftConfig validation names the field. (The rules of a head kind, an unknown kind, target_layer_ids
    and a reduced draft_vocab_size, are checked where the config meets a head: tests/models/
    test_head_registry.py.)"""
    import dataclasses

    with pytest.raises(ValueError, match=f"DraftConfig.{field}"):
        dataclasses.replace(tiny_draft_cfg, **change)


def test_draft_config_resolves_defaults_and_is_hashable(tiny_model_cfg):
    """0 means the model's value; eagle3 takes a reduced vocabulary and three layers; configs hash."""
    cfg = fspec.DraftConfig(
        kind="eagle3", model=tiny_model_cfg, draft_vocab_size=50, target_layer_ids=(0, 1, 1)
    )
    assert cfg.target_hidden_size == 32 and cfg.draft_vocab_size == 50
    assert cfg.max_blocks_per_request == 4096 // 16
    same = fspec.DraftConfig(
        kind="eagle3", model=tiny_model_cfg, draft_vocab_size=50, target_layer_ids=(0, 1, 1)
    )
    assert {cfg: 1}[same] == 1


def test_bucket_for_pads_to_the_next_bucket():
    """Batch sizes round up to 1, 2, 4, ..., 256; outside that range is an error."""
    assert [fspec.bucket_for(n) for n in (1, 2, 3, 5, 9, 200, 256)] == [1, 2, 4, 8, 16, 256, 256]
    for bad in (0, 257, 2.0):
        with pytest.raises(ValueError, match="batch_size"):
            fspec.bucket_for(bad)


def test_env_switches_are_exactly_the_fspec_and_inductor_variables_sorted(monkeypatch):
    """What benchmarks record beside their results: every FSPEC_* and TORCHINDUCTOR_* variable, nothing
    else, in name order."""
    from fspec.core.config import env_switches

    for k in [k for k in __import__("os").environ if k.startswith(("FSPEC_", "TORCHINDUCTOR_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("FSPEC_PIPELINE", "0")
    monkeypatch.setenv("FSPEC_COMPILE_PREFILL", "1")
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "1")
    monkeypatch.setenv("NOT_FSPEC_X", "1")
    monkeypatch.setenv("TORCH_LOGS", "graph")
    want = {"FSPEC_COMPILE_PREFILL": "1", "FSPEC_PIPELINE": "0", "TORCHINDUCTOR_ENABLE_PDL": "1"}
    assert env_switches() == want and list(env_switches()) == list(want)


def test_every_environment_switch_the_code_reads_is_documented():
    """Each FSPEC_* variable named in fspec's code, kernels or benchmarks appears in DEVELOPERS.md."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pattern = r"FSPEC_[A-Z][A-Z_]*[A-Z]"
    assert re.findall(pattern, 'os.environ.get("FSPEC_SOME_SWITCH")') == ["FSPEC_SOME_SWITCH"]
    sources = [p for d in ("fspec", "kernels", "benchmarks") for p in (root / d).rglob("*.py")]
    assert any(p.name == "paged_attention.py" for p in sources)  # the scan reads the kernels
    names = {n for p in sources for n in re.findall(pattern, p.read_text())}
    documented = (root / "DEVELOPERS.md").read_text()
    assert sorted(n for n in names if n not in documented) == []


def test_no_environment_variable_selects_a_kernel_or_layer_path():
    """The switches whose experiments ended (docs/experiments.md) are gone from the code: the defaults that
    won are the only path, and tuning constants are module constants or launcher arguments."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    gone = (
        "FSPEC_SKINNY_LINEAR", "FSPEC_FUSED_LAYER", "FSPEC_ROPE_ATTENTION", "FSPEC_ATTN_EARLY_KV",
        "FSPEC_ATTN_EARLY_RELEASE", "FSPEC_QKV_ROPE", "FSPEC_L2_PREFETCH", "FSPEC_ATTN_FUSED_REDUCE",
        "FSPEC_ATTN_MIN_PARTITION", "FSPEC_SAMPLING_BLOCK", "FSPEC_PDL",
    )  # fmt: skip
    sources = [p for d in ("fspec", "kernels", "benchmarks") for p in (root / d).rglob("*.py")]
    sources += [root / "benchmarks" / "gpu_run.sh"]
    found = {
        (p.relative_to(root).as_posix(), name)
        for p in sources
        for name in gone
        if re.search(rf"\b{name}\b", p.read_text())
    }
    assert sorted(found) == []
    assert "os.environ" not in (root / "fspec" / "models" / "layers.py").read_text()
    assert "os.environ" not in (root / "fspec" / "ops" / "attention.py").read_text()
    kernels = [p for p in (root / "kernels").glob("*.py") if p.name != "dispatch.py"]  # TRITON_INTERPRET
    assert [p.name for p in kernels if "os.environ" in p.read_text()] == []
