"""Fixtures for the models page, settings and wizard tests (`pytest_plugins = ("pages_fixtures",)`).

Every test runs with the user's state in tmp_path (data, cache, models folder, HF cache, an INI
QSettings) and, where it downloads, against the real local HTTP server that speaks the hub
protocol (tests/engine/store/hub_server.py), serving a real tiny model under the starter's repo id.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from pages_hub import HubServer
from PySide6.QtCore import QSettings

from app.state.preferences_store import PreferencesStore
from engine.testing.synthetic import tiny_gguf, tiny_model
from engine.store.transfer import DownloadSettings


@pytest.fixture
def app_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """User data, cache, models folder and HF cache under tmp_path; no token from the machine."""
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECCHAT_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture
def prefs_store(app_env: Path, qtbot) -> PreferencesStore:  # type: ignore[no-untyped-def]
    return PreferencesStore(QSettings(str(app_env / "specchat.ini"), QSettings.Format.IniFormat))


@pytest.fixture
def hub() -> Iterator[HubServer]:
    server = HubServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def slow_hub() -> Iterator[HubServer]:
    """~2 MB/s in 16 kB chunks: a download long enough to watch, pause and cancel."""
    server = HubServer(bytes_per_second=2_000_000).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_starter_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A real tiny Llama's files (config, safetensors, tokenizer), served as the starter repo."""
    folder = tiny_model("llama", seed=0, cache_dir=tmp_path_factory.mktemp("tiny-cache"))
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="session")
def tiny_starter_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real tiny Llama as a Q4_1 GGUF (engine.testing.synthetic), standing in for the wheel's."""
    return tiny_gguf("llama", layers=2, layer_types=("Q4_1",), head_type="Q8_0",
                     cache_dir=tmp_path_factory.mktemp("tiny-gguf")).read_bytes()


@pytest.fixture
def tiny_starter(tiny_starter_gguf: bytes) -> Callable[[Path], Path]:
    """Stands in for PyPI (engine.loading.starter.starter_model): writes the real tiny GGUF where
    the starter's GGUF lives, as the app's StarterSource; one fetched already stays (as pip's)."""
    from engine.store.pypi import STARTER_GGUF_NAME

    def build(cache_dir: Path) -> Path:
        gguf = cache_dir / "starter" / STARTER_GGUF_NAME
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            gguf.write_bytes(tiny_starter_gguf)
        return gguf

    return build


@pytest.fixture
def download_settings() -> DownloadSettings:
    return DownloadSettings(connect_timeout_s=2.0, max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.05,
                            progress_interval_s=0.0, free_space_margin_bytes=0, metadata_retries=1)
