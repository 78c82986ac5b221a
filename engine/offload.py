"""Offloaded decoder layers: the packed layer layout, the host store (RAM and SSD tiers) and the
streaming executor that runs a pass while the next layers are copied in.

Layout: every decoder layer of a model has the same parameters, so one offset table
(`LayerLayout`) describes any layer packed into one flat byte buffer. "Load layer i into ring
slot k" is then a single contiguous copy; a template decoder layer whose parameters are views
into slot k runs it. NF4 layers travel packed (4-bit codes + one fp32 absmax per 64 weights)
and are dequantised on the device into one dense buffer just before they run.

Tiers: a layer's home is the device (a resident transformers module, or a packed device buffer
for NF4), RAM (one contiguous buffer in an arena, pinned when the device is CUDA) or disk (a
slice of one memory-mapped file, read each pass with read-ahead of the next layers).

On CUDA, copies run on a side stream ordered by events: a slot is overwritten only after the
layer that last used it has run, and a layer runs only after its copy landed. On CPU the same
executor copies with plain `copy_` on a worker thread, so the schedule is exercised by tests.

What this module does not do: read checkpoints (weights.py, loading.py) or choose budgets.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import DiskFull
from .types import Offload, Placement, Quant

log = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of every entry: safe for any dtype view and for DMA
NF4_BLOCK = 64
RING_SLOTS = 3
HOST_ARENA_BYTES = 1 << 30  # RAM layers are grouped into arenas of about this size
GIB = 1 << 30


# ---- layout ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One tensor of a packed layer. kind "dense": a parameter stored in the compute dtype;
    "nf4": a Linear weight's 4-bit codes (uint8, two per byte, bitsandbytes order) whose
    per-block absmax is the entry `name + ABSMAX`."""

    name: str
    kind: str
    shape: tuple[int, ...]  # the parameter's shape (for nf4 too: the dequantised shape)
    dtype: torch.dtype  # storage dtype
    offset: int
    nbytes: int


