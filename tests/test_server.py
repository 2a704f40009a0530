"""engine.server against the bundled demo model, driven by the official ``openai`` client against the real
server (uvicorn on a thread, on a loopback port): chat (streaming and not), completions, models, usage
(``stream_options.include_usage``) and timings, stop strings, errors as the client's exception classes
(BadRequestError, NotFoundError, AuthenticationError, RateLimitError under a full queue), a client that
disconnects cancelling its generation within one token, /health while loading, /metrics parsed with
prometheus_client's parser, and ``sharpi serve`` as a command. Plain HTTP only where the client cannot
go: bodies that are not JSON, /health and /metrics, a raw socket closed mid-request."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from engine.api import Session
from engine.demo import demo_model_path
from engine.server import ModelHost, ServerOptions, UvicornServer

QUESTION = [{"role": "user", "content": "What is a decorator?"}]
ENDLESS = "def f(x):\n"  # the demo model continues this greedily past 1,500 tokens (no EOS)
ERROR_FIELDS = {"message", "type", "param", "code"}


def wait_until(cond, timeout=60.0, what="condition"):
    """Poll ``cond`` (no fixed sleeps); fail after ``timeout`` seconds (a hang, not a timing claim)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture(scope="module")
def session():
    with Session.load(str(demo_model_path())) as s:
        yield s


@pytest.fixture
def host(session):
    return ModelHost.from_session(session)


@contextlib.contextmanager
def serving(host: ModelHost, options: ServerOptions | None = None):
    """The real server over ``host`` on a free loopback port, stopped (and its runner thread ended) after."""
    server = UvicornServer(host, port=0, options=options)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        host.runner.close()
        wait_until(lambda: host.runner._worker is None, what="the runner's thread to end")


def openai_client(server: UvicornServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=900)


@pytest.fixture
def live(host):
    with serving(host) as server:
        yield server


@pytest.fixture
def client(live):
    with openai_client(live) as c:
        yield c


def chat(client, host, **kw):
    return client.chat.completions.create(
        **{"model": host.model_id, "messages": QUESTION, "temperature": 0, "max_tokens": 12, **kw}
    )


def root(server: UvicornServer) -> str:
    return server.url.removesuffix("/v1")


# -- the routes ------------------------------------------------------------------------------------
def test_chat_non_streaming_uses_the_models_template(client, host, session):
    r = chat(client, host)
    assert r.object == "chat.completion" and r.model == host.model_id and r.id
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length" and not choice.message.tool_calls
    # the same prompt ids and greedy tokens as the engine's own chat path (Session.generate(messages=...))
    from engine.generate import SamplingParams

    session.reset()
    direct = "".join(e.text for e in session.generate(messages=QUESTION, params=SamplingParams.greedy(max_tokens=12)))
    assert choice.message.content == direct
    u = r.usage
    assert u.prompt_tokens == len(session.prompt_ids(messages=QUESTION)) and u.completion_tokens == 12
    assert u.total_tokens == u.prompt_tokens + 12
    assert u.prompt_tokens_details.cached_tokens + r.timings["prompt_n"] == u.prompt_tokens
    t = r.timings  # llama-server's timings, an extra field the client keeps
    assert t["predicted_n"] == 12 and t["prompt_n"] + t["cache_n"] == u.prompt_tokens
    assert t["predicted_per_second"] > 0 and t["ttft_ms"] > 0


