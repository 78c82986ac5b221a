"""The hardware profile: what this machine can do, measured once (measure.py) or taken from
datasheets (reference.py), saved as versioned JSON in the user data dir, and read by the
planner and the app's wizard and models page.

It holds: OS, CPU model and cores, RAM total/available and copy bandwidth, read speed of the
models folder's disk; per GPU: name, VRAM, PCIe link, host-to-device and device bandwidths,
matmul rates, whether copies overlap compute; and the timing curve of one real decoder layer
of a given shape over tree sizes (`LayerTiming`: measured points only, extrapolated linearly
past the last one).

What this module does not do: measure (measure.py), decide anything (planner.py), load models.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine import paths
from engine.errors import InvalidRequest, MalformedInput
from engine.shapes import LayerShape
from engine.units import GB
from engine.untrusted import MIB, read_json_file

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
PROFILE_MAX_BYTES = 4 * MIB  # a profile is a few KB
GPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # tree sizes a GPU curve covers

# From the models' published config.json files.
LAYER_SHAPES = {
    "llama-70b": LayerShape("llama-70b", 8192, 28672, 64, 8, 128),  # Llama-2/3.x 70B
    "qwen2.5-72b": LayerShape("qwen2.5-72b", 8192, 29568, 64, 8, 128),
    "llama-8b": LayerShape("llama-8b", 4096, 14336, 32, 8, 128),
    "tiny": LayerShape("tiny", 64, 172, 4, 2, 16),  # tests
}


@dataclass(frozen=True)
class LayerTiming:
    """Seconds for one decoder layer over n new tokens (256 tokens of context in the cache).

    points: measured (tokens, seconds), ascending; beyond the last one `seconds()` grows
    linearly with the slope of the last two (compute-bound), below the first it is flat.
    overhead_s: one tiny layer at 1 token on the same device: the per-layer cost that does not
    scale with the weights (kernel launches, Python), used to rescale to other shapes.
    lean_overhead_s: that cost in a step through the lean step (CUDA graphs), measured on a GPU
    (engine.planning.lean_timing); None: not measured (a CPU, a profile from before it)."""

    shape: LayerShape
    device: str
    dtype: str
    layer_bytes: int
    points: tuple[tuple[int, float], ...]
    overhead_s: float
    lean_overhead_s: float | None = None

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
class ExpertTiming:
    """The packed CPU kernel running routed experts (measure.py times Qwen3-30B-A3B's: gate and
    up 2 x 768 x 2048 and down 2048 x 768, Q4_K values as the kernel holds them), the
    way a pass with its experts on the CPU runs them (engine.kernels.experts).

    read_gbps: packed bytes per second while one token runs its top-k experts (each read once
    from RAM, Python and the activation included): the memory-bound end. row_s_per_param:
    seconds per expert weight that each further token routed to an expert already being read
    adds (compute). A pass over N tokens waking u experts of a layer with k per token costs
    u x expert_bytes / read_gbps + (N k - u) x expert_params x row_s_per_param."""

    expert_params: int
    expert_bytes: int
    read_gbps: float
    row_s_per_param: float
    threads: int

    def seconds(self, union: float, rows: float, expert_params: int, expert_bytes: int) -> float:
        """Experts of one layer: `union` distinct experts of `expert_params` weights stored in
        `expert_bytes`, read once, over `rows` (token, expert) pairs in all."""
        return (union * expert_bytes / (self.read_gbps * GB)
                + max(rows - union, 0.0) * expert_params * self.row_s_per_param)


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
    cpu_experts: ExpertTiming | None = None  # None: measured before SpecChat timed experts

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
        if d.get("cpu_experts") is not None:
            fields["cpu_experts"] = ExpertTiming(**d["cpu_experts"])
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
                     f"tokens: {measured}; per-layer overhead {lt.overhead_s * 1e3:.2f} ms"
                     + (f" ({lt.lean_overhead_s * 1e3:.3f} ms in the lean step)" if lt.lean_overhead_s is not None else ""))
        if self.cpu_experts is not None:
            ex = self.cpu_experts
            lines.append(f"MoE experts on the CPU (packed 4-bit, {ex.threads} threads): read {ex.read_gbps:.1f} GB/s, "
                         f"{ex.row_s_per_param * ex.expert_params * 1e6:.0f} us per further token an expert runs")
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
    """The saved profile, or None when there is none or it is from another version (the caller
    measures again). A damaged one (not the JSON of a profile, or values no measurement gives:
    zero or negative timings and bandwidths) is ignored with one warning; the default file is
    also set aside (renamed, kept), so the warning comes once and a new measurement replaces it."""
    source = path or profile_path()
    try:
        raw = read_json_file(source, what="the hardware profile", max_bytes=PROFILE_MAX_BYTES)
        if isinstance(raw, dict) and raw.get("version") != PROFILE_VERSION:
            log.info("the hardware profile %s is from another version; not used", source)
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
        profile = HardwareProfile.from_json(raw)
        check_profile(profile)
        return profile
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the hardware profile %s (%s); planning without it", source, exc.strerror)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, MalformedInput) as exc:
        kept = set_aside(source) if path is None else None
        why = exc.user_message if isinstance(exc, MalformedInput) else str(exc)[:120] or type(exc).__name__
        log.warning("ignoring the damaged hardware profile %s (%s)%s; `specchat bench hardware` measures a new one",
                    source, why, f", kept as {kept.name}" if kept else "")
    return None


def read_profile(path: Path) -> HardwareProfile:
    """A profile file a user names (`--profile FILE`): the profile, or InvalidRequest saying
    what is wrong with that file (missing, not a regular file, not a profile, another
    version, values no measurement gives). Unlike load_profile nothing is set aside."""
    try:
        raw = read_json_file(path, what="the hardware profile", max_bytes=PROFILE_MAX_BYTES)
    except FileNotFoundError:
        raise InvalidRequest(f"No hardware profile at '{path}': `specchat bench hardware --output FILE` "
                             "measures one.") from None
    except OSError as exc:
        raise InvalidRequest(f"Cannot read the hardware profile '{path}' ({exc.strerror}).") from None
    except MalformedInput as exc:
        raise InvalidRequest(exc.user_message) from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"'{path}' is not a hardware profile (a JSON {type(raw).__name__}, not an object).")
    if raw.get("version") != PROFILE_VERSION:
        raise InvalidRequest(f"'{path}' is a hardware profile of another SpecChat version; "
                             "`specchat bench hardware` measures a new one.")
    try:
        profile = HardwareProfile.from_json(raw)
        check_profile(profile)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise InvalidRequest(f"'{path}' is not a valid hardware profile ({str(exc)[:120] or type(exc).__name__}).") \
            from None
    return profile


def check_profile(profile: HardwareProfile) -> None:
    """ValueError naming the first value no measurement can give: a timing, size or bandwidth
    that is zero, negative, infinite or NaN, or a layer curve that is empty or not ascending."""
    lt = profile.layer_timing
    positive: dict[str, float] = {
        "ram_total": profile.ram_total, "ram_copy_gbps": profile.ram_copy_gbps,
        "disk_read_gbps": profile.disk_read_gbps, "layer_bytes": lt.layer_bytes,
        **{f"layer shape {k}": getattr(lt.shape, k) for k in
           ("hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim")},
    }
    non_negative: dict[str, float] = {"ram_available": profile.ram_available, "overhead_s": lt.overhead_s}
    if lt.lean_overhead_s is not None:
        non_negative["lean_overhead_s"] = lt.lean_overhead_s
    for g in profile.gpus:  # the planner divides by the first two
        positive.update({f"GPU {g.index} {k}": getattr(g, k) for k in ("pinned_h2d_gbps", "device_memory_gbps")})
        non_negative.update({f"GPU {g.index} {k}": getattr(g, k) for k in
                             ("vram_total", "vram_free", "pageable_h2d_gbps", "fp16_tflops", "bf16_tflops")})
    positive.update({f"layer time at {n} tokens": t for n, t in lt.points})
    if profile.cpu_experts is not None:
        positive.update({f"cpu_experts {k}": getattr(profile.cpu_experts, k)
                         for k in ("expert_params", "expert_bytes", "read_gbps", "threads")})
        non_negative["cpu_experts row_s_per_param"] = profile.cpu_experts.row_s_per_param
    for name, value in (*positive.items(), *non_negative.items()):
        low_ok = value > 0 if name in positive else value >= 0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low_ok and value < math.inf):
            raise ValueError(f"{name} is {value!r}")
    if not lt.points or any(n < 1 for n, _ in lt.points) or \
            any(n1 <= n0 for (n0, _), (n1, _) in itertools.pairwise(lt.points)):
        raise ValueError(f"the layer timing points {lt.points!r} are not ascending token counts")


def set_aside(path: Path) -> Path | None:
    """Rename a damaged state file to `<stem>.damaged-<time><suffix>` beside it (kept for a
    look, out of the way of the next write); None when it cannot be renamed."""
    kept = path.with_name(f"{path.stem}.damaged-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
    try:
        os.replace(path, kept)
    except OSError:
        return None
    return kept


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
