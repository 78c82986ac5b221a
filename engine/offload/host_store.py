"""The host store: packed layers off the device, in RAM arenas (pinned on CUDA) or in one
memory-mapped file on disk (the SSD tier: a private file, the prepared-layer cache, or the GGUF
file the model came from), read each pass with read-ahead of the next layers.

What this module does not do: copy layers to the device (streamer) or pack them (layout).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.errors import DiskFull
from engine.offload.layout import ALIGN
from engine.units import GIB

log = logging.getLogger(__name__)

HOST_ARENA_BYTES = GIB  # RAM layers are grouped into arenas of about this size


class HostStore:
    """Packed layers off the device: the first `ram_layers` in RAM arenas, the rest in one
    file mapped into memory. Index j is the j-th offloaded layer (not the model layer index);
    `sizes[j]` its packed bytes (GGUF layers differ in size when their types differ).

    The file is a private temporary one (written with `write_disk`, unlinked once mapped), or
    `disk_file` = (an existing file, the offset of each disk layer in it), mapped in place: the
    prepared-layer cache, or a GGUF file itself (its layers are spans of the file)."""

    def __init__(self, sizes: Sequence[int], ram_layers: int, pin: bool, disk_dir: Path | None = None,
                 disk_file: tuple[Path, Sequence[int]] | None = None, arena_bytes: int = HOST_ARENA_BYTES) -> None:
        self.sizes = list(sizes)
        self.layer_nbytes = max(self.sizes, default=0)
        self.ram_layers = ram_layers
        self.disk_layers = len(self.sizes) - ram_layers
        self.pinned = False
        self._arenas: list[torch.Tensor] = []
        self._ram: list[torch.Tensor] = []
        j = 0
        while j < ram_layers:
            # one allocation per arena, pinned as a whole: the CUDA host allocator would round
            # each pinned allocation up to a power of two
            starts: list[int] = []
            end = 0
            for k in range(j, ram_layers):
                if starts and end + self.sizes[k] > arena_bytes:
                    break
                starts.append(end)
                end += _aligned(self.sizes[k], ALIGN)
            arena = torch.empty(end, dtype=torch.uint8)
            if pin:
                self.pinned = _pin(arena) or self.pinned
            self._arenas.append(arena)
            self._ram += [arena[a:a + self.sizes[j + k]] for k, a in enumerate(starts)]
            j += len(starts)
        self._file: Path | None = None
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._disk: torch.Tensor | None = None
        self._owned = disk_file is None
        disk_sizes = self.sizes[ram_layers:]
        if self.disk_layers and disk_file is not None:
            self._file, offsets = disk_file[0], list(disk_file[1])
            assert len(offsets) == self.disk_layers
            self._offsets = offsets
            self._fd = os.open(self._file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        elif self.disk_layers:
            # disk layers start on page boundaries, so read-ahead and drop hints cover whole layers
            self._offsets, need = [], 0
            for n in disk_sizes:
                self._offsets.append(need)
                need += _aligned(n, mmap.PAGESIZE)
            directory = disk_dir or Path(tempfile.gettempdir())
            directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(directory).free
            if need + GIB > free:
                raise DiskFull(f"The model's layers that do not fit in RAM need {need / GIB:.1f} GiB on disk in "
                               f"'{directory}' but {free / GIB:.1f} GiB is free. Free some disk space, or use "
                               "--quant nf4 to make the layers four times smaller.")
            fd, name = tempfile.mkstemp(prefix="layers-", suffix=".bin", dir=directory)
            self._file, self._fd = Path(name), fd
            os.ftruncate(fd, need)
        else:
            self._offsets = []

    @property
    def ram_bytes(self) -> int:
        """RAM the store's arenas hold."""
        return sum(a.numel() for a in self._arenas)

    @property
    def disk_path(self) -> Path | None:
        return self._file

    def tier(self, j: int) -> str:
        return "ram" if j < self.ram_layers else "disk"

    def ram_buffer(self, j: int) -> torch.Tensor:
        return self._ram[j]

    def write_disk(self, j: int, buf: torch.Tensor) -> None:
        """Write packed layer j (a disk-tier index) through the page cache, not into this
        process's memory."""
        assert self._owned and self._fd is not None and self._map is None, "write every disk layer before reading"
        data = buf[: self.sizes[j]].contiguous().numpy().data  # its bytes as a memoryview, no copy
        os.lseek(self._fd, self._offset(j), os.SEEK_SET)
        while len(data):
            data = data[os.write(self._fd, data):]

    def seal(self) -> None:
        """Done writing: map the disk file for reading."""
        if self._fd is not None and self._map is None:
            if self._owned:
                os.fsync(self._fd)
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():  # read-only mapping: the tensor is only ever read
                warnings.simplefilter("ignore", UserWarning)
                self._disk = torch.frombuffer(self._map, dtype=torch.uint8)
            if self._owned and self._file is not None and os.name == "posix":
                self._file.unlink()  # the mapping keeps it; nothing is left behind after exit

    def source(self, j: int) -> torch.Tensor:
        if j < self.ram_layers:
            return self._ram[j]
        assert self._disk is not None, "seal() the store first"
        start = self._offset(j)
        return self._disk[start : start + self.sizes[j]]

    def will_need(self, j: int) -> None:
        """Read-ahead hint for disk layer j (a no-op for RAM layers)."""
        self._advise(j, getattr(mmap, "MADV_WILLNEED", None))

    def done_with(self, j: int) -> None:
        """Drop disk layer j's pages from this process (the OS may keep them cached)."""
        self._advise(j, getattr(mmap, "MADV_DONTNEED", None))

    def _advise(self, j: int, advice: int | None) -> None:
        if j < self.ram_layers or self._map is None or advice is None or not hasattr(self._map, "madvise"):
            return
        start = self._offset(j) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(_aligned(self._offset(j) + self.sizes[j], mmap.PAGESIZE), len(self._map))
        self._map.madvise(advice, start, end - start)

    def _offset(self, j: int) -> int:
        return self._offsets[j - self.ram_layers]

    def close(self) -> None:
        self._disk = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor view is still alive; the mapping goes with it
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._owned and self._file is not None and self._file.exists():
            self._file.unlink()
        for arena in self._arenas:
            _unpin(arena)
        self._arenas, self._ram = [], []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _aligned(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _pin(t: torch.Tensor) -> bool:
    """Page-lock an existing host tensor in place (exact size, unlike pinned allocations)."""
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        log.warning("could not pin %d MB of host memory (CUDA error %s); copies will be slower",
                    t.numel() >> 20, int(err))
        return False
    return True


def _unpin(t: torch.Tensor) -> None:
    if torch.cuda.is_available() and t.is_pinned():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

