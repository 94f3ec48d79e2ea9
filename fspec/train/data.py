"""A real corpus present on every machine: the Python standard library's source, and a BPE tokenizer for it.

The embedded default model is trained on these files (the GPU host's Python 3.12 standard library), with a
deterministic held-out split by file path, so "held-out text" means files the model never saw. The split
hashes the path relative to the library root, so it is the same on every machine and Python version for the
files they share.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")
_SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "lib2to3", "turtledemo"}
# Generated at build time, not written: `_sysconfigdata_*.py` is one dict literal of the interpreter's build
# configuration (compiler flags, paths), named per platform (`_sysconfigdata__x86_64-linux-gnu.py` on
# Ubuntu, `_sysconfigdata__linux_x86_64-linux-gnu.py` in a source build). Ubuntu's name is held out by the
# path hash and sorts first, so the default model's build read all its held-out loss and agreement windows
# from it.
_SKIP_PREFIXES = ("_sysconfigdata",)


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Every `.py` file of the standard library under `root` (default: this interpreter's), sorted.

    Installed third-party packages (site-packages) are excluded, as are a few directories of generated or
    legacy code and the generated build-configuration dumps `_sysconfigdata*.py` (a dict literal, not source
    code: Ubuntu's is held out and, being easy to predict, inflated held-out scores; under other names it
    fell in the training split). Every other file keeps its split, which depends only on its own path.
    """
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"root: expected a directory of Python source, got {str(root)!r}")
    files = [
        p
        for p in root.rglob("*.py")
        if not _SKIP_PARTS.intersection(p.relative_to(root).parts) and not p.name.startswith(_SKIP_PREFIXES)
    ]
    if not files:
        raise FileNotFoundError(f"root: expected .py files under {str(root)!r}, found none")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(relative_path: str, *, eval_fraction: float = 0.05) -> bool:
    """Deterministic held-out membership of a file, by a hash of its path relative to the library root."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_fraction


def split_files(
    files: Sequence[Path], root: str | Path | None = None, *, eval_fraction: float = 0.05
) -> tuple[list[Path], list[Path]]:
    """(train, held_out) file lists."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction: expected a value in (0, 1), got {eval_fraction!r}")
    root = stdlib_root() if root is None else Path(root)
    train, held = [], []
    for f in files:
        (held if is_held_out(f.relative_to(root).as_posix(), eval_fraction=eval_fraction) else train).append(
            f
        )
    return train, held


def read_texts(files: Sequence[Path]) -> Iterator[str]:
    """File contents, skipping files that are not valid UTF-8 (a handful of test fixtures)."""
    for f in files:
        try:
            yield f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def train_tokenizer(files: Sequence[Path], *, vocab_size: int = 4096):
    """A byte-level BPE tokenizer (the `tokenizers` library) trained on `files`; token 0 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(f"vocab_size: expected at least 300 (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_texts(files), trainer=trainer)
    return tok


def encode_files(tokenizer, files: Sequence[Path]) -> torch.Tensor:
    """All files' tokens concatenated, each file followed by <|endoftext|>: a 1-D int32 tensor."""
    eos = tokenizer.token_to_id(SPECIAL_TOKENS[0])
    chunks: list[torch.Tensor] = []
    texts = list(read_texts(files))
    for enc in tokenizer.encode_batch(texts):
        chunks.append(torch.tensor(enc.ids + [eos], dtype=torch.int32))
    if not chunks:
        raise ValueError("files: expected at least one readable file, got none")
    return torch.cat(chunks)


def sample_windows(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """[batch_size, seq_len] int64 windows at random offsets of a 1-D token tensor."""
    if tokens.dim() != 1 or tokens.numel() <= seq_len:
        raise ValueError(
            f"tokens: expected a 1-D tensor longer than seq_len={seq_len}, got {tuple(tokens.shape)}"
        )
    return tokens[
        window_index(tokens.numel(), batch_size=batch_size, seq_len=seq_len, generator=generator)
    ].long()


def window_index(length: int, *, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len] int64 indices of windows at random offsets of a stream of `length` tokens (what
    `sample_windows` reads; index a parallel stream, such as a loss mask, with the same windows)."""
    starts = torch.randint(0, length - seq_len, (batch_size,), generator=generator)
    return starts[:, None] + torch.arange(seq_len)[None, :]


def spread_starts(tokens: torch.Tensor, *, count: int, length: int, eos: int = 0) -> list[int]:
    """Start offsets of `count` windows of `length` tokens in a stream written by `encode_files`, spread
    evenly over its files.

    The stream is cut into files at the `eos` ids; files shorter than `length` tokens are skipped. With
    F such files, window i falls in file (2i + 1) F // (2 count): when count <= F, count distinct files
    evenly spaced through the (sorted) list; otherwise each file gets count // F or one more. The c windows
    of a file start evenly spaced inside it ((m + 1) / (c + 1) of the way, no eos inside). Deterministic,
    and each file weighs the same, so one large file cannot dominate an evaluation.
    """
    if tokens.dim() != 1 or count < 1 or length < 1:
        raise ValueError(
            f"tokens, count, length: expected a 1-D tensor and positive sizes, got {tuple(tokens.shape)}, "
            f"{count}, {length}"
        )
    ends = (tokens == eos).nonzero().flatten().tolist()
    if not ends or ends[-1] != tokens.numel() - 1:
        ends.append(tokens.numel())
    spans, begin = [], 0
    for end in ends:
        if end - begin >= length:
            spans.append((begin, end))
        begin = end + 1
    if not spans:
        raise ValueError(f"tokens: expected a file of at least length={length} tokens, found none")
    owner = [(2 * i + 1) * len(spans) // (2 * count) for i in range(count)]
    starts = []
    for j in sorted(set(owner)):
        (a, b), c = spans[j], owner.count(j)
        starts += [a + (b - a - length) * (m + 1) // (c + 1) for m in range(c)]
    return starts


def spread_windows(tokens: torch.Tensor, *, count: int, length: int, eos: int = 0) -> torch.Tensor:
    """[count, length] int64 windows at `spread_starts` (held-out evaluation: every file weighs the same)."""
    starts = spread_starts(tokens, count=count, length=length, eos=eos)
    idx = torch.tensor(starts)[:, None] + torch.arange(length)[None, :]
    return tokens[idx].long()
