"""Shared fixtures: tiny configs and the GPU marker's skip."""

from __future__ import annotations

import pytest
import torch

import fspec


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_model_cfg() -> fspec.ModelConfig:
    return fspec.ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )


@pytest.fixture
def tiny_draft_cfg(tiny_model_cfg) -> fspec.DraftConfig:
    return fspec.DraftConfig(
        kind="eagle", model=tiny_model_cfg, num_speculative_steps=3, block_size=4, max_model_len=32
    )
