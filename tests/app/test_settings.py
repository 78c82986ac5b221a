"""The settings dialog saves into a real QSettings INI file; the benchmark runs in a real thread."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import (
    QAbstractButton,
    QComboBox,
    QDialogButtonBox,
    QLineEdit,
    QSpinBox,
)
from pytestqt.qtbot import QtBot

from app.settings.dialog import SettingsDialog
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from engine import paths

pytest_plugins = ("pages_fixtures",)  # app_env, prefs_store fixtures


def open_dialog(qtbot: QtBot, store: PreferencesStore, **kwargs: object) -> SettingsDialog:
    dialog = SettingsDialog(store, **kwargs)  # type: ignore[arg-type]
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def test_settings_persist_across_restarts(qtbot: QtBot, prefs_store: PreferencesStore, app_env: Path) -> None:
    prefs_store.save(replace(Preferences(), target="smollm2-135m-instruct", first_run_done=True))
    dialog = open_dialog(qtbot, prefs_store)
    dialog.temperature.setValue(0.25)
    dialog.top_p.setValue(0.8)
    dialog.top_k.setValue(40)
    dialog.min_p.setValue(0.05)
    dialog.repetition_penalty.setValue(1.15)
    dialog.max_new_tokens.setValue(512)
    dialog.context_length.setValue(8192)
    dialog.device.setCurrentIndex(dialog.device.findData("cpu"))
    dialog.offload.setCurrentIndex(dialog.offload.findData("none"))
    dialog.budget_auto.setChecked(False)
    assert dialog.budget.isEnabled()
    dialog.budget.setValue(96)
    dialog.max_depth.setValue(10)
    dialog.tree_mode.setCurrentIndex(dialog.tree_mode.findData("autoregressive"))
    dialog.keep_draft.setChecked(True)
    dialog.models_dir.setText(str(app_env / "elsewhere"))
    dialog.theme.setCurrentIndex(dialog.theme.findData("dark"))
    dialog.font_size.setValue(14)
    with qtbot.waitSignal(prefs_store.changed) as saved:
        qtbot.mouseClick(dialog.buttons.button(QDialogButtonBox.StandardButton.Ok), _left())

    expected = replace(
        Preferences(), temperature=0.25, top_p=0.8, top_k=40, min_p=0.05, repetition_penalty=1.15,
        max_new_tokens=512, context_length=8192, device="cpu", offload="none", budget=96, max_depth=10,
        tree_mode="autoregressive", keep_draft=True, models_dir=str(app_env / "elsewhere"), theme="dark",
        font_size=14, target="smollm2-135m-instruct", first_run_done=True,  # kept: not edited here
    )
    assert saved.args == [expected]
    # A new store on the same file (the app restarted) reads the same, and a new dialog shows it.
    reopened = PreferencesStore(QSettings(str(app_env / "specchat.ini"), QSettings.Format.IniFormat))
    assert reopened.load() == expected
    again = open_dialog(qtbot, reopened)
    assert again.preferences() == expected
    assert not again.budget_auto.isChecked() and again.budget.value() == 96
    assert again.theme.currentData() == "dark"


def test_cancel_discards_and_defaults_restore(qtbot: QtBot, prefs_store: PreferencesStore) -> None:
    prefs_store.save(replace(Preferences(), font_size=13, budget=128))
    dialog = open_dialog(qtbot, prefs_store)
    dialog.font_size.setValue(20)
    qtbot.mouseClick(dialog.buttons.button(QDialogButtonBox.StandardButton.Cancel), _left())
    assert prefs_store.load().font_size == 13

    dialog = open_dialog(qtbot, prefs_store)
    qtbot.mouseClick(dialog.buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults), _left())
    assert dialog.budget_auto.isChecked() and not dialog.budget.isEnabled()
    dialog.accept()
    assert prefs_store.load() == Preferences()


def test_system_prompt_presets_are_edited_and_saved(qtbot: QtBot, prefs_store: PreferencesStore) -> None:
    dialog = open_dialog(qtbot, prefs_store)
    dialog.tabs.setCurrentIndex(3)
    before = dialog.presets.rowCount()
    dialog._add_preset("Pirate", "Talk like a pirate.")
    dialog.presets.selectRow(0)
    dialog._on_remove_preset_clicked()
    dialog.accept()
    presets = prefs_store.load().system_presets
    assert len(presets) == before and presets[-1] == ("Pirate", "Talk like a pirate.")
    assert presets[0] == Preferences().system_presets[1]


def test_every_control_has_an_accessible_name(qtbot: QtBot, prefs_store: PreferencesStore) -> None:
    dialog = open_dialog(qtbot, prefs_store)
    unnamed = []
    for index in range(dialog.tabs.count()):
        dialog.tabs.setCurrentIndex(index)
        for kind in (QAbstractButton, QComboBox, QLineEdit, QSpinBox):
            for w in dialog.tabs.currentWidget().findChildren(kind):
                if not w.accessibleName() and not isinstance(w.parent(), (QComboBox, QSpinBox)) \
                        and not w.objectName().startswith("qt_"):
                    unnamed.append(w)
    assert unnamed == []


def _left():  # type: ignore[no-untyped-def]
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def test_benchmark_runs_in_a_thread_then_the_plot_shows_predictions(
    qtbot: QtBot, prefs_store: PreferencesStore, app_env: Path,
) -> None:
    import torch

    from engine.planning import planner
    from engine.planning.profile import load_profile
    from engine.store import load_catalog

    torch.set_num_threads(1)
    dialog = open_dialog(qtbot, prefs_store, benchmark_options={"quick": True})
    dialog.tabs.setCurrentIndex(4)
    assert load_profile() is None
    assert "Benchmark needed" in dialog.hardware.plot.message() and "No hardware profile" in dialog.hardware.profile_text.toPlainText()

    with qtbot.waitSignal(dialog.hardware.runner.finished, timeout=180_000):
        qtbot.mouseClick(dialog.hardware.benchmark_button, _left())
        assert not dialog.hardware.benchmark_button.isEnabled() and dialog.hardware.cancel_benchmark_button.isEnabled()
    assert dialog.hardware.benchmark_bar.value() == 1000 and dialog.hardware.benchmark_button.isEnabled()
    profile = load_profile()
    assert profile is not None  # saved by the worker
    assert profile.summary_lines()[1] in dialog.hardware.profile_text.toPlainText()

    # The plot is the planner's curve for the selected pair, on the measured profile.
    catalog = load_catalog()
    pair = catalog.pair(dialog.hardware.plot_pair.currentData())
    assert pair is not None
    expected = planner.predict_curve(profile, catalog.find(pair.target), catalog.find(pair.draft))
    assert dialog.hardware.plot.message() == "" and dialog.hardware.plot.points == [(b, t) for b, t in expected]
    dialog.hardware.plot_pair.setCurrentIndex(1)  # another pair redraws
    other = catalog.pair(dialog.hardware.plot_pair.currentData())
    assert dialog.hardware.plot.points == planner.predict_curve(profile, catalog.find(other.target), catalog.find(other.draft))

    # A second run can be stopped; the saved profile stays.
    with qtbot.waitSignal(dialog.hardware.runner.cancelled, timeout=60_000):
        dialog.hardware.start_benchmark()
        qtbot.mouseClick(dialog.hardware.cancel_benchmark_button, _left())
    assert "Stopped" in dialog.hardware.benchmark_status.text() and load_profile() == profile
    dialog.reject()


def test_this_computer_names_the_version_and_pytorch_build(qtbot: QtBot, prefs_store: PreferencesStore) -> None:
    import importlib.metadata as metadata

    dialog = open_dialog(qtbot, prefs_store)
    text = dialog.hardware.about.text()
    assert f"SpecChat {metadata.version('specchat')}" in text
    assert f"PyTorch {metadata.version('torch')}" in text and "build)" in text
    assert str(paths.data_dir()) in text


def test_the_hugging_face_token_field_saves_where_hf_tools_read_it(
        qtbot: QtBot, prefs_store: PreferencesStore, app_env: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from huggingface_hub import constants, get_token
    from PySide6.QtCore import Qt

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(app_env / "hf" / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    dialog = open_dialog(qtbot, prefs_store)
    tab = dialog.hub_tab
    dialog.tabs.setCurrentWidget(tab)
    assert "meta-llama/" in tab.licences.text()  # the gated catalog models' licence pages
    assert "No token" in tab.status.text() and not tab.forget_button.isEnabled()
    qtbot.keyClicks(tab.token, "not a token")
    qtbot.keyClick(tab.token, Qt.Key.Key_Return)
    assert "not a Hugging Face token" in tab.status.text() and get_token() is None
    tab.token.setText("hf_" + "x1" * 16)
    qtbot.mouseClick(tab.save_button, Qt.MouseButton.LeftButton)
    assert get_token() == "hf_" + "x1" * 16 and tab.token.text() == "" and tab.forget_button.isEnabled()
    qtbot.mouseClick(tab.forget_button, Qt.MouseButton.LeftButton)
    assert get_token() is None and "No token" in tab.status.text()


def test_the_plot_labels_small_speeds_and_keeps_its_points_inside(qtbot: QtBot) -> None:
    from app.settings.plot import BudgetPlot, label_format

    for top in (0.012, 0.04, 0.3, 3.0, 30.0):  # every tick label differs from the next
        ticks = [label_format(top) % (top * i / 5) for i in range(6)]
        assert len(set(ticks)) == 6, (top, ticks)
    plot = BudgetPlot()
    qtbot.addWidget(plot)
    points = [(8, 0.011), (32, 0.026), (128, 0.031), (512, 0.024)]
    plot.set_curve(points, chosen=128)
    x_axis, y_axis = plot._chart.axes(Qt.Orientation.Horizontal)[0], plot._chart.axes(Qt.Orientation.Vertical)[0]
    assert x_axis.min() < 8 and x_axis.max() > 512 and y_axis.max() > 0.031  # no point on an edge
    assert y_axis.labelFormat() != "%.1f"


def test_every_setting_explains_itself(qtbot: QtBot, prefs_store: PreferencesStore) -> None:
    dialog = open_dialog(qtbot, prefs_store)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "budget", "max_depth", "offload",
                 "quant", "device", "tree_mode"):
        widget = getattr(dialog, name)
        tip = widget.toolTip()
        assert len(tip.split()) >= 8 and tip.lower() != widget.accessibleName().lower(), name


def test_the_plot_offers_a_draft_free_catalog_pair_without_a_draft(prefs_store: PreferencesStore, app_env: Path) -> None:
    from app.settings.plot_entries import plot_entries
    from engine.store import load_catalog

    catalog = load_catalog()
    entries = {e.key: e for e in plot_entries(catalog, prefs_store.load(), None)}
    assert set(entries) >= {p.id for p in catalog.pairs}  # every pair, draft-free ones too
    entry = entries["qwen3.6-27b-draft-free"]
    assert entry.target is not None and entry.target.id == "qwen3.6-27b" and entry.draft is None
    assert not entry.active and entry.measured is None  # nothing of it is here
    assert entry.curve(None, "auto") == ([], None)  # no profile, no prediction