def test_chat_streaming_matches_non_streaming_with_usage(client, host):
    whole = chat(client, host)
    chunks = list(chat(client, host, stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # streamed piece by piece
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == "length" and final[0].timings["predicted_n"] == 12
    usage = chunks[-1]  # OpenAI's usage chunk: no choices, the usage of the whole request
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    plain = list(chat(client, host, stream=True))  # without include_usage: no usage chunk
    assert all(c.choices for c in plain) and "".join(c.choices[0].delta.content or "" for c in plain) == text


def test_stop_strings_cut_the_answer(client, host):
    whole = chat(client, host, max_tokens=30).choices[0].message.content
    word = whole.split()[4]
    (choice,) = chat(client, host, max_tokens=30, stop=[word, "zzz-never"]).choices
    assert choice.finish_reason == "stop" and choice.message.content == whole[: whole.index(word)]
    assert chat(client, host, max_tokens=30, stop=word).choices[0].message.content == choice.message.content


def test_roles_and_content_parts(client, host):
    msgs = [
        {"role": "system", "content": "You answer questions about Python."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "None?"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Explain the for statement."},
    ]  # fmt: skip
    r = client.chat.completions.create(model=host.model_id, messages=msgs, max_tokens=4, seed=3)
    assert 1 <= r.usage.completion_tokens <= 4


def test_seed_makes_sampling_repeatable(client, host):
    a = chat(client, host, temperature=1.0, seed=11, max_tokens=16).choices[0].message.content
    b = chat(client, host, temperature=1.0, seed=11, max_tokens=16).choices[0].message.content
    assert a == b


def test_max_completion_tokens_and_completions_route(client, host):
    r = client.chat.completions.create(model=host.model_id, messages=QUESTION, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    c = client.completions.create(model=host.model_id, prompt="The for statement", max_tokens=5, temperature=0)
    assert c.object == "text_completion" and c.usage.completion_tokens <= 5 and c.choices[0].text
    chunks = list(
        client.completions.create(
            model=host.model_id, prompt=["The for statement"], max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens


def test_models_and_health(client, live, host, session):
    (card,) = client.models.list().data
    assert card.id == host.model_id == "sharpi-demo-q8_0" and card.owned_by == "sharpi"
    assert card.meta["n_ctx"] == session.n_ctx and card.meta["n_vocab"] == session.args.n_vocab
    assert httpx.get(f"{root(live)}/health").json() == {"status": "ok"}


def test_health_and_generation_are_503_while_loading(session):
    release = threading.Event()

    def load(progress):
        progress(1, 4, "building model")
        release.wait(60)
        return session

    host = ModelHost.load_in_background("x/sharpi-demo-q8_0.gguf", load)
    try:
        with serving(host) as live, openai_client(live) as client:
            r = httpx.get(f"{root(live)}/health")
            assert r.status_code == 503 and r.json()["status"] == "loading" and "Retry-After" in r.headers
            with pytest.raises(openai.InternalServerError) as e:
                chat(client, host)
            assert e.value.status_code == 503 and e.value.code == "model_not_ready"
            release.set()
            wait_until(lambda: host.state == "ready", what="the load")
            assert httpx.get(f"{root(live)}/health").status_code == 200
            assert chat(client, host, max_tokens=2).usage.completion_tokens == 2
    finally:
        release.set()


# -- errors ----------------------------------------------------------------------------------------
def _openai_error(exc_info, status: int, type_: str = "invalid_request_error"):
    """The OpenAI error body the client parsed: every field there, no traceback."""
    e = exc_info.value
    assert e.status_code == status and set(e.body) == ERROR_FIELDS and e.body["message"], e.body
    assert e.type == type_ and "Traceback" not in e.response.text
    return e


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": 5}]}, None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"n": 2}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 1e308}, "top_p"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": [1]}, None),
        ({"seed": "x"}, "seed"),
        ({"stream_options": {"include_usage": "maybe"}}, "stream_options"),
        ({"extra_body": {"messages": "not a list"}}, "messages"),
    ],
)  # fmt: skip
def test_malformed_requests_are_bad_request_errors(client, host, kw, param):
    body = {"model": host.model_id, "messages": QUESTION, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**body)
    e = _openai_error(exc, 400)
    if param:
        assert (e.param or "").startswith(param), e.body
    assert host.runner.stats.admitted == 0  # refused before it reached the model


def test_a_request_without_messages_is_a_bad_request_error(client, host):
    from openai.types.chat import ChatCompletion

    with pytest.raises(openai.BadRequestError) as exc:  # the client's own post: what its types cannot build
        client.post("/chat/completions", body={"model": host.model_id}, cast_to=ChatCompletion)
    assert _openai_error(exc, 400).param == "messages"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=host.model_id, prompt="x", echo=True)
    assert _openai_error(exc, 400).param == "echo"


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe garbage", b"[]", b'{"model": 1e999999}'])
def test_bodies_that_are_not_a_json_object_are_400(live, body):
    # the official client only sends JSON it built itself: these go as plain HTTP
    r = httpx.post(f"{live.url}/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_FIELDS and err["type"] == "invalid_request_error" and "Traceback" not in r.text


def test_unknown_model_unknown_route_and_long_prompt(client, live, host, session):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    e = _openai_error(exc, 404)
    assert e.code == "model_not_found" and host.model_id in e.message
    with pytest.raises(openai.NotFoundError):
        client.get("/nothing", cast_to=object)
    with pytest.raises(openai.APIStatusError) as exc:
        client.get("/chat/completions", cast_to=object)
    assert exc.value.status_code == 405
    long = "word " * session.n_ctx
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=host.model_id, prompt=long)
    e = _openai_error(exc, 400)
    assert e.code == "context_length_exceeded" and str(session.n_ctx) in e.message
    assert httpx.get(f"{root(live)}/health").status_code == 200  # still serving
    assert chat(client, host, max_tokens=2).usage.completion_tokens == 2


def test_api_key_and_oversized_body(host):
    with serving(host, ServerOptions(api_key="k3y", max_body_bytes=1000)) as live:
        assert httpx.get(f"{root(live)}/health").status_code == 200  # health needs no key
        assert httpx.get(f"{live.url}/models").status_code == 401
        with openai_client(live, "nope") as wrong, pytest.raises(openai.AuthenticationError) as exc:
            wrong.models.list()
        assert _openai_error(exc, 401).code == "invalid_api_key"
        with openai_client(live, "k3y") as client:
            assert client.models.list().data[0].id == host.model_id
            assert chat(client, host, max_tokens=2).usage.completion_tokens == 2
            big = [{"role": "user", "content": "x" * 2000}]
            with pytest.raises(openai.APIStatusError) as exc:
                client.chat.completions.create(model=host.model_id, messages=big)
            assert _openai_error(exc, 413).code == "body_too_large"


# -- the queue, cancellation -----------------------------------------------------------------------
def test_full_queue_is_a_rate_limit_error_and_the_queued_ones_complete(session):
    host = ModelHost.from_session(session, max_queue=1)  # one generating, one waiting
    results: list = []
    with serving(host) as live, openai_client(live) as client:
        host.runner.lock.acquire()  # the model is busy (as with a chat in the app)
        try:
            workers = [
                threading.Thread(target=lambda: results.append(chat(client, host, max_tokens=3))) for _ in range(2)
            ]
            for w in workers:
                w.start()
            wait_until(lambda: host.runner.in_house == 2, what="two requests admitted")
            with pytest.raises(openai.RateLimitError) as exc:
                chat(client, host)
            e = _openai_error(exc, 429, "rate_limit_exceeded")
            assert e.code == "queue_full" and e.response.headers["Retry-After"] == "1"
            with pytest.raises(openai.RateLimitError):  # a stream is refused the same way, before it starts
                chat(client, host, stream=True)
        finally:
            host.runner.lock.release()
        for w in workers:
            w.join(120)
        assert [r.usage.completion_tokens for r in results] == [3, 3]
        assert host.runner.stats.rejected == 2 and host.runner.stats.completed == 2
        assert "sharpi_requests_rejected_total 2.0" in httpx.get(f"{root(live)}/metrics").text
        assert chat(client, host, max_tokens=2).usage.completion_tokens == 2  # room again


class GatedSession:
    """The demo session behind a gate: it generates a token only when the test has allowed one, and
    records how many it had made when the server cancelled (the server sees only the session's API)."""

    def __init__(self, session):
        self._s = session
        self._cv = threading.Condition()
        self._allowed = 0
        self.made = 0  # tokens generated
        self.made_at_cancel: int | None = None

    def __getattr__(self, name):
        return getattr(self._s, name)

    def allow(self, n: int) -> None:
        with self._cv:
            self._allowed += n
            self._cv.notify_all()

    def cancel(self) -> None:
        with self._cv:
            if self.made_at_cancel is None:
                self.made_at_cancel = self.made
        self._s.cancel()

    def generate(self, *args, **kw):
        events = self._s.generate(*args, **kw)
        while True:
            with self._cv:
                if not self._cv.wait_for(lambda: self.made < self._allowed, timeout=300):
                    raise AssertionError("the test never allowed the next token")
            ev = next(events, None)
            if ev is None:
                return
            with self._cv:
                self.made += ev.token_id is not None
            yield ev


@pytest.fixture
def gated(session):
    g = GatedSession(session)
    yield g
    g.allow(1 << 30)  # whatever happened, nothing stays blocked


def _raw_request(server: UvicornServer, body: dict) -> socket.socket:
    """A request sent over a plain socket (the test closes it to disconnect, at a moment it chooses)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.bind, server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_generation_within_one_token(gated, stream):
    host = ModelHost.from_session(gated)
    with serving(host) as live, openai_client(live) as client:
        gated.allow(6)
        body = {"model": host.model_id, "prompt": ENDLESS, "max_tokens": 3000, "temperature": 0}
        if stream:
            chunks = client.completions.create(**body, stream=True)
            assert any(c.choices and c.choices[0].text for c in chunks)  # the first text arrived
        else:
            sock = _raw_request(live, body)
        wait_until(lambda: gated.made == 6, what="the six allowed tokens")
        assert gated.made_at_cancel is None
        chunks.close() if stream else sock.close()  # the client goes away while the model waits at the gate
        # the server notices with no token made meanwhile (none is allowed), and cancels
        wait_until(lambda: gated.made_at_cancel is not None, what="the server to cancel the generation")
        assert gated.made_at_cancel == 6
        gated.allow(1 << 30)  # from here on the model may run freely: it stops within one token
        wait_until(lambda: host.runner.in_house == 0 and host.runner.stats.cancelled == 1, what="the cancel")
        assert gated.made - gated.made_at_cancel <= 1
        rec = host.records[-1]
        # (the log entry is written when the client goes: it counts the tokens made by then, or the last one too)
        assert rec.status == 499 and rec.finish_reason == "cancelled"
        assert gated.made_at_cancel <= rec.completion_tokens <= gated.made
        assert chat(client, host, max_tokens=2).usage.completion_tokens == 2  # the model is free again


def test_disconnect_while_queued_never_runs(live, host, client):
    host.runner.lock.acquire()
    try:
        sock = _raw_request(live, {"model": host.model_id, "prompt": ENDLESS, "max_tokens": 3000})
        wait_until(lambda: host.runner.in_house == 1, what="the request to queue")
        sock.close()
        wait_until(lambda: host.runner.stats.cancelled == 1, what="the queued job to be dropped")
    finally:
        host.runner.lock.release()
    assert host.runner.stats.running == 0 and host.runner.in_house == 0 and host.runner.stats.completed == 0
    assert chat(client, host, max_tokens=2).usage.completion_tokens == 2


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics_parse_as_prometheus_text(client, live, host):
    from prometheus_client.parser import text_string_to_metric_families

    r = chat(client, host)
    r = httpx.get(f"{root(live)}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "sharpi_requests", "sharpi_completion_tokens", "sharpi_time_to_first_token_seconds", "sharpi_model_ready",
        "sharpi_requests_waiting", "sharpi_expert_cache_hit_rate", "sharpi_expert_upload_gb_per_second",
        "sharpi_device_bytes", "sharpi_placement_info",
    ):  # fmt: skip
        assert name in fams, name
    ok = [s for s in fams["sharpi_requests"].samples if s.labels.get("route") == "/v1/chat/completions"]
    assert any(s.labels["status"] == "200" and s.value == 1 for s in ok)
    (tokens,) = [s for s in fams["sharpi_completion_tokens"].samples if s.name.endswith("_total")]
    assert tokens.value == 12
    (info,) = fams["sharpi_placement_info"].samples
    assert info.labels["moe_mode"] and info.value == 1


# -- the command -----------------------------------------------------------------------------------
def test_sharpi_serve_command(tmp_path):
    """``sharpi serve --port 0`` in a child process: it says where it listens, /health turns 200, the
    official client gets an answer."""
    import os
    import re
    import subprocess
    import sys

    root_dir = str(demo_model_path().parents[2])
    env = dict(os.environ, PYTHONPATH=root_dir)
    cmd = [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--model-id", "demo", "-c", "256"]
    p = subprocess.Popen(cmd, cwd=root_dir, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        m = re.search(r"serving demo at (http://127\.0\.0\.1:\d+/v1)", line)
        assert m, line
        url = m.group(1)
        wait_until(lambda: httpx.get(url.removesuffix("/v1") + "/health").status_code == 200, 120, "the load")
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as client:
            r = client.completions.create(model="demo", prompt="In Python", max_tokens=3)
        assert r.usage.completion_tokens <= 3
    finally:
        p.terminate()
        p.wait(30)
        p.stderr.close()
    bad = subprocess.run([*cmd[:3], "serve", "--port", "70000"], cwd=root_dir, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--port" in bad.stderr
