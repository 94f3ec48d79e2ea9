"""The header every benchmark result carries (machine, device, versions, date, command, FSPEC_* switches) and
how a result is written, for the scripts that share them."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import triton

from fspec.config import env_switches


def header(script: str, argv: list[str] | None, device: str) -> dict:
    """Metadata of a run of benchmarks/`script` with arguments `argv` (None: sys.argv) on `device` (words)."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "machine": platform.processor() or platform.machine(),
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", f"benchmarks/{script}", *args]),
        "env": env_switches(),
    }


def write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
