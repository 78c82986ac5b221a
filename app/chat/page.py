"""The chat page: conversation sidebar, system prompt, messages, composer, and the turn logic
(send -> stream -> stop / finish; regenerate; continue; edit-and-resend).

One answer is written at a time (the engine has one worker). It belongs to its conversation,
not to the screen: switching to another conversation, or to a new one, lets it go on in the
background (as LM Studio and Jan do). The sidebar marks that conversation, the composer shows
Stop wherever the user is (sending waits for the engine), and coming back shows the answer
where it has got to, still streaming.

Persistence rule: the answer's row is created (complete = 0) before its first token. While it is
on screen its text is written just before every render (ChatView.before_render), so the
database always holds at least what the window shows; in the background it is written every
BACKGROUND_SAVE_MS. A finished answer is marked complete with its stats and finish reason.
"""

from __future__ import annotations

import logging
import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QSplitter,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.chat.composer import Composer
from app.chat.empty_state import EmptyState
from app.chat.engine_picker import EnginePicker
from app.chat.markdown import MarkdownPalette
from app.chat.sidebar import Sidebar
from app.chat.system_prompt import SystemPromptRow
from app.chat.turn import Answer, answer_request, length_note, message_meta
from app.chat.turn_status import TurnStatus, mode_context
from app.chat.view import ChatView
from app.state.conversations import ConversationStore, StoredMessage, stats_dict, title_from
from app.state.preferences import PreferencesStore
from app.state.remote_engines import LOCAL, parse_engines, resolve
from app.widgets.status import ErrorBanner, StatusBar
from app.workers.engine_worker import EngineHost
from app.workers.remote_worker import RemoteHost
from engine.errors import RemoteError
from engine.types import Completion, RemoteModel

log = logging.getLogger(__name__)

BACKGROUND_SAVE_MS = 500


