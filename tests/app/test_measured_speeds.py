"""Measured speeds in the app: every answer the real engine thread finishes is recorded for the
model, format and device it ran as; Settings -> Engine and its plot show what runs and what was
measured, not what the settings ask for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from chat_helpers import WorkerEvents
from pytestqt.qtbot import QtBot

from app.settings.dialog import SettingsDialog
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from app.state.running import RunningPair, running_pair
from app.workers.engine_worker import EngineHost
from engine.testing.synthetic import tiny_gguf
from engine.planning.measured import measured_speed, record_answer
from engine.store.pypi import STARTER_FOLDER_NAME, STARTER_GGUF_NAME
from engine.shapes import Placement
from engine.types import GenerationRequest, GenerationStats, LoadSettings, Message, SamplingSettings


def _answer(qtbot: QtBot, host: EngineHost, events: WorkerEvents, tokens: int = 12) -> None:
    request = GenerationRequest(messages=(Message("user", "hello"),), max_new_tokens=tokens,
                                sampling=SamplingSettings(temperature=0.0))
    with qtbot.waitSignal(events.generation_finished, timeout=120_000):
        host.generate(request)


def test_every_finished_answer_is_measured_for_the_model_and_format_that_ran(
        qtbot: QtBot, make_host: Callable[[], EngineHost], tmp_path: Path) -> None:
    gguf = tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=tmp_path / "built")
    host = make_host()
    events = WorkerEvents(host)
    with qtbot.waitSignal(events.loaded, timeout=120_000) as loaded:
        host.load(str(gguf), "", LoadSettings(device="cpu"))
    placement = loaded.args[3]
    assert measured_speed(gguf, None) is None
    for _ in range(3):
        _answer(qtbot, host, events)
    got = measured_speed(gguf, None, "cpu", "GGUF Q8_0")  # recorded before the answer's signal
    assert got is not None and got.answers == 3 and got.tokens_per_second > 0
    assert got.last_mode == "context"  # no draft: draft-free decoding ran

    running = running_pair(str(gguf), "", placement)
    assert running.fmt == "GGUF Q8_0" and running.measured() == got
    summary = running.summary()
    how = ("multiplied by the packed CPU kernel" if placement.resident_form == "kernel" else
           "de-quantised once, at load" if placement.resident_form == "dequantised" else "de-quantised as each layer runs")
    assert f"GGUF Q8_0 blocks, {how}, on the CPU" in summary
    assert "draft-free" in summary and "over 3 answers" in summary and "no draft" in summary


def test_settings_engine_says_what_runs_not_what_was_asked(
        qtbot: QtBot, make_prefs: Callable[..., PreferencesStore], tmp_path: Path) -> None:
    gguf = tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=tmp_path / "built")
    running = running_pair(str(gguf), "", Placement(1, 1, quant="gguf", device="cpu"))
    store = make_prefs(target=str(gguf), quant="none", tree_mode="specexec")
    dialog = SettingsDialog(store, running=running)
    qtbot.addWidget(dialog)
    text = dialog.running_label.text()
    assert "GGUF Q8_0" in text and "draft-free" in text and "not measured here yet" in text
    assert dialog.quant.currentText() != "None (16-bit)" and "GGUF blocks" in dialog.quant.currentText()
    assert "SpecExec" not in dialog.tree_mode.currentText() and "draft-free" in dialog.tree_mode.currentText()
    # the loaded model, though the catalog does not know it, has its entry in the plot's menu
    keys = [dialog.hardware.plot_pair.itemData(i) for i in range(dialog.hardware.plot_pair.count())]
    assert "loaded" in keys and dialog.hardware.plot_pair.currentData() == "loaded"

    nothing = SettingsDialog(store)
    qtbot.addWidget(nothing)
    assert "no model is loaded" in nothing.running_label.text()


def test_the_plot_lists_the_loaded_starter_with_its_measured_speed(
        qtbot: QtBot, make_prefs: Callable[..., PreferencesStore], tmp_path: Path) -> None:
    from engine.planning.measure import measure_hardware
    from engine.planning.profile import save_profile

    save_profile(measure_hardware(quick=True))
    folder = _tiny_starter_gguf(tmp_path)  # the starter's one GGUF, fetched
    running = RunningPair(str(folder), "", Placement(2, 2, quant="gguf", device="cpu", resident_form="kernel"),
                          "GGUF Q4_1")
    stats = GenerationStats(prompt_tokens=10, new_tokens=29, target_passes=29, tokens_per_pass=1.0, draft_passes=0,
                            budget=0, seconds=10.0, ttft_seconds=0.5, tokens_per_second=2.9, peak_rss_bytes=0,
                            mode="context")
    for _ in range(10):
        record_answer(running.key, stats)
    store = make_prefs(target=str(folder))
    dialog = SettingsDialog(store, running=running)
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.tabs.setCurrentIndex(4)
    assert dialog.hardware.plot_pair.currentData() == "starter" and "Starter" in dialog.hardware.plot_pair.currentText()
    assert dialog.hardware.plot.message() == ""  # a chart, not "no prediction"
    assert len(dialog.hardware.plot.points) == 1 and dialog.hardware.plot.points[0][0] == 1  # one token per pass
    assert dialog.hardware.plot.measured == 2.9
    assert "measured here: 2.9 tok/s over 10 answers" in dialog.hardware.plot.title()
    assert "measured here: 2.9 tok/s over 10 answers" in dialog.running_label.text()
    assert "Q4_1 GGUF, as shipped: its blocks multiplied by the packed CPU kernel, on the CPU" in \
        dialog.running_label.text()


def test_running_pair_words_the_decoding_mode() -> None:
    cpu = Placement(2, 2, quant="none", device="cpu")
    assert "plain decoding" in RunningPair("t", "", cpu, "FP32", tree_mode="autoregressive").decoding_text()
    with_draft = RunningPair("t", "d", cpu, "FP32")
    assert "SpecExec trees" in with_draft.decoding_text() and "turned off while" in with_draft.decoding_text()
    assert "turned off" not in replace(with_draft, keep_draft=True).decoding_text()
    assert Preferences().tree_mode == "specexec"


def _tiny_starter_gguf(tmp_path: Path) -> Path:
    """A real tiny Q4_1 GGUF where the starter's GGUF lives, as if fetched from PyPI."""
    built = tiny_gguf("llama", layers=2, layer_types=("Q4_1",), head_type="Q8_0", cache_dir=tmp_path / "built")
    gguf = tmp_path / "cache" / "starter" / STARTER_GGUF_NAME
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(built.read_bytes())
    return gguf


