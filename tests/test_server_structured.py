"""Structured output and tool calls: llguidance's mask against its token-by-token reference, response_format
json_object / json_schema through the server (a property test over generated schemas: every answer
that ends parses and validates), Qwen3's ``<tool_call>`` blocks parsed back into ``tool_calls``
(streamed too), a forced tool call round trip, on the demo model."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import Session
from engine.demo import demo_model_path
from engine.generate import SamplingParams
from engine.generate.grammar import GrammarConstraint, json_schema_grammar, tool_call_grammar
from engine.server import ModelHost, asgi_app
from engine.server.tools import ParsedCall, ToolCallParser, split_content

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def session():
    with Session.load(str(demo_model_path())) as s:
        yield s


@pytest.fixture(scope="module")
def host(session):
    return ModelHost.from_session(session)


@pytest.fixture(scope="module")
def client(host):
    with TestClient(asgi_app(host)) as c:
        yield c


# -- the mask --------------------------------------------------------------------------------------
def test_bitmask_equals_the_token_by_token_reference(session):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"enum": ["ab", "cd"]}},
        "required": ["n", "s"],
    }
    g = GrammarConstraint(session.tokenizer, json_schema_grammar(schema))
    doc = session.tokenizer.encode('{"n": 12, "s": "cd"}', add_bos=False, parse_special=False)
    for tok in doc:
        allowed = g.allowed()
        assert allowed.shape == (session.tokenizer.n_vocab,)
        ref = g.reference_mask()
        # every token the mask allows the grammar accepts; the mask may leave out a token that only splits
        # what the grammar forces (a lone '"' where '":' is the tokenizer's token): never all of them
        assert not (allowed & ~ref).any() and allowed.any()
        assert allowed[tok] and allowed.sum() < len(allowed)
        logits = np.random.default_rng(tok).standard_normal(len(allowed)).astype(np.float32)
        masked = g.mask(logits)
        assert np.array_equal(np.isfinite(masked), allowed) and np.array_equal(masked[allowed], logits[allowed])
        g.accept(tok)
    assert g.complete
    end = g.allowed()
    assert set(np.flatnonzero(end)) <= set(session.tokenizer.eog_ids) and end.any()  # only EOS once complete


# -- response_format -------------------------------------------------------------------------------
def _chat(client, host, **kw):
    body = {"model": host.model_id, "messages": ASK, "temperature": 0, "max_tokens": 300, **kw}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_json_object(client, host):
    choice = _chat(client, host, response_format={"type": "json_object"})
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)}, st.integers(-999, 999), st.integers(-999, 999)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True)),
)  # fmt: skip
_names = st.text("abcdefgh_", min_size=1, max_size=6)


def _obj(children):
    return st.builds(
        lambda props, req: {
            "type": "object",
            "properties": props,
            "required": sorted(k for k in props if req(k)),
            "additionalProperties": False,
        },
        st.dictionaries(_names, children, min_size=1, max_size=4),
        st.sampled_from([lambda k: True, lambda k: False, lambda k: len(k) % 2 == 0]),
    )


_schema = st.recursive(
    _leaf,
    lambda inner: st.one_of(_obj(inner), st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, inner, st.integers(0, 3))),
    max_leaves=8,
)  # fmt: skip


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_obj(_schema), seed=st.integers(0, 2**31))
def test_json_schema_answers_validate(client, host, schema, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    choice = _chat(client, host, response_format=fmt, temperature=0.8, seed=seed, max_tokens=400)
    if choice["finish_reason"] == "length":  # cut by max_tokens: a prefix of a valid document, nothing to check
        return
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_bad_schema_and_conflicts_are_400(client, host):
    body = {"model": host.model_id, "messages": ASK}
    bad = {
        **body,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    }
    r = client.post("/v1/chat/completions", json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = client.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_schema"}})
    assert r.status_code == 400
    both = {**body, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert client.post("/v1/chat/completions", json=both).status_code == 400
    r = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    named = {**body, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert client.post("/v1/chat/completions", json=named).status_code == 400


# -- tool calls ------------------------------------------------------------------------------------
def test_parser_splits_content_and_calls_across_chunks():
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    for cut in range(1, len(text)):
        p = ToolCallParser()
        pieces = p.feed(text[:cut]) + p.feed(text[cut:]) + p.flush()
        content = "".join(x for x in pieces if isinstance(x, str))
        calls = [x for x in pieces if isinstance(x, ParsedCall)]
        assert content == "Let me look." and len(calls) == 1, cut
        assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris", "unit": "C"}
    assert split_content("a <tool_call>not json</tool_call> b") == ("a <tool_call>not json</tool_call> b", [])
    assert split_content("x < y and <tool_ca") == ("x < y and <tool_ca", [])
    content, calls = split_content('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')  # unclosed at the end
    assert content == "" and calls[0].arguments == '{"a": 1}'


def test_forced_tool_call_round_trip(client, host, session):
    choice = _chat(client, host, tools=[WEATHER], tool_choice="required")
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the answer goes back with the tool's result; the template renders the whole exchange
    msgs = [*ASK, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 18}'}]
    r = client.post(
        "/v1/chat/completions", json={"model": host.model_id, "messages": msgs, "tools": [WEATHER], "max_tokens": 5}
    )
    assert r.status_code == 200
    named = _chat(client, host, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_tool_calls_stream_as_deltas(client, host):
    body = {
        "model": host.model_id,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "stream": True,
        "temperature": 0,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        data = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in data if c["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "get_weather"
    assert "<tool_call>" not in "".join(d.get("content") or "" for d in deltas)
    assert data[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_reach_the_template(session):
    # the demo's ChatML template ignores tools; a Qwen3-style template writes them into the prompt
    from engine.tokenizer.chat import ChatTemplate

    t = ChatTemplate(
        "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert t.render(ASK, tools=[WEATHER]) == "get_weather;" + ASK[0]["content"]
    assert session.prompt_ids(messages=ASK, tools=[WEATHER]) == session.prompt_ids(messages=ASK)


def test_grammar_constrained_generation_in_the_engine(session):
    g = GrammarConstraint(session.tokenizer, tool_call_grammar([WEATHER]))
    out = "".join(
        e.text for e in session.generate(messages=ASK, params=SamplingParams(seed=5, max_tokens=200), constraint=g)
    )
    content, calls = split_content(out)
    assert content == "" and calls[0].name == "get_weather"