class ChatPage(QWidget):
    """Signals: starter_requested(), models_requested(), answer_finished(str) (finish reason)."""

    starter_requested = Signal()
    models_requested = Signal()
    answer_finished = Signal(str)

    def __init__(self, conversations: ConversationStore, host: EngineHost, preferences: PreferencesStore,
                 status: StatusBar, parent: QWidget | None = None, remote: RemoteHost | None = None) -> None:
        super().__init__(parent)
        self.store = conversations
        self.host = host
        self.remote = remote  # answers from remote engines (app/state/remote_engines.py), same signals as host's
        self._active: EngineHost | RemoteHost = host  # whichever runs the answer in progress
        self.preferences = preferences
        self.status = status
        self.turn = TurnStatus(status)  # the figures per conversation; an answer waiting for the API
        self.conversation_id = 0
        self.model_state, self._model_detail = "none", ""
        self._ids: list[int] = []  # database id of each message in the view
        self._answer: Answer | None = None
        self._editing_id = 0
        self.plan: object | None = None  # engine.planning.planner.Plan for budget "auto", from the worker
        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(BACKGROUND_SAVE_MS)
        self._save_timer.timeout.connect(self._save_answer)
        self._build()
        for worker in (host.worker, remote.worker) if remote is not None else (host.worker,):
            worker.tokens_generated.connect(self._on_worker_tokens_generated)
            worker.generation_finished.connect(self._on_worker_generation_finished)
            worker.generation_failed.connect(self._on_worker_generation_failed)
        host.worker.planned.connect(self._on_worker_planned)
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
        self.sidebar = Sidebar(self.store)
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
        self.system_row = SystemPromptRow()
        self.system_row.edited.connect(self._on_system_row_edited)
        self.system_row.save_requested.connect(self.save_preset)
        self.system_edit, self.preset_combo = self.system_row.edit, self.system_row.presets
        self.engine_picker = EnginePicker()
        self.engine_picker.reload(self.preferences.load())
        self.engine_picker.choice_changed.connect(self._on_engine_picker_choice_changed)
        self.system_row.layout().insertWidget(0, self.engine_picker)
        self.reload_presets()
        column.addWidget(self.system_row)
        self.view = ChatView()
        self.view.before_render = self._save_partial
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
        return self._answer is not None

    @property
    def answering_here(self) -> bool:
        return self._answer is not None and self._answer.conversation_id == self.conversation_id

    @property
    def answering_in(self) -> int:
        """The conversation an answer is being written in (0: none)."""
        return self._answer.conversation_id if self._answer is not None else 0

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
        answer = self._answer
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
        self.engine_picker.reload(self.preferences.load())  # the settings' servers may have changed
        self.system_row.set_presets(self.preferences.load().system_presets)

    def _default_system_prompt(self) -> str:
        presets = self.preferences.load().system_presets
        return presets[0][1] if presets else ""

    # ---- conversations -------------------------------------------------------------------
    def new_conversation(self) -> None:
        self._leave_conversation()
        self.conversation_id = 0
        self._ids = []
        self.view.clear()
        self.system_edit.setText(self._default_system_prompt())
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
        answer = self._answer if self.answering_here else None
        for m in self.store.messages(conv.id):
            if answer is not None and m.id == answer.message_id:
                widget = self.view.begin_answer(answer.text)  # still being written: it streams on here
                if not answer.first_token and self._active is self.host:
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
            self._save_answer()
        if self._editing_id:
            self.cancel_edit()

    def _show(self, m: StoredMessage) -> None:
        widget = self.view.add_message(m.role, m.content, m.complete)
        meta = message_meta(m)
        if m.role == "assistant" and m.complete and meta.get("finish_reason") == "length":
            widget.can_continue = True
            widget.set_note(length_note(int(meta.get("new_tokens", 0))))
            self.view.set_busy(self.busy)  # shows Continue on the last answer
        self._ids.append(m.id)

    def _on_sidebar_conversation_deleted(self, conversation_id: int) -> None:
        if self.answering_in == conversation_id:  # its row is gone with it: stop writing
            self._active.cancel_generation()
            self._save_timer.stop()
            self._answer = None
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

    def save_preset(self, name: str, text: str) -> None:
        presets = tuple(p for p in self.preferences.load().system_presets if p[0] != name) + ((name, text),)
        self.preferences.update(system_presets=presets)
        self.reload_presets()

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
        if not self.conversation_id:
            self.conversation_id = self.store.create(title_from(text), self.system_edit.text()).id
            self.store.set_engine(self.conversation_id, self.engine_picker.choice())
        elif self._editing_id:
            self._drop_from(self._editing_id)
        self._set_editing(None)
        self._show(self.store.add_message(self.conversation_id, "user", text))
        self._start_answer(remote=remote)

    def regenerate(self) -> None:
        """Drop the last answer and write it again."""
        if not self._ready() or not self._ids or self.view.messages[-1].role != "assistant":
            return
        ok, remote = self._engine_for_answer()
        if not ok:
            return
        self._drop_from(self._ids[-1])
        self._start_answer(remote=remote)

    def continue_answer(self) -> None:
        """Write on from the last answer (cut by the token limit), into the same message."""
        if not self._ready() or not self._ids or self.view.messages[-1].role != "assistant":
            return
        ok, remote = self._engine_for_answer()
        if not ok:
            return
        widget = self.view.messages[-1]
        self.store.update_message(self._ids[-1], widget.text, complete=False)
        self._start_answer(resume=widget, remote=remote)

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
            self._active.cancel_generation()

    def escape(self) -> None:
        """Esc: stop the answer being written, else leave edit mode."""
        if self.busy:
            self.stop()
        else:
            self.cancel_edit()

    def _drop_from(self, message_id: int) -> None:
        index = self._ids.index(message_id)
        self.store.delete_messages_from(self.conversation_id, message_id)
        self.view.remove_from(index)
        del self._ids[index:]

    def _engine_for_answer(self) -> tuple[bool, RemoteModel | None]:
        """The remote model this conversation runs on (None: the local one); False, with a banner,
        when its server was removed from the settings."""
        try:
            return True, resolve(self.engine_picker.choice(), parse_engines(self.preferences.load().remote_engines))
        except RemoteError as exc:
            self.show_error(exc.user_message, "engine")
            return False, None

    def _start_answer(self, resume: object = None, remote: RemoteModel | None = None) -> None:
        prefs = self.preferences.load()
        request = answer_request(prefs, self.plan, self.system_edit.text(), self.store.messages(self.conversation_id),
                                 self.conversation_id, continue_final=resume is not None)
        if resume is None:
            message_id = self.store.add_message(self.conversation_id, "assistant", "", complete=False).id
            self._ids.append(message_id)
            widget = self.view.begin_answer()
        else:
            message_id = self._ids[-1]
            widget = self.view.resume_answer(resume)  # type: ignore[arg-type]
        if remote is not None and self.remote is not None:
            self._active = self.remote
            request_id = self.remote.generate(request, remote)
        else:
            self._active = self.host
            request_id = self.host.generate(request)
            widget.set_placeholder(self.turn.waiting_text())
        self._answer = Answer(request_id, self.conversation_id, message_id, widget.text, started=time.monotonic())
        self.turn.begin(self.conversation_id, mode_context(prefs, self.plan, self.status.has_draft, remote is not None))
        self.sidebar.set_writing(self.conversation_id)
        self.sidebar.select(self.conversation_id)
        self._update_composer()

    def _on_worker_planned(self, plan: object) -> None:
        self.plan = plan

    def _on_worker_serving(self, busy: bool) -> None:
        """The engine started or ended an API request: an answer waiting behind it says so."""
        self.turn.serving = busy
        answer = self._answer
        if answer is not None and not answer.first_token and self._active is self.host and self.answering_here:
            self.view.set_waiting(self.turn.waiting_text())

    def _save_partial(self, text: str) -> None:
        """Before each render of the answer on screen: the database gets it first."""
        if self.answering_here:
            self.store.update_message(self._answer.message_id, text)  # type: ignore[union-attr]

    def _save_answer(self) -> None:
        if self._answer is not None:
            self.store.update_message(self._answer.message_id, self._answer.text)

    def _on_worker_tokens_generated(self, request_id: int, text: str, tokens: int) -> None:
        answer = self._answer
        if answer is None or request_id != answer.request_id:
            return
        answer.text += text
        answer.tokens += tokens
        seconds = time.monotonic() - answer.started
        here = self.answering_here
        if not answer.first_token:
            answer.first_token = True
            self.turn.first_token(seconds, here)
        if here:
            self.view.append_answer(text)
        elif not self._save_timer.isActive():
            self._save_timer.start()
        self.turn.progress(answer.tokens, seconds, here)

    def _on_worker_generation_finished(self, request_id: int, completion: Completion) -> None:
        answer = self._answer
        if answer is None or request_id != answer.request_id:
            return
        reason = completion.finish_reason
        stopped = reason == "cancelled"
        note = "stopped" if stopped else length_note(completion.stats.new_tokens) if reason == "length" else ""
        if self.answering_here:
            self.view.end_answer(note, complete=not stopped, can_continue=reason == "length")
        stats = {**stats_dict(completion.stats), "finish_reason": reason}
        self.store.update_message(answer.message_id, answer.text, complete=not stopped, stats=stats)
        self.turn.finish(completion.stats, self.answering_here)
        if not stopped:
            self.clear_error("answer")  # an answer works again
        self._finish_turn()
        self.answer_finished.emit(reason)

    def _on_worker_generation_failed(self, request_id: int, message: str) -> None:
        answer = self._answer
        if answer is None or request_id != answer.request_id:
            return
        if self.answering_here:
            self.view.end_answer("failed", complete=False)
        self.store.update_message(answer.message_id, answer.text, complete=False)
        self.turn.finish(None, self.answering_here)
        self.show_error(message, "answer")
        self._finish_turn()
        self.answer_finished.emit("error")

    def _finish_turn(self) -> None:
        self._save_timer.stop()
        self._answer = None
        self.sidebar.set_writing(0)
        self._update_composer()

