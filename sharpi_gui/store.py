"""Conversations in SQLite: every write commits at once, so a crash loses at most the message in flight.

The database lives in the platform's user data directory (``platformdirs``), or in
``$SHARPI_DATA_DIR``, or wherever the caller says (tests use a temporary directory).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

from platformdirs import user_data_dir

from sharpi_gui.data import Conversation, Message

DB_NAME = "conversations.sqlite3"
UNTITLED = "New conversation"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


def default_data_dir() -> Path:
    """The platform's user data directory for SharpI (``$SHARPI_DATA_DIR`` overrides it: the app passes
    that in, see ``sharpi_gui.bridge.app_data_dir``)."""
    return Path(user_data_dir("SharpI", "SharpI"))


class DamagedConversation(Exception):
    """A conversation whose messages the database cannot read."""


_COLUMNS = {
    "conversations": {"id", "title", "system_prompt", "created", "updated"},
    "messages": {"id", "conversation_id", "role", "content", "created", "meta"},
}


class ConversationStore:
    """Conversations and their messages. Use from one thread (the UI thread).

    A database that cannot be used (not SQLite, truncated, an unreadable schema or conversation list,
    another schema) is moved aside as a
    timestamped backup and a new one started; a data directory that cannot be written gives a session
    kept in memory (a copy of the readable database, if any). :attr:`notice` then says what happened and
    where the backup is, for the app to show."""

    def __init__(self, data_dir: str | os.PathLike | None = None):
        directory = Path(data_dir) if data_dir is not None else default_data_dir()
        self.path = directory / DB_NAME
        self.notice: str | None = None  # what went wrong at start-up, for the app to show
        self.backup: Path | None = None  # where a broken database was moved
        self.in_memory = False
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._db = self._open(self.path)
        except sqlite3.DatabaseError as e:
            if not _writable(directory):
                self._start_in_memory(directory, e)
                return
            self.backup = self._move_aside(e)
            try:
                self._db = self._open(self.path)
            except (sqlite3.Error, OSError) as e2:
                self._start_in_memory(directory, e2)
        except OSError as e:
            self._start_in_memory(directory, e)

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        # Autocommit: each statement is durable when it returns.
        db = sqlite3.connect(path, isolation_level=None)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            db.execute("PRAGMA busy_timeout = 5000")  # a second instance writing: wait, never raise at the user
            # checked before anything is written, so a database moved aside is the one found: the schema and
            # the list of conversations must read (a damaged page under one conversation's messages is that
            # conversation's problem: messages() says so, the others stay usable)
            for table, want in _COLUMNS.items():
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if have and not want <= have:
                    raise sqlite3.DatabaseError(f"table {table} lacks {', '.join(sorted(want - have))}")
            if "title" in {r[1] for r in db.execute("PRAGMA table_info(conversations)")}:
                db.execute("SELECT id, title, system_prompt, created, updated FROM conversations").fetchall()
            db.execute("PRAGMA journal_mode = WAL")
            # WAL + NORMAL: a commit survives the app crashing (it is in the WAL file) without an fsync
            # per message on the UI thread; only a power cut can lose the last few.
            db.execute("PRAGMA synchronous = NORMAL")
            db.executescript(_SCHEMA)
            return db
        except BaseException:
            db.close()
            raise

    def _move_aside(self, why: Exception) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = self.path.with_name(f"{self.path.name}.broken-{stamp}")
        n = 1
        while backup.exists():
            n += 1
            backup = self.path.with_name(f"{self.path.name}.broken-{stamp}-{n}")
        os.replace(self.path, backup)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                os.replace(side, backup.with_name(backup.name + suffix))
        self.notice = (
            f"The conversation database could not be opened ({why}). It was moved to {backup} and a new, "
            "empty one was started."
        )
        return backup

    def _start_in_memory(self, directory: Path, why: Exception) -> None:
        self.in_memory = True
        self._db = sqlite3.connect(":memory:", isolation_level=None)
        copied = False
        try:  # the conversations that can still be read, copied into memory
            src = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                src.backup(self._db)
                copied = True
            finally:
                src.close()
        except (sqlite3.Error, OSError):
            pass
        try:
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError:
            self._db.close()
            self._db = sqlite3.connect(":memory:", isolation_level=None)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
            copied = False
        self.notice = (
            f"Conversations cannot be saved: {directory} is not usable ({why}). "
            + ("The saved conversations were read; " if copied else "")
            + "this session's conversations are kept in memory only and are lost when the app closes."
        )

    def close(self) -> None:
        self._db.close()

    # -- conversations ------------------------------------------------------------------------------
    def conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        rows = self._db.execute(
            "SELECT id, title, system_prompt, created, updated FROM conversations ORDER BY updated DESC, id DESC"
        )
        return [Conversation(*r) for r in rows]

    def conversation(self, cid: int) -> Conversation | None:
        r = self._db.execute(
            "SELECT id, title, system_prompt, created, updated FROM conversations WHERE id = ?", (cid,)
        ).fetchone()
        return None if r is None else Conversation(*r)

    def create(self, title: str = UNTITLED, system_prompt: str = "") -> Conversation:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, system_prompt, created, updated) VALUES (?, ?, ?, ?)",
            (title, system_prompt, now, now),
        )
        return Conversation(cur.lastrowid, title, system_prompt, now, now)

    def rename(self, cid: int, title: str) -> None:
        self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, cid))

    def set_system_prompt(self, cid: int, text: str) -> None:
        self._db.execute("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, cid))

    def delete(self, cid: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (cid,))

    # -- messages -----------------------------------------------------------------------------------
    def messages(self, cid: int) -> list[Message]:
        """The messages of conversation ``cid``; :class:`DamagedConversation` if the database cannot read them
        (a corrupt page: the other conversations stay usable)."""
        try:
            rows = self._db.execute(
                "SELECT id, conversation_id, role, content, created, meta FROM messages "
                "WHERE conversation_id = ? ORDER BY id",
                (cid,),
            ).fetchall()
            return [Message(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]
        except (sqlite3.DatabaseError, ValueError) as e:
            raise DamagedConversation(f"conversation {cid} cannot be read from {self.path}: {e}") from None

    def add_message(self, cid: int, role: str, content: str, meta: dict | None = None) -> Message:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO messages (conversation_id, role, content, created, meta) VALUES (?, ?, ?, ?, ?)",
            (cid, role, content, now, json.dumps(meta or {})),
        )
        self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, cid))
        return Message(cur.lastrowid, cid, role, content, now, dict(meta or {}))

    def delete_message(self, mid: int) -> None:
        self._db.execute("DELETE FROM messages WHERE id = ?", (mid,))


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)
