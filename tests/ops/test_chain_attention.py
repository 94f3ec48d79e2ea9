"""fspec.ops.chain_attention against a dense masked softmax: values, gradients, vmap, and what it keeps."""

from __future__ import annotations

import warnings

import pytest
import torch

from fspec.ops.chain_attention import chain_attention, fused_available


def dense_reference(q, ks, vs, kd, vd, mine):
    """The same attention as one masked softmax over [S shared + Kc chain] keys, materialised."""
    s, d = q.shape[3], q.shape[4]
    shared = torch.einsum("bkgsd,bktd->bkgst", q, ks)
    own = torch.einsum("bkgsd,bkstd->bkgst", q, kd)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    visible = torch.cat((causal, mine[None, :].expand(s, -1)), dim=-1)
    p = torch.cat((shared, own), dim=-1).mul(d**-0.5).masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bkgst,bktd->bkgsd", p[..., :s], vs) + torch.einsum(
        "bkgst,bkstd->bkgsd", p[..., s:], vd
    )


def _inputs(b=2, nkv=3, g=2, s=13, kc=4, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: (torch.randn(*shape, generator=gen, dtype=dtype) * 2).requires_grad_()  # noqa: E731
    return (
        make(b, nkv, g, s, d),
        make(b, nkv, s, d),
        make(b, nkv, s, d),
        make(b, nkv, s, kc, d),
        make(b, nkv, s, kc, d),
    )


@pytest.mark.parametrize("mine", [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
@pytest.mark.parametrize("path", [{"chunk": 1}, {"chunk": 5}, {"chunk": None}, {"fused": True}])
def test_equals_the_dense_masked_softmax_and_its_gradients(mine, path):
    """fp64, irregular shapes (S = 13 over chunks of 1, 5 or all rows, or the causal block through the
    CPU flash kernel merged by log-sum-exp; GQA 3 x 2 heads): output and the gradients of all five inputs
    to 1e-12."""
    x = _inputs()
    m = torch.tensor(mine, dtype=torch.bool)
    w = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = chain_attention(*x, m, **({"fused": False} | path))
    want = dense_reference(*x, m)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad((got * w).sum(), x)
    g_want = torch.autograd.grad((want * w).sum(), x)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if not any(mine):  # a slot no step sees gets no gradient
        assert not g_got[3].any() and not g_got[4].any()


def test_fp32_and_bf16_inputs_accumulate_in_fp32_and_return_the_query_dtype():
    x = [t.detach() for t in _inputs(dtype=torch.float32, seed=1)]
    m = torch.tensor([1, 0, 1, 0], dtype=torch.bool)
    want = dense_reference(*[t.double() for t in x], m)
    for fused in (False, True):
        got = chain_attention(*x, m, chunk=4, fused=fused)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        half = [t.bfloat16() for t in x]
        got = chain_attention(*half, m, fused=fused)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(
            got.double(), dense_reference(*[t.double() for t in half], m), rtol=2e-2, atol=2e-2
        )


def test_the_flash_kernel_is_the_default_where_it_runs_and_never_under_vmap():
    """On the CPU the causal block goes through the flash kernel unless told not to; under vmap (even
    wrapped by grad) it never does: the kernel has no batching rule, and its per-sample fallback warns."""
    q = _inputs()[0].detach()
    assert fused_available(q, q[:, :, 0], q[:, :, 0]) and fused_available(*[q.bfloat16()] * 3)
    seen = []
    torch.func.vmap(lambda x: seen.append(fused_available(x, x, x)) or x)(q)
    torch.func.grad(lambda x: seen.append(fused_available(x, x, x)) or x.sum())(q)
    torch.func.vmap(torch.func.grad(lambda x: seen.append(fused_available(x, x, x)) or x.sum()))(q)
    assert seen == [False, True, False]
    batched_keys = []  # q unbatched, the keys batched (vmap over keys alone)
    torch.func.vmap(lambda k: batched_keys.append(fused_available(q, k, q)) or k)(torch.stack([q, q]))
    assert batched_keys == [False]


def test_vmap_and_grad_over_a_leading_axis_equal_a_loop():
    """torch.func.vmap(grad(...)) over a stack of 3 problems equals three separate calls (the generated vmap
    rule of the autograd.Function)."""
    xs = [torch.stack([_inputs(seed=i)[j].detach() for i in range(3)]) for j in range(5)]
    m = torch.tensor([1, 1, 1, 0], dtype=torch.bool)

    def loss(q, ks, vs, kd, vd):
        return chain_attention(q, ks, vs, kd, vd, m, chunk=4).square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no per-sample fallback of an op without a batching rule
        grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2, 3, 4)))(*xs)
    for i in range(3):
        one = torch.func.grad(lambda *a: dense_reference(*a, m).square().sum(), argnums=(0, 1, 2, 3, 4))(
            *[x[i] for x in xs]
        )
        for a, b in zip(grads, one):
            torch.testing.assert_close(a[i], b, rtol=1e-10, atol=1e-12)


