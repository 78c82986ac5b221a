"""Dialogs that answer at once, without a window (app/widgets/dialogs.py): imported by name, like
chat_helpers. No test patches QMessageBox, QInputDialog or QFileDialog."""

from __future__ import annotations

from pathlib import Path

from app.widgets.dialogs import Confirm, Dialogs


class Answers:
    """What the tests' dialogs answered and were asked. `confirm`: the answer to every Yes/No
    question (or a function of title and text); `text`: to every question asking for text;
    `path`: to every file or folder chooser. Everything asked is recorded in `asked`; a warning
    fails the test unless `warnings_expected`."""

    def __init__(self, confirm: bool | Confirm = False, text: str | None = None, path: Path | None = None,
                 warnings_expected: bool = False) -> None:
        self.confirm, self.text, self.path = confirm, text, path
        self.warnings_expected = warnings_expected
        self.asked: list[tuple[str, str]] = []  # (title, text or label)
        self.warnings: list[tuple[str, str]] = []

    def dialogs(self) -> Dialogs:
        def confirm(title: str, text: str) -> bool:
            self.asked.append((title, text))
            return self.confirm(title, text) if callable(self.confirm) else bool(self.confirm)

        def warn(title: str, text: str) -> None:
            if not self.warnings_expected:
                raise AssertionError(f"unexpected warning: {title}: {text}")
            self.warnings.append((title, text))

        def ask_text(title: str, label: str, _initial: str) -> str | None:
            self.asked.append((title, label))
            return self.text

        def ask_path(title: str, *_args: object) -> Path | None:
            self.asked.append((title, ""))
            return self.path

        return Dialogs(confirm, warn, ask_text, ask_path, ask_path, ask_path)


def answering(confirm: bool | Confirm = False, text: str | None = None, path: Path | None = None) -> Dialogs:
    """Dialogs that answer every question the same way (see Answers)."""
    return Answers(confirm, text, path).dialogs()


def refusing() -> Dialogs:
    """Dialogs that fail the test if anything is asked: a question nobody expected would block."""

    def refuse(*args: object) -> None:
        raise AssertionError(f"unexpected dialog: {args[:2]}")

    return Dialogs(refuse, refuse, refuse, refuse, refuse, refuse)  # type: ignore[arg-type]
