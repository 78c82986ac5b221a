"""Which PyTorch build to install, and why, from what the machine's NVIDIA driver reports.

PyTorch publishes one wheel per CUDA runtime on its own index (download.pytorch.org/whl/cuXYZ)
and a small CPU-only build (…/whl/cpu). A CUDA build runs when the driver supports at least
its CUDA version; the newest runtime also drops the oldest GPUs. The choice:

- an NVIDIA GPU and a working driver: the newest CUDA build the driver supports (and the GPU:
  CUDA 13 builds need compute capability 7.5 or newer, Turing and up);
- a driver too old for every build, or no NVIDIA GPU: the CPU build, with the reason;
- macOS: PyPI's build (it carries the Metal backend), never a CUDA build.

The choice is a pure function of `GpuReport` (tests feed it `nvidia-smi` outputs); `detect()`
is the only part that runs programs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

TORCH_VERSION = "2.13.0"  # the pin in pyproject.toml; tests check the two agree
TORCH_INDEX = "https://download.pytorch.org/whl/"


@dataclass(frozen=True)
class CudaBuild:
    tag: str  # the index folder and the wheel's local version label: cu128 -> torch 2.13.0+cu128
    cuda: tuple[int, int]
    min_compute: tuple[int, int]  # the oldest GPU generation the build still has kernels for


# The CUDA builds published for torch 2.13 (newest first). A driver reports the newest CUDA
# version it supports ("CUDA Version: 12.8" in nvidia-smi's header).
CUDA_BUILDS = (
    CudaBuild("cu130", (13, 0), (7, 5)),
    CudaBuild("cu128", (12, 8), (5, 0)),
    CudaBuild("cu126", (12, 6), (5, 0)),
)

# Without nvidia-smi's "CUDA Version" line: the first driver release of each CUDA version
# (NVIDIA's CUDA toolkit release notes, table 3; Linux numbers, Windows drivers are higher).
DRIVER_FOR_CUDA = (
    ((13, 0), (580, 65)),
    ((12, 9), (575, 51)),
    ((12, 8), (570, 26)),
    ((12, 6), (560, 28)),
    ((12, 4), (550, 54)),
    ((12, 2), (535, 54)),
    ((12, 0), (525, 60)),
    ((11, 8), (520, 61)),
)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_mib: int
    compute: tuple[int, int] | None


@dataclass(frozen=True)
class GpuReport:
    """What the NVIDIA driver says about this machine; `problem` when it could not be asked."""

    gpus: tuple[Gpu, ...] = ()
    driver: str = ""
    cuda: tuple[int, int] | None = None
    problem: str = ""


@dataclass(frozen=True)
class TorchChoice:
    variant: str  # "cpu", "default" (PyPI's own build) or a CudaBuild tag
    index_url: str | None  # None: the package index pip is configured with (PyPI)
    reason: str

    @property
    def requirement(self) -> str:
        return f"torch=={TORCH_VERSION}"

    @property
    def is_cuda(self) -> bool:
        return self.variant.startswith("cu")


def _version_tuple(text: str, parts: int = 2) -> tuple[int, ...] | None:
    numbers = re.findall(r"\d+", text)
    if len(numbers) < parts:
        return None
    return tuple(int(n) for n in numbers[:parts])


def parse_nvidia_smi(query_csv: str, header: str = "", driver_file: str = "") -> GpuReport:
    """Parse `nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version
    --format=csv,noheader,nounits`, the plain `nvidia-smi` banner (for "CUDA Version") and, on
    Linux, /proc/driver/nvidia/version when nvidia-smi itself is missing."""
    gpus: list[Gpu] = []
    driver = ""
    for line in query_csv.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0]:
            continue
        memory = int(fields[1]) if fields[1].isdigit() else 0
        compute = _version_tuple(fields[2])
        gpus.append(Gpu(fields[0], memory, compute if compute and len(compute) == 2 else None))  # type: ignore[arg-type]
        driver = driver or fields[3]
    if not driver and driver_file:
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", driver_file)
        driver = match.group(1) if match else ""
    cuda: tuple[int, int] | None = None
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header)
    if match:
        cuda = (int(match.group(1)), int(match.group(2)))
    elif driver:
        driver_version = _version_tuple(driver)
        for cuda_version, first_driver in DRIVER_FOR_CUDA:
            if driver_version and driver_version >= first_driver:
                cuda = cuda_version
                break
    return GpuReport(tuple(gpus), driver, cuda)


def _run(args: list[str], timeout: float = 20.0) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise OSError((done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"])
    return done.stdout


def find_nvidia_smi() -> str | None:
    found = shutil.which("nvidia-smi")
    if found:
        return found
    windows = Path(os.environ.get("SystemRoot", r"C:\Windows")) / "System32" / "nvidia-smi.exe"
    return str(windows) if windows.is_file() else None


def detect(platform: str) -> GpuReport:
    """Ask the NVIDIA driver (never raises: a failure is the report's `problem`)."""
    if platform == "macos":
        return GpuReport(problem="macOS has no NVIDIA driver")
    driver_file = ""
    proc_version = Path("/proc/driver/nvidia/version")
    if platform == "linux" and proc_version.is_file():
        try:
            driver_file = proc_version.read_text(errors="replace")
        except OSError:
            driver_file = ""
    smi = find_nvidia_smi()
    if smi is None:
        if driver_file:
            report = parse_nvidia_smi("", "", driver_file)
            return GpuReport(report.gpus, report.driver, report.cuda,
                             problem="nvidia-smi is missing, so the GPU could not be checked")
        return GpuReport(problem="no NVIDIA driver found (nvidia-smi is not installed)")
    try:
        query = _run([smi, "--query-gpu=name,memory.total,compute_cap,driver_version",
                      "--format=csv,noheader,nounits"])
        header = _run([smi])
    except (OSError, subprocess.SubprocessError) as exc:
        return GpuReport(problem=f"nvidia-smi failed ({exc}); the driver may need a reboot or reinstall")
    report = parse_nvidia_smi(query, header, driver_file)
    if not report.gpus:
        return GpuReport(problem="nvidia-smi lists no GPU")
    return report


def choose(platform: str, report: GpuReport, wanted: str = "auto") -> TorchChoice:
    """The build for `wanted` ("auto", "cpu", "cuda" or a tag such as "cu128")."""
    if platform == "macos":
        return TorchChoice("default", None, "macOS: PyPI's PyTorch build (Apple GPUs through Metal)")
    cpu = TorchChoice("cpu", TORCH_INDEX + "cpu" if platform == "linux" else None, "")
    tags = {b.tag: b for b in CUDA_BUILDS}
    if wanted in tags:
        build = tags[wanted]
        return TorchChoice(build.tag, TORCH_INDEX + build.tag, f"CUDA {build.cuda[0]}.{build.cuda[1]} build, as asked")
    if wanted == "cpu":
        return TorchChoice(cpu.variant, cpu.index_url, "CPU build, as asked")
    if wanted not in ("auto", "cuda"):
        raise ValueError(f"--torch {wanted!r}: use auto, cpu, cuda or one of {', '.join(tags)}")
    if not report.gpus:
        why = report.problem or "no NVIDIA GPU found"
        if wanted == "cuda":
            raise ValueError(f"--torch cuda: {why}. Install the NVIDIA driver first, or use --torch cpu.")
        return TorchChoice(cpu.variant, cpu.index_url, f"CPU build: {why}")
    gpu = report.gpus[0]
    described = f"{gpu.name} ({gpu.memory_mib / 1024:.0f} GB), driver {report.driver}"
    if report.cuda is None:
        return TorchChoice(cpu.variant, cpu.index_url,
                           f"CPU build: {described} did not say which CUDA version it supports; "
                           "update the NVIDIA driver and run the installer again")
    for build in CUDA_BUILDS:
        if build.cuda > report.cuda:
            continue
        if gpu.compute is not None and gpu.compute < build.min_compute:
            continue
        return TorchChoice(build.tag, TORCH_INDEX + build.tag,
                           f"CUDA {build.cuda[0]}.{build.cuda[1]} build for {described}, "
                           f"which supports CUDA up to {report.cuda[0]}.{report.cuda[1]}")
    oldest = CUDA_BUILDS[-1]
    return TorchChoice(cpu.variant, cpu.index_url,
                       f"CPU build: {described} supports CUDA {report.cuda[0]}.{report.cuda[1]}, and "
                       f"PyTorch {TORCH_VERSION} needs CUDA {oldest.cuda[0]}.{oldest.cuda[1]} or newer. "
                       "Update the NVIDIA driver (nvidia.com/drivers) and run the installer again "
                       "to switch to the GPU build")


def installed_variant(version: str) -> str:
    """The build an installed torch version string names: 2.13.0+cu128 -> cu128, 2.13.0+cpu ->
    cpu, 2.13.0 -> default (PyPI's own build)."""
    return version.partition("+")[2] or "default"
