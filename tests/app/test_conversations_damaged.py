"""A damaged conversations database and a data folder that cannot be written: the app still
opens and chats, keeps the damaged file, recovers what SQLite can read, and says so in its
banner (issue 18, items 3 and 4)."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from filesystems import read_only, small_disk
from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot

from app.main import show_store_notices
from app.main_window import MainWindow
from app.state.conversations import ConversationStore, default_path
from app.state.preferences_store import PreferencesStore
from app.state.recovery import LOST_TITLE

LOAD_MS = 120_000


def _filled(path: Path, conversations: int = 200, per: int = 6) -> dict[int, tuple[str, list[tuple[int, str]]]]:
    """A database of `conversations` chats of `per` messages; returns {id: (title, [(message id, text)])}."""
    store = ConversationStore(path)
    rows: dict[int, tuple[str, list[tuple[int, str]]]] = {}
    for i in range(conversations):
        conv = store.create(f"chat {i}")
        store.set_engine(conv.id, f"remote-{i % 3}")
        msgs = []
        for j in range(per):
            text = f"message {i}.{j} " + "lorem ipsum " * 30
            message = store.add_message(conv.id, "user" if j % 2 == 0 else "assistant", text)
            if message.role == "assistant":  # a thinking model's reasoning, apart from the answer
                store.update_message(message.id, text, reasoning=f"thought {i}.{j}", reasoning_seconds=j)
            msgs.append((message.id, text))
        rows[conv.id] = (conv.title, msgs)
    store.close()
    return rows


def _others(folder: Path, path: Path) -> list[Path]:
    """Files in `folder` other than the live database and its WAL/SHM."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith(path.name))


def test_garbage_bytes_are_set_aside_and_a_fresh_database_starts(tmp_path: Path) -> None:
    path = default_path(tmp_path)
    garbage = random.Random(3).randbytes(50_000)
    path.write_bytes(garbage)
    store = ConversationStore(path)
    [kept] = _others(tmp_path, path)
    assert kept.read_bytes() == garbage  # kept as it was, never deleted
    assert store.notice is not None and str(kept) in store.notice and "nothing could be recovered" in store.notice
    assert store.conversations() == []
    conv = store.create("after")
    store.add_message(conv.id, "user", "still works")
    store.close()
    again = ConversationStore(path)
    assert again.notice is None and [m.content for m in again.messages(conv.id)] == ["still works"]
    again.close()


