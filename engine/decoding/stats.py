"""What one generation measured: the timers its steps add to while it runs and the
GenerationStats its Completion carries (with the process's own peak memory, engine.peak_memory).

What this module does not do: learn from the figures (costs, acceptance) or print them (cli).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.peak_memory import peak_rss_bytes
from engine.shapes import Placement
from engine.types import GenerationStats, StepMode


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
        peak_rss_bytes=peak_rss_bytes(),
        draft_seconds=timers.draft,
        target_seconds=timers.target,
        prefill_seconds=timers.prefill,
        mode=mode,
        placement=placement,
        oom_retries=oom_retries,
        cached_tokens=cached_tokens,
        prefill_passes=timers.prefill_passes,
    )
