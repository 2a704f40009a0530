"""Reasoning kept apart from the answer (engine.generate.reasoning): the streaming splitter on scripted text and
on scripted token streams through the decode loop, with real token ids of the synthetic gpt-oss (harmony) and
a <think> vocabulary."""

from __future__ import annotations

import random
import threading

import pytest

from engine.generate import SamplingParams, generate
from engine.generate.loop import CacheState
from engine.generate.reasoning import (
    HARMONY,
    THINK,
    ReasoningSplitter,
    detect_format,
    model_format,
    start_state,
    template_messages,
)
from engine.gguf import open_gguf
from engine.synth.tokenizer import BPE_SPECIALS, corpus, train_bpe_vocab
from engine.synth.writer import write_model
from engine.tokenizer import load_tokenizer
from tests.scripted import FlatCache, ScriptedModel


def run(
    fmt: str, pieces, state: str | None = None, calls: list | None = None, only_calls: bool = False
) -> tuple[str, str, bool]:
    """(reasoning, answer, ended) of ``pieces`` fed one by one, then flushed; the tool calls into ``calls``."""
    sp = ReasoningSplitter(fmt, state, only_calls=only_calls)
    r, a = [], []
    ended = False
    got = [] if calls is None else calls
    for p in pieces:
        s = sp.feed(p)
        r.append(s.reasoning)
        a.append(s.answer)
        got.extend(s.calls)
        ended = ended or s.ended
    f = sp.flush()
    got.extend(f.calls)
    return "".join(r) + f.reasoning, "".join(a) + f.answer, ended or f.ended


def chunkings(text: str, seed: int = 0):
    """The text whole, character by character, and in random cuts."""
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(
    "text, state, want",
    [
        ("<think>\nLet me see.\n</think>\n\nIt is 4.", None, ("Let me see.\n", "It is 4.")),
        ("  <think>a</think>b", None, ("a", "b")),
        ("No thinking here.", None, ("", "No thinking here.")),
        # a prompt that ends inside <think> (QwQ): the reply starts in the reasoning
        ("Hmm, 2+2.\n</think>\n\n4", "reasoning", ("Hmm, 2+2.\n", "4")),
        # unterminated at max_tokens: all reasoning, nothing lost
        ("<think>still going", None, ("still going", "")),
        ("<think>still going <", None, ("still going <", "")),
        # nested and duplicated markers stay text of the part they occur in
        ("<think>a <think>b</think> c </think> d", None, ("a <think>b", "c </think> d")),
        ("<think><think></think></think>", None, ("<think>", "</think>")),
        ("answer first <think>x</think>", None, ("", "answer first <think>x</think>")),
        ("</think>only a close", None, ("", "</think>only a close")),
        ("<thi", None, ("", "<thi")),
        ("<think>", None, ("", "")),
        ("", None, ("", "")),
    ],
)
def test_think_splits_in_any_chunking(text, state, want):
    for pieces in chunkings(text):
        got = run(THINK, pieces, state)
        assert got[:2] == want, pieces
        assert not got[2]


@pytest.mark.parametrize(
    "text, want",
    [
        (
            "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4",
            ("User asks 2+2.", "4", False),
        ),
        (  # <|return|> written as text ends the turn; what follows is not part of it
            "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>junk",
            ("a", "b", True),
        ),
        (  # a tool call's message is neither reasoning nor answer (test_harmony_tool_calls); <|call|> ends the turn
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
            ("", "", True),
        ),
        ("<|channel|>analysis<|message|>unterminated", ("unterminated", "", False)),
        ("<|channel|>analysis<|message|>a<|end|><|start|>assistant", ("a", "", False)),
        ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", ("a", "", False)),
        # a model that writes no header: its text is answer
        ("Plain text\nwith a line break", ("", "Plain text\nwith a line break", False)),
        ("x" * 300, ("", "x" * 300, False)),
        ("hello<|return|>", ("", "hello", True)),
        # duplicated and nested markers inside a body are text of that body
        (
            "<|channel|>analysis<|message|>a<|message|>b<|channel|>c<|end|>"
            "<|start|>assistant<|channel|>final<|message|>d<|message|>e",
            ("a<|message|>b<|channel|>c", "d<|message|>e", False),
        ),
        # a new header without <|end|>: the body ends there
        (
            "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b",
            ("a", "b", False),
        ),
        # two analysis messages, then the answer
        (
            "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
            "<|start|>assistant<|channel|>final<|message|>c",
            ("ab", "c", False),
        ),
        # preambles (commentary without a recipient) are for the user
        ("<|channel|>commentary<|message|>Looking it up.<|end|>", ("", "Looking it up.", False)),
    ],
)
def test_harmony_splits_in_any_chunking(text, want):
    for pieces in chunkings(text):
        assert run(HARMONY, pieces) == want, pieces


