"""The server's reasoning: ``reasoning_content`` beside ``content`` in chat completion messages and stream deltas
(llama.cpp's server and DeepSeek's convention), a raw completion left whole, and an earlier reply's
reasoning handed to the chat template, which keeps or drops it — on the synthetic gpt-oss (harmony) file with
a scripted reply, through the official ``openai`` client."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from engine.api import LoadOptions, Session
from engine.config import EngineOptions
from engine.generate.reasoning import HARMONY, THINK
from engine.server import ModelHost
from engine.server.protocol import plan_chat
from engine.server.schemas import ChatCompletionRequest
from engine.synth.writer import write_model
from tests.scripted import ScriptedModel
from tests.test_server import openai_client, serving

REPLY = "<|channel|>analysis<|message|>The user wants a sum.<|end|><|start|>assistant<|channel|>final<|message|>2+2=4"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def harmony_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony") / "gpt-oss.gguf"
    write_model(path, "gpt-oss")
    return path


def _script(tok, text: str, end: str) -> list[int]:
    """The token ids of a scripted reply: ``text``, then the special token ``end``."""
    return [*tok.encode(text, add_bos=False), tok.token_id(end)]


@contextlib.contextmanager
def _scripted_session(path, text: str, end: str, engine: EngineOptions | None = None):
    """The file loaded, its model replaced by a scripted one writing ``text`` then ``end``."""
    opts = LoadOptions(n_ctx=512) if engine is None else LoadOptions(n_ctx=512, engine=engine)
    with Session.load(str(path), opts) as s:
        real, s.model = s.model, ScriptedModel(_script(s.tokenizer, text, end), s.tokenizer.n_vocab)
        try:
            yield s
        finally:
            s.model = real


@pytest.fixture(scope="module")
def session(harmony_path):
    with _scripted_session(harmony_path, REPLY, "<|return|>") as s:
        yield s


@pytest.fixture
def client(session):
    session.model.restart()
    host = ModelHost.from_session(session)
    with serving(host) as server, openai_client(server) as c:
        c.model_id = host.model_id
        yield c


def test_the_format_comes_from_the_model(session, harmony_path):
    assert session.reasoning == session.chat_format == HARMONY
    off = LoadOptions(n_ctx=64, engine=EngineOptions(reasoning="off"))
    with Session.load(str(harmony_path), off) as s:
        assert s.reasoning is None and s.chat_format == HARMONY  # the model still writes harmony
    forced = LoadOptions(n_ctx=64, engine=EngineOptions(reasoning="think"))
    with Session.load(str(harmony_path), forced) as s:
        assert s.reasoning == THINK and s.chat_format == HARMONY


def test_chat_message_has_reasoning_content(client):
    r = client.chat.completions.create(model=client.model_id, messages=QUESTION, temperature=0, max_tokens=64)
    msg = r.choices[0].message
    assert msg.content == "2+2=4"
    assert msg.model_extra["reasoning_content"] == "The user wants a sum."
    assert r.choices[0].finish_reason == "stop"


def test_streamed_deltas_carry_reasoning_then_content(client):
    parts = []
    for chunk in client.chat.completions.create(
        model=client.model_id, messages=QUESTION, temperature=0, max_tokens=64, stream=True
    ):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            if extra.get("reasoning_content"):
                parts.append(("reasoning", extra["reasoning_content"]))
            if ch.delta.content:
                parts.append(("content", ch.delta.content))
    kinds = [k for k, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # every reasoning delta before the answer
    assert len(parts) > 2  # streamed, not sent whole at the end
    assert "".join(t for k, t in parts if k == "reasoning") == "The user wants a sum."
    assert "".join(t for k, t in parts if k == "content") == "2+2=4"


def test_a_raw_completion_is_left_whole(client, session):
    r = client.completions.create(model=client.model_id, prompt="<|start|>assistant", max_tokens=64, temperature=0)
    assert r.choices[0].text == REPLY


def test_unterminated_reasoning_at_max_tokens(client, session):
    n = len(session.tokenizer.encode("<|channel|>analysis<|message|>The user", add_bos=False))
    r = client.chat.completions.create(model=client.model_id, messages=QUESTION, temperature=0, max_tokens=n)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert msg.content == "" and msg.model_extra["reasoning_content"]
    assert msg.model_extra["reasoning_content"] == "The user"


def test_an_earlier_replys_reasoning_reaches_the_template_which_drops_it(session):
    """gpt-oss's template renders an earlier turn's analysis only for a closing assistant message (a training
    render): a new prompt never carries it, though the client sent it back as reasoning_content."""
    history = [
        *QUESTION,
        {"role": "assistant", "content": "2+2=4", "reasoning_content": "SECRET-REASONING"},
        {"role": "user", "content": "And 3+3?"},
    ]
    req = ChatCompletionRequest(model="m", messages=history)
    prompt = session.detokenize(plan_chat(session, req).ids)
    assert "SECRET-REASONING" not in prompt and "<|channel|>final<|message|>2+2=4<|end|>" in prompt
    closing = session.render_chat(history[:2], add_generation_prompt=False)
    assert closing.endswith(
        "<|channel|>analysis<|message|>SECRET-REASONING<|end|><|start|>assistant<|channel|>final<|message|>2+2=4<|return|>"
    )


def test_reasoning_content_on_a_user_message_is_ignored(session):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi", "reasoning_content": "x"}])
    assert "reasoning_content" not in req.messages[0].for_template()


def test_http_body_without_the_client(client, session):
    """The wire format as llama.cpp's server writes it: message.reasoning_content is a string, absent when the
    reply had none."""
    base = client.base_url
    body = {"model": client.model_id, "messages": QUESTION, "max_tokens": 64, "temperature": 0}
    r = httpx.post(f"{base}chat/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["message"]["reasoning_content"] == "The user wants a sum."
    session.model.restart(
        session.tokenizer.encode("<|channel|>final<|message|>hi", add_bos=False)
        + [session.tokenizer.token_id("<|return|>")]
    )
    try:
        r = httpx.post(f"{base}chat/completions", json=body, timeout=60)
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == "hi" and "reasoning_content" not in msg
    finally:
        session.model.restart(
            [*session.tokenizer.encode(REPLY, add_bos=False), session.tokenizer.token_id("<|return|>")]
        )


def test_the_remote_client_reads_reasoning_deltas(session):
    """The app's remote chat (engine.remote) against this server: the reasoning arrives as the events'
    reasoning, and an earlier reply's reasoning_content is not sent on (DeepSeek's API refuses it)."""
    from engine.generate import SamplingParams
    from engine.remote import RemoteSession

    session.model.restart()
    host = ModelHost.from_session(session)
    with serving(host) as server, RemoteSession(server.url, timeout=60) as r:
        evs = list(r.generate(messages=QUESTION, params=SamplingParams(temperature=0, max_tokens=64)))
        assert "".join(e.reasoning for e in evs) == "The user wants a sum."
        assert "".join(e.text for e in evs) == "2+2=4"
        sent = []
        real = r._client.stream

        def spy(method, route, json=None, **kw):
            sent.append(json)
            return real(method, route, json=json, **kw)

        r._client.stream = spy
        session.model.restart()
        history = [*QUESTION, {"role": "assistant", "content": "2+2=4", "reasoning_content": "r"}, *QUESTION]
        list(r.generate(messages=history, params=SamplingParams(temperature=0, max_tokens=8)))
        assert sent and all("reasoning_content" not in m for m in sent[0]["messages"])


CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def calling(client, session):
    """The scripted model answering with a harmony tool call ended by the <|call|> token."""
    tok = session.tokenizer
    session.model.restart(_script(tok, CALL, "<|call|>"))
    try:
        yield client
    finally:
        session.model.restart(_script(tok, REPLY, "<|return|>"))


def test_a_harmony_tool_call_comes_back_as_tool_calls(calling, session):
    """gpt-oss writes a call as a message to ``functions.NAME``: the client gets OpenAI ``tool_calls`` (the
    arguments as written, the reasoning apart, no content), finish_reason "tool_calls"; the tools reach the
    template, and the call and its result render back into the next prompt in harmony's form."""
    r = calling.chat.completions.create(
        model=calling.model_id, messages=WEATHER, tools=TOOLS, temperature=0, max_tokens=64
    )
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and not msg.content
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert msg.tool_calls[0].id.startswith("call_") and msg.model_extra["reasoning_content"] == "Need the weather."
    req = ChatCompletionRequest(model="m", messages=WEATHER, tools=TOOLS)
    assert "type get_weather = (_: " in session.detokenize(plan_chat(session, req).ids)
    follow = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "18 C, sunny"},
    ]
    prompt = session.detokenize(plan_chat(session, ChatCompletionRequest(model="m", messages=follow, tools=TOOLS)).ids)
    assert prompt.endswith(
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C, sunny<|end|>"
        "<|start|>assistant"
    )


