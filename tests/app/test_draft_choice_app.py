"""The app shows which draft runs and why (issue 32): the status bar's pair field names the draft
the engine picked, its tooltip the reason and the candidates it passed over; the Models page's
draft combo offers "Automatic (recommended)", "None (draft-free)", the heads the target brings
(one that cannot draft for it greyed out, saying why), the self-draft at each width and the other
local models, and stores the choice in the preferences. `SPECCHAT_SCREENSHOT=FILE` saves the loaded window (a real engine
load with draft "auto") to FILE."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QStandardItemModel
from PySide6.QtWidgets import QApplication, QToolTip
from pytestqt.qtbot import QtBot

from app.main_window import MainWindow
from app.models.pair_box import DRAFT_CHOICES, PairBox
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from app.widgets.status import StatusBar
from app.workers.engine_worker import running_draft
from engine.decoding.draft_choice import Candidate, DraftChoice
from engine.decoding.draft_menu import DraftEntry
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
    mtp = DraftChoice("mtp", "MTP (1 layer, from the checkpoint)", None, "chosen by hand (--draft mtp)")
    assert running_draft("mtp", True, mtp) == mtp.label
    eagle = DraftChoice("assistant", "EAGLE-3 head (1 layer, x-eagle3)", None, "chosen by hand")
    assert running_draft("/models/x-eagle3", True, eagle) == eagle.label


def test_the_draft_combo_offers_the_engines_choices_and_stores_them(qtbot: QtBot) -> None:
    box = PairBox()
    qtbot.addWidget(box)
    heads = {"target-model": [DraftEntry("mtp", "MTP (1 layer, from the checkpoint)"),
                              DraftEntry("/m/target-eagle3", "EAGLE-3 head (1 layer, target-eagle3)"),
                              DraftEntry("/m/other-eagle3", "EAGLE-3 head (1 layer, other-eagle3)",
                                         "it was trained for a model 4096 wide, and this model is 576 wide")]}
    box.heads_for = lambda name: heads.get(name, [])
    box.show_pair(["target-model", "small-model", "target-eagle3"], "target-model", "auto", "", "")
    combo = box.draft_combo
    items = [(combo.itemText(i), combo.itemData(i)) for i in range(combo.count())]
    assert items == [("Automatic (recommended)", "auto"), ("None (draft-free)", ""), ("", None),
                     ("MTP (1 layer, from the checkpoint)", "mtp"),
                     ("EAGLE-3 head (1 layer, target-eagle3)", "/m/target-eagle3"),
                     ("EAGLE-3 head (1 layer, other-eagle3) (cannot be used)", "/m/other-eagle3"), ("", None),
                     ("Self-draft (bits sized to the memory left)", "self"), ("Self-draft, 4-bit", "self:4"),
                     ("Self-draft, 3-bit", "self:3"), ("Self-draft, 2-bit", "self:2"), ("", None),
                     ("small-model", "small-model")]  # the head's own folder is listed once, as the head
    assert combo.currentData() == "auto"
    model = combo.model()
    assert isinstance(model, QStandardItemModel)
    unusable = combo.findData("/m/other-eagle3")
    assert not model.item(unusable).isEnabled() and model.item(combo.findData("mtp")).isEnabled()
    assert "4096 wide" in combo.itemData(unusable, Qt.ItemDataRole.ToolTipRole)
    assert set(DRAFT_CHOICES.values()) == {"auto", "", "self", "self:4", "self:3", "self:2"}
    for spec in ("self:3", "mtp"):
        combo.setCurrentIndex(combo.findData(spec))
        with qtbot.waitSignal(box.use_requested) as used:
            box.use_button.click()
        assert used.args == ["target-model", spec]
    box.target_combo.setCurrentIndex(box.target_combo.findData("small-model"))  # no heads: none listed
    assert combo.findData("mtp") == -1 and combo.findData("/m/target-eagle3") == -1
    assert combo.findData("target-eagle3") >= 0 and combo.findData("self:2") >= 0
    box.show_pair(["small-model"], "small-model", "mtp", "", "")  # a preference this model cannot run
    assert combo.currentData() == "mtp" and "not in this model's files" in combo.currentText()
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
