"""One file over HTTP, resumable: Range requests onto a `.part` file, stall detection, retries
with backoff, pause and cancel checked between chunks.

Why not `hf_hub_download`: in huggingface_hub 2.4 it writes each attempt to a process-unique
temp file and deletes it on failure (so nothing survives a pause, a crash or an app restart), its
retry loop sleeps without a cancel check, and its progress goes to tqdm. We keep
huggingface_hub for metadata, URLs, auth headers and its HTTP client (same proxies, user agent
and CA settings) and stream `resolve` URLs here. The `.part` file *is* the resume state: its
length is the offset to ask for next.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx2

from engine.errors import Cancelled, DiskFull, DownloadFailed, GatedRepo, InvalidRequest
from engine.store.progress import ProgressTracker

logger = logging.getLogger(__name__)

_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_STALL_TIMEOUT_S = 86_400.0  # a day: beyond it "stalled" means nothing


@dataclass(frozen=True)
class DownloadSettings:
    """stall_timeout_s: no byte for this long means the transfer stalled (it is dropped and
    resumed). max_retries: consecutive attempts that bring no new byte before giving up; any
    progress resets the count, so a flaky line that still moves data never gives up."""

    stall_timeout_s: float = 30.0
    connect_timeout_s: float = 15.0
    max_retries: int = 8
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    progress_interval_s: float = 0.25
    free_space_margin_bytes: int = 200_000_000
    metadata_retries: int = 3

    def __post_init__(self) -> None:
        # `not 0 < x <= max` refuses NaN too; 0 would never time out a stall (httpx's "no limit")
        for name in ("stall_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not 0.0 < value <= MAX_STALL_TIMEOUT_S:
                raise InvalidRequest(f"{name.removesuffix('_s').replace('_', ' ').capitalize()} must be above 0 "
                                     f"and at most {MAX_STALL_TIMEOUT_S:g} seconds (got {value}).")
        if self.max_retries < 0 or self.metadata_retries < 0 or self.free_space_margin_bytes < 0:
            raise InvalidRequest("Retry counts and the free-space margin cannot be negative.")
        if not (0.0 <= self.backoff_initial_s <= self.backoff_max_s and 0.0 <= self.progress_interval_s):
            raise InvalidRequest("Backoff delays and the progress interval must be 0 or more, the first at most the last.")


class TransferControl:
    """The user's cancel and pause events, checked between chunks and while waiting."""

    def __init__(self, cancel: threading.Event, pause: threading.Event | None, tracker: ProgressTracker) -> None:
        self.cancel = cancel
        self.pause = pause
        self._tracker = tracker

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise Cancelled("The download was cancelled.")

    def paused(self) -> bool:
        return self.pause is not None and self.pause.is_set()

    def wait_while_paused(self) -> None:
        if not self.paused():
            return
        self._tracker.emit("paused", "Paused; the partial data is kept.")
        while self.paused():
            if self.cancel.wait(0.1):
                break
        self.check_cancel()

    def sleep(self, seconds: float) -> None:
        """Back off for `seconds`, waking at once on cancel."""
        if self.cancel.wait(seconds):
            self.check_cancel()


class _RetryableError(Exception):
    pass


def fetch_file(
    client: httpx2.Client, url: str, part: Path, size: int, headers: dict[str, str],
    settings: DownloadSettings, control: TransferControl, tracker: ProgressTracker, gated_text: str,
) -> None:
    """Make `part` hold exactly `size` bytes from `url`, resuming from its current length."""
    failures = 0
    timeout = httpx2.Timeout(
        connect=settings.connect_timeout_s, read=settings.stall_timeout_s,
        write=settings.connect_timeout_s, pool=settings.connect_timeout_s,
    )
    while True:
        control.check_cancel()
        control.wait_while_paused()
        done = part.stat().st_size if part.exists() else 0
        if done > size:  # longer than the real file: it cannot be a prefix of it
            _discard(part, done, tracker)
            done = 0
        if done == size:
            return
        request_headers = {**headers, "Accept-Encoding": "identity"}
        if done:
            request_headers["Range"] = f"bytes={done}-"
        got = 0
        try:
            with client.stream("GET", url, headers=request_headers, timeout=timeout, follow_redirects=True) as resp:
                status = resp.status_code
                if status in (401, 403):
                    raise GatedRepo(gated_text)
                if status == 416:
                    _discard(part, done, tracker)
                    raise _RetryableError("the server refused the resume offset; starting the file over")
                if status in _RETRYABLE_STATUS:
                    raise _RetryableError(f"the server answered HTTP {status}")
                if status >= 400:
                    raise DownloadFailed(f"The hub answered HTTP {status} for {url}. Try again later.")
                if done and status == 200:
                    logger.info("server ignored Range for %s; restarting the file", url)
                    _discard(part, done, tracker)
                    done = 0
                elif status == 206 and not resp.headers.get("Content-Range", "").startswith(f"bytes {done}-"):
                    _discard(part, done, tracker)
                    raise _RetryableError("the server resumed at the wrong offset")
                with part.open("ab") as out:
                    for chunk in resp.iter_bytes():  # as received: a drop loses nothing buffered
                        if done + got + len(chunk) > size:
                            raise _RetryableError("the server sent more bytes than the file has")
                        out.write(chunk)
                        got += len(chunk)
                        tracker.advance(len(chunk))
                        control.check_cancel()
                        if control.paused():
                            break
                if control.paused():
                    continue  # connection closed; wait, then resume from the new length
                if done + got < size:
                    raise _RetryableError(f"the connection closed after {done + got} of {size} bytes")
                return
        except httpx2.TimeoutException:
            reason = f"no data for {settings.stall_timeout_s:g} s (stalled)" if got or done else "the server did not answer"
        except httpx2.TransportError as exc:
            reason = f"network error ({exc.__class__.__name__}: {exc})"
        except _RetryableError as exc:
            reason = str(exc)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(
                    f"The disk holding {part.parent} filled up during the download. Free some space and run "
                    "the download again: it resumes where it stopped."
                ) from exc
            raise
        failures = 0 if got > 0 else failures + 1
        if failures > settings.max_retries:
            raise DownloadFailed(
                f"Downloading {part.name.removesuffix('.part')} failed {failures} times in a row ({reason}). "
                "The partial data is kept: run the download again to resume."
            )
        delay = min(settings.backoff_max_s, settings.backoff_initial_s * 2 ** max(0, failures - 1))
        logger.info("%s: %s; retry in %.1f s", url, reason, delay)
        tracker.emit("retrying", f"{reason}; retrying in {delay:.0f} s")
        control.sleep(delay)


def _discard(part: Path, length: int, tracker: ProgressTracker) -> None:
    part.unlink(missing_ok=True)
    tracker.advance(-length)


def file_matches(path: Path, sha256: str | None, blob_id: str | None, size: int) -> bool:
    """Content check against the hub: LFS sha256, else the git blob id, else the size only."""
    if path.stat().st_size != size:
        return False
    if sha256 is not None:
        digest = hashlib.sha256()
    elif blob_id is not None:
        digest = hashlib.sha1()
        digest.update(b"blob %d\0" % size)
    else:
        return True
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest() == (sha256 if sha256 is not None else blob_id)
