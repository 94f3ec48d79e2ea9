"""The command line runs and prints what it claims."""

from __future__ import annotations

import json

from fspec.cli import main


def test_demo_prints_metadata_crossing_a_block_boundary(capsys):
    """Request 0 starts 2 before a block boundary: its slot jumps to block 7 at step 2; padding stays -1."""
    assert main(["demo", "-k", "4", "--block-size", "4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    steps = record["steps"]
    assert [s["positions"][0] for s in steps] == [2, 3, 4, 5]
    assert [s["slot_mapping"][0] for s in steps] == [3 * 4 + 2, 3 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1]
    assert all(s["positions"][2] == -1 and s["slot_mapping"][2] == -1 for s in steps)
