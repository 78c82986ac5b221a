"""Fixtures for the model store: an isolated environment per test and a local fake hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
from hub_server import STARTER_REPO, FakeRepo, HubServer, make_model_files

from engine.store.transfer import DownloadSettings


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF cache, HF home, the models folder and the home folder all under tmp_path; no token from
    the machine."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("SPECCHAT_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # LM Studio's and Ollama's folders: none unless a test makes them
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT",
                 "OLLAMA_MODELS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    return tmp_path / "models"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    server = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def settings() -> DownloadSettings:
    """Short timeouts and backoff so fault tests run in well under a second each."""
    return DownloadSettings(
        stall_timeout_s=0.5, connect_timeout_s=2.0, max_retries=3, backoff_initial_s=0.01,
        backoff_max_s=0.05, progress_interval_s=0.0, free_space_margin_bytes=0,
        metadata_retries=1,
    )


@pytest.fixture
def starter_repo(hub: HubServer) -> FakeRepo:
    return hub.add_repo(FakeRepo(STARTER_REPO, make_model_files()))


@pytest.fixture
def closed_port_endpoint() -> str:
    """An endpoint on 127.0.0.1 where nothing listens: connection refused at once."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
