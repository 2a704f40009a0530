"""A conversation database the app cannot use never stops it: a broken one (garbage, truncated, corrupt,
another schema) is moved aside as a timestamped backup, a new one is started and a dialog says so; a data
directory that cannot be written gives a session kept in memory, with a dialog; writes are durable
across kills (the slow tier: 200 SIGKILLs of a writing process)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sharpi_gui.store import DB_NAME, ConversationStore, DamagedConversation

ROOT = Path(__file__).resolve().parents[1]


def _good_db(directory: Path, n: int = 3) -> Path:
    s = ConversationStore(directory)
    for i in range(n):
        c = s.create(f"chat {i}")
        s.add_message(c.id, "user", f"hello {i}")
    s.close()
    return directory / DB_NAME


def _garbage(p: Path) -> None:
    p.write_bytes(b"this is not sqlite" * 500)


def _truncated(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])


def _old_schema(p: Path) -> None:
    p.unlink()
    for side in ("-wal", "-shm"):
        Path(str(p) + side).unlink(missing_ok=True)
    db = sqlite3.connect(p)
    db.executescript("CREATE TABLE conversations (id INTEGER PRIMARY KEY, name TEXT); CREATE TABLE messages (x);")
    db.close()


def _corrupt_schema_page(p: Path) -> None:
    data = bytearray(p.read_bytes())
    for at in range(100, 1000):  # page 1 past the header: sqlite_master
        data[at] ^= 0x5A
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_garbage, _truncated, _old_schema, _corrupt_schema_page])
def test_a_broken_database_is_moved_aside_and_a_new_one_started(tmp_path, damage):
    path = _good_db(tmp_path)
    # checkpointed into the main file, so damaging it is damaging the data
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    original = path.read_bytes()
    damage(path)
    damaged = path.read_bytes()
    s = ConversationStore(tmp_path)
    assert s.notice and "moved to" in s.notice and s.backup is not None and str(s.backup) in s.notice
    assert s.backup.read_bytes() == damaged and damaged != original
    assert s.conversations() == []
    c = s.create("fresh")
    s.add_message(c.id, "user", "works")
    assert [m.content for m in s.messages(c.id)] == ["works"]
    s.close()
    assert ConversationStore(tmp_path).notice is None  # the new one opens cleanly next time


def _damage_one_conversation(tmp_path) -> tuple[int, int]:
    """A store under ``tmp_path`` with conversations a (its message's overflow page broken) and b; their ids."""
    s = ConversationStore(tmp_path)
    a, b = s.create("a"), s.create("b")
    s.add_message(a.id, "user", "A" * 20000)  # overflow pages of its own
    s.add_message(b.id, "user", "hello b")
    s.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    data = bytearray((tmp_path / DB_NAME).read_bytes())
    # an overflow page of a's message: its text right after the 4-byte pointer to the next one
    hit = next(k for k in range(0, len(data), page) if data[k + 4 : k + 104] == b"A" * 100)
    data[hit : hit + 4] = b"\xff\xff\xff\xff"  # the overflow chain points past the file
    (tmp_path / DB_NAME).write_bytes(bytes(data))
    return a.id, b.id


def test_a_damaged_conversation_is_reported_and_the_others_stay_usable(tmp_path):
    a, b = _damage_one_conversation(tmp_path)
    s = ConversationStore(tmp_path)
    assert s.notice is None and {c.title for c in s.conversations()} == {"a", "b"}
    with pytest.raises(DamagedConversation, match=f"conversation {a} cannot be read"):
        s.messages(a)
    assert [m.content for m in s.messages(b)] == ["hello b"]
    s.add_message(b, "assistant", "still works")


def test_the_app_reports_a_damaged_conversation(qtbot, tmp_path):
    pytest.importorskip("pytestqt")
    from sharpi_gui.testing import make_window

    (tmp_path / "data").mkdir()
    a, b = _damage_one_conversation(tmp_path / "data")
    w = make_window(qtbot, tmp_path)
    seen = []
    w.ctx.chat.notice.connect(seen.append)
    w.ctx.chat.select(a)
    assert seen and seen[0].title == "This conversation is damaged" and w.ctx.chat.messages == []
    w.ctx.chat.select(b)
    assert [m.content for m in w.ctx.chat.messages] == ["hello b"]


def test_an_unwritable_data_directory_keeps_the_session_in_memory(tmp_path, monkeypatch):
    path = _good_db(tmp_path)
    import sharpi_gui.store as store_mod

    def readonly(_path):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(store_mod.ConversationStore, "_open", staticmethod(readonly))
    monkeypatch.setattr(store_mod, "_writable", lambda d: False)
    s = ConversationStore(tmp_path)
    assert s.in_memory and "cannot be saved" in s.notice and "were read" in s.notice
    assert sorted(c.title for c in s.conversations()) == ["chat 0", "chat 1", "chat 2"]
    c = s.create("only in memory")
    s.add_message(c.id, "user", "x")
    assert path.exists()


def test_a_data_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = ConversationStore(blocker / "data")  # a path under a file: mkdir fails
    assert s.in_memory and "cannot be saved" in s.notice
    s.create("x")


def test_the_app_starts_on_a_broken_database_and_says_so(qtbot, tmp_path, monkeypatch):
    pytest.importorskip("pytestqt")
    from sharpi_gui.testing import make_window, patch_dialogs

    data = tmp_path / "data"
    data.mkdir()
    _garbage(data / DB_NAME)
    rec = patch_dialogs(monkeypatch)
    w = make_window(qtbot, tmp_path)
    qtbot.waitUntil(lambda: len(rec.shown) == 1)
    box = rec.shown[0]
    assert "moved to" in box.informativeText() and w.ctx.store.backup.exists()
    assert box.text() == "Conversation database reset"


WRITER = r"""
import sys
from sharpi_gui.store import ConversationStore
s = ConversationStore(sys.argv[1])
c = s.conversations()[0] if s.conversations() else s.create("log")
i = int(sys.argv[2])
while True:
    s.add_message(c.id, "user", f"m{i}")
    print(i, flush=True)  # acknowledged: the write returned
    i += 1
"""


@pytest.mark.slow
def test_two_hundred_kills_while_writing_lose_nothing_acknowledged(tmp_path):
    acked = []
    for k in range(200):
        start = acked[-1] + 1 if acked else 0
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(start)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        got = []
        deadline = time.monotonic() + 30
        while len(got) < 5 + k % 20 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            got.append(int(line))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        acked += got
    db = sqlite3.connect(tmp_path / DB_NAME)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    have = {int(r[0][1:]) for r in db.execute("SELECT content FROM messages")}
    db.close()
    assert set(acked) <= have and len(acked) >= 200 * 5