@pytest.mark.parametrize(
    "text, want, calls",
    [
        (  # the recipient after the channel, reasoning first; <|call|> written as text ends the turn
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|> {"city": "Paris"} <|call|>junk',
            ("Need the weather.", "", True),
            [("get_weather", '{"city": "Paris"}')],
        ),
        (  # the recipient before the channel; the call ends where the stream does (<|call|> as a token)
            '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "a<|message|>b"}',
            ("", "", False),
            [("lookup", '{"q": "a<|message|>b"}')],
        ),
        (  # a preamble for the user, then a call ended by <|end|>, then an answer; another namespace kept whole
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
            "to=browser.search<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>Done",
            ("", "Checking.Done", False),
            [("browser.search", "{}")],
        ),
        (  # arguments that are not JSON are passed as written (the client decides)
            "<|channel|>commentary to=functions.f<|message|>not json",
            ("", "", False),
            [("f", "not json")],
        ),
        # "to=" inside a body is text, not a recipient
        ("<|channel|>final<|message|>send it to=functions.f", ("", "send it to=functions.f", False), []),
    ],
)
def test_harmony_tool_calls(text, want, calls):
    """A message addressed to a recipient is a tool call: (name, arguments) in Split.calls, in any chunking."""
    for pieces in chunkings(text):
        got: list = []
        assert run(HARMONY, pieces, calls=got) == want, pieces
        assert got == calls, pieces


@pytest.mark.parametrize(
    "text, answer, calls",
    [
        (  # the analysis stays in the answer as written; the call message is taken out
            "<|channel|>analysis<|message|> Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|> {"city": "Paris"} ',
            "<|channel|>analysis<|message|> Need the weather.<|end|>",
            [("get_weather", '{"city": "Paris"}')],
        ),
        (  # a call ended by <|end|>, then an answer; a partial header at the end stays too
            "<|channel|>commentary to=functions.f<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>"
            " Done <|end|><|start|>assist",
            "<|start|>assistant<|channel|>final<|message|> Done <|end|><|start|>assist",
            [("f", "{}")],
        ),
        ("no markup at all", "no markup at all", []),
    ],
)
def test_harmony_only_calls_keeps_the_rest_as_written(text, answer, calls):
    """``only_calls`` (a harmony model with its reasoning off, tools in play): the calls come out as calls, every
    other character is answer, in any chunking."""
    for pieces in chunkings(text):
        got: list = []
        assert run(HARMONY, pieces, calls=got, only_calls=True) == ("", answer, False), pieces
        assert got == calls, pieces
    with pytest.raises(ValueError):
        ReasoningSplitter(THINK, only_calls=True)


def test_start_states_from_the_prompt():
    assert start_state(THINK, "<|im_start|>assistant\n<think>\n")[0] == "reasoning"
    assert start_state(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n")[0] == "start"
    assert start_state(THINK, "<|im_start|>assistant\n")[0] == "start"
    assert start_state(HARMONY, "<|end|><|start|>assistant")[0] == "header"
    assert start_state(HARMONY, "<|start|>assistant<|channel|>final<|message|>")[0] == "body:final"
    assert start_state(HARMONY, "<|start|>assistant<|channel|>analysis<|message|>")[0] == "body:analysis"
    assert start_state(HARMONY, "a raw prompt")[0] == "header"
    assert run(HARMONY, ["so it is 4.<|end|><|start|>assistant<|channel|>final<|message|>4"], "body:analysis") == (
        "so it is 4.",
        "4",
        False,
    )


WORDS = [f"w{i}" for i in range(40)]
THINK_BITS = ["<think>", "</think>", "<", "think>", "</", " ", "\n"]
HARMONY_BITS = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "<|message|>", "<|end|>", " ", "<|"]


