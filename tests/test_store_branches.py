"""The chat store's message tree (regenerate and edit-and-resend keep every alternative), its search
across conversations, the presets per model, an older database's migration, and that a branch written
just before a crash is there at the next start."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap

from sharpi_gui.store import ConversationStore


def _texts(msgs):
    return [m.content for m in msgs]


def test_alternatives_are_kept_and_reachable(tmp_path):
    s = ConversationStore(tmp_path)
    c = s.create("t")
    q = s.add_message(c.id, "user", "q")
    a1 = s.add_message(c.id, "assistant", "a1")
    a2 = s.add_message(c.id, "assistant", "a2", parent_id=q.id)  # a regenerated reply
    assert _texts(s.messages(c.id)) == ["q", "a2"]
    b = s.branch(a2.id)
    assert (b.index, b.count, b.sibling_ids) == (1, 2, (a1.id, a2.id))
    s.set_leaf(c.id, s.latest_leaf_under(a1.id))
    assert _texts(s.messages(c.id)) == ["q", "a1"]
    # the conversation goes on below a1; an edited first question starts a second root
    q2 = s.add_message(c.id, "user", "q2")
    s.add_message(c.id, "assistant", "a3")
    assert _texts(s.messages(c.id)) == ["q", "a1", "q2", "a3"] and q2.parent_id == a1.id
    e = s.add_message(c.id, "user", "q edited", parent_id=None)
    assert _texts(s.messages(c.id)) == ["q edited"] and s.branch(e.id).count == 2
    s.set_leaf(c.id, s.latest_leaf_under(q.id))  # back to the first question: its newest branch
    assert _texts(s.messages(c.id)) == ["q", "a2"]
    assert len(s.all_messages(c.id)) == 6
    s.close()
    assert _texts(ConversationStore(tmp_path).messages(c.id)) == ["q", "a2"]  # the branch shown persists


def test_a_database_before_branches_is_migrated(tmp_path):
    db = sqlite3.connect(tmp_path / "conversations.sqlite3")
    db.executescript(
        """
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL
            REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,
            created REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}');
        INSERT INTO conversations VALUES (1, 'one', '', 0, 0), (2, 'two', '', 0, 0);
        INSERT INTO messages (conversation_id, role, content, created) VALUES
            (1, 'user', 'a', 0), (2, 'user', 'x', 0), (1, 'assistant', 'b', 0), (1, 'user', 'c', 0);
        """
    )
    db.commit()
    db.close()
    s = ConversationStore(tmp_path)
    assert s.notice is None
    msgs = s.messages(1)
    assert _texts(msgs) == ["a", "b", "c"] and [m.parent_id for m in msgs] == [None, msgs[0].id, msgs[1].id]
    assert _texts(s.messages(2)) == ["x"]


def test_search_finds_titles_and_every_branch(tmp_path):
    s = ConversationStore(tmp_path)
    c1 = s.create("Generators")
    q = s.add_message(c1.id, "user", "what does yield do?")
    s.add_message(c1.id, "assistant", "It makes a generator. Use __next__ to advance.")
    s.add_message(c1.id, "assistant", "another answer", parent_id=q.id)  # the match is on the hidden branch
    c2 = s.create("Decorators")
    s.add_message(c2.id, "user", "what is 100% sure?")
    s.create("Empty")
    hits = s.search("__NEXT__")
    assert [h.conversation_id for h in hits] == [c1.id] and "__next__" in hits[0].snippet
    assert [h.conversation_id for h in s.search("decorat")] == [c2.id] and s.search("decorat")[0].snippet == ""
    assert [h.conversation_id for h in s.search("100%")] == [c2.id]
    assert s.search("_nex_") == [] and s.search("1%0") == []  # LIKE's wildcards are matched literally
    assert s.search("   ") == []


def test_presets_are_kept_per_model(tmp_path):
    s = ConversationStore(tmp_path)
    s.save_preset("demo", "terse", "Answer briefly.", {"temperature": 0.2})
    s.save_preset("demo", "terse", "Answer in one line.", {"temperature": 0.1})  # replaces
    s.save_preset("other", "terse", "x", {})
    s.close()
    s = ConversationStore(tmp_path)
    [p] = s.presets("demo")
    assert (p.name, p.system_prompt, p.sampling) == ("terse", "Answer in one line.", {"temperature": 0.1})
    s.delete_preset(p.id)
    assert s.presets("demo") == [] and len(s.presets("other")) == 1


def test_a_branch_written_just_before_a_crash_survives(tmp_path):
    child = textwrap.dedent(
        f"""
        import os
        from sharpi_gui.store import ConversationStore
        s = ConversationStore({str(tmp_path)!r})
        c = s.create("crash")
        q = s.add_message(c.id, "user", "q")
        s.add_message(c.id, "assistant", "a1")
        s.add_message(c.id, "assistant", "a2", parent_id=q.id)
        os._exit(0)  # no close, no checkpoint: as if the app crashed
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True)
    s = ConversationStore(tmp_path)
    [c] = s.conversations()
    assert _texts(s.messages(c.id)) == ["q", "a2"] and len(s.all_messages(c.id)) == 3
