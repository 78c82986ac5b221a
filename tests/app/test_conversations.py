"""The SQLite conversation store: CRUD, search, partial answers, export, schema migrations."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from app.chat.sidebar import export_conversation
from app.state.conversations import MIGRATIONS, SCHEMA_VERSION, ConversationStore, title_from


def test_conversations_and_messages_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    store = ConversationStore(path)
    a = store.create("First", "Be brief.")
    b = store.create("Second")
    store.add_message(a.id, "user", "hello")
    answer = store.add_message(a.id, "assistant", "", complete=False)
    store.update_message(answer.id, "hi th")
    store.update_message(answer.id, "hi there", complete=True, stats={"tokens_per_second": 3.5})
    store.rename(b.id, "Renamed")
    store.close()

    again = ConversationStore(path)
    assert {c.title for c in again.conversations()} == {"First", "Renamed"}
    msgs = again.messages(a.id)
    assert [(m.role, m.content, m.complete) for m in msgs] == [("user", "hello", True), ("assistant", "hi there", True)]
    assert json.loads(msgs[1].stats) == {"tokens_per_second": 3.5}
    assert again.get(a.id).system_prompt == "Be brief."  # type: ignore[union-attr]
    assert again.conversations()[0].id == a.id  # the last one written to comes first
    assert again._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


def test_search_matches_titles_and_message_text_literally(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    a = store.create("Trip to Paris")
    b = store.create("Code")
    store.add_message(b.id, "user", "what does 100% mean in a_b?")
    assert [c.id for c in store.conversations("paris")] == [a.id]
    assert [c.id for c in store.conversations("100%")] == [b.id]
    assert [c.id for c in store.conversations("a_b")] == [b.id]
    assert store.conversations("a%b") == []  # % is literal, not a wildcard
    assert len(store.conversations("  ")) == 2


def test_delete_from_a_message_and_delete_a_conversation(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    conv = store.create()
    ids = [store.add_message(conv.id, role, text).id
           for role, text in (("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))]
    store.delete_messages_from(conv.id, ids[2])
    assert [m.content for m in store.messages(conv.id)] == ["q1", "a1"]
    store.delete(conv.id)
    assert store.get(conv.id) is None
    assert store._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0  # cascaded


def test_a_version_1_database_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + "; PRAGMA user_version = 1;")
    db.execute("INSERT INTO conversations (title, system_prompt, created, updated) VALUES ('Old', '', 1, 1)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'kept', 1)")
    db.commit()
    db.close()
    store = ConversationStore(path)
    assert store.schema_version == SCHEMA_VERSION == 4
    [msg] = store.messages(1)
    assert (msg.content, msg.complete, msg.stats) == ("kept", True, "")
    assert store.get(1).engine == ""  # an old conversation runs on the local model
    store.set_engine(1, '{"engine": "gpu-box", "model": "m"}')
    assert store.get(1).engine == '{"engine": "gpu-box", "model": "m"}'


def test_a_newer_database_is_left_untouched_and_the_app_says_what_to_do(tmp_path: Path) -> None:
    """A file a newer SpecChat wrote (after a downgrade, or a data folder shared with a newer
    install) used to raise a RuntimeError that kept the app from opening. Now the store opens
    empty in memory, never writes to the file, and its notice says what happened and what to do."""
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT, tomorrow BLOB)")
    db.execute("INSERT INTO conversations (title, tomorrow) VALUES ('from the future', x'00')")
    db.commit()
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 4}")
    db.close()
    before = path.read_bytes()
    store = ConversationStore(path)
    assert store.in_memory and store.conversations() == []
    notice = store.notice or ""
    assert "newer version of SpecChat" in notice and f"database version {SCHEMA_VERSION + 4}" in notice
    assert "update SpecChat" in notice and "left untouched" in notice and str(path) in notice
    conv = store.create("today")  # the chat goes on, in memory
    store.add_message(conv.id, "user", "hello")
    assert [m.content for m in store.messages(conv.id)] == ["hello"]
    store.close()
    assert path.read_bytes() == before  # not migrated, not set aside, not written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.sqlite3"]


def test_export_markdown_and_json(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    conv = store.create("Fib", "You code.")
    store.add_message(conv.id, "user", "fib in python?")
    answer = store.add_message(conv.id, "assistant", "```python\ndef fib(n): ...\n```", complete=False)
    store.update_message(answer.id, "```python\ndef fib(n): ...\n```\n", complete=False)
    export_conversation(store, conv.id, tmp_path / "c.md", "md")
    export_conversation(store, conv.id, tmp_path / "c.json", "json")
    md = (tmp_path / "c.md").read_text(encoding="utf-8")
    assert md.startswith("# Fib\n") and "## You\n\nfib in python?" in md
    assert "## Assistant *(stopped)*\n\n```python\ndef fib(n): ...\n```" in md
    data = json.loads((tmp_path / "c.json").read_text(encoding="utf-8"))
    assert data["title"] == "Fib" and data["system_prompt"] == "You code."
    assert [(m["role"], m["complete"]) for m in data["messages"]] == [("user", True), ("assistant", False)]


def test_titles_from_first_messages() -> None:
    assert title_from("  Why is\nthe sky blue?  ") == "Why is the sky blue?"
    long = title_from("word " * 30)
    assert long.endswith("…") and len(long) <= 49
    assert title_from("   ") == "New chat"
