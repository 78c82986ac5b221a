"""Salvaging a damaged conversations database: set the file aside (kept, never deleted) and copy
every row SQLite can still read from it into a fresh database.

SQLite's own reader does the salvage, on a scratch copy (the kept file is never changed): each
table is read in rowid order, and where a damaged page stops the read, the scan restarts just
past the last row it got (the b-tree still finds the pages after the damage), skipping row ids
one at a time over the damaged stretch. A truncated copy is first padded with empty pages to
the length its header records, because SQLite refuses to read even the schema of a file whose
tables' root pages lie past its end. A file that is not a database at all (garbage bytes, a
damaged header) yields nothing; a truncated one yields the rows on the pages that survived. Rows that break the schema (a role other than
user/assistant) are dropped; messages whose conversation row is lost are kept together under a
"Recovered chat" stand-in. Nothing is allowed to fail the recovery.

What this module does not do: open the live database or decide when to recover
(conversations.py does both).
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_SKIPPED_IDS = 2000  # row ids probed past a damaged stretch before a table is given up
SIDE_FILES = ("-wal", "-shm", "-journal")
LOST_TITLE = "Recovered chat"  # a conversation whose messages survived but whose own row did not


@dataclass(frozen=True)
class Recovery:
    """What came back from a damaged file: where it was kept and how many rows were saved."""

    kept: Path
    conversations: int
    messages: int

    def describe(self) -> str:
        saved = (f"{self.conversations} conversations and {self.messages} messages were recovered from it"
                 if self.conversations or self.messages else "nothing could be recovered from it")
        return (f"The conversations database was damaged, so SpecChat moved it aside as {self.kept} (kept, not "
                f"deleted) and started a new one; {saved}.")


def set_aside(path: Path) -> Path:
    """Rename `path` (and its -wal/-shm/-journal files, which belong to it) to
    `<stem>.damaged-<time><suffix>`; returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = path.with_name(f"{path.stem}.damaged-{stamp}{path.suffix}")
    n = 1
    while kept.exists():
        n += 1
        kept = path.with_name(f"{path.stem}.damaged-{stamp}-{n}{path.suffix}")
    os.replace(path, kept)
    for side in SIDE_FILES:
        extra = Path(f"{path}{side}")
        if extra.exists():
            os.replace(extra, Path(f"{kept}{side}"))
    return kept


def recover_into(source: Path, dest: sqlite3.Connection) -> tuple[int, int]:
    """Copy the conversations and messages SQLite can read from `source` into `dest` (the
    current schema, empty); returns (conversations, messages) copied."""
    with tempfile.TemporaryDirectory(prefix="specchat-recover-") as scratch:
        copy = Path(scratch) / "damaged.sqlite3"
        try:
            shutil.copyfile(source, copy)
            if Path(f"{source}-wal").is_file():  # transactions not yet in the main file
                shutil.copyfile(f"{source}-wal", f"{copy}-wal")
            _pad_to_header(copy)
            src = sqlite3.connect(str(copy))
        except (OSError, sqlite3.Error) as exc:
            log.warning("cannot read the damaged database %s: %s", source, exc)
            return 0, 0
        try:
            return _copy_rows(src, dest)
        finally:
            src.close()


def _pad_to_header(path: Path) -> None:
    """Extend a truncated database file with zero pages to the page count its header records."""
    with path.open("r+b") as handle:
        head = handle.read(100)
        if len(head) < 100 or not head.startswith(b"SQLite format 3\0"):
            return
        page_size = struct.unpack(">H", head[16:18])[0]
        page_size = 65536 if page_size == 1 else page_size
        pages = struct.unpack(">I", head[28:32])[0]
        want = page_size * pages
        handle.seek(0, os.SEEK_END)
        if handle.tell() < want <= 1 << 40:
            handle.truncate(want)


