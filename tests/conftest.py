"""Shared fixtures: tiny configs, the GPU marker's skip, and the Triton interpreter switch.

The repository's root leaves sys.path first: `python -m pytest` puts the working directory there, and the
root's top-level `kernels/` folder (installed as `fspec.kernels`) would then shadow the unrelated `kernels`
distribution on PyPI, which transformers (5.25 on) requires and imports. fspec itself is imported from its
installed (editable) package either way.

Triton decides at import time whether `@triton.jit` kernels are interpreted, so on a machine without CUDA the
interpreter is switched on here, before anything imports triton. The ops read the variable again at call time:
tests outside tests/kernels switch it off (autouse fixture below) and run the fast PyTorch references; the
kernel tests keep it on and run the Triton kernels on CPU tensors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` on 2 cores: one thread per worker
    torch.set_num_threads(1)

import pytest  # noqa: E402

import fspec  # noqa: E402


def _interpreted_here(request) -> bool:
    return torch.cuda.is_available() or "tests/kernels" in request.node.nodeid.replace("\\", "/")


@pytest.fixture(autouse=True)
def _reference_ops_outside_kernel_tests(request, monkeypatch):
    if not _interpreted_here(request):
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module", autouse=True)
def _reference_ops_in_module_fixtures(request):
    """The same for a module's fixtures, which pytest sets up before any function-scoped fixture: the tiny
    default-model build of tests/train/test_default_model.py ran its kernels in the interpreter (262 s
    instead of ~40 s)."""
    if _interpreted_here(request):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny matmuls on 2 shared cores: one thread avoids OpenMP spin-waits (7 s instead of ~100 s for the
    default model's toy build; 20x for the distillation tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_model_cfg() -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )


@pytest.fixture
def tiny_draft_cfg(tiny_model_cfg) -> fspec.DraftConfig:
    return fspec.DraftConfig(
        kind="eagle", model=tiny_model_cfg, num_speculative_steps=3, block_size=4, max_model_len=32
    )