def test_a_streamed_harmony_tool_call(calling):
    calls, content, reasons = [], [], []
    for chunk in calling.chat.completions.create(
        model=calling.model_id, messages=WEATHER, tools=TOOLS, temperature=0, max_tokens=64, stream=True
    ):
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            content += [ch.delta.content] if ch.delta.content else []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    assert content == [] and reasons == ["tool_calls"]


def test_a_harmony_call_without_tools_offered_stays_visible(calling):
    """No tools in the request: a call the model writes anyway is shown as content, not dropped."""
    r = calling.chat.completions.create(model=calling.model_id, messages=WEATHER, temperature=0, max_tokens=64)
    assert r.choices[0].message.content == '{"city": "Paris"}' and not r.choices[0].message.tool_calls


# -- a forced tool call on a harmony model ------------------------------------------------------------
FORCED = 'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _walk(session, grammar_text: str, text: str) -> bool:
    """Whether the grammar takes ``text`` (its special tokens as tokens) whole, to a complete sentence."""
    from engine.errors import UsageError
    from engine.generate.grammar import GrammarConstraint

    g = GrammarConstraint(session.tokenizer, grammar_text)
    try:
        for t in session.tokenizer.encode(text, add_bos=False):
            g.accept(t)
    except UsageError:
        return False
    return g.complete


