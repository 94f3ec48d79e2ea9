"""fspec/core/sampling_params.py: the per-request sampling settings pytree."""

from __future__ import annotations

import pytest
import torch

import fspec
from fspec.core.sampling_params import validate_sampling_params


def test_create_broadcasts_scalars_takes_lists_and_tensors_and_pads_with_the_off_values():
    sp = fspec.SamplingParams.create(
        3, temperature=[0.0, 0.7, 1.0], seed=torch.tensor([1, 2, 3]), top_k=40, top_p=[0.9, 1.0, 0.5],
        min_p=0.05, suppress_ids=[2, 7], suppress_until=[10, 0, 5],
    )  # fmt: skip
    assert sp.top_k.dtype == torch.int32 and sp.top_k.tolist() == [40, 40, 40]
    assert sp.suppress_ids.shape == (3, 2) and sp.suppress_ids.tolist() == [[2, 7]] * 3
    padded = sp.pad(2)
    assert padded.batch_size == 5 and padded.temperature.tolist()[3:] == [0.0, 0.0]
    assert padded.top_p.tolist()[3:] == [1.0, 1.0] and padded.top_k.tolist()[3:] == [0, 0]
    assert padded.suppress_ids.tolist()[3:] == [[-1, -1]] * 2 and padded.min_p.tolist()[3:] == [0.0, 0.0]
    back = padded.take(3)
    for x, y in zip(fspec.tree.tree_leaves(back), fspec.tree.tree_leaves(sp)):
        assert torch.equal(x, y)
    assert fspec.SamplingParams.create(2, top_k=2**40).top_k.tolist() == [2**31 - 1] * 2  # "keep all"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_p": 0.0}, r"sampling.top_p: expected values in \(0, 1\]"),
        ({"top_p": 1.5}, r"sampling.top_p: expected values in \(0, 1\]"),
        ({"top_p": float("nan")}, r"sampling.top_p: expected values in \(0, 1\]"),
        ({"min_p": 1.0}, r"sampling.min_p: expected values in \[0, 1\)"),
        ({"min_p": -0.1}, r"sampling.min_p: expected values in \[0, 1\)"),
        ({"top_k": -1}, r"sampling.top_k: expected values >= 0"),
        ({"top_k": 2.5}, r"top_k: expected an int"),
        ({"top_k": [1, 2]}, r"top_k: expected 3 values \(one per request\), got 2"),
        ({"temperature": -1.0}, r"sampling.temperature: expected finite values >= 0"),
        ({"seed": [1.0, 2.0, 3.0]}, r"seed\[0\]: expected an int"),
        ({"suppress_ids": [1.5]}, r"suppress_ids: expected a list of token ids"),
        ({"suppress_ids": [-2]}, r"sampling.suppress_ids: expected token ids or -1"),
        (
            {"suppress_ids": torch.zeros(2, 1, dtype=torch.int64)},
            r"suppress_ids: expected a \[3, E\] integer",
        ),
    ],
)
def test_bad_values_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fspec.SamplingParams.create(3, **kwargs)


def test_a_state_refuses_a_strided_or_mis_shaped_setting():
    sp = fspec.SamplingParams.create(2)
    strided = fspec.replace(sp, top_p=torch.ones(4)[::2])
    with pytest.raises(ValueError, match=r"sampling.top_p: expected a contiguous tensor"):
        fspec.core.sampling_params.validate_sampling_params(strided, batch_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"state.sampling.temperature: expected a \[3\] torch.float32"):
        fspec.core.sampling_params.validate_sampling_params(
            sp, batch_size=3, device=torch.device("cpu"), name="state.sampling"
        )