ABSMAX = "#absmax"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LayerLayout:
    entries: tuple[Entry, ...]
    nbytes: int  # one packed layer
    dense_nbytes: int  # the same layer with every parameter in the compute dtype
    compute_dtype: torch.dtype
    quant: Quant

    @classmethod
    def of(cls, layer: nn.Module, compute_dtype: torch.dtype, quant: Quant) -> LayerLayout:
        """The layout of a decoder layer (any device, meta included): Linear weights are NF4
        when quant is "nf4" and their size is a multiple of the block; the rest stays dense."""
        linear = {f"{name}.weight" for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        entries: list[Entry] = []
        offset = dense = 0
        esize = torch.empty((), dtype=compute_dtype).element_size()
        for name, p in layer.named_parameters():
            numel = p.numel()
            dense += _aligned(numel * esize)
            if quant == "nf4" and name in linear and numel % NF4_BLOCK == 0:
                entries.append(Entry(name, "nf4", tuple(p.shape), torch.uint8, offset, numel // 2))
                offset += _aligned(numel // 2)
                n_abs = numel // NF4_BLOCK * 4
                entries.append(Entry(name + ABSMAX, "absmax", (numel // NF4_BLOCK,), torch.float32, offset, n_abs))
                offset += _aligned(n_abs)
            else:
                entries.append(Entry(name, "dense", tuple(p.shape), compute_dtype, offset, numel * esize))
                offset += _aligned(numel * esize)
        return cls(tuple(entries), offset, dense, compute_dtype, quant)

    def dense_layout(self) -> LayerLayout:
        """The unpacked twin: every parameter dense, in the same order."""
        entries, offset = [], 0
        esize = torch.empty((), dtype=self.compute_dtype).element_size()
        for e in self.entries:
            if e.kind == "absmax":
                continue
            n = _numel(e.shape) * esize
            entries.append(Entry(e.name, "dense", e.shape, self.compute_dtype, offset, n))
            offset += _aligned(n)
        return LayerLayout(tuple(entries), offset, offset, self.compute_dtype, "none")

    def view(self, buf: torch.Tensor, entry: Entry) -> torch.Tensor:
        """The tensor `entry` inside a packed buffer `buf` (uint8, nbytes long)."""
        raw = buf[entry.offset : entry.offset + entry.nbytes]
        if entry.kind == "nf4":
            return raw.view(-1, 1)  # (numel/2, 1): bitsandbytes' packed shape
        return raw.view(entry.dtype).view(entry.shape)

    def params(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dense parameter views (only meaningful for an unquantised layout)."""
        assert self.quant == "none"
        return {e.name: self.view(buf, e) for e in self.entries}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- NF4 ------------------------------------------------------------------------------------
def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight -> (packed codes (numel/2, 1) uint8, absmax (numel/64,) fp32), blocksize 64."""
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(weight.contiguous(), blocksize=NF4_BLOCK, quant_type="nf4")
    return packed, state.absmax.float()


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, code: torch.Tensor) -> None:
    """Write the dequantised weight into `out` (its shape and dtype), on packed's device."""
    import bitsandbytes.functional as bnbf

    state = bnbf.QuantState(absmax=absmax, shape=out.shape, code=code, blocksize=NF4_BLOCK,
                            quant_type="nf4", dtype=out.dtype)
    if out.device.type == "cuda":
        bnbf.dequantize_4bit(packed, state, out=out)
    else:  # bitsandbytes' CPU backend has no out= variant
        out.copy_(bnbf.dequantize_4bit(packed, state))


def nf4_code(device: torch.device) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.get_4bit_type("nf4", device=device)


def pack_entry(layout: LayerLayout, buf: torch.Tensor, name: str, value: torch.Tensor) -> None:
    """Store parameter `name` (any dtype/device) into packed buffer `buf`, quantising as the
    layout says."""
    entry = next(e for e in layout.entries if e.name == name)
    if entry.kind == "nf4":
        packed, absmax = quantize_nf4(value.to(layout.compute_dtype))
        layout.view(buf, entry).copy_(packed.view(-1, 1))
        layout.view(buf, _absmax_entry(layout, name)).copy_(absmax)
    else:
        layout.view(buf, entry).copy_(value.reshape(entry.shape))


def pack_prequantized(layout: LayerLayout, buf: torch.Tensor, name: str, packed: torch.Tensor,
                      absmax: torch.Tensor) -> None:
    """Store an already-NF4 weight (blocksize 64) as it is."""
    layout.view(buf, next(e for e in layout.entries if e.name == name)).copy_(packed.reshape(-1, 1))
    layout.view(buf, _absmax_entry(layout, name)).copy_(absmax.float())


def _absmax_entry(layout: LayerLayout, name: str) -> Entry:
    return next(e for e in layout.entries if e.name == name + ABSMAX)


def unpack_into(layout: LayerLayout, packed_buf: torch.Tensor, dense: dict[str, torch.Tensor],
                code: torch.Tensor) -> None:
    """Fill dense parameter tensors from a packed buffer (dequantising NF4 entries)."""
    for e in layout.entries:
        if e.kind == "nf4":
            dequantize_nf4(layout.view(packed_buf, e), layout.view(packed_buf, _absmax_entry(layout, e.name)),
                           dense[e.name], code)
        elif e.kind == "dense":
            dense[e.name].copy_(layout.view(packed_buf, e))


def bind(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Make `module`'s parameters the given tensors (views: no copy)."""
    for name, t in params.items():
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, nn.Parameter(t, requires_grad=False))


# ---- host store -----------------------------------------------------------------------------
class HostStore:
    """Packed layers off the device: the first `ram_layers` in RAM arenas, the rest in one
    file mapped into memory. Index j is the j-th offloaded layer (not the model layer index).

    The file is a private temporary one (written with `write_disk`, unlinked once mapped), or
    `disk_file` = (an existing file of packed layers at a page-aligned stride, the file index of
    the first disk layer): the prepared-layer cache, mapped in place."""

    def __init__(self, layer_nbytes: int, ram_layers: int, disk_layers: int, pin: bool,
                 disk_dir: Path | None = None, disk_file: tuple[Path, int] | None = None) -> None:
        self.layer_nbytes = layer_nbytes
        self.ram_layers = ram_layers
        self.disk_layers = disk_layers
        self.pinned = False
        self._arenas: list[torch.Tensor] = []
        self._ram: list[torch.Tensor] = []
        per_arena = max(1, HOST_ARENA_BYTES // max(layer_nbytes, 1))
        left = ram_layers
        while left > 0:
            n = min(per_arena, left)
            # one allocation per arena, pinned as a whole: the CUDA host allocator would round
            # each pinned allocation up to a power of two
            arena = torch.empty(n * layer_nbytes, dtype=torch.uint8)
            if pin:
                self.pinned = _pin(arena) or self.pinned
            self._arenas.append(arena)
            self._ram += [arena[i * layer_nbytes : (i + 1) * layer_nbytes] for i in range(n)]
            left -= n
        # disk layers start on page boundaries, so read-ahead and drop hints cover whole layers
        self._stride = (layer_nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._file: Path | None = None
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._disk: torch.Tensor | None = None
        self._owned = disk_file is None
        self._first = 0  # file index of disk layer ram_layers
        if disk_layers and disk_file is not None:
            self._file, self._first = disk_file
            self._fd = os.open(self._file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        elif disk_layers:
            directory = disk_dir or Path(tempfile.gettempdir())
            directory.mkdir(parents=True, exist_ok=True)
            need = disk_layers * self._stride
            free = shutil.disk_usage(directory).free
            if need + GIB > free:
                raise DiskFull(f"The model's layers that do not fit in RAM need {need / GIB:.1f} GiB on disk in "
                               f"'{directory}' but {free / GIB:.1f} GiB is free. Free some disk space, or use "
                               "--quant nf4 to make the layers four times smaller.")
            fd, name = tempfile.mkstemp(prefix="layers-", suffix=".bin", dir=directory)
            self._file, self._fd = Path(name), fd
            os.ftruncate(fd, disk_layers * self._stride)

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
        data = memoryview(buf.contiguous().numpy())
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
                self._disk = torch.frombuffer(self._map, dtype=torch.uint8)  # type: ignore[call-overload]
            if self._owned and self._file is not None and os.name == "posix":
                self._file.unlink()  # the mapping keeps it; nothing is left behind after exit

    def source(self, j: int) -> torch.Tensor:
        if j < self.ram_layers:
            return self._ram[j]
        assert self._disk is not None, "seal() the store first"
        start = self._offset(j)
        return self._disk[start : start + self.layer_nbytes]

    def will_need(self, j: int) -> None:
        """Read-ahead hint for disk layer j (a no-op for RAM layers)."""
        self._advise(j, getattr(mmap, "MADV_WILLNEED", None))

    def done_with(self, j: int) -> None:
        """Drop disk layer j's pages from this process (the OS may keep them cached)."""
        self._advise(j, getattr(mmap, "MADV_DONTNEED", None))

    def _advise(self, j: int, advice: int | None) -> None:
        if j < self.ram_layers or self._map is None or advice is None or not hasattr(self._map, "madvise"):
            return
        self._map.madvise(advice, self._offset(j), self._stride)

    def _offset(self, j: int) -> int:
        return (self._first + j - self.ram_layers) * self._stride

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


# ---- the executor ---------------------------------------------------------------------------
LayerCall = Callable[[nn.Module, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerHome:
    """Where model layer i lives: a resident module, a packed device buffer (NF4 resident) or
    index `store_index` of the host store."""

    module: nn.Module | None = None
    packed: torch.Tensor | None = None
    store_index: int | None = None


class LayerStreamer:
    """Runs all decoder layers of a pass in order, streaming the offloaded ones through a ring
    of device slots. `call(module, layer_idx, hidden)` runs one layer (causal_lm supplies it)."""

    def __init__(self, homes: list[LayerHome], layout: LayerLayout, store: HostStore | None,
                 make_template: Callable[[], nn.Module], device: torch.device, ring_slots: int = RING_SLOTS) -> None:
        self.homes = homes
        self.layout = layout
        self.store = store
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.streamed = [i for i, h in enumerate(homes) if h.store_index is not None]
        m = len(self.streamed)
        self.k = min(ring_slots, m) if m else 0
        self._slots = [torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.k)]
        self._code = nf4_code(self.device) if layout.quant == "nf4" else None
        self.dense_layout = layout.dense_layout()
        if layout.quant == "nf4":
            # one dense buffer: the compute stream dequantises into it, then runs the layer
            self._dense = torch.empty(self.dense_layout.nbytes, dtype=torch.uint8, device=self.device)
            self._dense_params = self.dense_layout.params(self._dense)
            self._dense_template = make_template()
            bind(self._dense_template, self._dense_params)
            self._templates: list[nn.Module] = []
        else:
            self._templates = []
            for slot in self._slots:
                t = make_template()
                bind(t, layout.params(slot))
                self._templates.append(t)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specchat-offload") if m else None
        self._copy_stream = torch.cuda.Stream(device=self.device) if self.cuda and m else None
        self._loaded = [torch.cuda.Event() for _ in range(self.k)] if self._copy_stream else []
        self._free = [torch.cuda.Event() for _ in range(self.k)] if self._copy_stream else []
        self._staging = ([torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(self.k)]
                         if self._copy_stream and store is not None and store.disk_layers else [])
        self._pending: list[Future[None] | None] = [None] * self.k
        self._slot_layer: list[int | None] = [None] * self.k  # store index a slot holds (or is getting)
        self._pos = 0  # position in the cyclic sequence of streamed layers of the next layer to run
        self._primed = False

    # -- scheduling --
    def _submit(self, pos: int) -> None:
        """Start loading streamed position `pos` into its slot (pos % k)."""
        assert self._pool is not None and self.store is not None
        k = pos % self.k
        j = self.homes[self.streamed[pos % len(self.streamed)]].store_index
        assert j is not None
        if self._slot_layer[k] == j:  # already there (ring as large as the streamed set)
            return
        self._slot_layer[k] = j
        if self.store.tier(j) == "disk":
            self.store.will_need(j)
        self._pending[k] = self._pool.submit(self._load, j, k)

    @torch.inference_mode()
    def _load(self, j: int, k: int) -> None:
        assert self.store is not None
        src = self.store.source(j)
        disk = self.store.tier(j) == "disk"
        if self._copy_stream is None:  # CPU: a plain copy (on this worker thread)
            self._slots[k].copy_(src)
        else:
            if disk:  # page in from the file to pinned staging, then DMA
                staging = self._staging[k]
                self._loaded[k].synchronize()  # the previous DMA out of this staging buffer
                staging.copy_(src)
                src = staging
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._free[k])  # the slot's previous layer has run
                self._slots[k].copy_(src, non_blocking=True)
                self._loaded[k].record(self._copy_stream)
        if disk:
            self.store.done_with(j)

    def _acquire(self, pos: int) -> int:
        k = pos % self.k
        fut = self._pending[k]
        if fut is not None:
            fut.result()
            self._pending[k] = None
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[k])
        return k

    def _release(self, k: int) -> None:
        if self._copy_stream is not None:
            self._free[k].record(torch.cuda.current_stream(self.device))

    def reset(self) -> None:
        """Forget the schedule (after a failed pass): wait for copies in flight; the next pass
        starts from its first layer."""
        for k, fut in enumerate(self._pending):
            if fut is not None:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 -- the next pass reloads the slot
                    log.debug("a layer copy failed during a failed pass", exc_info=True)
            self._pending[k] = None
        self._slot_layer = [None] * self.k
        self._pos, self._primed = 0, False

    # -- one pass --
    def run(self, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        try:
            return self._run(hidden, call)
        except BaseException:
            self.reset()
            raise

    def _run(self, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        m = len(self.streamed)
        if m and not self._primed:
            for p in range(self.k):
                self._submit(p)
            self._primed = True
        for i, home in enumerate(self.homes):
            if home.module is not None:
                hidden = call(home.module, i, hidden)
                continue
            if home.packed is not None:  # NF4 resident on the device
                assert self._code is not None
                unpack_into(self.layout, home.packed, self._dense_params, self._code)
                hidden = call(self._dense_template, i, hidden)
                continue
            pos = self._pos
            k = self._acquire(pos)
            if self._code is not None:
                unpack_into(self.layout, self._slots[k], self._dense_params, self._code)
                self._release(k)  # the slot is free once dequantised
                hidden = call(self._dense_template, i, hidden)
            else:
                hidden = call(self._templates[k], i, hidden)
                self._release(k)
            self._pos = pos + 1
            # refill this slot with the layer k positions ahead (wrapping into the next pass)
            self._submit(pos + self.k)
        # positions keep counting across passes (each pass consumes exactly m), so a slot
        # prefetched at the end of one pass is found at the start of the next
        return hidden

    def close(self) -> None:
        self.reset()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()


# ---- placement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryNeeds:
    """Device memory a target needs besides its decoder layers, in bytes."""

    fixed: int  # embeddings, final norm, head, rotary tables; plus the draft if it shares the device
    kv_per_token: int  # all target layers, K and V
    activations: int  # one pass at the largest tree budget


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def activation_bytes(budget: int, context: int, hidden: int, intermediate: int, num_heads: int,
                     vocab: int, dtype_bytes: int) -> int:
    """A generous estimate of one pass's transient memory at `budget` tokens: residual and
    normed states, q/k/v/o, the MLP's three intermediates, the additive mask and attention
    scores of every head over the whole context (SDPA's math fallback materialises them),
    and fp32 logits for every tree row."""
    states = budget * (6 * hidden + 3 * intermediate) * dtype_bytes
    scores = budget * context * (num_heads + 1) * dtype_bytes
    logits = budget * vocab * 4
    return states + scores + logits


def plan_placement(*, num_layers: int, layer_bytes: int, dense_layer_bytes: int, quant: Quant,
                   offload: Offload, device: str, device_free: int, needs: MemoryNeeds, context_length: int,
                   host_free: int, margin: int = GIB, ring_slots: int = RING_SLOTS) -> Placement:
    """How many decoder layers stay on the device, in RAM and on disk.

    device_free: free device memory now (for a CPU device: the RAM the layers may use).
    host_free: RAM the host store may use (already less the OS/app margin).
    Resident layers are what fits after the fixed part, the KV cache for `context_length`,
    the activations, the margin and (when anything streams) the ring of slot buffers.
    """
    fit = max(0, host_free) // max(layer_bytes, 1)
    if device == "cpu":
        # device memory is RAM: "resident" layers and the host store draw on the same budget,
        # so auto keeps what fits resident and sends the rest to disk; all streams everything
        if offload == "none":
            return Placement(num_layers, num_layers, 0, 0, layer_bytes, quant, device)
        if offload == "auto":
            resident = min(num_layers, fit)
            return Placement(num_layers, resident, 0, num_layers - resident, layer_bytes, quant, device)
        ram = min(num_layers, fit)
        return Placement(num_layers, 0, ram, num_layers - ram, layer_bytes, quant, device)
    if offload == "none":
        gpu = num_layers
    elif offload == "all":
        gpu = 0
    else:
        budget = device_free - needs.fixed - needs.kv_per_token * context_length - needs.activations - margin
        gpu = max(0, min(num_layers, budget // max(layer_bytes, 1)))
        if gpu < num_layers:  # streaming needs a ring (and an NF4 dense buffer)
            ring = ring_slots * layer_bytes + (dense_layer_bytes if quant == "nf4" else 0)
            gpu = max(0, min(num_layers, (budget - ring) // max(layer_bytes, 1)))
    rest = num_layers - gpu
    ram = min(rest, fit)
    return Placement(num_layers, gpu, ram, rest - ram, layer_bytes, quant, device)
