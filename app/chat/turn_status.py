"""What the window says about answers besides their text: the status bar's figures and the note
in an answer's bubble while it waits for the engine. The chat page's helper; no signals.

- Figures belong to the conversation whose answer made them. An answer written in the
  background never puts its figures beside another conversation; coming back to it shows them
  (live while it is written, final once done). Another model forgets them all (`forget`).
- While the local engine runs a request from the API server (Settings > Server), an answer
  sent meanwhile waits behind it: its bubble says so until its first token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from app.state.preferences import Preferences
from app.widgets.status import ModeContext, StatusBar
from engine.types import GenerationStats

if TYPE_CHECKING:
    from engine.decoding.auto_budget import BudgetChoice

WAITING_FOR_API = "Waiting for the API request to finish…"


def mode_context(prefs: Preferences, has_draft: bool, remote: bool) -> ModeContext:
    """What is known of how an answer about to be sent will be decoded: the settings and whether
    a draft is loaded (what budget "auto" chooses comes from the worker: `TurnStatus.choose`). An
    answer from a remote engine has none of these."""
    if remote:
        return ModeContext()
    return ModeContext(auto_budget=prefs.budget <= 0, has_draft=has_draft, setting=prefs.tree_mode)


@dataclass
class _Live:
    """The figures of the answer being written."""

    conversation_id: int
    context: ModeContext
    first_token: float | None = None
    tokens: int = 0
    seconds: float = 0.0


class TurnStatus:
    """The figures per conversation, and whether the engine is busy with an API request."""

    def __init__(self, status: StatusBar) -> None:
        self.status = status
        self._live: _Live | None = None
        self._done: dict[int, tuple[GenerationStats, ModeContext]] = {}
        self.serving = False  # the local engine runs an API request now

    def waiting_text(self) -> str:
        """What a local answer without text waits for ("" : nothing known)."""
        return WAITING_FOR_API if self.serving else ""

    # ---- the answer being written -------------------------------------------------------------
    def begin(self, conversation_id: int, context: ModeContext) -> None:
        """An answer starts in the shown conversation `conversation_id`."""
        self._live = _Live(conversation_id, context)
        self._done.pop(conversation_id, None)
        self.status.begin_answer()

    def choose(self, choice: BudgetChoice) -> None:
        """What budget "auto" chose for the answer being written (the worker says so before its
        first token): its mode field will say why the draft was or was not used."""
        if self._live is not None:
            self._live.context = replace(self._live.context, choice=choice)

    def first_token(self, seconds: float, shown: bool) -> None:
        if self._live is None:
            return  # forgotten: the model changed under it
        self._live.first_token = seconds
        if shown:
            self.status.show_first_token(seconds)

    def progress(self, tokens: int, seconds: float, shown: bool) -> None:
        if self._live is None:
            return
        self._live.tokens, self._live.seconds = tokens, seconds
        if shown:
            self.status.show_live(tokens, seconds)

    def finish(self, stats: GenerationStats | None, shown: bool) -> None:
        """The answer ended; `stats` None: it failed (its conversation keeps no figures)."""
        live, self._live = self._live, None
        if live is None:
            return
        if stats is not None:
            self._done[live.conversation_id] = (stats, live.context)
            if shown:
                self.status.show_stats(stats, live.context)
        elif shown:
            self.status.clear_figures()

    # ---- what is shown ------------------------------------------------------------------------
    def show_conversation(self, conversation_id: int) -> None:
        """The window now shows `conversation_id` (0: a new one): its own figures, or none."""
        self.status.clear_figures()
        live = self._live
        if live is not None and live.conversation_id == conversation_id and conversation_id:
            if live.first_token is None:
                self.status.begin_answer()
            else:
                self.status.show_first_token(live.first_token)
                self.status.show_live(live.tokens, live.seconds)
        elif conversation_id in self._done:
            self.status.show_stats(*self._done[conversation_id])

    def forget(self) -> None:
        """Another model: figures measured with the last one say nothing now, nor do those of
        an answer it is still ending (a load stops the answer being written)."""
        self._done.clear()
        self._live = None
        self.status.clear_figures()
