"""Conversations and their messages in SQLite (WAL) in the user data dir.

The chat page writes an assistant answer while it streams: the message row exists from the
first token with `complete = 0`, and its text is updated before each render of the answer, so a
crash or `kill -9` loses nothing the window had shown (WAL survives a killed process; only a
power cut can drop the last transactions with synchronous=NORMAL).

The schema is versioned with `PRAGMA user_version`; `MIGRATIONS[i]` takes version i to i+1 and
runs once, in one transaction, when an older file is opened. This module knows nothing of Qt;
exports are app/state/export.py's.

The database never keeps the app from working. A damaged file (garbage bytes, truncated: found
by SQLite's quick_check at open) is moved aside, kept, and what SQLite can still read of it is
copied into a fresh one (recovery.py). A folder that cannot be written (read-only, full, not
ours: at open or at any later write) turns the store into an in-memory copy of what it held, so
the chat goes on for this session. A file a newer SpecChat wrote (a schema version above
SCHEMA_VERSION) is never written to, migrated or set aside: this session starts empty in memory.
Either way `notice` says what happened and what to do, in sentences the app shows in its banner,
and `on_notice` is told when it happens later.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from app.state.recovery import Recovery, recover_into, set_aside
from engine.types import GenerationStats

log = logging.getLogger(__name__)

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
    # 3 -> 4: a thinking model's reasoning, apart from its answer, and how long it thought
    """
    ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT '';
    ALTER TABLE messages ADD COLUMN reasoning_seconds REAL NOT NULL DEFAULT 0;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
