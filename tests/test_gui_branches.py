"""Branching chats in the app (pytest-qt, offscreen): Regenerate keeps alternatives (← 1/2 → on the
reply), Edit resends a question as a new branch with the old one reachable, Copy per message, search
across conversations, presets (system prompt + sampling) per model; all of it read back from the store
by a second window."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QGuiApplication  # noqa: E402

from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, patch_dialogs  # noqa: E402


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen3moe", "Q8_0", vocab=1024).path


def _ask(qtbot, w, text: str) -> None:
    w.chat.input.setPlainText(text)
    with qtbot.waitSignal(w.ctx.chat.streamEnded, timeout=GEN_TIMEOUT_MS):
        qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)


def _shown(w) -> list[tuple[str, str]]:
    return [(b.role, b.text) for b in w.chat.transcript.bubbles]


def test_regenerate_and_edit_keep_every_branch(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path, simulate_device=False)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 1.0, "seed": 1, "max_tokens": 5}
    _ask(qtbot, w, "Tell me a story")
    first = w.chat.transcript.bubbles[-1].text
    w.settings.sampling = {"temperature": 1.0, "seed": 2, "max_tokens": 5}
    with qtbot.waitSignal(w.ctx.chat.streamEnded, timeout=GEN_TIMEOUT_MS):
        qtbot.mouseClick(w.chat.regen_button, Qt.MouseButton.LeftButton)
    second = w.chat.transcript.bubbles[-1].text
    assert first != second
    reply = w.chat.transcript.bubbles[-1]
    assert reply.branch_label.isVisibleTo(w) and reply.branch_label.text() == "2/2"
    assert reply.prev_button.isEnabled() and not reply.next_button.isEnabled()
    qtbot.mouseClick(reply.prev_button, Qt.MouseButton.LeftButton)  # ←: the first reply again
    assert _shown(w) == [("user", "Tell me a story"), ("assistant", first)]
    assert w.chat.transcript.bubbles[-1].branch_label.text() == "1/2"

    # Copy on a bubble puts the message on the clipboard as written
    qtbot.mouseClick(w.chat.transcript.bubbles[-1].copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == first

    # Edit the question: a second branch; the first (with both replies) stays reachable
    question = w.chat.transcript.bubbles[0]
    qtbot.mouseClick(question.edit_button, Qt.MouseButton.LeftButton)
    assert w.chat.input.toPlainText() == "Tell me a story" and w.chat.send_button.text() == "Resend"
    _ask(qtbot, w, "Tell me a poem")
    assert [t for _r, t in _shown(w)][0] == "Tell me a poem" and len(w.chat.transcript.bubbles) == 2
    assert w.chat.send_button.text() == "Send"
    assert w.chat.transcript.bubbles[0].branch_label.text() == "2/2"
    qtbot.mouseClick(w.chat.transcript.bubbles[0].prev_button, Qt.MouseButton.LeftButton)
    assert _shown(w) == [("user", "Tell me a story"), ("assistant", second)]  # that branch's newest reply
    cid = w.ctx.chat.current.id
    assert len(w.ctx.store.all_messages(cid)) == 5

    # a second window over the same data shows the same branch, arrows and all
    w2 = make_window(qtbot, tmp_path, simulate_device=False)
    w2.ctx.chat.select(cid)
    assert _shown(w2) == _shown(w)
    assert w2.chat.transcript.bubbles[0].branch_label.text() == "1/2"
    assert w2.chat.transcript.bubbles[1].branch_label.text() == "2/2"


def test_search_across_conversations(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path, simulate_device=False)
    load(qtbot, w, model_path)
    w.settings.sampling = {"max_tokens": 3}
    _ask(qtbot, w, "What does __init__ do?")
    w.ctx.chat.new_conversation()
    _ask(qtbot, w, "Explain decorators")
    box = w.chat.conversations.search
    lst = w.chat.conversations.list
    assert lst.count() == 2
    qtbot.keyClicks(box, "__init__")
    assert lst.count() == 1 and "What does __init__ do?" in lst.item(0).text()
    lst.setCurrentRow(0)
    assert w.ctx.chat.messages[0].content == "What does __init__ do?"
    box.clear()
    assert lst.count() == 2


def test_presets_per_model(qtbot, tmp_path, monkeypatch, model_path, synth_model):
    rec = patch_dialogs(monkeypatch)
    w = make_window(qtbot, tmp_path, simulate_device=False)
    load(qtbot, w, model_path)
    chat = w.ctx.chat
    chat.set_system_prompt("You answer in French.")
    w.settings.sampling = {"temperature": 0.2, "max_tokens": 7}
    rec.texts.append("french")
    qtbot.mouseClick(w.chat.save_preset_button, Qt.MouseButton.LeftButton)
    assert [p.name for p in chat.presets()] == ["french"] and w.chat.preset_box.count() == 2

    chat.new_conversation()
    w.settings.sampling = {}
    assert chat.current.system_prompt == "You answer in French."  # the default carries over; clear it
    chat.set_system_prompt("")
    w.chat.preset_box.setCurrentIndex(1)
    w.chat.preset_box.activated.emit(1)
    assert chat.current.system_prompt == "You answer in French."
    assert w.settings.sampling == {"temperature": 0.2, "max_tokens": 7}
    assert w.chat.system_edit.toPlainText() == "You answer in French."

    other = synth_model("qwen3moe", "Q8_0", vocab=512).path  # another model: its own (empty) list
    load(qtbot, w, other)
    assert chat.presets() == [] and not w.chat.preset_box.isEnabled()
    load(qtbot, w, model_path)
    assert [p.name for p in chat.presets()] == ["french"]
