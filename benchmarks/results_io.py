"""The header every benchmark result carries (machine, device, versions, date, command, the environment
variables of fspec and Inductor), how a result is written, and the copy bandwidth its floors divide by, for
the scripts that share them."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import triton

from fspec.core.config import env_switches


def copy_bandwidth_tbps(device: str | torch.device = "cuda", *, reps: int = 20) -> float:
    """TB/s of a 1 GiB device-to-device copy: (bytes read + bytes written) / the median of `reps` copies timed
    with CUDA events, after three warm-up copies."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times.sort()
    return 2 * src.numel() * src.element_size() / times[len(times) // 2] / 1e12


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