# SQLite result codes (primary): the file is damaged, or the folder cannot take a write
_DAMAGED = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB
_UNWRITABLE = {3, 8, 10, 13, 14}  # SQLITE_PERM, _READONLY, _IOERR, _FULL, _CANTOPEN


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
    streaming (or was cut short by a crash); `stats` is a JSON object or ''; `reasoning` what a
    thinking model thought before answering ('' for none), for `reasoning_seconds`."""

    id: int
    conversation_id: int
    role: Role
    content: str
    created: float
    complete: bool = True
    stats: str = ""
    reasoning: str = ""
    reasoning_seconds: float = 0.0


class ConversationStore:
    """All conversations of one user. One connection, used from one thread (the GUI's).

    `notice`: None, or what the app should tell the user about this store (a damaged file set
    aside, or conversations kept in memory only); `on_notice(message)` is called when that
    happens after opening (a folder that turns read-only while the app runs)."""

    def __init__(self, path: Path, on_notice: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.notice: str | None = None
        self.on_notice = on_notice
        self.recovery: Recovery | None = None
        self.in_memory = False
        try:
            self._db = self._open_file(path)
        except _Newer as newer:
            self._db = self._memory_copy(_newer(path, newer.version), copy=False)
        except _Damaged:
            self._db = self._recover(path)
        except (sqlite3.DatabaseError, OSError) as exc:  # OSError: the data folder cannot be created
            self._db = self._memory_copy(_unwritable(path, exc))

    def _open_file(self, path: Path) -> sqlite3.Connection:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path), isolation_level=None)  # autocommit; explicit BEGINs
        try:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])  # before anything writes to it
            if version > SCHEMA_VERSION:
                raise _Newer(version)
            _configure(db)
            check = db.execute("PRAGMA quick_check(1)").fetchone()  # reads every page: finds truncation
            if check is None or check[0] != "ok":
                raise _Damaged(check[0] if check else "no answer")
            _migrate(db, path)
        except sqlite3.DatabaseError as exc:
            db.close()
            if _code(exc) in _DAMAGED:
                raise _Damaged(str(exc)) from exc
            raise
        except (_Damaged, _Newer):
            db.close()
            raise
        return db

    def _recover(self, path: Path) -> sqlite3.Connection:
        """Set the damaged file aside, start a fresh one, copy into it what can be read."""
        try:
            kept = set_aside(path)
            db = self._open_file(path)
        except (OSError, sqlite3.DatabaseError) as exc:  # cannot even rename or create: memory only
            return self._memory_copy(_unwritable(path, exc))
        db.execute("BEGIN IMMEDIATE")
        try:
            conversations, messages = recover_into(kept, db)
            db.execute("COMMIT")
        except sqlite3.Error:
            db.execute("ROLLBACK")
            log.exception("recovering %s failed", kept)
            conversations = messages = 0
        self.recovery = Recovery(kept, conversations, messages)
        self.notice = self.recovery.describe()
        log.warning("%s", self.notice)
        return db

    def _memory_copy(self, reason: str, copy: bool = True) -> sqlite3.Connection:
        """An in-memory database holding what the file held (if it can be read at all; nothing
        when `copy` is False)."""
        memory = sqlite3.connect(":memory:", isolation_level=None)
        memory.row_factory = sqlite3.Row
        source = getattr(self, "_db", None)
        # a read-only open of a WAL file needs its -shm; immutable=1 reads it without one
        uris = [f"file:{self.path}?mode=ro", f"file:{self.path}?immutable=1"] if self.path.is_file() and copy else []
        readers: list[sqlite3.Connection | str] = [source] if source is not None else list(uris)
        for reader in readers:
            try:
                db = reader if isinstance(reader, sqlite3.Connection) else sqlite3.connect(reader, uri=True)
                db.backup(memory)  # SQLite's online backup: a consistent copy of every page
                break
            except (sqlite3.Error, OSError) as exc:
                log.warning("could not copy %s into memory: %s", self.path, exc)
        memory.execute("PRAGMA foreign_keys=ON")
        _migrate(memory, self.path)
        self.in_memory = True
        self.notice = reason
        log.warning("%s", reason)
        return memory

    def _write(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        """Execute a write; if the file can no longer be written, carry on in memory (once,
        telling `on_notice`)."""
        try:
            return self._db.execute(sql, args)
        except sqlite3.OperationalError as exc:
            if self.in_memory or _code(exc) not in _UNWRITABLE:
                raise
            old = self._db
            self._db = self._memory_copy(_unwritable(self.path, exc))
            old.close()
            if self.on_notice is not None and self.notice:
                self.on_notice(self.notice)
            return self._db.execute(sql, args)

    def close(self) -> None:
        self._db.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    # ---- conversations ---------------------------------------------------------------------
    def create(self, title: str = "New chat", system_prompt: str = "") -> Conversation:
        now = time.time()
        cur = self._write(
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
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title.strip() or "Untitled", conversation_id))

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._write("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conversation_id))

    def set_engine(self, conversation_id: int, engine: str) -> None:
        self._write("UPDATE conversations SET engine = ? WHERE id = ?", (engine, conversation_id))

    def delete(self, conversation_id: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _touch(self, conversation_id: int) -> None:
        self._write("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))

    # ---- messages --------------------------------------------------------------------------
    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [_message(r) for r in rows]

    def add_message(self, conversation_id: int, role: Role, content: str, complete: bool = True) -> StoredMessage:
        now = time.time()
        cur = self._write(
            "INSERT INTO messages (conversation_id, role, content, created, complete) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, role, content, now, int(complete)),
        )
        self._touch(conversation_id)
        return StoredMessage(int(cur.lastrowid or 0), conversation_id, role, content, now, complete)

    def update_message(self, message_id: int, content: str, complete: bool | None = None,
                       stats: dict[str, Any] | None = None, reasoning: str | None = None,
                       reasoning_seconds: float | None = None) -> None:
        """Replace a message's text (the streaming answer's text so far); optionally mark it
        complete, attach its stats, and replace its reasoning and thinking time."""
        sets: list[str] = ["content = ?"]
        args: list[str | int | float] = [content]
        if complete is not None:
            sets.append("complete = ?")
            args.append(int(complete))
        if stats is not None:
            sets.append("stats = ?")
            args.append(json.dumps(stats))
        if reasoning is not None:
            sets.append("reasoning = ?")
            args.append(reasoning)
        if reasoning_seconds is not None:
            sets.append("reasoning_seconds = ?")
            args.append(float(reasoning_seconds))
        self._write(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and every later one (regenerate, edit-and-resend)."""
        self._write("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id))


def _configure(db: sqlite3.Connection) -> None:
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:  # _open_file checks first; a copy in memory of such a file is never made
        raise _Newer(version)
    for target in range(version, SCHEMA_VERSION):
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[target].split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {target + 1}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise


class _Damaged(Exception):
    """The database file is damaged (SQLite says so, or quick_check finds a fault)."""


class _Newer(Exception):
    """The database file was written by a newer SpecChat (its schema `version` is above ours)."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


def _newer(path: Path, version: int) -> str:
    return (f"Your conversations in {path} were saved by a newer version of SpecChat (database version {version}; "
            f"this one reads up to {SCHEMA_VERSION}), so this version cannot show them. The file is left untouched: "
            "update SpecChat to see them again (or set SPECCHAT_DATA_DIR to another folder). Until then, new chats "
            "are kept in memory only and are lost when SpecChat closes.")


def _code(exc: sqlite3.Error) -> int:
    """The primary SQLite result code of an error (0 when unknown)."""
    return int(getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF


def _unwritable(path: Path, exc: Exception) -> str:
    return (f"SpecChat cannot write its conversations to {path.parent} ({exc}). This session's chats are kept in "
            "memory only and are lost when SpecChat closes: make the folder writable (or free disk space), or set "
            "SPECCHAT_DATA_DIR to a writable folder, then restart SpecChat.")


def title_from(text: str, limit: int = 48) -> str:
    """A conversation title from its first message: the first line, cut at a word."""
    line = " ".join(text.strip().split())
    if len(line) <= limit:
        return line or "New chat"
    cut = line[:limit].rsplit(" ", 1)[0]
    return (cut or line[:limit]) + "…"


# what some file system refuses in a name: Windows' reserved characters, control characters
_REFUSED = {**{c: "-" for c in '/\\|:'}, '"': "'", **{c: "" for c in "<>*?"}, **{chr(i): " " for i in range(32)}, "\x7f": " "}
_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
MAX_NAME_BYTES = 200  # below the usual 255-byte limit, with room for the suffix


def export_file_name(title: str, suffix: str) -> str:
    """A file name for exporting a conversation titled `title`: its words and punctuation as they
    are, less only what a file system refuses (path separators, `<>:"|?*`, control characters,
    a leading dot, trailing dots and spaces, Windows' reserved names), and the "…" a long title
    was cut with. "What is 2/3? Answer in one…" -> "What is 2-3 Answer in one.md"."""
    name = "".join(_REFUSED.get(c, c) for c in title.replace(": ", " - "))
    name = " ".join(name.split()).removesuffix("…").strip()
    while len(name.encode("utf-8")) > MAX_NAME_BYTES:
        cut = name[:-1].rsplit(" ", 1)[0] if " " in name[:-1] else name[:-1]
        name = cut.rstrip()
    name = name.lstrip(".").rstrip(". ")
    if name.split(".")[0].strip().upper() in _RESERVED:
        name = f"{name} (conversation)"
    return f"{name or 'conversation'}.{suffix}"


def stats_dict(stats: GenerationStats) -> dict[str, Any]:
    """A GenerationStats (a dataclass) as a JSON-able dict, for `update_message(stats=...)`."""
    return json.loads(json.dumps(asdict(stats), default=str))


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(row["id"], row["title"], row["system_prompt"], row["created"], row["updated"], row["engine"])


def _message(row: sqlite3.Row) -> StoredMessage:
    return StoredMessage(row["id"], row["conversation_id"], row["role"], row["content"], row["created"],
                         bool(row["complete"]), row["stats"], row["reasoning"], float(row["reasoning_seconds"] or 0.0))


def default_path(data_dir: Path) -> Path:
    return data_dir / "conversations.sqlite3"


__all__: Sequence[str] = ("Conversation", "ConversationStore", "StoredMessage", "default_path", "title_from")
