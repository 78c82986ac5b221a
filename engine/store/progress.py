"""Download progress as plain-data events: per-file and total bytes, rolling speed, ETA.

`ProgressTracker` is owned by one download (one thread); it turns byte counts into
`DownloadProgress` events at most every `interval_s` (state changes are always sent). The clock
is injectable so tests can drive it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from engine.types import DownloadProgress, DownloadState

ProgressCallback = Callable[[DownloadProgress], None]


class RateMeter:
    """Bytes per second over the last `window_s` seconds of samples."""

    def __init__(self, window_s: float = 8.0) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, total_bytes: int) -> None:
        self._samples.append((now, total_bytes))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window_s:
            self._samples.popleft()

    def reset(self) -> None:
        self._samples.clear()

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        # Under half a second of samples says nothing about the line's speed.
        return (b1 - b0) / (t1 - t0) if t1 - t0 >= 0.5 else 0.0


class ProgressTracker:
    def __init__(
        self, model_id: str, on_progress: ProgressCallback | None, bytes_total: int,
        clock: Callable[[], float] = time.monotonic, interval_s: float = 0.25,
    ) -> None:
        self.model_id = model_id
        self.bytes_total = bytes_total
        self.bytes_done = 0
        self.file_name = ""
        self.file_done = 0
        self.file_total = 0
        self._on_progress = on_progress
        self._clock = clock
        self._interval_s = interval_s
        self._meter = RateMeter()
        self._last_emit = float("-inf")
        self._state: DownloadState = "checking"

    def start_file(self, name: str, size: int, already: int) -> None:
        self.file_name, self.file_total, self.file_done = name, size, already

    def advance(self, count: int) -> None:
        """`count` new bytes arrived (negative when a partial file is discarded)."""
        self.file_done += count
        self.bytes_done += count
        now = self._clock()
        if count < 0:
            self._meter.reset()
        self._meter.add(now, self.bytes_done)
        if self._state != "downloading":
            self.emit("downloading")
        elif now - self._last_emit >= self._interval_s:
            self.emit("downloading")

    def emit(self, state: DownloadState, message: str = "") -> None:
        if state in ("paused", "retrying"):
            self._meter.reset()  # speed after a gap restarts from fresh samples
        self._state = state
        self._last_emit = self._clock()
        if self._on_progress is None:
            return
        speed = self._meter.rate() if state == "downloading" else 0.0
        remaining = max(0, self.bytes_total - self.bytes_done)
        eta = remaining / speed if speed > 0 else (0.0 if state == "done" else None)
        self._on_progress(DownloadProgress(
            model_id=self.model_id, state=state, file_name=self.file_name,
            file_bytes_done=self.file_done, file_bytes_total=self.file_total,
            bytes_done=self.bytes_done, bytes_total=self.bytes_total,
            bytes_per_second=speed, eta_seconds=eta, message=message,
        ))
