"""Small things a new user trips over (issue 26 item 11), with real widgets and real files:

- no label shows a literal "&" (a mnemonic without a buddy), in Settings or anywhere else;
- every Settings tab title is shown whole, at any font size;
- an exported conversation's file name keeps its words;
- the sidebar's "being written" mark stays in sight on a long title.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from answers import answering
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QFormLayout, QLabel, QLineEdit, QWidget
from pytestqt.qtbot import QtBot

from app.chat.sidebar import WRITING, Sidebar
from app.settings.dialog import SettingsDialog
from app.state.conversations import ConversationStore, export_file_name, title_from
from app.theme import apply_theme
from app.widgets.mnemonics import give_buddies, has_mnemonic, unpaired


def _labels_showing_an_ampersand(root: QWidget) -> list[str]:
    """Plain labels whose text marks a mnemonic but that have no buddy: Qt draws their "&"."""
    return [label.text() for label in root.findChildren(QLabel)
            if label.buddy() is None and label.textFormat() != Qt.TextFormat.RichText
            and not label.text().lstrip().startswith("<") and has_mnemonic(label.text())]


@pytest.mark.parametrize("font_size", [11, 15])
def test_settings_shows_no_ampersand_and_every_tab_whole(qtbot: QtBot, make_prefs, font_size: int) -> None:
    app = QApplication.instance()
    assert isinstance(app, QApplication)
    apply_theme(app, "light", font_size)
    try:
        dialog = SettingsDialog(make_prefs(server_enabled=True, server_port=0))
        qtbot.addWidget(dialog)
        dialog.show()
        qtbot.waitExposed(dialog)
        assert _labels_showing_an_ampersand(dialog) == []  # "API &key:", "&URL:" showed theirs
        key = next(label for label in dialog.findChildren(QLabel) if label.text() == "API &key:")
        assert isinstance(key.buddy(), QLineEdit)  # Alt+K reaches the key field
        bar = dialog.tabs.tabBar()
        for i in range(bar.count()):
            rect, text = bar.tabRect(i), bar.tabText(i).replace("&", "")
            assert bar.rect().contains(rect), text  # not behind scroll arrows
            assert rect.width() >= bar.fontMetrics().horizontalAdvance(text), text  # not "Hug…"
        dialog.close()
    finally:
        apply_theme(app, "light", 11)


def test_a_label_without_a_field_loses_its_ampersand(qtbot: QtBot) -> None:
    root = QWidget()
    qtbot.addWidget(root)
    form = QFormLayout(root)
    form.addRow("&Port:", QLineEdit())  # a buddy already
    row = QFormLayout()
    row.addRow(QLineEdit())
    form.addRow("API &key:", row)  # a layout: no buddy from Qt
    lonely = QLabel("Tom && Jerry &Co", root)  # not in a form
    give_buddies(root)
    assert unpaired(root) == [] and lonely.text() == "Tom && Jerry Co"


@pytest.mark.parametrize(("title", "name"), [
    (title_from("Explain speculative decoding to me. Answer in one sentence please, thanks"),
     "Explain speculative decoding to me. Answer in.md"),  # the title's "…" goes, not its words
    ("What is 2/3? Answer in one…", "What is 2-3 Answer in one.md"),
    ("Modèles et 模型: <notes> \"v2\"", "Modèles et 模型 - notes 'v2'.md"),
    ("Time 10:30 | plan\\draft", "Time 10-30 - plan-draft.md"),
    ("...hidden. ", "hidden.md"),
    ("CON", "CON (conversation).md"),
    ("\x00\t\n", "conversation.md"),
])
def test_an_export_name_keeps_the_words(title: str, name: str) -> None:
    assert export_file_name(title, "md") == name


def test_an_export_name_is_never_too_long_for_a_file_system() -> None:
    name = export_file_name("ü" * 300, "json")
    assert name.endswith(".json") and len(name.encode("utf-8")) <= 255


def test_the_export_dialog_proposes_the_title_and_the_file_is_written(qtbot: QtBot, conversations: ConversationStore,
                                                                       tmp_path: Path) -> None:
    conv = conversations.create(title_from("Why is the sky blue? Answer in one sentence, please, for a child"))
    conversations.add_message(conv.id, "user", "Why is the sky blue?")
    proposed: list[Path] = []

    def save_path(_title: str, suggested: Path, _filter: str) -> Path:
        proposed.append(suggested)
        return tmp_path / suggested.name

    sidebar = Sidebar(conversations, dialogs=replace(answering(), ask_save_path=save_path))
    qtbot.addWidget(sidebar)
    sidebar.refresh(select=conv.id)
    sidebar.export_current("md")
    assert Path(proposed[0]).name == "Why is the sky blue Answer in one sentence,.md"
    assert "Why is the sky blue?" in (tmp_path / Path(proposed[0]).name).read_text(encoding="utf-8")


def test_the_writing_mark_stays_in_sight_on_a_long_title(qtbot: QtBot, conversations: ConversationStore) -> None:
    long = conversations.create(title_from("Compare the three approaches we discussed for caching the prompt "
                                           "and say which one"))
    short = conversations.create("Short")
    sidebar = Sidebar(conversations)
    qtbot.addWidget(sidebar)
    sidebar.resize(220, 400)
    sidebar.show()
    qtbot.waitExposed(sidebar)
    sidebar.set_writing(long.id)
    items = {i.data(Qt.ItemDataRole.UserRole): i for i in sidebar.conversation_items()}
    marked = items[long.id]
    width = sidebar.list.visualItemRect(marked).width()
    shown = sidebar.list.fontMetrics().elidedText(marked.text(), Qt.TextElideMode.ElideRight, width)
    assert shown.startswith(WRITING.strip()) and shown.endswith("…")  # the title is cut, the mark is not
    assert "being written" in marked.toolTip() and not items[short.id].text().startswith(WRITING.strip())
    sidebar.set_writing(0)
    assert not any(i.text().startswith(WRITING.strip()) for i in sidebar.conversation_items())
