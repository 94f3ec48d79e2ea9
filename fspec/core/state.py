"""The state pytrees of the draft loop: `AttnMetadata` and `DraftState`.

Both are frozen, updated only with `dataclasses.replace`, and keep every leaf's shape, dtype and device across
a step (a change would recompile). Scalars that change between steps (the step counter) are 0-d tensors.

`validate` functions run at public boundaries, eagerly; compiled code never branches on tensor values.
"""

from __future__ import annotations

import torch

from fspec.core.config import DraftConfig
from fspec.core.pytree import pytree_dataclass
from fspec.core.sampling_params import SamplingParams, validate_sampling_params
from fspec.kernels.step_metadata import slot_mapping_ref as _slot_mapping  # the one slot algebra


@pytree_dataclass
class AttnMetadata:
    """Where B requests' T query tokens sit in the paged KV cache.

    Attributes:
        positions: [T] int64, position of each query token in its request; -1 for padding tokens.
        query_start_loc: [B+1] int32; request b's query tokens are rows qsl[b]:qsl[b+1].
        seq_lens: [B] int32, tokens of request b in the cache after this step's writes (0 for padding rows).
        block_table: [B, max_blocks] int32, cache block of each request's j-th block of block_size tokens.
        slot_mapping: [T] int64, cache slot (block * block_size + offset) each token's K/V is written to;
            -1 = do not write (padding).
    """

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


@pytree_dataclass
class DraftState:
    """Everything one draft step reads and writes, besides the parameters and the KV cache.

    Naming convention: p = target distribution, q = draft distribution.

    A round's first step carries T = B·Q query tokens (Q rows per request: the tokens the target just
    verified, live ones first, padding -1 after; or a ragged prompt after prefill); every later step carries
    one token per request (T = B). Across decode steps every leaf keeps its shape, dtype and device.

    Attributes:
        input_ids: [T] int64, the (target-vocabulary) token of each query row.
        hidden: [T, H] float, the hidden paired with each row's token (EAGLE pairs the hidden of position
            i with the token at i + 1): the target's (projected by the head's fc for EAGLE-3) at the first
            step, the head's own output afterwards.
        attn: `AttnMetadata` of this step's T query tokens.
        step: 0-d int64, index of the draft column this step writes (0..K-1; K after the last step).
        draft_tokens: [B, K] int64, proposed tokens (column k written by step k; -1 before).
        draft_probs: [B, K, Vd] float32, q of each proposed token's distribution (processed: temperature
            applied; one-hot at temperature 0), needed for lossless verification. [B, K, 0] when the config
            declares greedy drafts (q is then one-hot and implied by `draft_tokens`).
        sampling: `SamplingParams`, the requests' sampling settings ([B] tensors: temperature, seed, ...),
            read by the sampling kernels from their tensors.
    """

    input_ids: torch.Tensor
    hidden: torch.Tensor
    attn: AttnMetadata
    step: torch.Tensor
    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor
    sampling: SamplingParams

    @property
    def batch_size(self) -> int:
        return self.draft_tokens.shape[0]


def init_draft_state(
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    attn: AttnMetadata,
    *,
    cfg: DraftConfig,
    sampling: SamplingParams | None = None,
    temperature: torch.Tensor | float | list = 0.0,
    seed: torch.Tensor | int | list = 0,
) -> DraftState:
    """A fresh `DraftState` at step 0, draft buffers allocated once (they keep their shape afterwards).

    input_ids: [T] of any integer dtype (stored as int64). sampling: the requests' settings; without it,
    `SamplingParams.create(B, temperature=temperature, seed=seed)` (each a scalar or one per request; a
    float seed is refused, never truncated). Giving both a `sampling` and a temperature or seed is an error.
    """
    _check_cfg(cfg)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        raise ValueError(f"input_ids: expected a [T] tensor, got {_describe(input_ids)}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids: expected an integer dtype (token ids), got {input_ids.dtype}")
    if not isinstance(attn, AttnMetadata):
        raise ValueError(f"attn: expected an AttnMetadata, got {type(attn).__name__}")
    _expect("attn.seq_lens", attn.seq_lens, shape=(None,))
    b, device = attn.num_requests, input_ids.device
    if b == 0:
        raise ValueError("state.attn: expected at least one request, got an empty batch")
    if sampling is None:
        sampling = SamplingParams.create(b, temperature=temperature, seed=seed, device=device)
    elif not (_is_default(temperature, 0.0) and _is_default(seed, 0)):
        raise ValueError("sampling: expected either a SamplingParams or temperature / seed, got both")
    k = cfg.num_speculative_steps
    vd = 0 if cfg.greedy_drafts else cfg.draft_vocab_size
    state = DraftState(
        input_ids=input_ids.to(torch.int64),
        hidden=hidden,
        attn=attn,
        step=torch.zeros((), dtype=torch.int64, device=device),
        draft_tokens=torch.full((b, k), -1, dtype=torch.int64, device=device),
        draft_probs=torch.zeros((b, k, vd), dtype=torch.float32, device=device),
        sampling=sampling,
    )
    validate_draft_state(state, cfg=cfg)
    return state


