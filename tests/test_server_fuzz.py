"""Malformed and hostile request bodies against the server on the demo model: wrong types, huge numbers,
deep nesting, invalid UTF-8, truncated and oversized bodies, hostile schemas. Every one must get a 4xx
(or a 200 where the random body happens to be a valid request), never a 5xx, and the server keeps serving.
The bodies come from a seeded generator (the same ones every run) and go over loopback to the real server
(uvicorn on a thread), so its HTTP parsing is under test too."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from engine.api import LoadOptions, Session
from engine.demo import demo_model_path
from engine.server import ModelHost, ServerOptions, UvicornServer

MODEL = "sharpi-demo-q8_0"
ROUTES = ("/v1/chat/completions", "/v1/completions")
KEYS = (
    "model", "messages", "prompt", "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens",
    "stop", "seed", "stream", "stream_options", "n", "response_format", "tools", "tool_choice", "logprobs", "echo",
    "presence_penalty", "frequency_penalty",
)  # fmt: skip


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.45:
        return rng.choice(
            [
                None, True, False, 0, 1, 2, -1, 3, 2**31, 2**63, -(2**70), 10**30, 1.5, -0.0, 1e308, -1e308, 0.5,
                "", "x", "user", "system", "tool", "robot", MODEL, "json_object", "json_schema", "required", "auto",
                "\ud800", "\x00", "é" * 50, "<tool_call>", "a" * 5000,
            ]
        )  # fmt: skip
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice((*KEYS, "role", "content", "type", "schema", "json_schema", "function", "name")): _value(
            rng, depth + 1
        )
        for _ in range(rng.randrange(4))
    }


def _plausible(rng: random.Random) -> dict:
    """A request close to a valid one, with a few fields swapped for hostile values."""
    body = {"model": MODEL, "max_tokens": rng.choice([1, 2, 3]), "temperature": 0}
    if rng.random() < 0.5:
        body["messages"] = [{"role": rng.choice(["user", "system", "assistant", "tool", "bot"]), "content": "hi"}]
    else:
        body["prompt"] = "The for statement"
    for _ in range(rng.randrange(1, 4)):
        body[rng.choice(KEYS)] = _value(rng)
    if body.get("max_tokens") not in (1, 2, 3):  # keep generation short where the body is valid
        body["max_tokens"] = 2
    body.pop("max_completion_tokens", None)
    return body


def _schema_attack(rng: random.Random) -> dict:
    deep = {"type": "object"}
    for _ in range(rng.randrange(1, 400)):
        deep = {"type": "array", "items": deep}
    schema = rng.choice(
        [
            deep,
            {"$ref": "#/nowhere"},
            {"type": "string", "pattern": "(a|aa)*b{" + str(rng.randrange(10**6)) + "}"},
            {"type": "integer", "minimum": 10, "maximum": 1},
            {"anyOf": [{"type": "string"}] * rng.randrange(1, 300)},
            {"type": ["nonsense"]},
            {"enum": []},
        ]
    )
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def bodies(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.random()
        if kind < 0.35:
            raw = json.dumps(_plausible(rng)).encode()
        elif kind < 0.55:
            raw = json.dumps(_value(rng)).encode()
        elif kind < 0.62:
            raw = json.dumps(_schema_attack(rng)).encode()
        elif kind < 0.70:
            d = rng.randrange(100, 50_000)
            raw = (
                b"[" * d + b"]" * d
                if rng.random() < 0.5
                else b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * d
            )
        elif kind < 0.80:
            raw = json.dumps(_plausible(rng)).encode()
            i = rng.randrange(len(raw))
            raw = raw[:i] + bytes([rng.choice([0x80, 0xFF, 0xC0, 0xED, 0x00])]) + raw[i + 1 :]
        elif kind < 0.88:
            raw = json.dumps(_plausible(rng)).encode()
            raw = raw[: rng.randrange(len(raw))]
        elif kind < 0.94:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            raw = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * rng.randrange(70_000, 200_000) + b'"}'
        yield rng.choice(ROUTES), raw


@pytest.fixture(scope="module")
def client():
    with Session.load(str(demo_model_path()), LoadOptions(n_ctx=64)) as s:
        host = ModelHost.from_session(s)
        server = UvicornServer(host, port=0, options=ServerOptions(max_body_bytes=64 << 10))
        server.start()
        try:
            with httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=300) as c:
                yield c
        finally:
            server.stop()
            host.runner.close()


def _fuzz(client, n: int) -> None:
    statuses: dict[int, int] = {}
    for i, (route, raw) in enumerate(bodies(n)):
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (i, r.status_code, raw[:300], r.text[:300])
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in r.text
    assert statuses.get(200, 0) < n // 2 and sum(v for k, v in statuses.items() if k >= 400) > n // 2  # mostly refused
    assert client.get("/health").status_code == 200
    ok = client.post(ROUTES[0], json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200  # still serving


def test_hostile_bodies_get_4xx(client):
    _fuzz(client, 300)


@pytest.mark.slow
def test_two_thousand_hostile_bodies_get_4xx(client):
    _fuzz(client, 2000)
