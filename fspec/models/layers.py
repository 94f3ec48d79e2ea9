"""Building blocks shared by the target and the draft heads: RMSNorm, RoPE, attention projections, SwiGLU.

Every function works on any leading shape (`[T, ...]` for the paged path, `[B, S, ...]` for the dense path):
attention itself is passed in as `attend(q, k, v, layer, cos, sin) -> out`, so one decoder layer serves both.
RoPE belongs to attention (`fspec.ops.attention.Attend`): the layer hands over q and k un-rotated with the
cos/sin of their positions, so the paged backend can rotate them inside its cache-write kernel.

Numerics follow transformers' Llama (v5.24): RMSNorm in fp32 then cast back before the weight multiply;
RoPE's cos/sin computed in fp32 from `positions * inv_freq` and cast to the activation dtype; rotate-half
convention (the HF checkpoint layout, not the interleaved one of Meta's original code).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from fspec.core.config import ModelConfig
from fspec.kernels import ops as kops
from fspec.kernels.dispatch import direct
from fspec.kernels.rms_norm import fits as rms_norm_fits
from fspec.kernels.rms_norm import fits_residual, rms_norm_ref
from fspec.kernels.rope_cos_sin import inv_freq
from fspec.kernels.silu_mul import fits as silu_mul_fits
from fspec.models.packed import is_packed, packed_linear
from fspec.ops.attention import Attend

SKINNY_ROWS = 16  # fspec::skinny_linear's row limit (kernels/skinny_linear.py MAX_ROWS)
# widest weight routed for one row (the widest of the one-row sweep, an EAGLE-3 head's 32000-token draft
# vocabulary, 31.7 vs cuBLAS 33.2 us; target LM heads, 128k outputs, stay with cuBLAS:
# benchmarks/results/skinny_linear_one_row.json)
SKINNY_ROW_MAX_OUT = 32768
# Several rows (2..SKINNY_ROWS: a batch-1 round's K + 1 verification rows, its first draft step, a short
# prefill chunk) run the fused layer only in models at most this wide, where every product costs a few µs
# whatever its kernel and the launches the fusion saves (the norms, SiLU * up, the residual adds: three a
# layer) weigh more than cuBLAS's speed. SmolLM2-135M (hidden 576), bf16, B = 1, H100: a K = 5 round
# 1189 -> 950 µs, K = 3 1127 -> 884 (benchmarks/results/verify_rows.json); the 2..8-row CUDA-core kernel
# instead: 1820 µs. A 1B-shaped target (hidden 2048) lost with the fused layer for several rows
# (docs/experiments.md, the fused layer for 1..16 rows). Widths between were not measured.
FUSED_ROWS_MAX_HIDDEN = 1024


def use_skinny_linear(x: torch.Tensor, w: torch.Tensor, *, cuda: bool | None = None) -> bool:
    """Whether `linear` routes x @ w.T to `fspec::skinny_linear`: one row of x (batch-1 decode and draft
    steps: the one-row CUDA-core kernel, ahead of cuBLAS at every one-row shape of the H200 sweep but one;
    table `switches`, run i) and a 2-d weight of at most SKINNY_ROW_MAX_OUT output features, x and w of one
    floating dtype, on CUDA, no autograd through it (training keeps F.linear). Several rows (verification,
    a round's first draft step, batches) keep cuBLAS, which the tile kernels did not beat for a product alone
    (docs/experiments.md); a narrow model's few rows take the fused layer instead (`use_fused_layer`).
    Decided when a graph is traced."""
    if not (x.is_cuda if cuda is None else cuda):  # first: per product, per layer
        return False
    if w.dim() != 2 or math.prod(x.shape[:-1]) != 1 or w.shape[0] > SKINNY_ROW_MAX_OUT:
        return False
    return x.dtype == w.dtype and _skinny_inference(x, w, cuda=cuda)


def use_qkv_rope(x: torch.Tensor, w: torch.Tensor, cfg: ModelConfig, *, cuda: bool | None = None) -> bool:
    """Whether a layer's rows x may hand over to `attend.qkv_rope` (its fused q/k/v weight w, RoPE and the
    cache write in the product's launch): one row on `use_skinny_linear`'s conditions; 2..SKINNY_ROWS rows
    (a batch-1 round's verification, its first draft step) where the several-row layers are fused
    (a model at most FUSED_ROWS_MAX_HIDDEN wide, `use_fused_layer`), on the same conditions of x and w.
    Decided when a graph is traced."""
    rows = math.prod(x.shape[:-1])
    if rows == 1:
        return use_skinny_linear(x, w, cuda=cuda)
    if not (x.is_cuda if cuda is None else cuda) or cfg.hidden_size > FUSED_ROWS_MAX_HIDDEN:
        return False
    if w.dim() != 2 or w.shape[0] > SKINNY_ROW_MAX_OUT:
        return False
    return x.dtype == w.dtype and _skinny_inference(x, w, cuda=cuda)


def _skinny_inference(x: torch.Tensor, w: torch.Tensor, *, cuda: bool | None) -> bool:
    """What `fspec::skinny_linear` needs of x beyond the weights: CUDA (`cuda` overrides x's device, for
    tests), 1..SKINNY_ROWS rows, a floating dtype it handles, no autograd through x or w, no torch.func
    transform (the op has no vmap or grad rule: under vmap a request's one row would reach it batched), and
    w with unit stride along K (the kernel would copy any other weight on every call; F.linear reads it as
    it lies)."""
    if torch._C._are_functorch_transforms_active():
        return False
    cuda = x.is_cuda if cuda is None else cuda
    rows = math.prod(x.shape[:-1])
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    unit = w.dim() == 2 and w.stride(-1) == 1
    return cuda and 0 < rows <= SKINNY_ROWS and x.dtype in dtypes and not grad and unit


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through `fspec::skinny_linear` where `use_skinny_linear` says so, and through oneDNN
    for a weight that `fspec.models.packed.pack_params` packed."""
    if is_packed(w):
        return packed_linear(x, w, b)
    if not use_skinny_linear(x, w):
        return F.linear(x, w, b)
    y = kops.skinny_linear(x.reshape(-1, x.shape[-1]), w)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, computed in fp32 like HF's LlamaRMSNorm (fp64 stays fp64: gradient checks
    by finite differences), rounded to x's dtype, times the weight (`fspec.kernels.rms_norm.rms_norm_ref`).

    Eager CUDA code where nothing traces or differentiates (`direct`: no torch.compile, functorch transform,
    dispatch mode or tensor that requires grad) runs it as one kernel (`fspec::rms_norm`) instead of eight:
    the captured prefill chunks and eager `generate`. Everywhere else it is the PyTorch code, which Inductor
    fuses with its neighbours and autograd and vmap see through."""
    if x.is_cuda and rms_norm_fits(x, weight) and direct((x, weight)):
        return kops.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h, weight, eps)) with h = residual + x: a pre-norm layer's residual add and the norm
    after it, one launch (`fspec::add_rms_norm`) where `rms_norm` would take its kernel and x and the residual
    agree in shape and dtype; the two steps otherwise."""
    if x.is_cuda and fits_residual(x, residual, weight) and direct((x, residual, weight)):
        return kops.add_rms_norm(x, residual, weight, eps)
    h = residual + x
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of a fused gate/up output [..., 2I]: one launch (`fspec::silu_mul`) in eager
    CUDA code where nothing traces or differentiates (as `rms_norm`), the PyTorch code everywhere else."""
    if gate_up.is_cuda and silu_mul_fits(gate_up) and direct((gate_up,)):
        return kops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies for `cfg.rope_type` ("default", "linear", "llama3"): the arithmetic of
    `fspec.kernels.rope_cos_sin.inv_freq` (transformers' `_compute_llama3_parameters` for "llama3")."""
    return inv_freq(*rope_key(cfg), device)


def rope_key(cfg: ModelConfig) -> tuple[int, str, tuple[float, ...]]:
    """What the inverse frequencies depend on, as plain values: (head_dim, rope_type, rope) with rope =
    (theta, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), the arguments of
    `fspec.kernels.rope_cos_sin.inv_freq` and, rope as a list, of the ops that compute RoPE from positions."""
    rope = (
        cfg.rope_theta,
        cfg.rope_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_max_position_embeddings,
    )
    return cfg.head_dim, cfg.rope_type, tuple(float(x) for x in rope)


def rope_cos_sin(
    positions: torch.Tensor, *, cfg: ModelConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., D] for integer `positions` [...]; padding positions (-1) get position 0's values.

    One `fspec::rope_tables` op (kernels/rope_cos_sin.py: one launch on the GPU, the PyTorch reference on
    the CPU), so a compiled forward computes the tables once for all its layers; the op takes the rope
    parameters as plain values and keeps the inverse frequencies per device (`cached_inv_freq`), so no graph
    computes them (traced inline they were one Inductor kernel per forward: per draft step of a compiled
    propose, ~1 us of a 1B-shaped head's step on the H200, benchmarks/results/timelines/)."""
    head_dim, rope_type, rope = rope_key(cfg)
    return kops.rope_tables(positions, dtype, head_dim, rope_type, list(rope))


def bias_layout(cfg: ModelConfig) -> tuple[bool, bool]:
    """(q/k/v carry a bias, o carries a bias), as transformers builds each model type.

    Qwen2 hard-codes bias=True on q/k/v and False on o (whatever `attention_bias` says); Mistral never has
    biases; Llama and Qwen3 put `attention_bias` on all four projections.
    """
    if cfg.model_type == "qwen2":
        return True, False
    if cfg.model_type == "mistral":
        return False, False
    return cfg.attention_bias, cfg.attention_bias


def project_qkv(
    p: dict, x: torch.Tensor, *, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [..., N, D], k/v [..., Nkv, D] from x [..., Hin]: bias and per-head q/k norm (Qwen3); no RoPE (the
    `attend` applies it).

    A fused layer (`fuse_projections`) computes all three with one matmul over its "qkv" weight; q, k and v
    are then views of that one output, which the paged backend's kernel reads in place.
    """
    if "qkv" in p:
        qkv = linear(x, p["qkv"], p.get("qkv_bias"))
        q, k, v = qkv.split(qkv_sizes(cfg), dim=-1)
    else:
        q = linear(x, p["q"], p.get("q_bias"))
        k = linear(x, p["k"], p.get("k_bias"))
        v = linear(x, p["v"], p.get("v_bias"))
    # unflatten, not einops: three calls per layer of every step (~3 us each of Python on the CPU)
    q, k, v = (t.unflatten(-1, (-1, cfg.head_dim)) for t in (q, k, v))  # [..., heads, D]
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's D, before RoPE
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return q, k, v


def mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x)); a fused layer computes gate and up with one matmul."""
    if "gate_up" in p:
        return linear(silu_mul(linear(x, p["gate_up"])), p["down"])
    return linear(F.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])


# --- fused projections --------------------------------------------------------------------------------------

_QKV = ("q", "k", "v")
_FUSED_AWAY = ("q", "k", "v", "q_bias", "k_bias", "v_bias", "gate", "up")


def qkv_sizes(cfg: ModelConfig) -> list[int]:
    """Output rows of q, k and v in a fused "qkv" weight: [N·D, Nkv·D, Nkv·D]."""
    return [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2


def _map_layers(tree, is_layer, fn) -> tuple[object, int]:
    """(tree with fn applied to every dict `is_layer` accepts, how many); lists and dicts are walked."""
    if isinstance(tree, list):
        pairs = [_map_layers(x, is_layer, fn) for x in tree]
        return [x for x, _ in pairs], sum(n for _, n in pairs)
    if not isinstance(tree, dict):
        return tree, 0
    if is_layer(tree):
        return fn(tree), 1
    pairs = {k: _map_layers(v, is_layer, fn) for k, v in tree.items()}
    return {k: x for k, (x, _) in pairs.items()}, sum(n for _, n in pairs.values())


def _check_params(params) -> None:
    if not isinstance(params, dict):
        raise ValueError(
            f"params: expected a model's or head's params dict (target.params), got {type(params).__name__}"
        )


def _fuse_layer(p: dict) -> dict:
    out = {k: v for k, v in p.items() if k not in _FUSED_AWAY}
    with torch.no_grad():
        out["qkv"] = param(torch.cat([p[k] for k in _QKV]))
        if "q_bias" in p:
            out["qkv_bias"] = param(torch.cat([p[f"{k}_bias"] for k in _QKV]))
        out["gate_up"] = param(torch.cat([p["gate"], p["up"]]))
    return out


def fuse_projections(params: dict) -> dict:
    """`params` (a model's or a head's pytree) with every decoder layer's q/k/v weights concatenated into
    "qkv" (biases into "qkv_bias") and gate/up into "gate_up": one matmul instead of three and two, as
    gpt-fast's `wqkv` and vLLM's merged linear layers do. The result computes the same function (up to the
    matmul's summation order); the separate weights are not kept in it (drop the input to free them).
    `unfuse_projections` inverts it; `save_target` / `save_draft` do that themselves.
    """
    _check_params(params)
    fused, n = _map_layers(params, lambda p: all(k in p for k in (*_QKV, "gate", "up")), _fuse_layer)
    if n == 0:
        raise ValueError(
            "params: expected layers with separate q/k/v and gate/up weights, got none (fused already?)"
        )
    return fused


def fuse_projections_(params: dict) -> int:
    """`fuse_projections` in place, one layer at a time (each layer's separate weights are released before
    the next is fused, so peak memory grows by one layer, not by the model). For trees the caller owns, such
    as one just loaded; returns the number of layers fused (0 if already fused)."""
    _check_params(params)
    count = 0

    def walk(tree) -> None:
        nonlocal count
        items = tree if isinstance(tree, list) else tree.values() if isinstance(tree, dict) else ()
        if isinstance(tree, dict) and all(k in tree for k in (*_QKV, "gate", "up")):
            fused = _fuse_layer(tree)
            tree.clear()
            tree.update(fused)
            count += 1
            return
        for x in list(items):
            walk(x)

    walk(params)
    return count


def unfuse_projections(params: dict, cfg: ModelConfig) -> dict:
    """The separate q/k/v and gate/up weights of a `fuse_projections` pytree (unfused layers pass through);
    cfg gives the head counts (a head's: its `DraftConfig.model`)."""
    _check_params(params)
    sizes = qkv_sizes(cfg)

    def split(p: dict) -> dict:
        rows = p["qkv"].shape[0]
        if rows != sum(sizes) or p["gate_up"].shape[0] % 2:
            raise ValueError(
                f"cfg: expected head counts matching the fused weights ({rows} qkv rows), got "
                f"N={cfg.num_attention_heads}, Nkv={cfg.num_key_value_heads}, D={cfg.head_dim} "
                f"({sum(sizes)} rows)"
            )
        out = {k: v for k, v in p.items() if k not in ("qkv", "qkv_bias", "gate_up")}
        with torch.no_grad():
            for name, w in zip(_QKV, p["qkv"].split(sizes)):
                out[name] = param(w.clone())
            if "qkv_bias" in p:
                for name, b in zip(_QKV, p["qkv_bias"].split(sizes)):
                    out[f"{name}_bias"] = param(b.clone())
            gate, up = p["gate_up"].chunk(2)
            out["gate"], out["up"] = param(gate.clone()), param(up.clone())
        return out

    return _map_layers(params, lambda p: "qkv" in p, split)[0]


def decoder_layer(
    p: dict,
    attn_in: torch.Tensor,
    residual: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Attend,
    *,
    cfg: ModelConfig,
    layer: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pre-norm Llama layer given its (already normalized) attention input.

    attn_in [..., Hin] feeds q/k/v (Hin = H for a target layer, 2H for an EAGLE-3 layer); residual [..., H] is
    what the attention output is added to. Returns [..., H]. Where `use_fused_layer` says so, everything
    after the attention runs as three fused `skinny_linear` launches (`fused_decoder_layer`).

    rows [R] int64 (tokens laid out [T, ...]): only these rows' outputs are wanted, [R, H]. The attention
    still runs over all T rows (their K/V go to the cache); o, the norm and the MLP, which are row-wise, run
    over the R rows only (a draft round's first step needs one row per request of its K + 1).
    """
    # q/k/v, RoPE and the cache write may be one launch (`use_qkv_rope`: one row, a decode or later draft
    # step, `rows` then picks that row; or a narrow model's few rows)
    out = _qkv_rope_attention(p, attn_in, None, attend, cfg=cfg, layer=layer, cos=cos)
    if out is None:
        q, k, v = project_qkv(p, attn_in, cfg=cfg)
        out = attend(q, k, v, layer, cos, sin)  # RoPE happens in attend
    out = out.flatten(-2)  # [..., N·D]
    if rows is not None:
        out, residual = out.index_select(0, rows), residual.index_select(0, rows)
    if use_fused_layer(p, residual, cfg):  # o, the post-attention norm, the MLP: three launches
        return _fused_after_attention(p, out, residual, cfg=cfg)
    h, normed = add_rms_norm(linear(out, p["o"], p.get("o_bias")), residual, p["post_norm"], cfg.rms_norm_eps)
    return h + mlp(p, normed)


def use_fused_layer(p: dict, x: torch.Tensor, cfg: ModelConfig, *, cuda: bool | None = None) -> bool:
    """Whether a pre-norm layer runs as `fused_decoder_layer`: for one row of x, a batch-1 decode or draft
    step, where the one-row kernel runs it (table `switches`, run j), and for up to SKINNY_ROWS rows (a
    batch-1 round's K + 1 verification rows, its first draft step) in a model at most
    FUSED_ROWS_MAX_HIDDEN wide, on the tensor-core tile kernel (wider models keep cuBLAS there); for a
    layer with fused projections ("qkv", "gate_up"), a post-attention norm, no biases and no q/k norm,
    its weights and norms in x's dtype (the input norm too where the layer has one: an EAGLE head's first
    layer has none, and `decoder_layer` fuses only what follows its attention), and the conditions of
    `use_skinny_linear` for x (CUDA, inference), wide weights included. Decided when a graph is traced."""
    if not (x.is_cuda if cuda is None else cuda):  # the kernel's device, first
        return False
    rows = math.prod(x.shape[:-1])
    if rows != 1 and not (rows <= SKINNY_ROWS and cfg.hidden_size <= FUSED_ROWS_MAX_HIDDEN):
        return False
    if "qkv" not in p or "gate_up" not in p or "qkv_bias" in p or "o_bias" in p or cfg.qk_norm:
        return False
    names = ("qkv", "o", "gate_up", "down", "post_norm")
    if any(n not in p for n in names):
        return False
    names += ("input_norm",) if "input_norm" in p else ()
    same = all(p[n].dtype == x.dtype for n in names)  # one dtype: the kernel's contract
    return same and _skinny_inference(x, p["qkv"], cuda=cuda)


def fused_decoder_layer(
    p: dict,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Attend,
    *,
    cfg: ModelConfig,
    layer: int,
) -> torch.Tensor:
    """`decoder_layer(p, rms_norm(x, p["input_norm"]), x, ...)` in four `fspec::skinny_linear` launches
    around the attention: the input norm in the q/k/v projection's prologue, the residual add in o's
    epilogue, the post-attention norm in gate/up's prologue and SiLU * up in its epilogue, the second
    residual add in down's epilogue (on the H200 each of those is otherwise a launch of ~1.5 µs plus a gap
    in a decode step). For a layer with fused projections, no biases, no q/k norm (`use_fused_layer`)."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, hidden)
    eps = cfg.rms_norm_eps
    out = _qkv_rope_attention(p, x, p["input_norm"], attend, cfg=cfg, layer=layer, cos=cos)
    if out is not None:  # q/k/v, RoPE and the cache write in one launch, then the attention
        return _fused_after_attention(p, out, x, cfg=cfg)
    qkv = kops.skinny_linear(rows, p["qkv"], p["input_norm"], eps, False, None)
    q, k, v = (rearrange(t, "t (n d) -> t n d", d=cfg.head_dim) for t in qkv.split(qkv_sizes(cfg), dim=-1))
    shape = lambda t: t.reshape(*lead, *t.shape[1:])  # noqa: E731
    out = rearrange(attend(shape(q), shape(k), shape(v), layer, cos, sin), "... n d -> ... (n d)")
    return _fused_after_attention(p, out, x, cfg=cfg)


def _qkv_rope_attention(
    p: dict,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    attend: Attend,
    *,
    cfg: ModelConfig,
    layer: int,
    cos: torch.Tensor,
) -> torch.Tensor | None:
    """The attention output [..., N, D] of the rows x [..., K] through `attend.qkv_rope` (the paged backend's
    `fspec::qkv_rope_write` then `fspec::paged_attention`): the layer's fused "qkv" weight, RMSNorm of x
    first with `norm_weight`, no q/k/v bias and no q/k norm, where `use_qkv_rope` says so; None otherwise
    (the caller projects, then attends)."""
    qkv_rope = getattr(attend, "qkv_rope", None)
    if qkv_rope is None or "qkv" not in p or "qkv_bias" in p or cfg.qk_norm:
        return None
    if not use_qkv_rope(x, p["qkv"], cfg):
        return None
    flat = x.reshape(-1, x.shape[-1])
    out = qkv_rope(flat, p["qkv"], norm_weight, cfg.rms_norm_eps, layer, cos.dtype)
    return None if out is None else out.reshape(*x.shape[:-1], *out.shape[1:])


def _fused_after_attention(
    p: dict, out: torch.Tensor, residual: torch.Tensor, *, cfg: ModelConfig
) -> torch.Tensor:
    """residual + o(out), then + down(silu(gate) * up of rms_norm(h)): three `skinny_linear` launches."""
    lead, hidden = residual.shape[:-1], residual.shape[-1]
    rows, eps = residual.reshape(-1, hidden), cfg.rms_norm_eps
    h = kops.skinny_linear(out.reshape(rows.shape[0], -1), p["o"], None, eps, False, rows)
    act = kops.skinny_linear(h, p["gate_up"], p["post_norm"], eps, True, None)  # silu(gate) * up
    return kops.skinny_linear(act, p["down"], None, eps, False, h).reshape(*lead, hidden)


# --- initialization ---------------------------------------------------------------------------------------


def param(t: torch.Tensor) -> torch.nn.Parameter:
    """A frozen Parameter: CUDA graphs treat Parameters as static inputs (no copy per replay)."""
    return torch.nn.Parameter(t, requires_grad=False)


def normal(
    gen: torch.Generator,
    *shape: int,
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.nn.Parameter:
    """N(0, std²) drawn on the CPU from `gen` (reproducible on every device), as a frozen Parameter.

    On the "meta" device nothing is drawn: checkpoint loaders build shape templates that way.
    """
    if torch.device(device).type == "meta":
        return param(torch.empty(*shape, dtype=dtype, device="meta"))
    return param(
        torch.randn(*shape, generator=gen, dtype=torch.float32).mul_(std).to(device=device, dtype=dtype)
    )


def ones(
    *shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Parameter:
    return param(torch.ones(*shape, dtype=dtype, device=device))


def zeros(
    *shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Parameter:
    return param(torch.zeros(*shape, dtype=dtype, device=device))


def init_layer(
    gen: torch.Generator,
    cfg: ModelConfig,
    *,
    attn_in: int,
    input_norm: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.nn.Parameter]:
    """Parameters of one decoder layer whose q/k/v read `attn_in` features (HF init: N(0, 0.02), norms 1)."""
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    kw = {"dtype": dtype, "device": device}
    p = {
        "q": normal(gen, nq, attn_in, **kw),
        "k": normal(gen, nkv, attn_in, **kw),
        "v": normal(gen, nkv, attn_in, **kw),
        "o": normal(gen, h, nq, **kw),
        "gate": normal(gen, cfg.intermediate_size, h, **kw),
        "up": normal(gen, cfg.intermediate_size, h, **kw),
        "down": normal(gen, h, cfg.intermediate_size, **kw),
        "post_norm": ones(h, **kw),
    }
    if input_norm:
        p["input_norm"] = ones(h, **kw)
    qkv_bias, o_bias = bias_layout(cfg)
    if qkv_bias:
        p.update(q_bias=zeros(nq, **kw), k_bias=zeros(nkv, **kw), v_bias=zeros(nkv, **kw))
    if o_bias:
        p["o_bias"] = zeros(h, **kw)
    if cfg.qk_norm:
        p.update(q_norm=ones(d, **kw), k_norm=ones(d, **kw))
    return p


#: HF name of each decoder-layer parameter, relative to the layer's prefix.
LAYER_KEYS = {
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "hidden_norm": "hidden_norm.weight",  # EAGLE-3's norm of the incoming hidden state
}
