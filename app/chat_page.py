"""The chat page: conversation sidebar, system prompt, messages, composer, and the turn logic
(send -> stream -> stop / finish; regenerate; edit-and-resend).

Persistence rule: the answer's row is created (complete = 0) before its first token and its text
is written to the database just before every render (ChatView.before_render), so the database
always holds at least what the window shows. A finished answer is marked complete with its stats.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QPushButton,
    QSplitter,
    QStackedWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.errors import RemoteError
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    RemoteModel,
    SpeculationSettings,
)

from .chat_view import ChatView
from .composer import Composer
from .conversations import ConversationStore, StoredMessage, stats_dict, title_from
from .engine_picker import EnginePicker
from .engine_worker import EngineHost
from .markdown import MarkdownPalette
from .preferences import Preferences, PreferencesStore
from .remote_engines import LOCAL, RemoteHost, parse_engines, resolve
from .sidebar import Sidebar
from .status import ErrorBanner, StatusBar

log = logging.getLogger(__name__)


class EmptyState(QWidget):
    """Shown when no model is chosen: what to do, with the two ways to get one."""

    starter_requested = Signal()
    models_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.addStretch(2)
        title = QLabel("Choose a model to start chatting")
        title.setObjectName("emptyTitle")
        title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        text = QLabel("The starter model (SmolLM2-135M-Instruct, ~93 MB) runs on any machine and works without "
                      "the Hugging Face hub.\nFor 70B models with speculative decoding, pick a pair on the Models page.")
        text.setObjectName("emptyText")
        text.setAlignment(Qt.AlignmentFlag.AlignCenter)
        text.setWordWrap(True)
        layout.addWidget(title)
        layout.addWidget(text)
        row = QHBoxLayout()
        row.addStretch(1)
        self.starter_button = QPushButton("Use the starter model")
        self.starter_button.setAccessibleName("Use the starter model")
        self.starter_button.clicked.connect(self.starter_requested)
        self.models_button = QPushButton("Open the Models page")
        self.models_button.setAccessibleName("Open the Models page")
        self.models_button.clicked.connect(self.models_requested)
        row.addWidget(self.starter_button)
        row.addWidget(self.models_button)
        row.addStretch(1)
        layout.addLayout(row)
        layout.addStretch(3)


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
        self.remote = remote  # answers from remote engines (app/remote_engines.py), same signals as host's
        self._active: EngineHost | RemoteHost = host  # whichever runs the answer in progress
        self.preferences = preferences
        self.status = status
        self.conversation_id = 0
        self._ids: list[int] = []  # database id of each message in the view
        self._request_id: int | None = None
        self._answer_id = 0
        self._editing_id = 0
        self._tokens = 0
        self._started = 0.0
        self.plan: object | None = None  # engine.planning.planner.Plan for budget "auto", from the worker
        self.model_state, self._model_detail = "none", ""
        self._build()
        host.worker.tokens_generated.connect(self._on_worker_tokens_generated)
        host.worker.generation_finished.connect(self._on_worker_generation_finished)
        host.worker.generation_failed.connect(self._on_worker_generation_failed)
        host.worker.planned.connect(self._on_worker_planned)
        if remote is not None:
            remote.worker.tokens_generated.connect(self._on_worker_tokens_generated)
            remote.worker.generation_finished.connect(self._on_worker_generation_finished)
            remote.worker.generation_failed.connect(self._on_worker_generation_failed)
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
        self.sidebar = Sidebar(self.store)
        self.sidebar.conversation_selected.connect(self.open_conversation)
        self.sidebar.new_requested.connect(self.new_conversation)
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
        column.addLayout(self._system_row())
        self.view = ChatView()
        self.view.before_render = self._save_partial
        self.view.edit_requested.connect(self.edit_last)
        self.view.regenerate_requested.connect(self.regenerate)
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
        column.addWidget(self.composer)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([240, 760])
        outer.addWidget(splitter)

    def _system_row(self) -> QHBoxLayout:
        row = QHBoxLayout()
        row.setContentsMargins(12, 8, 12, 4)
        self.engine_picker = EnginePicker()
        self.engine_picker.reload(self.preferences.load())
        self.engine_picker.choice_changed.connect(self._on_engine_picker_choice_changed)
        row.addWidget(self.engine_picker)
        label = QLabel("System prompt")
        row.addWidget(label)
        self.system_edit = QLineEdit()
        self.system_edit.setAccessibleName("System prompt")
        self.system_edit.setPlaceholderText("How the assistant should behave in this conversation")
        self.system_edit.editingFinished.connect(self._on_system_edit_finished)
        label.setBuddy(self.system_edit)
        row.addWidget(self.system_edit, 1)
        self.preset_combo = QComboBox()
        self.preset_combo.setAccessibleName("System prompt presets")
        self.preset_combo.setToolTip("Use a saved system prompt")
        self.preset_combo.activated.connect(self._on_preset_combo_activated)
        row.addWidget(self.preset_combo)
        self.save_preset_button = QToolButton()
        self.save_preset_button.setText("Save preset")
        self.save_preset_button.setAccessibleName("Save the system prompt as a preset")
        self.save_preset_button.clicked.connect(self._save_preset)
        row.addWidget(self.save_preset_button)
        self.reload_presets()
        return row

    # ---- state ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._request_id is not None

    def set_model_state(self, state: str, detail: str = "") -> None:
        """"none" (no model chosen: the empty state), "loading", "ready" or "failed"."""
        self.model_state = state
        self._model_detail = detail
        if self.engine_picker.choice() != LOCAL:  # a remote model answers whatever the local one does
            state = "ready"
        self.stack.setCurrentWidget(self.empty if state == "none" else self.view)
        reasons = {"none": "Choose a model first", "loading": "Loading the model…",
                   "failed": detail or "The model could not be loaded; see the message above"}
        self.composer.set_can_send(state == "ready", reasons.get(state, ""))

    def _can_answer(self) -> bool:
        return self.model_state == "ready" or self.engine_picker.choice() != LOCAL

    def set_palette(self, palette: MarkdownPalette) -> None:
        self.view.set_palette(palette)

    def show_error(self, message: str) -> None:
        self.banner.show_message(message)

    def reload_presets(self) -> None:
        self.engine_picker.reload(self.preferences.load())  # the settings' servers may have changed
        self.preset_combo.clear()
        self.preset_combo.addItem("Presets…", None)
        for name, text in self.preferences.load().system_presets:
            self.preset_combo.addItem(name, text)

    def _default_system_prompt(self) -> str:
        presets = self.preferences.load().system_presets
        return presets[0][1] if presets else ""

    # ---- conversations -------------------------------------------------------------------
    def new_conversation(self) -> None:
        self._abandon_answer()
        self.conversation_id = 0
        self._ids = []
        self._editing_id = 0
        self.view.clear()
        self.system_edit.setText(self._default_system_prompt())
        self.sidebar.refresh(select=0)
        self.composer.input.setFocus()

    def open_conversation(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id and self._ids:
            return
        self._abandon_answer()
        conv = self.store.get(conversation_id) if conversation_id else None
        if conv is None:
            self.new_conversation()
            return
        self.conversation_id = conv.id
        self._editing_id = 0
        self.view.clear()
        self._ids = []
        self.system_edit.setText(conv.system_prompt)
        self.engine_picker.set_choice(conv.engine)
        self.set_model_state(self.model_state, self._model_detail)
        for m in self.store.messages(conv.id):
            self._show(m)
        self.view.set_busy(False)
        self.sidebar.select(conv.id)
        self.view.scroll_to_bottom()

    def _show(self, m: StoredMessage) -> None:
        self.view.add_message(m.role, m.content, m.complete)
        self._ids.append(m.id)

    def _on_engine_picker_choice_changed(self, choice: str) -> None:
        if self.conversation_id:
            self.store.set_engine(self.conversation_id, choice)
        self.set_model_state(self.model_state, self._model_detail)

    def _on_system_edit_finished(self) -> None:
        if self.conversation_id:
            self.store.set_system_prompt(self.conversation_id, self.system_edit.text())

    def _on_preset_combo_activated(self, index: int) -> None:
        text = self.preset_combo.itemData(index)
        if text is not None:
            self.system_edit.setText(str(text))
            self._on_system_edit_finished()
        self.preset_combo.setCurrentIndex(0)

    def _save_preset(self) -> None:
        text = self.system_edit.text().strip()
        if not text:
            return
        name, ok = QInputDialog.getText(self, "Save system prompt", "Preset name:")
        if ok and name.strip():
            self.save_preset(name.strip(), text)

    def save_preset(self, name: str, text: str) -> None:
        presets = tuple(p for p in self.preferences.load().system_presets if p[0] != name) + ((name, text),)
        self.preferences.update(system_presets=presets)
        self.reload_presets()

    # ---- a turn --------------------------------------------------------------------------
    def send(self, text: str) -> None:
        """Send a user message (or the edited last one) and start the answer."""
        if self.busy or not self._can_answer() or not text.strip():
            return
        ok, remote = self._engine_for_answer()
        if not ok:
            return
        self.banner.dismiss()
        if not self.conversation_id:
            conv = self.store.create(title_from(text), self.system_edit.text())
            self.conversation_id = conv.id
            self.store.set_engine(conv.id, self.engine_picker.choice())
            self.sidebar.refresh(select=conv.id)
        elif self._editing_id:
            self._drop_from(self._editing_id)
        self._editing_id = 0
        self._show(self.store.add_message(self.conversation_id, "user", text))
        self._start_answer(remote)

    def regenerate(self) -> None:
        """Drop the last answer and write it again."""
        if self.busy or not self._can_answer() or not self._ids or self.view.messages[-1].role != "assistant":
            return
        ok, remote = self._engine_for_answer()
        if not ok:
            return
        self._drop_from(self._ids[-1])
        self._start_answer(remote)

    def edit_last(self) -> None:
        """Put the last user message in the composer; sending it replaces it and what followed."""
        if self.busy:
            return
        users = [i for i, m in enumerate(self.view.messages) if m.role == "user"]
        if not users:
            return
        index = users[-1]
        self._editing_id = self._ids[index]
        self.composer.set_text(self.view.messages[index].text)

    def stop(self) -> None:
        if self.busy:
            self._active.cancel_generation()

    def _drop_from(self, message_id: int) -> None:
        index = self._ids.index(message_id)
        self.store.delete_messages_from(self.conversation_id, message_id)
        self.view.remove_from(index)
        del self._ids[index:]

    def _history(self) -> tuple[Message, ...]:
        system = self.system_edit.text().strip()
        msgs = [Message("system", system)] if system else []
        msgs += [Message(m.role, m.content) for m in self.store.messages(self.conversation_id)]  # type: ignore[arg-type]
        return tuple(msgs)

    def _engine_for_answer(self) -> tuple[bool, RemoteModel | None]:
        """The remote model this conversation runs on (None: the local one); False, with a banner,
        when its server was removed from the settings."""
        try:
            return True, resolve(self.engine_picker.choice(), parse_engines(self.preferences.load().remote_engines))
        except RemoteError as exc:
            self.show_error(exc.user_message)
            return False, None

    def _start_answer(self, remote: RemoteModel | None = None) -> None:
        prefs = self.preferences.load()
        request = GenerationRequest(
            messages=self._history(),
            max_new_tokens=prefs.max_new_tokens,
            sampling=prefs.sampling(),
            speculation=self._speculation(prefs),
            conversation=f"conversation-{self.conversation_id}",  # its KV cache continues turn to turn
        )
        self._answer_id = self.store.add_message(self.conversation_id, "assistant", "", complete=False).id
        self._ids.append(self._answer_id)
        self.view.begin_answer()
        self._tokens, self._started = 0, time.monotonic()
        if remote is not None and self.remote is not None:
            self._active = self.remote
            self._request_id = self.remote.generate(request, remote)
        else:
            self._active = self.host
            self._request_id = self.host.generate(request)
        self.composer.set_busy(True)
        self.view.set_busy(True)

    def _speculation(self, prefs: Preferences) -> SpeculationSettings:
        """The tree shape: the user's budget, or with budget 0 (auto) the planner's budget, depth
        and mode for this pair on this machine (the engine's default budget without a plan)."""
        spec = prefs.speculation()
        plan = self.plan
        if prefs.budget > 0 or plan is None:
            return spec
        if getattr(plan, "mode", "") == "autoregressive":
            return replace(spec, mode="autoregressive")
        return replace(spec, budget=int(plan.budget), max_depth=int(plan.max_depth))  # type: ignore[attr-defined]

    def _on_worker_planned(self, plan: object) -> None:
        self.plan = plan

    def _save_partial(self, text: str) -> None:
        if self._answer_id:
            self.store.update_message(self._answer_id, text)

    def _on_worker_tokens_generated(self, request_id: int, text: str, tokens: int) -> None:
        if request_id != self._request_id:
            return
        self._tokens += tokens
        self.view.append_answer(text)
        self.status.show_live(self._tokens, time.monotonic() - self._started)

    def _on_worker_generation_finished(self, request_id: int, completion: Completion) -> None:
        if request_id != self._request_id:
            return
        stopped = completion.finish_reason == "cancelled"
        self.view.flush()
        text = self.view.answer_text
        self.store.update_message(self._answer_id, text, complete=not stopped, stats=stats_dict(completion.stats))
        self.view.end_answer("stopped" if stopped else "", complete=not stopped)
        self.status.show_stats(completion.stats, auto_budget=self.preferences.load().budget <= 0)
        self._finish_turn()
        self.answer_finished.emit(completion.finish_reason)

    def _on_worker_generation_failed(self, request_id: int, message: str) -> None:
        if request_id != self._request_id:
            return
        self.view.flush()
        self.store.update_message(self._answer_id, self.view.answer_text, complete=False)
        self.view.end_answer("failed", complete=False)
        self.show_error(message)
        self._finish_turn()
        self.answer_finished.emit("error")

    def _finish_turn(self) -> None:
        self._request_id = None
        self._answer_id = 0
        self.composer.set_busy(False)
        self.view.set_busy(False)
        self.sidebar.refresh()

    def _abandon_answer(self) -> None:
        """Leaving a conversation mid-answer: stop it and keep what was written."""
        if not self.busy:
            return
        self._active.cancel_generation()
        self.view.flush()
        self.store.update_message(self._answer_id, self.view.answer_text, complete=False)
        self.view.end_answer("stopped", complete=False)
        self._finish_turn()
