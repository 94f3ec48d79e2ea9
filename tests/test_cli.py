"""The command line runs and prints what it claims."""

from __future__ import annotations

import json

import fspec
from fspec.cli import main

from engine_setup import aligned_pair


def test_demo_runs_the_embedded_model_losslessly_on_held_out_text(capsys):
    """`fspec demo`: the shipped target and EAGLE-3 head continue a held-out file; greedy speculative tokens
    equal target-only greedy tokens, and the head gets more than one token per target forward."""
    assert main(["demo", "--max-new-tokens", "32", "--prompt-tokens", "48"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["demo"] == "default-model" and len(record["tokens"]) == 32
    assert record["stats"]["acceptance_length"] > 1.25  # an untrained head gets about 1.0
    # the target-only run it compares with: same tokens (greedy), one target forward per token
    only = record["target_only"]
    assert only["same_tokens"] is True and only["stats"]["target_forwards"] == 32
    assert record["stats"]["target_forwards"] < 32
    ratio = record["stats"]["tokens_per_second"] / only["stats"]["tokens_per_second"]
    assert abs(record["speedup"] - ratio) < 1e-9
    target, draft = fspec.load_default()
    from fspec import data

    _, held = data.split_files(data.stdlib_files())
    text = next(data.read_texts(held[:1]))
    ids = target.tokenizer.encode(text).ids[:48]
    assert fspec.generate(target, None, [ids], max_new_tokens=32).tokens[0] == record["tokens"]


def test_generate_command_runs_a_saved_target_and_head(tmp_path, capsys):
    """`fspec generate` on HF directories written by save_target/save_draft: greedy speculative tokens
    equal target-only tokens, and the JSON line carries the stats."""
    target, draft = aligned_pair(k=3)
    fspec.save_target(target, tmp_path / "t")
    fspec.save_draft(draft, tmp_path / "d")
    base = ["generate", "--target", str(tmp_path / "t"), "--tokens", "1 2 3", "--max-new-tokens", "12"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(base + ["--draft", str(tmp_path / "d"), "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"] and len(spec["tokens"]) == 12
    assert spec["stats"]["acceptance_length"] > 1.2 and plain["stats"]["acceptance_length"] == 1.0
