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
header is one CorruptGGUF, never a huge allocation. Whatever the file claims, the parse is bounded:
the header must end within its first MAX_HEADER_BYTES (so no string or array it keeps is larger),
and the entries, tensors and strings it walks one by one number at most MAX_ITEMS in all (so a
sparse file of zeros claiming billions of empty strings is refused, not walked for an hour).

Every tensor must lie within the file, at an offset that is a multiple of the alignment: a file
cut short (a broken download, a full disk) is refused here by name, before anything is loaded or
registered. Only a regular file is opened (a FIFO or a folder is refused without blocking).

A model may be split by llama.cpp's gguf-split into files named `<name>-00001-of-00003.gguf`:
every part is a GGUF of its own holding whole tensors, the first also the model's metadata,
each `split.no` / `split.count` / `split.tensors.count`. `read_model` reads all parts into one
header whose tensors say which part holds them; a missing, renamed or foreign part is a
MissingPart or CorruptGGUF that names the file.

What this module does not do: interpret the metadata (gguf.py) or read tensor data.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, BinaryIO, TypeVar

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
STRING, ARRAY = 8, 9
MAX_DIMS = 4
# Bounds on what a header may claim. The largest real headers (a 256k-token vocabulary with its
# scores, types and merges, a tokenizer.json copied in) are tens of MiB and ~1M strings.
MAX_HEADER_BYTES = 256 << 20
MAX_ITEMS = 1 << 22  # metadata entries + tensors + strings in arrays, each walked in Python


P = TypeVar("P", bound=PurePath)
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


class CorruptGGUF(ValueError):
    """A GGUF whose header does not add up (truncated, damaged, or not a GGUF)."""


class MissingPart(CorruptGGUF):
    """A part of a split GGUF is not beside the others."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first
    qtype: int  # ggml type id
    offset: int  # absolute, in the file that holds it
    nbytes: int
    part: int = 0  # which file of a split model holds it (GGUFHeader.parts)

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
    parts: tuple[Path, ...] = ()  # every file of a split model, first to last; () for one file

    @property
    def files(self) -> tuple[Path, ...]:
        return self.parts or (self.path,)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, name: str) -> None:
        self.buf, self.pos, self.name, self.size = buf, 0, name, len(buf)
        self.items = 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise CorruptGGUF(f"{self.name} ends inside its header (truncated or not a GGUF file)")
        if self.pos + n > MAX_HEADER_BYTES:
            raise CorruptGGUF(f"{self.name} has a header larger than {MAX_HEADER_BYTES >> 20} MiB, far more than "
                              "any model's (damaged or not a GGUF file)")

    def count(self, n: int, what: str) -> None:
        """Walk budget: `n` more entries, tensors or strings, at most MAX_ITEMS in all."""
        self.items += n
        if self.items > MAX_ITEMS:
            raise CorruptGGUF(f"{self.name} claims {n:,} {what}, more than any model has (damaged or not a "
                              "GGUF file)")

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
        if etype in _NUMPY:  # bounded by need(): at most MAX_HEADER_BYTES copied
            width = np.dtype(_NUMPY[etype]).itemsize
            self.need(count * width)
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos).copy()
            self.pos += count * width
            return arr
        if etype != STRING:
            raise CorruptGGUF(f"{self.name} has a metadata array of unsupported type {etype}")
        self.need(count * 8)  # every string needs at least its length
        self.count(count, "strings in one array")
        if keep_strings:
            return [self.string() for _ in range(count)]
        for _ in range(count):
            self.string(keep=False)
        return count


def read_header(path: Path, string_arrays: Container[str] = ()) -> GGUFHeader:
    """The header of the GGUF at `path`; the string arrays named in `string_arrays` (e.g.
    "tokenizer.ggml.tokens") are read in full, the others are left as their length."""
    with open_regular(path) as f:
        size = f.seek(0, 2)
        if size < 24:
            raise CorruptGGUF(f"{path.name} is too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size, string_arrays)


def open_regular(path: Path, error: type[ValueError] = CorruptGGUF) -> BinaryIO:
    """`path` opened for reading if it is a regular file; `error` if it is a folder, a FIFO
    (opened without blocking, so a pipe where a model belongs cannot hang a listing), a socket
    or a device; OSError (missing, no permission) passes through."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else \
                "a socket or device"
            raise error(f"{path.name} is {kind}, not a model file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def split_parts(path: P) -> list[P]:
    """The files of the model `path` belongs to, from names alone: [path] for one file; every part
    of a split model (`<name>-00002-of-00003.gguf` -> parts 1, 2 and 3, whether present or not)
    in the folder of `path`."""
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) < 2 or not 1 <= int(m["no"]) <= int(m["count"]):
        return [path]
    count = int(m["count"])
    suffix = path.name[-len(".gguf"):]
    return [path.with_name(f"{m['stem']}-{no:05d}-of-{count:05d}{suffix}") for no in range(1, count + 1)]


