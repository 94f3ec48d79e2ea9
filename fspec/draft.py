"""The draft loop: a pure step function over `DraftState`, and the K-step rollout `propose`.

Naming convention: p = target distribution, q = draft distribution.

A round's first draft step runs over the tokens the target just verified (Q = K + 1 rows per request, of
which num_accepted + 1 are live; or a whole prompt, ragged, after prefill); every later step runs over one
token per request. One function covers both: the step samples from each request's LAST live row, and the next
state's metadata is `decode_after(attn)`, a pure function of this step's metadata computed on the device —
there is no host work between steps, so a captured graph can never replay stale metadata (vLLM's Model
Runner V2 did, and crashed with an illegal memory access past two MTP steps; its PR #41162 rebuilds the
metadata on the host before every step instead).

EAGLE pairs the hidden state of position i with the token at position i + 1 (EAGLE's `input_ids[:, 1:]`
shift): a head row at cache position i predicts the token at position i + 2. With seq_lens = last row + 1,
the sampled token's position is seq_lens + 1, and that position keys the sampler's Philox noise.

Purity and donation: `draft_step` and `propose` never change their input state. The paged KV cache is
donated (written in place and returned, like `jax.jit(donate_argnums=...)`): callers must use the returned
handle. `draft_step` copies the [B, K] and [B, K, Vd] draft buffers before writing one column; `propose`
allocates fresh ones once (it writes every column), so inside the compiled whole loop the K intermediate
states write in place and never leave the graph.

The dense path. `draft_step` / `propose` over a `DenseKVCache` (or distillation's `ChainKVCache`) run
`dense_step`: the paged `_step` with every in-place write replaced by an out-of-place one:

* K/V go into a new cache (`fspec.ops.dense_cache.bind_dense`: `where` over a position one-hot), attention is
  a masked softmax over positions <= the query's;
* column `step` of draft_tokens / draft_probs is written with `where(arange(K) == step, new, old)`;
* sampling is the sampler's PyTorch reference (same Philox noise, same ties, same q), not the kernel op.

So the step composes with `torch.func.grad` / `grad_and_value` (w.r.t. params, or the state's hidden),
`torch.func.vmap` (over a leading axis of state and cache, or of params: an ensemble of heads) and
`torch.compile`. Gradients flow through the hidden states and the logits (into draft_probs q), never through
the sampled token: argmax / Gumbel-max are piecewise constant, so a greedy or Gumbel step's tokens carry no
gradient, and with the noise fixed by the state's seeds the step is a differentiable function of the params
almost everywhere.
"""

from __future__ import annotations

import torch

from fspec.core.cache import ChainKVCache, DenseKVCache, KVCache, check_cache, check_dense_cache
from fspec.core.config import DraftConfig
from fspec.core.metadata import decode_after, decode_rollout
from fspec.core.pytree import replace
from fspec.core.state import AttnMetadata, DraftState, _expect, check_positive_int, validate_draft_state
from fspec.kernels import ops as kops
from fspec.kernels.gumbel import first_argmax_ref, inv_temperature_ref, softmax_ref
from fspec.kernels.philox import philox_gumbel_ref
from fspec.kernels.salts import SALT_DRAFT
from fspec.kernels.sampling_filter import filter_logits_ref, sampling_filter_ref
from fspec.models.heads import _head_forward, check_head_params, head_hidden, head_logits, lookup
from fspec.models.heads.eagle3 import _draft_to_target
from fspec.ops.dense_cache import bind_chain, bind_dense


def last_live_rows(attn: AttnMetadata) -> torch.Tensor:
    """[B] int64: the row of each request's last live query token (its first row when it has none).

    A draft state lays its T = B·Q rows out uniformly (request b owns rows b·Q .. b·Q + Q - 1, live ones
    first; `validate_draft_state` checks it), so this is a fixed-shape row count: no scatter, no sort (an
    `index_add` here lowered to a sort-based scatter on the H200, two extra kernels per step).
    """
    b = attn.num_requests
    q = attn.num_tokens // b
    live = (attn.positions.view(b, q) >= 0).sum(-1)  # [B]
    return torch.arange(b, device=live.device) * q + (live - 1).clamp(min=0)


