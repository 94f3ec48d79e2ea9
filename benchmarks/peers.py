"""Peers' kernels for the benchmarks, run from their own released files (never copied into this repository).

vLLM's Gumbel sampler (`vllm/v1/worker/gpu/sample/gumbel.py` of the vLLM wheel, Model Runner V2) is one
Triton launch plus an argmax and a gather over the blocks' winners. The file imports nothing of vLLM but
`vllm.triton_utils` (which re-exports `triton` and `triton.language` as `tl`), so it runs without installing
vLLM: `benchmarks/gpu_prepare.sh` extracts it from the wheel into `.peers/vllm/<version>/gumbel.py`, and
`vllm_gumbel` imports it with a stand-in `vllm.triton_utils` module that gives it the same two names.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_GUMBEL = ROOT / ".peers" / "vllm" / "0.20.0" / "gumbel.py"
_STANDIN = "vllm.triton_utils"


def vllm_gumbel(path: Path | str | None = None) -> types.ModuleType | None:
    """vLLM's gumbel.py as a module (its `gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos,
    apply_temperature, processed_logits_out=None)`), or None when the file is absent (not prepared). The
    stand-in `vllm` and `vllm.triton_utils` modules are added to sys.modules only while the file imports,
    and only where no real vLLM is importable."""
    path = Path(path) if path is not None else VLLM_GUMBEL
    if not path.is_file():
        return None
    import triton
    import triton.language as tl

    added = []
    if importlib.util.find_spec("vllm") is None:
        for name in ("vllm", _STANDIN):
            if name not in sys.modules:
                sys.modules[name] = types.ModuleType(name)
                added.append(name)
        sys.modules[_STANDIN].tl, sys.modules[_STANDIN].triton = tl, triton
    try:
        spec = importlib.util.spec_from_file_location("vllm_gumbel_peer", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name in added:
            del sys.modules[name]
    return module


def vllm_gumbel_call(module: types.ModuleType, logits, temperature, seed, pos):
    """A zero-argument callable: one eager call of vLLM's `gumbel_sample` as its sampler makes it, with the
    temperature applied and the processed logits written (`processed_logits_out`, what speculative
    verification reads), request i in row i."""
    import torch

    b = logits.shape[0]
    mapping = torch.arange(b, dtype=torch.int32, device=logits.device)
    processed = torch.empty_like(logits, dtype=torch.float32)

    def call():
        return module.gumbel_sample(
            logits, mapping, temperature, seed, pos, True, processed_logits_out=processed
        )

    return call
