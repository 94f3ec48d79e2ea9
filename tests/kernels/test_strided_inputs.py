"""The launchers read per-row inputs at `ptr + row`: strided and expanded views must give the results of
their contiguous copies (each view interleaves poison values that a stride-1 read would pick up)."""

import torch

from fspec.kernels import gumbel, rejection
from fspec.kernels.kv_write import kv_write
from fspec.kernels.paged_attention import paged_attention


def _interleave(x: torch.Tensor, poison) -> torch.Tensor:
    """A stride-2 view equal to x whose skipped elements hold `poison`."""
    full = torch.full((2 * x.shape[0],), poison, dtype=x.dtype)
    full[::2] = x
    return full[::2]


def test_gumbel_launcher_reads_strided_and_expanded_rows():
    gen = torch.Generator().manual_seed(0)
    n, v = 6, 41
    logits = torch.randn(n, v, generator=gen)
    temp = torch.tensor([0.0, 0.0, 0.7, 0.0, 1.3, 0.0])
    pos = torch.arange(n) * 3
    want = gumbel.gumbel_sample(logits, temp, torch.full((n,), 11), pos)
    # poison: huge temperatures (near-uniform sampling) and positions of another stream
    got = gumbel.gumbel_sample(
        logits, _interleave(temp, 1e4), torch.tensor(11).expand(n), _interleave(pos, 12345)
    )
    assert torch.equal(got, want)
    assert torch.equal(want, gumbel.gumbel_sample_ref(logits, temp, torch.full((n,), 11), pos))


def test_rejection_launcher_reads_strided_rows():
    gen = torch.Generator().manual_seed(1)
    b, k, v = 4, 3, 29
    target = torch.randn(b, k + 1, v, generator=gen)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    q = torch.softmax(torch.randn(b, k, v, generator=gen), -1)
    temp, seed, pos = torch.tensor([0.0, 1.0, 0.5, 0.0]), torch.arange(b) + 3, torch.arange(b) * 7
    want = rejection.rejection_sample(target, drafts, q, temp, seed, pos)
    got = rejection.rejection_sample(
        target, drafts, q, _interleave(temp, 1e4), _interleave(seed, 999), _interleave(pos, 4321)
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kv_write_launcher_reads_a_strided_slot_mapping():
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    slots = torch.tensor([9, -1, 3, 30])
    caches = [torch.zeros(1, 4, 8, 2, 16) for _ in range(4)]
    kv_write(k, v, caches[0], caches[1], slots)
    kv_write(k, v, caches[2], caches[3], _interleave(slots, 17))  # 17: a slot no token owns
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_paged_attention_launcher_reads_strided_metadata():
    gen = torch.Generator().manual_seed(3)
    bs, nb, nkv, group, d = 4, 12, 2, 2, 16
    kc = torch.randn(1, nb, bs, nkv, d, generator=gen)
    vc = torch.randn(1, nb, bs, nkv, d, generator=gen)
    table = torch.tensor([[0, 1, 2, -1], [5, 6, -1, -1], [3, 4, 7, 8]], dtype=torch.int32)
    seq = torch.tensor([10, 6, 15], dtype=torch.int32)
    pos = torch.tensor([9, 5, 14])
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    q = torch.randn(3, nkv * group, d, generator=gen)
    kw = dict(scale=0.25, num_query=1)
    want = paged_attention(q, kc, vc, table, seq, pos, qsl, **kw)
    got = paged_attention(
        q, kc, vc, table, _interleave(seq, 2), _interleave(pos, 1), _interleave(qsl, 0), **kw
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
