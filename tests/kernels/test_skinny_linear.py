"""fspec::skinny_linear (kernels/skinny_linear.py) against its reference, the routing in
fspec.models.layers.linear, and the kernel compiled for the H200 (sm_90)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from fresh_process import in_fresh_process, ptxas_spills

from fspec.kernels import ops  # noqa: F401  (registers torch.ops.fspec)
from fspec.kernels.skinny_linear import (
    NORM_MAX_BLOCK_K,
    SkinnyConfig,
    default_config,
    gemv_block_k,
    skinny_linear,
    skinny_linear_ref,
)
from fspec.models import layers


# slow: 100 x 513 (2-3 s each, interpreted); 37 x 200 has the same masked columns, several K tiles and a
# partial last one for every config, and 16 x 16 a single tile.
@pytest.mark.parametrize("m", [1, 3, 6, 16])
@pytest.mark.parametrize(("n", "k"), [(16, 16), (37, 200), pytest.param(100, 513, marks=pytest.mark.slow)])
def test_kernel_equals_reference_on_irregular_shapes(m, n, k):
    """Every row count up to the tile, output and reduction sizes that are not multiples of the tiles (masked
    columns, a partial last K tile), one and several K iterations, two tile widths; the CUDA-core kernels
    (`fma`: one row, and 2..FMA_MAX_ROWS rows as `_skinny_rows_kernel`; more rows fall back to the tile
    kernel)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    want = skinny_linear_ref(x, w)
    fma = (SkinnyConfig(block_n=16, block_k=64, fma=True), SkinnyConfig(block_n=32, block_k=16, fma=True))
    fma += (SkinnyConfig(block_n=16, block_k=16, num_warps=8, fma=True, one_tile=True),)  # all K at once
    # the reduction cut into 2 / 4 / 8 programs per column block: a loop per split, one tile per split, and
    # more splits than tiles (k = 16: splits past K add zeros)
    fma += (
        SkinnyConfig(block_n=16, block_k=16, fma=True, split_k=4),
        SkinnyConfig(block_n=32, fma=True, split_k=2),
    )
    fma += (SkinnyConfig(block_n=16, block_k=16, num_warps=8, fma=True, one_tile=True, split_k=8),)
    for cfg in (None, SkinnyConfig(block_n=32, block_k=64), SkinnyConfig(block_n=16, block_k=16), *fma):
        got = skinny_linear(x, w, config=cfg)
        assert got.shape == (m, n) and got.dtype == x.dtype
        # fp32 sums of k unit-variance products in another order: rounding ~ sqrt(k) * 2^-24 * sqrt(k)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_reads_strided_rows_and_keeps_bf16():
    """A row-strided x (a slice of a wider activation) and bf16 inputs: the result is the reference's
    float32-accumulated product rounded to bf16 (at most one bf16 step apart: sums in another order)."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(5, 300, generator=gen).bfloat16()
    x, w = wide[:, 20:220], torch.randn(48, 200, generator=gen).bfloat16()
    got, want = skinny_linear(x, w), skinny_linear_ref(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


def test_op_matches_reference_and_traces_under_compile():
    """The registered op (Triton under the interpreter, reference on CPU when traced) gives the reference's
    result eagerly and inside torch.compile(fullgraph=True)."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 40, generator=gen), torch.randn(24, 40, generator=gen)
    want = skinny_linear_ref(x, w)
    torch.testing.assert_close(torch.ops.fspec.skinny_linear(x, w), want, rtol=1e-5, atol=1e-5)
    compiled = torch.compile(lambda a, b: torch.ops.fspec.skinny_linear(a, b) * 2.0, fullgraph=True)
    torch.testing.assert_close(compiled(x, w), want * 2.0, rtol=1e-5, atol=1e-5)