def _check_cfg(cfg: object) -> None:
    if not isinstance(cfg, DraftConfig):
        raise ValueError(f"cfg: expected a DraftConfig, got {type(cfg).__name__}")


def _is_default(value: object, default: object) -> bool:
    """`value` is the untouched keyword default (a plain Python scalar equal to it)."""
    return type(value) is type(default) and value == default


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__} {x!r}"


def _expect(
    name: str,
    x: object,
    *,
    shape: tuple | None = None,
    dtype: torch.dtype | tuple | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {_describe(x)}")
    if shape is not None and (
        x.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape))
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,) if dtype is not None else ()
    if dtypes and x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected device {device}, got {x.device}")
    if contiguous and not x.is_contiguous():
        # The kernels index these buffers with unit stride: a strided view would be read at the wrong place.
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {x.stride()}")


def validate_attn_metadata(
    meta: AttnMetadata,
    *,
    block_size: int,
    max_model_len: int,
    num_blocks: int | None = None,
    name: str = "attn",
) -> None:
    """Check shapes, dtypes, devices and ranges of `meta`; raise ValueError naming the field. Eager only.

    Besides each field's own range: the 1-D fields are contiguous (the kernels read them with unit stride),
    every live token has its own slot, and no cache block is in use by two requests.
    """
    if not isinstance(meta, AttnMetadata):
        raise ValueError(f"{name}: expected an AttnMetadata, got {type(meta).__name__}")
    check_positive_int("block_size", block_size)
    check_positive_int("max_model_len", max_model_len)
    if num_blocks is not None:
        check_positive_int("num_blocks", num_blocks)
    dev = meta.positions.device if isinstance(meta.positions, torch.Tensor) else None
    one_d = dict(dtype=torch.int64, device=dev, contiguous=True)
    _expect(f"{name}.positions", meta.positions, shape=(None,), **one_d)
    t = meta.positions.shape[0]
    _expect(f"{name}.seq_lens", meta.seq_lens, shape=(None,), dtype=torch.int32, device=dev, contiguous=True)
    b = meta.seq_lens.shape[0]
    _expect(
        f"{name}.query_start_loc",
        meta.query_start_loc,
        shape=(b + 1,),
        dtype=torch.int32,
        device=dev,
        contiguous=True,
    )
    _expect(f"{name}.block_table", meta.block_table, shape=(b, None), dtype=torch.int32, device=dev)
    _expect(f"{name}.slot_mapping", meta.slot_mapping, shape=(t,), **one_d)
    qsl = meta.query_start_loc
    if int(qsl[0]) != 0 or int(qsl[-1]) != t or bool((qsl[1:] < qsl[:-1]).any()):
        raise ValueError(
            f"{name}.query_start_loc: expected non-decreasing offsets from 0 to T={t}, got {qsl.tolist()}"
        )
    pos = meta.positions
    if bool((pos < -1).any()) or bool((pos >= max_model_len).any()):
        raise ValueError(
            f"{name}.positions: expected values in [-1, max_model_len={max_model_len}), "
            f"got min {int(pos.min())}, max {int(pos.max())}"
        )
    if bool((meta.seq_lens < 0).any()) or bool((meta.seq_lens > max_model_len).any()):
        raise ValueError(
            f"{name}.seq_lens: expected values in [0, max_model_len={max_model_len}], "
            f"got {meta.seq_lens.tolist()}"
        )
    capacity = meta.block_table.shape[1] * block_size
    if bool((meta.seq_lens > capacity).any()):
        raise ValueError(
            f"{name}.seq_lens: expected at most block_table capacity {capacity} "
            f"({meta.block_table.shape[1]} blocks of {block_size}), got max {int(meta.seq_lens.max())}"
        )
    req = torch.repeat_interleave(torch.arange(b, device=dev), (qsl[1:] - qsl[:-1]).long(), output_size=t)
    live = pos >= 0
    if bool((pos[live] >= meta.seq_lens[req[live]]).any()):
        raise ValueError(f"{name}.positions: expected every live position < its request's seq_lens")
    used_blocks = _used_blocks(meta.seq_lens, meta.block_table.shape[1], block_size)
    used = meta.block_table[used_blocks]
    hi = num_blocks if num_blocks is not None else torch.iinfo(torch.int32).max
    if used.numel() and (bool((used < 0).any()) or bool((used >= hi).any())):
        raise ValueError(
            f"{name}.block_table: expected blocks in use to lie in [0, num_blocks={num_blocks}), "
            f"got min {int(used.min())}, max {int(used.max())}"
        )
    if used.unique().numel() != used.numel():
        # A block shared by two requests (or listed twice) lets one request read and overwrite another's K/V.
        values, counts = used.unique(return_counts=True)
        raise ValueError(
            f"{name}.block_table: expected every block in use to belong to one request once, "
            f"got blocks {values[counts > 1][:4].tolist()} used more than once"
        )
    expected_slots = _slot_mapping(meta.block_table, pos, block_size, req)
    if not torch.equal(expected_slots, meta.slot_mapping):
        raise ValueError(f"{name}.slot_mapping: expected the slots of positions in block_table, got others")
    live_slots = meta.slot_mapping[live]
    if live_slots.unique().numel() != live_slots.numel():
        # Two writes to one slot in one step race on the GPU (which one lands is unspecified).
        raise ValueError(
            f"{name}.positions: expected each live token of a request at its own position (distinct slots), "
            f"got {live_slots.numel() - live_slots.unique().numel()} repeated"
        )


