"""EngineWorker in its real QThread with a real tiny engine: load, stream, cancel, errors."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from chat_helpers import WorkerEvents
from PySide6.QtCore import QObject, QThread, Signal, Slot
from pytestqt.qtbot import QtBot

from app.workers.engine_worker import EngineHost
from app.workers.host import WorkerHost
from app.workers.remote_worker import RemoteHost
from engine.types import (
    Completion,
    GenerationRequest,
    LoadSettings,
    Message,
    RemoteModel,
    SamplingSettings,
    SpeculationSettings,
)

GREEDY = SamplingSettings(temperature=0.0)


def _load(qtbot: QtBot, host: EngineHost, target: Path, draft: Path | None) -> WorkerEvents:
    events = WorkerEvents(host)
    with qtbot.waitSignal(events.loaded, timeout=120_000) as blocker:
        host.load(str(target), str(draft) if draft else "", LoadSettings(device="cpu"))
    assert blocker.args[1] == str(target)
    return events


def test_load_and_stream_in_the_worker_thread(qtbot: QtBot, make_host, tiny_target_path: Path,
                                              tiny_draft_path: Path) -> None:
    host = make_host()
    loader_threads: set[int] = set()
    host.worker.load_progressed.connect(lambda _p: loader_threads.add(threading.get_ident()))  # runs in the emitter
    events = _load(qtbot, host, tiny_target_path, tiny_draft_path)
    assert host.worker.thread() is not QThread.currentThread()
    assert loader_threads and threading.get_ident() not in loader_threads  # loading never ran in the GUI thread
    assert [p.stage for p in events.progress][-1] == "ready"  # type: ignore[attr-defined]

    request = GenerationRequest(messages=(Message("user", "hello"),), max_new_tokens=60, sampling=GREEDY,
                                speculation=SpeculationSettings(budget=8, max_depth=4))
    with qtbot.waitSignal(events.generation_finished, timeout=120_000) as blocker:
        request_id = host.generate(request)
    rid, completion = blocker.args
    assert rid == request_id and isinstance(completion, Completion)
    assert completion.finish_reason == "length"
    # the coalesced chunks add up to exactly the final text (the token counts feed only the live
    # tok/s: a step whose bytes end mid-character adds no text and is not counted there)
    assert "".join(t for _, t, _ in events.chunks) == completion.text
    assert 0 < sum(n for _, _, n in events.chunks) <= len(completion.token_ids) == 60
    assert {i for i, _, _ in events.chunks} == {request_id}
    assert completion.stats.mode == "specexec" and completion.stats.budget == 8


def test_cancel_stops_a_long_answer_and_keeps_its_text(qtbot: QtBot, make_host, tiny_target_path: Path) -> None:
    host = make_host()
    events = _load(qtbot, host, tiny_target_path, None)
    request = GenerationRequest(messages=(Message("user", "hello"),), max_new_tokens=1800, sampling=GREEDY)
    with qtbot.waitSignal(events.tokens_generated, timeout=60_000):
        host.generate(request)
    with qtbot.waitSignal(events.generation_finished, timeout=60_000) as blocker:
        host.cancel_generation()
    completion = blocker.args[1]
    assert completion.finish_reason == "cancelled"
    assert 0 < len(completion.token_ids) < 1800
    assert "".join(t for _, t, _ in events.chunks) == completion.text


def test_a_new_request_does_not_revive_a_cancelled_one(qtbot: QtBot, make_host, tiny_target_path: Path) -> None:
    host = make_host()
    events = _load(qtbot, host, tiny_target_path, None)
    long = GenerationRequest(messages=(Message("user", "hello"),), max_new_tokens=1800, sampling=GREEDY)
    short = GenerationRequest(messages=(Message("user", "hi"),), max_new_tokens=5, sampling=GREEDY)
    with qtbot.waitSignal(events.tokens_generated, timeout=60_000):
        first = host.generate(long)
    host.cancel_generation()
    second = host.generate(short)  # queued before the worker saw the cancel
    qtbot.waitUntil(lambda: second in events.finished, timeout=60_000)
    reasons = {i: c.finish_reason for i, c in events.finished.items()}  # type: ignore[attr-defined]
    assert reasons == {first: "cancelled", second: "length"}


def test_errors_arrive_as_user_messages(qtbot: QtBot, make_host, tmp_path: Path) -> None:
    host = make_host()
    events = WorkerEvents(host)
    with qtbot.waitSignal(events.load_failed, timeout=60_000) as blocker:
        host.load(str(tmp_path / "nowhere"), "", LoadSettings(device="cpu"))
    assert "No model at" in blocker.args[1]
    with qtbot.waitSignal(events.generation_failed, timeout=10_000) as blocker:
        host.generate(GenerationRequest(messages=(Message("user", "hi"),)))
    assert "No model is loaded" in blocker.args[1]


def test_a_cancelled_load_reports_it_and_leaves_no_engine(qtbot: QtBot, make_host, tiny_target_path: Path) -> None:
    host = make_host()
    events = _load(qtbot, host, tiny_target_path, None)
    long = GenerationRequest(messages=(Message("user", "hello"),), max_new_tokens=1800, sampling=GREEDY)
    with qtbot.waitSignal(events.tokens_generated, timeout=60_000):
        host.generate(long)  # keeps the worker busy, so the load below waits in its queue
    load_id = host.load(str(tiny_target_path), "", LoadSettings(device="cpu"))
    host.cancel_load()  # the Cancel button, pressed before the load's first step
    with qtbot.waitSignal(events.load_failed, timeout=60_000) as blocker:
        host.cancel_generation()
    assert blocker.args == [load_id, "Loading was cancelled."]
    with qtbot.waitSignal(events.generation_failed, timeout=10_000):
        host.generate(long)


def test_the_loaded_signal_carries_the_context_and_budget_auto_is_chosen_in_the_worker(
        qtbot: QtBot, make_host, tiny_target_path: Path, tiny_draft_path: Path) -> None:
    """Budget "auto" travels as 0 and is chosen per request by AutoBudget in the worker (here no
    hardware profile: the fallback); the GUI hears the choice before the first token."""
    host = make_host()
    events = WorkerEvents(host)
    with qtbot.waitSignal(events.loaded, timeout=120_000) as loaded:
        host.load(str(tiny_target_path), str(tiny_draft_path), LoadSettings(device="cpu"))
    assert loaded.args[4] == 2048  # the tiny model's max_position_embeddings: the API server's limit
    request = GenerationRequest(messages=(Message("user", "hello"),), max_new_tokens=12, sampling=GREEDY,
                                speculation=SpeculationSettings(budget=0, max_depth=4))
    with qtbot.waitSignal(events.generation_finished, timeout=120_000) as blocker:
        request_id = host.generate(request)
    completion = blocker.args[1]
    choice = events.chosen[request_id]
    assert choice.source == "fallback" and "bench hardware" in choice.reason  # type: ignore[attr-defined]
    assert completion.stats.mode == "specexec" and completion.stats.budget == choice.budget  # type: ignore[attr-defined]
    with qtbot.waitSignal(events.generation_finished, timeout=120_000):
        fixed = host.generate(replace(request, speculation=SpeculationSettings(budget=8, max_depth=4)))
    assert fixed not in events.chosen  # a budget the user set is not "chosen"


def test_a_remote_error_is_one_warning_line_and_ids_come_from_one_counter(
        qtbot: QtBot, make_host, caplog: pytest.LogCaptureFixture) -> None:
    """A server that is not there is the user's condition, not a bug: the banner says what to do
    and the log gets one WARNING line, no traceback. The remote host draws its request ids from
    the engine host's counter: a page hears both workers and never sees one id twice."""
    host = make_host()
    remote = RemoteHost(ids=host.ids)
    try:
        events = WorkerEvents(remote)
        with socket.socket() as gone:
            gone.bind(("127.0.0.1", 0))
            port = gone.getsockname()[1]  # closed when the block ends: nothing listens there
        caplog.set_level(logging.INFO)
        with qtbot.waitSignal(events.generation_failed, timeout=30_000) as failed:
            request_id = remote.generate(GenerationRequest(messages=(Message("user", "hi"),)),
                                         RemoteModel(f"http://127.0.0.1:{port}/v1", "m", "", "box"))
        assert failed.args[0] == request_id and f"127.0.0.1:{port}" in failed.args[1]
        assert next(host.ids) == request_id + 1  # one counter for both hosts, no offsets
        records = [r for r in caplog.records if r.name.startswith("app.")]
        assert [(r.levelno, r.exc_info) for r in records] == [(logging.WARNING, None)]
        assert str(port) in records[0].getMessage() and "\n" not in records[0].getMessage()
    finally:
        remote.shutdown()