def test_linear_routes_only_one_row_inference_products_on_cuda():
    """use_skinny_linear: only on CUDA, for one row of x (batch-1 decode and draft steps; several rows keep
    cuBLAS), at most SKINNY_ROW_MAX_OUT outputs (gate/up yes, target LM heads no), matching float dtypes
    it handles, and never where autograd would need the product's gradient. `linear` itself equals
    F.linear (on CPU it never routes)."""
    row, w = torch.randn(1, 1, 8), torch.randn(5, 8)
    widest = layers.SKINNY_ROW_MAX_OUT
    assert layers.use_skinny_linear(row, w, cuda=True)
    assert layers.use_skinny_linear(row[0], w, cuda=True)
    assert layers.use_skinny_linear(row[0, 0], w, cuda=True)  # a 1-d x: one row
    assert not layers.use_skinny_linear(row, w, cuda=False)
    assert not layers.use_skinny_linear(torch.randn(2, 3, 8), w, cuda=True)  # 6 rows
    assert not layers.use_skinny_linear(torch.randn(2, 8), w, cuda=True)  # two rows
    assert not layers.use_skinny_linear(torch.randn(17, 8), w, cuda=True)
    assert not layers.use_skinny_linear(torch.randn(0, 8), w, cuda=True)
    assert layers.use_skinny_linear(row, torch.randn(widest, 8), cuda=True)
    assert not layers.use_skinny_linear(row, torch.randn(widest + 1, 8), cuda=True)
    k = 4096  # a long reduction of one row: routed; of two rows: not
    assert layers.use_skinny_linear(torch.randn(1, k), torch.randn(k, k), cuda=True)
    assert not layers.use_skinny_linear(torch.randn(2, k), torch.randn(k, k), cuda=True)
    assert not layers.use_skinny_linear(row, torch.randn(1, 5, 8), cuda=True)  # a 3-d weight
    assert not layers.use_skinny_linear(row.double(), w.double(), cuda=True)
    assert not layers.use_skinny_linear(row.bfloat16(), w, cuda=True)
    assert layers.use_skinny_linear(row.bfloat16(), w.bfloat16(), cuda=True)
    assert not layers.use_skinny_linear(row, w.clone().requires_grad_(), cuda=True)
    assert not layers.use_skinny_linear(row.clone().requires_grad_(), w, cuda=True)
    with torch.no_grad():
        assert layers.use_skinny_linear(row, w.clone().requires_grad_(), cuda=True)
    b = torch.randn(5)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(layers.linear(row, w, b), F.linear(row, w, b))
    # never under a torch.func transform (the op has no vmap rule) nor for a weight strided along K
    w16 = torch.randn(16, 8)
    torch.func.vmap(lambda r: _assert_routed(r, w16, False), in_dims=0)(torch.randn(3, 1, 8))
    torch.func.grad(lambda r: (_assert_routed(r, w16, False) * r).sum())(torch.randn(1, 8))
    _assert_routed(row, w16, True)
    _assert_routed(row, torch.randn(8, 16).t(), False)


def _assert_routed(x: torch.Tensor, w: torch.Tensor, want: bool) -> torch.Tensor:
    assert layers.use_skinny_linear(x, w, cuda=True) is want
    return x


def test_bad_shapes_dtypes_and_devices_are_refused_naming_the_argument():
    """The op, the kernel's launcher and the reference refuse what the kernel would read out of bounds or
    mix: a ValueError naming the argument, the expected and the actual value."""
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    cases = [
        (torch.randn(17, 32), w, r"x: expected a \[M, K\] tensor with 1 <= M <= 16, got shape \(17, 32\)"),
        (torch.randn(0, 32), w, r"x: expected .* got shape \(0, 32\)"),
        (torch.randn(32), w, r"x: expected .* got shape \(32,\)"),
        (x, torch.randn(8, 31), r"w: expected a \[N, 32\] tensor \(x's K\), got shape \(8, 31\)"),
        (x, w.double(), r"w: expected x's floating dtype torch.float32, got torch.float64"),
        (x.long(), w.long(), r"w: expected x's floating dtype torch.int64, got torch.int64"),
    ]
    for fn in (skinny_linear, skinny_linear_ref, torch.ops.fspec.skinny_linear):
        for a, b, msg in cases:
            with pytest.raises(ValueError, match=msg):
                fn(a, b)


def test_default_config_follows_the_h200_sweep_and_caps_the_tile_depth():
    """The sweep's best configs for the decode projections (benchmarks/results/skinny_linear.json); BLOCK_K
    never past K's next power of two."""
    assert default_config(2048, 2048) == SkinnyConfig(block_n=16, block_k=512, num_stages=4)  # 1B o
    assert default_config(2048, 8192) == SkinnyConfig(block_n=16, block_k=512, num_stages=4)  # 1B down
    assert default_config(4096, 4096) == SkinnyConfig(block_n=32, block_k=512, num_stages=4)  # 8B o, down
    assert default_config(6144, 8192) == SkinnyConfig(block_n=64, block_k=256, num_stages=4)  # 8B q/k/v
    assert default_config(28672, 4096) == SkinnyConfig(block_n=64, block_k=128, num_stages=4)  # 8B gate/up
    assert default_config(100, 40).block_k == 64
    # one row (benchmarks/results/skinny_linear_one_row.json): the CUDA-core kernel, 16 columns per program
    gemv = SkinnyConfig(block_n=16, block_k=512, num_warps=8, num_stages=1, fma=True)
    one = dataclasses.replace(gemv, block_k=1024, one_tile=True)  # one tile where it fits (gemv_block_k)
    assert default_config(2048, 2048, one_row=True) == one  # 1B o
    assert default_config(2048, 8192, one_row=True) == one  # 1B down (does not fit: the loop)
    assert gemv_block_k(one, 2048) == (2048, True, 2048) and gemv_block_k(one, 8192) == (1024, False, 8192)
    assert default_config(3072, 2048, one_row=True) == gemv  # 1B q/k/v
    assert default_config(4096, 14336, one_row=True) == gemv  # 8B down
    assert default_config(6144, 8192, one_row=True) == dataclasses.replace(gemv, num_warps=4)  # 8B q/k/v
    assert default_config(16384, 2048, one_row=True) == dataclasses.replace(gemv, block_k=256)  # 1B gate/up
    assert default_config(28672, 4096, one_row=True) == dataclasses.replace(gemv, block_k=256, num_warps=4)
    assert default_config(32000, 2048, one_row=True) == dataclasses.replace(
        gemv, num_warps=4
    )  # draft LM head
    assert default_config(32000, 4096, one_row=True) == dataclasses.replace(gemv, block_k=256, num_warps=4)
    assert default_config(2048, 700, one_row=True).block_k == 1024  # K's next power of two
    assert default_config(100, 40, one_row=True).block_k == 64


