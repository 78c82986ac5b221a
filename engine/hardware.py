"""The hardware profile: what this machine can do, measured once, saved as versioned JSON in the
user data dir, and read by the planner (engine/planner.py) and the app's wizard and models page.

Measured: OS, CPU model and cores, RAM total/available and multi-threaded copy bandwidth, read
speed of the models folder's disk (a fresh file, dropped from the page cache where the OS allows);
per GPU (torch + NVML): name, VRAM total/free, PCIe generation and width (idle, during a copy,
and maximum), pinned and pageable host-to-device bandwidth, device memory bandwidth, fp16/bf16
matmul rate, whether a copy overlaps a matmul; and the timing curve of one real decoder layer
(transformers' own LlamaDecoderLayer) of a given shape over tree sizes of 1..2048 tokens, on
the device that would run it (the GPU if there is one, else the CPU at fp32).

On CPU a 70B-shaped layer is 3.4 GB at fp32 and slow, so only a few token counts are measured
(1, 4, 16, 64, 128) and the rest is extrapolated with the slope of the last two measured points
(compute-bound growth); `LayerTiming.points` holds only measured points. `quick=True` uses small
buffers (tests, and a first impression in seconds); the CLI and the wizard measure in full.

What this module does not do: decide anything (the planner does), or load models.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import torch

from . import paths
from .errors import Cancelled

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
GB = 1e9
Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class LayerShape:
    """Shape of one llama-family decoder layer (the values of a model's config.json)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_attention_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        return attn + 3 * h * self.intermediate_size + 2 * h  # gate/up/down + two norms

    def flops(self, tokens: int) -> float:
        return 2.0 * self.params * tokens


# From the models' published config.json files.
LAYER_SHAPES = {
    "llama-70b": LayerShape("llama-70b", 8192, 28672, 64, 8, 128),  # Llama-2/3.x 70B
    "qwen2.5-72b": LayerShape("qwen2.5-72b", 8192, 29568, 64, 8, 128),
    "llama-8b": LayerShape("llama-8b", 4096, 14336, 32, 8, 128),
    "tiny": LayerShape("tiny", 64, 172, 4, 2, 16),  # tests
}
GPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
CPU_TOKENS = (1, 4, 16, 64, 128)


@dataclass(frozen=True)
class LayerTiming:
    """Seconds for one decoder layer over n new tokens (256 tokens of context in the cache).

    points: measured (tokens, seconds), ascending; beyond the last one `seconds()` grows
    linearly with the slope of the last two (compute-bound), below the first it is flat.
    overhead_s: one tiny layer at 1 token on the same device: the per-layer cost that does not
    scale with the weights (kernel launches, Python), used to rescale to other shapes."""

    shape: LayerShape
    device: str
    dtype: str
    layer_bytes: int
    points: tuple[tuple[int, float], ...]
    overhead_s: float

    def seconds(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(pts):
            if tokens <= n1:
                return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
        if len(pts) == 1:
            return pts[0][1]
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + max(t1 - t0, 0.0) / (n1 - n0) * (tokens - n1)

    def scaled_seconds(self, shape_params: int, tokens: int) -> float:
        """The same device's time for a layer of `shape_params` parameters (same dtype): the
        weight-proportional part scales with the parameter count, the overhead does not."""
        base = self.seconds(tokens)
        return self.overhead_s + max(base - self.overhead_s, 0.0) * shape_params / self.shape.params

    @property
    def memory_bandwidth(self) -> float:
        """Bytes/s the layer streams from memory at 1 token (the memory-bound end)."""
        return self.layer_bytes / max(self.points[0][1] - self.overhead_s, 1e-9)


@dataclass(frozen=True)
class GpuProfile:
    index: int
    name: str
    vram_total: int
    vram_free: int
    pcie_gen_current: int | None
    pcie_width_current: int | None
    pcie_gen_loaded: int | None  # read while a host-to-device copy runs (links idle down)
    pcie_width_loaded: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    pinned_h2d_gbps: float
    pageable_h2d_gbps: float
    device_memory_gbps: float
    fp16_tflops: float
    bf16_tflops: float
    copy_overlaps_compute: bool


@dataclass(frozen=True)
class HardwareProfile:
    """One machine, measured. Sizes in bytes, bandwidths in GB/s (10**9 bytes)."""

    version: int
    created: str
    os: str
    cpu_model: str
    cpu_cores: int
    cpu_threads: int
    torch_threads: int
    ram_total: int
    ram_available: int
    ram_copy_gbps: float
    disk_path: str
    disk_read_gbps: float
    disk_read_uncached: bool  # False: the OS could not drop the test file from its cache
    gpus: tuple[GpuProfile, ...]
    layer_timing: LayerTiming
    measure_seconds: float
    warnings: tuple[str, ...] = ()
    quick: bool = False

    @property
    def gpu(self) -> GpuProfile | None:
        return self.gpus[0] if self.gpus else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> HardwareProfile:
        lt = dict(d["layer_timing"])
        lt["shape"] = LayerShape(**lt["shape"])
        lt["points"] = tuple((int(n), float(s)) for n, s in lt["points"])
        fields = dict(d)
        fields["layer_timing"] = LayerTiming(**lt)
        fields["gpus"] = tuple(GpuProfile(**g) for g in d.get("gpus", ()))
        fields["warnings"] = tuple(d.get("warnings", ()))
        return HardwareProfile(**fields)

    def summary_lines(self) -> list[str]:
        lt = self.layer_timing
        lines = [
            f"OS: {self.os}",
            (f"CPU: {self.cpu_model}, {self.cpu_cores} cores / {self.cpu_threads} threads "
             f"(torch uses {self.torch_threads})"),
            (f"RAM: {self.ram_total / GB:.1f} GB total, {self.ram_available / GB:.1f} GB available, "
             f"copy {self.ram_copy_gbps:.1f} GB/s"),
            f"Models disk ({self.disk_path}): read {self.disk_read_gbps:.2f} GB/s"
            + ("" if self.disk_read_uncached else " (may include the OS cache)"),
        ]
        for g in self.gpus:
            link = (f"PCIe Gen{g.pcie_gen_loaded or g.pcie_gen_current} x{g.pcie_width_loaded or g.pcie_width_current}"
                    f" (max Gen{g.pcie_gen_max} x{g.pcie_width_max})" if g.pcie_gen_max else "PCIe link unknown")
            lines.append(f"GPU {g.index}: {g.name}, {g.vram_total / GB:.1f} GB VRAM ({g.vram_free / GB:.1f} free), {link}")
            lines.append(f"  host->GPU {g.pinned_h2d_gbps:.1f} GB/s pinned, {g.pageable_h2d_gbps:.1f} GB/s pageable; "
                         f"VRAM {g.device_memory_gbps:.0f} GB/s; fp16 {g.fp16_tflops:.0f} / bf16 {g.bf16_tflops:.0f} "
                         f"TFLOP/s; copies {'overlap' if g.copy_overlaps_compute else 'do not overlap'} compute")
        if not self.gpus:
            lines.append("GPU: none (CUDA not available to PyTorch)")
        measured = ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in lt.points)
        lines.append(f"One {lt.shape.name} layer ({lt.layer_bytes / GB:.2f} GB {lt.dtype}) on {lt.device}, "
                     f"tokens: {measured}; per-layer overhead {lt.overhead_s * 1e3:.2f} ms")
        lines += [f"warning: {w}" for w in self.warnings]
        return lines


# ---- saving -----------------------------------------------------------------------------------
def profile_path() -> Path:
    return paths.data_dir() / "hardware_profile.json"


def save_profile(profile: HardwareProfile, path: Path | None = None) -> Path:
    target = path or profile_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1), encoding="utf-8")
    os.replace(tmp, target)  # a reader never sees half a file
    return target


