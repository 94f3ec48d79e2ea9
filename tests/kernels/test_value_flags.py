"""fspec::value_flags (kernels/value_flags.py): the public functions' value checks in one launch, against the
plain-PyTorch reference bit for bit, on irregular shapes with each bad value planted alone and together."""

import pytest
import torch
from fresh_process import in_fresh_process

from fspec.kernels import ops
from fspec.kernels import value_flags as vf
from fspec.kernels.philox import POSITION_MASK

ALL = (vf.FLAG_TEMPERATURE, vf.FLAG_LOGITS, vf.FLAG_POSITIONS, vf.FLAG_COL, vf.FLAG_DRAFTS, vf.FLAG_PROBS)


def _clean(b: int, s: int, v: int, k: int, dtype=torch.float32, seed: int = 0) -> dict:
    """Valid inputs: logits [B, S, V] (S = 1: [B, V]), a greedy and sampled mix, K drafts with their q."""
    gen = torch.Generator().manual_seed(seed)
    shape = (b, v) if s == 1 else (b, s, v)
    logits = (torch.randn(shape, generator=gen) * 4).to(dtype)
    logits.view(-1)[:: max(1, v // 3)] = float("-inf")  # -inf and NaN are allowed (they count as -inf)
    logits.view(-1)[1 :: max(2, v // 2)] = float("nan")
    temperature = torch.tensor([0.0, 0.7, 1.3, 1e-3, 2.0])[torch.arange(b) % 5]
    probs = torch.rand(b, k, v, generator=gen)
    probs = probs / probs.sum(-1, keepdim=True)
    probs[0, 0, 0] = 0.0  # the edge of every valid range is in the clean inputs, its neighbour planted below
    positions = torch.randint(-1, POSITION_MASK - 8, (b,), generator=gen)
    positions[0], positions[-1] = (-1, POSITION_MASK - (s - 1)) if b > 1 else (POSITION_MASK - (s - 1), 0)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    drafts[0, 0], drafts[-1, 0] = 0, v - 1
    d2t = torch.randint(0, 5, (v,), generator=gen)
    d2t[-1] = -(v - 1)  # t + d2t[t] = 0 at the last token
    return dict(
        logits=logits,
        temperature=temperature,
        positions=positions,
        span=s - 1,
        col=torch.tensor(k - 1),
        ncols=k,
        draft_tokens=drafts,
        draft_probs=probs,
        d2t=d2t if s == 1 else None,
    )


def _plant(args: dict, bit: int, where: int) -> dict:
    """One bad value for `bit`, in request `where` (the last vocabulary entry where there is one)."""
    a = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in args.items()}
    if bit == vf.FLAG_TEMPERATURE:
        a["temperature"][where] = -0.5 if where % 2 else float("nan")
    elif bit == vf.FLAG_LOGITS:
        a["logits"][where].view(-1)[-1] = float("inf")
    elif bit == vf.FLAG_POSITIONS:
        a["positions"][where] = -2 if where % 2 else POSITION_MASK - a["span"] + 1
    elif bit == vf.FLAG_COL:
        a["col"] = torch.tensor(a["ncols"], device=a["col"].device)
    elif bit == vf.FLAG_DRAFTS:
        a["draft_tokens"][where, -1] = a["logits"].shape[-1] if where % 2 else -1
    elif bit == vf.FLAG_PROBS:
        a["draft_probs"][where, 0, -1] = -1e-9 if where % 2 else float("inf")
    elif bit == vf.FLAG_D2T:
        a["d2t"][-1] = -a["logits"].shape[-1]  # t + d2t[t] = -1 at the last token
    return a


def _both(a: dict) -> tuple[int, int]:
    got = int(vf.value_flags(**a, block=64))
    want = int(vf.value_flags_ref(**a))
    return got, want


# slow: the two large interpreted shapes (~16 s each). The default run keeps one vocabulary block with d2t,
# several blocks over K + 1 slots (5, 4, 130, 3), and d2t over several blocks in
# test_drafts_in_chunks_and_vocabulary_blocks_within_grid_axis_1.
@pytest.mark.parametrize(
    "b, s, v, k",
    [
        (1, 1, 7, 1),
        pytest.param(3, 1, 1031, 4, marks=pytest.mark.slow),
        (5, 4, 130, 3),
        pytest.param(37, 1, 65, 2, marks=pytest.mark.slow),
    ],
)
def test_kernel_equals_reference_bit_for_bit(b, s, v, k):
    """Clean inputs give 0; each bad value, planted alone in the first, a middle and the last request (and
    the last vocabulary block), sets exactly its bit in both; all planted at once set all of them."""
    args = _clean(b, s, v, k)
    assert _both(args) == (0, 0)
    bits = ALL + ((vf.FLAG_D2T,) if args["d2t"] is not None else ())
    for bit in bits:
        for where in sorted({0, b // 2, b - 1}):
            assert _both(_plant(args, bit, where)) == (bit, bit), (bit, where)
    every = args
    for bit in bits:
        every = _plant(every, bit, b - 1)
    assert _both(every) == (sum(bits), sum(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_and_temperature_overflow(dtype):
    """bf16 / fp16 logits are read as float32. A sampled row whose largest finite |logit| / T overflows
    float32 sets FLAG_LOGITS; the same T on a greedy-free row of small logits does not, nor T = 0."""
    args = _clean(4, 1, 300, 2, dtype=dtype)
    args["logits"] = args["logits"].clamp(-3, 3)
    args["temperature"] = torch.tensor([0.0, 1e-37, 1.0, 0.5])
    assert _both(args) == (0, 0)  # 3 / 1e-37 = 3e37 is finite
    args["logits"][1, 5] = 60000.0 if dtype == torch.float16 else 1e38
    assert _both(args) == (vf.FLAG_LOGITS, vf.FLAG_LOGITS)  # 6e4 / 1e-37 or 1e38 / 1e-37 overflows
    args["temperature"][1] = 0.0  # greedy: no scaling
    assert _both(args) == (0, 0)


def test_strided_logits_and_empty_batches():
    """A [B, K+1, V] view with padded request and slot strides is read where it lies; B = 0 gives 0."""
    args = _clean(3, 3, 50, 2)
    big = torch.zeros(3, 4, 64)
    big[:, :3, :50] = args["logits"]
    big[:, 3] = float("inf")  # outside the view: must not be read
    args["logits"] = big[:, :3, :50]
    assert _both(args) == (0, 0)
    empty = dict(
        logits=torch.zeros(0, 9), temperature=torch.zeros(0), positions=torch.zeros(0, dtype=torch.long)
    )
    assert int(vf.value_flags(**empty)) == 0 and int(vf.value_flags_ref(**empty)) == 0


def test_the_op_runs_the_kernel_and_has_a_fake():
    """Through torch.ops.fspec (interpreted kernel) and under FakeTensorMode: int32 [1]."""
    a = _plant(_clean(3, 1, 40, 2), vf.FLAG_POSITIONS, 1)
    flags = torch.ops.fspec.value_flags(
        a["logits"], a["temperature"], a["positions"], 0, a["col"], 2, None, None, a["d2t"]
    )
    assert flags.dtype == torch.int32 and flags.shape == (1,) and int(flags) == vf.FLAG_POSITIONS
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.fspec.value_flags(
            mode.from_tensor(a["logits"]), mode.from_tensor(a["temperature"]),
            mode.from_tensor(a["positions"]), 0, None, 0, None, None, None,
        )  # fmt: skip
    assert fake.shape == (1,) and fake.dtype == torch.int32
    assert ops.kernels_interpreted()


def _compile_for_sm90_body():
    """The kernel compiles for the H200 (sm_90) with every optional check on, bf16 logits, without register
    spills, and sets its flags with one atomic per program."""
    import inspect
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fspec.kernels.value_flags import _value_flags_kernel

    types = {"logits_ptr": "*bf16", "temperature_ptr": "*fp32", "probs_ptr": "*fp32", "d2t_ptr": "*i32"}
    types.update(flags_ptr="*i32", positions_ptr="*i64", col_ptr="*i64", drafts_ptr="*i64")
    consts = {"BLOCK": 2048, "K_POW2": 8, "HAS_COL": True, "HAS_DRAFTS": True, "HAS_PROBS": True}
    consts.update(HAS_D2T=True, PDL=True)
    names = list(inspect.signature(_value_flags_kernel.fn).parameters)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=_value_flags_kernel, signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    nvdisasm = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    assert "STL" not in sass, "the value-flags kernel spills registers"
    assert "ATOM" in sass or "RED" in sass, "no atomic OR of the flags"


def test_kernel_compiles_for_sm90():
    in_fresh_process(__file__, globals(), "_compile_for_sm90_body")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_equals_reference():
    in_fresh_process(__file__, globals(), "_gpu_body")


def _gpu_body():
    """On CUDA: the compiled kernel and the reference agree on clean and planted inputs (fp32 and bf16
    logits, a 32000 slice of vocabulary and a verification layout), and the public functions refuse each
    bad value with the ValueError naming it."""
    import fspec

    for b, s, v, k, dtype in ((3, 1, 32000, 4, torch.float32), (5, 4, 1031, 3, torch.bfloat16)):
        args = _clean(b, s, v, k, dtype=dtype)
        args = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
        bits = ALL + ((vf.FLAG_D2T,) if args["d2t"] is not None else ())
        assert (int(vf.value_flags(**args)), int(vf.value_flags_ref(**args))) == (0, 0)
        for bit in bits:
            a = _plant(args, bit, b - 1)
            assert (int(vf.value_flags(**a)), int(vf.value_flags_ref(**a))) == (bit, bit), bit
    logits = torch.randn(2, 100, device="cuda")
    t, seed, pos = (
        torch.tensor([1.0, -1.0], device="cuda"),
        torch.zeros(2, dtype=torch.long, device="cuda"),
        None,
    )
    pos = torch.zeros(2, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="temperature: expected finite values >= 0"):
        fspec.gumbel_sample(logits, t, seed, pos)


def test_drafts_in_chunks_and_vocabulary_blocks_within_grid_axis_1(monkeypatch):
    """Caps lowered: 5 drafts per request checked 2 at a time (MAX_DRAFTS_PER_LOAD, the bad one planted in
    the last, partial chunk) and the vocabulary blocks of grid axis 1 kept within gumbel.MAX_GRID_Y = 3 (the
    block grows from 64 to 512 for V = 1031): bit for bit the reference's flags, each planted alone."""
    from fspec.kernels import gumbel

    monkeypatch.setattr(vf, "MAX_DRAFTS_PER_LOAD", 2)
    monkeypatch.setattr(gumbel, "MAX_GRID_Y", 3)
    assert vf.draft_block(5) == 2 and gumbel.vocab_blocks(1031, 64)[:2] == (512, 3)
    args = _clean(3, 1, 1031, 5, seed=4)
    assert _both(args) == (0, 0)
    for bit in (vf.FLAG_DRAFTS, vf.FLAG_LOGITS, vf.FLAG_PROBS, vf.FLAG_D2T):
        for where in (0, 2):
            assert _both(_plant(args, bit, where)) == (bit, bit), (bit, where)
