"""The packed-weight kernel (qmatmul.c), compiled on first use with the system's C compiler and
loaded with ctypes.

Compiled into the user cache (`<cache>/kernels/<key>/libqmatmul.so`, the key a hash of the
source, the flags, the compiler's version and the machine), written to a temporary name and
renamed, so a crash mid-build leaves nothing that looks finished. Flags from the fastest to
the most portable: `-march=native`, then AVX2 + FMA, then plain C; a build that fails moves
to the next. A cached library that does not load (damaged) is built again, once.

No compiler, every build failing, Windows (no build here yet), or SPECCHAT_NO_KERNELS=1 in the
environment: `kernels()` is None, one INFO line says why, and the caller runs its dense path.
Never raises. SPECCHAT_NO_VNNI=1 builds without the integer rows of VNNI CPUs (qm_digits.h), so
their fp32 rows can be compared or relied on.

What this module does not do: choose which weights use the kernel (engine.loading) or run it
(linear.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from engine import paths

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"), ("-O3", "-fopenmp"),
             ("-O3",))
VERSION = 15  # qmatmul.c qm_version(): 2 K-quant scales (QM_KSC), 3 MoE layers in a decode step, 4 six-bit codes,
# 5 experts' gates with biases (gpt-oss, qm_gate), 6 MXFP4 as q4 codes of E2M1 values (QM_E2M1), 7 IQ4's nibbles
# as q8 codes (QM_IQ4), 8 gpt-oss layers in the fused step and pass (sinks, windows: qm_view, its router and gate),
# 9 Qwen3.5's Gated DeltaNet layers, gated attention and gated shared experts in the step, 10 an accepted path
# replayed through a Gated DeltaNet layer's state (qm_delta_replay), 11 products over 16+ tokens in panels
# (transposed tokens, 16 decoded rows), 12 a pass's routed experts of 17+ tokens in panels, 13 a K/V head's
# query heads attend together (attend_group: keys and values a tile at a time), 14 a hybrid's prompt chunk
# folded into its Gated DeltaNet states in the pass (delta_chain), 15 Gemma 4's layers (per-layer head widths,
# keys as values, value norms, its MoE block beside the MLP, layer scales, per-layer inputs, reused K/V; experts'
# GELU gate: qm_gate.gelu; the MLPs' SiLU and GELU gates in one branch-free form that vectorises: qm_expf)
SIMD_NAMES = {0: "plain C", 2: "AVX2", 3: "AVX-512", 4: "AVX-512 VNNI integer rows", 5: "AVX2, AVX-VNNI integer rows"}

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_tried = False


def compiler() -> str | None:
    """$CC, else cc or gcc on the PATH."""
    named = os.environ.get("CC", "").strip()
    if named:
        return shutil.which(named) or (named if Path(named).is_file() else None)
    return shutil.which("cc") or shutil.which("gcc")


def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call of the process; None when there is
    none to be had (see the module docstring)."""
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            _loaded = _build_and_load()
        return _loaded


def identity() -> str:
    """Which kernel build this process runs: its cache key (source, flags, compiler, CPU), or
    "none" when none was loaded. Pass costs measured under one build are not another's
    (engine.decoding.learned keys its files by it)."""
    lib = _loaded
    return Path(lib._name).parent.name if lib is not None else "none"


def reset() -> None:
    """Forget the library this process loaded (tests build again under other settings)."""
    global _loaded, _tried
    with _lock:
        _loaded, _tried = None, False


def _build_and_load() -> ctypes.CDLL | None:
    if os.environ.get("SPECCHAT_NO_KERNELS", "").strip() not in ("", "0"):
        log.info("packed CPU kernels off (SPECCHAT_NO_KERNELS): packed layers run de-quantised")
        return None
    if sys.platform == "win32":
        log.info("packed CPU kernels are not built on Windows yet: packed layers run de-quantised")
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler (cc, gcc or $CC) for the packed CPU kernels: packed layers run de-quantised")
        return None
    version = _compiler_version(cc)
    source = b"".join(path.read_bytes() for path in (SOURCE, *sorted(SOURCE.parent.glob("*.h"))))  # and its headers
    first_error = ""
    no_vnni = os.environ.get("SPECCHAT_NO_VNNI", "").strip() not in ("", "0")
    for flags in FLAG_SETS:
        if no_vnni:
            flags = (*flags, "-DQM_NO_VNNI")
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                          platform.machine().encode(), _cpu_model().encode()])).hexdigest()[:20]
        target = paths.cache_dir() / "kernels" / key / "libqmatmul.so"
        for attempt in (0, 1):
            if not target.is_file() or attempt:
                error = _compile(cc, flags, target)
                if error:
                    first_error = first_error or error
                    break
            lib = _load(target)
            if lib is not None:
                log.info("packed CPU kernels: %s (%s; %s)", target.parent.name, " ".join(flags),
                         SIMD_NAMES.get(lib.qm_simd(), "?"))
                return lib
            target.unlink(missing_ok=True)  # damaged: build once more
    log.info("packed CPU kernels could not be built (%s): packed layers run de-quantised", first_error)
    return None


def _compile(cc: str, flags: tuple[str, ...], target: Path) -> str:
    """'' when `target` was built; else the compiler's first error line."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write {target.parent}: {exc.strerror or exc}"
    try:
        proc = subprocess.run([cc, *flags, "-shared", "-fPIC", "-std=c11", "-o", tmp, str(SOURCE)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if "error" in line.lower()]
            return (lines or (proc.stderr or proc.stdout or f"exit code {proc.returncode}").splitlines() or ["?"])[0][:200]
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc}: {exc}"
    finally:
        Path(tmp).unlink(missing_ok=True)


def _load(target: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(target))
        lib.qm_version.restype = ctypes.c_int
        if lib.qm_version() != VERSION:
            return None
        lib.qm_simd.restype = ctypes.c_int
        lib.qm_matmul.restype = ctypes.c_int
        lib.qm_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_int]
        lib.qm_experts_one.restype = ctypes.c_int
        lib.qm_experts_one.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        return lib
    except (OSError, AttributeError) as exc:
        log.info("the cached kernel library %s does not load (%s)", target, exc)
        return None


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "?"


def _cpu_model() -> str:
    """The CPU's model line: a library built with -march=native runs only on CPUs like it (a
    cache folder copied to another machine gets its own build)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return model + flags
