"""kernels/dispatch.py: eager calls with plain tensors skip the dispatcher; everything that could observe
the difference (autograd, tracing, fake tensors, dispatch modes) still goes through the op."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fspec.kernels import dispatch, gumbel, ops


@pytest.fixture
def recorded(monkeypatch):
    """Calls that reached gumbel_sample's implementation through the typed function's direct path (the op
    itself calls the function it was registered with, not `ops.gumbel_sample.impl`)."""
    seen = []
    impl = ops.gumbel_sample.impl

    def spy(*args, **kwargs):
        seen.append(args[0])
        return impl(*args, **kwargs)

    monkeypatch.setattr(ops.gumbel_sample, "impl", spy)
    return seen


def _args(requires_grad: bool = False):
    logits = torch.randn(3, 41, generator=torch.Generator().manual_seed(0)).requires_grad_(requires_grad)
    return logits, torch.tensor([0.0, 1.0, 0.7]), torch.arange(3), torch.arange(3) + 9, 0


def test_eager_call_with_plain_tensors_skips_the_dispatcher_and_equals_the_op(recorded):
    args = _args()
    got = ops.gumbel_sample(*args)
    assert len(recorded) == 1 and recorded[0] is args[0]
    assert torch.equal(got, torch.ops.fspec.gumbel_sample(*args))
    assert torch.equal(got, gumbel.gumbel_sample_ref(*args[:4], salt=0))


def test_inputs_that_require_grad_go_through_the_op(recorded):
    ops.gumbel_sample(*_args(requires_grad=True))
    assert recorded == []


def test_traced_calls_go_through_the_op(recorded):
    args = _args()
    fn = torch.compile(lambda *a: ops.gumbel_sample(*a), fullgraph=True, backend="eager")
    got = fn(*args)
    assert recorded == []
    assert torch.equal(got, gumbel.gumbel_sample_ref(*args[:4], salt=0))


def test_fake_tensors_and_dispatch_modes_see_the_op(recorded):
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in _args()]
        out = ops.gumbel_sample(*fake)
    assert out.shape == (3,) and out.dtype == torch.int64 and recorded == []

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops_seen:
        ops.gumbel_sample(*_args())
    assert recorded == [] and "fspec.gumbel_sample.default" in ops_seen.names


def test_register_refuses_other_namespaces():
    with pytest.raises(ValueError, match="qualname: expected an op of the 'fspec' namespace"):
        dispatch.register("other::op", mutates_args=())


def test_the_typed_function_reads_like_the_implementation():
    """A reader (or an IDE, or inspect) following a call lands on the implementation's signature and docs."""
    import inspect

    assert ops.gumbel_sample.__name__ == "gumbel_sample"
    assert ops.gumbel_sample.__doc__ == ops.gumbel_sample.impl.__doc__
    assert inspect.signature(ops.gumbel_sample) == inspect.signature(ops.gumbel_sample.impl)
    assert ops.gumbel_sample.op is not None and ops.kv_write.op is not None
