"""`specchat` with no arguments: the desktop app.

Start-up: on Linux with X11, the system libraries Qt needs (app/qt_platform.py: a missing one is
named with the command that installs it, instead of Qt's abort); one instance per data folder
(app/single_instance.py: a second launch raises the first window and exits before it logs
anything), the log file, the theme from preferences, the conversation database in the user data
dir, the main window, then the first-run wizard unless it ran already (or SPECCHAT_SKIP_WIZARD=1).

Test hooks (documented, used by tests/app/test_kill.py; no effect when unset):
- SPECCHAT_TEST_AUTOSEND=TEXT: send TEXT as soon as the model has loaded.
- SPECCHAT_TEST_SHOWN_LOG=FILE: after every render of a streaming answer, append one JSON line
  {"text": ...} with the text the window now shows, flushed, so a test that kills the app can
  compare what was on screen with what the database kept.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from PySide6.QtCore import QTimer
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from app.state.conversations import ConversationStore, default_path
from app.state.logfile import install_log_file
from app.state.preferences_store import PreferencesStore
from engine import paths
from engine.openmp import configure_waiting

from .main_window import MainWindow
from .qt_platform import startup_problem
from .single_instance import Running, acquire

log = logging.getLogger(__name__)


def _install_test_hooks(window: MainWindow) -> None:
    autosend = os.environ.get("SPECCHAT_TEST_AUTOSEND")
    if autosend:
        def send_once() -> None:
            window.model_loaded.disconnect(send_once)
            window.chat.send(autosend)

        window.model_loaded.connect(send_once)
    shown_log = os.environ.get("SPECCHAT_TEST_SHOWN_LOG")
    if shown_log:
        out = open(shown_log, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the app

        def record(text: str) -> None:
            out.write(json.dumps({"text": text}) + "\n")
            out.flush()

        window.chat.view.rendered.connect(record)


def _run_wizard(window: MainWindow, store: PreferencesStore) -> None:
    try:
        from app.wizard.first_run import FirstRunWizard

        wizard = FirstRunWizard(store, window)
    except Exception:  # noqa: BLE001 - without a wizard the empty state still offers the starter
        log.exception("the first-run wizard could not open")
        return
    wizard.exec()


def show_store_notices(window: MainWindow, conversations: ConversationStore) -> None:
    """A damaged database set aside, or chats kept in memory only: said in the chat's banner,
    now or whenever it happens."""
    conversations.on_notice = lambda message: window.chat.show_error(message, "store")
    if conversations.notice:
        window.chat.show_error(conversations.notice, "store")


ICON_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
DESKTOP_FILE_NAME = "specchat"  # the installer's specchat.desktop: Wayland app id, taskbar grouping


def app_icon() -> QIcon:
    """The window and taskbar icon, from the PNG set the installer also uses."""
    icon = QIcon()
    for size in ICON_SIZES:
        path = paths.resource(f"icons/specchat-{size}.png")
        if path.is_file():
            icon.addFile(str(path))
    return icon


def configure_runtime() -> None:
    """Process-wide settings the app needs before torch is first imported (in the worker).

    PyTorch's OpenMP threads spin while they wait for work. With the decode loop in a worker
    thread rather than the thread that first started OpenMP, spinning teams fight over the
    cores (the starter ran at 0.5-1.5 tok/s in the worker against 8-13 tok/s once waiting was
    passive); a bounded spin (engine.openmp) keeps the fused decode step's speed without that.
    A user's own setting wins.
    """
    configure_waiting()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    configure_runtime()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    problem = startup_problem(argv)  # before QApplication, which would abort with a one-library hint
    if problem:
        print(problem, file=sys.stderr)
        return 1
    app = QApplication.instance() or QApplication(argv)
    assert isinstance(app, QApplication)
    app.setApplicationName("SpecChat")
    app.setOrganizationName("SpecChat")
    app.setApplicationDisplayName("SpecChat")
    app.setDesktopFileName(DESKTOP_FILE_NAME)
    app.setWindowIcon(app_icon())
    data = paths.data_dir()
    instance = acquire(data)  # the data folder's lock, before any window: one instance per folder
    if isinstance(instance, Running):
        print("SpecChat is already running; its window was raised." if instance.raised else
              "SpecChat is already running (it did not answer; see its window or the log).")
        return 0
    install_log_file()  # only the instance that stays logs its start
    store = PreferencesStore()
    conversations = ConversationStore(default_path(data))
    window = MainWindow(store, conversations, endpoint=os.environ.get("HF_ENDPOINT"))
    show_store_notices(window, conversations)
    instance.raise_requested.connect(window.raise_window)
    _install_test_hooks(window)
    window.show()
    if not store.load().first_run_done and os.environ.get("SPECCHAT_SKIP_WIZARD") != "1":
        QTimer.singleShot(0, lambda: _run_wizard(window, store))
    code = app.exec()
    conversations.close()
    if not window.engine_stopped:
        # the engine thread is stuck in a long step of a load; destroying a running QThread
        # aborts the process, so leave now (the database is closed and complete)
        logging.shutdown()
        os._exit(int(code))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