@pytest.mark.parametrize("fmt, bits", [(THINK, THINK_BITS), (HARMONY, HARMONY_BITS)])
@pytest.mark.parametrize("seed", range(30))
def test_hostile_streams_never_crash_or_lose_a_word(fmt, bits, seed):
    """Random mixes of markers, marker fragments and words, cut anywhere: the same split in every chunking, and
    each word once in the reasoning or the answer, unless a header took it (harmony, words between a header
    marker and its <|message|>)."""
    rng = random.Random(seed)
    parts = [rng.choice(bits) if rng.random() < 0.6 else rng.choice(WORDS) for _ in range(rng.randint(1, 40))]
    text = "".join(p if p not in WORDS else f" {p} " for p in parts)
    whole = run(fmt, [text])
    for pieces in chunkings(text, seed):
        assert run(fmt, pieces) == whole, pieces
    out = (whole[0] + " " + whole[1]).split()
    for w in {p for p in parts if p in WORDS}:
        if fmt == THINK:
            assert out.count(w) == text.split().count(w), (w, text, whole)
        else:
            assert out.count(w) <= text.split().count(w)


def test_harmony_words_outside_headers_survive():
    text = "<|channel|>analysis<|message|> w1 w2 <|end|><|start|>assistant<|channel|>final<|message|> w3 <|end|> w4"
    r, a, _ = run(HARMONY, list(text))
    assert r.split() == ["w1", "w2"] and a.split() == ["w3", "w4"]


def test_detect_format():
    vocab = {"<|channel|>", "<|message|>"}
    assert detect_format("gpt-oss", None, lambda t: False) == HARMONY
    assert detect_format("llama", None, vocab.__contains__) == HARMONY
    assert detect_format("qwen3moe", None, {"<think>", "</think>"}.__contains__) == THINK
    assert detect_format("qwen2", "{{ content.split('</think>')[-1] }}", lambda t: False) == THINK
    assert detect_format("qwen2moe", "{{ messages }}", lambda t: False) is None
    assert model_format("off", HARMONY) is None
    assert model_format("think", None) == THINK
    assert model_format("auto", HARMONY) == HARMONY
    assert model_format("auto", None) is None


def test_template_messages_name_the_reasoning_as_the_template_does():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert template_messages(msgs, THINK) is msgs
    assert template_messages(msgs, HARMONY)[1] == {**msgs[1], "thinking": "r"}
    assert template_messages(msgs, None) is msgs


# -- through the decode loop, on real token ids -----------------------------------------------------------------
def stream(tok, script, prompt, fmt, max_tokens=64, **kw):
    model = ScriptedModel(script, tok.n_vocab)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    evs = list(generate(model, tok, FlatCache(), CacheState(), prompt, params, threading.Event(), reasoning=fmt))
    return "".join(e.reasoning for e in evs), "".join(e.text for e in evs), evs


@pytest.fixture(scope="module")
def harmony_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony") / "gpt-oss.gguf"
    write_model(path, "gpt-oss")
    gf = open_gguf(path)
    yield load_tokenizer(gf)
    gf.close()


@pytest.fixture(scope="module")
def think_tok(tmp_path_factory):
    vocab = train_bpe_vocab(corpus(), 1024, specials=(*BPE_SPECIALS, "<think>", "</think>"))
    path = tmp_path_factory.mktemp("think") / "qwen3.gguf"
    write_model(path, "qwen3moe", tokenizer=vocab)
    gf = open_gguf(path)
    yield load_tokenizer(gf)
    gf.close()


