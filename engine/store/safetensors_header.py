"""A safetensors file's header, read and checked without torch and without touching the data:
the model store checks shards at import with it, the loader (engine.loading.checkpoint) before
it maps them.

The format is the documented one: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}} (plus an optional "__metadata__"), then the data. The
header is read bounded (MAX_HEADER_BYTES, the format's own limit; nesting and numbers bounded by
engine.untrusted), only from a regular file (a FIFO never blocks), and every tensor it declares
must lie within the file: a shard cut short by a broken download is a CorruptCheckpoint naming
it, before anything is allocated from the header.

What this module does not do: read tensor data or know torch's dtypes (ITEM_BYTES is the
format's table of element sizes).
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from engine.errors import MalformedInput
from engine.store.gguf_header import open_regular
from engine.untrusted import parse_json

MAX_HEADER_BYTES = 100_000_000
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1, "U64": 8, "U32": 4, "U16": 2}


class CorruptCheckpoint(ValueError):
    """A shard whose header or sizes do not add up (truncated or damaged download)."""


def check_header(header: object, name: str, data_bytes: int) -> None:
    """CorruptCheckpoint unless `header` has the documented shape: an object whose entries
    (besides "__metadata__") are objects {dtype: str, shape: [int >= 0, ...], data_offsets:
    [start, end]} with 0 <= start <= end <= data_bytes and, for a known dtype, end - start the
    bytes of that shape. Checked before anything is allocated from it."""
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{name} has a damaged header (not a JSON object)")
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                and isinstance(shape, list) and all(_count(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CorruptCheckpoint(f"{name} has a damaged header (the entry for {str(tensor)[:80]!r})")
        if offsets[1] > data_bytes:
            raise CorruptCheckpoint(f"{name} is truncated (tensor {str(tensor)[:80]!r} ends past the end of the file)")
        item = ITEM_BYTES.get(info["dtype"])
        if item is not None and offsets[1] - offsets[0] != math.prod(shape) * item:
            raise CorruptCheckpoint(f"{name} has a damaged header (tensor {str(tensor)[:80]!r} has the wrong size)")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_shard_header(file: BinaryIO, name: str, size: int) -> tuple[dict[str, Any], int]:
    """(header, where the data starts) of the safetensors file open in `file` (`size` bytes),
    checked by check_header."""
    file.seek(0)
    head = file.read(8)
    if len(head) != 8:
        raise CorruptCheckpoint(f"{name} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise CorruptCheckpoint(f"{name} is truncated or damaged (its header claims {n:,} bytes, longer than "
                                "the file)")
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpoint(f"{name} has a header of {n:,} bytes; the safetensors format allows at most "
                                f"{MAX_HEADER_BYTES:,} (damaged)")
    try:
        header = parse_json(file.read(n), what=f"the header of {name}", max_bytes=MAX_HEADER_BYTES)
    except MalformedInput as exc:
        raise CorruptCheckpoint(f"{name} has a damaged header ({exc.user_message.rstrip('.')})") from None
    check_header(header, name, size - 8 - n)
    assert isinstance(header, dict)
    return header, 8 + n


def open_shard(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file; CorruptCheckpoint if it is a folder,
    a FIFO, a socket or a device."""
    return open_regular(path, CorruptCheckpoint)


def check_shard(path: Path) -> None:
    """CorruptCheckpoint unless `path` is a regular file whose header is whole and whose tensors
    lie within it."""
    with open_shard(path) as f:
        read_shard_header(f, path.name, os.fstat(f.fileno()).st_size)
