"""The device work of one generation round, as pure functions: one CUDA graph per round when compiled.

`spec_round` is a whole speculative round — target forward over [current token, d_1..d_K], rejection
sampling, and the next K drafts (`propose` from the accepted rows, whose target hidden states the forward just
produced) — with every piece of metadata derived on the device from (n, live, block table). Nothing leaves
the device between the target forward and the last draft step: the host reads the accepted tokens once per
round, afterwards. `decode_step` is the target-only counterpart (one token per request). `spec_round_in_place`
and `decode_round` add the round's bookkeeping (`advance`): what the engine compiles.

Both skip input validation: they are internal, fed by the engine, and run inside compiled graphs.
Naming convention: p = target distribution, q = draft distribution.
"""

from __future__ import annotations

import functools

import torch

from fspec.compile import jit
from fspec.compile.graph_capture import GraphCapture
from fspec.core.cache import KVCache
from fspec.core.config import DraftConfig, ModelConfig
from fspec.core.metadata import _decode_metadata, _first_step_metadata
from fspec.core.pytree import pytree_dataclass
from fspec.core.sampling_params import SamplingParams
from fspec.core.state import DraftState
from fspec.draft import _rollout, last_live_rows
from fspec.kernels import ops as kops
from fspec.kernels.salts import SALT_BONUS
from fspec.models import llama
from fspec.models.heads import lookup, project_target_hidden
from fspec.models.heads.eagle3 import _draft_to_target


def draft_probs_over_target_vocab(draft_probs: torch.Tensor, params: dict, *, cfg: DraftConfig, vocab: int):
    """q over the target vocabulary [B, K, V]: EAGLE-3's reduced-vocabulary q scattered through d2t."""
    if not lookup(cfg.kind).reduced_vocab or cfg.draft_vocab_size == vocab:
        return draft_probs
    d2t = params["d2t"]
    ids = _draft_to_target(torch.arange(d2t.numel(), device=d2t.device), d2t)  # [Vd] target ids
    b, k, _ = draft_probs.shape
    return draft_probs.new_zeros(b, k, vocab).index_copy(2, ids, draft_probs)


def first_draft_state(
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    meta,
    sampling: SamplingParams,
    *,
    cfg: DraftConfig,
) -> DraftState:
    """A round's first draft state (step 0, fresh draft buffers), without validation."""
    b, k = sampling.batch_size, cfg.num_speculative_steps
    vd = 0 if cfg.greedy_drafts else cfg.draft_vocab_size
    device = input_ids.device
    return DraftState(
        input_ids=input_ids,
        hidden=hidden,
        attn=meta,
        step=torch.zeros((), dtype=torch.int64, device=device),
        draft_tokens=torch.empty((b, k), dtype=torch.int64, device=device),  # the K steps write every column
        draft_probs=torch.empty((b, k, vd), dtype=torch.float32, device=device),
        sampling=sampling,
    )


def run_drafts(dparams: dict, state: DraftState, dcache: KVCache, *, cfg: DraftConfig, backend: str = "auto"):
    """The K draft steps of `propose`, unvalidated: (draft_tokens [B, K], draft_probs [B, K, Vd])."""
    state, dcache = _rollout(
        dparams, state, dcache, cfg.num_speculative_steps, cfg=cfg, backend=backend, max_context=None
    )
    return state.draft_tokens, state.draft_probs


