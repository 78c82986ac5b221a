"""The app's tokens per second against the CLI's, for the same model, prompt and answer.

    python scripts/app_vs_cli.py [--rounds 3] [--max-new-tokens 400] [--model PATH] [--offscreen]

Each round runs `python -m engine generate --json` and then the desktop app (a MainWindow with
its real worker thread, under Xvfb when there is one, else Qt's offscreen platform), each in a
fresh process, greedy, on the CPU, with the same system prompt and user message, so both write
the same answer. The two alternate so that a machine shared with other work slows both alike;
the best round of each is compared. Prints one row per run and the ratio, plus how much CPU the
app's GUI thread used while the answer streamed (seconds of GUI-thread CPU per second of answer).

The model defaults to the starter (SmolLM2-135M-Instruct) from the user cache. A benchmark that
prints a table: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant."
PROMPT = ("Write a long, detailed guide to planning a vegetable garden: soil, sunlight, watering, which "
          "vegetables to start with, and a month-by-month calendar. Use Markdown headings and lists.")


def _cli_run(model: str, max_new: int, penalty: float) -> dict:
    cmd = [sys.executable, "-m", "engine", "generate", "--target", model, "--system", SYSTEM, "--prompt", PROMPT,
           "--max-new-tokens", str(max_new), "--temperature", "0", "--repetition-penalty", str(penalty),
           "--device", "cpu", "--json"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tok_s": row["stats"]["tokens_per_second"], "tokens": row["stats"]["new_tokens"], "text": row["text"],
            "gui_cpu": None}


def _app_run(model: str, max_new: int, penalty: float, offscreen: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="specchat-appspeed-") as state:
        env = dict(os.environ, SPECCHAT_DATA_DIR=f"{state}/data", SPECCHAT_MODELS_DIR=f"{state}/models",
                   XDG_CONFIG_HOME=f"{state}/config", SPECCHAT_SKIP_WIZARD="1")
        if offscreen or not (env.get("DISPLAY") or _xvfb_display(env)):
            env["QT_QPA_PLATFORM"] = "offscreen"
        out = subprocess.run([sys.executable, __file__, "--child", model, str(max_new), str(penalty), state],
                             cwd=REPO, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(f"the app run failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


_XVFB: list[subprocess.Popen[bytes]] = []


def _xvfb_display(env: dict[str, str]) -> bool:
    """Start one Xvfb for the whole benchmark (the screenshots script's way); False without one."""
    sys.path.insert(0, str(REPO / "scripts"))
    from screenshots import _start_xvfb

    if not _XVFB:
        proc = _start_xvfb()
        if proc is None:
            return False
        _XVFB.append(proc)
    env["DISPLAY"] = os.environ["DISPLAY"]
    env["QT_QPA_PLATFORM"] = "xcb"
    return True


def _child(model: str, max_new: int, penalty: float, state: str) -> int:
    """In the app's process: open the main window, send the prompt, print the answer's stats."""
    sys.path.insert(0, str(REPO))
    from app.main import configure_runtime

    configure_runtime()
    from PySide6.QtCore import QEventLoop, QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.state.conversations import ConversationStore, default_path
    from app.state.preferences import Preferences
    from app.state.preferences_store import PreferencesStore

    app = QApplication(["specchat"])
    prefs = PreferencesStore(QSettings(f"{state}/specchat.ini", QSettings.Format.IniFormat))
    prefs.save(Preferences(target=model, draft="", temperature=0.0, max_new_tokens=max_new, device="cpu",
                           repetition_penalty=penalty, first_run_done=True, theme="light"))
    store = ConversationStore(default_path(Path(state) / "data"))
    window = MainWindow(prefs, store)
    window.resize(1280, 800)
    window.show()

    def wait(signal) -> None:  # type: ignore[no-untyped-def]
        loop = QEventLoop()
        signal.connect(lambda *_: loop.quit())
        QTimer.singleShot(600_000, loop.quit)
        loop.exec()

    if window.chat.model_state != "ready":
        wait(window.model_loaded)
    window.chat.system_edit.setText(SYSTEM)
    cpu0 = time.thread_time()
    window.chat.send(PROMPT)
    wait(window.chat.answer_finished)
    gui_cpu = time.thread_time() - cpu0
    last = store.messages(window.chat.conversation_id)[-1]
    stats = json.loads(last.stats or "{}")
    window.close()
    store.close()
    print(json.dumps({"tok_s": stats.get("tokens_per_second", 0.0), "tokens": stats.get("new_tokens", 0),
                      "text": last.content, "gui_cpu": gui_cpu / max(stats.get("seconds", 1.0), 1e-9)}))
    app.quit()
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, max_new, penalty, state = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
        return _child(model, max_new, penalty, state)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the starter's GGUF from the user cache)")
    parser.add_argument("--offscreen", action="store_true", help="Qt's offscreen platform even when Xvfb is there")
    args = parser.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO))
        from engine.loading.starter import starter_model

        model = str(starter_model())
    best = {"cli": 0.0, "app": 0.0}
    texts: dict[str, str] = {}
    print(f"{'round':>5} {'run':>4} {'tokens':>6} {'tok/s':>7} {'GUI CPU/s':>9}")
    try:
        for i in range(args.rounds):
            for kind in ("cli", "app"):
                row = (_cli_run(model, args.max_new_tokens, args.repetition_penalty) if kind == "cli"
                       else _app_run(model, args.max_new_tokens, args.repetition_penalty, args.offscreen))
                best[kind] = max(best[kind], row["tok_s"])
                texts.setdefault(kind, row["text"])
                gui = "" if row["gui_cpu"] is None else f"{row['gui_cpu']:.3f}"
                print(f"{i + 1:>5} {kind:>4} {row['tokens']:>6} {row['tok_s']:>7.2f} {gui:>9}", flush=True)
    finally:
        for proc in _XVFB:
            proc.terminate()
    same = texts.get("cli") == texts.get("app")
    print(f"best: CLI {best['cli']:.2f} tok/s, app {best['app']:.2f} tok/s, app/CLI {best['app'] / best['cli']:.3f}"
          f" ({'the same answer' if same else 'ANSWERS DIFFER'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
