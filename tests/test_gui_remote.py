"""The app's chat through a remote OpenAI-compatible endpoint (pytest-qt, offscreen), against a third-party
server started for the test run — llama-cpp-python's ``llama_cpp.server`` on the demo model (the
``llama_server`` fixture): the connect dialog lists its models, the reply streams into the chat's bubble
piece by piece, Stop ends it mid-reply, and the placement and experts docks say they do not apply."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QDialog  # noqa: E402

from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, patch_dialogs  # noqa: E402
from sharpi_gui.views.remote import ConnectDialog, normalized_url  # noqa: E402

pytestmark = pytest.mark.llama
CONNECT_TIMEOUT_MS = 60_000


def _connect(qtbot, window, url: str, api_key: str = "", model: str = ""):
    with qtbot.waitSignal(window.bridge.remoteConnected, timeout=CONNECT_TIMEOUT_MS) as blocker:
        assert window.connect_remote(url, api_key, model)
    return blocker.args[0]


def test_normalized_url():
    assert normalized_url(" http://gpu-box:8000/ ") == "http://gpu-box:8000/v1"
    assert normalized_url("https://api.example.com/v1/") == "https://api.example.com/v1"
    assert normalized_url("http://h/openai/v1") == "http://h/openai/v1"  # a path given is kept
    assert normalized_url("gpu-box:8000") == "gpu-box:8000"  # left for the dialog to refuse


def test_dialog_lists_the_models_and_connects_the_chat(qtbot, tmp_path, monkeypatch, llama_server):
    w = make_window(qtbot, tmp_path)
    dialogs: list[ConnectDialog] = []

    def fill_and_accept(dlg):  # the user types a bare host, lists the models, picks one, presses Connect
        dialogs.append(dlg)
        assert not dlg.connect_button.isEnabled()  # nothing listed yet
        dlg.url_edit.setText(llama_server.removesuffix("/v1"))
        with qtbot.waitSignal(w.bridge.remoteModels, timeout=CONNECT_TIMEOUT_MS):
            qtbot.mouseClick(dlg.list_button, Qt.MouseButton.LeftButton)
        assert dlg.models.count() == 1 and dlg.connect_button.isEnabled()
        assert "1 model served at" in dlg.state.text()
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ConnectDialog, "exec", fill_and_accept)
    with qtbot.waitSignal(w.bridge.remoteConnected, timeout=CONNECT_TIMEOUT_MS) as blocker:
        w.actions_by_name["connect"].trigger()
    info = blocker.args[0]
    assert dialogs and dialogs[0].url() == llama_server and info.base_url == llama_server
    assert info.model == dialogs[0].model() and info.models == (info.model,)
    assert w.bridge.remote == info and w.bridge.has_model and w.bridge.model_card is None
    assert w.windowTitle() == f"SharpI — {info.model} @ {llama_server}"
    assert w.status["placement"].text() == f"remote: {info.model} @ {llama_server}"
    assert w.settings.remote_url == llama_server  # the URL is remembered; the key never is
    assert w.chat.send_button.isEnabled()
    # The docks say they do not apply; their engine calls answer without a local model.
    for dock, what in ((w.placement_dock, "Placement does"), (w.experts_dock, "Expert statistics do")):
        assert dock.pages.currentWidget() is dock.remote_note
        assert f"{what} not apply to a remote model" in dock.remote_note.text()
        assert llama_server in dock.remote_note.text() and "no reply yet" in dock.remote_note.text()
    assert w.bridge.preview(w.ctx.placement.settings or _any_settings()).error
    assert w.bridge.poll_stats(force=True) is None
    assert not w.bridge.apply(_any_settings())


def _any_settings():
    from sharpi_gui import data as D

    return D.PlanSettings(vram_bytes=1 << 30, ctx=256)


def test_dialog_says_why_an_endpoint_cannot_be_listed(qtbot, tmp_path):
    w = make_window(qtbot, tmp_path, show=False)
    dlg = ConnectDialog(w.bridge, "", w, w.ctx.keys)
    qtbot.addWidget(dlg)
    dlg.url_edit.setText("gpu-box:8000")
    dlg.list_models()
    assert "starts with http://" in dlg.state.text() and dlg.models.count() == 0
    dlg.url_edit.setText("http://127.0.0.1:9/v1")  # nothing listens on the discard port
    with qtbot.waitSignal(w.bridge.remoteModels, timeout=CONNECT_TIMEOUT_MS) as blocker:
        dlg.list_models()
    assert blocker.args[1] is None and "cannot reach" in dlg.state.text()
    assert not dlg.connect_button.isEnabled() and dlg.list_button.isEnabled()


def test_connect_failure_is_a_dialog(qtbot, tmp_path, monkeypatch):
    w = make_window(qtbot, tmp_path)
    rec = patch_dialogs(monkeypatch)
    with qtbot.waitSignal(w.bridge.loadFailed, timeout=CONNECT_TIMEOUT_MS) as blocker:
        assert w.connect_remote("http://127.0.0.1:9/v1")
    assert "Could not connect" in blocker.args[0].title and rec.errors()
    assert not w.bridge.has_model and w.bridge.state == "idle" and not w.progress.isVisible()


def test_chat_streams_from_llama_cpp_server(qtbot, tmp_path, llama_server):
    w = make_window(qtbot, tmp_path)
    info = _connect(qtbot, w, llama_server)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 24}
    pieces: list[str] = []
    shown: list[str] = []  # what the streaming bubble showed as each piece arrived
    w.bridge.token.connect(lambda _rid, text, _s: pieces.append(text))
    w.ctx.chat.streamText.connect(lambda _t: shown.append(w.chat.transcript.streaming.text))
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        w.chat.input.setPlainText("What is a decorator?")
        qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)
        assert w.chat.stop_button.isEnabled() and not w.chat.send_button.isEnabled()
    final = done.args[1]
    reply = "".join(pieces)
    assert final.finish_reason in ("eos", "length") and 2 <= final.n_generated <= 24
    assert len(pieces) >= 2 and reply.strip()  # streamed piece by piece, not as one answer
    assert shown and shown[0] == pieces[0] and w.ctx.chat.stream == reply
    assert final.decode_tok_s > 0 and "decode" in w.status["decode"].text()
    assert w.status["ctx"].text() == "context —"  # a remote stream does not say its context
    stored = w.ctx.store.messages(w.ctx.chat.current.id)
    assert [(m.role, m.content) for m in stored] == [("user", "What is a decorator?"), ("assistant", reply)]
    assert stored[1].meta["finish_reason"] == final.finish_reason
    bubbles = w.chat.transcript.bubbles
    assert [b.role for b in bubbles] == ["user", "assistant"] and bubbles[-1].text == reply
    assert "tok/s (measured here)" in w.placement_dock.remote_note.text()  # the notes show the reply's speed
    assert info.base_url in w.experts_dock.remote_note.text()


def test_stop_ends_a_remote_reply(qtbot, tmp_path, llama_server):
    w = make_window(qtbot, tmp_path)
    _connect(qtbot, w, llama_server)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 200}  # the demo model's reply runs ~80 tokens
    # The demo model streams faster than the UI thread takes the tokens: hold the worker after its third
    # piece (a server that slows down) until Stop is pressed, so Stop lands mid-reply every time.
    gate, seen = threading.Event(), []

    def on_worker(_rid, text, _stats):  # on the engine thread
        seen.append(text)
        if len(seen) == 3:
            gate.wait(GEN_TIMEOUT_MS / 1000)

    w.bridge._worker.token.connect(on_worker, Qt.ConnectionType.DirectConnection)
    assert w.ctx.chat.send("What is a decorator?")
    qtbot.waitUntil(lambda: len(w.ctx.chat.stream) > 0 and len(seen) >= 3, timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        qtbot.mouseClick(w.chat.stop_button, Qt.MouseButton.LeftButton)
        gate.set()
    final = done.args[1]
    assert final.finish_reason == "cancelled" and final.n_generated == 3
    msg = w.ctx.store.messages(w.ctx.chat.current.id)[-1]
    assert msg.role == "assistant" and msg.meta["finish_reason"] == "cancelled" and msg.content == "".join(seen)
    assert "stopped" in w.chat.transcript.bubbles[-1].footer.text()
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as again:  # the endpoint still answers
        w.settings.sampling = {"temperature": 0.0, "max_tokens": 4}
        assert w.ctx.chat.regenerate()
    assert again.args[1].finish_reason in ("eos", "length")


def test_remote_replaces_the_local_model_and_back(qtbot, tmp_path, llama_server):
    from engine.demo import demo_model_path

    w = make_window(qtbot, tmp_path)
    load(qtbot, w, demo_model_path())
    status = w.ctx.server.start("127.0.0.1", 0)  # the local server follows what the chat has
    assert httpx.get(f"{status.url}/models", timeout=10).status_code == 200
    assert w.placement_dock.pages.currentWidget() is not w.placement_dock.remote_note
    _connect(qtbot, w, llama_server)
    assert w.bridge.model_card is None and w.bridge.limits is None and w.card is None
    assert not w.actions_by_name["card"].isEnabled()
    assert httpx.get(f"{status.url.removesuffix('/v1')}/health", timeout=10).status_code == 503
    load(qtbot, w, demo_model_path())  # a local model again: the docks come back
    assert w.bridge.remote is None and w.remote is None and w.actions_by_name["card"].isEnabled()
    for dock in (w.placement_dock, w.experts_dock):
        assert dock.pages.currentWidget() is not dock.remote_note
    assert httpx.get(f"{status.url.removesuffix('/v1')}/health", timeout=10).status_code == 200
    w.ctx.server.stop()


def test_stop_while_the_server_is_silent(qtbot, tmp_path, silent_server):
    """Stop ends a remote reply at once even before the server sends anything (a long prompt on a busy
    server): the connection is cut, the chat is free again."""
    w = make_window(qtbot, tmp_path)
    _connect(qtbot, w, silent_server)
    assert w.ctx.chat.send("What is a decorator?")
    qtbot.waitUntil(lambda: w.bridge._worker.holding, timeout=GEN_TIMEOUT_MS)  # the request is out
    with qtbot.waitSignal(w.bridge.finished, timeout=30_000) as done:
        qtbot.mouseClick(w.chat.stop_button, Qt.MouseButton.LeftButton)
    assert done.args[1].finish_reason == "cancelled" and done.args[1].n_generated == 0
    assert not w.ctx.chat.busy and w.chat.send_button.isEnabled()