def _saved_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of fn(*args) (beyond the inputs)."""
    ids = {t.data_ptr() for t in args}
    kept: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in ids:
            kept[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args).sum()
    return sum(kept.values())


def test_keeps_o_of_s_for_the_backward_pass_where_the_dense_form_keeps_o_of_s_squared():
    """Doubling S doubles what chain_attention keeps beyond its inputs (the output and a log-sum-exp per
    row), while the dense softmax's kept probabilities grow 4x; at S = 512 the dense form keeps > 25x more."""
    m = torch.tensor([1, 1, 0, 0], dtype=torch.bool)
    lean, dense = [], []
    for s in (256, 512):
        x = _inputs(b=1, nkv=2, g=2, s=s, kc=4, d=16, dtype=torch.float32)
        lean.append(_saved_bytes(lambda *a: chain_attention(*a, m), *x))
        for fused in (False, True):
            assert _saved_bytes(lambda *a, f=fused: chain_attention(*a, m, fused=f), *x) == lean[-1]
        dense.append(_saved_bytes(lambda *a: dense_reference(*a, m), *x))
    assert lean[1] <= 2.1 * lean[0], lean
    assert dense[1] >= 3.5 * dense[0], dense
    assert dense[1] > 25 * lean[1], (dense, lean)  # seen: 33x


def test_the_backward_runs_untracked_so_it_is_once_differentiable():
    """The backward pass records no graph of its own chunked ops (`once_differentiable`): under
    `torch.func.grad` an autograd.Function's backward otherwise runs with grad on, and every chunk's
    [B, N, C, S] temporaries stayed alive until the backward ended (a TTT step at SmolLM2 head shapes kept
    34.7 GiB instead of 24.0). The contract that shows it: a second derivative is refused, not computed."""
    q, ks, vs, kd, vd = _inputs()
    out = chain_attention(q, ks, vs, kd, vd, torch.tensor([True, True, False, False]), chunk=5)
    (dq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError):  # "does not require grad" or "not used in the graph"
        torch.autograd.grad(dq.sum(), (q,))
    first = torch.func.grad(lambda x: chain_attention(x, ks, vs, kd, vd, torch.tensor([True] * 4)).sum())
    torch.testing.assert_close(
        first(q.detach()),
        torch.autograd.grad(chain_attention(q, ks, vs, kd, vd, torch.tensor([True] * 4)).sum(), (q,))[0],
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mine", [[0, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
def test_the_cuda_flash_path_equals_the_chunks_and_the_dense_softmax(dtype, mine):
    """CUDA, half precision, irregular shapes (S = 37, GQA 3 x 3 heads of 64, Kc = 5): the flash-kernel path
    (default there) against the fp32-accumulating chunks and the fp64 dense softmax, output and the five
    gradients (scaled by the largest fp64 gradient). Bound: the half-precision inputs' own rounding plus the
    kernel's half-precision P·V product: rtol 3e-2, atol 2e-2 in bf16 (8 mantissa bits), 1e-2 / 5e-3 in fp16
    (11 bits)."""
    x = [
        t.detach().to("cuda", dtype).requires_grad_()
        for t in _inputs(b=3, nkv=3, g=3, s=37, kc=5, d=64, dtype=torch.float32, seed=4)
    ]
    m = torch.tensor(mine, dtype=torch.bool, device="cuda")
    w = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(9)).to("cuda", dtype)
    tol = {"rtol": 3e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-2, "atol": 5e-3}
    assert fused_available(*x[:3]) and not fused_available(*[t.float() for t in x[:3]])
    # an fp32 q with half keys, as bf16 autocast training hands them over: the kernel in the keys' dtype
    assert fused_available(x[0].float(), *x[1:3])
    mixed = chain_attention(x[0].detach().float(), *[t.detach() for t in x[1:]], m)
    assert mixed.dtype == torch.float32
    with pytest.raises(ValueError, match="fused"):
        chain_attention(*[t.float() for t in x], m, fused=True)
    fused = chain_attention(*x, m)
    chunks = chain_attention(*x, m, fused=False)
    xd = [t.detach().double().requires_grad_() for t in x]
    want = dense_reference(*xd, m)
    torch.testing.assert_close(fused.double(), want, **tol)
    torch.testing.assert_close(fused.double(), chunks.double(), **tol)
    g_fused = torch.autograd.grad((fused * w).sum(), x)
    g_chunks = torch.autograd.grad((chunks * w).sum(), x)
    g_want = torch.autograd.grad((want * w.double()).sum(), xd)
    for a, b, c in zip(g_fused, g_chunks, g_want):
        scale = max(c.abs().max().item(), 1.0)  # gradients of O(10) (of 0 for slots no step sees)
        torch.testing.assert_close(a.double() / scale, c / scale, **tol)
        torch.testing.assert_close(b.double() / scale, c / scale, **tol)