def read_model(path: Path, string_arrays: Container[str] = ()) -> GGUFHeader:
    """The header of the model whose (first or any) file is `path`: one file's own, or a split
    model's parts read into one (metadata of the first part, tensors of all, each with its part).
    `path` of the result is the first part."""
    parts = split_parts(path)
    first = read_header(parts[0], string_arrays) if parts[0].exists() or len(parts) == 1 else None
    count = _split_count(first) if first is not None else len(parts)
    if len(parts) == 1:
        if count > 1:
            raise CorruptGGUF(f"{path.name} is part of a model split into {count} files, but its name does not "
                              "say which: keep the names llama.cpp gave the parts (<name>-00001-of-0000N.gguf).")
        assert first is not None, "a one-file model is read above (read_header raises if it cannot)"
        return first
    missing = [p.name for p in parts if not p.exists()]  # a pipe or folder there: read_header says so
    if missing:
        raise MissingPart(f"{path.name} is one of {len(parts)} files of a split model, but "
                          f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                          f"{'is' if len(missing) == 1 else 'are'} not beside it in {path.parent}. "
                          "Download every part into the same folder.")
    assert first is not None
    headers = [first] + [read_header(p) for p in parts[1:]]
    tensors: list[TensorInfo] = []
    for i, h in enumerate(headers):
        no, n = h.metadata.get("split.no"), _split_count(h)
        if no != i or n != len(parts):
            raise CorruptGGUF(f"{h.path.name} says it is part {no if isinstance(no, int) else '?'} of {n}, "
                              f"its name part {i} of {len(parts)} (counting from 0): the parts do not belong "
                              "together. Download the model again.")
        tensors += [TensorInfo(t.name, t.shape, t.qtype, t.offset, t.nbytes, i) for t in h.tensors]
    expected = first.metadata.get("split.tensors.count")
    names = {t.name for t in tensors}
    if len(names) != len(tensors) or (isinstance(expected, int) and expected != len(tensors)):
        raise CorruptGGUF(f"The parts of {parts[0].name} hold {len(tensors)} tensors"
                          f"{f' where {expected} were written' if isinstance(expected, int) else ''}"
                          f"{', some twice' if len(names) != len(tensors) else ''}: download the model again.")
    return GGUFHeader(parts[0], sum(h.size for h in headers), first.metadata, tuple(tensors), tuple(parts))


def _split_count(header: GGUFHeader) -> int:
    n = header.metadata.get("split.count", 1)
    return n if isinstance(n, int) and n > 0 else 1


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
    c.count(n_kv, "metadata entries")
    c.count(n_tensors, "tensors")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.scalar("<I"), key in string_arrays)
    raw = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CorruptGGUF(f"{path.name}: tensor {name[:80]} has {n_dims} dimensions")
        dims = [c.scalar("<Q") for _ in range(n_dims)]
        raw.append((name, tuple(reversed(dims)), c.scalar("<I"), c.scalar("<Q")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= 1 << 16 or align & (align - 1):
        raise CorruptGGUF(f"{path.name} has an invalid alignment {align!r}")
    data = (c.pos + align - 1) // align * align
    tensors = tuple(_tensor(path.name, name, shape, qtype, offset, data, align, size)
                    for name, shape, qtype, offset in raw)
    if len({t.name for t in tensors}) != len(tensors):
        raise CorruptGGUF(f"{path.name} names a tensor twice (damaged)")
    return GGUFHeader(path, size, metadata, tensors)


def _tensor(file: str, name: str, shape: tuple[int, ...], qtype: int, offset: int, data: int, align: int,
            size: int) -> TensorInfo:
    """One tensor's entry, checked: a known type, whole blocks, an aligned offset (relative to the
    data section at `data`), and its bytes within the file's `size`."""
    try:
        values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise CorruptGGUF(f"{file}: tensor {name[:80]} has unknown ggml type {qtype}") from None
    numel = 1
    for d in shape:
        numel *= d
    if shape[-1] % values:
        raise CorruptGGUF(f"{file}: tensor {name[:80]} has rows of {shape[-1]} values, not whole blocks")
    if offset % align:
        raise CorruptGGUF(f"{file}: tensor {name[:80]} starts at offset {offset}, not a multiple of the "
                          f"alignment {align} (damaged)")
    nbytes = numel // values * block_bytes
    if data + offset + nbytes > size:
        need = data + offset + nbytes
        raise CorruptGGUF(f"{file} is truncated: tensor {name[:80]} ends at byte {need:,}, past the end of the "
                          f"file ({size:,} bytes)")
    return TensorInfo(name, shape, qtype, data + offset, nbytes)
