"""The chat page: conversation sidebar, system prompt, messages and composer, wired to the turn
controller (app/chat/turn.py: history -> request, the answer being written, the save rule) and
the workers (the local engine's host and the remote engines').

One answer is written at a time (the engine has one worker). It belongs to its conversation,
not to the screen: switching to another conversation, or to a new one, lets it go on in the
background (as LM Studio and Jan do). The sidebar marks that conversation, the composer shows
Stop wherever the user is (sending waits for the engine), and coming back shows the answer
where it has got to, still streaming. What is saved when is the turn controller's rule; this
page tells it whether the answer is on screen and saves before every render of it. Answers are
split for the model that writes them (`answer_format`, set by the window when a model loads).

What this does not do: decide anything about the database or the request itself (the turn
controller does), or touch the engine (the hosts do).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QSplitter, QStackedWidget, QVBoxLayout, QWidget

from app.chat.composer import Composer
from app.chat.empty_state import EmptyState
from app.chat.engine_picker import EnginePicker
from app.chat.markdown import MarkdownPalette
from app.chat.reasoning import PLAIN, REMOTE, AnswerFormat
from app.chat.sidebar import Sidebar
from app.chat.system_prompt import SystemPromptRow
from app.chat.turn import Ending, TurnController, TurnSettings, length_note, message_meta
from app.chat.turn_status import TurnStatus, mode_context
from app.chat.view import ChatView, MessageWidget
from app.state.conversations import ConversationStore, StoredMessage
from app.state.preferences_store import PreferencesStore
from app.state.remote_engines import LOCAL
from app.widgets.dialogs import Dialogs
from app.widgets.status import ErrorBanner, StatusBar
from app.workers.engine_worker import EngineHost
from app.workers.remote_worker import RemoteHost
from engine.errors import RemoteError
from engine.types import Completion, GenerationRequest, RemoteModel

if TYPE_CHECKING:
    from engine.decoding.auto_budget import BudgetChoice

log = logging.getLogger(__name__)


class ChatPage(QWidget):
    """Signals: starter_requested(), models_requested(), answer_finished(str) (finish reason)."""

    starter_requested = Signal()
    models_requested = Signal()
    answer_finished = Signal(str)

    def __init__(self, conversations: ConversationStore, host: EngineHost, preferences: PreferencesStore,
                 status: StatusBar, parent: QWidget | None = None, remote: RemoteHost | None = None,
                 dialogs: Dialogs | None = None, settings: TurnSettings | None = None) -> None:
        super().__init__(parent)
        self.store = conversations
        self.host = host
        self.remote = remote  # answers from remote engines (app/workers/remote_worker.py), same signals as host's
        self.preferences = preferences
        self.status = status
        self.dialogs = dialogs or Dialogs.over(self)
        self.controller = TurnController(conversations, self._send, settings)
        self.turn = TurnStatus(status)  # the figures per conversation; an answer waiting for the API
        self.conversation_id = 0
        self.model_state, self._model_detail = "none", ""
        self.answer_format: AnswerFormat = PLAIN  # the local model's (app/chat/reasoning.py); remote: REMOTE
        self._ids: list[int] = []  # database id of each message in the view
        self._editing_id = 0
        self._build()
        for worker in (host.worker, remote.worker) if remote is not None else (host.worker,):
            worker.tokens_generated.connect(self._on_worker_tokens_generated)
            worker.generation_finished.connect(self._on_worker_generation_finished)
            worker.generation_failed.connect(self._on_worker_generation_failed)
        host.worker.budget_chosen.connect(self._on_worker_budget_chosen)
        host.worker.serving.connect(self._on_worker_serving)
        self.sidebar.refresh()
        first = self.store.conversations()
        if first:
            self.open_conversation(first[0].id)
        else:
            self.new_conversation()
        self.set_model_state("none")

    def _build(self) -> None:
        outer = QHBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.setChildrenCollapsible(False)
        self.sidebar = Sidebar(self.store, dialogs=self.dialogs)
        self.sidebar.conversation_selected.connect(self.open_conversation)
        self.sidebar.conversation_deleted.connect(self._on_sidebar_conversation_deleted)
        self.sidebar.new_requested.connect(self.new_conversation)
        self.sidebar.exported.connect(lambda path: self.status.showMessage(f"Exported to {path}", 10_000))
        splitter.addWidget(self.sidebar)
        right = QWidget()
        column = QVBoxLayout(right)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        self.banner = ErrorBanner()
        banner_row = QHBoxLayout()
        banner_row.setContentsMargins(12, 8, 12, 0)
        banner_row.addWidget(self.banner)
        column.addLayout(banner_row)
        self.system_row = SystemPromptRow(self.preferences, dialogs=self.dialogs)
        self.system_row.edited.connect(self._on_system_row_edited)
        self.system_edit, self.preset_combo = self.system_row.edit, self.system_row.presets
        self.engine_picker = EnginePicker()
        self.engine_picker.reload(self.preferences.load())
        self.engine_picker.choice_changed.connect(self._on_engine_picker_choice_changed)
        self.system_row.add_leading(self.engine_picker)
        self.reload_presets()
        column.addWidget(self.system_row)
        self.view = ChatView()
        self.view.before_render = self._on_view_before_render
        self.view.edit_requested.connect(self.edit_last)
        self.view.regenerate_requested.connect(self.regenerate)
        self.view.continue_requested.connect(self.continue_answer)
        self.empty = EmptyState()
        self.empty.starter_requested.connect(self.starter_requested)
        self.empty.models_requested.connect(self.models_requested)
        self.stack = QStackedWidget()
        self.stack.addWidget(self.view)
        self.stack.addWidget(self.empty)
        column.addWidget(self.stack, 1)
        self.composer = Composer()
        self.composer.send_requested.connect(self.send)
        self.composer.stop_requested.connect(self.stop)
        self.composer.edit_cancelled.connect(self.cancel_edit)
        column.addWidget(self.composer)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([220, 760])
        outer.addWidget(splitter)

    # ---- state ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """An answer is being written (in this conversation or another)."""
        return self.controller.busy

    @property
    def answering_here(self) -> bool:
        return self.controller.busy and self.controller.answering_in == self.conversation_id

    @property
    def answering_in(self) -> int:
        """The conversation an answer is being written in (0: none)."""
        return self.controller.answering_in

    def _active(self) -> EngineHost | RemoteHost:
        """The host whose worker writes the answer in progress (the local one when none)."""
        answer = self.controller.answer
        return self.remote if answer is not None and answer.remote and self.remote is not None else self.host

    def set_model_state(self, state: str, detail: str = "") -> None:
        """"none" (no model chosen: the empty state), "loading", "ready" or "failed"."""
        if state != self.model_state and state != "ready":
            self.turn.forget()  # the last model's figures
        self.model_state, self._model_detail = state, detail
        shown = "ready" if self.engine_picker.choice() != LOCAL else state  # a remote model answers anyway
        self.stack.setCurrentWidget(self.empty if shown == "none" else self.view)
        self._update_composer()

    def _can_answer(self) -> bool:
        return self.model_state == "ready" or self.engine_picker.choice() != LOCAL

    def _update_composer(self) -> None:
        answer = self.controller.answer
        self.composer.set_busy(answer is not None)  # Stop wherever the user is
        self.view.set_busy(answer is not None)
        if answer is not None:
            elsewhere = "" if self.answering_here else self._elsewhere_text(answer.conversation_id)
            self.composer.set_can_send(False, elsewhere)
            return
        reasons = {"none": "Choose a model first", "loading": "Loading the model…",
                   "failed": self._model_detail or "The model could not be loaded; see the message above"}
        can = self._can_answer()
        self.composer.set_can_send(can, "" if can else reasons.get(self.model_state, ""))

    def _elsewhere_text(self, conversation_id: int) -> str:
        conv = self.store.get(conversation_id)
        title = conv.title if conv is not None else "another conversation"
        return f"An answer is being written in “{title}”: send when it is done, or press Stop"

    def set_palette(self, palette: MarkdownPalette) -> None:
        self.view.set_palette(palette)

    def show_error(self, message: str, cause: str = "") -> None:
        """An error in the banner; `cause` lets `clear_error` take it away once it is gone."""
        self.banner.show_message(message, cause)

    def clear_error(self, *causes: str) -> None:
        self.banner.clear(*causes)

    def reload_presets(self) -> None:
        """The preferences changed: the settings' servers and the saved presets may have."""
        self.engine_picker.reload(self.preferences.load())
        self.system_row.reload()

    # ---- conversations -------------------------------------------------------------------
    def new_conversation(self) -> None:
        self._leave_conversation()
        self.conversation_id = 0
        self._ids = []
        self.view.clear()
        self.system_edit.setText(self.system_row.default_prompt())
        self.sidebar.select(0)
        self.turn.show_conversation(0)
        self._update_composer()
        self.composer.input.setFocus()

    def open_conversation(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id and self._ids:
            return
        conv = self.store.get(conversation_id) if conversation_id else None
        if conv is None:
            self.new_conversation()
            return
        self._leave_conversation()
        self.conversation_id = conv.id
        self.view.clear()
        self._ids = []
        self.system_edit.setText(conv.system_prompt)
        self.engine_picker.set_choice(conv.engine)
        self.set_model_state(self.model_state, self._model_detail)
        answer = self.controller.answer if self.answering_here else None
        for m in self.store.messages(conv.id):
            if answer is not None and m.id == answer.message_id:
                # still being written: it streams on here
                widget = self.view.begin_answer(answer.text, answer.reasoning, answer.reasoning_seconds)
                if not answer.first_token and not answer.remote:
                    widget.set_placeholder(self.turn.waiting_text())
                self._ids.append(m.id)
            else:
                self._show(m)
        self.sidebar.select(conv.id)
        self.turn.show_conversation(conv.id)
        self._update_composer()
        self.view.scroll_to_bottom()

    def _leave_conversation(self) -> None:
        """The shown conversation is about to change: an answer streaming here goes on in the
        background (its text saved now), and an edit in progress is dropped."""
        if self.answering_here:
            self.view.flush()
            self.view.detach_answer()
            self.controller.save()
        if self._editing_id:
            self.cancel_edit()

    def _show(self, m: StoredMessage) -> None:
        widget = self.view.add_message(m.role, m.content, m.complete, m.reasoning, m.reasoning_seconds)
        meta = message_meta(m)
        if m.role == "assistant" and m.complete and meta.get("finish_reason") == "length":
            widget.can_continue = True
            widget.set_note(length_note(int(meta.get("new_tokens", 0))))
            self.view.set_busy(self.busy)  # shows Continue on the last answer
        self._ids.append(m.id)

    def _on_sidebar_conversation_deleted(self, conversation_id: int) -> None:
        active = self._active()
        if self.controller.forget(conversation_id):  # its row is gone with it: stop writing
            active.cancel_generation()
            self._update_composer()
        if conversation_id == self.conversation_id:
            self.conversation_id = 0

    def _on_engine_picker_choice_changed(self, choice: str) -> None:
        self.clear_error("engine")  # "the server of this conversation is gone"
        if self.conversation_id:
            self.store.set_engine(self.conversation_id, choice)
        self.set_model_state(self.model_state, self._model_detail)

    def _on_system_row_edited(self, text: str) -> None:
        if self.conversation_id:
            self.store.set_system_prompt(self.conversation_id, text)

    # ---- a turn --------------------------------------------------------------------------
    def _ready(self) -> bool:
        return not self.busy and self._can_answer()

    def send(self, text: str) -> None:
        """Send a user message (or the edited last one) and start the answer."""
        if not self._ready() or not text.strip():
            return
        ok, remote = self._engine_for_answer()
        if not ok:
            return
        self.clear_error("answer", "engine")  # a new try
        replace_from = self._editing_id if self.conversation_id else 0
        if replace_from:
            self._unshow_from(replace_from)
        self._set_editing(None)
        self.conversation_id, message = self.controller.post(
            self.conversation_id, text, self.system_edit.text(), self.engine_picker.choice(), replace_from)
        self._show(message)
        self._start_answer(remote=remote)

    def regenerate(self) -> None:
        """Drop the last answer and write it again."""
        if not self._ready() or not self._ids or self.view.messages[-1].role != "assistant":
            return
        ok, remote = self._engine_for_answer()
        if not ok:
            return
        last = self._ids[-1]
        self._unshow_from(last)
        self.controller.drop_from(self.conversation_id, last)
        self._start_answer(remote=remote)

    def continue_answer(self) -> None:
        """Write on from the last answer (cut by the token limit), into the same message."""
        if not self._ready() or not self._ids or self.view.messages[-1].role != "assistant":
            return
        ok, remote = self._engine_for_answer()
        if not ok:
            return
        self._start_answer(resume=self.view.messages[-1], remote=remote)

    def edit_last(self) -> None:
        """Put the last user message in the composer; sending it replaces it and what followed."""
        if self.busy:
            return
        users = [i for i, m in enumerate(self.view.messages) if m.role == "user"]
        if users:
            self._set_editing(users[-1])
            self.composer.set_text(self.view.messages[users[-1]].text)

    def cancel_edit(self) -> None:
        """Leave edit mode: the message stays as it was."""
        if self._editing_id:
            self._set_editing(None)
            self.composer.set_text("")

    def _set_editing(self, index: int | None) -> None:
        """Edit mode on the message at view index `index` (None: off); the message and the
        composer both say so."""
        self._editing_id = self._ids[index] if index is not None else 0
        self.view.set_editing(index)
        self.composer.set_editing(index is not None)

    def stop(self) -> None:
        if self.busy:
            self._active().cancel_generation()

    def escape(self) -> None:
        """Esc: stop the answer being written, else leave edit mode."""
        if self.busy:
            self.stop()
        else:
            self.cancel_edit()

    def _unshow_from(self, message_id: int) -> None:
        """Take a message and every later one off the view (the controller drops them from the database)."""
        index = self._ids.index(message_id)
        self.view.remove_from(index)
        del self._ids[index:]

    def _engine_for_answer(self) -> tuple[bool, RemoteModel | None]:
        """The remote model this conversation runs on (None: the local one); False, with a banner,
        when its server was removed from the settings."""
        try:
            return True, self.controller.route(self.engine_picker.choice(), self.preferences.load())
        except RemoteError as exc:
            self.show_error(exc.user_message, "engine")
            return False, None

    def _send(self, request: GenerationRequest, remote: RemoteModel | None) -> int:
        """The turn controller's way to the engine: a remote server's worker or the local one."""
        if remote is not None and self.remote is not None:
            return self.remote.generate(request, remote)
        return self.host.generate(request)

    def _start_answer(self, resume: MessageWidget | None = None, remote: RemoteModel | None = None) -> None:
        prefs = self.preferences.load()
        resumed = (self._ids[-1], resume.text) if resume is not None else None
        answer = self.controller.begin(self.conversation_id, prefs, self.system_edit.text(), remote, resumed,
                                       fmt=REMOTE if remote is not None else self.answer_format)
        if resume is None:
            self._ids.append(answer.message_id)
            widget = self.view.begin_answer()
        else:
            widget = self.view.resume_answer(resume)
        if not answer.remote:
            widget.set_placeholder(self.turn.waiting_text())
        self.turn.begin(self.conversation_id, mode_context(prefs, self.status.has_draft, answer.remote))
        self.sidebar.set_writing(self.conversation_id)
        self.sidebar.select(self.conversation_id)
        self._update_composer()

    def _on_worker_budget_chosen(self, request_id: int, choice: BudgetChoice) -> None:
        """What budget "auto" chose for the answer being written: its mode field says why."""
        if self.controller.owns(request_id):
            self.turn.choose(choice)

    def _on_worker_serving(self, busy: bool) -> None:
        """The engine started or ended an API request: an answer waiting behind it says so."""
        self.turn.serving = busy
        answer = self.controller.answer
        if answer is not None and not answer.first_token and not answer.remote and self.answering_here:
            self.view.set_waiting(self.turn.waiting_text())

    def _on_view_before_render(self, text: str) -> None:
        """Before each render of the answer on screen: the database gets it first."""
        if self.answering_here:
            self.controller.save_shown(text)

    def _on_worker_tokens_generated(self, request_id: int, text: str, tokens: int) -> None:
        here = self.answering_here
        progress = self.controller.tokens(request_id, text, tokens, shown=here)
        if progress is None:
            return
        if progress.first:
            self.turn.first_token(progress.seconds, here)
        if here:
            self.view.show_progress(progress)
        self.turn.progress(progress.tokens, progress.seconds, here)

    def _on_worker_generation_finished(self, request_id: int, completion: Completion) -> None:
        here = self.answering_here
        ending = self.controller.finish(request_id, completion)
        if ending is None:
            return
        self._end_turn(ending, here)
        self.turn.finish(completion.stats, here)
        if ending.complete:
            self.clear_error("answer")  # an answer works again
        self.answer_finished.emit(ending.reason)

    def _on_worker_generation_failed(self, request_id: int, message: str) -> None:
        here = self.answering_here
        ending = self.controller.fail(request_id)
        if ending is None:
            return
        self._end_turn(ending, here)
        self.turn.finish(None, here)
        self.show_error(message, "answer")
        self.answer_finished.emit(ending.reason)

    def _end_turn(self, ending: Ending, here: bool) -> None:
        if here:
            self.view.finish_answer(ending)
        self.sidebar.set_writing(0)
        self._update_composer()
