"""A GGUF file's header, metadata and tensor table, parsed in one pass over its bytes (little-endian, format
versions 2 and 3), and each tensor's bytes as a numpy view of the memory-mapped file.

`fspec.models.gguf` reads Llama checkpoints through this instead of the `gguf` package's `GGUFReader`, which
builds a numpy view for every part of every field: on SmolLM2-135M-Instruct's file (a 49152-token vocabulary
and 48900 merges, ~147k field parts) its constructor took 6.5 s of a 10.5 s `load_target` on one CPU thread.
Here a string array is one loop of slices over the header bytes and a numeric array one `np.frombuffer`.
The `gguf` package still dequantizes (`gguf.quants.dequantize`) and names the tensor types
(`gguf.GGMLQuantizationType`, `gguf.GGML_QUANT_SIZES`).

Layout (llama.cpp's docs/gguf.md): magic ``GGUF``, version u32, tensor count u64, metadata count u64; each
metadata entry a string key, a u32 value type and the value (strings: u64 length + UTF-8 bytes; arrays: u32
element type, u64 count, the elements); each tensor a string name, u32 dimension count, u64 dimensions
(innermost first), u32 type, u64 offset from the data section, which starts at the next multiple of
``general.alignment`` (default 32) after the tensor table.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, numpy dtype) for the scalar types; 8 = string, 9 = array
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes do not follow the GGUF layout (the message says where); `gguf.read_gguf` names the file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    Attributes:
        name: the GGUF tensor name (``blk.0.attn_q.weight``).
        type_name: the `gguf.GGMLQuantizationType` name (``F32``, ``Q4_1``, ...), or ``type <n>`` for a
            number the `gguf` package does not know.
        shape: numpy order (outermost first): [out, in] for a matrix.
        offset: absolute byte offset in the file.
        n_bytes: bytes of the tensor's data.
        data: the bytes as a read-only numpy view of the memory map: the element dtype and `shape` for F32 /
            F16 / F64 / I8..I64, uint8 of shape [..., row bytes] for BF16 and the block-quantized types
            (what `gguf.quants.dequantize` takes); None where the file ends before them.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int
    data: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: `version`, `metadata` (key -> str, int, float, bool or list) and `tensors` in
    file order."""

    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


class _Cursor:
    """Reads little-endian values from `buf` at `pos`, raising GGUFFormatError past its end."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFFormatError(f"{what}: expected {n} bytes at offset {self.pos}, the file has "
                                  f"{max(len(self.buf) - self.pos, 0)} (truncated?)")  # fmt: skip
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what}: expected UTF-8 text, got undecodable bytes ({e})") from None

    def strings(self, count: int, what: str) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        size = len(buf)
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise GGUFFormatError(f"{what}: the file ends inside its strings (truncated?)")
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise GGUFFormatError(f"{what}: the file ends inside its strings (truncated?)")
                out.append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what}: expected UTF-8 text, got undecodable bytes ({e})") from None
        self.pos = pos
        return out

    def value(self, kind: int, what: str):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            elem = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if elem == _STRING:
                return self.strings(count, what)
            if elem in _SCALARS:
                dtype = np.dtype(_SCALARS[elem][1]).newbyteorder("<")
                raw = self.take(count * dtype.itemsize, what)
                return np.frombuffer(raw, dtype=dtype).tolist()
            if elem == _ARRAY:  # nested arrays: rare, element by element
                return [self.value(_ARRAY, what) for _ in range(count)]
            raise GGUFFormatError(f"{what}: expected an array element type in 0..12, got {elem}")
        raise GGUFFormatError(f"{what}: expected a value type in 0..12, got {kind}")


def parse(path: Path) -> GGUFFile:
    """Parse the GGUF file at `path` (which must exist). Raises GGUFFormatError (a ValueError) for a file that
    is not GGUF, another version, a big-endian file, a header that runs past the file's end, or an unknown
    value type. Tensors whose data runs past the end get `data` None: the caller names them."""
    import gguf

    # a plain ndarray over the map: slices of an np.memmap pay its __array_finalize__, which took ~0.75 s of
    # `gguf.quants.dequantize`'s row groups on SmolLM2's file
    mm = (
        np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
        if path.stat().st_size
        else np.zeros(0, np.uint8)
    )
    cur = _Cursor(memoryview(mm))
    magic = bytes(cur.take(4, "magic")) if len(mm) >= 4 else bytes(mm)
    if magic != MAGIC:
        raise GGUFFormatError(f"expected a GGUF file (magic b'GGUF'), got first bytes {magic!r}")
    version = cur.scalar("<I", "version")
    if version not in VERSIONS:
        swapped = struct.unpack(">I", struct.pack("<I", version))[0]
        hint = " (a big-endian file: fspec reads little-endian GGUF)" if swapped in VERSIONS else ""
        raise GGUFFormatError(f"version: expected one of {VERSIONS}, got {version}{hint}")
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata entry {i}'s key")
        metadata[key] = cur.value(cur.scalar("<I", f"metadata {key!r}"), f"metadata {key!r}")
    table = []
    for i in range(n_tensors):
        name = cur.string(f"tensor {i}'s name")
        ndim = cur.scalar("<I", f"tensor {name!r}")
        if ndim > 8:
            raise GGUFFormatError(f"tensor {name!r}: expected at most 8 dimensions, got {ndim}")
        dims = struct.unpack(f"<{ndim}Q", cur.take(8 * ndim, f"tensor {name!r}"))
        kind = cur.scalar("<I", f"tensor {name!r}")
        offset = cur.scalar("<Q", f"tensor {name!r}")
        table.append((name, dims, kind, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0:
        raise GGUFFormatError(f"general.alignment: expected a positive byte count, got {alignment!r}")
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in table:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            tensors.append(TensorInfo(name, f"type {kind}", tuple(reversed(dims)), start + offset, 0, None))
            continue
        shape = tuple(int(d) for d in reversed(dims)) or (1,)  # numpy order
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if shape and shape[-1] % block:
            raise GGUFFormatError(f"tensor {name!r}: its rows ({shape[-1]}) are not whole {block}-element "
                                  f"blocks of {qtype.name}")  # fmt: skip
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        n_bytes = count // block * type_size
        begin = start + offset
        data = None
        if begin + n_bytes <= len(mm):
            raw = mm[begin : begin + n_bytes]
            if qtype.name in _PLAIN:
                data = raw.view(_PLAIN[qtype.name]).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(TensorInfo(name, qtype.name, shape, begin, n_bytes, data))
    return GGUFFile(version=version, metadata=metadata, tensors=tuple(tensors))
