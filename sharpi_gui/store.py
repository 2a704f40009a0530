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


class ConversationStore:
    """Conversations and their messages. Use from one thread (the UI thread)."""

    def __init__(self, data_dir: str | os.PathLike | None = None):
        directory = Path(data_dir) if data_dir is not None else default_data_dir()
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / DB_NAME
        # Autocommit: each statement is durable when it returns.
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute("PRAGMA journal_mode = WAL")
        # WAL + NORMAL: a commit survives the app crashing (it is in the WAL file) without an fsync
        # per message on the UI thread; only a power cut can lose the last few.
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(_SCHEMA)

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
        rows = self._db.execute(
            "SELECT id, conversation_id, role, content, created, meta FROM messages WHERE conversation_id = ? ORDER BY id",
            (cid,),
        )
        return [Message(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

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
