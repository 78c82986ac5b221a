"""The status bar (model pair, where the weights live, tok/s, tokens per pass, time to first
token, budget; a cancellable load progress bar) and the dismissable error banner.

Every field is an `ElidedLabel`: it asks for its text's width but takes less, ending in "…" (the
full text in its tooltip), so a long model name or loading message never widens the window.
Each field's tooltip explains it in a sentence."""

from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QPainter, QPaintEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QStatusBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.types import GenerationStats, LoadProgress, Placement

from .logfile import current_log_file

TOKENS_PER_PASS_TIP = ("Answer tokens per pass over the big model's weights. Plain decoding makes 1; with "
                       "speculation each pass checks a tree of the draft's guesses and keeps every one the big "
                       "model agrees with, so a good draft makes several.")
BUDGET_TIP = ("The tree budget: how many draft tokens the big model checks in one pass. A bigger tree keeps more "
              "tokens per pass but makes each pass slower; auto lets the planner pick the fastest for this computer.")


def short_paths(text: str) -> str:
    """`text` with every file path cut to its last part ("loading /home/…/models/x on cpu" ->
    "loading x on cpu"): a raw path in a status line says little and cuts the rest off."""
    return _PATH.sub(lambda m: re.split(r"[\\/]", m.group(0).rstrip("\\/"))[-1] or m.group(0), text)


_PATH = re.compile(r"(?:[A-Za-z]:[\\/]|/)[^\s]*[\\/][^\s]+")


def short_name(spec: str) -> str:
    """A model spec (catalog id, repo id or path) as a short readable name."""
    if not spec:
        return ""
    path = Path(spec)
    if path.is_absolute() or spec.startswith(("~", ".")):
        return path.stem if path.suffix.lower() == ".gguf" else path.name
    return spec.rsplit("/", 1)[-1]


