"""Preferences round-trip through a real QSettings INI file and become the engine's settings."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QSettings
from pytestqt.qtbot import QtBot

from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from engine.types import LoadSettings, SamplingSettings


def _ini(path: Path) -> QSettings:
    return QSettings(str(path), QSettings.Format.IniFormat)


def test_defaults_when_nothing_stored(tmp_path: Path, qtbot: QtBot) -> None:
    assert PreferencesStore(_ini(tmp_path / "p.ini")).load() == Preferences()


def test_default_sampling_penalises_recent_repeats() -> None:
    """Without a penalty the small starter loops on a phrase; the default is LM Studio's and
    Ollama's 1.1 over the last 64 tokens."""
    sampling = Preferences().sampling()
    assert sampling.repetition_penalty == 1.1 and sampling.repetition_window == 64


def test_every_field_survives_a_new_store_on_the_same_file(tmp_path: Path, qtbot: QtBot) -> None:
    changed = Preferences(
        temperature=0.3, top_p=0.8, top_k=40, min_p=0.05, repetition_penalty=1.25,
        max_new_tokens=333, context_length=2048, device="cpu", quant="nf4", offload="all",
        budget=128, max_depth=8, tree_mode="autoregressive", models_dir=str(tmp_path / "m"),
        theme="dark", font_size=14, target="llama-3.1-70b-instruct", draft="llama-3.2-1b",
        first_run_done=True, system_presets=(("Pirate", "Talk like a pirate."), ("Empty", "")),
    )
    store = PreferencesStore(_ini(tmp_path / "p.ini"))
    with qtbot.waitSignal(store.changed) as blocker:
        store.save(changed)
    assert blocker.args == [changed]
    assert PreferencesStore(_ini(tmp_path / "p.ini")).load() == changed


def test_update_changes_only_named_fields(tmp_path: Path, qtbot: QtBot) -> None:
    store = PreferencesStore(_ini(tmp_path / "p.ini"))
    store.save(replace(Preferences(), font_size=13))
    saved = store.update(target="starter", draft="", first_run_done=True)
    assert saved == replace(Preferences(), font_size=13, target="starter", draft="", first_run_done=True)
    assert store.load() == saved


def test_unreadable_values_fall_back_one_field_at_a_time(tmp_path: Path, qtbot: QtBot) -> None:
    ini = tmp_path / "p.ini"
    ini.write_text(
        "[preferences]\ntemperature=warm\ntheme=purple\nfont_size=15\nfirst_run_done=true\n"
        "system_presets=not json\nbudget=96\n"
    )
    prefs = PreferencesStore(_ini(ini)).load()
    assert prefs == replace(Preferences(), font_size=15, first_run_done=True, budget=96)


def test_engine_settings() -> None:
    prefs = Preferences(temperature=0.5, top_p=0.95, top_k=20, min_p=0.1, repetition_penalty=1.2,
                        device="cpu", quant="nf4", offload="none", context_length=1024,
                        budget=0, max_depth=12, tree_mode="specexec")
    assert prefs.sampling(seed=3) == SamplingSettings(
        temperature=0.5, top_k=20, top_p=0.95, min_p=0.1, repetition_penalty=1.2, seed=3)
    assert prefs.load_settings() == LoadSettings(device="cpu", quant="nf4", offload="none", context_length=1024)
    auto = prefs.speculation()  # budget "auto" travels as 0: AutoBudget chooses per request, in the worker
    assert (auto.mode, auto.budget, auto.max_depth) == ("specexec", 0, 12)
    assert prefs.speculation().switch_draft and not replace(prefs, keep_draft=True).speculation().switch_draft
    assert not prefs.speculation(switch_draft=False).switch_draft  # the wizard's calibration measures trees
    assert replace(prefs, budget=32).speculation().budget == 32


def test_models_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECCHAT_MODELS_DIR", str(tmp_path / "env-models"))
    assert Preferences().models_path() == tmp_path / "env-models"
    assert Preferences(models_dir=str(tmp_path / "mine")).models_path() == tmp_path / "mine"


def test_the_models_folder_chosen_in_the_app_is_the_clis(tmp_path: Path, qtbot: QtBot,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's choice goes to the settings file the CLI reads too (engine.paths.models_dir)."""
    import subprocess
    import sys

    from engine import paths

    monkeypatch.delenv("SPECCHAT_MODELS_DIR", raising=False)
    chosen = tmp_path / "my models"
    store = PreferencesStore(_ini(tmp_path / "p.ini"))
    store.update(models_dir=str(chosen))
    assert paths.models_dir() == chosen == store.load().models_path()
    cli = subprocess.run([sys.executable, "-c", "from engine.store import default_models_dir; "
                          "print(default_models_dir())"], capture_output=True, text=True, check=True)
    assert cli.stdout.strip() == str(chosen)  # a fresh process, as the CLI is
    paths.settings_file().write_text('{"models_dir": ["not", "a", "path"]}')  # a damaged file: ignored
    assert paths.models_dir() == paths.data_dir() / "models"
    store.update(models_dir="")  # back to the default, for both
    assert paths.shared_setting("models_dir") == "" and paths.models_dir() == paths.data_dir() / "models"
