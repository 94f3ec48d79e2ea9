"""torch.library registrations: schema / fake / dispatch checks, and the interpreted kernel runs in eager."""

import pytest
import torch

from fspec.kernels import gumbel, ops, rejection


def _gumbel_args(n: int = 3, v: int = 37):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, v, generator=gen),
        torch.tensor([0.0, 0.9, 1.4])[:n],
        torch.arange(n),
        torch.arange(n),
    )


def _rejection_args(b: int = 3, k: int = 2, v: int = 37):
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(b, k + 1, v, generator=gen)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    q = torch.softmax(torch.randn(b, k, v, generator=gen), -1)
    return target, drafts, q, torch.tensor([0.0, 1.0, 0.6])[:b], torch.arange(b), torch.arange(b) * 5


def test_ops_pass_torch_library_opcheck():
    """Schemas, fake implementations and mutation declarations are consistent (torch.library.opcheck)."""
    logits, t, seeds, positions = _gumbel_args()
    torch.library.opcheck(torch.ops.fspec.gumbel_sample.default, (logits, t, seeds, positions, 2))
    out_tokens, out_probs = torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4, 37)
    torch.library.opcheck(
        torch.ops.fspec.gumbel_sample_into.default,
        (logits, t, seeds, positions, 0, out_tokens, out_probs, torch.tensor(3)),
    )
    d2t = torch.arange(37) % 5  # EAGLE-3's id offsets
    torch.library.opcheck(
        torch.ops.fspec.gumbel_sample_into.default,
        (logits, t, seeds, positions, 0, out_tokens, out_probs, torch.tensor(1), d2t),
    )
    torch.library.opcheck(  # a draft step's call: int32 seq_lens and the position offset
        torch.ops.fspec.gumbel_sample_into.default,
        (logits, t, seeds, positions.int(), 0, out_tokens, out_probs, torch.tensor(2), d2t, 1),
    )
    args = _rejection_args()
    torch.library.opcheck(torch.ops.fspec.rejection_sample.default, args)
    torch.library.opcheck(torch.ops.fspec.rejection_sample.default, (*args[:2], None, *args[3:]))


# slow (~20 s interpreted): tests/ops/test_sampling.py's compiled test traces the same fakes by default
@pytest.mark.slow
def test_ops_with_sampling_options_pass_opcheck():
    """The ops with top_k / top_p / min_p, and fspec::sampling_filter itself (rows_per_request K + 1), are
    consistent with their schemas and fakes."""
    logits, t, seeds, positions = _gumbel_args()
    opts = (
        torch.tensor([3, 0, 2], dtype=torch.int32),
        torch.tensor([1.0, 0.8, 0.9]),
        torch.tensor([0.0, 0.1, 0.0]),
    )
    out_tokens, out_probs = torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4, 37)
    torch.library.opcheck(
        torch.ops.fspec.gumbel_sample_into.default,
        (logits, t, seeds, positions, 0, out_tokens, out_probs, torch.tensor(3), None, 0, *opts),
    )
    args = _rejection_args()
    torch.library.opcheck(torch.ops.fspec.sampling_filter.default, (args[0], args[3], *opts, 3))
    torch.library.opcheck(torch.ops.fspec.rejection_sample.default, (*args, *opts))


def test_metadata_and_rope_ops_pass_opcheck():
    """The one-launch step metadata (every mode, with and without `count`) and RoPE tables ops: schemas,
    fake implementations (shapes, dtypes) and the no-aliasing rule, in eager (interpreted kernel) and fake."""
    from fspec.kernels.step_metadata import MODE_ADVANCE, MODE_AFTER, MODE_DECODE, MODE_FIRST

    table = torch.tensor([[3, 1, -1], [0, 2, 4]], dtype=torch.int32)
    start, count = torch.tensor([5, -1]), torch.tensor([2, 0])
    op = torch.ops.fspec.step_metadata.default
    torch.library.opcheck(op, (start, None, table, 1, 4, 12, MODE_DECODE))
    torch.library.opcheck(op, (torch.tensor([6, 0], dtype=torch.int32), None, table, 1, 4, 12, MODE_AFTER))
    torch.library.opcheck(op, (start, count, table, 3, 4, 12, MODE_FIRST))
    torch.library.opcheck(op, (start, torch.tensor([6, 0], dtype=torch.int32), table, 1, 4, 12, MODE_ADVANCE))
    torch.library.opcheck(op, (torch.tensor([6, 0], dtype=torch.int32), None, table, 1, 4, 12, MODE_AFTER, 5))
    inv_freq = torch.tensor([1.0, 0.25, 0.01])
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(
            torch.ops.fspec.rope_cos_sin.default, (torch.tensor([[0, 7], [-1, 300]]), inv_freq, dtype)
        )
        rope = (6, "llama3", [500000.0, 8.0, 1.0, 4.0, 8192.0])  # head dim 6, Llama-3.1's scaling
        torch.library.opcheck(
            torch.ops.fspec.rope_tables.default, (torch.tensor([[0, 7], [-1, 300]]), dtype, *rope)
        )


def test_ops_run_the_interpreted_kernels_in_eager(monkeypatch):
    """With TRITON_INTERPRET=1 the eager ops call the Triton launchers, not the references."""
    logits, t, seeds, positions = _gumbel_args()
    args = _rejection_args()
    want_tokens = gumbel.gumbel_sample_ref(logits, t, seeds, positions)
    want_verified = rejection.rejection_sample_ref(*args)

    def refuse(*a, **k):
        raise AssertionError("the reference ran instead of the kernel")

    monkeypatch.setattr(gumbel, "gumbel_sample_ref", refuse)
    monkeypatch.setattr(rejection, "rejection_sample_ref", refuse)
    assert ops.kernels_interpreted()
    assert torch.equal(torch.ops.fspec.gumbel_sample(logits, t, seeds, positions, 0), want_tokens)
    got = torch.ops.fspec.rejection_sample(*args)
    assert torch.equal(got[0], want_verified[0]) and torch.equal(got[1], want_verified[1])


def test_ops_fall_back_to_the_reference_when_not_interpreted(monkeypatch):
    """Without the interpreter, CPU tensors run the PyTorch reference."""
    logits, t, seeds, positions = _gumbel_args()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ops.kernels_interpreted()

    def refuse(*a, **k):
        raise AssertionError("the kernel ran on a CPU tensor without the interpreter")

    monkeypatch.setattr(gumbel, "gumbel_sample", refuse)
    tokens = torch.ops.fspec.gumbel_sample(logits, t, seeds, positions, 0)
    monkeypatch.undo()
    assert torch.equal(tokens, gumbel.gumbel_sample_ref(logits, t, seeds, positions))


@pytest.mark.parametrize("k", [1, 8])
def test_rejection_fake_shapes(k):
    """The fake rejection op returns [B, K+1] and [B] int64 on the input's device."""
    with torch._subclasses.fake_tensor.FakeTensorMode():
        target = torch.empty(4, k + 1, 11)
        ids = torch.empty(4, dtype=torch.int64)
        drafts = torch.empty(4, k, dtype=torch.int64)
        tokens, n = torch.ops.fspec.rejection_sample(target, drafts, None, torch.empty(4), ids, ids)
        assert tokens.shape == (4, k + 1) and n.shape == (4,)
        assert tokens.dtype == n.dtype == torch.int64
