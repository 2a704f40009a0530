"""engine.remote: chatting through an OpenAI-compatible endpoint with a local Session's events — against
``sharpi serve`` in-process and against a third-party server (llama-cpp-python's ``llama_cpp.server``) on
the demo model; ``sharpi run --remote``."""

from __future__ import annotations

import threading

import pytest

from engine.api import Session
from engine.demo import demo_model_path
from engine.errors import SharpIError, UsageError
from engine.generate import SamplingParams
from engine.generate.events import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH
from engine.remote import RemoteError, RemoteSession
from engine.server import ModelHost, ServerOptions, UvicornServer

ASK = [{"role": "user", "content": "What is a decorator?"}]


@pytest.fixture(scope="module")
def sharpi_url():
    with Session.load(str(demo_model_path())) as s:
        server = UvicornServer(ModelHost.from_session(s), port=0, options=ServerOptions(api_key="k"))
        server.start()
        yield server.url, s
        server.stop()


def test_remote_chat_equals_the_local_one(sharpi_url):
    url, local = sharpi_url
    params = SamplingParams.greedy(max_tokens=12)
    local.reset()
    want = "".join(e.text for e in local.generate(messages=ASK, params=params))
    with RemoteSession(url, api_key="k") as r:
        assert r.models == ["sharpi-demo-q8_0"] and r.model == "sharpi-demo-q8_0"
        events = list(r.generate(messages=ASK, params=params))
    assert "".join(e.text for e in events) == want
    last = events[-1]
    assert last.done and last.finish_reason == FINISH_LENGTH and last.n_generated == 12 and last.n_prompt > 0
    assert all(e.token_id is None and not e.done for e in events[:-1])
    assert last.decode_tok_s > 0 and r.last_decode_tok_s > 0
    with RemoteSession(url, api_key="k") as r:
        raw = list(r.generate("In Python", params=SamplingParams.greedy(max_tokens=3)))
    assert raw[-1].done and raw[-1].n_generated <= 3


def test_remote_errors_are_sharpi_errors(sharpi_url):
    url, _ = sharpi_url
    with pytest.raises(RemoteError, match="401"):
        RemoteSession(url, api_key="wrong")
    with pytest.raises(UsageError, match="does not serve"):
        RemoteSession(url, api_key="k", model="gpt-9")
    with pytest.raises(UsageError):
        RemoteSession("ftp://x")
    with pytest.raises(RemoteError, match="cannot reach"):
        RemoteSession("http://127.0.0.1:9/v1")
    with RemoteSession(url, api_key="k") as r, pytest.raises(SharpIError, match="400"):
        list(r.generate(messages=[{"role": "robot", "content": "x"}]))


def test_remote_cancel_stops_the_stream(sharpi_url):
    url, _ = sharpi_url
    with RemoteSession(url, api_key="k") as r:
        out = []
        for ev in r.generate("def f(x):\n", params=SamplingParams.greedy(max_tokens=3000)):
            out.append(ev)
            if len(out) == 3:
                r.cancel()
        assert out[-1].finish_reason == FINISH_CANCELLED and len(out) <= 5
        stop, out = threading.Event(), []  # the generation's own event, as the app's Stop sets it
        for ev in r.generate("def f(x):\n", params=SamplingParams.greedy(max_tokens=3000), cancel=stop):
            out.append(ev)
            if len(out) == 3:
                stop.set()
        assert out[-1].finish_reason == FINISH_CANCELLED and len(out) <= 5


def test_cancel_cuts_a_silent_stream(silent_server):
    """cancel() ends a stream at once even before the server sends a byte of it (it shuts the socket), as
    the app's Stop does; without a cancel the read would wait for the server."""
    with RemoteSession(silent_server, timeout=60) as r:
        out: list = []
        t = threading.Thread(target=lambda: out.extend(r.generate(messages=ASK)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not out  # waiting on the silent server
        r.cancel()
        t.join(30)
        assert not t.is_alive()
        assert [e.finish_reason for e in out] == [FINISH_CANCELLED] and out[0].n_generated == 0
        stop = threading.Event()
        stop.set()  # the generation's own event, set before the stream opens: cut once it does
        assert [e.finish_reason for e in r.generate(messages=ASK, cancel=stop)] == [FINISH_CANCELLED]


@pytest.mark.llama
def test_remote_chat_through_llama_cpp_server(llama_server):
    with RemoteSession(llama_server) as r:
        assert len(r.models) == 1
        events = list(r.generate(messages=ASK, params=SamplingParams(seed=1, max_tokens=16)))
        text = "".join(e.text for e in events)
        assert text and events[-1].done and events[-1].finish_reason in (FINISH_EOS, FINISH_LENGTH)
        assert 0 < events[-1].n_generated <= 16


@pytest.mark.llama
def test_sharpi_run_remote(llama_server, capsys):
    from engine.cli.main import main

    assert main(["run", "--remote", llama_server, "-p", "In Python", "-n", "4", "--temp", "0"]) == 0
    out = capsys.readouterr()
    assert out.out and "placement flags do not apply" in out.err and "[" in out.err
    assert main(["run", "--remote", llama_server, "-m", "x.gguf", "-p", "hi"]) == 2
