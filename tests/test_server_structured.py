"""Structured output and tool calls: llguidance's mask against its token-by-token reference, response_format
json_object / json_schema through the real server driven by the official ``openai`` client (its
``parse`` helper over a pydantic model; a property test over generated schemas: every answer that ends
parses and validates), Qwen3's ``<tool_call>`` blocks parsed back into ``tool_calls`` (streamed too), a
forced tool call round trip, on the demo model."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import Session
from engine.demo import demo_model_path
from engine.generate import SamplingParams
from engine.generate.grammar import GrammarConstraint, json_schema_grammar, tool_call_grammar
from engine.server import ModelHost, UvicornServer
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
    server = UvicornServer(host, port=0)
    server.start()
    try:
        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=900) as c:
            yield c
    finally:
        server.stop()
        host.runner.close()


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
    return client.chat.completions.create(**body).choices[0]


def test_json_object(client, host):
    choice = _chat(client, host, response_format={"type": "json_object"})
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    unit: str = pydantic.Field(pattern="^(C|F)$")
    days: list[int] = pydantic.Field(max_length=3)


def test_json_schema_through_the_clients_parse_helper(client, host):
    # the official client turns the pydantic model into a strict json_schema response_format and parses the
    # answer back into the model (it raises if the answer does not validate)
    r = client.chat.completions.parse(
        model=host.model_id, messages=ASK, response_format=Weather, temperature=0.7, seed=3, max_tokens=300
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


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
    if choice.finish_reason == "length":  # cut by max_tokens: a prefix of a valid document, nothing to check
        return
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
)  # fmt: skip
def test_bad_schemas_and_conflicts_are_bad_request_errors(client, host, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=host.model_id, messages=ASK, **kw)
    e = exc.value
    assert e.status_code == 400 and e.type == "invalid_request_error" and e.message
    if param:
        assert (e.param or "").startswith(param), e.body


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
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the answer goes back as the client hands it over, with the tool's result; the template renders the whole
    # exchange and the model answers it
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'}
    msgs = [*ASK, choice.message.model_dump(exclude_none=True), result]
    r = client.chat.completions.create(model=host.model_id, messages=msgs, tools=[WEATHER], max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > len(session.prompt_ids(messages=ASK))  # the call and its result are in
    named = _chat(client, host, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.message.tool_calls[0].function.name == "get_weather"


def test_tool_calls_stream_as_deltas(client, host):
    chunks = list(
        client.chat.completions.create(
            model=host.model_id, messages=ASK, tools=[WEATHER], tool_choice="required", stream=True, temperature=0
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].function.name == "get_weather"
    whole = _chat(client, host, tools=[WEATHER], tool_choice="required").message.tool_calls[0]
    assert calls[0][0].function.arguments == whole.function.arguments  # the same call as the non-streamed one
    assert "<tool_call>" not in "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


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
