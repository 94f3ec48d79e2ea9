"""The command line runs and prints what it claims."""

from __future__ import annotations

import json

import fspec
import fspec.train.prompts
from fspec.cli import main

from engine_setup import aligned_pair


def test_demo_answers_a_held_out_chat_prompt_with_the_real_model_losslessly(capsys):
    """`fspec demo`: SmolLM2-135M-Instruct and its shipped EAGLE-3 head answer a held-out chat prompt through
    the chat template; greedy speculative tokens equal target-only greedy tokens, the head gets more than one
    token per target forward, and the last line is JSON with the acceptance length and both speeds."""
    assert main(["demo", "--max-new-tokens", "24"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["demo"] == "smollm2-135m-instruct" and len(record["tokens"]) <= 24
    assert record["prompt"] == fspec.train.prompts.heldout("chat")[0] and record["threads"] == 1
    assert record["same_tokens"] is True
    assert record["acceptance_length"] > 1.1  # an untrained head gets about 1.0
    ratio = record["tokens_per_second"] / record["target_only_tokens_per_second"]
    assert abs(record["speedup"] - ratio) < 1e-9
    target, _ = fspec.load_default()
    chat = fspec.render_chat(target, [{"role": "user", "content": record["prompt"]}])
    ids = target.tokenizer.encode(chat, add_special_tokens=False).ids
    assert fspec.generate(target, None, [ids], max_new_tokens=24).tokens[0] == record["tokens"]


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