def check_positive_int(name: str, value: object) -> None:
    """ValueError naming `name` unless `value` is a positive Python int below 2^31 (bools refused). Every
    such size (block_size, max_model_len, num_blocks, steps, max_context) indexes int32 metadata; 2^70 would
    otherwise escape as torch's OverflowError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise ValueError(f"{name}: expected a positive int below 2^31, got {value!r}")


def _used_blocks(seq_lens: torch.Tensor, max_blocks: int, block_size: int) -> torch.Tensor:
    n_used = (seq_lens.long() + block_size - 1) // block_size  # [B]
    return torch.arange(max_blocks, device=seq_lens.device)[None, :] < n_used[:, None]  # [B, max_blocks]


def validate_draft_state(
    state: DraftState, *, cfg: DraftConfig, num_blocks: int | None = None, float64: bool = False
) -> None:
    """Check every leaf of `state` against `cfg`; raise ValueError naming the field. Eager only.

    float64: also accept float64 `hidden` and `draft_probs` (the dense-cache path, for finite
    differences)."""
    _check_cfg(cfg)
    if not isinstance(state, DraftState):
        raise ValueError(f"state: expected a DraftState, got {type(state).__name__}")
    if not isinstance(state.attn, AttnMetadata):
        raise ValueError(f"state.attn: expected an AttnMetadata, got {type(state.attn).__name__}")
    _expect("state.input_ids", state.input_ids, shape=(None,), dtype=torch.int64)
    _expect("state.attn.seq_lens", state.attn.seq_lens, shape=(None,))
    dev, k = state.input_ids.device, cfg.num_speculative_steps
    t, b = state.input_ids.shape[0], state.attn.seq_lens.shape[0]
    if b == 0:
        raise ValueError("state.attn: expected at least one request, got an empty batch")
    if t == 0 or t % b:
        raise ValueError(f"state.input_ids: expected T = B·Q tokens for B={b} requests, got T={t}")
    vd = 0 if cfg.greedy_drafts else cfg.draft_vocab_size
    floats = (torch.float32, torch.bfloat16, torch.float16) + ((torch.float64,) if float64 else ())
    _expect("state.hidden", state.hidden, shape=(t, None), dtype=floats, device=dev)
    if state.hidden.shape[1] != cfg.model.hidden_size:
        raise ValueError(
            f"state.hidden: expected width H = {cfg.model.hidden_size} (cfg.model.hidden_size), "
            f"got {state.hidden.shape[1]}"
        )
    _expect("state.step", state.step, shape=(), dtype=torch.int64, device=dev)
    # The draft buffers are written in place, one column per step, by the sampling kernel.
    buf = dict(device=dev, contiguous=True)
    _expect("state.draft_tokens", state.draft_tokens, shape=(b, k), dtype=torch.int64, **buf)
    probs = (torch.float32, torch.float64) if float64 else torch.float32
    _expect("state.draft_probs", state.draft_probs, shape=(b, k, vd), dtype=probs, **buf)
    validate_sampling_params(state.sampling, batch_size=b, device=dev, name="state.sampling")
    ids = state.input_ids
    if bool((ids < 0).any()) or bool((ids >= cfg.model.vocab_size).any()):
        raise ValueError(
            f"state.input_ids: expected token ids in [0, {cfg.model.vocab_size}), "
            f"got min {int(ids.min())}, max {int(ids.max())}"
        )
    if not 0 <= int(state.step) <= k:
        raise ValueError(f"state.step: expected a value in [0, K={k}], got {int(state.step)}")
    _expect("state.attn.positions", state.attn.positions, shape=(None,), device=dev)
    if state.attn.num_tokens != t:
        raise ValueError(
            f"state.attn.positions: expected T={t} query tokens (input_ids'), got {state.attn.num_tokens}"
        )
    _expect("state.attn.query_start_loc", state.attn.query_start_loc, shape=(b + 1,))
    q = t // b
    uniform = torch.arange(b + 1, dtype=torch.int32, device=state.attn.query_start_loc.device) * q
    if not torch.equal(state.attn.query_start_loc, uniform):
        raise ValueError(
            f"state.attn.query_start_loc: expected Q={q} rows per request (0, Q, 2Q, ...), "
            f"got {state.attn.query_start_loc.tolist()[:6]}"
        )
    validate_attn_metadata(
        state.attn,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        num_blocks=num_blocks,
        name="state.attn",
    )
