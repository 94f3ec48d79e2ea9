"""fspec.ops.ttt_attention: the chunked, recomputing TTT attention equals the dense masked one (values and
gradients) and keeps no score matrix for the backward pass."""

from __future__ import annotations

import pytest
import torch

from fspec.ops.attention import dense_attention
from fspec.ops.ttt_attention import ttt_attention
from fspec.train.ttt import ttt_mask


def _inputs(b, s, n, nkv, d, steps, *, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(True)

    q = rand(b, s, n, d)
    keys = [rand(b, s, nkv, d) for _ in range(steps + 1)]
    values = [rand(b, s, nkv, d) for _ in range(steps + 1)]
    return q, keys, values


def _dense(q, keys, values):
    mask = ttt_mask(q.shape[1], len(keys) - 1)[None]
    return dense_attention(q, torch.cat(keys, 1), torch.cat(values, 1), mask=mask)


@pytest.mark.parametrize(
    "b,s,n,nkv,d,steps,chunk",
    [(1, 1, 2, 2, 4, 1, None), (2, 13, 4, 2, 8, 1, 5), (3, 17, 6, 2, 5, 3, 1), (2, 9, 4, 1, 16, 6, 4),
     (1, 31, 8, 8, 3, 2, 64)],
)  # fmt: skip
def test_equals_dense_masked_attention_values_and_gradients(b, s, n, nkv, d, steps, chunk):
    """Irregular shapes (S of 1 and primes, GQA groups 1, 2, 3, 4, head dims 3..16), every chunk size from one
    row to more than S: output and the gradients of q and of every step's keys and values equal the dense
    attention under ttt_mask to fp64 rounding."""
    q, keys, values = _inputs(b, s, n, nkv, d, steps)
    grad_out = torch.randn(b, s, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    got = ttt_attention(q, keys, values, chunk=chunk)
    want = _dense(q, keys, values)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    leaves = [q, *keys, *values]
    g_got = torch.autograd.grad((got * grad_out).sum(), leaves)
    g_want = torch.autograd.grad((want * grad_out).sum(), leaves)
    for name, x, y in zip(["q"] + [f"k{i}" for i in range(steps + 1)] + [f"v{i}" for i in range(steps + 1)],
                          g_got, g_want):  # fmt: skip
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_float32_and_bfloat16_inputs_accumulate_in_float32():
    """Low-precision inputs give their own dtype back, computed in fp32: bf16 within bf16 rounding of the
    fp64 result."""
    q, keys, values = _inputs(2, 11, 4, 2, 8, 2)
    want = _dense(q, keys, values)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        got = ttt_attention(q.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values])
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_composes_with_vmap_and_func_grad():
    """vmap over a leading axis of stacked inputs equals a loop; torch.func.grad equals autograd."""
    stacks = [_inputs(2, 7, 4, 2, 8, 2, seed=s) for s in range(3)]

    def loss(q, k0, k1, k2, v0, v1, v2):
        return ttt_attention(q, [k0, k1, k2], [v0, v1, v2], chunk=3).square().sum()

    qs = torch.stack([st[0].detach() for st in stacks])
    ks = [torch.stack([st[1][i].detach() for st in stacks]) for i in range(3)]
    vs = [torch.stack([st[2][i].detach() for st in stacks]) for i in range(3)]
    grads = torch.func.vmap(torch.func.grad(loss))(qs, *ks, *vs)
    for i, (q, keys, values) in enumerate(stacks):
        want = torch.autograd.grad(_dense(q, keys, values).square().sum(), q)[0]
        torch.testing.assert_close(grads[i], want, rtol=1e-10, atol=1e-10)


def test_keeps_no_score_matrix_for_the_backward_pass():
    """Saved for backward: q, keys, values, output and one log-sum-exp per (row, head). At S = 64 and three
    steps every saved tensor holds at most B·S·J·Nkv·D = 3072 values, a quarter of one S x S score matrix of
    one head (4096); PyTorch's math attention backend, which CUDA SDPA falls back to for a boolean mask with
    grouped-query heads, keeps [B, N, S, 4S] of them."""
    b, s, n, nkv, d, steps = 1, 64, 4, 2, 8, 3
    q, keys, values = _inputs(b, s, n, nkv, d, steps)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ttt_attention(q, keys, values, chunk=16).sum()
    bound = b * s * steps * nkv * d
    assert bound < s * s and saved and max(t.numel() for t in saved) <= bound


def test_bad_key_lists_name_the_argument():
    q, keys, values = _inputs(1, 5, 2, 1, 4, 2)
    with pytest.raises(ValueError, match="^keys/values: expected the same number"):
        ttt_attention(q, keys[:1], values[:1])
    with pytest.raises(ValueError, match="^keys/values: expected the same number"):
        ttt_attention(q, keys, values[:2])
    with pytest.raises(ValueError, match=r"^q: expected a float \[B, S, N, D\] tensor, got \(5, 2, 4\)"):
        ttt_attention(q[0], keys, values)
    with pytest.raises(ValueError, match=r"^keys\[1\]: expected a float \[B=1, S=5, Nkv, D=4\] tensor"):
        ttt_attention(q, [keys[0], keys[1][:, :3]], values[:2])
    with pytest.raises(ValueError, match=r"^values\[0\]: expected a float"):
        ttt_attention(q, keys, [values[0].long(), *values[1:]])
    wide = torch.randn(1, 5, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="^keys: expected KV heads dividing q's 2 heads"):
        ttt_attention(q, [wide, wide], [wide, wide])
    with pytest.raises(ValueError, match="^chunk: expected a positive int or None, got 0"):
        ttt_attention(q, keys, values, chunk=0)


def test_autocast_does_not_change_the_computation():
    """Under bf16 autocast (how `--autocast` distillation runs) the forward pass still computes in fp32, as
    the backward pass recomputes it: output and gradients are bit-identical to the run without autocast."""
    q, keys, values = _inputs(2, 10, 4, 2, 8, 2, dtype=torch.float32)
    leaves = [q, *keys, *values]
    plain = ttt_attention(q, keys, values, chunk=4)
    g_plain = torch.autograd.grad(plain.square().sum(), leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = ttt_attention(q, keys, values, chunk=4)
        g_cast = torch.autograd.grad(cast.float().square().sum(), leaves)
    assert cast.dtype == torch.float32 and torch.equal(cast, plain)
    assert all(torch.equal(a, b) for a, b in zip(g_cast, g_plain))
