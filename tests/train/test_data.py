"""The corpus reader and tokenizer: deterministic split, reversible tokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fspec.train import data


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


def test_stdlib_files_skips_generated_sysconfigdata_and_keeps_every_other_split(tmp_path: Path):
    """`_sysconfigdata*.py` (a generated dict of build flags; Ubuntu's name is held out and sorts first) is
    not part of the corpus; every other file is listed and split exactly as before, by its own path."""
    names = [
        "_sysconfigdata__x86_64-linux-gnu.py",
        "_sysconfigdata__linux_x86_64-linux-gnu.py",
        "abc.py",
        "asyncio/__init__.py",
        "bisect.py",
        "email/generator.py",
        "zipapp.py",
    ]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    assert data.is_held_out(names[0])  # why it mattered: the split holds Ubuntu's dump out
    files = data.stdlib_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == names[2:]
    train, held = data.split_files(files, tmp_path)
    rel = [p.relative_to(tmp_path).as_posix() for p in held]
    assert rel == [n for n in names[2:] if data.is_held_out(n)]
    assert all(not p.name.startswith("_sysconfigdata") for p in data.stdlib_files())


def test_spread_windows_weighs_every_file_alike():
    """Evaluation windows come from files spread through the stream, not from its first (largest) file."""
    big, small = list(range(1000, 2000)) + [0], [[k] * 20 + [0] for k in (6, 7, 8, 9)]
    stream = torch.tensor(big + sum(small, []) + [3] * 2, dtype=torch.int32)  # last file: too short

    def files_of(w):
        return [5 if int(r[0]) >= 1000 else int(r[0]) for r in w]

    w = data.spread_windows(stream, count=5, length=8)
    assert w.shape == (5, 8) and w.dtype == torch.int64 and files_of(w) == [5, 6, 7, 8, 9]
    assert bool((w[1:] == w[1:, :1]).all()) and w[0].tolist() == list(range(w[0, 0], w[0, 0] + 8))
    two = data.spread_windows(stream, count=2, length=8)  # fewer windows than files: evenly spaced files
    assert files_of(two) == [6, 8]
    many = data.spread_windows(stream, count=10, length=8)  # two per file, at different offsets
    assert files_of(many) == [5, 5, 6, 6, 7, 7, 8, 8, 9, 9] and int(many[0, 0]) < int(many[1, 0])
    assert torch.equal(data.spread_windows(stream, count=10, length=8), many)
    with pytest.raises(ValueError, match="tokens"):
        data.spread_windows(stream, count=2, length=2000)


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
