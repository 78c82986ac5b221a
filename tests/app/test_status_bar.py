"""The status bar (issue 26 item 7): every field fits at the default width, figures do not
outlive their answer's model, and the mode says why a loaded draft is not used.

The window is a real MainWindow (no model: nothing loads); the texts are those of a 70B pair
streamed to a GPU, the longest the status bar shows.
"""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QLabel
from pytestqt.qtbot import QtBot

from app.main_window import MainWindow
from app.widgets.field_row import ElidedLabel, FieldRow
from app.widgets.status import ModeContext, StatusBar, mode_text
from engine.decoding.auto_budget import BudgetChoice
from engine.shapes import Placement
from engine.types import GenerationStats

TARGET = "/home/ann/.local/share/specchat/models/Llama-3.1-70B-Instruct"
DRAFT = "/home/ann/.local/share/specchat/models/Llama-3.2-1B-Instruct"
ON_GPU = Placement(80, 18, 62, 0, device="cuda")
API_IDLE = "API: 127.0.0.1:8765"
API_BUSY = "API: 1 request waiting for the chat"


def _stats(mode: str = "context", **fields: object) -> GenerationStats:
    base = dict(prompt_tokens=2345, new_tokens=300, target_passes=88, tokens_per_pass=3.41, draft_passes=500,
                budget=128, seconds=103.0, ttft_seconds=5.02, tokens_per_second=2.9, peak_rss_bytes=0,
                mode=mode, placement=ON_GPU, cached_tokens=1234)
    return GenerationStats(**{**base, **fields})  # type: ignore[arg-type]


@pytest.fixture
def window(qtbot: QtBot, make_prefs, open_window) -> MainWindow:  # type: ignore[no-untyped-def]
    win = open_window(make_prefs(), wait_loaded=False)
    qtbot.waitExposed(win)
    return win


def _fill(win: MainWindow, api: str) -> StatusBar:
    bar = win.status
    bar.show_pair(TARGET, DRAFT, ON_GPU)
    bar.show_stats(_stats(), ModeContext(auto_budget=True, has_draft=True))
    bar.show_api(api)
    return bar


def _painted(label: QLabel) -> str:
    """What the label draws at its width (an ElidedLabel elides; a plain QLabel clips)."""
    shown = getattr(label, "shown_text", None)
    if shown is not None:
        return shown()
    return label.text() if label.contentsRect().width() >= label.fontMetrics().horizontalAdvance(label.text()) else "…"


def _resize(qtbot: QtBot, win: MainWindow, width: int) -> None:
    win.resize(width, 700)
    qtbot.waitUntil(lambda: win.width() == width, timeout=5_000)
    qtbot.wait(20)


@pytest.mark.parametrize("api", ["", API_IDLE])
def test_every_field_is_whole_at_the_default_width(qtbot: QtBot, window: MainWindow, api: str) -> None:
    bar = _fill(window, api)
    _resize(qtbot, window, 1180)
    fields = [bar.speed, bar.per_pass, bar.ttft, bar.budget, bar.placement]
    assert [_painted(f) for f in fields] == [f.text() for f in fields]
    assert bar.ttft.text() == "first token 5.02 s" and "1,234 of 2,345 prompt tokens reused" in bar.ttft.toolTip()
    assert bar.placement.text() == "18 of 80 layers on GPU" and "62 in RAM" in bar.placement.toolTip()
    assert _painted(bar.pair).startswith("Llama-3.1-70B-Instruct + ")  # the target whole; the draft's name may go
    assert "Llama-3.2-1B-Instruct" in bar.pair.toolTip()


@pytest.mark.parametrize(("width", "api"), [(1180, API_BUSY), (800, ""), (800, API_IDLE)])
def test_narrower_fields_give_way_in_order_and_the_figures_never_elide(qtbot: QtBot, window: MainWindow,
                                                                         width: int, api: str) -> None:
    bar = _fill(window, api)
    _resize(qtbot, window, width)
    assert [_painted(bar.speed), _painted(bar.per_pass)] == ["2.9 tok/s", "3.41 tok/pass"]
    if width == 1180:  # the busy API field is long: the shorter wordings come, nothing is cut
        assert [_painted(f) for f in (bar.pair, bar.placement, bar.ttft, bar.budget)] == \
            ["Llama-3.1-70B-Instruct + draft", "18/80 on GPU", "first token 5.02 s", "draft off"]
    else:
        assert _painted(bar.budget) == "draft off" and _painted(bar.placement) == "18/80 on GPU"
        assert _painted(bar.ttft).endswith("5.02 s")  # the figure stays in sight
    assert window.width() == width and window.minimumSizeHint().width() <= 640  # nothing widens the window


