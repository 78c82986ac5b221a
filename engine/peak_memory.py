"""This process's resident memory and its high-water mark, from the platform's own per-process
figure: the one source for every peak SpecChat reports (`generate --json`'s
`stats.peak_rss_bytes`, `bench offload --load-rss`).

- Linux: VmRSS / VmHWM of /proc/self/status. Not `ru_maxrss`: the kernel carries a process's
  `ru_maxrss` over fork and exec, so a program started by a parent holding 1.7 GB reports at
  least 1.7 GB however little it used. VmHWM belongs to the process image and starts afresh at
  exec; `reset_peak()` sets it back to the current RSS (/proc/self/clear_refs).
- macOS: `ru_maxrss` (bytes there; exec starts it afresh).
- Windows: the working set's peak (PeakWorkingSetSize, through psutil).
- Other POSIX: `ru_maxrss` (KiB, as BSDs report it), the best the platform offers.

What this does not do: measure other processes, or GPU memory (torch.cuda has its own).
"""

from __future__ import annotations

import logging
import sys

import psutil

log = logging.getLogger(__name__)

_STATUS = "/proc/self/status"


def peak_rss_bytes() -> int:
    """The most resident memory this process (image) has held, in bytes."""
    if sys.platform.startswith("linux"):
        peak = _proc_status("VmHWM")
        if peak is not None:
            return peak
    if sys.platform == "win32":
        return int(psutil.Process().memory_info().peak_wset)
    import resource  # POSIX only

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # Linux and the BSDs report KiB


def rss_bytes() -> int:
    """Resident memory now, in bytes."""
    if sys.platform.startswith("linux"):
        rss = _proc_status("VmRSS")
        if rss is not None:
            return rss
    return int(psutil.Process().memory_info().rss)


def reset_peak() -> bool:
    """Set the high-water mark back to the current RSS, so a later `peak_rss_bytes()` measures
    only what follows (Linux; elsewhere nothing happens). Whether it was reset."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError as exc:  # an old kernel, or a sandbox that hides it
        log.debug("cannot reset the RSS high-water mark: %s", exc)
        return False


def _proc_status(key: str) -> int | None:
    """A "kB" field of /proc/self/status in bytes; None where /proc does not say (a sandbox
    without /proc, gVisor)."""
    try:
        with open(_STATUS, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