def test_the_window_runs_the_starter_gguf_and_tells_settings_and_the_models_page(
        qtbot: QtBot, make_host: Callable[[], EngineHost], make_prefs: Callable[..., PreferencesStore],
        tmp_path: Path) -> None:
    """An older wizard saved the starter by its catalog id and copied its GGUF into the models
    folder: the window loads the one starter GGUF instead, and what it loaded reaches Settings
    and the models page."""
    from app.main_window import MainWindow
    from app.state.conversations import ConversationStore, default_path
    from engine.store.registry import manifest_data, write_json_atomic

    folder = _tiny_starter_gguf(tmp_path)
    old = tmp_path / "models" / "smollm2-135m-instruct"
    old.mkdir(parents=True)
    (old / STARTER_GGUF_NAME).write_bytes(b"GGUF" + bytes(64))  # would fail to load if it were used
    write_json_atomic(old / "specchat-model.json", manifest_data(
        model_id="smollm2-135m-instruct", repo_id=None, source="pypi-wheel", path=STARTER_GGUF_NAME,
        revision=None, files=[{"name": STARTER_GGUF_NAME, "size": 68, "sha256": None}]))
    store = make_prefs(target="smollm2-135m-instruct", device="cpu")
    conversations = ConversationStore(default_path(tmp_path / "data"))
    window = MainWindow(store, conversations, host=make_host())
    qtbot.addWidget(window)
    window.show()
    try:
        qtbot.waitUntil(lambda: window.running is not None, timeout=120_000)
        assert window.running is not None and Path(window.running.target) == folder
        assert window.running.fmt == "GGUF Q4_1" and "Q4_1 GGUF, as shipped" in window.running.format_text()
        window.show_models()
        page = window.models_page
        assert page is not None and "Running:" in page.pair.active_label.text()  # type: ignore[attr-defined]
        assert "SmolLM2-135M-Instruct" in page.pair.active_label.text()  # type: ignore[attr-defined]
    finally:
        window.close()
        conversations.close()


def test_a_saved_choice_of_the_starter_fp32_folder_now_runs_its_gguf(
        qtbot: QtBot, make_host: Callable[[], EngineHost], make_prefs: Callable[..., PreferencesStore],
        tmp_path: Path, tiny_target_path: Path) -> None:
    """Older versions ran the starter's FP32 conversion and saved its folder in the preferences:
    the window saves and loads the GGUF in its place (the folder stays, for the proxy draft)."""
    from app.main_window import MainWindow
    from app.state.conversations import ConversationStore, default_path

    gguf = _tiny_starter_gguf(tmp_path)
    folder = tmp_path / "cache" / "starter" / STARTER_FOLDER_NAME
    folder.mkdir(parents=True)
    for f in tiny_target_path.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    store = make_prefs(target=str(folder), device="cpu")
    conversations = ConversationStore(default_path(tmp_path / "data"))
    window = MainWindow(store, conversations, host=make_host())
    qtbot.addWidget(window)
    window.show()
    try:
        qtbot.waitUntil(lambda: window.running is not None, timeout=120_000)
        assert window.running is not None and Path(window.running.target) == gguf
        assert store.load().target == str(gguf) and folder.is_dir()
    finally:
        window.close()
        conversations.close()