class _Busy(QObject):
    """A worker whose first request holds its thread until released; its second records."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release, self.ran = threading.Event(), threading.Event(), threading.Event()

    @Slot()
    def hold(self) -> None:
        self.started.set()
        self.release.wait(10)

    @Slot()
    def record(self) -> None:
        self.ran.set()


class _BusyHost(WorkerHost):
    _hold = Signal()
    _record = Signal()

    def __init__(self) -> None:
        super().__init__(_Busy(), "busy", join_on_quit=False)
        self._hold.connect(self.worker.hold)
        self._record.connect(self.worker.record)
        self._start()


def test_a_request_queued_before_shutdown_runs_even_while_the_worker_is_busy(qtbot: QtBot) -> None:
    """The app queues "save the conversations' caches" and then shuts the engine's thread down,
    often while the answer's slot is still finishing: the save must still run (a direct
    QThread.quit() dropped it, since events posted during a slot wait for the loop's next round)."""
    host = _BusyHost()
    worker = host.worker
    assert isinstance(worker, _Busy)
    host._hold.emit()
    assert worker.started.wait(10)
    host._record.emit()
    threading.Timer(0.3, worker.release.set).start()  # the slot ends while shutdown() waits
    assert host.shutdown(10_000)
    assert worker.ran.is_set()