def test_the_harmony_call_grammar_takes_a_call_and_refuses_a_tool_call_block(session):
    from engine.generate.grammar import harmony_call_grammar

    g = harmony_call_grammar([*TOOLS, CLOCK])
    assert _walk(session, g, "<|channel|>" + FORCED + "<|call|>")
    assert _walk(session, g, "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>")
    assert not _walk(session, g, "<|channel|>" + FORCED.replace("city", "town") + "<|call|>")  # off the schema
    assert not _walk(session, g, "<|channel|>" + FORCED + "<|return|>")  # a call ends with <|call|>
    assert not _walk(session, g, "<|channel|>final<|message|>It is sunny.<|return|>")
    assert not _walk(session, g, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    opened = harmony_call_grammar(TOOLS, open_message=True)  # a prompt whose generation prompt did not open one
    assert _walk(session, opened, "<|start|>assistant<|channel|>" + FORCED + "<|call|>")
    assert not _walk(session, opened, "<|channel|>" + FORCED + "<|call|>")
    assert _walk(session, opened, "<|start|>assistant" + CALL + "<|call|>")


def test_the_harmony_call_grammar_lets_an_analysis_come_first(session):
    """gpt-oss reasons before it calls: an analysis message may come before the call, its free text ended by the
    <|end|> token (the mask allows each token of it, one by one) and holding no marker the splitter would read,
    spelled out as text; after the analysis only the call."""
    from engine.errors import UsageError
    from engine.generate.grammar import GrammarConstraint, harmony_call_grammar

    tok = session.tokenizer
    g = harmony_call_grammar([*TOOLS, CLOCK])

    def masked_walk(*parts) -> bool:  # (text, special): special tokens parsed, or the text spelled out
        c = GrammarConstraint(tok, g, split=True)
        try:
            for text, special in parts:
                for t in tok.encode(text, add_bos=False, parse_special=special):
                    if not c.allowed()[t]:
                        return False
                    c.accept(t)
        except UsageError:
            return False
        return c.complete

    after = ("<|end|><|start|>assistant<|channel|>" + FORCED + "<|call|>", True)
    assert masked_walk(
        ("<|channel|>analysis<|message|>", True), ("Need the weather.\nIn Paris, 2<3 > 1.", False), after
    )
    assert masked_walk(("<|channel|>analysis<|message|>", True), after)  # an empty analysis
    assert masked_walk((CALL + "<|call|>", True))
    assert not masked_walk(("<|channel|>analysis<|message|>", True), ("a<|end|>b", False), after)  # a spelled marker
    assert not masked_walk(("<|channel|>analysis<|message|>a<|end|>", True), ("x", False), after)  # text outside
    assert not masked_walk(
        ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>", True)
    )
    assert not masked_walk(("<|channel|>analysis<|message|>a<|return|>", True))


@pytest.fixture
def forced(client, session):
    """The scripted model writing the harmony call a forced tool_choice asks of it, after the generation prompt."""
    tok = session.tokenizer
    session.model.restart(_script(tok, "<|channel|>" + FORCED, "<|call|>"))
    try:
        yield client
    finally:
        session.model.restart(_script(tok, REPLY, "<|return|>"))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_on_a_harmony_model_is_a_harmony_call(forced, session, choice):
    """tool_choice "required" or a named function constrains a harmony model to a call message to
    ``functions.NAME`` (not Qwen's ``<tool_call>`` block, which its parser would not read): the client gets it
    as ``tool_calls``, finish_reason "tool_calls", no content."""
    r = forced.chat.completions.create(
        model=forced.model_id, messages=WEATHER, tools=[*TOOLS, CLOCK], tool_choice=choice, temperature=0, max_tokens=64
    )
    msg, choice_ = r.choices[0].message, r.choices[0]
    assert choice_.finish_reason == "tool_calls" and not msg.content
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    session.model.restart()  # the same reply, streamed
    calls, content, reasons = [], [], []
    for chunk in forced.chat.completions.create(
        model=forced.model_id,
        messages=WEATHER,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=64,
        stream=True,
    ):
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            content += [ch.delta.content] if ch.delta.content else []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert content == [] and reasons == ["tool_calls"]
    req = ChatCompletionRequest(model="m", messages=WEATHER, tools=[*TOOLS, CLOCK], tool_choice=choice)
    plan = plan_chat(session, req)  # the decode loop splits the forced call's text (GrammarConstraint.split)
    assert plan.parse_tools and plan.constraint.split


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_harmony_call_may_follow_an_analysis(calling, choice):
    """The model's analysis before a forced call passes the grammar; the splitter gives it as reasoning_content
    and the call as tool_calls."""
    r = calling.chat.completions.create(
        model=calling.model_id, messages=WEATHER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=64
    )
    msg, choice_ = r.choices[0].message, r.choices[0]
    assert choice_.finish_reason == "tool_calls" and not msg.content
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert msg.model_extra["reasoning_content"] == "Need the weather."


@pytest.fixture(scope="module")
def off_session(harmony_path):
    """The harmony file loaded with SHARPI_REASONING=off, its scripted model writing an analysis then a call."""
    with _scripted_session(harmony_path, CALL, "<|call|>", EngineOptions(reasoning="off")) as s:
        yield s


@pytest.mark.parametrize("choice", [None, "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_with_reasoning_off_a_harmony_call_is_still_a_call(off_session, choice):
    """The call format follows the model, not the reasoning switch: with reasoning off a gpt-oss model is still
    held to (or, unforced, read for) a harmony call, which reaches the client as tool_calls; the analysis stays
    in the content as the model wrote it, with no reasoning_content."""
    extra = {} if choice is None else {"tool_choice": choice}
    req = ChatCompletionRequest(model="m", messages=WEATHER, tools=TOOLS, **extra)
    plan = plan_chat(off_session, req)
    if choice is not None:  # harmony's call grammar, split by the decode loop
        assert plan.constraint.split
        for t in off_session.tokenizer.encode(CALL + "<|call|>", add_bos=False):
            plan.constraint.accept(t)
        assert plan.constraint.complete
    host = ModelHost.from_session(off_session)
    with serving(host) as server, openai_client(server) as c:
        for stream in (False, True):
            off_session.model.restart()
            r = c.chat.completions.create(
                model=host.model_id, messages=WEATHER, tools=TOOLS, temperature=0, max_tokens=64, stream=stream, **extra
            )
            if stream:
                chunks = list(r)
                calls = [tc for ch in chunks for x in ch.choices for tc in x.delta.tool_calls or []]
                content = "".join(x.delta.content or "" for ch in chunks for x in ch.choices)
                reasons = [x.finish_reason for ch in chunks for x in ch.choices if x.finish_reason]
                thought = [
                    ch for ch in chunks for x in ch.choices if (x.delta.model_extra or {}).get("reasoning_content")
                ]
            else:
                msg = r.choices[0].message
                calls, content, reasons = msg.tool_calls, msg.content, [r.choices[0].finish_reason]
                thought = [msg.model_extra["reasoning_content"]] if "reasoning_content" in msg.model_extra else []
            assert [(t.function.name, t.function.arguments) for t in calls] == [("get_weather", '{"city": "Paris"}')]
            assert content == "<|channel|>analysis<|message|>Need the weather.<|end|>" and reasons == ["tool_calls"]
            assert thought == []
