"""On-disk cache of a model's prepared (NF4-packed) decoder layers, so the second start reads
packed layers instead of the bf16 checkpoint and skips quantisation.

One file per (checkpoint, layout): every layer's packed buffer at a page-aligned stride, plus a
`.done` marker written last. The key hashes the shard names, sizes and modification times, the
layout's offset table, the compute dtype and the quantisation, so a changed checkpoint (or a
new SpecChat layout) misses the cache; older files of the same folder are deleted when a new
one is written. Only NF4 models are cached: a 16-bit cache would duplicate the checkpoint.

What this module does not do: decide where layers go, or read checkpoints (materialise.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
from pathlib import Path

import torch

from engine.offload.layout import LayerLayout
from engine.units import GIB

log = logging.getLogger(__name__)

FORMAT = 1


def cache_key(files: list[Path], layout: LayerLayout, num_layers: int) -> str:
    shards = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    entries = [(e.name, e.kind, e.shape, str(e.dtype), e.offset, e.nbytes) for e in layout.entries]
    blob = json.dumps([FORMAT, shards, entries, str(layout.compute_dtype), layout.quant, num_layers])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class PreparedLayers:
    """Read or write the prepared-layer file of one model (a folder, or a GGUF file); `files`
    are the weight files whose names, sizes and times key the cache."""

    def __init__(self, cache_dir: Path, folder: Path, layout: LayerLayout, num_layers: int,
                 files: list[Path]) -> None:
        self.layer_nbytes = layout.nbytes
        self.num_layers = num_layers
        self.stride = (layout.nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.prefix = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
        self.dir = cache_dir
        self.path = cache_dir / f"{self.prefix}-{cache_key(files, layout, num_layers)}.bin"
        self.done = self.path.with_suffix(".done")
        self._fd: int | None = None

    @property
    def ready(self) -> bool:
        return self.done.is_file() and self.path.is_file() and self.path.stat().st_size == self.num_layers * self.stride

    # -- reading --
    def read_into(self, i: int, buf: torch.Tensor) -> None:
        """Packed layer i into `buf` (host or device)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        if buf.device.type == "cpu":
            view = buf.numpy().data  # the array's bytes as a memoryview, no copy
        else:
            host = torch.empty(self.layer_nbytes, dtype=torch.uint8)
            view = host.numpy().data
        os.lseek(self._fd, i * self.stride, os.SEEK_SET)
        got = 0
        while got < self.layer_nbytes:
            n = os.readv(self._fd, [view[got:]]) if hasattr(os, "readv") else _read_into(self._fd, view[got:])
            if n <= 0:
                raise OSError(f"the prepared-layer cache {self.path.name} is shorter than expected")
            got += n
        if buf.device.type != "cpu":
            buf.copy_(host)

    # -- writing --
    def start_writing(self) -> bool:
        """Open a fresh file for writing; False (and no cache) when the disk is too full."""
        self.dir.mkdir(parents=True, exist_ok=True)
        need = self.num_layers * self.stride
        if shutil.disk_usage(self.dir).free < need + 4 * GIB:
            log.info("not caching prepared layers: %d MB would leave under 4 GiB free", need >> 20)
            return False
        for old in self.dir.glob(f"{self.prefix}-*"):  # an older checkpoint or layout of this folder
            try:
                old.unlink(missing_ok=True)
            except OSError:  # mapped by a running SpecChat on Windows: left for a later start
                log.debug("could not remove %s", old)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o600)
        os.ftruncate(self._fd, need)
        return True

    def write(self, i: int, buf: torch.Tensor) -> None:
        assert self._fd is not None
        data = buf.cpu().contiguous().numpy().data
        os.lseek(self._fd, i * self.stride, os.SEEK_SET)
        while len(data):
            data = data[os.write(self._fd, data):]

    def finish(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            self.done.write_text("ok")
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """A write that did not finish: remove the partial file."""
        self.close()
        if not self.done.is_file():
            self.path.unlink(missing_ok=True)


def _read_into(fd: int, view: memoryview) -> int:  # platforms without readv (Windows)
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)
