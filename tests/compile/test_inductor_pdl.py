"""fspec/compile/inductor_pdl.py: Inductor's PDL, a wait in every kernel, only in fspec's compiled calls."""

from __future__ import annotations

import re
import types

import pytest
import torch
from torch._inductor.codegen import triton as triton_codegen
from torch._inductor.virtualized import V

from fspec.compile import inductor_pdl

GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)


def test_inductor_options_turn_on_inductor_pdl_with_the_caches_off_on_cuda_only():
    from fspec.compile import inductor_options

    opts = inductor_options("reduce-overhead", cuda=True)
    assert opts["triton.cudagraphs"] and opts["triton.enable_pdl"]
    # the patch is invisible to Inductor's cache keys: no graph compiled without it may be reused
    assert opts["fx_graph_cache"] is False and opts["fx_graph_remote_cache"] is False
    assert inductor_options("cuda-graph", cuda=True)["triton.cudagraphs"] is False
    assert inductor_options("reduce-overhead", cuda=False) is None
    assert inductor_options("default", cuda=True) is None


def test_the_patch_is_in_place_only_inside_a_compiled_call(monkeypatch):
    """Outside fspec's calls Inductor's own method runs (a user's torch.compile is untouched); inside the
    wrapper `jit` returns (where Inductor lowers) the patched one, once even when nested."""
    import fspec.compile as C

    original = triton_codegen.TritonKernel._handle_pdl_before_access
    assert not getattr(original, "fspec_always_wait", False)
    seen = []

    def fake_compile(fn, **kwargs):
        assert kwargs["options"]["triton.enable_pdl"]

        def run(*args):
            seen.append(triton_codegen.TritonKernel._handle_pdl_before_access)
            with inductor_pdl.always_wait():  # nested: leaves the outer patch in place
                seen.append(triton_codegen.TritonKernel._handle_pdl_before_access)
            return fn(*args)

        return run

    monkeypatch.setattr(C.torch, "compile", fake_compile)
    monkeypatch.setattr(C, "inductor_options", lambda mode: {"triton.enable_pdl": True})
    f = C.jit(lambda x: x + 1)
    assert f(1) == 2
    assert all(getattr(m, "fspec_always_wait", False) for m in seen) and len(seen) == 2
    assert seen[0].__wrapped__ is original
    assert triton_codegen.TritonKernel._handle_pdl_before_access is original  # restored after the call


class _Lines:
    def __init__(self):
        self.lines = []

    def writeline(self, line):
        self.lines.append(line)


def _decide(previous_writes: list[str]) -> list[str]:
    """Run Inductor's wait decision for a load of "buf1" in a kernel whose previous Inductor kernel wrote
    `previous_writes`; the lines it writes into the load buffer."""
    kernel = types.SimpleNamespace(
        _enable_pdl_codegen=lambda: True,
        inside_reduction=False,
        range_trees=[],
        GDC_WAIT=triton_codegen.TritonKernel.GDC_WAIT,
        current_node=types.SimpleNamespace(mutation_renames={}),
    )
    writes = [types.SimpleNamespace(name=n) for n in previous_writes]
    previous = types.SimpleNamespace(read_writes=types.SimpleNamespace(writes=writes, reads=[]))
    scheduler = types.SimpleNamespace(previous_node=previous)
    graph = types.SimpleNamespace(scheduler=scheduler)
    buffer = _Lines()
    with V.set_graph_handler(graph), V.set_kernel_handler(kernel):
        triton_codegen.TritonKernel._handle_pdl_before_access(kernel, buffer, "buf1")
    assert scheduler.previous_node is previous  # restored
    return buffer.lines


def test_installed_every_access_decision_writes_the_wait(monkeypatch):
    """Before the patch (Inductor's rule) a load of a buffer the previous kernel did not write gets no wait;
    after it, it does, as does one of a buffer it wrote. Installing twice patches once."""
    original = triton_codegen.TritonKernel._handle_pdl_before_access
    original = getattr(original, "__wrapped__", original)
    monkeypatch.setattr(triton_codegen.TritonKernel, "_handle_pdl_before_access", original)
    wait = triton_codegen.TritonKernel.GDC_WAIT
    assert _decide(["buf0"]) == []  # Inductor's own rule: buf1 was not written by the previous kernel
    assert _decide(["buf1"]) == [wait]
    with inductor_pdl.always_wait() as on:
        assert on
        patched = triton_codegen.TritonKernel._handle_pdl_before_access
        assert patched.__wrapped__ is original
        assert _decide(["buf0"]) == [wait] and _decide(["buf1"]) == [wait]
    assert _decide(["buf0"]) == []  # Inductor's rule again after the call


def test_a_torch_without_the_hook_gets_no_inductor_pdl(monkeypatch):
    from fspec.compile import inductor_options

    monkeypatch.delattr(triton_codegen.TritonKernel, "_handle_pdl_before_access")
    assert not inductor_pdl.available()
    with inductor_pdl.always_wait() as on:
        assert on is False
    assert inductor_options("reduce-overhead", cuda=True) is None  # no PDL without the waits


def _kernels(code: str) -> dict[str, str]:
    """name -> source of each @triton.jit kernel in Inductor's output code."""
    parts = re.split(r"@triton\.jit\s*\ndef (\w+)", code)
    return {parts[i]: parts[i + 1].split("''', device_str")[0] for i in range(1, len(parts), 2)}


@GPU
@pytest.mark.gpu
def test_every_generated_kernel_waits_before_its_first_access_and_results_equal_eager():
    """A compiled function with a fill, pointwise and reduction kernels, compiled by `jit`: each
    Triton kernel Inductor writes has gdc_wait before its first tl.load / tl.store, and the output equals
    the uncompiled function's."""
    from torch._inductor.utils import run_and_get_code

    from fspec.compile import jit

    def f(x, w):
        y = torch.zeros(x.shape[0], 64, device=x.device)  # a fill: no loads
        h = torch.nn.functional.silu(x @ w) * 2.0
        return y + h[:, :64], (h * h).sum(-1), torch.arange(x.shape[0], device=x.device) * 3

    x, w = torch.randn(8, 128, device="cuda"), torch.randn(128, 256, device="cuda")
    got, codes = run_and_get_code(jit(f, mode="reduce-overhead"), x, w)
    want = f(x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    kernels = {k: v for code in codes for k, v in _kernels(code).items()}
    assert len(kernels) >= 2, list(kernels)
    for name, src in kernels.items():
        access = re.search(r"tl\.(load|store)\(", src)
        waits = src.find("gdc_wait()")
        assert access and 0 <= waits < access.start(), (name, src[:2000])