def prefill_forward(
    tparams: dict,
    dparams: dict | None,
    ids: torch.Tensor,
    counts: torch.Tensor,
    live: torch.Tensor,
    table: torch.Tensor,
    sampling: SamplingParams,
    tcache: KVCache,
    *,
    tcfg: ModelConfig,
    dcfg: DraftConfig | None,
    block_size: int,
    backend: str = "auto",
    greedy: bool = False,
    chunk: PrefillChunk | None = None,
) -> tuple[torch.Tensor, torch.Tensor, DraftState | None]:
    """The target's prefill of B padded prompts, unvalidated: ids [B, Q] (request b's prompt in its first
    counts[b] columns), live [B] bool (False: a padding request). Returns (the first new tokens [B], the
    last prompt position's logits [B, V] float32, the head's first state, or None when dcfg is None).
    The target cache is donated. greedy (static): every temperature is 0 (`sample_tokens`).

    chunk: one chunk of longer prompts instead (`PrefillChunk`): ids [B, Q] are the tokens at positions
    chunk.starts .. + Q - 1 of which counts[b] are request b's, attending to the earlier chunks in the cache;
    the first token and the head's pairing with it count only where chunk.final."""
    b, q = ids.shape
    zero = torch.zeros_like(counts)
    starts = zero if chunk is None else chunk.starts
    starts = torch.where(live, starts, torch.full_like(counts, -1))
    meta = _first_step_metadata(starts, counts, table, num_query=q, block_size=block_size)
    aux = lookup(dcfg.kind).aux_layer_ids(dcfg) if dcfg is not None else ()
    rows = last_live_rows(meta)
    last, hidden, _ = llama.forward(
        tparams, ids.reshape(-1), meta, tcache, cfg=tcfg, backend=backend, aux_layer_ids=aux, max_query_len=q,
        logit_rows=rows,
    )  # fmt: skip
    last = last.float()  # [B, V]
    positions = counts if chunk is None else chunk.starts + counts  # the first new token's position
    first = sample_tokens(suppress_tokens(last, sampling, positions), sampling, positions, greedy=greedy)
    if dcfg is None:
        return first, last, None
    # The head's rows are positions 0..n-1, pairing hidden i with token i + 1 (last: the new token).
    cols = torch.arange(q, device=ids.device)
    after = ids.new_zeros(b, 1) if chunk is None else chunk.lookahead[:, None]
    shifted = torch.cat([ids[:, 1:], after], 1)
    final = cols == (counts - 1).clamp(min=0)[:, None]
    if chunk is not None:
        final = final & chunk.final[:, None]
    shifted = torch.where(final, first[:, None], shifted)
    h = project_target_hidden(dparams, hidden, cfg=dcfg)
    return first, last, first_draft_state(shifted.reshape(-1), h, meta, sampling, cfg=dcfg)


@pytree_dataclass
class PrefillChunk:
    """Where one chunk of a chunked prefill sits (`prefill_forward(chunk=...)`), [B] tensors.

    Attributes:
        starts: int64, the position of each request's first row in this chunk.
        lookahead: int64, the prompt token right after the chunk (the head pairs the chunk's last hidden
            with it; any value where the prompt ends in this chunk).
        final: bool, the prompt ends in this chunk: its first new token is sampled here.
    """

    starts: torch.Tensor
    lookahead: torch.Tensor
    final: torch.Tensor


def prefill_round(
    tparams: dict,
    dparams: dict | None,
    ids: torch.Tensor,
    counts: torch.Tensor,
    live: torch.Tensor,
    table: torch.Tensor,
    sampling: SamplingParams,
    tcache: KVCache,
    dcache: KVCache | None,
    *,
    tcfg: ModelConfig,
    dcfg: DraftConfig | None,
    block_size: int,
    backend: str = "auto",
    greedy: bool = False,
    chunk: PrefillChunk | None = None,
):
    """`prefill_forward` and, with a head, its first K drafts: (first tokens [B], draft_tokens [B, K],
    draft_probs [B, K, Vd]); without one, (first tokens [B],). What `generate` runs before a request's first
    round: chunk by chunk on CUDA (`captured_prefill_chunk`), whole prompts at once elsewhere.

    With `chunk`, a chunk that does not end a request's prompt still runs the head over its rows (the head's
    cache needs them) and the K steps after them: their drafts are ignored, their K - 1 cache positions past
    the chunk are rewritten by the next chunk."""
    first, _, state = prefill_forward(
        tparams, dparams, ids, counts, live, table, sampling, tcache,
        tcfg=tcfg, dcfg=dcfg, block_size=block_size, backend=backend, greedy=greedy, chunk=chunk,
    )  # fmt: skip
    if state is None:
        return (first,)
    return (first, *run_drafts(dparams, state, dcache, cfg=dcfg, backend=backend))


def prefill_chunk_round(*args, **static):
    """`prefill_round(*args[:9], chunk=args[9], ...)`: the chunk as a positional argument (what `GraphCapture`
    takes)."""
    return prefill_round(*args[:9], chunk=args[9], **static)


