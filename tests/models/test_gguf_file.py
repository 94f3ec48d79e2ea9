"""fspec.models.gguf_file: the one-pass GGUF parser against the `gguf` package's reader, and its errors."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from fspec.models.gguf_file import GGUFFormatError, parse

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def write_file(path: Path, *, alignment: int | None = None) -> None:
    """A GGUF file with metadata of every value type (arrays of strings, ints, floats, bools and a nested
    array among them) and tensors of plain, half, bf16-as-bytes and block-quantized types, odd shapes."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_uint32("general.alignment", alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.strings", ["a", "", "ĠĠ", "日本", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.no_items", [])
    w.add_tensor("a.f32", rng.normal(size=(3, 5)).astype(np.float32))
    w.add_tensor("b.f16", rng.normal(size=(7,)).astype(np.float16))
    w.add_tensor(
        "c.q8", gguf.quants.quantize(rng.normal(size=(5, 64)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0
    )
    w.add_tensor(
        "d.q41",
        gguf.quants.quantize(rng.normal(size=(2, 3, 32)).astype(np.float32), Q.Q4_1),
        raw_dtype=Q.Q4_1,
    )
    w.add_tensor(
        "e.bf16", gguf.quants.quantize(rng.normal(size=(4, 6)).astype(np.float32), Q.BF16), raw_dtype=Q.BF16
    )
    w.add_tensor("f.i32", np.arange(10, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_file")
    out = {}
    for alignment in (None, 64):
        path = root / f"align{alignment}.gguf"
        write_file(path, alignment=alignment)
        out[alignment] = path
    return out


@pytest.mark.parametrize("alignment", [None, 64])
def test_parse_equals_the_gguf_packages_reader(files, alignment):
    """Every metadata value (type and value) and every tensor (name, type, numpy-order shape, offset, byte
    count, bytes, dtype) equals what `gguf.GGUFReader` reads from the same file, at the default and a
    wider alignment."""
    path = files[alignment]
    ours = parse(path)
    reader = gguf.GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.version == 3 and list(ours.metadata) == list(theirs)
    # the reader's contents() flattens a nested array ([1, 2, 3]); the file holds [[1, 2], [3]]
    assert theirs.pop("t.nested") == [1, 2, 3] and ours.metadata["t.nested"] == [[1, 2], [3]]
    for key, value in theirs.items():
        got = ours.metadata[key]
        assert type(got) is type(value) and got == value, key
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.strings"][3] == "日本"
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(ours.tensors, reader.tensors):
        assert a.type_name == b.tensor_type.name
        assert a.shape == tuple(int(d) for d in reversed(b.shape.tolist()))
        assert (a.offset, a.n_bytes) == (b.data_offset, b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 1, order: str = "<") -> bytes:
    return b"GGUF" + struct.pack(f"{order}IQQ", version, n_tensors, n_kv)


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    "body, message",
    [
        (b"GGML" + bytes(20), r"expected a GGUF file \(magic b'GGUF'\), got first bytes b'GGML'"),
        (b"GG", r"magic b'GGUF'\), got first bytes b'GG'"),
        (_header(version=1), r"version: expected one of \(2, 3\), got 1"),
        (_header(order=">"), r"got 50331648 \(a big-endian file"),
        (_header()[:12], r"tensor count: expected 8 bytes at offset 8, the file has 4 \(truncated\?\)"),
        (_header() + _string("k") + struct.pack("<I", 13), r"'k': expected a value type in 0..12, got 13"),
        (_header() + _string("k") + struct.pack("<IQ", 8, 9) + b"abc", r"metadata 'k': expected 9 bytes"),
        (_header() + _string("k") + struct.pack("<IIQ", 9, 8, 3) + _string("a"), r"the file ends inside"),
        (_header() + _string("k") + struct.pack("<IIQ", 9, 5, 4) + bytes(8), r"'k': expected 16 bytes"),
        (_header() + _string("k") + struct.pack("<IQ", 8, 2) + b"\xff\xfe", r"'k': expected UTF-8 text"),
        (_header() + _string("k") + struct.pack("<IIQ", 9, 8, 1) + _string("a")[:-1] + b"\xff", r"UTF-8"),
        (_header(n_tensors=1) + _string("k") + struct.pack("<IB", 0, 1) + _string("w") + struct.pack("<I", 9),
         r"tensor 'w': expected at most 8 dimensions, got 9"),
    ],
)  # fmt: skip
def test_malformed_bytes_are_a_format_error_saying_where(tmp_path, body, message):
    """Bytes that break the layout raise GGUFFormatError (a ValueError) naming the part and what it expected;
    never an IndexError, a struct.error or a hang."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(body)
    with pytest.raises(GGUFFormatError, match=message):
        parse(path)
    assert issubclass(GGUFFormatError, ValueError)


@pytest.mark.parametrize("value, kind", [(0, 4), (-64, 5), ("32", 8)])
def test_an_alignment_that_is_not_a_positive_int_is_a_format_error(tmp_path, value, kind):
    """general.alignment of 0, a negative int or a string (the data section's start is a multiple of it)."""
    raw = struct.pack("<i" if kind == 5 else "<I", value) if kind != 8 else _string(value)
    path = tmp_path / "align.gguf"
    path.write_bytes(_header(n_kv=1) + _string("general.alignment") + struct.pack("<I", kind) + raw)
    with pytest.raises(
        GGUFFormatError, match=rf"general\.alignment: expected a positive byte count, got {value!r}"
    ):
        parse(path)


def test_tensor_data_past_the_end_is_none_with_its_extent(files, tmp_path):
    """A file cut inside its tensor data parses; the tensors the cut reaches have data None (their offset
    and byte count kept for the caller's message) and the ones before it keep their bytes."""
    data = files[None].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-30])
    cut = parse(path)
    whole = parse(files[None])
    assert [t.data is None for t in cut.tensors] == [
        t.offset + t.n_bytes > len(data) - 30 for t in whole.tensors
    ]
    assert cut.tensors[-1].data is None and cut.tensors[0].data is not None
    assert (cut.tensors[-1].offset, cut.tensors[-1].n_bytes) == (
        whole.tensors[-1].offset,
        whole.tensors[-1].n_bytes,
    )


def test_unknown_tensor_type_number_is_named_not_read(tmp_path):
    """A tensor type number the gguf package does not know parses as type 'type <n>' without data (the
    loader then names it as unsupported); a row that is not whole blocks of its type is a format error."""
    head = _header(n_tensors=1, n_kv=0)
    info = _string("w") + struct.pack("<I2QIQ", 2, 32, 2, 999, 0)
    path = tmp_path / "odd.gguf"
    path.write_bytes(head + info + bytes(64))
    (t,) = parse(path).tensors
    assert t.type_name == "type 999" and t.data is None and t.shape == (2, 32)
    path.write_bytes(head + _string("w") + struct.pack("<I2QIQ", 2, 30, 2, int(Q.Q8_0), 0) + bytes(96))
    with pytest.raises(
        GGUFFormatError, match=r"tensor 'w': its rows \(30\) are not whole 32-element blocks of Q8_0"
    ):
        parse(path)
