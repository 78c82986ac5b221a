"""A GGUF file's header: metadata and tensor table, read from a memory map without touching
the tensor data.

The layout is the documented one (ggml's docs/gguf.md): "GGUF", a uint32 version (2 or 3),
uint64 tensor and metadata counts; metadata as (string key, uint32 type, value), strings as a
uint64 length and UTF-8 bytes, arrays as (uint32 element type, uint64 count, elements); then per
tensor (name, uint32 dimension count, uint64 dimensions fastest first, uint32 ggml type, uint64
offset into the data section), which starts at the next multiple of `general.alignment` (32).

gguf-py's GGUFReader reads the same thing but builds an object per array element: seconds for
a 128k-token vocabulary, on every load and for every file a folder listing shows. Here string
arrays are walked and kept only when asked for (the tokenizer's), numeric arrays are one
numpy copy. Every length is checked against the file's size first, so a damaged or hostile
header is one CorruptGGUF, never a huge allocation.

What this module does not do: interpret the metadata (gguf.py) or read tensor data.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
STRING, ARRAY = 8, 9
MAX_DIMS = 4


class CorruptGGUF(ValueError):
    """A GGUF whose header does not add up (truncated, damaged, or not a GGUF)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first
    qtype: int  # ggml type id
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    size: int
    metadata: dict[str, Any]  # string arrays not asked for are their element count
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, name: str) -> None:
        self.buf, self.pos, self.name, self.size = buf, 0, name, len(buf)

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise CorruptGGUF(f"{self.name} ends inside its header (truncated or not a GGUF file)")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, keep: bool = True) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = self.buf[self.pos:self.pos + n] if keep else b""
        self.pos += n
        try:
            return raw.decode("utf-8") if keep else ""
        except UnicodeDecodeError:
            raise CorruptGGUF(f"{self.name} has a header string that is not UTF-8") from None

    def value(self, vtype: int, keep_strings: bool) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            raise CorruptGGUF(f"{self.name} has a metadata value of unknown type {vtype}")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _NUMPY:
            width = np.dtype(_NUMPY[etype]).itemsize
            self.need(count * width)
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos).copy()
            self.pos += count * width
            return arr
        if etype != STRING:
            raise CorruptGGUF(f"{self.name} has a metadata array of unsupported type {etype}")
        self.need(count * 8)  # every string needs at least its length
        if keep_strings:
            return [self.string() for _ in range(count)]
        for _ in range(count):
            self.string(keep=False)
        return count


def read_header(path: Path, string_arrays: Container[str] = ()) -> GGUFHeader:
    """The header of the GGUF at `path`; the string arrays named in `string_arrays` (e.g.
    "tokenizer.ggml.tokens") are read in full, the others are left as their length."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise CorruptGGUF(f"{path.name} is too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size, string_arrays)


def _parse(buf: mmap.mmap, path: Path, size: int, string_arrays: Container[str]) -> GGUFHeader:
    c = _Cursor(buf, path.name)
    if buf[:4] != b"GGUF":
        raise CorruptGGUF(f"{path.name} is not a GGUF file (bad header)")
    c.pos = 4
    version = c.scalar("<I")
    if version not in (2, 3):
        raise CorruptGGUF(f"{path.name} is GGUF version {version}; SpecChat reads versions 2 and 3")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    if n_tensors > size // 24 or n_kv > size // 12:  # each needs more bytes than that
        raise CorruptGGUF(f"{path.name} claims more entries than the file can hold")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.scalar("<I"), key in string_arrays)
    raw = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CorruptGGUF(f"{path.name}: tensor {name} has {n_dims} dimensions")
        dims = [c.scalar("<Q") for _ in range(n_dims)]
        raw.append((name, tuple(reversed(dims)), c.scalar("<I"), c.scalar("<Q")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise CorruptGGUF(f"{path.name} has an invalid alignment {align!r}")
    data = (c.pos + align - 1) // align * align
    tensors = tuple(_tensor(path.name, name, shape, qtype, data + offset, size) for name, shape, qtype, offset in raw)
    return GGUFHeader(path, size, metadata, tensors)


def _tensor(file: str, name: str, shape: tuple[int, ...], qtype: int, offset: int, size: int) -> TensorInfo:
    try:
        values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise CorruptGGUF(f"{file}: tensor {name} has unknown ggml type {qtype}") from None
    numel = 1
    for d in shape:
        numel *= d
    if shape[-1] % values:
        raise CorruptGGUF(f"{file}: tensor {name} has rows of {shape[-1]} values, not whole blocks")
    nbytes = numel // values * block_bytes
    if offset + nbytes > size:
        raise CorruptGGUF(f"{file} is truncated (tensor {name} runs past the end of the file)")
    return TensorInfo(name, shape, qtype, offset, nbytes)
