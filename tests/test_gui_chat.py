"""The desktop app's chat (pytest-qt, offscreen): load, stream, Stop, persistence, Regenerate,
keyboard, and the errors a user can cause (bad GGUF, unsupported architecture, full context)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402

from sharpi_gui import data as D  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, patch_dialogs, session_of  # noqa: E402


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen3moe", "Q8_0", vocab=1024).path


def _tokens(window):
    """Record (text, GenStats) of every token event the bridge delivers."""
    seen = []
    window.bridge.token.connect(lambda rid, text, stats: seen.append((text, stats)))
    return seen


def test_load_stream_persist_and_restore(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    assert w.windowTitle() == "SharpI"
    card, limits = load(qtbot, w, model_path)
    assert w.windowTitle() == f"SharpI — {card.name}"
    assert card.architecture == "qwen3moe" and card.n_expert == 8 and card.n_layer == 2
    assert limits.n_layer == 2 and limits.is_moe
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 64}

    seen = _tokens(w)
    streamed = []  # what the streaming bubble showed while tokens arrived
    w.ctx.chat.streamText.connect(lambda _t: streamed.append(w.chat.transcript.streaming.text))
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        w.chat.input.setPlainText("Hello there")
        qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)
        assert w.chat.input.toPlainText() == ""  # sent
        assert not w.chat.send_button.isEnabled() and w.chat.stop_button.isEnabled()
    final = done.args[1]
    assert final.finish_reason in ("length", "eos") and final.n_generated >= 2
    # Tokens streamed one event at a time, counting up, and the text accumulated.
    counts = [s.n_generated for _, s in seen]
    assert counts == list(range(1, len(counts) + 1)) and len(counts) == final.n_generated
    reply = "".join(t for t, _ in seen)
    assert w.ctx.chat.stream == reply
    assert streamed and streamed[0] == seen[0][0]  # the first token shows the moment it arrives
    # The status bar shows the speeds and the context in use.
    assert "decode" in w.status["decode"].text() and f"/ {card.n_ctx:,}" in w.status["ctx"].text()
    assert w.status["placement"].text() == "placement: CPU only"

    # Saved at once: a second window over the same data directory sees the conversation.
    conv = w.ctx.chat.current
    stored = w.ctx.store.messages(conv.id)
    assert [(m.role, m.content) for m in stored] == [("user", "Hello there"), ("assistant", reply)]
    assert stored[1].meta["finish_reason"] == final.finish_reason
    w.close()

    w2 = make_window(qtbot, tmp_path)
    assert [c.title for c in w2.ctx.chat.conversations] == ["Hello there"]
    assert w2.ctx.chat.current.id == conv.id  # reopened where the user left off
    assert [(b.role, b.text) for b in w2.chat.transcript.bubbles] == [("user", "Hello there"), ("assistant", reply)]
    assert w2.settings.recent_models == [str(model_path)]


def test_streaming_bubble_coalesces_fast_updates(qtbot):
    """A burst of stream updates renders the first at once and the latest after STREAM_RENDER_MS,
    never each one (what keeps a fast model from flooding the UI thread with Markdown layouts)."""
    from sharpi_gui.views.transcript import TranscriptView

    view = TranscriptView()
    qtbot.addWidget(view)
    view.begin_stream()
    view.update_stream("a")
    assert view.streaming.text == "a"  # the first update renders at once
    view.update_stream("ab")
    view.update_stream("abc")
    assert view.streaming.text == "a"  # the rest wait for the render timer
    qtbot.waitUntil(lambda: view.streaming.text == "abc", timeout=GEN_TIMEOUT_MS)  # the latest wins
    view.end_stream(None)
    assert view.streaming is None and not view.bubbles


def test_stop_within_one_token_and_stopped_reply_saved(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    w.settings.set_ctx_for(str(model_path), 4096)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 4000}
    seen = _tokens(w)
    assert w.ctx.chat.send("Count to a thousand")
    qtbot.waitUntil(lambda: len(seen) >= 3, timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        qtbot.mouseClick(w.chat.stop_button, Qt.MouseButton.LeftButton)
        at_stop = w.ctx.chat.tokens_at_stop  # tokens the engine had made when Stop was pressed
    final = done.args[1]
    assert final.finish_reason == "cancelled"
    assert at_stop >= 3 and final.n_generated <= at_stop + 1
    msg = w.ctx.store.messages(w.ctx.chat.current.id)[-1]
    assert msg.role == "assistant" and msg.meta["finish_reason"] == "cancelled"
    assert msg.content == w.ctx.chat.stream and msg.content
    assert "stopped" in w.chat.transcript.bubbles[-1].footer.text()


def test_regenerate_keeps_the_previous_reply(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 1.0, "seed": 1, "max_tokens": 6}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.send("Tell me a story")
    w.settings.sampling = {"temperature": 1.0, "seed": 2, "max_tokens": 6}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.actions_by_name["regenerate"].trigger()
    roles = [m.role for m in w.ctx.store.messages(w.ctx.chat.current.id)]
    assert roles == ["user", "assistant"]
    assert [b.role for b in w.chat.transcript.bubbles] == ["user", "assistant"]
    assert len(w.ctx.store.all_messages(w.ctx.chat.current.id)) == 3  # the first reply is kept (test_gui_branches)


def test_enter_sends_shift_enter_adds_a_line(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    w.settings.sampling = {"max_tokens": 2}
    box = w.chat.input
    box.setFocus()
    qtbot.keyClicks(box, "first line")
    qtbot.keyClick(box, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(box, "second")
    assert box.toPlainText() == "first line\nsecond"
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        qtbot.keyClick(box, Qt.Key.Key_Return)
    assert box.toPlainText() == ""
    assert w.ctx.store.messages(w.ctx.chat.current.id)[0].content == "first line\nsecond"


def test_conversations_new_rename_delete_and_system_prompt(qtbot, tmp_path, monkeypatch):
    rec = patch_dialogs(monkeypatch)
    w = make_window(qtbot, tmp_path)
    chat = w.ctx.chat
    first = chat.new_conversation()
    second = chat.new_conversation()
    assert w.chat.conversations.list.count() == 2 and chat.current.id == second.id
    # Rename through the dialog (its exec is patched to type the new title and accept).
    rec.texts.append("Renamed")
    w.actions_by_name["rename"].trigger()
    assert w.ctx.store.conversation(second.id).title == "Renamed"
    assert w.chat.conversations.list.currentItem().text() == "Renamed"
    # The system prompt is stored with the conversation and leads the engine's messages.
    w.chat.show_system_prompt()
    w.chat.system_edit.setPlainText("You are terse.")
    w.chat._commit_system()
    assert w.ctx.store.conversation(second.id).system_prompt == "You are terse."
    assert chat.chat_messages() == [{"role": "system", "content": "You are terse."}]
    # Delete asks first; "No" keeps it, "Yes" removes it.
    from PySide6.QtWidgets import QMessageBox

    rec.answers["QMessageBox"] = QMessageBox.StandardButton.No
    w.chat.delete_current()
    assert w.ctx.store.conversation(second.id) is not None
    rec.answers["QMessageBox"] = QMessageBox.StandardButton.Yes
    w.chat.delete_current()
    assert w.ctx.store.conversation(second.id) is None
    assert [c.id for c in chat.conversations] == [first.id] and chat.current.id == first.id


def test_bad_and_unsupported_files_show_dialogs_and_the_app_keeps_running(qtbot, tmp_path, monkeypatch, model_path):
    rec = patch_dialogs(monkeypatch)
    w = make_window(qtbot, tmp_path)
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(model_path.read_bytes().replace(b"qwen3moe", b"qwen9moe"))  # same length: still valid
    for path, kind in (
        (bad, D.ERR_BAD_FILE),
        (foreign, D.ERR_UNSUPPORTED),
        (tmp_path / "missing.gguf", D.ERR_BAD_FILE),
    ):
        with qtbot.waitSignal(w.bridge.loadFailed, timeout=GEN_TIMEOUT_MS) as failed:
            w.open_model(str(path))
        assert failed.args[0].kind == kind
        box = rec.errors()[-1]
        assert box.objectName() == f"error-{kind}" and path.name in box.text()
        assert not w.progress.isVisible() and w.bridge.state == "idle"
    assert "qwen9moe" in rec.errors()[1].informativeText()
    # Still alive: a good model loads and answers.
    load(qtbot, w, model_path)
    w.settings.sampling = {"max_tokens": 3}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        assert w.ctx.chat.send("hi")
    assert w.settings.recent_models == [str(model_path)]


def test_full_context_is_an_inline_message(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    w.settings.set_ctx_for(str(model_path), 40)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 1000}
    # The reply runs into the end of the context: it is kept, and a note says why it ended.
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        w.ctx.chat.send("hi")
    assert done.args[1].finish_reason == "context"
    assert w.chat.transcript.bubbles[-1].role == "notice"
    assert "Context full" in w.chat.transcript.bubbles[-1].text
    # A prompt that cannot fit at all is refused with the engine's explanation, not a crash.
    with qtbot.waitSignal(w.bridge.failed, timeout=GEN_TIMEOUT_MS) as failed:
        w.ctx.chat.send("word " * 60)
    assert failed.args[1].kind == D.ERR_CONTEXT
    assert "context" in w.chat.transcript.bubbles[-1].text
    assert w.bridge.state == "idle" and session_of(w) is not None


def test_closing_mid_reply_keeps_it_and_deleting_a_streaming_chat_is_safe(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    w.settings.set_ctx_for(str(model_path), 4096)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 4000}
    seen = _tokens(w)
    assert w.ctx.chat.send("A long reply, please")
    cid = w.ctx.chat.current.id
    qtbot.waitUntil(lambda: len(seen) >= 2, timeout=GEN_TIMEOUT_MS)
    w.close()  # mid-reply
    w2 = make_window(qtbot, tmp_path)
    msgs = w2.ctx.store.messages(cid)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].meta["finish_reason"] == "cancelled"
    assert msgs[1].content and "".join(t for t, _ in seen).startswith(msgs[1].content)

    # Deleting the conversation a reply streams into stops it; nothing is saved, nothing breaks.
    load(qtbot, w2, model_path)
    w2.settings.sampling = {"temperature": 0.0, "max_tokens": 4000}
    seen2 = _tokens(w2)
    assert w2.ctx.chat.send("Another long one")
    doomed = w2.ctx.chat.current.id
    qtbot.waitUntil(lambda: len(seen2) >= 2, timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(w2.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w2.ctx.chat.delete(doomed)
    assert w2.ctx.store.conversation(doomed) is None and w2.ctx.store.messages(doomed) == []
    assert not w2.ctx.chat.busy and w2.bridge.state == "idle"


def test_opening_a_model_while_a_reply_streams_stops_it_then_loads(qtbot, tmp_path, model_path, synth_model):
    other = synth_model("qwen3moe", "F32", vocab=1024).path
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 4000}
    seen = _tokens(w)
    assert w.ctx.chat.send("Keep going")
    qtbot.waitUntil(lambda: len(seen) >= 2, timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(w.bridge.loaded, timeout=GEN_TIMEOUT_MS) as loaded:
        assert not w.open_model(str(other))  # deferred: the reply is stopped first
    assert loaded.args[0].path == str(other)
    last = w.ctx.store.messages(w.ctx.chat.current.id)[-1]
    assert last.role == "assistant" and last.meta["finish_reason"] == "cancelled"


def test_a_stop_right_after_send_cancels_the_reply(qtbot, tmp_path, model_path):
    """Stop lands before the engine worker has started the request: the reply is cancelled, not run to
    its limit (the stop event travels with the request)."""
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        rid = w.bridge.generate([{"role": "user", "content": "Hello"}], {"temperature": 0.0, "max_tokens": 200})
        assert rid
        w.bridge.stop()
    assert done.args[1].finish_reason == "cancelled" and done.args[1].n_generated <= 1


def test_a_failing_chat_template_offers_chatml(qtbot, tmp_path, model_path, monkeypatch):
    """A template that fails (here: loops past its time limit) ends the reply with the error, and the app asks
    before switching to ChatML; after Yes, the next message is answered."""
    from PySide6.QtWidgets import QMessageBox

    from engine.tokenizer.chat import ChatTemplate, RenderLimits
    from sharpi_gui.testing import patch_dialogs

    rec = patch_dialogs(monkeypatch)
    rec.answers["QMessageBox"] = QMessageBox.StandardButton.Yes
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    hostile = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    hostile.limits = RenderLimits(seconds=0.2)
    session_of(w).chat_template = hostile
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 2}
    with qtbot.waitSignal(w.bridge.failed, timeout=GEN_TIMEOUT_MS) as failed:
        w.chat.input.setPlainText("Hello")
        qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)
    assert failed.args[1].kind == D.ERR_TEMPLATE and "time limit" in failed.args[1].message
    qtbot.waitUntil(lambda: any("ChatML" in d.text() for d in rec.shown if isinstance(d, QMessageBox)))
    assert not session_of(w).chat_template.from_file  # switched, after the question
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        w.chat.input.setPlainText("Hello again")
        qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)
    assert done.args[1].n_generated >= 1


def test_status_bar_shows_mtp_acceptance(qtbot, tmp_path):
    """A reply decoded with MTP drafts: the status bar's decode figure carries the acceptance (engine events ->
    GenStats -> the status bar); without drafts nothing is added."""
    from engine.generate.events import GenerationEvent
    from sharpi_gui.bridge.convert import gen_stats

    w = make_window(qtbot, tmp_path)
    ev = GenerationEvent("x", 5, 3, 9, 12, 64, 0.1, 50.0, 7.5, mtp_passes=4, mtp_drafted=8, mtp_accepted=3)
    w._render_stats(gen_stats(ev))
    assert w.status["decode"].text() == "decode 7.5 tok/s · MTP 38% accepted"
    w._render_stats(gen_stats(GenerationEvent("x", 5, 3, 9, 12, 64, 0.1, 50.0, 7.5)))
    assert w.status["decode"].text() == "decode 7.5 tok/s"
