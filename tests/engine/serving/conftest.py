"""The serving tests' shared server: the tiny pair behind `specchat serve` (serve_process.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import API_KEY, ServeProcess


@pytest.fixture(scope="session")
def tiny_server(tiny_target_path: Path, tiny_draft_path: Path) -> Iterator[ServeProcess]:
    """The tiny pair served with an API key, a queue of one, budget 8, greedy, 16 tokens by default;
    the draft kept on (the tiny draft costs what the target does, and its trees are under test)."""
    server = ServeProcess(["--target", tiny_target_path, "--draft", tiny_draft_path, "--device", "cpu",
                           "--budget", 8, "--max-depth", 4, "--max-new-tokens", 16, "--api-key", API_KEY,
                           "--queue-size", 1, "--keep-draft"])
    server.wait_for(lambda line: line.startswith("ready:"))
    yield server
    assert server.stop() == 0, "\n".join(server.lines)
