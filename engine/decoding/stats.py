"""What one generation measured: the timers its steps add to while it runs, the GenerationStats
its Completion carries, and the process's peak resident memory.

What this module does not do: learn from the figures (costs, acceptance) or print them (cli).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import psutil

from engine.types import GenerationStats, Placement, StepMode


@dataclass
class StepTimers:
    """Seconds and passes of one generation, by kind."""

    draft: float = 0.0
    target: float = 0.0
    prefill: float = 0.0
    target_passes: int = 0
    draft_passes: int = 0
    prefill_passes: int = 0


def generation_stats(*, prompt_tokens: int, new_tokens: int, timers: StepTimers, seconds: float,
                     ttft: float | None, budget: int, mode: StepMode, placement: Placement | None,
                     oom_retries: int, cached_tokens: int) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        target_passes=timers.target_passes,
        tokens_per_pass=new_tokens / max(timers.target_passes, 1),
        draft_passes=timers.draft_passes,
        budget=budget,
        seconds=seconds,
        ttft_seconds=ttft if ttft is not None else seconds,
        tokens_per_second=new_tokens / seconds if seconds > 0 else 0.0,
        peak_rss_bytes=peak_rss(),
        draft_seconds=timers.draft,
        target_seconds=timers.target,
        prefill_seconds=timers.prefill,
        mode=mode,
        placement=placement,
        oom_retries=oom_retries,
        cached_tokens=cached_tokens,
        prefill_passes=timers.prefill_passes,
    )


def peak_rss() -> int:
    if sys.platform == "win32":
        return int(psutil.Process().memory_info().peak_wset)
    import resource  # POSIX only

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
