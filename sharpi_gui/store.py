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

from sharpi_gui.data import Branch, Conversation, Message, Preset, SearchHit

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
CREATE TABLE IF NOT EXISTS presets (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    name TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',
    UNIQUE (model, name)
);
"""

# Columns added after the first schema, with how an older database gets them (one transaction each, so a
# crash leaves the old schema or the new one). Branching chats: a message's parent (a database written
# before branching holds straight lines: each message follows the one before it) and the leaf of the
# branch a conversation shows (NULL: its newest message).
_MIGRATIONS = (
    (
        "messages",
        "parent_id",
        "ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE",
        "UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p "
        "WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)",
    ),
    ("conversations", "leaf_id", "ALTER TABLE conversations ADD COLUMN leaf_id INTEGER", None),
    # a reply's reasoning, kept apart from its answer ('' for every message written before)
    ("messages", "reasoning", "ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''", None),
)


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
            _migrate(db)
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
            _migrate(self._db)
        except sqlite3.DatabaseError:
            self._db.close()
            self._db = sqlite3.connect(":memory:", isolation_level=None)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
            _migrate(self._db)
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
    # A conversation is a tree: regenerating a reply or editing a question adds a sibling (same parent)
    # and the conversation shows one branch, root to ``leaf_id``. Nothing is ever overwritten.
    _MSG_COLUMNS = "id, conversation_id, role, content, created, meta, parent_id, reasoning"

    @staticmethod
    def _message(r) -> Message:
        return Message(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), r[6], r[7])

    def _rows(self, sql: str, args: tuple) -> list[Message]:
        return [self._message(r) for r in self._db.execute(sql, args).fetchall()]

    def all_messages(self, cid: int) -> list[Message]:
        """Every message of conversation ``cid``, every branch, oldest first."""
        return self._guarded(
            cid,
            lambda: self._rows(
                f"SELECT {self._MSG_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY id", (cid,)
            ),
        )

    def messages(self, cid: int) -> list[Message]:
        """The branch conversation ``cid`` shows, first message to its leaf; :class:`DamagedConversation`
        if the database cannot read them (a corrupt page: the other conversations stay usable)."""
        return self.path_to(cid, self.leaf(cid))

    def leaf(self, cid: int) -> int | None:
        """The last message of the branch shown (the newest message if none was chosen)."""

        def read():
            r = self._db.execute(
                "SELECT c.leaf_id FROM conversations c JOIN messages m ON m.id = c.leaf_id "
                "WHERE c.id = ? AND m.conversation_id = c.id",
                (cid,),
            ).fetchone()
            if r is None:
                r = self._db.execute("SELECT MAX(id) FROM messages WHERE conversation_id = ?", (cid,)).fetchone()
            return r[0]

        return self._guarded(cid, read)

    def path_to(self, cid: int, mid: int | None) -> list[Message]:
        """The messages from the first one down to ``mid`` (empty for None)."""
        if mid is None:
            return []
        sql = (
            "WITH RECURSIVE path(id, depth) AS (SELECT ?, 0 UNION ALL "
            "SELECT m.parent_id, path.depth + 1 FROM messages m JOIN path ON m.id = path.id "
            "WHERE m.parent_id IS NOT NULL) "
            f"SELECT {', '.join('m.' + c.strip() for c in self._MSG_COLUMNS.split(','))} "
            "FROM path JOIN messages m ON m.id = path.id WHERE m.conversation_id = ? ORDER BY path.depth DESC"
        )
        return self._guarded(cid, lambda: self._rows(sql, (mid, cid)))

    def branch(self, mid: int) -> Branch:
        """Where message ``mid`` sits among the alternatives with its parent."""
        r = self._db.execute("SELECT conversation_id, parent_id FROM messages WHERE id = ?", (mid,)).fetchone()
        if r is None:
            return Branch(0, 0, ())
        ids = tuple(
            x[0]
            for x in self._db.execute(
                "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id", (r[0], r[1])
            )
        )
        return Branch(ids.index(mid), len(ids), ids)

    def latest_leaf_under(self, mid: int) -> int:
        """The end of the newest branch below message ``mid`` (``mid`` itself if nothing follows it)."""
        while True:
            r = self._db.execute("SELECT MAX(id) FROM messages WHERE parent_id = ?", (mid,)).fetchone()
            if r[0] is None:
                return mid
            mid = r[0]

    def set_leaf(self, cid: int, mid: int | None) -> None:
        """Show the branch ending at ``mid``."""
        self._db.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (mid, cid))

    def add_message(
        self,
        cid: int,
        role: str,
        content: str,
        meta: dict | None = None,
        parent_id: int | None = ...,
        reasoning: str = "",
    ) -> Message:
        """Append a message below ``parent_id`` (default: the leaf shown; None: a new first message) and
        show its branch; ``reasoning``: a reply's reasoning, stored with it. One transaction: a crash keeps the
        message, its reasoning and the branch shown together."""
        now = time.time()
        if parent_id is ...:
            parent_id = self.leaf(cid)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, meta, parent_id, reasoning) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (cid, role, content, now, json.dumps(meta or {}), parent_id, reasoning),
            )
            self._db.execute(
                "UPDATE conversations SET updated = ?, leaf_id = ? WHERE id = ?", (now, cur.lastrowid, cid)
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return Message(cur.lastrowid, cid, role, content, now, dict(meta or {}), parent_id, reasoning)

    def delete_message(self, mid: int) -> None:
        """Delete a message and everything below it (the conversation then shows its newest message)."""
        r = self._db.execute("SELECT conversation_id FROM messages WHERE id = ?", (mid,)).fetchone()
        self._db.execute("DELETE FROM messages WHERE id = ?", (mid,))
        if r is not None:
            self._db.execute(
                "UPDATE conversations SET leaf_id = NULL WHERE id = ? AND leaf_id NOT IN (SELECT id FROM messages)",
                (r[0],),
            )

    def _guarded(self, cid: int, read):
        try:
            return read()
        except (sqlite3.DatabaseError, ValueError) as e:
            raise DamagedConversation(f"conversation {cid} cannot be read from {self.path}: {e}") from None

    # -- search -------------------------------------------------------------------------------------
    def search(self, query: str, limit: int = 200) -> list[SearchHit]:
        """Conversations whose title or any message (any branch) contains ``query``, ignoring case (ASCII
        letters), most recently updated first, each with a snippet of its first matching message."""
        query = query.strip()
        if not query:
            return []
        pattern = "%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._db.execute(
            "SELECT c.id, c.title, "
            "(SELECT m.id FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ?1 ESCAPE '\\' "
            "ORDER BY m.id LIMIT 1) AS hit "
            "FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\' OR hit IS NOT NULL "
            "ORDER BY c.updated DESC, c.id DESC LIMIT ?2",
            (pattern, limit),
        ).fetchall()
        out = []
        for cid, title, mid in rows:
            snippet = ""
            if mid is not None:
                text = self._db.execute("SELECT content FROM messages WHERE id = ?", (mid,)).fetchone()[0]
                snippet = _snippet(text, query)
            out.append(SearchHit(cid, title, snippet, mid))
        return out

    # -- presets ------------------------------------------------------------------------------------
    def presets(self, model: str) -> list[Preset]:
        """The presets saved for ``model``, by name."""
        rows = self._db.execute(
            "SELECT id, model, name, system_prompt, sampling FROM presets WHERE model = ? ORDER BY name COLLATE NOCASE",
            (model,),
        )
        return [Preset(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in rows]

    def save_preset(self, model: str, name: str, system_prompt: str, sampling: dict) -> Preset:
        """Save (or replace) the preset ``name`` of ``model``."""
        self._db.execute(
            "INSERT INTO presets (model, name, system_prompt, sampling) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (model, name) DO UPDATE SET system_prompt = excluded.system_prompt, "
            "sampling = excluded.sampling",
            (model, name, system_prompt, json.dumps(sampling)),
        )
        r = self._db.execute("SELECT id FROM presets WHERE model = ? AND name = ?", (model, name)).fetchone()
        return Preset(r[0], model, name, system_prompt, dict(sampling))

    def delete_preset(self, pid: int) -> None:
        self._db.execute("DELETE FROM presets WHERE id = ?", (pid,))


def _migrate(db: sqlite3.Connection) -> None:
    for table, column, add, fill in _MIGRATIONS:
        if column in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
            continue
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(add)
            if fill:
                db.execute(fill)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise


def _snippet(text: str, query: str, width: int = 80) -> str:
    """About ``width`` characters of ``text`` around the first ``query``, on one line."""
    flat = " ".join(text.split())
    at = flat.lower().find(query.lower())
    if at < 0:
        return flat[:width] + ("…" if len(flat) > width else "")
    start = max(0, at - width // 3)
    end = min(len(flat), start + width)
    return ("…" if start else "") + flat[start:end] + ("…" if end < len(flat) else "")


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)