class ElidedLabel(QLabel):
    """A one-line label that shrinks below its text's width by eliding it (see the module)."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), self.fontMetrics().horizontalAdvance("0000…")), hint.height())

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802
        rect = self.contentsRect()
        shown = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, rect.width())
        painter = QPainter(self)
        painter.setPen(self.palette().color(self.foregroundRole()))
        painter.drawText(rect, int(self.alignment() | Qt.AlignmentFlag.AlignVCenter), shown)


def budget_text(budget: int, auto: bool) -> str:
    if budget <= 0:
        return "budget: —"
    return f"budget: auto ({budget})" if auto else f"budget: {budget}"


class StatusBar(QStatusBar):
    """Signals: load_cancel_requested()."""

    load_cancel_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setSizeGripEnabled(False)
        self.pair = self._field("No model loaded", "Model pair", "The target model and its draft")
        self.placement = self._field("", "Where the weights live",
                                     "Where the target's layers live: layers on the GPU run at full speed, the "
                                     "others are streamed from RAM (or disk) for every pass")
        # the two figures a user watches never elide (they are short); the long fields give way
        self.speed = self._field("", "Tokens per second", "Tokens of answer written per second", elide=False)
        self.per_pass = self._field("", "Tokens per target pass", TOKENS_PER_PASS_TIP, elide=False)
        self.ttft = self._field("", "Time to first token",
                                "Seconds from sending until the first token: mostly reading the conversation. "
                                "Reused prompt tokens were already read in an earlier turn and cost nothing now.")
        self.budget = self._field("", "Speculation budget", BUDGET_TIP)
        for label in (self.pair, self.placement):
            self.addWidget(label)
        for label in (self.speed, self.per_pass, self.ttft, self.budget):
            self.addPermanentWidget(label)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Loading progress")
        self.progress.setRange(0, 1000)
        self.progress.setMaximumWidth(220)
        self.progress.setTextVisible(False)
        self.progress_text = self._field("", "Loading status", "")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName("Cancel loading")
        self.cancel_button.clicked.connect(self.load_cancel_requested)
        for widget in (self.progress_text, self.progress, self.cancel_button):
            self.addWidget(widget)
            widget.hide()

    def _field(self, text: str, name: str, tip: str, elide: bool = True) -> QLabel:
        label = ElidedLabel(text) if elide else QLabel(text)
        label.setObjectName("statusField")
        label.setAccessibleName(name)
        label.setToolTip(tip)
        label.setProperty("tip", tip)
        return label

    @staticmethod
    def _set(label: QLabel, text: str) -> None:
        """Set a field's text; its tooltip is its explanation, then the text in full."""
        label.setText(text)
        tip = label.property("tip") or ""
        label.setToolTip(f"{text}\n{tip}".strip() if text and tip else text or tip)

    # ---- model ---------------------------------------------------------------------------
    def show_pair(self, target: str, draft: str, placement: Placement | None) -> None:
        pair = short_name(target) + (f" + {short_name(draft)} draft" if draft else " (no draft)")
        self.pair.setText(pair)
        self.pair.setToolTip(f"Target: {target}\nDraft: {draft or 'none (plain decoding)'}")
        self._set(self.placement, placement.describe() if placement is not None else "")

    def show_no_model(self, text: str = "No model loaded") -> None:
        self._set(self.pair, text)
        self._set(self.placement, "")

    def show_load_progress(self, progress: LoadProgress) -> None:
        for widget in (self.progress_text, self.progress, self.cancel_button):
            widget.show()
        self.progress.setValue(int(max(0.0, min(1.0, progress.fraction)) * 1000))
        if progress.stage == "starter" or progress.fraction <= 0.0:
            self.progress.setRange(0, 0)  # busy indicator until real fractions come
        else:
            self.progress.setRange(0, 1000)
        self._set(self.progress_text, short_paths(progress.message) or f"Loading the {progress.stage}…")

    def hide_load_progress(self) -> None:
        for widget in (self.progress_text, self.progress, self.cancel_button):
            widget.hide()

    # ---- generation ----------------------------------------------------------------------
    def begin_answer(self) -> None:
        """A new answer: the last one's figures go (they would read as this one's)."""
        for label in (self.speed, self.per_pass, self.budget):
            self._set(label, "")
        self._set(self.ttft, "first token …")

    def show_first_token(self, seconds: float) -> None:
        self._set(self.ttft, f"first token {seconds:.2f} s")

    def show_live(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self._set(self.speed, f"{tokens / seconds:.1f} tok/s")

    def show_stats(self, stats: GenerationStats, auto_budget: bool) -> None:
        self._set(self.speed, f"{stats.tokens_per_second:.1f} tok/s")
        self._set(self.per_pass, f"{stats.tokens_per_pass:.2f} tokens/pass")
        reused = f", {stats.cached_tokens:,} of {stats.prompt_tokens:,} prompt tokens reused" if stats.cached_tokens else ""
        self._set(self.ttft, f"first token {stats.ttft_seconds:.2f} s{reused}")
        mode = {"specexec": budget_text(stats.budget, auto_budget), "context": "draft-free (text from the context)"}
        self._set(self.budget, mode.get(stats.mode, "no speculation"))
        if stats.placement is not None:
            self._set(self.placement, stats.placement.describe())


class ErrorBanner(QFrame):
    """A dismissable one-message banner above the chat (errors never open a modal dialog)."""

    dismissed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("errorBanner")
        self.setAccessibleName("Error")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        self.label = QLabel("")
        self.label.setWordWrap(True)
        self.label.setAccessibleName("Error message")
        self.log_label = QLabel("")  # where the details are: the log file (app/logfile.py)
        self.log_label.setObjectName("errorBannerLog")
        self.log_label.setAccessibleName("Log file")
        self.log_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.log_label.setWordWrap(True)
        text = QVBoxLayout()
        text.setSpacing(2)
        text.addWidget(self.label)
        text.addWidget(self.log_label)
        layout.addLayout(text, 1)
        self.close_button = QToolButton()
        self.close_button.setText("✕")
        self.close_button.setAccessibleName("Dismiss error")
        self.close_button.setToolTip("Dismiss")
        self.close_button.clicked.connect(self.dismiss)
        layout.addWidget(self.close_button)
        self.hide()

    def show_message(self, message: str) -> None:
        self.label.setText(message)
        log = current_log_file()
        self.log_label.setText(f"Details in the log: {log}" if log is not None else "")
        self.log_label.setVisible(log is not None)
        self.show()

    def dismiss(self) -> None:
        self.hide()
        self.dismissed.emit()

    @property
    def message(self) -> str:
        return self.label.text() if self.isVisible() else ""
