"""The app's local server switch (pytest-qt): the dock starts and stops the server over the loaded demo
model, shows the base URL and counts the requests (asked by the official ``openai`` client); the key typed
in the dock is required and remembered in the keyring; the chat waits while an API request generates."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window

pytest.importorskip("pytestqt")

ENDLESS = "def f(x):\n"  # the demo model continues this greedily to the end of its 256-token context


@pytest.fixture
def window(qtbot, tmp_path):
    from engine.demo import demo_model_path

    w = make_window(qtbot, tmp_path)
    load(qtbot, w, demo_model_path())
    return w


def test_switch_serves_the_loaded_model_and_logs_requests(qtbot, window):
    panel = window.server_dock.panel
    model = window.ctx.server
    assert not panel.switch.isChecked() and panel.url.text() == ""
    with qtbot.waitSignal(model.statusChanged):
        status = model.start("127.0.0.1", 0)  # port 0: any free port
    assert status.running and status.model_id == "sharpi-demo-q8_0", status.error
    assert panel.switch.isChecked() and panel.url.text() == status.url and status.url.endswith("/v1")
    assert not panel.host.isEnabled()  # the address is fixed while it runs
    client = openai.OpenAI(base_url=panel.url.text(), api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [status.model_id]
    with qtbot.waitSignal(model.requestLogged, timeout=GEN_TIMEOUT_MS):
        r = client.chat.completions.create(
            model=status.model_id, messages=[{"role": "user", "content": "What is None?"}], max_tokens=4
        )
    assert 1 <= r.usage.completion_tokens <= 4
    assert model.log[-1].status == 200 and model.log[-1].route == "/v1/chat/completions"
    assert panel.requests.topLevelItemCount() == 1 and "1 requests answered" in panel.count.text()
    panel.switch.setChecked(False)  # the switch turns it off
    assert not model.status.running and panel.url.text() == ""
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{status.url}/models", timeout=5)


def test_chat_waits_for_an_api_request(qtbot, window):
    bridge = window.bridge
    status = window.ctx.server.start("127.0.0.1", 0)
    body = {"model": status.model_id, "prompt": ENDLESS, "max_tokens": 200, "temperature": 0, "stream": True}
    seen = threading.Event()
    got: list[str] = []

    def client():
        with httpx.stream("POST", f"{status.url}/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                seen.set()
                got.append(line)

    t = threading.Thread(target=client)
    t.start()
    qtbot.waitUntil(seen.is_set, timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(bridge.waiting, timeout=GEN_TIMEOUT_MS):  # the API holds the model: the chat waits
        rid = bridge.generate([{"role": "user", "content": "What is None?"}], {"max_tokens": 3})
    with qtbot.waitSignal(bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        pass
    assert done.args[0] == rid
    t.join(120)
    chunks = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 200  # the API request ran whole, before the chat
    window.ctx.server.stop()


def test_port_in_use_is_reported(qtbot, window):
    first = window.ctx.server.start("127.0.0.1", 0)
    window.ctx.server.stop()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        status = window.ctx.server.start("127.0.0.1", port)
    assert first.running and not status.running and "could not start" in status.error
    assert window.server_dock.panel.note.text() == status.error and not window.server_dock.panel.switch.isChecked()


def test_the_server_follows_the_model_the_app_loads(qtbot, window, synth_model):
    status = window.ctx.server.start("127.0.0.1", 0)
    other = synth_model("qwen3moe", "F32", vocab=1024).path
    load(qtbot, window, other)
    now = window.bridge.server_status()
    assert now.running and now.model_id == other.stem != status.model_id
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    client = openai.OpenAI(base_url=status.url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=status.model_id, **ask)
    assert client.chat.completions.create(model=now.model_id, **ask).model == now.model_id
    window.ctx.server.stop()


def test_the_key_typed_in_the_dock_is_required_and_remembered(qtbot, window):
    from sharpi_gui.keys import LOCAL_SERVER

    panel = window.server_dock.panel
    panel.key.setText("dock-k3y")
    panel.port.setValue(_free_port())
    with qtbot.waitSignal(window.ctx.server.statusChanged):
        panel.switch.setChecked(True)
    status = window.ctx.server.status
    assert status.running and status.api_key, status.error
    assert window.ctx.keys.get(LOCAL_SERVER) == "dock-k3y" and "keyring" in panel.key_note.text()
    ask = {"model": status.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=status.url, api_key="wrong", max_retries=0).chat.completions.create(**ask)
    keyed = openai.OpenAI(base_url=status.url, api_key="dock-k3y", max_retries=0, timeout=120)
    assert keyed.chat.completions.create(**ask).usage.completion_tokens <= 2
    window.ctx.server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