def _write_column(buffer: torch.Tensor, col: torch.Tensor, values: torch.Tensor) -> None:
    """buffer[:, col] = values, with col a 0-d device tensor (no host read of the step counter)."""
    buffer.index_copy_(1, col.view(1), values.unsqueeze(1))


def _step(
    params: dict,
    state: DraftState,
    cache: KVCache,
    *,
    cfg: DraftConfig,
    backend: str,
    max_context: int | None,
    nxt: AttnMetadata | None = None,
) -> tuple[DraftState, KVCache]:
    """One draft step that WRITES column `state.step` of the state's draft buffers in place (donated). `nxt`
    is the next state's metadata where the caller has it already (`decode_rollout`), else `decode_after`."""
    attn = state.attn
    b = attn.num_requests
    # Each request's last live row. With one row per request (every step after a round's first) that is
    # row b of request b, so nothing is selected: a gather would be a launch between the attention and the
    # o projection, which the attention's reduce otherwise releases early (`early_release`).
    rows = last_live_rows(attn) if attn.num_tokens > b else None  # [B]
    # 1-3. embed + combine with hidden, one decoder layer (K/V written at slot_mapping), logits of last rows.
    logits, hidden, cache = _head_forward(
        params,
        state.input_ids,
        state.hidden,
        attn,
        cache,
        cfg=cfg,
        backend=backend,
        max_query_len=attn.num_tokens // b,
        max_context=max_context,
        logit_rows=rows,
        rows_only=True,  # after the attention only each request's last live row is computed
    )  # [B, Vd], [B, H]
    # 4. sample into column `step`: the column comes from the tensor, never from a Python int.
    # a reduced draft vocabulary (EAGLE-3): emit TARGET ids
    d2t = params["d2t"] if lookup(cfg.kind).reduced_vocab else None
    if cfg.greedy_drafts:
        tokens = logits.float().nan_to_num(nan=float("-inf")).argmax(-1)  # q is one-hot: nothing to store
        if d2t is not None:
            tokens = _draft_to_target(tokens, d2t)
        _write_column(state.draft_tokens, state.step, tokens)
        step = state.step + 1
    else:
        # the sampling kernels write the (mapped) ids into column `step` themselves and return step + 1; the
        # sampled token's position (seq_lens + 1, the Philox counter) is added in the kernel: no launch of
        # its own for either on a step's dependent chain (the state was validated: the op is called as is)
        # the draft's own processed q' (the request's top_k / top_p / min_p over its logits), stored for
        # verification
        sp = state.sampling
        tokens, step = kops.gumbel_sample_into(
            logits,
            sp.temperature,
            sp.seed,
            attn.seq_lens,
            SALT_DRAFT,
            state.draft_tokens,
            state.draft_probs,
            state.step,
            d2t,
            1,
            *sp.filters(),
        )
    # 5. the next state; its metadata is a pure function of this step's.
    if nxt is None:
        nxt = decode_after(attn, block_size=cfg.block_size, max_model_len=cfg.max_model_len)
    return replace(state, input_ids=tokens, hidden=hidden, attn=nxt, step=step), cache


