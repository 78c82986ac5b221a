"""Small pieces of issue 17's polish: dated sidebar groups, export confirmed in the status bar,
no stale time to first token while the next answer is written."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from pathlib import Path

from answers import answering
from pytestqt.qtbot import QtBot

from app.chat.sidebar import Sidebar, date_group
from app.state.conversations import ConversationStore, default_path
from app.widgets.status import StatusBar


def test_conversations_are_grouped_by_date() -> None:
    today = date(2026, 11, 23)

    def at(days_ago: int) -> float:
        return datetime.combine(today - timedelta(days=days_ago), datetime.min.time()).timestamp() + 3600

    assert [date_group(at(d), today) for d in (0, 1, 3, 12, 45)] == \
        ["Today", "Yesterday", "Previous 7 days", "Previous 30 days", "October 2026"]


def test_export_is_confirmed_and_headings_are_not_conversations(qtbot: QtBot, tmp_path: Path) -> None:
    store = ConversationStore(default_path(tmp_path / "data"))
    try:
        conv = store.create("Lisbon")
        store.add_message(conv.id, "user", "three days in Lisbon?")
        target = tmp_path / "lisbon.md"
        sidebar = Sidebar(store, dialogs=answering(path=target))
        qtbot.addWidget(sidebar)
        sidebar.refresh(select=conv.id)
        assert sidebar.list.item(0).text() == "Today" and not sidebar.list.item(0).flags()  # a heading
        assert [i.text() for i in sidebar.conversation_items()] == ["Lisbon"]
        assert "last message" in sidebar.conversation_items()[0].toolTip()
        with qtbot.waitSignal(sidebar.exported) as exported:
            sidebar.export_current("md")
        assert exported.args == [str(target)] and "three days in Lisbon?" in target.read_text(encoding="utf-8")
    finally:
        store.close()


def test_a_new_answer_clears_the_last_ones_figures(qtbot: QtBot) -> None:
    status = StatusBar()
    qtbot.addWidget(status)
    status.show_first_token(0.52)
    status.show_live(40, 2.0)
    assert status.ttft.text() == "first token 0.52 s" and status.speed.text() == "20.0 tok/s"
    status.begin_answer()
    assert status.ttft.text() == "first token …" and status.speed.text() == "" and status.per_pass.text() == ""


def test_loading_shows_a_model_name_not_a_path(qtbot: QtBot) -> None:
    from engine.types import LoadProgress

    status = StatusBar()
    qtbot.addWidget(status)
    status.show_load_progress(LoadProgress("target", 0.0, "loading /home/ann/.local/share/specchat/models/llama on cpu"))
    assert status.progress_text.text() == "loading llama on cpu"
    assert status.progress.maximum() == 0  # a busy bar until a fraction comes, not 0 % for 20 s