def test_filtered_says_whether_any_request_filters_and_travels_in_the_tree_structure():
    """`filtered` is static (the samplers skip the filter without it): set by `create` from the values,
    kept by pad / take / copy_into, part of the tree structure (a compiled call keys its graph on it), and a
    False beside an active filter is refused rather than silently ignored."""
    off = fspec.SamplingParams.create(3, temperature=0.8)
    assert off.filtered is False and off.filters() == (None, None, None)
    for kw in ({"top_k": [0, 5, 0]}, {"top_p": 0.9}, {"min_p": [0.0, 0.0, 0.1]}):
        on = fspec.SamplingParams.create(3, temperature=0.7, **kw)
        assert fspec.SamplingParams.create(3, **kw).filtered is False  # greedy: the argmax is the same
        assert on.filtered is True and on.filters() == (on.top_k, on.top_p, on.min_p)
        assert on.pad(2).filtered and on.take(2).filtered
        home = fspec.SamplingParams.create(3)
        copied = on.copy_into(home)
        assert copied.filtered and copied.top_k is home.top_k and torch.equal(home.top_k, on.top_k)
        assert fspec.tree.tree_structure(on) != fspec.tree.tree_structure(off)
    assert not off.pad(1).filtered and fspec.tree.tree_leaves(off.pad(1))[0].shape == (4,)
    lying = fspec.replace(fspec.SamplingParams.create(2, temperature=[0.5, 0.0], top_p=0.5), filtered=False)
    expected = r"sampling.filtered: expected True when a sampled request .* \[0\] filtering"
    with pytest.raises(ValueError, match=expected):
        fspec.core.sampling_params.validate_sampling_params(lying, batch_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"sampling.filtered: expected a bool, got int 1"):
        fspec.core.sampling_params.validate_sampling_params(
            fspec.replace(off, filtered=1), batch_size=3, device=torch.device("cpu")
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("extra", [0, 3])
def test_to_device_packs_the_fields_into_one_copy_and_gives_each_back_exactly(extra):
    """CPU -> CUDA travels as one pinned buffer viewed back as the fields (8-byte aligned whatever the
    fields' sizes: 5 requests of int32 top_k end on a 4-byte boundary); each field equals its own copy, is
    contiguous and valid, and a request's values survive the round trip."""
    ids = [2, 7, 11][:extra]
    sp = fspec.SamplingParams.create(
        5, temperature=[0.0, 0.7, 1.0, 0.2, 0.0], seed=[1, -2, 2**62, 4, 5], top_k=[0, 3, 40, 7, 1],
        top_p=[1.0, 0.9, 0.5, 0.3, 1.0], min_p=0.05, suppress_ids=ids or None,
        suppress_until=[10, 0, 5, 1, 2],
    )  # fmt: skip
    moved = sp.to_device("cuda")
    assert moved.filtered == sp.filtered
    for name, t in sp.fields().items():
        got = moved.fields()[name]
        assert got.is_cuda and got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous()
        assert torch.equal(got.cpu(), t)
    validate_sampling_params(moved, batch_size=5, device=moved.temperature.device)
    assert moved.to_device("cuda") is moved


def test_to_device_names_a_bad_device():
    """to_device and create (both of its paths: plain numbers and tensors) name a device they cannot parse."""
    sp = fspec.SamplingParams.create(2)
    assert sp.to_device("cpu") is sp
    for bad in ("gpu0", 3.5):
        with pytest.raises(ValueError, match="device: expected a torch.device or a device string, got"):
            sp.to_device(bad)
        for temperature in (0.5, torch.tensor([0.5, 0.0])):
            with pytest.raises(ValueError, match="device: expected a torch.device or a device string, got"):
                fspec.SamplingParams.create(2, temperature=temperature, device=bad)


SCALARS = [
    dict(temperature=0.0),
    dict(temperature=0.7, seed=-5, top_k=40, top_p=0.9, min_p=0.05, suppress_until=12),
    dict(temperature=1e-50, top_k=3),  # 0 in float32: greedy, so not filtered
    dict(temperature=0.5, top_p=1 - 1e-9),  # 1.0 in float32: top_p off, not filtered
    dict(temperature=2, top_k=2**40),  # an int temperature; top_k past int32 is clamped (general path)
    dict(temperature=1, seed=2**63 - 1, min_p=0.999),
]


def _as_tensor(v) -> torch.Tensor:
    values = v if isinstance(v, list) else [v] * 3
    return torch.tensor(
        values, dtype=torch.float64 if any(isinstance(x, float) for x in values) else torch.int64
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        *SCALARS,
        dict(temperature=[0.0, 0.7, 1e-50], top_k=[0, 5, 9], top_p=[1.0, 1 - 1e-9, 0.5], seed=[1, 2, 3]),
        dict(temperature=[0.0, 0.0, 0.0], min_p=[0.0, 0.2, 0.0]),  # filters on greedy rows only: not filtered
        dict(temperature=(1, 0.5, 0), top_k=7),  # a tuple and a scalar together
    ],
)
def test_plain_numbers_give_what_tensors_give(kwargs):
    """`create` builds options given as Python numbers (scalars, or lists / tuples of one per request) in one
    step per field; every field (values, dtype, shape, contiguity) and `filtered` equal what the general
    path makes of the same values given as tensors."""
    fast = fspec.SamplingParams.create(3, **kwargs)
    general = fspec.SamplingParams.create(3, **{k: _as_tensor(list(v) if isinstance(v, tuple) else v)
                                                for k, v in kwargs.items()})  # fmt: skip
    for name in ("temperature", "seed", "top_k", "top_p", "min_p", "suppress_ids", "suppress_until"):
        x, y = getattr(fast, name), getattr(general, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous() and torch.equal(x, y), name
    assert fast.filtered == general.filtered


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=1e39), r"sampling\.temperature: expected finite values >= 0, got \[inf"),
        (dict(temperature=-0.1), r"temperature: expected finite values >= 0"),
        (dict(top_p=0.0), r"top_p: expected values in \(0, 1\]"),
        (dict(min_p=1.0), r"min_p: expected values in \[0, 1\)"),
        (dict(seed=2**63), r"seed: expected a 64-bit int"),
        (dict(temperature=True), r"temperature: expected a number"),
        (dict(top_p=[1.0, 0.0]), r"sampling\.top_p: expected values in \(0, 1\] \(1 = off\), got \[0\.0\]"),
        (dict(seed=[1, 2.0]), r"seed\[1\]: expected an int"),
        (dict(top_k=[1, 2, 3]), r"top_k: expected 2 values \(one per request\), got 3"),
    ],
)
def test_bad_scalars_raise_the_general_paths_errors(kwargs, match):
    """A scalar outside its range (in float32: 1e39 is inf there) is refused with the message the general
    path gives, never built by the scalar fast path."""
    with pytest.raises(ValueError, match=match):
        fspec.SamplingParams.create(2, **kwargs)