def _validate(params: dict, state: DraftState, cache: KVCache, *, cfg: DraftConfig, max_context) -> None:
    """Everything a step reads: the state against cfg and the cache, the cache's layout, the params."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected a KVCache, got {type(cache).__name__}")
    validate_draft_state(state, cfg=cfg, num_blocks=cache.num_blocks)
    device = state.input_ids.device
    check_cache(cache, cfg=cfg.model, block_size=cfg.block_size, device=device)
    check_head_params(params, cfg=cfg, device=device)
    if max_context is not None:
        check_positive_int("max_context", max_context)


def draft_step(
    params: dict,
    state: DraftState,
    cache: KVCache | DenseKVCache,
    *,
    cfg: DraftConfig,
    backend: str = "auto",
    max_context: int | None = None,
) -> tuple[DraftState, KVCache | DenseKVCache]:
    """One draft step: (next state, cache). Pure in `state`; the cache is donated.

    Samples the token for column `state.step` from each request's last live row (`state.sampling` per
    request, Philox noise keyed by the sampled token's position and the draft salt), writes it and its
    processed probabilities q into a copy of the draft buffers, and advances the metadata on the device.
    Validates `state`, `cache` (a KVCache of the head's layout and cfg.block_size on the state's device) and
    `params` (the head kind's keys, on that device) when called eagerly. max_context, a static bound on the
    context read, is only checked to be a positive int: a smaller bound truncates the context (as in
    `fspec.attention`), which lowers acceptance but never changes verified output.

    With a `DenseKVCache` (`dense_step`) the step is a pure function of (params, state, cache): K/V
    are written out of place into a new cache and attention is a masked softmax, so it composes with
    `torch.func.grad` / `grad_and_value` / `vmap` (over a leading axis of state and cache, or of params) and
    `torch.compile`. Gradients flow through the hidden states and the logits (into `draft_probs`), not
    through the argmax or the Gumbel-max choice of the token (piecewise constant; the noise is fixed by the
    state's seeds and positions). `backend` and `max_context` do not apply there (the whole row is read).
    """
    if isinstance(cache, (DenseKVCache, ChainKVCache)):
        if not torch.compiler.is_compiling():
            validate_dense(params, state, cache, cfg=cfg, steps=1, max_context=max_context)
        return dense_step(params, state, cache, cfg=cfg)
    if not torch.compiler.is_compiling():
        _validate(params, state, cache, cfg=cfg, max_context=max_context)
    state = replace(state, draft_tokens=state.draft_tokens.clone(), draft_probs=state.draft_probs.clone())
    return _step(params, state, cache, cfg=cfg, backend=backend, max_context=max_context)


def propose(
    params: dict,
    state: DraftState,
    cache: KVCache | DenseKVCache,
    *,
    cfg: DraftConfig,
    backend: str = "auto",
    max_context: int | None = None,
) -> tuple[DraftState, KVCache | DenseKVCache]:
    """All K draft steps from `state` (its step counter is ignored: a rollout fills columns 0..K-1).

    Returns the state after step K — `draft_tokens` [B, K] (target ids), `draft_probs` [B, K, Vd]
    (q; [B, K, 0] for greedy drafts), `step` = K — and the donated cache. Pure in `state`. Validates as
    `draft_step` does. With a `DenseKVCache` every step is out of place (see `draft_step`) and the new cache
    is returned.
    """
    b, k = state.attn.num_requests, cfg.num_speculative_steps
    device = state.draft_tokens.device
    if isinstance(cache, (DenseKVCache, ChainKVCache)):
        if not torch.compiler.is_compiling():
            validate_dense(params, state, cache, cfg=cfg, steps=k, max_context=max_context)
        state = replace(
            state,
            step=torch.zeros_like(state.step),
            draft_tokens=torch.full_like(state.draft_tokens, -1),
            draft_probs=torch.zeros_like(state.draft_probs),
        )
        return dense_rollout(params, state, cache, k, cfg=cfg)
    if not torch.compiler.is_compiling():
        _validate(params, state, cache, cfg=cfg, max_context=max_context)
    state = replace(
        state,
        step=torch.zeros((), dtype=torch.int64, device=device),
        # every column of both is written before it is read: no fill kernel in the compiled loop
        draft_tokens=torch.empty((b, k), dtype=torch.int64, device=device),
        draft_probs=torch.empty_like(state.draft_probs),
    )
    return _rollout(params, state, cache, k, cfg=cfg, backend=backend, max_context=max_context)


def _rollout(
    params: dict,
    state: DraftState,
    cache: KVCache,
    steps: int,
    *,
    cfg: DraftConfig,
    backend: str,
    max_context: int | None,
) -> tuple[DraftState, KVCache]:
    """`steps` draft steps from `state` (unvalidated; in place in its draft buffers). Positions advance
    whatever is sampled, so the steps' next metadata come from one `decode_rollout` launch, not one each."""
    if steps == 0:
        return state, cache
    nexts = decode_rollout(state.attn, steps, block_size=cfg.block_size, max_model_len=cfg.max_model_len)
    for nxt in nexts:
        state, cache = _step(params, state, cache, cfg=cfg, backend=backend, max_context=max_context, nxt=nxt)
    return state, cache


# --- the dense path: out of place, for torch.func (see the module docstring) ------------------------------


def _sample(
    logits: torch.Tensor, state: DraftState, *, cfg: DraftConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft ids [B], q [B, Vd]) of logits [B, Vd]: the arithmetic of `gumbel_sample_ref` (noise keyed by the
    sampled token's position seq_lens + 1 and the draft salt), differentiable in q, without its writes."""
    sp = state.sampling
    if sp.filtered:  # the tokens outside the kept prefix are -inf: p' and its samples
        x = filter_logits_ref(logits, *sampling_filter_ref(logits, sp.temperature, *sp.filters()))
    else:
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays: FD tests)
        x = torch.where(torch.isnan(x), float("-inf"), x)  # `clean_logits_ref`
    scaled = x * inv_temperature_ref(sp.temperature).to(x.dtype)[:, None]  # [B, Vd]
    # rows whose logits / T reach +inf are decided greedily, by the raw logits (the T -> 0 limit)
    sampled = ((sp.temperature > 0) & (scaled.amax(-1) < float("inf")))[:, None]  # [B, 1]
    positions = state.attn.seq_lens.to(torch.int64) + 1
    noise = philox_gumbel_ref(sp.seed, positions, x.shape[-1], SALT_DRAFT).to(x.dtype)  # [B, Vd]
    tokens = first_argmax_ref(torch.where(sampled, scaled + noise, x).detach())  # [B]
    probs, m, _ = softmax_ref(scaled)
    one_hot = torch.nn.functional.one_hot(tokens, x.shape[-1]).to(probs.dtype)
    return tokens, torch.where(sampled & (m > float("-inf"))[:, None], probs, one_hot)


def dense_step(
    params: dict,
    state: DraftState,
    cache: DenseKVCache | ChainKVCache,
    *,
    cfg: DraftConfig,
    nxt: AttnMetadata | None = None,
) -> tuple[DraftState, DenseKVCache | ChainKVCache]:
    """One draft step over a dense (or training-time-test chain) cache, out of place, unvalidated:
    (next state, new cache)."""
    attn = state.attn
    b, t = attn.num_requests, attn.num_tokens
    # 1-3. the head over the T = B·Q rows (K/V into a new cache), logits of each request's last live row
    rows = last_live_rows(attn) if t > b else None  # [B]
    if isinstance(cache, ChainKVCache):  # training-time test: one-row chains forked off shared sequences
        attend = bind_chain(state.step, cache)
    else:
        attend = bind_dense(attn.positions.reshape(b, t // b), cache)
    hidden = head_hidden(params, state.input_ids, state.hidden, attn.positions, attend, cfg=cfg, rows=rows)
    logits = head_logits(params, hidden, cfg=cfg)  # [B, Vd]
    # 4. sample, then write column `step` out of place
    col = torch.arange(cfg.num_speculative_steps, device=logits.device) == state.step  # [K]
    if cfg.greedy_drafts:
        tokens = logits.detach().nan_to_num(nan=float("-inf")).argmax(-1)  # q one-hot: nothing to store
        draft_probs = state.draft_probs
    else:
        tokens, q = _sample(logits, state, cfg=cfg)
        draft_probs = torch.where(
            col[None, :, None], q[:, None, :].to(state.draft_probs.dtype), state.draft_probs
        )
    if lookup(cfg.kind).reduced_vocab:  # a reduced draft vocabulary (EAGLE-3): emit TARGET ids
        tokens = _draft_to_target(tokens, params["d2t"])
    draft_tokens = torch.where(col[None, :], tokens[:, None], state.draft_tokens)
    # 5. the next state; its metadata is a pure function of this step's
    if nxt is None:
        nxt = decode_after(attn, block_size=cfg.block_size, max_model_len=cfg.max_model_len)
    new = replace(
        state,
        input_ids=tokens,
        hidden=hidden,  # [B, H]
        attn=nxt,
        step=state.step + 1,
        draft_tokens=draft_tokens,
        draft_probs=draft_probs,
    )
    return new, attend.new_cache()


def dense_rollout(
    params: dict, state: DraftState, cache: DenseKVCache, steps: int, *, cfg: DraftConfig
) -> tuple[DraftState, DenseKVCache]:
    """`steps` dense draft steps from `state` (unvalidated); metadata from one `decode_rollout`."""
    nexts = decode_rollout(state.attn, steps, block_size=cfg.block_size, max_model_len=cfg.max_model_len)
    for nxt in nexts:
        state, cache = dense_step(params, state, cache, cfg=cfg, nxt=nxt)
    return state, cache


def validate_dense(
    params: dict, state: DraftState, cache: DenseKVCache, *, cfg: DraftConfig, steps: int, max_context
) -> None:
    """The dense path's public-boundary checks. Under a torch.func transform (vmap, grad) only types, shapes,
    dtypes and devices are checked (reading values of a batched tensor is impossible there); eagerly, the
    whole state (`validate_draft_state`, float64 allowed) and room in the cache for the `steps` steps."""
    if not isinstance(state, DraftState) or not isinstance(state.attn, AttnMetadata):
        raise ValueError(f"state: expected a DraftState, got {type(state).__name__}")
    _expect("state.input_ids", state.input_ids, shape=(None,), dtype=torch.int64)
    dev, b = state.input_ids.device, state.attn.num_requests
    if isinstance(cache, ChainKVCache):  # distillation's: R = B·S one-row chains
        chains = cache.chain_k.shape[0]
        if chains != b or cache.k.shape[0] * cache.k.shape[3] != b or cache.k.device != dev:
            raise ValueError(f"cache: expected a ChainKVCache of {b} chains on {dev}, got {chains}")
    else:
        check_dense_cache(cache, cfg=cfg.model, batch_size=b, device=dev)
    check_head_params(params, cfg=cfg, device=dev)
    if max_context is not None:
        check_positive_int("max_context", max_context)
    if torch._C._are_functorch_transforms_active():
        t, k = state.input_ids.shape[0], cfg.num_speculative_steps
        vd = 0 if cfg.greedy_drafts else cfg.draft_vocab_size
        _expect("state.hidden", state.hidden, shape=(t, cfg.model.hidden_size), device=dev)
        _expect("state.draft_tokens", state.draft_tokens, shape=(b, k), dtype=torch.int64, device=dev)
        _expect("state.draft_probs", state.draft_probs, shape=(b, k, vd), device=dev)
        _expect("state.step", state.step, shape=(), dtype=torch.int64, device=dev)
        return
    validate_draft_state(state, cfg=cfg, float64=True)
    if isinstance(cache, ChainKVCache):
        return
    reach = int(state.attn.seq_lens.max()) + steps - 1  # positions written: < seq_lens, then one a step
    if reach > cache.max_len:
        raise ValueError(
            f"cache: expected room for positions up to {reach - 1} ({steps} step(s) from seq_lens max "
            f"{int(state.attn.seq_lens.max())}), got max_len {cache.max_len}"
        )
