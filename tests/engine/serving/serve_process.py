"""`specchat serve` as a real subprocess on 127.0.0.1 (port 0: a free one), its stderr read line
by line (one line per request). Imported by name (tests/engine/serving is on sys.path)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
API_KEY = "sk-test-key"
START_SECONDS = 180


class ServeProcess:
    """`python -m engine serve ...` with its stderr collected line by line."""

    def __init__(self, args: list[object], env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        full_env.pop("SPECCHAT_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", "0", *map(str, args)],
                                     cwd=REPO, env=full_env, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        serving = self.wait_for(lambda line: "serving http://" in line or line.startswith("error:"))
        match = re.search(r"serving (http://\S+/v1)", serving)
        assert match, "\n".join(self.lines)
        self.url = match.group(1)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n").removeprefix("specchat: "))
                self._changed.notify_all()

    def wait_for(self, match: Callable[[str], bool], start: int = 0, timeout: float = START_SECONDS) -> str:
        """The first line from index `start` on that matches (waits for it)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[start:]:
                    if match(line):
                        return line
                if self.proc.poll() is not None and not any(match(line) for line in self.lines[start:]):
                    time.sleep(0.2)  # the reader may still be draining the pipe
                    found = [line for line in self.lines[start:] if match(line)]
                    if found:
                        return found[0]
                    raise AssertionError("the server exited:\n" + "\n".join(self.lines))
                left = deadline - time.monotonic()
                assert left > 0, "timed out; server said:\n" + "\n".join(self.lines)
                self._changed.wait(min(left, 0.5))

    def wait_requests(self, count: int, start: int = 0) -> list[str]:
        """The first `count` per-request lines from line index `start` on (waits for them)."""
        seen: list[str] = []

        def enough(line: str) -> bool:
            if line.startswith("request ") and line not in seen:
                seen.append(line)
            return len(seen) >= count

        self.wait_for(enough, start)
        return seen[:count]

    def request_lines(self) -> list[str]:
        with self._changed:
            return [line for line in self.lines if line.startswith("request ")]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