def _compile_for_sm90_body():
    """Compile the kernel for sm_90 (bf16 weights, one decode row), plain and with each fusion the fused
    layer uses, and look for tensor-core MMAs and the absence of register spills."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fspec.kernels.skinny_linear import _skinny_linear_kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "norm_ptr": "*bf16", "res_ptr": "*bf16"}
    sig.update(M="i32", N="i32", K="i32", eps="fp32", stride_xm="i32", stride_wn="i32", stride_ym="i32")
    sig.update(stride_rm="i32", positions_ptr="*i64", inv_freq_ptr="*fp32", slot_ptr="*i64")
    sig.update(k_cache_ptr="*bf16", v_cache_ptr="*bf16", q_cols="i32", kv_cols="i32")
    flags = ("M_PAD", "BLOCK_N", "BLOCK_K", "UPCAST", "NORM", "SILU", "RESIDUAL", "PDL")
    sig.update({name: "constexpr" for name in (*flags, "ROPE_HEAD_DIM", "TABLE_DTYPE")})
    nvdisasm = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "nvdisasm"
    # at the launcher's configs of a 1B layer: plain; the input norm (q/k/v); the post norm and SiLU * up
    # (gate/up: 32 gate and 32 up rows per program); the residual (o, down)
    for norm, silu, residual, (n, k) in (
        (0, 0, 0, (2048, 2048)), (1, 0, 0, (3072, 2048)), (1, 1, 0, (16384, 2048)), (0, 0, 1, (2048, 8192)),
    ):  # fmt: skip
        cfg = default_config(n, k)
        block_n = cfg.block_n // 2 if silu else cfg.block_n
        block_k = min(cfg.block_k, NORM_MAX_BLOCK_K) if norm else cfg.block_k
        consts = {"M_PAD": 16, "BLOCK_N": block_n, "BLOCK_K": block_k, "UPCAST": False, "NORM": bool(norm)}
        consts.update(SILU=bool(silu), RESIDUAL=bool(residual), PDL=True)
        consts.update(ROPE_HEAD_DIM=0, TABLE_DTYPE=tl.float32)  # (test_qkv_rope_write.py)
        # as the launcher specialises these shapes: pointers, N, K and the strides divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7, 9, 10, 11, 12)}
        src = ASTSource(fn=_skinny_linear_kernel, signature=sig, constexprs=consts, attrs=attrs)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            run = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True)
        sass = run.stdout
        assert "HMMA" in sass or "HGMMA" in sass, f"no tensor-core instruction ({consts})"
        assert "STL" not in sass, f"the skinny linear kernel spills registers ({consts})"
    # the one-row CUDA-core kernel at the largest tiles its launcher allows (GEMV_ELEMS_PER_THREAD), plain and
    # with the fusions
    from fspec.kernels.skinny_linear import _skinny_gemv_kernel, norm_block

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "norm_ptr": "*bf16", "res_ptr": "*bf16"}
    sig.update(part_ptr="*fp32", counter_ptr="*i32", N="i32", K="i32", K_SPLIT="i32", eps="fp32")
    sig.update(stride_wn="i32", positions_ptr="*i64", inv_freq_ptr="*fp32", slot_ptr="*i64")
    sig.update(k_cache_ptr="*bf16", v_cache_ptr="*bf16", q_cols="i32", kv_cols="i32")
    names = ("BLOCK_N", "BLOCK_K", "NORM", "SILU", "RESIDUAL", "PDL", "ONE_TILE", "SPLIT_K", "NORM_BLOCK")
    sig.update({name: "constexpr" for name in (*names, "ROPE_HEAD_DIM", "TABLE_DTYPE")})
    # the loop at its largest tiles, and the one-tile kernel at the largest the launcher allows
    # (GEMV_ONE_TILE_ELEMS_PER_THREAD: 16 x 2048 at 8 warps; 16 x 1024 with SiLU * up's two tiles); the
    # split reduction (its combine adds a [SPLIT_K, BLOCK_N] load and an atomic)
    for norm, silu, residual, block_n, block_k, warps, one, split in (
        (0, 0, 0, 64, 256, 8, 0, 1), (1, 1, 0, 16, 256, 4, 0, 1), (0, 0, 1, 16, 512, 4, 0, 1),
        (1, 1, 1, 32, 256, 8, 0, 1), (0, 0, 0, 16, 2048, 8, 1, 1), (1, 0, 0, 16, 2048, 8, 1, 1),
        (0, 0, 1, 16, 2048, 8, 1, 1), (1, 1, 1, 16, 1024, 8, 1, 1), (0, 0, 1, 16, 2048, 8, 1, 4),
        (1, 1, 1, 16, 256, 4, 0, 8), (0, 0, 1, 16, 512, 8, 0, 16), (1, 0, 0, 16, 512, 8, 0, 1),
        (1, 0, 0, 16, 1024, 8, 0, 1), (1, 0, 0, 16, 512, 4, 0, 1),
    ):  # fmt: skip
        consts = {"BLOCK_N": block_n, "BLOCK_K": block_k, "NORM": bool(norm), "SILU": bool(silu)}
        # the RMS pass at its widest load (NORM_VALUES_PER_THREAD per thread: K = 8192 at 8 warps)
        consts.update(RESIDUAL=bool(residual), PDL=True, ONE_TILE=bool(one), SPLIT_K=split)
        consts.update(NORM_BLOCK=norm_block(8192, warps) if norm else 16)
        consts.update(ROPE_HEAD_DIM=0, TABLE_DTYPE=tl.float32)  # (test_qkv_rope_write.py)
        divisible = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11)
        attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
        src = ASTSource(fn=_skinny_gemv_kernel, signature=sig, constexprs=consts, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            run = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True)
        assert "STL" not in run.stdout, f"the one-row kernel spills registers ({consts}, {warps} warps)"
        assert ("ATOM" in run.stdout) == (split > 1), f"the counter's atomic ({consts})"
    # the 2..FMA_MAX_ROWS-row CUDA-core kernel (an explicit fma config) at the tiles its launcher picks from
    # the one-row configs for a 1B-shaped head's products (and a 32000-token LM head), at 2, 4 and 8 padded
    # rows, plain and with the fusions
    from fspec.kernels.skinny_linear import _skinny_rows_kernel, rows_block_k, rows_norm_block

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "norm_ptr": "*bf16", "res_ptr": "*bf16"}
    sig.update(M="i32", N="i32", K="i32", eps="fp32", stride_xm="i32", stride_wn="i32", stride_ym="i32")
    sig.update(stride_rm="i32", positions_ptr="*i64", inv_freq_ptr="*fp32", slot_ptr="*i64")
    sig.update(k_cache_ptr="*bf16", v_cache_ptr="*bf16", q_cols="i32", kv_cols="i32")
    names = ("M_POW2", "BLOCK_N", "BLOCK_K", "NORM", "SILU", "RESIDUAL", "PDL", "NORM_BLOCK")
    sig.update({name: "constexpr" for name in (*names, "ROPE_HEAD_DIM", "TABLE_DTYPE")})
    for m, n, k, norm, silu, residual in (
        (8, 3072, 2048, 1, 0, 0), (6, 8192, 2048, 1, 1, 0), (8, 2048, 8192, 0, 0, 1),
        (4, 3072, 2048, 1, 0, 0), (2, 8192, 2048, 1, 1, 1), (6, 32000, 2048, 0, 0, 0),
        (2, 2048, 8192, 0, 0, 1),
    ):  # fmt: skip
        cfg = default_config(2 * n if silu else n, k, one_row=True)  # what an fma config would take
        if silu:  # as the launcher: block_n gate rows and block_n up rows
            cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
        consts = {"M_POW2": triton.next_power_of_2(m), "BLOCK_N": cfg.block_n, "NORM": bool(norm)}
        consts.update(BLOCK_K=rows_block_k(cfg, m, k, silu_mul=bool(silu)), SILU=bool(silu))
        consts.update(RESIDUAL=bool(residual), PDL=True)
        consts.update(NORM_BLOCK=rows_norm_block(m, k, cfg.num_warps) if norm else 16)
        consts.update(ROPE_HEAD_DIM=0, TABLE_DTYPE=tl.float32)
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 9, 10, 11, 12)}
        src = ASTSource(fn=_skinny_rows_kernel, signature=sig, constexprs=consts, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            run = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True)
        assert "STL" not in run.stdout, f"the rows kernel spills registers ({consts}, {cfg.num_warps} warps)"
    # the rows tile kernel (an explicit `fma` + `one_tile` config, 2..16 rows unrolled) at SmolLM2-135M's four
    # fused products (q/k/v also with the RoPE epilogue) and its EAGLE-3 head's q/k/v, 6 and 16 rows, eight
    # warps: the whole reduction in one tile without spills (ptxas's account: with RoPE the stack frame also
    # holds cos / sin's argument reduction for large arguments, a local array, which is no spill)
    from fspec.kernels.skinny_linear import _skinny_rows_tile_kernel, rows_tile_fits

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "norm_ptr": "*bf16", "res_ptr": "*bf16"}
    sig.update(N="i32", K="i32", eps="fp32", stride_xm="i32", stride_wn="i32", stride_ym="i32")
    sig.update(stride_rm="i32", positions_ptr="*i64", inv_freq_ptr="*fp32", slot_ptr="*i64")
    sig.update(k_cache_ptr="*bf16", v_cache_ptr="*bf16", q_cols="i32", kv_cols="i32")
    names = ("ROWS", "BLOCK_N", "BLOCK_K", "NORM", "SILU", "RESIDUAL", "PDL", "ROPE_HEAD_DIM", "TABLE_DTYPE")
    sig.update({name: "constexpr" for name in names})
    one = SkinnyConfig(block_n=16, block_k=512, num_warps=8, fma=True, one_tile=True)
    for k, norm, silu, residual, rope in (
        (576, 1, 0, 0, 0), (576, 1, 0, 0, 64), (576, 0, 0, 1, 0), (576, 1, 1, 0, 0), (1536, 0, 0, 1, 0),
        (1152, 0, 0, 0, 64),
    ):  # fmt: skip
        assert rows_tile_fits(one, k, silu_mul=bool(silu))
        for m in (6, 16):
            consts = {"ROWS": m, "BLOCK_N": 16, "BLOCK_K": triton.next_power_of_2(k), "NORM": bool(norm)}
            consts.update(SILU=bool(silu), RESIDUAL=bool(residual), PDL=True, ROPE_HEAD_DIM=rope)
            consts.update(TABLE_DTYPE=tl.bfloat16)
            attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 8, 9, 10)}
            src = ASTSource(fn=_skinny_rows_tile_kernel, signature=sig, constexprs=consts, attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
            assert ptxas_spills(compiled.asm["ptx"]) is None, f"rows tile spills ({consts})"


def test_kernel_compiles_for_sm90():
    in_fresh_process(__file__, globals(), "_compile_for_sm90_body")


def _gpu_matches_reference_body():
    """On CUDA at the decode shapes of a 1B-shaped target (bf16): the compiled kernel equals the float32
    reference within one bf16 rounding of the output, for 1, 6 and 16 rows, default and non-default tiles
    and the one-row CUDA-core kernel (a loop, one tile, the reduction split over 4 programs; the one-tile
    config at several rows: the rows tile kernel where it fits); a layer's one-row projection routed through
    it equals F.linear's the same way; the fusions at a 1B layer's shapes and, on the rows tile kernel, at
    SmolLM2's (eager and in a CUDA graph)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (100, 72)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        for m in (1, 6, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = skinny_linear_ref(x, w).float()
            gemv = SkinnyConfig(block_n=16, block_k=512, num_stages=1, fma=True)  # one row: CUDA cores
            one = SkinnyConfig(block_n=16, block_k=512, num_warps=8, num_stages=1, fma=True, one_tile=True)
            splits = (dataclasses.replace(gemv, split_k=4), dataclasses.replace(one, split_k=4))
            for cfg in (
                None,
                SkinnyConfig(block_n=32, block_k=128, num_warps=8, num_stages=4),
                gemv,
                one,
                *splits,
            ):
                got = skinny_linear(x, w, config=cfg).float()
                torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
    x = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, generator=gen) * 2048**-0.5
    with torch.no_grad():
        assert layers.use_skinny_linear(x, w) and not layers.use_skinny_linear(x.expand(2, 3, 2048), w)
        torch.testing.assert_close(
            layers.linear(x, w).float(), F.linear(x, w).float(), rtol=2**-7, atol=2**-7
        )
    # the fusions at a 1B layer's shapes (bf16): input norm on q/k/v, residual on o and down, the post norm
    # and SiLU * up on gate/up; within two bf16 roundings of the reference (sum order, approximate exp / sqrt)
    for n, k, kw in (
        (3072, 2048, "norm"), (2048, 2048, "residual"), (16384, 2048, "norm+silu"), (2048, 8192, "residual"),
    ):  # fmt: skip
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        out = n // 2 if "silu" in kw else n
        for m in (1, 6):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            args = _gpu_fusion_args(kw, m, k, out, gen)
            want = skinny_linear_ref(x, w, **args).float()
            one = SkinnyConfig(block_n=16, block_k=512, num_warps=8, num_stages=1, fma=True, one_tile=True)
            split = SkinnyConfig(block_n=16, block_k=256, num_warps=8, num_stages=1, fma=True, split_k=4)
            for cfg in (None, SkinnyConfig(block_n=16, block_k=512, num_stages=1, fma=True), one, split):
                got = skinny_linear(x, w, config=cfg, **args).float()
                torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6)
    # the rows tile kernel (`one` at several rows) at SmolLM2-135M's fused products, 2, 6 and 16 rows, eagerly
    # and replayed in a CUDA graph with new rows of x: the reference within two bf16 roundings, and the tile
    # kernel's result within the same
    for n, k, kw in (
        (960, 576, "norm"),
        (576, 576, "residual"),
        (3072, 576, "norm+silu"),
        (576, 1536, "residual"),
    ):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        out = n // 2 if "silu" in kw else n
        for m in (2, 6, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            args = _gpu_fusion_args(kw, m, k, out, gen)
            got = skinny_linear(x, w, config=one, **args).float()
            torch.testing.assert_close(got, skinny_linear_ref(x, w, **args).float(), rtol=2**-6, atol=2**-6)
            torch.testing.assert_close(got, skinny_linear(x, w, **args).float(), rtol=2**-6, atol=2**-6)
            graph, static = torch.cuda.CUDAGraph(), torch.empty(m, out, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                static.copy_(skinny_linear(x, w, config=one, **args))
            x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen))
            graph.replay()
            want = skinny_linear_ref(x, w, **args).float()
            torch.testing.assert_close(static.float(), want, rtol=2**-6, atol=2**-6)


