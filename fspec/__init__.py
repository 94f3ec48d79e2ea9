"""fspec: speculative decoding for PyTorch as a pure step function over an immutable state pytree.

Naming convention everywhere: p = target distribution, q = draft distribution.
"""

# Pytrees: one namespace ("fspec") shared by optree, torch.func and torch.compile.
# Static configuration.
from fspec.config import BATCH_BUCKETS, DraftConfig, ModelConfig, bucket_for

# Metadata algebra.
from fspec.metadata import advance, decode_after, decode_metadata, first_step_metadata, slot_mapping
from fspec.pytree import pytree_dataclass, replace, static_field, tree

# State pytrees.
from fspec.state import (
    AttnMetadata,
    DraftState,
    init_draft_state,
    validate_attn_metadata,
    validate_draft_state,
)

__version__ = "0.1.0"

__all__ = [
    "AttnMetadata",
    "BATCH_BUCKETS",
    "DraftConfig",
    "DraftState",
    "ModelConfig",
    "advance",
    "bucket_for",
    "decode_after",
    "decode_metadata",
    "first_step_metadata",
    "init_draft_state",
    "pytree_dataclass",
    "replace",
    "slot_mapping",
    "static_field",
    "tree",
    "validate_attn_metadata",
    "validate_draft_state",
]