def test_figures_go_with_their_model(qtbot: QtBot, window: MainWindow) -> None:
    bar = _fill(window, "")
    bar.show_no_model()
    assert [f.text() for f in bar.figures] == ["", "", "", ""] and bar.pair.text() == "No model loaded"
    _fill(window, "")
    bar.show_no_model("Loading Llama-3.3-70B-Instruct…")
    assert [f.text() for f in bar.figures] == ["", "", "", ""]
    _fill(window, "")
    bar.show_pair(DRAFT, "", ON_GPU)  # another pair loaded
    assert [f.text() for f in bar.figures] == ["", "", "", ""] and not bar.has_draft


def test_an_moe_with_its_experts_on_the_cpu_says_where_they_are(qtbot: QtBot, window: MainWindow) -> None:
    """Issue 31: "experts: x % in VRAM, rest on CPU" (no expert is cached in VRAM yet: 0 %)."""
    split = Placement(48, 48, 0, 0, quant="gguf", device="cuda:0", resident_form="experts-cpu")
    bar = window.status
    bar.show_pair(TARGET, "", split)
    assert bar.placement.text() == "experts: 0 % in VRAM, rest on CPU"
    assert "all 48 layers on GPU, experts: 0 % in VRAM, rest on CPU (GGUF blocks)." in bar.placement.toolTip()


def _off(reason: str) -> BudgetChoice:
    return BudgetChoice(False, 64, 16, "planner", reason, 9.0)


def _on(budget: int, reason: str) -> BudgetChoice:
    return BudgetChoice(True, budget, 16, "planner", reason, 30.0)


@pytest.mark.parametrize(("stats", "context", "text", "why"), [
    (_stats("specexec", budget=64), ModeContext(auto_budget=True, has_draft=True), "budget: auto (64)", "tree budget"),
    (_stats("specexec", budget=8), ModeContext(has_draft=True), "budget: 8", "tree budget"),
    (_stats("context"), ModeContext(has_draft=False), "draft-free", "no draft model"),
    (_stats("context"), ModeContext(has_draft=True), "draft off (slower)", "measured slower"),
    (_stats("autoregressive"), ModeContext(has_draft=True, setting="autoregressive"), "plain (Settings)",
     "Settings > Engine > Mode"),
    (_stats("autoregressive", oom_retries=2), ModeContext(has_draft=True), "plain (out of memory)",
     "ran out of memory"),
    (_stats("autoregressive"), ModeContext(auto_budget=True, has_draft=True, choice=_off("the draft costs 40 %")),
     "plain (faster)", "the draft costs 40 %"),
    # budget auto found the draft does not pay: AutoBudget decodes draft-free (context candidates),
    # and the field says so, not that the engine measured the draft slower
    (_stats("context"), ModeContext(auto_budget=True, has_draft=True, choice=_off("the draft costs 40 %")),
     "draft off (auto)", "budget auto left the draft out"),
    (_stats("specexec", budget=128), ModeContext(auto_budget=True, has_draft=True, choice=_on(128, "trees pay")),
     "budget: auto (128)", "trees pay"),
    (_stats("autoregressive"), ModeContext(), "no speculation", "one token per pass"),
])
def test_the_mode_says_why_a_draft_is_not_used(stats: GenerationStats, context: ModeContext, text: str,
                                               why: str) -> None:
    shown, short, tip = mode_text(stats, context)
    assert shown == text and why in tip and len(short) <= len(shown)


def test_a_draft_beside_plain_decoding_shows_the_reason_in_the_bar(qtbot: QtBot, window: MainWindow) -> None:
    bar = window.status
    bar.show_pair(TARGET, DRAFT, ON_GPU)
    bar.show_stats(_stats("autoregressive", tokens_per_pass=1.0),
                   ModeContext(auto_budget=True, has_draft=True, choice=_off("plain decoding predicted 1.4x faster")))
    assert bar.budget.text() == "plain (faster)" and "1.4x faster" in bar.budget.toolTip()
    assert bar.per_pass.text() == "1.00 tok/pass"


def test_a_row_gives_way_in_the_order_set(qtbot: QtBot) -> None:
    row = FieldRow()
    qtbot.addWidget(row)
    a, b, c = (ElidedLabel() for _ in range(3))
    row.add_left(a)
    row.add_right(b, c)
    a.set_text("a long model name that can go", "a long…")
    b.set_text("first token 5.02 s", "1st token 5.02 s")
    c.set_text("2.9 tok/s")
    c.keep_width = True
    row.give_way([(a, "short"), (b, "short"), (a, "min"), (b, "min"), (c, "min")])
    row.show()
    full = row.sizeHint().width()
    for width, expect in ((full, ("a long model name that can go", "first token 5.02 s")),
                          (full - 60, ("a long…", "first token 5.02 s"))):
        row.resize(width, row.sizeHint().height())
        qtbot.wait(10)
        assert (a.shown_text(), b.shown_text(), c.shown_text()) == (*expect, "2.9 tok/s")
    row.resize(row.minimumSizeHint().width(), row.sizeHint().height())
    qtbot.wait(10)
    assert c.shown_text() == "2.9 tok/s" and a.shown_text().endswith("…")
