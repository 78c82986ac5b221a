"""The app shows which draft runs and why (issue 32): the status bar's pair field names the draft
the engine picked, its tooltip the reason and the candidates it passed over; the Models page's
draft combo offers "Automatic (recommended)", "None (draft-free)" and "Self-draft" and stores
them in the preferences. `SPECCHAT_SCREENSHOT=FILE` saves the loaded window (a real engine
load with draft "auto") to FILE."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QPoint
from PySide6.QtWidgets import QApplication, QToolTip
from pytestqt.qtbot import QtBot

from app.main_window import MainWindow
from app.models.pair_box import DRAFT_CHOICES, PairBox
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from app.widgets.status import StatusBar
from app.workers.engine_worker import running_draft
from engine.decoding.draft_choice import Candidate, DraftChoice
from engine.shapes import Placement

SELF = DraftChoice("self", "self-draft, 3-bit (54 of 80 layers)", 11.2,
                   "predicted fastest: 11.20 tok/s at budget 256 against 0.86 tok/s draft-free (SubSpec's prior)",
                   (Candidate("catalog", "llama-3.2-1b-instruct", 5.1, "5.10 tok/s, slower than the chosen draft"),
                    Candidate("none", "none (draft-free)", 0.86, "0.86 tok/s: slower than self-draft")), bits=3)
STREAMED = Placement(80, 26, 54, 0, 481_305_600, "nf4", "cuda:0")


def test_the_status_bar_names_the_draft_and_says_why(qtbot: QtBot) -> None:
    bar = StatusBar()
    qtbot.addWidget(bar)
    bar.show_pair("/models/Llama-3.3-70B-Instruct", SELF.label, STREAMED, SELF)
    assert "draft: self-draft, 3-bit (54 of 80 layers)" in bar.pair.text()
    tip = bar.pair.toolTip()
    assert "Why: predicted fastest: 11.20 tok/s" in tip and "picked by the engine" in tip
    assert "Not chosen:" in tip and "llama-3.2-1b-instruct: 5.10 tok/s" in tip
    assert bar.has_draft
    none = DraftChoice("none", "none (draft-free)", None, "no hardware profile (...), and no draft can run here")
    bar.show_pair("/models/tiny", "", None, none)
    assert "draft-free" in bar.pair.text() and not bar.has_draft
    assert "no draft can run here" in bar.pair.toolTip()


def test_the_worker_names_the_draft_that_runs() -> None:
    assert running_draft("auto", False, SELF) == ""
    assert running_draft("auto", True, SELF) == SELF.label
    assert running_draft("self:3", True, SELF) == SELF.label
    assert running_draft("/models/draft", True, None) == "/models/draft"


def test_the_draft_combo_offers_the_engines_choices_and_stores_them(qtbot: QtBot) -> None:
    box = PairBox()
    qtbot.addWidget(box)
    box.show_pair(["target-model", "small-model"], "target-model", "auto", "", "")
    items = [(box.draft_combo.itemText(i), box.draft_combo.itemData(i)) for i in range(box.draft_combo.count())]
    assert items == [("Automatic (recommended)", "auto"), ("None (draft-free)", ""), ("Self-draft", "self"),
                     ("small-model", "small-model")]
    assert box.draft_combo.currentData() == "auto"
    assert set(DRAFT_CHOICES.values()) == {"auto", "", "self"}
    box.draft_combo.setCurrentIndex(box.draft_combo.findData("self"))
    with qtbot.waitSignal(box.use_requested) as used:
        box.use_button.click()
    assert used.args == ["target-model", "self"]
    assert Preferences().draft == "auto"  # the engine picks unless the user chose


def test_a_loaded_window_shows_the_draft_the_engine_picked(
        qtbot: QtBot, open_window: Callable[..., MainWindow], make_prefs: Callable[..., PreferencesStore],
        tiny_target_path: Path) -> None:
    prefs = make_prefs(target=str(tiny_target_path), draft="auto", device="cpu")
    window = open_window(prefs)
    pair = window.status.pair
    qtbot.waitUntil(lambda: "draft-free" in pair.text(), timeout=5000)
    tip = pair.toolTip()
    assert "Draft: none (draft-free), picked by the engine" in tip
    assert "self-draft" in tip  # the candidates it passed over, each with its reason
    shot = os.environ.get("SPECCHAT_SCREENSHOT")
    if shot:  # the window with the pair field's tooltip open (the whole screen under Xvfb)
        window.move(0, 0)
        window.resize(1180, 720)
        qtbot.wait(300)
        QToolTip.showText(pair.mapToGlobal(QPoint(20, 0)), tip, pair)
        qtbot.wait(500)
        screen = QApplication.primaryScreen().grabWindow(0, 0, 0, window.width(), window.height())
        (window.grab() if screen.isNull() or QApplication.platformName() == "offscreen" else screen).save(shot)
