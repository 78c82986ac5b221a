"""The main window: a toolbar to switch between Chat and Models, the status bar, shortcuts,
and the engine's life cycle (load the chosen pair at start and whenever preferences change it;
a cancellable progress bar while it loads; errors as a banner, taken away once their cause is:
a later load that works clears a failed one's).

Pages from the other half of the app (models page, settings dialog) are created lazily, so a
problem in one of them never keeps the chat from opening.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QMainWindow,
    QScrollArea,
    QStackedWidget,
    QToolBar,
    QWidget,
)

from app.chat.markdown import warm_up_highlighting
from app.chat.page import ChatPage
from app.chat.reasoning import answer_format
from app.state.conversations import ConversationStore
from app.state.names import short_name
from app.state.preferences import Preferences
from app.state.preferences_store import PreferencesStore
from app.state.running import RunningPair, running_pair
from app.widgets.dialogs import Dialogs
from app.widgets.status import StatusBar
from app.workers.api_server import ApiServer
from app.workers.engine_worker import EngineHost
from app.workers.remote_worker import RemoteHost
from engine.decoding.draft_choice import DraftChoice
from engine.shapes import Placement
from engine.types import LoadProgress, LoadSettings

if TYPE_CHECKING:  # the models page opens lazily (a problem in it never keeps the chat from opening);
    # BudgetChoice's module imports torch, which the GUI thread never does
    from app.models.page import ModelsPage
    from engine.decoding.auto_budget import BudgetChoice

from .theme import apply_theme, markdown_palette

# closing waits this long for the engine thread: it saves the long conversations' caches first
PERSIST_WAIT_MS = 30_000

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _PairKey:
    target: str
    draft: str
    load: LoadSettings


def _key(prefs: Preferences) -> _PairKey:
    return _PairKey(prefs.target, prefs.draft, prefs.load_settings())


class MainWindow(QMainWindow):
    """Signals: model_loaded(), model_failed(str)."""

    model_loaded = Signal()
    model_failed = Signal(str)

    def __init__(self, preferences: PreferencesStore, conversations: ConversationStore,
                 host: EngineHost | None = None, endpoint: str | None = None,
                 parent: QWidget | None = None, dialogs: Dialogs | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("SpecChat")
        self.setAccessibleName("SpecChat")
        self.resize(1180, 780)
        self.preferences = preferences
        self.conversations = conversations
        prefs = preferences.load()
        app = QApplication.instance()
        if isinstance(app, QApplication):  # before any widget exists, so every widget gets the font
            apply_theme(app, prefs.theme, prefs.font_size)
        self._look = (prefs.theme, prefs.font_size)
        self.endpoint = endpoint
        self.dialogs = dialogs or Dialogs.over(self)  # every confirm and ask of the pages (tests answer them)
        self.host = host if host is not None else EngineHost(self)
        self._loaded_key: _PairKey | None = None
        self._loading_key: _PairKey | None = None
        self._load_id = 0  # the load (or starter preparation) whose results count
        self._draft_choice: tuple[int, DraftChoice | None] = (0, None)  # the engine's, by load id
        self.running: RunningPair | None = None  # what the engine loaded (Settings -> Engine, Models page)
        self._warmed = False
        self.engine_stopped = True  # False after closing if the engine thread would not stop
        threading.Thread(target=warm_up_highlighting, name="pygments-warm-up", daemon=True).start()
        self.status = StatusBar(self)
        self.setStatusBar(self.status)
        self.status.load_cancel_requested.connect(self.cancel_load)
        self.pages = QStackedWidget()
        # conversations on remote engines (Settings > Engines); its request ids come from the
        # engine host's counter: the chat page hears both workers
        self.remote_host = RemoteHost(self, ids=self.host.ids)
        self.api = ApiServer(self.host, self)  # Settings > Server: the loaded model over the OpenAI API
        self.api.status_changed.connect(self._on_api_status_changed)
        self.chat = ChatPage(conversations, self.host, preferences, self.status, remote=self.remote_host,
                             dialogs=self.dialogs)
        self.chat.starter_requested.connect(self.use_starter)
        self.chat.models_requested.connect(self.show_models)
        self.pages.addWidget(self.chat)
        self.models_page: ModelsPage | None = None
        self.setCentralWidget(self.pages)
        self._build_actions()
        worker = self.host.worker
        worker.load_progressed.connect(self._on_worker_load_progressed)
        worker.loaded.connect(self._on_worker_loaded)
        worker.draft_chosen.connect(self._on_worker_draft_chosen)
        worker.load_failed.connect(self._on_worker_load_failed)
        worker.starter_prepared.connect(self._on_worker_starter_prepared)
        worker.budget_chosen.connect(self._on_worker_budget_chosen)
        preferences.changed.connect(self._on_preferences_changed)
        self.chat.set_palette(markdown_palette(prefs.theme))
        self.api.apply(prefs)
        self.ensure_loaded(prefs)

    # ---- actions and shortcuts -------------------------------------------------------------
    def _build_actions(self) -> None:
        bar = QToolBar("Main")
        bar.setObjectName("mainToolbar")
        bar.setAccessibleName("Main toolbar")
        bar.setMovable(False)
        bar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.addToolBar(bar)
        group = QActionGroup(self)
        self.chat_action = QAction("Chat", self, checkable=True, checked=True)
        self.chat_action.setToolTip("Chat")
        self.chat_action.triggered.connect(self.show_chat)
        self.models_action = QAction("Models", self, checkable=True)
        self.models_action.setToolTip("Download models and choose the target/draft pair")
        self.models_action.triggered.connect(self.show_models)
        for action in (self.chat_action, self.models_action):
            group.addAction(action)
            bar.addAction(action)
        bar.addSeparator()
        self.new_action = QAction("New chat", self)
        self.new_action.setShortcut(QKeySequence.StandardKey.New)
        self.new_action.setToolTip("New chat (Ctrl+N)")
        self.new_action.triggered.connect(self.new_chat)
        self.settings_action = QAction("Settings", self)
        self.settings_action.setShortcut(QKeySequence("Ctrl+,"))
        self.settings_action.setToolTip("Settings (Ctrl+,)")
        self.settings_action.triggered.connect(self.open_settings)
        self.find_action = QAction("Search conversations", self)
        self.find_action.setShortcut(QKeySequence.StandardKey.Find)
        self.find_action.triggered.connect(self.focus_search)
        self.quit_action = QAction("Quit", self)
        self.quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        self.quit_action.triggered.connect(self.close)
        bar.addAction(self.new_action)
        bar.addAction(self.settings_action)
        for action in (self.find_action, self.quit_action):
            self.addAction(action)  # shortcuts work without a toolbar button
        self.stop_shortcut = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        self.stop_shortcut.setContext(Qt.ShortcutContext.WindowShortcut)
        self.stop_shortcut.activated.connect(self.chat.escape)
        for widget in bar.findChildren(QWidget):
            default = getattr(widget, "defaultAction", None)  # the toolbar's buttons
            shown = default() if default is not None else None
            if shown is not None:
                widget.setAccessibleName(shown.text())

    def show_chat(self) -> None:
        self.pages.setCurrentWidget(self.chat)
        self.chat_action.setChecked(True)

    def show_models(self) -> None:
        page = self._ensure_models_page()
        if page is None:
            return
        self.pages.setCurrentWidget(self._models_scroll)
        self.models_action.setChecked(True)

    def _ensure_models_page(self) -> ModelsPage | None:
        if self.models_page is None:
            try:
                from app.models.page import ModelsPage

                page = ModelsPage(self.preferences, self, endpoint=self.endpoint, running=self.running,
                                  dialogs=self.dialogs)
            except Exception as exc:  # noqa: BLE001 - the chat keeps working without it
                log.exception("the models page failed to open")
                self.chat.show_error(f"The Models page could not open ({exc}).", "models_page")
                return None
            self.chat.clear_error("models_page")
            page.active_pair_changed.connect(lambda _t, _d: self.show_chat())
            self.models_page = page
            self._models_scroll = scroll = QScrollArea()  # below its natural size (half a screen, 640x480) the page scrolls
            scroll.setWidgetResizable(True)
            scroll.setFrameShape(QFrame.Shape.NoFrame)
            scroll.setWidget(page)
            self.pages.addWidget(scroll)
        return self.models_page

    def new_chat(self) -> None:
        self.show_chat()
        self.chat.new_conversation()

    def focus_search(self) -> None:
        self.show_chat()
        self.chat.sidebar.search.setFocus()
        self.chat.sidebar.search.selectAll()

    def open_settings(self) -> None:
        try:
            from app.settings.dialog import SettingsDialog

            dialog = SettingsDialog(self.preferences, self, running=self.running)
        except Exception as exc:  # noqa: BLE001
            log.exception("the settings dialog failed to open")
            self.chat.show_error(f"Settings could not open ({exc}).", "settings")
            return
        self.chat.clear_error("settings")
        dialog.exec()
        self.chat.reload_presets()

    def raise_window(self) -> None:
        """Another launch asked for this window."""
        if self.isMinimized():
            self.showNormal()
        self.show()
        self.raise_()
        self.activateWindow()

    # ---- the engine ----------------------------------------------------------------------
    def ensure_loaded(self, prefs: Preferences) -> None:
        """Load the preferred pair unless it is loaded or loading already."""
        moved = _starter_as_gguf(prefs.target)
        if moved:  # an older version's choice of the starter's FP32 folder: the GGUF runs now
            self.preferences.update(target=moved)  # -> _on_preferences_changed -> here again
            return
        key = _key(prefs)
        if not prefs.target:
            self.status.show_no_model()
            self.chat.clear_error("load")  # nothing is to be loaded now
            self.chat.set_model_state("none")
            if not self._warmed:
                self._warmed = True
                self.host.warm_up()  # import torch now, not in the middle of the first load
            return
        self._warmed = True
        if key in (self._loaded_key, self._loading_key):
            return
        if _unbuilt_starter(prefs.target):  # the starter chosen by id (an older wizard): fetch its one GGUF
            self.use_starter()
            return
        if self.chat.busy:
            self.chat.stop()
        self._loading_key = key
        self._loaded_key = None
        self.chat.set_model_state("loading")
        self.status.show_no_model(f"Loading {short_name(prefs.target)}…")
        self.status.show_load_progress(LoadProgress("target", 0.0, f"Loading {short_name(prefs.target)}…"))
        target, draft = (_local_path(spec, prefs.models_path()) for spec in (prefs.target, prefs.draft))
        self._load_id = self.host.load(target, draft, key.load)

    def cancel_load(self) -> None:
        self.host.cancel_load()

    def use_starter(self) -> None:
        self.chat.set_model_state("loading")
        self._load_id = self.host.prepare_starter()

    def _on_api_status_changed(self, text: str) -> None:
        self.status.show_api(text, self.api.tooltip())

    def _on_worker_starter_prepared(self, load_id: int, path: str) -> None:
        if load_id == self._load_id:
            self.preferences.update(target=path, draft="")  # -> _on_preferences_changed -> load

    def _on_worker_load_progressed(self, progress: LoadProgress) -> None:
        self.status.show_load_progress(progress)

    def _on_worker_loaded(self, load_id: int, target: str, draft: str, placement: Placement | None,
                          _context: int, chat_template: str) -> None:
        if load_id != self._load_id:
            return  # a load that was replaced by a newer one
        self._loaded_key, self._loading_key = self._loading_key, None
        self.status.hide_load_progress()
        chosen_id, choice = self._draft_choice
        self.status.show_pair(target, draft, placement, choice if chosen_id == load_id else None)
        self.chat.clear_error("load")  # an earlier load's failure is no longer true
        prefs = self.preferences.load()
        self.running = running_pair(target, draft, placement, prefs.tree_mode, prefs.keep_draft, chat_template)
        self.chat.answer_format = answer_format(chat_template)  # its answers' reasoning and calls, split
        if self.models_page is not None:
            self.models_page.set_running(self.running)
        self.chat.set_model_state("ready")
        self.model_loaded.emit()

    def _on_worker_draft_chosen(self, load_id: int, choice: DraftChoice) -> None:
        self._draft_choice = (load_id, choice)  # shown with the pair when that load is done

    def _on_worker_budget_chosen(self, _request_id: int, choice: BudgetChoice) -> None:
        """Budget "auto" chose for an answer: what runs says whether it leaves the draft out."""
        if self.running is None or not self.running.draft:
            return
        running = replace(self.running, auto_off="" if choice.draft else choice.reason)
        if running != self.running:
            self.running = running
            if self.models_page is not None:
                self.models_page.set_running(running)

    def _on_worker_load_failed(self, load_id: int, message: str) -> None:
        if load_id != self._load_id:
            return
        self._loading_key = None
        self.running = None
        if self.models_page is not None:
            self.models_page.set_running(None)
        self.status.hide_load_progress()
        has_target = bool(self.preferences.load().target)
        self.status.show_no_model("No model loaded")
        self.chat.set_model_state("failed" if has_target else "none", message)
        self.chat.show_error(message, "load")
        self.model_failed.emit(message)

    def _on_preferences_changed(self, prefs: Preferences) -> None:
        self._apply_appearance(prefs)
        self.chat.reload_presets()
        self.api.apply(prefs)
        self.ensure_loaded(prefs)

    def _apply_appearance(self, prefs: Preferences) -> None:
        look = (prefs.theme, prefs.font_size)
        if look == getattr(self, "_look", None):
            return  # re-styling every widget takes a while; only when the look changed
        self._look = look
        app = QApplication.instance()
        if isinstance(app, QApplication):
            apply_theme(app, prefs.theme, prefs.font_size)
        self.chat.set_palette(markdown_palette(prefs.theme))

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802
        self.chat.stop()
        if self.models_page is not None:
            self.models_page.shutdown()  # its download thread
        self.api.stop()  # before the engine: its requests end first
        self.remote_host.shutdown()
        self.host.persist_caches()  # queued before the thread's quit: long conversations are saved
        self.engine_stopped = self.host.shutdown(PERSIST_WAIT_MS)
        super().closeEvent(event)


def _local_path(spec: str, models_dir: Path) -> str:
    """A catalog or repo id -> its folder in the user's models folder (which may not be the
    default one the engine would search); paths and unknown ids pass through unchanged, so the
    engine's own lookup reports what is missing."""
    if not spec or Path(spec).expanduser().exists():
        return spec
    from engine.store import resolve_model, usable_catalog
    from engine.store.pypi import built_starter

    if spec == usable_catalog().starter and built_starter() is not None:  # the one starter GGUF
        return str(built_starter())

    found = resolve_model(spec, models_dir)
    return str(found) if found is not None else spec


def _starter_as_gguf(spec: str) -> str:
    """The starter's GGUF when `spec` is its FP32 folder (what older versions ran and saved in the
    preferences) and the GGUF is in the cache; else ""."""
    from engine.store.pypi import built_starter, converted_starter

    folder, gguf = converted_starter(), built_starter()
    if not spec or folder is None or gguf is None or Path(spec).expanduser() != folder:
        return ""
    return str(gguf)


def _unbuilt_starter(spec: str) -> bool:
    """The catalog's starter named by id while its one GGUF (engine.loading.starter) is not
    fetched: an older wizard's choice, whose GGUF copy in the models folder must not run."""
    from engine.store import usable_catalog
    from engine.store.pypi import built_starter

    return bool(spec) and spec == usable_catalog().starter and built_starter() is None
