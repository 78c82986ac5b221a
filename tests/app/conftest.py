"""Shared by every app test: no test reads or writes the user's real state.

An autouse fixture points SPECCHAT_DATA_DIR / CACHE_DIR / MODELS_DIR, XDG_CONFIG_HOME, HOME and
QSettings' user-scope INI path into tmp_path and sets SPECCHAT_SKIP_WIZARD=1. The chat tests
build windows (`open_window`) over a real EngineHost (a real QThread) and a real tiny model;
their dialogs answer at once (`answers`, tests/app/answers.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from answers import Answers  # noqa: E402
from PySide6.QtCore import QSettings  # noqa: E402

from app.main_window import MainWindow  # noqa: E402
from app.state.conversations import ConversationStore, default_path  # noqa: E402
from app.state.preferences import Preferences  # noqa: E402
from app.state.preferences_store import PreferencesStore  # noqa: E402
from app.workers.engine_worker import EngineHost  # noqa: E402

LOAD_MS = 120_000  # loading the tiny pair on two busy cores


@pytest.fixture(autouse=True)
def isolated_user_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECCHAT_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("SPECCHAT_SKIP_WIZARD", "1")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("SPECCHAT_CONFIG_DIR", str(tmp_path / "config" / "specchat"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no LM Studio or Ollama folders unless a test makes them
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    for fmt in (QSettings.Format.IniFormat, QSettings.Format.NativeFormat):
        QSettings.setPath(fmt, QSettings.Scope.UserScope, str(tmp_path / "config"))
    yield tmp_path


def _set_torch_threads() -> None:
    from engine.threads import set_threads

    set_threads(1)  # two cores shared with other work: keep the worker to one (kept when a model loads)


@pytest.fixture
def settings_file(tmp_path: Path) -> Path:
    return tmp_path / "specchat.ini"


@pytest.fixture
def make_prefs(settings_file: Path) -> Callable[..., PreferencesStore]:
    """A PreferencesStore on the test's INI file, saved with the given fields."""

    def make(**fields: object) -> PreferencesStore:
        store = PreferencesStore(QSettings(str(settings_file), QSettings.Format.IniFormat))
        store.save(replace(Preferences(first_run_done=True), **fields))  # type: ignore[arg-type]
        return store

    return make


@pytest.fixture
def chat_prefs(make_prefs: Callable[..., PreferencesStore], tiny_target_path: Path,
               tiny_draft_path: Path) -> PreferencesStore:
    """The tiny pair, greedy, long answers (so a test can stop one mid-way), on the CPU; the draft
    kept on (the tiny draft costs what the target does, and the tests look at its trees)."""
    return make_prefs(target=str(tiny_target_path), draft=str(tiny_draft_path), temperature=0.0,
                      max_new_tokens=1500, device="cpu", budget=8, max_depth=4, keep_draft=True,
                      repetition_penalty=1.0)  # the tiny model's long answers, as the tests were timed with


@pytest.fixture
def conversations(tmp_path: Path) -> Iterator[ConversationStore]:
    store = ConversationStore(default_path(tmp_path / "data"))
    yield store
    store.close()


@pytest.fixture
def make_host(qtbot) -> Iterator[Callable[[], EngineHost]]:  # type: ignore[no-untyped-def]
    """EngineHosts (real worker threads) that are shut down after the test."""
    hosts: list[EngineHost] = []

    def make() -> EngineHost:
        host = EngineHost(thread_setup=_set_torch_threads)
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        host.shutdown()



@pytest.fixture
def answers() -> Answers:
    """How the windows' dialogs answer (No to every question, unless a test says otherwise)."""
    return Answers()


@pytest.fixture
def open_window(qtbot, make_host, conversations: ConversationStore,  # type: ignore[no-untyped-def]
                answers: Answers) -> Iterator[Callable[..., MainWindow]]:
    """Main windows over a real EngineHost, shown, closed after the test. `open_window(prefs)`
    waits until the model is loaded; `wait_loaded=False` does not; `store` replaces the test's
    ConversationStore (a second window over the same file)."""
    windows: list[MainWindow] = []

    def open_(prefs: PreferencesStore, wait_loaded: bool = True, store: ConversationStore | None = None) -> MainWindow:
        window = MainWindow(prefs, store or conversations, host=make_host(), dialogs=answers.dialogs())
        qtbot.addWidget(window)
        window.show()
        windows.append(window)
        if wait_loaded:
            qtbot.waitUntil(lambda: window.chat.model_state == "ready", timeout=LOAD_MS)
        return window

    yield open_
    for window in windows:
        window.close()
