"""Screenshots of real thinking models in the chat window (issue 30): the two scripted tiny models
(engine/testing/scripted_model.py; Qwen 3 Thinking's <think> template and gpt-oss's harmony
template), each loaded with its noisy draft by the app's own worker thread, answer two messages
typed into the composer. The first answer's Thinking block folded itself when the answer began;
the second one is opened by a click, so the picture shows both states.

    python scripts/thinking_screenshot.py [--out DIR] [--theme light|dark]

Writes DIR/thinking-real-qwen.png and DIR/thinking-real-harmony.png (default DIR: the current
folder). Runs on Qt's offscreen platform unless QT_QPA_PLATFORM says otherwise; user state and
the models go to a temporary folder. Not a test: nothing here is asserted beyond the answers
being the scripts'.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHOTS = {"qwen3-thinking": ("thinking-real-qwen.png", "Qwen3-Thinking (scripted tiny)"),
         "gpt-oss-harmony": ("thinking-real-harmony.png", "gpt-oss (scripted tiny)")}
QUESTIONS = ("Hi there!", "Hello again.")


def _qwen_thinking_template() -> str:
    spec = importlib.util.spec_from_file_location("templates", REPO / "tests" / "engine" / "serving" / "templates.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.QWEN_THINKING)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path.cwd())
    parser.add_argument("--theme", choices=("light", "dark"), default="light")
    args = parser.parse_args()

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    tmp = Path(tempfile.mkdtemp(prefix="thinking-shot-"))
    for name in ("DATA", "CACHE", "MODELS", "CONFIG"):
        os.environ[f"SPECCHAT_{name}_DIR"] = str(tmp / name.lower())
    os.environ["SPECCHAT_SKIP_WIZARD"] = "1"
    os.environ["HOME"] = str(tmp / "home")

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.state.conversations import ConversationStore, default_path
    from app.state.preferences import Preferences
    from app.state.preferences_store import PreferencesStore
    from engine.testing.thinking_scripts import scripted_thinking_models

    app = QApplication([])
    pairs = scripted_thinking_models(tmp / "cache", _qwen_thinking_template())
    for key, (file_name, shown_name) in SHOTS.items():
        pair = pairs[key]
        target, draft = tmp / "models" / shown_name, tmp / "models" / f"{shown_name} draft"
        shutil.copytree(pair.target, target)
        shutil.copytree(pair.draft, draft)
        store = ConversationStore(default_path(tmp / "data" / key))
        prefs = PreferencesStore(QSettings(str(tmp / f"{key}.ini"), QSettings.Format.IniFormat))
        prefs.save(Preferences(first_run_done=True, target=str(target), draft=str(draft), keep_draft=True,
                               device="cpu", temperature=0.0, max_new_tokens=60, theme=args.theme))
        window = MainWindow(prefs, store)
        window.resize(1000, 720)
        window.show()
        _wait(app, lambda: window.chat.model_state == "ready", 120)
        for question in QUESTIONS:
            done: list[str] = []
            window.chat.answer_finished.connect(done.append)
            window.chat.composer.input.setPlainText(question)
            window.chat.composer.send_button.click()  # as the user sends it: the box empties
            _wait(app, lambda: bool(done), 60)
            window.chat.answer_finished.disconnect(done.append)
            last = window.chat.view.messages[-1]
            if (last.text, last.reasoning) != (pair.script.answer, pair.script.reasoning):
                print(f"{key}: unexpected answer {last.text!r} / {last.reasoning!r}", file=sys.stderr)
                return 1
        last = window.chat.view.messages[-1]
        assert last.thinking is not None
        last.thinking.header.click()  # the user opens the second answer's reasoning
        _wait(app, lambda: False, 0.5)
        window.chat.view.scroll_to_bottom()
        _wait(app, lambda: False, 0.3)
        out = args.out / file_name
        window.grab().save(str(out))
        print(out)
        window.close()
        store.close()
        app.processEvents()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _wait(app: object, done: object, seconds: float) -> None:
    """Run the event loop until done() or `seconds` have passed."""
    from PySide6.QtCore import QThread
    from PySide6.QtWidgets import QApplication

    assert isinstance(app, QApplication) and callable(done)
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        app.processEvents()
        QThread.msleep(20)


if __name__ == "__main__":
    sys.exit(main())