def _copy_rows(src: sqlite3.Connection, dest: sqlite3.Connection) -> tuple[int, int]:
    conversations = messages = 0
    try:
        conv_cols = _columns(src, "conversations", ("id", "title", "system_prompt", "created", "updated", "engine"))
        msg_cols = _columns(src, "messages", ("id", "conversation_id", "role", "content", "created", "complete",
                                              "stats", "reasoning", "reasoning_seconds"))
        now = time.time()
        if conv_cols:
            for row in _salvage(src, "conversations", conv_cols):
                values = dict(zip(conv_cols, row, strict=True))
                title = values.get("title")
                dest.execute(
                    "INSERT OR IGNORE INTO conversations (id, title, system_prompt, created, updated, engine) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (values["id"], title if isinstance(title, str) and title else LOST_TITLE,
                     _text(values.get("system_prompt")), _number(values.get("created"), now),
                     _number(values.get("updated"), now), _engine(values.get("engine"))))
                conversations += 1
        if msg_cols:
            known = {r[0] for r in dest.execute("SELECT id FROM conversations")}
            for row in _salvage(src, "messages", msg_cols):
                values = dict(zip(msg_cols, row, strict=True))
                owner = values.get("conversation_id")
                if values.get("role") not in ("user", "assistant") or not isinstance(values.get("content"), str) \
                        or not isinstance(owner, int) or isinstance(owner, bool):
                    continue
                if owner not in known:  # its conversation's row was lost: a stand-in keeps the chat together
                    dest.execute("INSERT INTO conversations (id, title, system_prompt, created, updated) "
                                 "VALUES (?, ?, '', ?, ?)", (owner, LOST_TITLE, now, now))
                    known.add(owner)
                    conversations += 1
                dest.execute(
                    "INSERT OR IGNORE INTO messages (id, conversation_id, role, content, created, complete, stats, "
                    "reasoning, reasoning_seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (values["id"], owner, values["role"], values["content"], _number(values.get("created"), now),
                     1 if values.get("complete", 1) else 0, _text(values.get("stats")), _text(values.get("reasoning")),
                     _number(values.get("reasoning_seconds"), 0.0)))
                messages += 1
        return conversations, messages
    except sqlite3.DatabaseError as exc:  # a fault outside the row scans (the id list): keep what was copied
        log.warning("recovery stopped early: %s", exc)
        return conversations, messages


def _columns(src: sqlite3.Connection, table: str, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The wanted columns the damaged file's table has (older schemas lack some); () when the
    table or the schema itself cannot be read."""
    try:
        have = {row[1] for row in src.execute(f"PRAGMA table_info({table})")}
    except sqlite3.DatabaseError as exc:
        log.warning("cannot read the %s table of the damaged database: %s", table, exc)
        return ()
    return tuple(c for c in wanted if c in have) if "id" in have else ()


def _salvage(src: sqlite3.Connection, table: str, columns: tuple[str, ...]) -> Iterator[tuple]:
    """Rows of `table` in rowid order, past any damaged stretch SQLite cannot read. Row ids only
    ever grow, so the scan ends even on a b-tree damaged into a loop."""
    after, skipped = 0, 0
    while skipped <= MAX_SKIPPED_IDS:
        try:
            cursor = src.execute(f"SELECT {', '.join(columns)} FROM {table} WHERE rowid > ? ORDER BY rowid", (after,))
            for row in cursor:
                if not isinstance(row[0], int) or row[0] <= after:
                    # a damaged page read as rows out of order, or pages that point back in a cycle
                    raise sqlite3.DatabaseError(f"row id {row[0]!r} after {after}")
                yield row
                after, skipped = row[0], 0
            return
        except sqlite3.DatabaseError:
            after, skipped = after + 1, skipped + 1
    log.warning("gave up reading %s past row %d of the damaged database", table, after)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _engine(value: object) -> str:
    """The conversation's engine name, or '' (the local model) when it reads as damaged text."""
    return value if isinstance(value, str) and value.isprintable() and len(value) <= 200 else ""


def _number(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
