"""The command line runs and prints what it claims."""

from __future__ import annotations

import json

import fspec
from fspec.cli import main

from engine_setup import aligned_pair


def test_demo_prints_metadata_crossing_a_block_boundary(capsys):
    """Request 0 starts 2 before a block boundary: its slot jumps to block 7 at step 2; padding stays -1."""
    assert main(["demo", "-k", "4", "--block-size", "4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    steps = record["steps"]
    assert [s["positions"][0] for s in steps] == [2, 3, 4, 5]
    assert [s["slot_mapping"][0] for s in steps] == [3 * 4 + 2, 3 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1]
    assert all(s["positions"][2] == -1 and s["slot_mapping"][2] == -1 for s in steps)


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