def load_profile(path: Path | None = None) -> HardwareProfile | None:
    """The saved profile, or None when there is none, it is unreadable or from another version
    (the caller measures again)."""
    source = path or profile_path()
    try:
        raw = json.loads(source.read_text(encoding="utf-8"))
        if raw.get("version") != PROFILE_VERSION:
            return None
        return HardwareProfile.from_json(raw)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.info("no usable hardware profile at %s (%s)", source, exc)
        return None


# ---- measuring ----------------------------------------------------------------------------------
class _Steps:
    def __init__(self, progress: Progress | None, cancel: threading.Event | None, total: float) -> None:
        self.progress, self.cancel, self.total, self.done = progress, cancel, total, 0.0

    def __call__(self, weight: float, message: str) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("The hardware measurement was cancelled; nothing was saved.")
        if self.progress is not None:
            self.progress(min(self.done / self.total, 1.0), message)
        self.done += weight


def measure_hardware(progress: Progress | None = None, cancel: threading.Event | None = None,
                     layer_shape: str = "llama-70b", quick: bool = False,
                     models_dir: Path | None = None) -> HardwareProfile:
    """Measure this machine (about a minute; `quick` takes seconds with small buffers and a
    tiny layer). Raises Cancelled when `cancel` is set (checked between steps)."""
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    step = _Steps(progress, cancel, total=10.0)
    step(0.5, "reading system information")
    vm = psutil.virtual_memory()
    step(0.5, "measuring RAM copy bandwidth")
    ram_gbps = _ram_copy_gbps(64 << 20 if quick else 512 << 20)
    step(1.0, "measuring the models folder's disk")
    folder = models_dir or paths.models_dir()
    disk_gbps, uncached, disk_where = _disk_read_gbps(folder, 8 << 20 if quick else 256 << 20)
    gpus: list[GpuProfile] = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            step(2.0 / torch.cuda.device_count(), f"measuring GPU {i}")
            gpus.append(_measure_gpu(i, quick))
    else:
        step(2.0, "no CUDA GPU")
    shape = LAYER_SHAPES["tiny" if quick else layer_shape]
    if cuda and not quick and torch.cuda.mem_get_info(0)[0] < 3 * shape.params * 2:
        shape = LAYER_SHAPES["llama-8b"]  # a small GPU: time a smaller layer, the planner rescales it
    tokens = GPU_TOKENS if cuda else CPU_TOKENS
    if quick:
        tokens = tuple(n for n in tokens if n <= 64)
    step(0.5, f"building one {shape.name} decoder layer")
    timing = _layer_timing(shape, "cuda:0" if cuda else "cpu", tokens,
                           lambda frac, msg: step(5.5 / len(tokens), msg))
    profile = HardwareProfile(
        version=PROFILE_VERSION,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        os=f"{platform.system()} {platform.release()}",
        cpu_model=_cpu_model(),
        cpu_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        cpu_threads=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        ram_total=int(vm.total),
        ram_available=int(vm.available),
        ram_copy_gbps=ram_gbps,
        disk_path=str(disk_where),
        disk_read_gbps=disk_gbps,
        disk_read_uncached=uncached,
        gpus=tuple(gpus),
        layer_timing=timing,
        measure_seconds=time.perf_counter() - t_start,
        quick=quick,
    )
    profile = replace(profile, warnings=tuple(profile_warnings(profile)))
    if progress is not None:
        progress(1.0, "done")
    return profile


