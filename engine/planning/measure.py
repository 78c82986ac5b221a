"""Measuring this machine into a HardwareProfile (`specchat bench hardware`, the wizard).

Measured: OS, CPU model and cores, RAM total/available and multi-threaded copy bandwidth, read
speed of the models folder's disk (a fresh file, dropped from the page cache where the OS allows);
per GPU (torch + NVML): name, VRAM total/free, PCIe generation and width (idle, during a copy,
and maximum), pinned and pageable host-to-device bandwidth, device memory bandwidth, fp16/bf16
matmul rate, whether a copy overlaps a matmul; the timing curve of one real decoder layer
(transformers' own LlamaDecoderLayer) of a given shape over tree sizes of 1..2048 tokens, on
the device that would run it (the GPU if there is one, else the CPU at fp32); and the packed
CPU kernel on MoE experts (ExpertTiming: where an MoE's experts run on the CPU, with or
without a GPU).

On CPU a 70B-shaped layer is 3.4 GB at fp32 and slow, so only a few token counts are measured
(1, 4, 16, 64, 128) and the rest is extrapolated with the slope of the last two measured points
(compute-bound growth). `quick=True` uses small buffers (tests, and a first impression in
seconds); the CLI and the wizard measure in full.

What this module does not do: decide anything (the planner does), or load models.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)

from engine import paths
from engine.errors import Cancelled
from engine.model.cache import KVCache, steady_attention
from engine.planning.lean_timing import lean_layer_overhead
from engine.planning.profile import (
    GPU_TOKENS,
    LAYER_SHAPES,
    PROFILE_VERSION,
    ExpertTiming,
    GpuProfile,
    HardwareProfile,
    LayerTiming,
    profile_warnings,
)
from engine.shapes import LayerShape
from engine.units import GB

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]
CPU_TOKENS = (1, 4, 16, 64, 128)
WARM_LINK_S = 0.3  # copies before the host-to-device probe (a cold PCIe link runs at a lower generation)


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
    step = _Steps(progress, cancel, total=11.0)
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
    tokens: tuple[int, ...] = GPU_TOKENS if cuda else CPU_TOKENS
    if quick:
        tokens = tuple(n for n in tokens if n <= 64)
    step(0.5, f"building one {shape.name} decoder layer")
    timing = _layer_timing(shape, "cuda:0" if cuda else "cpu", tokens,
                           lambda frac, msg: step(5.5 / len(tokens), msg))
    step(1.0, "timing MoE experts on the CPU")
    experts = expert_timing(16 if quick else 64)
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
        cpu_experts=experts,
    )
    profile = replace(profile, warnings=tuple(profile_warnings(profile)))
    if progress is not None:
        progress(1.0, "done")
    return profile


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _keep_busy(fn: Callable[[], None], seconds: float) -> None:
    """Run `fn` again and again for at least `seconds` (at least once)."""
    end = time.perf_counter() + seconds
    fn()
    while time.perf_counter() < end:
        fn()


EXPERT_HIDDEN, EXPERT_WIDTH, EXPERT_TOP_K = 2048, 768, 8  # Qwen3-30B-A3B's experts


def expert_timing(experts: int = 64, tokens: int = 4, repeats: int = 3) -> ExpertTiming | None:
    """Time the packed CPU kernel on `experts` random Q4_K experts (more bytes than a CPU's
    caches hold at 64: each call reads from RAM, as a model's experts are): one token through
    EXPERT_TOP_K of them, the next call the next EXPERT_TOP_K, and `tokens` tokens through the
    same EXPERT_TOP_K (4: a tree's expert gets a few of its tokens, and up to 4 take the integer
    rows a decode step takes; 8 timed the fp32 tiles, 1.78e-11 s a weight against 1.43e-11 here). None when the kernel cannot be built here (the experts then run
    de-quantised, which the planner prices as dense layers)."""
    from engine.kernels import linear  # noqa: PLC0415 - builds the C kernel on first use
    from engine.kernels.build import kernels  # noqa: PLC0415

    if kernels() is None:
        return None
    gen = torch.Generator().manual_seed(0)

    def q4_k(rows: int, cols: int) -> linear.QuantWeight:  # random Q4_K values, held as the kernel holds Q4_K
        groups = cols // 32
        return linear.from_factors(torch.randint(0, 16, (rows, cols), generator=gen),
                                   torch.full((rows, groups // 8), 1e-3), torch.randint(0, 64, (rows, groups), generator=gen),
                                   torch.full((rows, groups // 8), -1e-3), torch.randint(0, 64, (rows, groups), generator=gen),
                                   32, 4)

    bank = [(q4_k(2 * EXPERT_WIDTH, EXPERT_HIDDEN), q4_k(EXPERT_HIDDEN, EXPERT_WIDTH)) for _ in range(experts)]
    groups = [bank[i:i + EXPERT_TOP_K] for i in range(0, experts - EXPERT_TOP_K + 1, EXPERT_TOP_K)]

    def run(x: torch.Tensor, group: list[tuple[linear.QuantWeight, linear.QuantWeight]]) -> None:
        for gate_up, down in group:
            g, u = linear.qlinear(x, gate_up).chunk(2, dim=-1)
            linear.qlinear(torch.nn.functional.silu(g) * u, down)

    one, many = torch.randn(1, EXPERT_HIDDEN, generator=gen), torch.randn(tokens, EXPERT_HIDDEN, generator=gen)
    t_one = min(_best_of(lambda g=g: run(one, g), 1) for g in groups * repeats)  # type: ignore[misc]
    t_many = min(_best_of(lambda g=g: run(many, g), 1) for g in groups * repeats)  # type: ignore[misc]
    params = 3 * EXPERT_HIDDEN * EXPERT_WIDTH
    nbytes = bank[0][0].nbytes + bank[0][1].nbytes
    extra_rows = EXPERT_TOP_K * (tokens - 1)
    return ExpertTiming(params, nbytes, EXPERT_TOP_K * nbytes / t_one / GB,
                        max(t_many - t_one, 0.0) / (extra_rows * params), torch.get_num_threads())


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
            # posix_fadvise: not on macOS or Windows (said by platform, which type checkers follow)
            if sys.platform != "darwin" and sys.platform != "win32" and hasattr(os, "posix_fadvise"):
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
    if device.startswith("cuda"):
        note(0.0, "timing the lean step (CUDA graphs)")
    lean = lean_layer_overhead(device, dtype)
    elem = torch.finfo(dtype).bits // 8
    return LayerTiming(shape, device, str(dtype).removeprefix("torch."), shape.params * elem, tuple(points), overhead,
                       lean)


@torch.inference_mode()
def _time_layer(shape: LayerShape, device: str, dtype: torch.dtype, tokens: tuple[int, ...], context: int,
                note: Progress | None = None) -> list[tuple[int, float]]:
    """Best-of time of transformers' LlamaDecoderLayer for each token count, `context` tokens
    already in its cache (random weights: the arithmetic is what is timed)."""
    config = LlamaConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, num_hidden_layers=1, vocab_size=16, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    if device != "cpu":
        steady_attention()  # as load_model does: the layer is timed with the kernels the engine runs
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

    # warm the link first: an idle PCIe link sits at a low generation and takes a moment under
    # load to come up (an H100 read 31 GB/s pinned on a cold link, 54 GB/s warm, in two runs)
    _keep_busy(copy(host_pinned), WARM_LINK_S)
    pinned = nbytes / _best_of(copy(host_pinned), 5) / GB
    pageable = nbytes / _best_of(copy(host_pageable), 2) / GB
    gpu_dst = torch.empty_like(gpu_buf)
    def copy_on_device() -> None:
        gpu_dst.copy_(gpu_buf)
        sync()

    dev_bw = 2 * nbytes / _best_of(copy_on_device, 3) / GB  # read + write
    link = _pcie_link(index, lambda: [gpu_buf.copy_(host_pinned, non_blocking=True) for _ in range(8)])
    sync()
    size = 2048 if quick else 8192
    rates = {dt: _matmul_tflops(dev, dt, size) for dt in (torch.float16, torch.bfloat16)}
    # overlap: a copy on a side stream while the default stream multiplies
    side = torch.cuda.Stream(dev)
    a = torch.randn(size, size, device=dev, dtype=torch.float16)
    t_copy = _best_of(copy(host_pinned), 2)
    def multiply() -> None:
        products = [torch.matmul(a, a) for _ in range(5)]  # all five held until the sync
        sync()
        del products

    t_mm = _best_of(multiply, 2)

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
