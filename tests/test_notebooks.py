"""The research notebooks run top to bottom at tiny sizes, and the committed ones match their build source.

Each notebook executes in a fresh ipykernel of this interpreter (notebooks/_build.py writes a kernel spec for
`sys.executable` to a temporary directory, so a "python3" kernel spec elsewhere on the machine cannot pick
another interpreter), with `FSPEC_NOTEBOOK_FULL` unset: the notebooks' own asserts are the claims under test,
and nbclient raises CellExecutionError at the first cell that fails.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

# a dev dependency; hosts without it (the GPU host) skip this module instead of failing collection
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
RESULTS_DIR = NOTEBOOKS_DIR.parent / "benchmarks" / "results"

# One line per notebook. 02 and 03 run the real default model (a minute or more each on 2 cores): `slow`.
# What they assert is checked in the default run by tests/test_cli.py (`fspec demo`: lossless speculation
# with the shipped head), tests/train/test_default_model.py and tests/train/test_distill.py; 01 and 04 keep
# the notebook execution itself in the default run.
NOTEBOOKS = [
    "01_pure_draft_step.ipynb",
    pytest.param("02_acceptance.ipynb", marks=pytest.mark.slow),
    pytest.param("03_distill_a_head.ipynb", marks=pytest.mark.slow),
    "04_performance.ipynb",
]


def _build_module():
    spec = importlib.util.spec_from_file_location("fspec_notebooks_build", NOTEBOOKS_DIR / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _build_module()


@pytest.fixture
def tiny_env(monkeypatch):
    """The kernel inherits this environment: tiny sizes, the repository's results, PyTorch reference ops."""
    monkeypatch.delenv("FSPEC_NOTEBOOK_FULL", raising=False)
    monkeypatch.delenv("FSPEC_BENCH_RESULTS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU ops run their PyTorch references, not the interpreter
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend turns figures into outputs
    return monkeypatch


def _images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def _text(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_at_tiny_size(name, tiny_env):
    """Every cell of the notebook runs without error (its asserts hold) and every code cell ran."""
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    build.execute(nb, timeout=300)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"cells raised: {[e.ename for e in errors]}"
    assert _images(nb) > 0, "the notebook drew no plot"


def test_performance_notebook_skips_absent_results(tiny_env, tmp_path):
    """With only sampling.json present, 04 plots sampling alone and reports the other files as absent."""
    source = RESULTS_DIR / "sampling.json"
    if not source.exists():
        pytest.skip("benchmarks/results/sampling.json is absent")
    shutil.copy(source, tmp_path / "sampling.json")
    tiny_env.setenv("FSPEC_BENCH_RESULTS", str(tmp_path))
    nb = nbformat.read(NOTEBOOKS_DIR / "04_performance.ipynb", as_version=4)
    build.execute(nb, timeout=300)
    assert _images(nb) == 1, "one plot: sampling"
    for name in ("attention", "draft_loop", "generate"):
        assert f"{name}.json: absent, skipped" in _text(nb)


@pytest.mark.parametrize("name", sorted(build.NOTEBOOKS))
def test_committed_notebook_matches_its_build_source(name):
    """The committed .ipynb has the cells notebooks/_build.py writes (including 04's provenance table, read
    from benchmarks/results), was executed, and its outputs name no absolute path of the machine that ran it.
    Fix: FSPEC_NOTEBOOK_FULL=1 python notebooks/_build.py --execute"""
    committed = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    expected = build.build(name)
    assert [(c.cell_type, c.source) for c in committed.cells] == [
        (c.cell_type, c.source) for c in expected.cells
    ], f"{name} is stale: regenerate it with notebooks/_build.py"
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{name}: committed without outputs"
    assert not build.absolute_paths(committed), f"{name}: outputs contain absolute paths"