def profile_warnings(profile: HardwareProfile, need_ram_bytes: int | None = None) -> list[str]:
    """Problems a user can act on. `need_ram_bytes`: the chosen model's host-memory need."""
    out: list[str] = []
    for g in profile.gpus:
        gen = g.pcie_gen_loaded or g.pcie_gen_current
        width = g.pcie_width_loaded or g.pcie_width_current
        if width is not None and width < 16:
            out.append(f"GPU {g.index} ({g.name}) runs on a PCIe x{width} link"
                       f"{f' (it supports x{g.pcie_width_max})' if g.pcie_width_max and g.pcie_width_max > width else ''}: "
                       "streaming weights will be slower. Move it to the first x16 slot (see the motherboard manual).")
        if gen is not None and gen < 4:
            out.append(f"GPU {g.index} ({g.name}) links at PCIe Gen{gen}"
                       f"{f' (it supports Gen{g.pcie_gen_max})' if g.pcie_gen_max and g.pcie_gen_max > gen else ''}: "
                       "about half the bandwidth of Gen4. Check the slot and the PCIe setting in the BIOS.")
        if g.pinned_h2d_gbps < 10.0:
            out.append(f"GPU {g.index} ({g.name}) receives only {g.pinned_h2d_gbps:.1f} GB/s from RAM (PCIe 4 x16 "
                       "gives ~25): it sits on a slow link (chipset slot, riser or Thunderbolt). Offloaded models "
                       "will be slow; prefer 4-bit models that fit more layers on the GPU.")
    if not profile.gpus:
        out.append("No CUDA GPU was found: 70B models would run on the CPU at well under 1 token/s. "
                   "Use a small model pair, or install the NVIDIA driver and a CUDA build of PyTorch.")
    if need_ram_bytes is not None and need_ram_bytes > profile.ram_total:
        out.append(f"The chosen model needs about {need_ram_bytes / GB:.0f} GB of RAM but this machine has "
                   f"{profile.ram_total / GB:.0f} GB: the rest would be read from disk every pass (very slow). "
                   "Pick a 4-bit version or a smaller model, or add RAM.")
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _best_of(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _ram_copy_gbps(nbytes: int) -> float:
    """Bytes copied per second by torch's multi-threaded copy of a large host buffer."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / _best_of(lambda: dst.copy_(src), 3) / GB


def _disk_read_gbps(folder: Path, nbytes: int) -> tuple[float, bool, Path]:
    """Sequential read speed of a fresh file in (the nearest existing parent of) `folder`."""
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    chunk = 8 << 20
    block = os.urandom(min(chunk, nbytes))
    fd, name = tempfile.mkstemp(prefix=".specchat-disk-test-", dir=where)
    uncached = False
    try:
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(nbytes // len(block), 1)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        size = os.path.getsize(name)
        with open(name, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # drop it from the page cache
                uncached = True
            t0 = time.perf_counter()
            while f.read(chunk):
                pass
            seconds = time.perf_counter() - t0
    finally:
        os.unlink(name)
    return size / max(seconds, 1e-9) / GB, uncached, where


def _layer_timing(shape: LayerShape, device: str, tokens: tuple[int, ...], note: Progress,
                  context: int = 256) -> LayerTiming:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    overhead = _time_layer(LAYER_SHAPES["tiny"], device, dtype, (1,), context)[0][1]
    points = _time_layer(shape, device, dtype, tokens, context, note)
    elem = torch.finfo(dtype).bits // 8
    return LayerTiming(shape, device, str(dtype).removeprefix("torch."), shape.params * elem, tuple(points), overhead)


@torch.inference_mode()
def _time_layer(shape: LayerShape, device: str, dtype: torch.dtype, tokens: tuple[int, ...], context: int,
                note: Progress | None = None) -> list[tuple[int, float]]:
    """Best-of time of transformers' LlamaDecoderLayer for each token count, `context` tokens
    already in its cache (random weights: the arithmetic is what is timed)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    from .cache import KVCache

    config = LlamaConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, num_hidden_layers=1, vocab_size=16, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
    layer = layer.to_empty(device=device).eval()  # allocated once, in its final dtype
    for p in layer.parameters():
        p.uniform_(-0.02, 0.02)  # no uninitialised memory: denormals or NaNs would skew the timing
    rotary = LlamaRotaryEmbedding(config).to(device)
    cache = KVCache(1, shape.num_kv_heads, shape.head_dim, dtype, device, context + max(tokens))
    cache.reserve(context)
    for buf in cache.keys + cache.values:
        buf.zero_()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: list[tuple[int, float]] = []
    for n in tokens:
        if note is not None:
            note(0.0, f"timing one {shape.name} layer at {n} tokens")
        hidden = torch.randn(1, n, shape.hidden_size, dtype=dtype, device=device) * 0.1
        pos = torch.arange(context, context + n, device=device)[None]
        rope = rotary(hidden, position_ids=pos)
        mask = torch.zeros(1, 1, n, context + n, dtype=dtype, device=device)

        run = functools.partial(_call_layer, layer, cache, context, hidden, mask, pos, rope, sync)
        run()  # warm-up (allocations, kernel selection)
        repeats = 10 if shape.params * n < 1e8 else 3 if shape.params * n < 4e10 else 2
        out.append((n, _best_of(run, repeats)))
    return out


def _call_layer(layer: torch.nn.Module, cache: Any, context: int, hidden: torch.Tensor, mask: torch.Tensor,
                pos: torch.Tensor, rope: Any, sync: Callable[[], None]) -> None:
    cache.length = context  # every call writes the same slots
    layer(hidden, attention_mask=mask, position_ids=pos, past_key_values=cache, position_embeddings=rope)
    sync()


def _matmul_tflops(dev: torch.device, dtype: torch.dtype, size: int, reps: int = 5) -> float:
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    torch.matmul(a, b)
    torch.cuda.synchronize(dev)

    def run() -> None:
        for _ in range(reps):
            torch.matmul(a, b)
        torch.cuda.synchronize(dev)

    return 2 * size**3 * reps / _best_of(run, 2) / 1e12


def _measure_gpu(index: int, quick: bool) -> GpuProfile:
    """Bandwidths, matmul rates and the PCIe link of one CUDA device (needs a GPU; not run in
    the CPU-only test suite)."""
    dev = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(dev)
    free, total = torch.cuda.mem_get_info(dev)
    nbytes = (64 << 20) if quick else (512 << 20)
    host_pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_pageable = torch.empty(nbytes, dtype=torch.uint8)
    gpu_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def sync() -> None:
        torch.cuda.synchronize(dev)

    def copy(src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            gpu_buf.copy_(src, non_blocking=True)
            sync()
        return run

    copy(host_pinned)()
    pinned = nbytes / _best_of(copy(host_pinned), 3) / GB
    pageable = nbytes / _best_of(copy(host_pageable), 2) / GB
    gpu_dst = torch.empty_like(gpu_buf)
    dev_bw = 2 * nbytes / _best_of(lambda: (gpu_dst.copy_(gpu_buf), sync()), 3) / GB  # read + write
    link = _pcie_link(index, lambda: [gpu_buf.copy_(host_pinned, non_blocking=True) for _ in range(8)])
    sync()
    size = 2048 if quick else 8192
    rates = {dt: _matmul_tflops(dev, dt, size) for dt in (torch.float16, torch.bfloat16)}
    # overlap: a copy on a side stream while the default stream multiplies
    side = torch.cuda.Stream(dev)
    a = torch.randn(size, size, device=dev, dtype=torch.float16)
    t_copy = _best_of(copy(host_pinned), 2)
    t_mm = _best_of(lambda: ([torch.matmul(a, a) for _ in range(5)], sync()), 2)

    def both() -> None:
        with torch.cuda.stream(side):
            gpu_buf.copy_(host_pinned, non_blocking=True)
        for _ in range(5):
            torch.matmul(a, a)
        sync()

    t_both = _best_of(both, 2)
    overlaps = t_both < 0.8 * (t_copy + t_mm)
    return GpuProfile(index=index, name=props.name, vram_total=int(total), vram_free=int(free),
                      pcie_gen_current=link[0], pcie_width_current=link[1], pcie_gen_loaded=link[2],
                      pcie_width_loaded=link[3], pcie_gen_max=link[4], pcie_width_max=link[5],
                      pinned_h2d_gbps=pinned, pageable_h2d_gbps=pageable, device_memory_gbps=dev_bw,
                      fp16_tflops=rates[torch.float16], bf16_tflops=rates[torch.bfloat16],
                      copy_overlaps_compute=overlaps)


def _pcie_link(index: int, load: Callable[[], object]) -> tuple[int | None, ...]:
    """(gen, width) idle, (gen, width) during `load`, (gen, width) max; None where NVML cannot
    tell (not installed, not an NVIDIA driver)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return (None,) * 6
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            idle = (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
            load()  # queued asynchronously: the link is busy while NVML reads it
            busy = (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
            top = (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
            return (*idle, *busy, *top)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        log.info("NVML could not read the PCIe link: %s", exc)
        return (None,) * 6


# ---- reference machines (for `specchat bench plan` and the cost model's published-number tests) --
@dataclass(frozen=True)
class ReferenceGpu:
    """Datasheet figures of a GPU: VRAM, memory bandwidth, dense fp16 tensor rate (fp32 accumulate)."""

    name: str
    vram_gb: float
    memory_gbps: float
    fp16_tflops: float
    pcie_gen: int


REFERENCE_GPUS = {
    "rtx4090": ReferenceGpu("NVIDIA GeForce RTX 4090", 24, 1008, 165, 4),
    "rtx3090": ReferenceGpu("NVIDIA GeForce RTX 3090", 24, 936, 71, 4),
    "rtx4060ti-16gb": ReferenceGpu("NVIDIA GeForce RTX 4060 Ti 16GB", 16, 288, 44, 4),
    "l40": ReferenceGpu("NVIDIA L40", 48, 864, 181, 4),
    "a100-80gb": ReferenceGpu("NVIDIA A100 80GB PCIe", 80, 1935, 312, 4),
}
MEMORY_EFFICIENCY = 0.8  # share of datasheet bandwidth a 16-bit GEMV reaches
COMPUTE_EFFICIENCY = 0.6  # share of datasheet tensor rate a decoder layer's GEMMs reach
GPU_LAYER_OVERHEAD_S = 1.5e-4  # ~15 kernel launches per decoder layer


def reference_profile(gpu: str = "rtx4090", pinned_gbps: float = 25.0, ram_gb: float = 128.0,
                      disk_gbps: float = 3.0, layer_shape: str = "llama-70b") -> HardwareProfile:
    """A profile built from datasheet figures instead of measurements: the layer curve is a
    roofline, overhead + max(bytes / (0.8 x memory bandwidth), flops / (0.6 x tensor rate)).
    `pinned_gbps` is the host-to-device rate (PCIe 4 x16 pinned copies reach ~25 GB/s)."""
    ref = REFERENCE_GPUS[gpu]
    shape = LAYER_SHAPES[layer_shape]
    nbytes = shape.params * 2
    points = tuple((n, GPU_LAYER_OVERHEAD_S + max(nbytes / (ref.memory_gbps * GB * MEMORY_EFFICIENCY),
                                                  shape.flops(n) / (ref.fp16_tflops * 1e12 * COMPUTE_EFFICIENCY)))
                   for n in GPU_TOKENS)
    timing = LayerTiming(shape, "cuda:0", "bfloat16", nbytes, points, GPU_LAYER_OVERHEAD_S)
    card = GpuProfile(0, ref.name, int(ref.vram_gb * GB), int((ref.vram_gb - 0.5) * GB), ref.pcie_gen, 16,
                      ref.pcie_gen, 16, ref.pcie_gen, 16, pinned_gbps, pinned_gbps * 0.5, ref.memory_gbps * MEMORY_EFFICIENCY,
                      ref.fp16_tflops, ref.fp16_tflops, True)
    return HardwareProfile(
        version=PROFILE_VERSION, created="reference", os="-", cpu_model="reference", cpu_cores=16, cpu_threads=32,
        torch_threads=16, ram_total=int(ram_gb * GB), ram_available=int((ram_gb - 4) * GB), ram_copy_gbps=20.0,
        disk_path="-", disk_read_gbps=disk_gbps, disk_read_uncached=True, gpus=(card,), layer_timing=timing,
        measure_seconds=0.0, warnings=(), quick=False)
