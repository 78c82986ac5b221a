"""Reference machines from datasheet figures, for `specchat bench plan --gpu` and the cost
model's tests against published numbers: a HardwareProfile whose layer curve is a roofline.

What this module does not do: measure anything (measure.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.profile import (
    GPU_TOKENS,
    LAYER_SHAPES,
    PROFILE_VERSION,
    ExpertTiming,
    GpuProfile,
    HardwareProfile,
    LayerTiming,
)
from engine.units import GB


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
    # a 12 GB card (the "Qwen3.6-27B on a 12 GB card"): GA106, 28 SMs x 4 tensor cores x
    # 256 FP16 flops per clock at 1.78 GHz = 51 TFLOP/s dense, as the 3090's 71 counts; 360 GB/s
    # 8 GB cards (the llama.cpp figure for an MoE on 8 GB): RTX 2080, TU104 at 448 GB/s,
    # 40 TFLOP/s fp16 with fp32 accumulate (GeForce Turing runs it at half the fp16-accumulate
    # 81), PCIe 3; RTX 4060, AD107 at 272 GB/s, 61 (half of 121), PCIe 4 x8
    "rtx2080-8gb": ReferenceGpu("NVIDIA GeForce RTX 2080", 8, 448, 40, 3),
    "rtx4060-8gb": ReferenceGpu("NVIDIA GeForce RTX 4060", 8, 272, 61, 4),
    "rtx3060-12gb": ReferenceGpu("NVIDIA GeForce RTX 3060 12GB", 12, 360, 51, 4),
    "l40": ReferenceGpu("NVIDIA L40", 48, 864, 181, 4),
    "a100-80gb": ReferenceGpu("NVIDIA A100 80GB PCIe", 80, 1935, 312, 4),
}
MEMORY_EFFICIENCY = 0.8  # share of datasheet bandwidth a 16-bit GEMV reaches
COMPUTE_EFFICIENCY = 0.6  # share of datasheet tensor rate a decoder layer's GEMMs reach
# what a decoder layer costs beyond its bytes and FLOPs in this engine's eager PyTorch: launches
# and Python, measured, not a datasheet figure (`specchat bench gpu`'s profile: one tiny layer at
# one token, 0.86 ms on an H200 host with a 16-core Xeon, PyTorch 2.11, 2026-11-28; the same
# session's experts-beside-the-GPU decode spent 0.7-1.0 ms a layer outside the CPU's experts).
# It was 0.15 ms ("~15 kernel launches") before that measurement.
GPU_LAYER_OVERHEAD_S = 8.6e-4


def reference_profile(gpu: str = "rtx4090", pinned_gbps: float = 25.0, ram_gb: float = 128.0,
                      disk_gbps: float = 3.0, layer_shape: str = "llama-70b",
                      cpu_experts: ExpertTiming | None = None,
                      layer_overhead_s: float = GPU_LAYER_OVERHEAD_S) -> HardwareProfile:
    """A profile built from datasheet figures instead of measurements: the layer curve is a
    roofline, overhead + max(bytes / (0.8 x memory bandwidth), flops / (0.6 x tensor rate)).
    `pinned_gbps` is the host-to-device rate (PCIe 4 x16 pinned copies reach ~25 GB/s);
    `cpu_experts` the CPU's packed-expert timing (default: the planner's prior from RAM speed);
    `layer_overhead_s` a layer's cost beyond its bytes and FLOPs (default: the general path's, measured)."""
    ref = REFERENCE_GPUS[gpu]
    shape = LAYER_SHAPES[layer_shape]
    nbytes = shape.params * 2
    points = tuple((n, layer_overhead_s + max(nbytes / (ref.memory_gbps * GB * MEMORY_EFFICIENCY),
                                                  shape.flops(n) / (ref.fp16_tflops * 1e12 * COMPUTE_EFFICIENCY)))
                   for n in GPU_TOKENS)
    timing = LayerTiming(shape, "cuda:0", "bfloat16", nbytes, points, layer_overhead_s)
    card = GpuProfile(0, ref.name, int(ref.vram_gb * GB), int((ref.vram_gb - 0.5) * GB), ref.pcie_gen, 16,
                      ref.pcie_gen, 16, ref.pcie_gen, 16, pinned_gbps, pinned_gbps * 0.5, ref.memory_gbps * MEMORY_EFFICIENCY,
                      ref.fp16_tflops, ref.fp16_tflops, True)
    return HardwareProfile(
        version=PROFILE_VERSION, created="reference", os="-", cpu_model="reference", cpu_cores=16, cpu_threads=32,
        torch_threads=16, ram_total=int(ram_gb * GB), ram_available=int((ram_gb - 4) * GB), ram_copy_gbps=20.0,
        disk_path="-", disk_read_gbps=disk_gbps, disk_read_uncached=True, gpus=(card,), layer_timing=timing,
        measure_seconds=0.0, warnings=(), quick=False, cpu_experts=cpu_experts)
