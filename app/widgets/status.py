"""The status bar (model pair, where the weights live, tok/s, tokens per pass, time to first
token, budget; a cancellable load progress bar) and the dismissable error banner.

Every field is an `ElidedLabel` in one `FieldRow` (app/widgets/field_row.py): each has its full width
while the row fits (the default 1180 px window, with the longest model names, a placement and
the API server's field); where it does not, fields yield room in a set order: first the loading
message, then the model pair's draft name, the shorter wordings of the placement, the mode and
the first-token time, then the model pair down to a few letters. Tok/s and tokens per pass
never elide. Nothing widens the window. Each field's tooltip has its text in full and explains
it in a sentence; details (reused prompt tokens, what is streamed from where, why a draft is
not used) live there.

Figures belong to one answer: `clear_figures()` empties them when the model or the shown
conversation changes (the chat page restores a conversation's own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QStatusBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.state.logfile import current_log_file
from app.state.names import short_name, short_paths
from app.widgets.field_row import ElidedLabel, FieldRow
from engine.shapes import PACKING_LABELS, Placement
from engine.types import GenerationStats, LoadProgress

if TYPE_CHECKING:  # it imports torch; the GUI thread never does
    from engine.decoding.auto_budget import BudgetChoice
    from engine.decoding.draft_choice import DraftChoice

TOKENS_PER_PASS_TIP = ("Answer tokens per pass over the big model's weights. Plain decoding makes 1; with "
                       "speculation each pass checks a tree of guesses and keeps every one the big model agrees "
                       "with, so good guesses make several.")
BUDGET_TIP = ("The tree budget: how many draft tokens the big model checks in one pass. A bigger tree keeps more "
              "tokens per pass but makes each pass slower; auto lets the planner pick the fastest for this computer.")
TTFT_TIP = ("Seconds from sending until the first token: mostly reading the conversation. Prompt tokens reused "
            "from an earlier turn were read already and cost nothing now.")


def draft_text(choice: DraftChoice, draft: str) -> str:
    """The draft that runs, in the status bar: "draft: self-draft, 3-bit (54 of 80 layers)",
    "draft-free"."""
    if choice.kind == "none" or not draft:
        return "draft-free"
    label = short_name(draft) if choice.kind == "catalog" else choice.label
    return f"draft: {label}"


def draft_tip(target: str, choice: DraftChoice) -> str:
    """Why this draft runs, and why not the others (the engine's reasons)."""
    how = "picked by hand" if choice.reason.startswith("chosen by hand") else "picked by the engine"
    lines = [f"Target: {target}", f"Draft: {choice.label}, {how}", f"Why: {choice.reason}"]
    if choice.rejected:
        lines.append("Not chosen:")
        lines += [f"  {c.label}: {c.reason}" for c in choice.rejected]
    return "\n".join(lines)


@dataclass(frozen=True)
class ModeContext:
    """Why an answer was decoded the way it was, besides its stats.

    auto_budget: the tree budget is "auto". has_draft: a draft model runs with the target (the
    local engine). setting: Settings > Engine > Mode ("specexec" or "autoregressive"). choice:
    what budget "auto" chose for this answer (engine.decoding.auto_budget.BudgetChoice: draft on
    or off, budget, depth, reason), told by the worker before the first token; None when the
    budget was set, or for a remote answer."""

    auto_budget: bool = False
    has_draft: bool = False
    setting: str = "specexec"
    choice: BudgetChoice | None = None


def mode_text(stats: GenerationStats, context: ModeContext) -> tuple[str, str, str]:
    """The mode field: how this answer was decoded and, where a loaded draft was not used, why;
    as (text, its shorter wording, tooltip). The stats say what ran; the context says who
    decided: budget "auto" (its reason), the engine's per-conversation switch, or the settings."""
    choice = context.choice
    auto_off = choice is not None and not choice.draft and context.has_draft  # budget auto left the draft out
    if stats.mode == "specexec":
        text = budget_text(stats.budget, context.auto_budget)
        why = f"\nBudget auto chose it: {choice.reason}." if choice is not None and choice.draft else ""
        return text, text, BUDGET_TIP + why
    if stats.mode == "context":
        if auto_off:
            assert choice is not None
            return "draft off (auto)", "draft off", (
                f"Draft-free speculation: budget auto left the draft out for this answer ({choice.reason}). Each "
                "pass checks continuations copied from the conversation instead, so text that repeats comes "
                "several tokens per pass. Set a tree budget in Settings > Engine to use the draft anyway.")
        if context.has_draft:
            return "draft off (slower)", "draft off", (
                "Draft-free speculation: the draft's trees were measured slower than decoding without them in "
                "this conversation, so the draft is off here (measured again every few hundred tokens). "
                "“Keep the draft on” in Settings > Engine keeps it.")
        return "draft-free", "draft-free", (
            "Draft-free speculation: each pass also checks continuations copied from the conversation (no "
            "draft model), so text that repeats comes several tokens per pass.")
    plain = "Plain decoding: one token per pass over the weights, no speculation."
    if context.setting == "autoregressive":
        return "plain (Settings)", "plain", f"{plain} Settings > Engine > Mode says so."
    if stats.oom_retries:
        return "plain (out of memory)", "plain", (f"{plain} The device ran out of memory for the trees; a smaller "
                                                  "tree budget in Settings > Engine may fit.")
    if auto_off:
        assert choice is not None
        return "plain (faster)", "plain", (f"{plain} Budget auto predicts it is faster on this computer than "
                                           f"speculating ({choice.reason}). Set a tree budget in Settings > "
                                           "Engine to speculate anyway.")
    return "no speculation", "plain", plain


def short_placement(placement: Placement) -> tuple[str, str]:
    """Where the layers live in a few words ("18 of 80 layers on GPU") and in fewer ("18/80 on
    GPU"); Placement.describe() has the rest (what is streamed from where) for the tooltip."""
    n, on_device = placement.num_layers, placement.gpu_layers
    where = "on GPU" if placement.device.startswith("cuda") else "in RAM"
    quant = PACKING_LABELS[placement.quant]
    if placement.resident_form == "experts-cpu":  # an MoE: the rest on the GPU, the routed experts in RAM
        return placement.experts_where(), "experts on CPU"
    if on_device == n:
        return f"all {n} layers {where}{quant}", f"all {where}"
    if not on_device:
        return f"all {n} layers streamed{quant}", "streamed"
    return f"{on_device} of {n} layers {where}{quant}", f"{on_device}/{n} {where}"


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
        self.has_draft = False  # the loaded pair has a draft (show_pair)
        self.pair = self._field("No model loaded", "Model pair", "The target model and its draft")
        # the two figures a user watches never elide; the time to first token keeps its figure in sight
        self.placement = self._field("", "Where the weights live",
                                     "Where the target's layers live: layers on the GPU run at full speed, the "
                                     "others are streamed from RAM (or disk) for every pass")
        self.speed = self._field("", "Tokens per second", "Tokens of answer written per second", keep_width=True)
        self.per_pass = self._field("", "Tokens per target pass", TOKENS_PER_PASS_TIP, keep_width=True)
        self.ttft = self._field("", "Time to first token", TTFT_TIP)
        self.ttft.elide = Qt.TextElideMode.ElideLeft
        self.budget = self._field("", "Speculation mode", BUDGET_TIP)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Loading progress")
        self.progress.setRange(0, 1000)
        self.progress.setMaximumWidth(220)
        self.progress.setTextVisible(False)
        self.progress_text = self._field("", "Loading status", "")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName("Cancel loading")
        self.cancel_button.clicked.connect(self.load_cancel_requested)
        self.api = self._field("", "API server", "")  # Settings > Server (app/workers/api_server.py)
        self.row = FieldRow()
        self.row.add_left(self.pair, self.placement, self.progress_text, self.progress, self.cancel_button)
        self.row.add_right(*self.figures, self.api)
        for widget in (self.progress_text, self.progress, self.cancel_button, self.api):
            widget.hide()
        # what yields room first when the window is narrow; tok/s and tokens per pass never do,
        # the API server's field gives way last
        self.row.give_way([(self.progress_text, "min"), (self.pair, "short"), (self.placement, "short"),
                           (self.budget, "short"), (self.ttft, "short"), (self.pair, "min"),
                           (self.budget, "min"), (self.ttft, "min"), (self.placement, "min"), (self.api, "min")])
        self.addWidget(self.row, 1)

    def show_api(self, text: str, tip: str = "") -> None:
        """The API server's field ("" hides it); `tip` explains it."""
        self._set(self.api, text, tip)
        self.api.setVisible(bool(text))
        self.row.relayout()

    @property
    def figures(self) -> tuple[ElidedLabel, ...]:
        """The fields that describe one answer."""
        return (self.speed, self.per_pass, self.ttft, self.budget)

    def _field(self, text: str, name: str, tip: str, keep_width: bool = False) -> ElidedLabel:
        label = ElidedLabel(text, keep_width=keep_width)
        label.setObjectName("statusField")
        label.setAccessibleName(name)
        label.setToolTip(tip)
        label.setProperty("tip", tip)
        return label

    def _set(self, label: ElidedLabel, text: str, tip: str | None = None, short: str = "") -> None:
        """Set a field's text (`short`: its shorter wording where it does not fit); its tooltip is
        the text in full, then its explanation (`tip`, else the field's own)."""
        label.set_text(text, short)
        tip = (label.property("tip") or "") if tip is None else tip
        label.setToolTip(f"{text}\n{tip}".strip() if text and tip else text or tip)
        self.row.relayout()

    # ---- model ---------------------------------------------------------------------------
    def show_pair(self, target: str, draft: str, placement: Placement | None,
                  choice: DraftChoice | None = None) -> None:
        """A pair loaded: the last model's figures go. `choice`: which draft runs and why (the
        engine's DraftChoice): its label in the field, its reason and the other candidates'
        in the tooltip."""
        self.clear_figures()
        self.has_draft = bool(draft)
        name = short_name(target)
        if choice is None:
            self._set(self.pair, name + (f" + {short_name(draft)} draft" if draft else " (no draft)"),
                      f"Target: {target}\nDraft: {draft or 'none'}", name + (" + draft" if draft else ""))
        else:
            self._set(self.pair, f"{name} · {draft_text(choice, draft)}", draft_tip(target, choice),
                      name + (" + draft" if draft else " · draft-free"))
        self._show_placement(placement)

    def _show_placement(self, placement: Placement | None) -> None:
        if placement is None:
            self._set(self.placement, "")
        else:
            text, short = short_placement(placement)
            self._set(self.placement, text, f"{placement.describe()}.\n{self.placement.property('tip')}", short)

    def show_no_model(self, text: str = "No model loaded") -> None:
        """No model (or one loading): no figures either."""
        self.clear_figures()
        self.has_draft = False
        self._set(self.pair, text)
        self._set(self.placement, "")

    def show_load_progress(self, progress: LoadProgress) -> None:
        for widget in (self.progress_text, self.progress, self.cancel_button):
            widget.show()
        self.row.relayout()
        self.progress.setValue(int(max(0.0, min(1.0, progress.fraction)) * 1000))
        if progress.stage == "starter" or progress.fraction <= 0.0:
            self.progress.setRange(0, 0)  # busy indicator until real fractions come
        else:
            self.progress.setRange(0, 1000)
        self._set(self.progress_text, short_paths(progress.message) or f"Loading the {progress.stage}…")

    def hide_load_progress(self) -> None:
        for widget in (self.progress_text, self.progress, self.cancel_button):
            widget.hide()
        self.row.relayout()

    # ---- generation ----------------------------------------------------------------------
    def clear_figures(self) -> None:
        """No answer's figures (another model, another conversation)."""
        for label in self.figures:
            self._set(label, "")

    def begin_answer(self) -> None:
        """A new answer: the last one's figures go (they would read as this one's)."""
        self.clear_figures()
        self._set(self.ttft, "first token …")

    def show_first_token(self, seconds: float) -> None:
        self._set(self.ttft, f"first token {seconds:.2f} s", short=f"1st token {seconds:.2f} s")

    def show_live(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self._set(self.speed, f"{tokens / seconds:.1f} tok/s")

    def show_stats(self, stats: GenerationStats, context: ModeContext) -> None:
        """A finished answer's figures; `context` says why it was decoded as it was."""
        self._set(self.speed, f"{stats.tokens_per_second:.1f} tok/s")
        self._set(self.per_pass, f"{stats.tokens_per_pass:.2f} tok/pass")
        read = stats.prompt_tokens - stats.cached_tokens
        reused = (f"{stats.cached_tokens:,} of {stats.prompt_tokens:,} prompt tokens reused from an earlier turn, "
                  f"{read:,} read." if stats.cached_tokens else f"{stats.prompt_tokens:,} prompt tokens read.")
        self._set(self.ttft, f"first token {stats.ttft_seconds:.2f} s", f"{reused}\n{TTFT_TIP}",
                  f"1st token {stats.ttft_seconds:.2f} s")
        text, short, tip = mode_text(stats, context)
        self._set(self.budget, text, tip, short)
        if stats.placement is not None:
            self._show_placement(stats.placement)


class ErrorBanner(QFrame):
    """A dismissable banner above the chat (errors never open a modal dialog). Signals: dismissed().

    Each message has a cause ("load", "answer", … or ""), and `clear(cause)` takes it away when
    that cause is gone (a later load worked, a later answer did), so an error never outlives it.
    It shows the latest message; clearing or dismissing it shows the one before, if any."""

    dismissed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("errorBanner")
        self.setAccessibleName("Error")
        self._messages: dict[str, str] = {}  # cause -> message, the latest last
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        self.label = QLabel("")
        self.label.setWordWrap(True)
        self.label.setAccessibleName("Error message")
        self.log_label = QLabel("")  # where the details are: the log file (app/state/logfile.py)
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

    def show_message(self, message: str, cause: str = "") -> None:
        """Show `message` (replacing an earlier one of the same cause)."""
        self._messages.pop(cause, None)
        self._messages[cause] = message
        self._show_latest()

    def clear(self, *causes: str) -> None:
        """The messages of these causes are no longer true."""
        for cause in causes:
            self._messages.pop(cause, None)
        self._show_latest()

    def dismiss(self) -> None:
        """The user closed the message shown."""
        if self._messages:
            self._messages.pop(next(reversed(self._messages)))
        self._show_latest()
        self.dismissed.emit()

    def _show_latest(self) -> None:
        if not self._messages:
            self.hide()
            return
        self.label.setText(next(reversed(self._messages.values())))
        log = current_log_file()
        self.log_label.setText(f"Details in the log: {log}" if log is not None else "")
        self.log_label.setVisible(log is not None)
        self.show()

    @property
    def cause(self) -> str | None:
        """The cause of the message shown (None: none shown)."""
        return next(reversed(self._messages)) if self._messages else None

    @property
    def message(self) -> str:
        return self.label.text() if self.isVisible() else ""