def test_the_synthetic_gpt_oss_vocabulary_speaks_harmony(harmony_tok):
    tok = harmony_tok
    ids = {t: tok.token_id(t) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")}
    assert all(i is not None and tok.is_special(i) for i in ids.values())
    assert tok.is_eog(ids["<|return|>"]) and tok.is_eog(ids["<|call|>"]) and not tok.is_eog(ids["<|end|>"])
    assert tok.token_text(tok.eos_id) == "<|return|>"
    assert (
        tok.encode("<|start|>assistant<|channel|>final<|message|>hi")[:3]
        == [
            ids["<|start|>"],
            *tok.encode("assistant", parse_special=False),
            ids["<|channel|>"],
        ][:3]
    )


def test_harmony_through_the_loop_with_token_ids(harmony_tok):
    tok = harmony_tok

    def enc(s):
        return tok.encode(s, add_bos=False)

    prompt = enc("<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant")
    script = enc("<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>4")
    ret = tok.token_id("<|return|>")
    r, a, evs = stream(tok, [*script, ret], prompt, HARMONY)
    assert (r, a) == ("Simple sum.", "4")
    assert evs[-1].finish_reason == "eos" and evs[-1].token_id == ret
    # <|call|> ends the turn too, the call in the last event
    r, a, evs = stream(
        tok,
        [*enc('<|channel|>commentary to=functions.f<|message|>{"x": 1}'), tok.token_id("<|call|>")],
        prompt,
        HARMONY,
    )
    assert (r, a, evs[-1].finish_reason) == ("", "", "eos")
    assert [c for e in evs for c in e.calls] == [("f", '{"x": 1}')] and evs[-1].calls
    # unterminated analysis at max_tokens: what came is reasoning, the answer empty
    r, a, evs = stream(tok, enc("<|channel|>analysis<|message|>" + "thinking " * 30), prompt, HARMONY, max_tokens=12)
    assert evs[-1].finish_reason == "length" and a == "" and r.startswith("thinking")
    assert r == tok.decode(enc("<|channel|>analysis<|message|>" + "thinking " * 30)[:12]).split("<|message|>")[1]
    # separation off: the text whole
    r, a, _ = stream(tok, [*script, ret], prompt, None)
    assert r == "" and a == tok.decode(script)


def test_think_through_the_loop_with_special_and_plain_markers(think_tok, harmony_tok):
    tok = think_tok
    open_id, close_id = tok.token_id("<think>"), tok.token_id("</think>")
    assert tok.encode("<think>")[-1] == open_id
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    body = tok.encode("<think>\nThe user greets.\n</think>\n\nHello there.")
    assert open_id in body and close_id in body
    r, a, evs = stream(tok, [*body, tok.eos_id], prompt, THINK)
    assert (r, a) == ("The user greets.\n", "Hello there.") and evs[-1].finish_reason == "eos"
    # a prompt ending in <think>: no opening marker in the reply
    open_prompt = prompt + tok.encode("<think>\n")
    r, a, _ = stream(tok, [*tok.encode("Hmm.\n</think>\n\nHi."), tok.eos_id], open_prompt, THINK)
    assert (r, a) == ("Hmm.\n", "Hi.")
    # plain-text markers in a vocabulary without them: split over several tokens each
    plain = harmony_tok
    ids = plain.encode("<think>Deep thought.</think>Answer.", add_bos=False)
    assert plain.token_id("<think>") is None and len(ids) > 6
    r, a, _ = stream(plain, [*ids, plain.token_id("<|return|>")], plain.encode("q", add_bos=False), THINK)
    assert (r, a) == ("Deep thought.", "Answer.")
    # a stop string inside the answer still cuts it
    r, a, evs = stream(tok, [*body, tok.eos_id], prompt, THINK, stop=("there",))
    assert (r, a, evs[-1].finish_reason) == ("The user greets.\n", "Hello ", "stop")


def test_the_cli_writes_the_answer_to_stdout_and_the_reasoning_to_stderr(harmony_tok, capsys):
    from engine.cli.cmd_run import _stream

    tok = harmony_tok
    script = tok.encode("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>ok")
    _, _, evs = stream(tok, [*script, tok.token_id("<|return|>")], tok.encode("q"), HARMONY)
    _stream(None, evs)
    out = capsys.readouterr()
    assert out.out == "ok" and out.err == "hmm"


# The rule Qwen3's template follows, written out for this test: an assistant turn's reasoning (its
# reasoning_content, or the <think> block in its content) is rendered only after the last user message (a tool
# round in progress); every earlier turn keeps its answer alone.
QWEN_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set thought = m.get('reasoning_content') or '' %}"
    "{%- if '</think>' in content %}{%- set thought = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and thought %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_think_models_history_leaves_earlier_reasoning_out(tmp_path):
    """A Qwen3-style file (the <think> tokens in its vocabulary): the format is detected, and an earlier reply's
    reasoning handed back as reasoning_content is dropped by the template from the next prompt, kept only for a
    turn after the last user message."""
    from dataclasses import replace

    from engine.api import LoadOptions, Session

    vocab = train_bpe_vocab(corpus(), 1024, specials=(*BPE_SPECIALS, "<think>", "</think>"))
    path = tmp_path / "qwen3.gguf"
    write_model(path, "qwen3moe", tokenizer=replace(vocab, chat_template=QWEN_LIKE))
    with Session.load(str(path), LoadOptions(n_ctx=256)) as s:
        assert s.reasoning == THINK
        turns = [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "EARLIER"},
            {"role": "user", "content": "q2"},
        ]
        prompt = s.render_chat(turns)
        assert "EARLIER" not in prompt and "<|im_start|>assistant\na1<|im_end|>" in prompt
        tool_round = [*turns, {"role": "assistant", "content": "calling", "reasoning_content": "NOW"}]
        assert "<think>\nNOW\n</think>" in s.render_chat(tool_round, add_generation_prompt=False)
        # the ids a next turn feeds: no earlier reasoning either
        assert "EARLIER" not in s.detokenize(s.chat_ids(turns))