def _gpu_fusion_args(fusions: str, m: int, k: int, out: int, gen: torch.Generator) -> dict:
    """skinny_linear's keyword arguments for `fusions` ("norm", "silu", "residual" joined by "+"), bf16 on
    CUDA: a norm weight in [0.5, 1.5) and eps 1e-5, SiLU * up, an [m, out] residual."""
    args = {"silu_mul": "silu" in fusions}
    if "norm" in fusions:
        norm = torch.rand(k, device="cuda", generator=gen).bfloat16() + 0.5
        args.update(norm_weight=norm, eps=1e-5)
    if "residual" in fusions:
        args.update(residual=torch.randn(m, out, device="cuda", dtype=torch.bfloat16, generator=gen))
    return args


@pytest.mark.gpu
def test_kernel_gpu_matches_reference():
    in_fresh_process(__file__, globals(), "_gpu_matches_reference_body")


FUSIONS = ["norm", "silu", "residual", "norm+residual", "silu+residual", "norm+silu", "norm+silu+residual"]


# slow: the larger shape (2-5 s each, interpreted) but for all three fusions at once. 37 x 200 already has a
# partial last column block and several K tiles, a partial last one, for every fusion, row count and config.
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize(
    ("fusion", "n", "k"),
    [(f, 37, 200) for f in FUSIONS]
    + [pytest.param(f, 100, 513, marks=[] if f == FUSIONS[-1] else [pytest.mark.slow]) for f in FUSIONS],
)
def test_fused_prologue_and_epilogues_equal_the_unfused_ops(m, n, k, fusion):
    """RMSNorm (a row's RMS over every K tile, the weight per column), SiLU * up (w = [w_gate; w_up]: gate
    rows n and up rows N + n in one program) and the residual add give the reference's result, itself
    checked against the unfused PyTorch ops of a Llama layer (layers.rms_norm, layers.mlp's chunk and
    F.silu, residual + y)."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    silu = "silu" in fusion
    x = torch.randn(m, k, generator=gen) * 3 + 0.5
    w = torch.randn(2 * n if silu else n, k, generator=gen) * k**-0.5 * 2
    kw = {}
    if "norm" in fusion:
        kw.update(norm_weight=torch.rand(k, generator=gen) + 0.5, eps=1e-5)
    if silu:
        kw.update(silu_mul=True)
    if "residual" in fusion:
        kw.update(residual=torch.randn(m, n, generator=gen))
    want = skinny_linear_ref(x, w, **kw)
    assert want.shape == (m, n)
    # the reference is the unfused layer code
    h = layers.rms_norm(x, kw["norm_weight"], kw["eps"]) if "norm" in fusion else x
    y = F.linear(h, w)
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    unfused = y + (kw["residual"] if "residual" in fusion else 0)
    torch.testing.assert_close(want, unfused, rtol=1e-5, atol=1e-4)
    # fp32 sums of K products of magnitude up to ~10 in another order, then SiLU * up: ~sqrt(K) * 30 ulps
    tol = dict(rtol=1e-4, atol=1e-3)
    configs = (None, SkinnyConfig(block_n=16, block_k=64), SkinnyConfig(block_n=16, block_k=64, fma=True))
    configs += (SkinnyConfig(block_n=16, block_k=16, num_warps=16, fma=True, one_tile=True),)
    configs += (  # the split reduction, combined before the epilogue (with SiLU * up: both halves' partials)
        SkinnyConfig(block_n=16, block_k=32, fma=True, split_k=4),
        SkinnyConfig(block_n=16, block_k=16, num_warps=16, fma=True, one_tile=True, split_k=2),
    )
    for (
        cfg
    ) in configs:  # one and several K tiles for the RMS pass; the one-row CUDA-core kernel (and in one tile)
        got = skinny_linear(x, w, config=cfg, **kw)
        torch.testing.assert_close(got, want, **tol)
    # the op, eager (interpreted kernel) and its fake
    torch.testing.assert_close(torch.ops.fspec.skinny_linear(x, w, **kw), want, **tol)


def test_fusions_reject_inconsistent_arguments():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"^norm_weight: expected a \[8\] tensor"):
        skinny_linear(x, w, norm_weight=torch.ones(7))
    with pytest.raises(ValueError, match=r"^residual: expected a \[2, 4\] tensor"):
        skinny_linear(x, w, residual=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"^residual: expected .* dtype torch.float32"):
        skinny_linear(x, w, residual=torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^w: expected \[2N, K\] \(gate rows, then up rows\) with silu"):
        skinny_linear(x, torch.randn(5, 8), silu_mul=True)
    with pytest.raises(ValueError, match=r"^residual: expected a \[2, 2\] tensor"):
        skinny_linear(x, w, silu_mul=True, residual=torch.ones(2, 4))  # the output is half of w's rows
    assert skinny_linear(x, w, silu_mul=True).shape == (2, 2)
    assert torch.ops.fspec.skinny_linear(x, w, None, 1e-6, True, None).shape == (2, 2)


def test_fused_op_passes_opcheck():
    gen = torch.Generator().manual_seed(11)
    x, w, r = torch.randn(3, 40, generator=gen), torch.randn(24, 40, generator=gen), torch.randn(3, 24)
    op = torch.ops.fspec.skinny_linear.default
    torch.library.opcheck(op, (x, w, torch.rand(40, generator=gen), 1e-6, False, r))
    torch.library.opcheck(op, (x, w, torch.rand(40, generator=gen), 1e-6, True, r[:, :12]))


def test_one_row_kernel_gets_a_tile_that_fits_in_registers(monkeypatch):
    """The `fma` launcher halves BLOCK_K until BLOCK_N x BLOCK_K is at most GEMV_ELEMS_PER_THREAD per
    thread (half that with SiLU * up: two partial sums), and only one-row products take that kernel."""
    from fspec.kernels import skinny_linear as sl

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, kw["BLOCK_N"], kw["BLOCK_K"]))

    monkeypatch.setattr(sl, "_skinny_gemv_kernel", Recorder())
    x, w = torch.randn(1, 2048), torch.randn(256, 2048)
    cfg = SkinnyConfig(block_n=64, block_k=512, num_warps=4, fma=True)
    skinny_linear(x, w, config=cfg)
    assert launched[-1] == ((4, 1), 64, 128)  # 64 x 128 = 64 elements per thread of 128
    skinny_linear(x, w, config=cfg, silu_mul=True)
    assert launched[-1] == ((2, 1), 64, 64)  # out = 128 columns; two sums: 32 each
    skinny_linear(x, w, config=dataclasses.replace(cfg, num_warps=8))
    assert launched[-1] == ((4, 1), 64, 256)
    skinny_linear(x, w, norm_weight=torch.ones(2048))  # the default up to N = 2048: 16 columns, one tile
    assert launched[-1] == ((16, 1), 16, 2048)  # no NORM_MAX_BLOCK_K cap: the one-row kernel's x is a vector
    count = len(launched)
    assert skinny_linear(torch.randn(2, 2048), w, config=cfg).shape == (2, 256)
    assert len(launched) == count  # two rows: `_skinny_rows_kernel`
    rows_launched = []

    class RowsRecorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: rows_launched.append((grid, kw["M_POW2"], kw["BLOCK_K"]))

    monkeypatch.setattr(sl, "_skinny_rows_kernel", RowsRecorder())
    skinny_linear(torch.randn(6, 2048), w)  # no config: several rows keep the tile kernel (measured faster)
    assert rows_launched == []
    skinny_linear(torch.randn(6, 2048), w, config=dataclasses.replace(cfg, num_warps=8))  # explicit fma
    assert rows_launched == [((4,), 8, 64)]  # 8 rows x 64 x 64 / 256 threads = ROWS_ELEMS_PER_THREAD
    # one_tile: the whole reduction (K's next power of two) when it fits in GEMV_ONE_TILE_ELEMS_PER_THREAD
    one = SkinnyConfig(block_n=16, block_k=512, num_warps=8, fma=True, one_tile=True)
    assert sl.gemv_block_k(one, 2048) == (2048, True, 2048)  # 16 x 2048 / 256 threads = 128
    assert sl.gemv_block_k(one, 1500) == (2048, True, 1504)
    assert sl.gemv_block_k(one, 2049) == (512, False, 2560)  # 4096 would not fit: the loop, cfg.block_k
    assert sl.gemv_block_k(one, 2048, silu_mul=True) == (512, False, 2048)  # two tiles do not fit
    assert sl.gemv_block_k(one, 1024, silu_mul=True) == (1024, True, 1024)
    assert sl.gemv_block_k(dataclasses.replace(one, num_warps=4), 2048) == (512, False, 2048)
    assert sl.gemv_block_k(dataclasses.replace(one, one_tile=False), 100) == (512, False, 512)
    # split_k: each split's depth (a multiple of 16; of BLOCK_K when it loops), in one tile where it fits
    assert sl.gemv_block_k(dataclasses.replace(one, split_k=4), 8192) == (2048, True, 2048)
    assert sl.gemv_block_k(dataclasses.replace(one, split_k=4), 8000) == (2048, True, 2000)
    assert sl.gemv_block_k(dataclasses.replace(one, split_k=4), 8001) == (2048, True, 2016)
    assert sl.gemv_block_k(SkinnyConfig(block_n=16, block_k=512, num_warps=8, fma=True, split_k=4), 8001) == (
        512,
        False,
        2048,
    )
    split = SkinnyConfig(block_n=16, block_k=256, num_warps=8, fma=True, split_k=4)
    skinny_linear(x, w, config=split)
    assert launched[-1] == ((16, 4), 16, 256)  # grid: column blocks x splits


def test_several_rows_with_an_explicit_one_tile_config_take_the_rows_tile_kernel(monkeypatch):
    """An `fma` + `one_tile` config for 2..MAX_ROWS rows launches `_skinny_rows_tile_kernel` (all the rows
    unrolled, BLOCK_K = K's next power of two) where the weight tile fits (`rows_tile_fits`: the one-row
    one-tile kernel's register bound, two tiles with SiLU * up); otherwise, with a split reduction, or with
    no config, the other several-row kernels."""
    from fspec.kernels import skinny_linear as sl

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((self.name, grid, kw.get("ROWS"), kw["BLOCK_K"]))

    for name in ("_skinny_rows_tile_kernel", "_skinny_rows_kernel", "_skinny_linear_kernel"):
        monkeypatch.setattr(sl, name, Recorder(name))
    one = SkinnyConfig(block_n=16, block_k=512, num_warps=8, fma=True, one_tile=True)
    w = torch.randn(960, 576)
    for m in (2, 6, 16):
        skinny_linear(torch.randn(m, 576), w, config=one)
        assert launched[-1] == ("_skinny_rows_tile_kernel", (60,), m, 1024)
    assert sl.rows_tile_fits(one, 2048) and not sl.rows_tile_fits(one, 2049)
    assert sl.rows_tile_fits(one, 1024, silu_mul=True) and not sl.rows_tile_fits(one, 1025, silu_mul=True)
    skinny_linear(torch.randn(6, 576), torch.randn(3072, 576), config=one, silu_mul=True)
    assert launched[-1] == ("_skinny_rows_tile_kernel", (96,), 6, 1024)
    skinny_linear(torch.randn(6, 2049), torch.randn(64, 2049), config=one)  # does not fit: the rows kernel
    assert launched[-1][0] == "_skinny_rows_kernel"
    skinny_linear(torch.randn(12, 2049), torch.randn(64, 2049), config=one)  # nor 12 rows: the tile kernel
    assert launched[-1][0] == "_skinny_linear_kernel"
    skinny_linear(torch.randn(6, 576), w, config=dataclasses.replace(one, split_k=2))
    assert launched[-1][0] == "_skinny_rows_kernel"
    skinny_linear(torch.randn(6, 576), w)
    assert launched[-1][0] == "_skinny_linear_kernel"


def test_one_row_rms_pass_reads_x_in_one_load_where_registers_allow_and_loops_beyond(monkeypatch):
    """`norm_block`: K's next power of two, capped at NORM_VALUES_PER_THREAD values per thread; past the cap
    the RMS pass loops, and the fused one-row product still equals the reference."""
    from fspec.kernels import skinny_linear as sl

    assert sl.norm_block(2048, 8) == 2048 and sl.norm_block(8192, 8) == 8192
    assert sl.norm_block(8192, 4) == 4096 and sl.norm_block(100, 4) == 128 and sl.norm_block(3, 1) == 16
    monkeypatch.setattr(sl, "NORM_VALUES_PER_THREAD", 1)  # 128 values per load at 4 warps: K = 513 loops
    assert sl.norm_block(513, 4) == 128
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(1, 513, generator=gen) * 2, torch.randn(60, 513, generator=gen) * 513**-0.5
    kw = dict(norm_weight=torch.rand(513, generator=gen) + 0.5, eps=1e-5, residual=torch.randn(1, 30))
    for cfg in (SkinnyConfig(block_n=16, block_k=64, fma=True), None):
        got = skinny_linear(x, w, silu_mul=True, config=cfg, **kw)
        torch.testing.assert_close(got, skinny_linear_ref(x, w, silu_mul=True, **kw), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fusion", ["", "norm+silu+residual"])
def test_split_reduction_repeats_bit_for_bit(fusion):
    """The split reduction combines its partials in one fixed order: each launch gives the reference's result
    and the same bits as the first, whichever other split launches ran in between."""
    gen = torch.Generator().manual_seed(5)
    silu = "silu" in fusion
    n, k = 70, 300
    x, w = torch.randn(1, k, generator=gen), torch.randn(2 * n if silu else n, k, generator=gen) * k**-0.5
    kw = {}
    if fusion:
        kw = dict(norm_weight=torch.rand(k, generator=gen) + 0.5, silu_mul=True, residual=torch.randn(1, n))
    want = skinny_linear_ref(x, w, **kw)
    cfg = SkinnyConfig(block_n=16, block_k=32, fma=True, split_k=4)
    first = skinny_linear(x, w, config=cfg, **kw)
    torch.testing.assert_close(first, want, rtol=1e-4, atol=1e-4)
    other = torch.randn(40, 64, generator=gen)
    for _ in range(3):
        skinny_linear(torch.randn(1, 64, generator=gen), other, config=dataclasses.replace(cfg, split_k=2))
        again = skinny_linear(x, w, config=cfg, **kw)
        assert torch.equal(again, first)


def test_bad_eps_and_launch_configs_are_value_errors():
    """eps must be finite and >= 0 (a negative one makes a zero row's RMS NaN); a config's tiles powers of two
    >= 16, its warps a power of two <= 16, its stages >= 1; each error names the argument."""
    x, w = torch.randn(1, 32), torch.randn(16, 32)
    for eps in (-1.0, float("nan"), float("inf"), True, "1e-6"):
        with pytest.raises(ValueError, match=r"^eps: expected a finite number >= 0"):
            skinny_linear(x, w, norm_weight=torch.ones(32), eps=eps)
        with pytest.raises(ValueError, match=r"^eps: expected a finite number >= 0"):
            skinny_linear_ref(x, w, norm_weight=torch.ones(32), eps=eps)
    for field, bad in (
        ("block_n", 24),
        ("block_k", 8),
        ("num_warps", 3),
        ("num_stages", 0),
        ("fma", 1),
        ("one_tile", 1),
        ("split_k", 3),
        ("split_k", 0),
        ("split_k", 128),
        ("split_k", True),
    ):
        cfg = dataclasses.replace(SkinnyConfig(), **{field: bad})
        with pytest.raises(ValueError, match=rf"^config\.{field}: expected"):
            skinny_linear(x, w, config=cfg)
    with pytest.raises(ValueError, match=r"^config: expected a SkinnyConfig"):
        skinny_linear(x, w, config={"block_n": 16})
    torch.testing.assert_close(skinny_linear(x, w, norm_weight=torch.ones(32), eps=0), skinny_linear_ref(
        x, w, norm_weight=torch.ones(32), eps=0), rtol=1e-5, atol=1e-5)  # fmt: skip
