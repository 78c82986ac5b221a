"""Small model files that are whole (their headers add up), for tests of import and listing:
the store refuses damaged ones, so stand-ins must be real files of their format."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFWriter


def safetensors_bytes(n: int) -> bytes:
    """A safetensors file of one uint8 tensor of `n` bytes (a little over `n` bytes in all)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(n)


def write_gguf(path: Path, arch: str = "llama", rows: int = 8, cols: int = 32) -> Path:
    """A GGUF with an architecture and one float32 tensor (rows x cols): whole, loads no model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.arange(rows * cols, dtype=np.float32).reshape(rows, cols))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
