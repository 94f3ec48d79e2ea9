"""fspec: speculative decoding for PyTorch as a pure step function over an immutable state pytree.

Naming convention everywhere: p = target distribution, q = draft distribution.
"""

# Pytrees: one namespace ("fspec") shared by optree, torch.func and torch.compile.
from fspec.core.pytree import pytree_dataclass, replace, static_field, tree

# Static configuration.
from fspec.core.config import BATCH_BUCKETS, DraftConfig, ModelConfig, bucket_for

# State pytrees.
from fspec.core.sampling_params import SamplingParams
from fspec.core.state import AttnMetadata, DraftState, init_draft_state
from fspec.core.state import validate_attn_metadata, validate_draft_state

# Metadata algebra.
from fspec.core.metadata import (
    advance,
    decode_after,
    decode_metadata,
    decode_rollout,
    first_step_metadata,
    slot_mapping,
)

# Models, checkpoints, KV cache, attention.
from fspec.ops.attention import attention, dense_attention
from fspec.core.cache import (
    BlockAllocator,
    DenseKVCache,
    KVCache,
    block_table_row,
    blocks_needed,
    mark_static,
    write_kv,
)
from fspec.models.checkpoint import Draft, Target, init_draft, load_draft, load_target, save_draft
from fspec.models.checkpoint import render_chat, save_target
from fspec.models.heads import (
    TargetHidden,
    draft_to_target,
    eagle3_layer_ids,
    fuse_projections,
    head_forward,
    head_forward_dense,
    head_init,
    project_target_hidden,
    unfuse_projections,
    vocab_maps,
)

# Sampling and verification (p = target, q = draft).
from fspec.ops.sampling import gumbel_sample
from fspec.ops.verify import rejection_sample

# The draft loop.
from fspec.draft import draft_step, propose

# End-to-end generation, and its first step as a function.
from fspec.serve.engine import GenerateResult, Generator, StreamChunk, default_generator, generate, stream
from fspec.serve.prefill import Prefill, prefill
from fspec.serve.runner import Refill

# Training-time-test distillation, the embedded default model (SmolLM2-135M-Instruct and its EAGLE-3 head)
# and the 4-layer toy model (a fast test fixture).
from fspec.train.default_model import load_default
from fspec.train.toy_model import load_toy
from fspec.train.distill import DistillConfig, distill_head

__version__ = "0.1.0"

__all__ = [
    "advance",
    "attention",
    "AttnMetadata",
    "BATCH_BUCKETS",
    "block_table_row",
    "BlockAllocator",
    "blocks_needed",
    "bucket_for",
    "decode_after",
    "decode_rollout",
    "decode_metadata",
    "default_generator",
    "dense_attention",
    "distill_head",
    "DistillConfig",
    "Draft",
    "draft_step",
    "draft_to_target",
    "DraftConfig",
    "DraftState",
    "eagle3_layer_ids",
    "first_step_metadata",
    "fuse_projections",
    "generate",
    "GenerateResult",
    "Generator",
    "gumbel_sample",
    "head_forward",
    "head_forward_dense",
    "head_init",
    "init_draft",
    "init_draft_state",
    "DenseKVCache",
    "KVCache",
    "load_default",
    "load_toy",
    "load_draft",
    "load_target",
    "mark_static",
    "ModelConfig",
    "project_target_hidden",
    "propose",
    "Prefill",
    "Refill",
    "prefill",
    "pytree_dataclass",
    "rejection_sample",
    "render_chat",
    "replace",
    "SamplingParams",
    "save_draft",
    "save_target",
    "slot_mapping",
    "unfuse_projections",
    "static_field",
    "stream",
    "StreamChunk",
    "Target",
    "TargetHidden",
    "tree",
    "validate_attn_metadata",
    "validate_draft_state",
    "vocab_maps",
    "write_kv",
]
