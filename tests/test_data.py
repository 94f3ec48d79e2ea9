"""The corpus reader and tokenizer: deterministic split, reversible tokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fspec import data


def test_stdlib_split_is_deterministic_disjoint_and_excludes_site_packages():
    """Held-out files are chosen by path hash: stable, disjoint from training, about 5% of files."""
    files = data.stdlib_files()
    assert all("site-packages" not in p.parts for p in files)
    train, held = data.split_files(files)
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(files)
    assert 0.02 < len(held) / len(files) < 0.10
    assert data.split_files(files) == (train, held)
    assert data.is_held_out("asyncio/__init__.py") == data.is_held_out("asyncio/__init__.py")


def test_tokenizer_round_trips_held_out_source(tmp_path: Path):
    """A BPE tokenizer trained on a few files decodes held-out source back to the same text."""
    files = data.stdlib_files()
    train, held = data.split_files(files)
    tok = data.train_tokenizer(train[:40], vocab_size=512)
    assert tok.get_vocab_size() == 512 and tok.token_to_id("<|endoftext|>") == 0
    text = next(data.read_texts(held[:1]))
    assert tok.decode(tok.encode(text).ids) == text
    ids = data.encode_files(tok, held[:2])
    assert ids.dtype == torch.int32 and int((ids == 0).sum()) >= 2
    windows = data.sample_windows(ids, batch_size=3, seq_len=16, generator=torch.Generator().manual_seed(0))
    assert windows.shape == (3, 16) and windows.dtype == torch.int64


def test_data_rejects_bad_arguments(tmp_path: Path):
    """Missing directories and bad sizes are named."""
    with pytest.raises(FileNotFoundError, match="root"):
        data.stdlib_files(tmp_path / "nope")
    with pytest.raises(ValueError, match="eval_fraction"):
        data.split_files([], tmp_path, eval_fraction=1.5)
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer([], vocab_size=10)
    with pytest.raises(ValueError, match="tokens"):
        data.sample_windows(torch.arange(4), batch_size=1, seq_len=8, generator=torch.Generator())