def captured_prefill_chunk(tcfg: ModelConfig, dcfg: DraftConfig | None, block_size: int) -> GraphCapture:
    """`prefill_round` over one `PrefillChunk`, eager code captured into one CUDA graph per layout (group
    bucket, chunk length, table width; `GraphCapture`) and replayed: chunks of fixed lengths make the graphs
    few whatever the prompt lengths, and capturing eager code (no Inductor compile) makes each one cost three
    eager calls instead of a compile. Prefill runs once per request, so its fusion matters less than the
    rounds'. Its only in-place writes are the caches' (the same values on every warm-up call)."""
    return GraphCapture(functools.partial(prefill_chunk_round, tcfg=tcfg, dcfg=dcfg, block_size=block_size))


def spec_round(
    tparams: dict,
    dparams: dict,
    cur: torch.Tensor,
    n: torch.Tensor,
    live: torch.Tensor,
    table: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    sampling: SamplingParams,
    tcache: KVCache,
    dcache: KVCache,
    *,
    tcfg: ModelConfig,
    dcfg: DraftConfig,
    max_len: int,
    backend: str = "auto",
):
    """One speculative round for B requests.

    cur [B] (current token, at position n [B], not yet in the target cache), live [B] bool, table [B, M],
    draft_tokens [B, K] / draft_probs [B, K, Vd] (the previous round's proposal), sampling: the requests'
    settings. Returns (tokens [B, K+1]
    (accepted drafts, then the replacement or bonus, then -1), num_accepted [B], the next draft_tokens,
    the next draft_probs). Both caches are donated.
    """
    k, bs = dcfg.num_speculative_steps, dcfg.block_size
    # 1. Target forward over K + 1 rows per request; rows past max_model_len are padding.
    logits, hidden, starts = verify_forward(
        tparams, cur, n, live, table, draft_tokens, tcache, tcfg=tcfg, dcfg=dcfg, max_len=max_len,
        backend=backend,
    )  # fmt: skip
    # 2. Lossless verification.
    tokens, accepted = verify_drafts(
        logits, dparams, draft_tokens, draft_probs, sampling, n, tcfg=tcfg, dcfg=dcfg
    )
    # 3. The next proposal: the head's first step pairs the target hidden of positions n..n+a with the
    #    emitted tokens at n+1..n+a+1 (a = accepted), then K - 1 decode steps.
    meta_d = _first_step_metadata(starts, accepted + 1, table, num_query=k + 1, block_size=bs)
    h = project_target_hidden(dparams, hidden, cfg=dcfg)
    state = first_draft_state(tokens.clamp(min=0).reshape(-1), h, meta_d, sampling, cfg=dcfg)
    next_tokens, next_probs = run_drafts(dparams, state, dcache, cfg=dcfg, backend=backend)
    return tokens, accepted, next_tokens, next_probs


def verify_forward(
    tparams: dict,
    cur: torch.Tensor,
    n: torch.Tensor,
    live: torch.Tensor,
    table: torch.Tensor,
    draft_tokens: torch.Tensor,
    tcache: KVCache,
    *,
    tcfg: ModelConfig,
    dcfg: DraftConfig,
    max_len: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, llama.TargetHidden, torch.Tensor]:
    """Step 1 of `spec_round`: the target's forward over [cur, d_1..d_K] of each request (K + 1 rows,
    positions n .. n + K; rows past max_model_len are padding). Returns (logits [B·(K+1), V], the hidden
    states the head reads, starts [B]: n, or -1 for a request that is padding this round). The target cache
    is donated."""
    k, bs = dcfg.num_speculative_steps, dcfg.block_size
    # A request whose sequence is full is padding, also when the host has not seen it finish yet (the engine
    # launches round r + 1 before it reads round r).
    live = live & (n + 1 < max_len)
    starts = torch.where(live, n, torch.full_like(n, -1))
    meta = _first_step_metadata(starts, (max_len - n).clamp(max=k + 1), table, num_query=k + 1, block_size=bs)
    ids = torch.cat([cur[:, None], draft_tokens.clamp(min=0)], 1).reshape(-1)  # [B·(K+1)]
    aux = lookup(dcfg.kind).aux_layer_ids(dcfg)
    logits, hidden, _ = llama.forward(
        tparams, ids, meta, tcache, cfg=tcfg, backend=backend, aux_layer_ids=aux, max_query_len=k + 1
    )
    return logits, hidden, starts


