"""A reply's reasoning in the app (pytest-qt, offscreen): shown open under "Thinking…" while it streams, folded
away once the answer starts, saved with the reply (surviving a crash, migrated into an older database), shown
folded when the chat is reopened, and handed to the template beside the answer — which drops it from the next
prompt (gpt-oss's harmony, on the synthetic gpt-oss file with a scripted reply)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402

from engine.synth.writer import write_model  # noqa: E402
from sharpi_gui.store import ConversationStore  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, session_of  # noqa: E402
from sharpi_gui.theme import LIGHT  # noqa: E402
from sharpi_gui.views.transcript import REASONING, THINKING, MessageWidget  # noqa: E402
from tests.scripted import ScriptedModel  # noqa: E402

THOUGHT = "The user asks for 2+2. Adding two and two gives four; no trick here."
ANSWER = "2 + 2 = **4**."
REPLY = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony-gui") / "gpt-oss.gguf"
    write_model(path, "gpt-oss")
    return path


def _script(window) -> None:
    s = session_of(window)
    tok = s.tokenizer
    s.model = ScriptedModel([*tok.encode(REPLY, add_bos=False), tok.token_id("<|return|>")], tok.n_vocab, s.model)


def test_reasoning_streams_folds_saves_and_stays_out_of_the_next_prompt(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 128}
    real = session_of(w).model
    _script(w)
    seen = []  # (reasoning so far, answer so far, toggle text, reasoning shown open) at each update

    def look(*_):
        b = w.chat.transcript.streaming
        w.chat.transcript._render_stream()  # render now (updates are coalesced by a timer)
        seen.append((w.ctx.chat.reasoning, w.ctx.chat.stream, b.reasoning_toggle.text(), b.reasoning_open))

    w.ctx.chat.streamReasoning.connect(look)
    w.ctx.chat.streamText.connect(look)
    try:
        with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
            w.chat.input.setPlainText("What is 2+2?")
            qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)
        thinking = [s for s in seen if s[0] and not s[1]]
        answering = [s for s in seen if s[1]]
        assert len(thinking) > 3 and answering
        assert all(s[2] == f"▾ {THINKING}" and s[3] for s in thinking)  # open while it thinks
        assert all(s[2] == f"▸ {REASONING}" and not s[3] for s in answering)  # folded once the answer starts
        bubble = w.chat.transcript.bubbles[-1]
        assert bubble.reasoning == THOUGHT and bubble.text == ANSWER and not bubble.reasoning_open
        bubble.reasoning_toggle.click()
        assert bubble.reasoning_open and bubble.reasoning_toggle.text() == f"▾ {REASONING}"

        # saved with the reply
        conv = w.ctx.chat.current
        stored = w.ctx.store.messages(conv.id)
        assert [(m.role, m.content, m.reasoning) for m in stored] == [
            ("user", "What is 2+2?", ""),
            ("assistant", ANSWER, THOUGHT),
        ]
        # the next turn: the reasoning goes beside the answer, and the template leaves it out of the prompt
        msgs = [*w.ctx.chat.chat_messages(), {"role": "user", "content": "And 3+3?"}]
        assert msgs[1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
        prompt = session_of(w).detokenize(session_of(w).chat_ids(msgs))
        assert THOUGHT not in prompt and f"<|channel|>final<|message|>{ANSWER}<|end|>" in prompt
    finally:
        session_of(w).model = real
    w.close()

    # reopened: the reasoning is there, folded
    w2 = make_window(qtbot, tmp_path)
    b = w2.chat.transcript.bubbles[-1]
    assert (b.text, b.reasoning) == (ANSWER, THOUGHT)
    assert b.reasoning_toggle.isVisibleTo(b) and not b.reasoning_open
    assert not w2.chat.transcript.bubbles[0].reasoning_toggle.isVisibleTo(w2.chat.transcript.bubbles[0])
    w2.close()


def test_a_reply_without_reasoning_shows_no_toggle(qtbot):
    m = MessageWidget("assistant", "Hello.", {}, LIGHT)
    qtbot.addWidget(m)
    m.show()
    assert not m.reasoning_toggle.isVisible() and not m.reasoning_view.isVisible()
    m.set_reasoning("", streaming=True)  # a reply that starts thinking: the toggle says so at once
    assert m.reasoning_toggle.isVisible() and m.reasoning_toggle.text() == f"▾ {THINKING}"
    m.set_reasoning("step one", streaming=True)
    assert m.reasoning_view.isVisible()
    m.reasoning_toggle.click()  # the user folds it while it streams: it stays as the user left it
    m.set_reasoning("step one, two", streaming=True)
    assert not m.reasoning_view.isVisible()


def test_reasoning_survives_a_crash_and_an_older_database_is_migrated(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    db = sqlite3.connect(old / "conversations.sqlite3")
    db.executescript(
        """
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL,
            leaf_id INTEGER);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL
            REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,
            created REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}', parent_id INTEGER);
        INSERT INTO conversations VALUES (1, 'one', '', 0, 0, NULL);
        INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'a', 0);
        """
    )
    db.commit()
    db.close()
    s = ConversationStore(old)
    assert s.notice is None and [(m.content, m.reasoning) for m in s.messages(1)] == [("a", "")]
    s.add_message(1, "assistant", "b", reasoning="r")
    assert [(m.content, m.reasoning) for m in ConversationStore(old).messages(1)] == [("a", ""), ("b", "r")]

    child = textwrap.dedent(
        f"""
        import os
        from sharpi_gui.store import ConversationStore
        s = ConversationStore({str(tmp_path)!r})
        c = s.create("crash")
        s.add_message(c.id, "user", "q")
        s.add_message(c.id, "assistant", "answer", reasoning="why")
        os._exit(0)  # no close, no checkpoint: as if the app crashed
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, cwd=os.getcwd())
    s = ConversationStore(tmp_path)
    [c] = s.conversations()
    assert [(m.content, m.reasoning) for m in s.messages(c.id)] == [("q", ""), ("answer", "why")]


def test_export_keeps_the_reasoning(qtbot, tmp_path):
    import json

    w = make_window(qtbot, tmp_path)
    chat = w.ctx.chat
    conv = chat.store.create("x")
    q = chat.store.add_message(conv.id, "user", "q")
    chat.store.add_message(conv.id, "assistant", "a", parent_id=q.id, reasoning="because\nso")
    doc = json.loads(Path(chat.export(str(tmp_path / "c.json"), conv.id)).read_text())
    assert doc["messages"][1]["reasoning"] == "because\nso" and "reasoning" not in doc["messages"][0]
    md = Path(chat.export(str(tmp_path / "c.md"), conv.id)).read_text()
    assert "> because\n> so\n" in md
    w.close()