def test_a_truncated_database_gives_back_every_row_sqlite_can_still_read(tmp_path: Path) -> None:
    path = default_path(tmp_path)
    original = _filled(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy cut short, a disk that filled up
    store = ConversationStore(path)
    [kept] = _others(tmp_path, path)
    assert kept.read_bytes() == data[: len(data) // 2]
    recovered = store.conversations()
    messages = {m.id: m.content for c in recovered for m in store.messages(c.id)}
    total = sum(len(m) for _, m in original.values())
    assert store.recovery is not None
    assert (store.recovery.conversations, store.recovery.messages) == (len(recovered), len(messages))
    assert f"{len(recovered)} conversations and {len(messages)} messages were recovered" in (store.notice or "")
    assert 0 < len(messages) < total  # half the pages are gone, the other half came back
    originals = {mid: text for _, msgs in original.values() for mid, text in msgs}
    for conv in recovered:  # what came back is exactly what was written, in its own conversation
        assert conv.title in (original[conv.id][0], LOST_TITLE)
        if conv.title != LOST_TITLE:  # which engine it runs on comes back too, or '' (local) when damaged
            assert conv.engine in (f"remote-{int(conv.title.split()[1]) % 3}", "")
        assert all(m.id in dict(original[conv.id][1]) for m in store.messages(conv.id))
    titled = [conv for conv in recovered if conv.title != LOST_TITLE]
    assert titled and sum(conv.engine != "" for conv in titled) > len(titled) // 2
    assert all(originals[mid] == text for mid, text in messages.items())
    answers = [m for c in recovered for m in store.messages(c.id) if m.role == "assistant"]
    # each answer's reasoning comes back with it ("message i.j ..." thought "thought i.j" for j seconds)
    assert answers and all(m.reasoning == "thought " + m.content.split()[1] for m in answers)
    assert all(m.reasoning_seconds == int(m.content.split()[1].split(".")[1]) for m in answers)
    store.create("new chat")  # and the fresh database takes writes
    store.close()


def test_a_read_only_data_folder_keeps_the_chats_in_memory(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    path = default_path(folder)
    original = _filled(path, conversations=3, per=2)
    before = sorted(p.name for p in folder.iterdir())
    with read_only(folder):
        store = ConversationStore(path)
        assert store.in_memory and store.notice is not None
        assert str(folder) in store.notice and "memory" in store.notice
        assert {c.id for c in store.conversations()} == set(original)  # what the file held is all there
        conv = store.create("new")
        store.add_message(conv.id, "user", "hello")
        assert [m.content for m in store.messages(conv.id)] == ["hello"]
        store.close()
        assert sorted(p.name for p in folder.iterdir()) == before  # nothing written


def test_a_data_folder_that_fills_up_mid_session_switches_to_memory_once(tmp_path: Path) -> None:
    told: list[str] = []
    with small_disk(tmp_path / "data", 4 << 20) as folder:
        store = ConversationStore(default_path(folder), on_notice=told.append)
        conv = store.create("chat")
        store.add_message(conv.id, "user", "first")
        assert store.notice is None
        _fill(folder)
        store.add_message(conv.id, "assistant", "second " * 2000)  # raised sqlite3.OperationalError before
        store.add_message(conv.id, "user", "third")
        assert [m.content.split()[0] for m in store.messages(conv.id)] == ["first", "second", "third"]
        assert store.in_memory and len(told) == 1 and "memory" in told[0] and str(folder) in told[0]
        store.close()


def test_the_window_opens_over_a_damaged_database_and_says_which_file_was_kept(
        qtbot: QtBot, make_host, make_prefs: Callable[..., PreferencesStore], tmp_path: Path) -> None:
    path = default_path(tmp_path / "data")
    path.parent.mkdir()
    path.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 20)
    store = ConversationStore(path)
    window = MainWindow(make_prefs(), store, host=make_host())
    qtbot.addWidget(window)
    show_store_notices(window, store)
    window.show()
    assert store.recovery is not None and str(store.recovery.kept) in window.chat.banner.message
    window.close()
    store.close()


def _fill(folder: Path) -> None:
    """Another program takes the rest of the disk (on a tmpfs, even opening a file can fail
    when it is full already)."""
    with pytest.raises(OSError):
        with (folder / "filler").open("wb") as filler:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()


def test_sending_when_the_data_folder_cannot_take_a_write_answers_and_warns_in_the_banner(
        qtbot: QtBot, make_host, chat_prefs: PreferencesStore, tmp_path: Path) -> None:
    with small_disk(tmp_path / "data", 4 << 20) as folder:
        store = ConversationStore(default_path(folder))
        window = MainWindow(chat_prefs, store, host=make_host())
        qtbot.addWidget(window)
        show_store_notices(window, store)
        window.show()
        qtbot.waitUntil(lambda: window.chat.model_state == "ready", timeout=LOAD_MS)
        _fill(folder)
        with qtbot.waitSignal(window.chat.answer_finished, timeout=LOAD_MS):
            box = window.chat.composer.input
            box.setFocus()
            qtbot.keyClicks(box, "hello")
            qtbot.keyClick(box, Qt.Key.Key_Return)  # raised sqlite3.OperationalError in the slot before
            qtbot.waitUntil(lambda: window.chat.busy, timeout=5_000)
            window.chat.stop()
        assert "cannot write" in window.chat.banner.message and str(folder) in window.chat.banner.message
        messages = store.messages(window.chat.conversation_id)
        assert [m.role for m in messages] == ["user", "assistant"] and messages[0].content == "hello"
        window.close()
        store.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_recovery_never_raises_on_random_damage(tmp_path: Path, damage: str) -> None:
    """Seeded: random pages overwritten or the file cut at random points; opening always works."""
    rng = random.Random(11)
    source = tmp_path / "source.sqlite3"
    _filled(source, conversations=40, per=4)
    data = source.read_bytes()
    for case in range(8):
        path = default_path(tmp_path / f"{damage}{case}")
        path.parent.mkdir()
        if damage == "truncated":
            path.write_bytes(data[: rng.randrange(100, len(data))])
        else:
            broken = bytearray(data)
            for _ in range(rng.randrange(1, 6)):
                at = rng.randrange(len(broken))
                broken[at:at + 512] = rng.randbytes(512)[: len(broken) - at]
            path.write_bytes(bytes(broken))
        store = ConversationStore(path)  # never raises
        store.add_message(store.create("after").id, "user", "ok")
        assert sqlite3.connect(path).execute("PRAGMA quick_check").fetchone()[0] == "ok"
        store.close()


def test_the_window_opens_over_a_newer_database_and_its_banner_says_what_to_do(
        qtbot: QtBot, make_prefs: Callable[..., PreferencesStore], make_host, tmp_path: Path) -> None:
    path = default_path(tmp_path / "data")
    path.parent.mkdir(parents=True)
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    store = ConversationStore(path)
    window = MainWindow(make_prefs(), store, host=make_host())
    qtbot.addWidget(window)
    try:
        show_store_notices(window, store)
        window.show()
        banner = window.chat.banner
        assert banner.isVisible() and banner.cause == "store"
        assert "saved by a newer version of SpecChat" in banner.message and "update SpecChat" in banner.message
        assert window.chat.composer.isEnabled()  # the window works; chats are kept in memory
    finally:
        window.close()
        store.close()
