"""The status bar (model pair, where the weights live, tok/s, tokens per pass, time to first
token, budget; a cancellable load progress bar) and the dismissable error banner."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QStatusBar,
    QToolButton,
    QWidget,
)

from engine.types import GenerationStats, LoadProgress, Placement


def short_name(spec: str) -> str:
    """A model spec (catalog id, repo id or path) as a short readable name."""
    if not spec:
        return ""
    path = Path(spec)
    if path.is_absolute() or spec.startswith(("~", ".")):
        return path.stem if path.suffix.lower() == ".gguf" else path.name
    return spec.rsplit("/", 1)[-1]


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
        self.pair = self._field("No model loaded", "Model pair")
        self.placement = self._field("", "Where the weights live")
        self.speed = self._field("", "Tokens per second")
        self.per_pass = self._field("", "Tokens per target pass")
        self.ttft = self._field("", "Time to first token")
        self.budget = self._field("", "Speculation budget")
        for label in (self.pair, self.placement):
            self.addWidget(label)
        for label in (self.speed, self.per_pass, self.ttft, self.budget):
            self.addPermanentWidget(label)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Loading progress")
        self.progress.setRange(0, 1000)
        self.progress.setMaximumWidth(220)
        self.progress.setTextVisible(False)
        self.progress_text = self._field("", "Loading status")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName("Cancel loading")
        self.cancel_button.clicked.connect(self.load_cancel_requested)
        for widget in (self.progress_text, self.progress, self.cancel_button):
            self.addWidget(widget)
            widget.hide()

    def _field(self, text: str, name: str) -> QLabel:
        label = QLabel(text)
        label.setObjectName("statusField")
        label.setAccessibleName(name)
        label.setToolTip(name)
        return label

    # ---- model ---------------------------------------------------------------------------
    def show_pair(self, target: str, draft: str, placement: Placement | None) -> None:
        pair = short_name(target) + (f" + {short_name(draft)} draft" if draft else " (no draft)")
        self.pair.setText(pair)
        self.pair.setToolTip(f"Target: {target}\nDraft: {draft or 'none (plain decoding)'}")
        self.placement.setText(placement.describe() if placement is not None else "")

    def show_no_model(self, text: str = "No model loaded") -> None:
        self.pair.setText(text)
        self.placement.setText("")

    def show_load_progress(self, progress: LoadProgress) -> None:
        for widget in (self.progress_text, self.progress, self.cancel_button):
            widget.show()
        self.progress.setValue(int(max(0.0, min(1.0, progress.fraction)) * 1000))
        if progress.stage == "starter" or progress.fraction <= 0.0:
            self.progress.setRange(0, 0)  # busy indicator until real fractions come
        else:
            self.progress.setRange(0, 1000)
        self.progress_text.setText(progress.message or f"Loading the {progress.stage}…")

    def hide_load_progress(self) -> None:
        for widget in (self.progress_text, self.progress, self.cancel_button):
            widget.hide()

    # ---- generation ----------------------------------------------------------------------
    def show_live(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self.speed.setText(f"{tokens / seconds:.1f} tok/s")

    def show_stats(self, stats: GenerationStats, auto_budget: bool) -> None:
        self.speed.setText(f"{stats.tokens_per_second:.1f} tok/s")
        self.per_pass.setText(f"{stats.tokens_per_pass:.2f} tokens/pass")
        reused = f", {stats.cached_tokens:,} of {stats.prompt_tokens:,} prompt tokens reused" if stats.cached_tokens else ""
        self.ttft.setText(f"first token {stats.ttft_seconds:.2f} s{reused}")
        self.ttft.setToolTip("Time from sending to the first token of the answer. Reused prompt tokens were "
                             "already read in an earlier turn and cost nothing now.")
        self.budget.setText(budget_text(stats.budget, auto_budget) if stats.mode == "specexec" else "no speculation")
        if stats.placement is not None:
            self.placement.setText(stats.placement.describe())


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
        layout.addWidget(self.label, 1)
        self.close_button = QToolButton()
        self.close_button.setText("✕")
        self.close_button.setAccessibleName("Dismiss error")
        self.close_button.setToolTip("Dismiss")
        self.close_button.clicked.connect(self.dismiss)
        layout.addWidget(self.close_button)
        self.hide()

    def show_message(self, message: str) -> None:
        self.label.setText(message)
        self.show()

    def dismiss(self) -> None:
        self.hide()
        self.dismissed.emit()

    @property
    def message(self) -> str:
        return self.label.text() if self.isVisible() else ""
