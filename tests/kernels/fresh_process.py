"""Run a test module's function in a new Python without TRITON_INTERPRET.

tests/kernels/conftest.py sets TRITON_INTERPRET=1 for the whole directory before triton is imported, and then
even triton's own library (tl.max, ...) is interpreted: no kernel can be compiled in this process, and
interpreted kernels copy CUDA tensors through the host (no CUDA-graph capture). Tests that compile kernels
(for the H200's sm_90 here, or on the GPU) therefore run their body in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fspec.kernels import attention_ops


def in_fresh_process(module_file: str, module_globals: dict, body: str) -> None:
    """Call `body` (a function of the module at `module_file`) without TRITON_INTERPRET: here when the
    kernels are already compiled, else in a subprocess that loads the module afresh."""
    if not attention_ops.kernels_interpreted():
        module_globals[body]()
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        f"import sys\nsys.path.insert(0, {str(Path(module_file).parent)!r})\n"
        "import importlib.util as u\n"
        f"s = u.spec_from_file_location('fresh_test_module', {module_file!r})\n"
        f"m = u.module_from_spec(s)\ns.loader.exec_module(m)\nm.{body}()"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{body} failed in a fresh process:\n{run.stdout}\n{run.stderr[-6000:]}"


def ptxas_spills(ptx: str) -> str | None:
    """None when triton's bundled ptxas reports no spill stores or loads for `ptx` (sm_90a), else its report.
    ptxas's own account, not a search for local stores in the SASS: a kernel with RoPE also keeps cos / sin's
    argument reduction for large arguments in a local array, which is no spill."""
    import tempfile

    import triton

    ptxas = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run(
            [str(ptxas), "--gpu-name", "sm_90a", "-v", f.name, "-o", "/dev/null"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    report = info.stdout + info.stderr
    return None if "0 bytes spill stores, 0 bytes spill loads" in report else report
