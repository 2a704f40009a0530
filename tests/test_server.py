"""engine.server against the bundled demo model: the OpenAI routes (FastAPI's TestClient), streaming,
stop strings, usage and timings, errors, the bounded queue (429), disconnect-cancels, /health while
loading, /metrics in Prometheus text, and one round with the official ``openai`` client against a
live uvicorn on loopback."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from engine.api import Session
from engine.demo import demo_model_path
from engine.server import ModelHost, ServerOptions, UvicornServer, asgi_app

QUESTION = [{"role": "user", "content": "What is a decorator?"}]
ENDLESS = "def f(x):\n"  # the demo model continues this greedily past 1,500 tokens (no EOS)


def wait_until(cond, timeout=30.0, what="condition"):
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


@pytest.fixture
def client(host):
    with TestClient(asgi_app(host)) as c:
        yield c


def chat(client, host, **kw):
    body = {"model": host.model_id, "messages": QUESTION, "temperature": 0, "max_tokens": 12, **kw}
    return client.post("/v1/chat/completions", json=body)


def sse(lines) -> list[dict]:
    """The JSON objects of an SSE stream, checking it ends with [DONE]."""
    data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# -- the routes ------------------------------------------------------------------------------------
def test_chat_non_streaming_uses_the_models_template(client, host, session):
    r = chat(client, host)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == host.model_id
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    # the same prompt ids and greedy tokens as the engine's own chat path (Session.generate(messages=...))
    from engine.generate import SamplingParams

    session.reset()
    direct = "".join(e.text for e in session.generate(messages=QUESTION, params=SamplingParams.greedy(max_tokens=12)))
    assert choice["message"]["content"] == direct
    u = body["usage"]
    assert u["prompt_tokens"] == len(session.prompt_ids(messages=QUESTION)) and u["completion_tokens"] == 12
    assert u["total_tokens"] == u["prompt_tokens"] + 12
    t = body["timings"]
    assert t["predicted_n"] == 12 and t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
    assert t["predicted_per_second"] > 0 and t["ttft_ms"] > 0


def test_chat_streaming_matches_non_streaming(client, host):
    whole = chat(client, host).json()["choices"][0]["message"]["content"]
    body = {"model": host.model_id, "messages": QUESTION, "temperature": 0, "max_tokens": 12, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse(r.iter_lines())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    assert "timings" in final[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_stop_strings_cut_the_answer(client, host):
    whole = chat(client, host, max_tokens=30).json()["choices"][0]["message"]["content"]
    word = whole.split()[4]
    r = chat(client, host, max_tokens=30, stop=[word, "zzz-never"])
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == whole[: whole.index(word)]
    assert (
        chat(client, host, max_tokens=30, stop=word).json()["choices"][0]["message"]["content"]
        == choice["message"]["content"]
    )


def test_roles_and_content_parts(client, host):
    msgs = [
        {"role": "system", "content": "You answer questions about Python."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "None?"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Explain the for statement."},
    ]  # fmt: skip
    r = client.post("/v1/chat/completions", json={"model": host.model_id, "messages": msgs, "max_tokens": 4, "seed": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_seed_makes_sampling_repeatable(client, host):
    a = chat(client, host, temperature=1.0, seed=11, max_tokens=16).json()["choices"][0]["message"]["content"]
    b = chat(client, host, temperature=1.0, seed=11, max_tokens=16).json()["choices"][0]["message"]["content"]
    assert a == b


def test_max_completion_tokens_and_completions_route(client, host):
    r = chat(client, host, max_tokens=None, max_completion_tokens=3)
    assert r.json()["usage"]["completion_tokens"] == 3
    r = client.post("/v1/completions", json={"model": host.model_id, "prompt": "The for statement", "max_tokens": 5})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] <= 5 and isinstance(body["choices"][0]["text"], str)
    body = {"model": host.model_id, "prompt": ["In Python"], "max_tokens": 5, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = sse(r.iter_lines())
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" in chunks[-1]


def test_models_and_health(client, host, session):
    assert client.get("/health").json() == {"status": "ok"}
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == host.model_id == "sharpi-demo-q8_0" and card["meta"]["n_ctx"] == session.n_ctx


def test_health_is_503_while_loading(session):
    release = threading.Event()

    def load(progress):
        progress(1, 4, "building model")
        release.wait(30)
        return session

    host = ModelHost.load_in_background("x/sharpi-demo-q8_0.gguf", load)
    with TestClient(asgi_app(host)) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and "Retry-After" in r.headers
        assert chat(c, host).status_code == 503
        release.set()
        wait_until(lambda: host.state == "ready", what="the load")
        assert c.get("/health").status_code == 200 and chat(c, host).status_code == 200


# -- errors ----------------------------------------------------------------------------------------
def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"\xff\xfe garbage", None),
        (b"[]", None),
        (b'{"model": "sharpi-demo-q8_0"}', "messages"),
        (b'{"model": "sharpi-demo-q8_0", "messages": []}', "messages"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user"}]}', "messages.0"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user", "content": 5}]}', None),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user", "content": "x"}], "top_p": 1e308}', "top_p"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user", "content": "x"}], "logprobs": true}', "logprobs"),
        (b'{"model": "sharpi-demo-q8_0", "messages": [{"role": "user", "content": "x"}], "stop": [1]}', None),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(client, body, param):
    err = _error(client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error"
    if param:
        assert (err["param"] or "").startswith(param)


def test_unknown_model_unknown_route_and_long_prompt(client, host, session):
    err = _error(client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": QUESTION}), 404)
    assert err["code"] == "model_not_found" and host.model_id in err["message"]
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/chat/completions"), 405)
    long = "word " * session.n_ctx
    err = _error(client.post("/v1/completions", json={"model": host.model_id, "prompt": long}), 400)
    assert err["code"] == "context_length_exceeded" and str(session.n_ctx) in err["message"]
    assert client.get("/health").status_code == 200  # still serving


def test_oversized_body_and_api_key(host):
    with TestClient(asgi_app(host, ServerOptions(api_key="k3y", max_body_bytes=1000))) as c:
        assert c.get("/health").status_code == 200  # health needs no key
        _error(c.get("/v1/models"), 401)
        _error(c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        auth = {"Authorization": "Bearer k3y"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        big = {"model": host.model_id, "messages": [{"role": "user", "content": "x" * 2000}]}
        _error(c.post("/v1/chat/completions", json=big, headers=auth), 413)


# -- the queue, cancellation -----------------------------------------------------------------------
def test_full_queue_answers_429_and_the_queued_ones_complete(session):
    host = ModelHost.from_session(session, max_queue=1)
    results: list = []
    with TestClient(asgi_app(host)) as c:
        host.runner.lock.acquire()  # the model is busy (as with a chat in the app)
        try:
            workers = [threading.Thread(target=lambda: results.append(chat(c, host, max_tokens=3))) for _ in range(2)]
            for w in workers:
                w.start()
            wait_until(lambda: host.runner.in_house == 2, what="two requests admitted")
            r = chat(c, host)
            err = _error(r, 429)
            assert err["code"] == "queue_full" and r.headers["Retry-After"] == "1"
        finally:
            host.runner.lock.release()
        for w in workers:
            w.join(60)
        assert [r.status_code for r in results] == [200, 200]
        assert host.runner.stats.rejected == 1 and host.runner.stats.completed == 2
        assert "sharpi_requests_rejected_total 1.0" in c.get("/metrics").text


@pytest.fixture
def live(host):
    server = UvicornServer(host, port=0)
    server.start()
    yield server
    server.stop()
    host.runner.close()
    wait_until(lambda: host.runner._worker is None, what="the runner's thread to end")


def test_disconnect_cancels_the_generation(live, host):
    import httpx

    body = {"model": host.model_id, "prompt": ENDLESS, "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=live.url, timeout=60) as c, c.stream("POST", "/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [ln for ln in (next(lines) for _ in range(8)) if ln.startswith("data: ")]
        assert got  # it is generating
    wait_until(lambda: host.runner.stats.cancelled == 1 and host.runner.in_house == 0, what="the cancel")
    rec = host.records[-1]
    assert rec.finish_reason == "cancelled" and rec.completion_tokens < 3000
    # the model is free again
    assert (
        httpx.post(
            f"{live.url}/chat/completions", json={"model": host.model_id, "messages": QUESTION, "max_tokens": 2}
        ).status_code
        == 200
    )


def test_disconnect_while_queued_never_runs(live, host):
    import httpx

    host.runner.lock.acquire()
    try:
        body = {"model": host.model_id, "prompt": ENDLESS, "max_tokens": 3000, "stream": False}
        t = threading.Thread(
            target=lambda: _swallow(lambda: httpx.post(f"{live.url}/completions", json=body, timeout=0.5))
        )
        t.start()
        t.join(30)
        wait_until(lambda: host.runner.stats.cancelled == 1, what="the queued job to be dropped")
    finally:
        host.runner.lock.release()
    assert host.runner.stats.running == 0 and host.runner.in_house == 0


def _swallow(fn):
    try:
        fn()
    except Exception:
        pass


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics_parse_as_prometheus_text(client, host):
    from prometheus_client.parser import text_string_to_metric_families

    chat(client, host)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "sharpi_requests", "sharpi_completion_tokens", "sharpi_time_to_first_token_seconds", "sharpi_model_ready",
        "sharpi_requests_waiting", "sharpi_expert_cache_hit_rate", "sharpi_expert_upload_gb_per_second",
        "sharpi_device_bytes", "sharpi_placement_info",
    ):  # fmt: skip
        assert name in fams, name
    ok = [s for s in fams["sharpi_requests"].samples if s.labels.get("route") == "/v1/chat/completions"]
    assert any(s.labels["status"] == "200" and s.value >= 1 for s in ok)
    (info,) = fams["sharpi_placement_info"].samples
    assert info.labels["moe_mode"] and info.value == 1


# -- the official client ---------------------------------------------------------------------------
def test_the_openai_client_against_a_live_server(live, host):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url, api_key="unused", max_retries=0)
    (m,) = client.models.list().data
    assert m.id == host.model_id
    r = client.chat.completions.create(model=host.model_id, messages=QUESTION, max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=host.model_id, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=host.model_id, prompt="In Python", max_tokens=4)
    assert c.usage.completion_tokens <= 4
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=host.model_id, messages=QUESTION, n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=QUESTION)


def test_sharpi_serve_command(tmp_path):
    """``sharpi serve --port 0`` in a child process: it says where it listens, /health turns 200, it answers."""
    import os
    import re
    import subprocess
    import sys

    import httpx

    root = str(demo_model_path().parents[2])
    env = dict(os.environ, PYTHONPATH=root)
    cmd = [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--model-id", "demo", "-c", "256"]
    p = subprocess.Popen(cmd, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        m = re.search(r"serving demo at (http://127\.0\.0\.1:\d+/v1)", line)
        assert m, line
        url = m.group(1)
        wait_until(lambda: httpx.get(url.removesuffix("/v1") + "/health").status_code == 200, 120, "the load")
        r = httpx.post(f"{url}/completions", json={"model": "demo", "prompt": "In Python", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        p.terminate()
        p.wait(30)
        p.stderr.close()
    bad = subprocess.run([*cmd[:3], "serve", "--port", "70000"], cwd=root, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--port" in bad.stderr
