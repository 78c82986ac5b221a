"""Conversations and their messages in SQLite (WAL) in the user data dir.

The chat page writes an assistant answer while it streams: the message row exists from the
first token with `complete = 0`, and its text is updated before each render of the answer, so a
crash or `kill -9` loses nothing the window had shown (WAL survives a killed process; only a
power cut can drop the last transactions with synchronous=NORMAL).

The schema is versioned with `PRAGMA user_version`; `MIGRATIONS[i]` takes version i to i+1 and
runs once, in one transaction, when an older file is opened. This module knows nothing of Qt.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Role = Literal["user", "assistant"]

MIGRATIONS: tuple[str, ...] = (
    # 0 -> 1: conversations and messages
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL,
        created REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    # 1 -> 2: partial answers and the stats line of finished ones
    """
    ALTER TABLE messages ADD COLUMN complete INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE messages ADD COLUMN stats TEXT NOT NULL DEFAULT '';
    """,
    # 2 -> 3: the engine a conversation runs on ('' = the local model; else a remote model as
    # JSON {"engine": name in Settings > Engines, "model": id on that server})
    """
    ALTER TABLE conversations ADD COLUMN engine TEXT NOT NULL DEFAULT '';
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    created: float
    updated: float
    engine: str = ""  # '' = the local model; see MIGRATIONS[2]


@dataclass(frozen=True)
class StoredMessage:
    """One message. `complete` is False for an answer that was stopped, failed or is still
    streaming (or was cut short by a crash); `stats` is a JSON object or ''."""

    id: int
    conversation_id: int
    role: Role
    content: str
    created: float
    complete: bool = True
    stats: str = ""


class ConversationStore:
    """All conversations of one user. One connection, used from one thread (the GUI's)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(str(path), isolation_level=None)  # autocommit; explicit BEGINs
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        self._db.close()

    def _migrate(self) -> None:
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} was written by a newer SpecChat (schema {version}); update the app.")
        for target in range(version, SCHEMA_VERSION):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for statement in MIGRATIONS[target].split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {target + 1}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    # ---- conversations ---------------------------------------------------------------------
    def create(self, title: str = "New chat", system_prompt: str = "") -> Conversation:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, system_prompt, created, updated) VALUES (?, ?, ?, ?)",
            (title, system_prompt, now, now),
        )
        return Conversation(int(cur.lastrowid or 0), title, system_prompt, now, now)

    def get(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def conversations(self, search: str = "") -> list[Conversation]:
        """Newest first. `search` matches titles and message text (case-insensitive)."""
        if not search.strip():
            rows = self._db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC").fetchall()
        else:
            pattern = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self._db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\' OR EXISTS "
                "(SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ?1 ESCAPE '\\') "
                "ORDER BY updated DESC, id DESC",
                (pattern,),
            ).fetchall()
        return [_conversation(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title.strip() or "Untitled", conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._db.execute("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conversation_id))

    def set_engine(self, conversation_id: int, engine: str) -> None:
        self._db.execute("UPDATE conversations SET engine = ? WHERE id = ?", (engine, conversation_id))

    def delete(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _touch(self, conversation_id: int) -> None:
        self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))

    # ---- messages --------------------------------------------------------------------------
    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [_message(r) for r in rows]

    def add_message(self, conversation_id: int, role: Role, content: str, complete: bool = True) -> StoredMessage:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO messages (conversation_id, role, content, created, complete) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, role, content, now, int(complete)),
        )
        self._touch(conversation_id)
        return StoredMessage(int(cur.lastrowid or 0), conversation_id, role, content, now, complete)

    def update_message(self, message_id: int, content: str, complete: bool | None = None,
                       stats: dict[str, Any] | None = None) -> None:
        """Replace a message's text (the streaming answer's text so far); optionally mark it
        complete and attach its stats."""
        sets, args = ["content = ?"], [content]
        if complete is not None:
            sets.append("complete = ?")
            args.append(int(complete))  # type: ignore[arg-type]
        if stats is not None:
            sets.append("stats = ?")
            args.append(json.dumps(stats))
        self._db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and every later one (regenerate, edit-and-resend)."""
        self._db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id))

    # ---- export ----------------------------------------------------------------------------
    def export_json(self, conversation_id: int) -> dict[str, Any]:
        conv = self.get(conversation_id)
        if conv is None:
            raise KeyError(conversation_id)
        return {
            "title": conv.title,
            "system_prompt": conv.system_prompt,
            "created": conv.created,
            "messages": [
                {"role": m.role, "content": m.content, "created": m.created, "complete": m.complete,
                 **({"stats": json.loads(m.stats)} if m.stats else {})}
                for m in self.messages(conversation_id)
            ],
        }

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        if conv is None:
            raise KeyError(conversation_id)
        parts = [f"# {conv.title}\n"]
        if conv.system_prompt:
            parts.append(f"*System prompt:* {conv.system_prompt}\n")
        for m in self.messages(conversation_id):
            who = "You" if m.role == "user" else "Assistant"
            note = "" if m.complete else " *(stopped)*"
            parts.append(f"## {who}{note}\n\n{m.content.rstrip()}\n")
        return "\n".join(parts)


def title_from(text: str, limit: int = 48) -> str:
    """A conversation title from its first message: the first line, cut at a word."""
    line = " ".join(text.strip().split())
    if len(line) <= limit:
        return line or "New chat"
    cut = line[:limit].rsplit(" ", 1)[0]
    return (cut or line[:limit]) + "…"


def stats_dict(stats: object) -> dict[str, Any]:
    """A GenerationStats (a dataclass) as a JSON-able dict, for `update_message(stats=...)`."""
    return json.loads(json.dumps(asdict(stats), default=str))  # type: ignore[call-overload]


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(row["id"], row["title"], row["system_prompt"], row["created"], row["updated"], row["engine"])


def _message(row: sqlite3.Row) -> StoredMessage:
    return StoredMessage(row["id"], row["conversation_id"], row["role"], row["content"], row["created"],
                         bool(row["complete"]), row["stats"])


def default_path(data_dir: Path) -> Path:
    return data_dir / "conversations.sqlite3"


__all__: Sequence[str] = ("Conversation", "ConversationStore", "StoredMessage", "default_path", "title_from")