def verify_drafts(
    logits: torch.Tensor,
    dparams: dict,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    sampling: SamplingParams,
    n: torch.Tensor,
    *,
    tcfg: ModelConfig,
    dcfg: DraftConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 of `spec_round`: lossless verification of the K drafts against the target's logits
    [B·(K+1), V] (`verify_forward`), with the requests' token suppression and sampling options. Returns
    (tokens [B, K+1], num_accepted [B])."""
    k, b = dcfg.num_speculative_steps, n.shape[0]
    q = None
    if not dcfg.greedy_drafts:
        q = draft_probs_over_target_vocab(draft_probs, dparams, cfg=dcfg, vocab=tcfg.vocab_size)
    rows = ((n + 1)[:, None] + torch.arange(k + 1, device=n.device)).reshape(-1)  # each row's token position
    logits = suppress_tokens(logits, sampling, rows)
    return kops.rejection_sample(
        logits.view(b, k + 1, -1),
        draft_tokens.clamp(min=0),
        q,
        sampling.temperature,
        sampling.seed,
        n + 1,
        *sampling.filters(),
    )  # against the target's processed p' (the request's filters)


def suppress_tokens(logits: torch.Tensor, sampling: SamplingParams, positions: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with each row's `sampling.suppress_ids` set to -inf where the row's token position
    (positions [N]) is below its request's `suppress_until` (rows N // B per request, in order): how
    `generate` keeps EOS and the stop ids out before min_new_tokens, as HF's and vLLM's min-token processors
    do. Applied to the target's logits only: the draft may still propose a suppressed id, which verification
    then rejects (p' = 0 there), so the output stays exactly target-only sampling's. With E = 0: no op."""
    ids = sampling.suppress_ids
    if ids.shape[1] == 0:  # static: no ids to suppress in this call
        return logits
    per = logits.shape[0] // ids.shape[0]
    ids = ids.repeat_interleave(per, 0)  # [N, E]
    until = sampling.suppress_until.repeat_interleave(per, 0)
    active = ((positions < until)[:, None] & (ids >= 0)).to(torch.int8)
    # amax: a padding entry (-1, clamped to id 0) never clears a real suppression of id 0
    mask = torch.zeros(logits.shape, dtype=torch.int8, device=logits.device)
    mask = mask.scatter_reduce(1, ids.clamp(min=0), active, "amax")
    return logits.masked_fill(mask.bool(), float("-inf"))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[N] int64 argmax of logits [N, V] by the samplers' temperature-0 rules: NaN counts as -inf, ties go to
    the smallest id (torch.argmax returns the first maximum; an all -inf row gives 0): `gumbel_sample`'s
    tokens at temperature 0, without its noise."""
    x = logits.float()
    return torch.where(torch.isnan(x), float("-inf"), x).argmax(dim=-1)


def sample_tokens(logits, sampling: SamplingParams, positions, *, greedy: bool) -> torch.Tensor:
    """The engine's token for each row of logits [N, V] (salt SALT_BONUS): `gumbel_sample`, or with `greedy`
    (static: the caller knows every temperature is 0) `greedy_tokens`, the same tokens. On the CPU the op
    runs its PyTorch reference, which draws Philox noise for every row whatever the temperature (branch-free
    for compiled code): 5 ms per call at V = 49152 on one thread, 6% of a SmolLM2-135M decode step."""
    if greedy:
        return greedy_tokens(logits)
    sp = sampling
    return kops.gumbel_sample(logits, sp.temperature, sp.seed, positions, SALT_BONUS, *sp.filters())


def decode_step(
    tparams: dict,
    cur: torch.Tensor,
    n: torch.Tensor,
    live: torch.Tensor,
    table: torch.Tensor,
    sampling: SamplingParams,
    tcache: KVCache,
    *,
    tcfg: ModelConfig,
    block_size: int,
    max_len: int,
    backend: str = "auto",
    greedy: bool = False,
) -> torch.Tensor:
    """Target-only decoding of one token per request: the token for position n + 1, [B] int64. greedy
    (static): every temperature is 0 (`sample_tokens`)."""
    live = live & (n + 1 < max_len)
    pos = torch.where(live, n, torch.full_like(n, -1))
    meta = _decode_metadata(pos, table, block_size=block_size)
    logits, _, _ = llama.forward(tparams, cur, meta, tcache, cfg=tcfg, backend=backend, max_query_len=1)
    return sample_tokens(suppress_tokens(logits, sampling, n + 1), sampling, n + 1, greedy=greedy)


def advance(cur: torch.Tensor, n: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """A round's bookkeeping on the device: the last emitted token (tokens [B, K + 1] at accepted [B])
    becomes `cur` and `n` moves accepted + 1 on, both written in place. Returns the round's record as the
    host reads it: [B, K + 2] int64, the tokens then the number accepted."""
    cur.copy_(tokens.gather(1, accepted[:, None]).squeeze(1))
    n.add_(accepted + 1)
    return torch.cat([tokens, accepted[:, None]], 1)


def decode_round(tparams: dict, cur: torch.Tensor, n: torch.Tensor, *inputs, **options) -> torch.Tensor:
    """One round of target-only decoding with its bookkeeping on the device: `decode_step(tparams, cur, n,
    *inputs, **options)`, then `advance` (cur and n donated, like the cache, so a compiled round reads and
    writes them where they lie and a loop of rounds needs no launch between graphs). Returns [B, 2] int64
    (token, 0): a round's (tokens, accepted) as the host reads them."""
    new = decode_step(tparams, cur, n, *inputs, **options)
    return advance(cur, n, new[:, None], torch.zeros_like(new))


def spec_round_in_place(tparams, dparams, cur, n, live, table, draft_tokens, draft_probs, *rest, **options):
    """`spec_round` with its bookkeeping on the device, as `decode_round`: the next proposal written over
    this one (draft_tokens, draft_probs) and `advance` of cur and n, all four donated. Returns the round's
    [B, K + 2] record. A loop of compiled rounds then launches nothing between graphs: the host's part of
    a round is one replay and the read-back copy."""
    tokens, accepted, next_tokens, next_probs = spec_round(
        tparams, dparams, cur, n, live, table, draft_tokens, draft_probs, *rest, **options
    )
    draft_tokens.copy_(next_tokens)
    draft_probs.copy_(next_probs)
    return advance(cur, n, tokens, accepted)


def compiled_spec_round(tcfg: ModelConfig, dcfg: DraftConfig, max_len: int, captured: bool = False):
    """`spec_round_in_place` as one CUDA graph per batch bucket: torch.compile in reduce-overhead mode, or
    with `captured` (CUDA) compiled in Inductor's default mode and replayed from fspec's own graphs
    (`GraphCapture`: no dynamo guards and graph-tree bookkeeping per round). cur, n and the proposal's homes
    must have static addresses (the graph writes them in place); the capture's warm-up calls put them back
    as they found them (the caches' writes need no undo: a repeated call makes them again)."""
    fn = functools.partial(spec_round_in_place, tcfg=tcfg, dcfg=dcfg, max_len=max_len)
    if not captured:
        return jit(fn)
    return GraphCapture(jit(fn, "cuda-graph"), preserve=lambda args: [args[2], args[3], args[6], args[7]])


def compiled_decode_step(tcfg: ModelConfig, block_size: int, max_len: int):
    """`decode_step` as one CUDA graph per batch bucket."""
    return jit(functools.partial(decode_step, tcfg=tcfg, block_size=block_size, max_len=max_len))


def compiled_decode_round(tcfg: ModelConfig, block_size: int, max_len: int, captured: bool = False):
    """`decode_round` as one CUDA graph per batch bucket; `cur` and `n` must have static addresses (the graph
    writes them in place). `captured`: replayed from fspec's own graphs, as `compiled_spec_round`; the
    capture's warm-up calls put `cur` and `n` back as they found them."""
    fn = functools.partial(decode_round, tcfg=tcfg, block_size=block_size, max_len=max_len)
    if not captured:
        return jit(fn)
    return GraphCapture(jit(fn, "cuda-graph"), preserve=lambda args: [args[1], args[2]])
