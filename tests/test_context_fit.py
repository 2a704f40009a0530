"""A conversation never outgrows the context: the oldest turns leave it (the system prompt and the
latest turn stay), and the CLI and the app give a model the same default context."""

from __future__ import annotations

import pytest

from engine.api import AUTO_CTX, LoadOptions, Session
from engine.generate import SamplingParams
from engine.plan import DEFAULT_CTX_MAX, default_ctx


@pytest.fixture(scope="module")
def session(synth_model):
    path = synth_model("qwen3moe", "Q8_0", vocab=1024, ctx=128).path
    with Session.load(str(path), LoadOptions(n_ctx=AUTO_CTX)) as s:
        yield s


def _turns(n: int) -> list[dict]:
    out = [{"role": "system", "content": "You answer briefly."}]
    for i in range(n):
        out += [{"role": "user", "content": f"question {i} " * 4}, {"role": "assistant", "content": f"answer {i} " * 4}]
    return out + [{"role": "user", "content": "the last question"}]


def test_default_ctx_is_the_training_context_capped():
    assert default_ctx(128) == 128 and default_ctx(262144) == DEFAULT_CTX_MAX and default_ctx(0) == DEFAULT_CTX_MAX


def test_auto_context_is_the_models_default(session):
    assert session.n_ctx == default_ctx(session.args.n_ctx_train) == 128


def test_fit_drops_oldest_turns_keeps_system_and_last(session):
    messages = _turns(12)
    kept, dropped = session.fit_messages(messages, max_tokens=32)
    assert dropped > 0 and dropped % 2 == 0  # whole turns: a question with its answer
    assert kept[0] == messages[0] and kept[-1] == messages[-1]
    assert kept[1:] == messages[1 + dropped :]  # the newest turns, in order
    n = len(session.tokenize(session.render_chat(kept)))
    assert n <= session.n_ctx - 32
    # One turn more would not have fitted: no turn was dropped that could stay.
    wider = [messages[0], *messages[dropped - 1 : dropped + 1], *kept[1:]]
    assert len(session.tokenize(session.render_chat(wider))) > session.n_ctx - 32


def test_fit_keeps_a_short_conversation_whole(session):
    messages = _turns(1)
    assert session.fit_messages(messages, max_tokens=16) == (messages, 0)


def test_twenty_turns_never_dead_end(session):
    """Twenty questions in one conversation: each gets a reply, none fails for the context."""
    messages: list[dict] = []
    params = SamplingParams.greedy(max_tokens=24)
    for i in range(20):
        messages.append({"role": "user", "content": f"tell me about topic number {i}"})
        messages, _ = session.fit_messages(messages, params.max_tokens)
        last = list(session.generate(messages=messages, params=params))[-1]
        assert last.finish_reason in ("eos", "length", "stop", "context") and last.n_generated >= 1
        messages.append({"role": "assistant", "content": "reply"})


def test_cli_chat_drops_old_turns_and_says_so_once(synth_model, monkeypatch, capsys):
    """`sharpi run --chat` on a model trained for 128 tokens: its default context is the app's, and
    fifteen questions all get answers, the user told once that old turns leave the context."""
    import io

    from engine.cli.main import main

    path = synth_model("qwen3moe", "Q8_0", vocab=1024, ctx=128).path
    questions = "".join(f"tell me about topic number {i}\n" for i in range(15))
    monkeypatch.setattr("sys.stdin", io.StringIO(questions))
    assert main(["run", "-m", str(path), "--chat", "-n", "12", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert f"ctx {default_ctx(128)}:" in err  # the same default as the app's
    assert err.count("older turns are dropped") == 1
    assert err.count("] prompt ") == 15  # every question answered (one speed line each)
    assert "sharpi: the prompt has" not in err


def test_twenty_turns_with_the_demo_model_never_dead_end(monkeypatch, capsys):
    """The bundled demo model (trained for 256 tokens) through `sharpi run --chat` as a user runs it (no -m,
    the default reply length): twenty questions, twenty answers, old turns dropped with one notice."""
    import io

    from engine.cli.main import main
    from engine.demo import demo_model_path

    try:
        demo_model_path()
    except FileNotFoundError:
        pytest.skip("the demo model is not in this checkout")
    topics = ("the with statement", "generators", "decorators", "list comprehensions", "__init__")
    questions = "".join(f"What about {topics[i % len(topics)]}? ({i})\n" for i in range(20))
    monkeypatch.setattr("sys.stdin", io.StringIO(questions))
    assert main(["run", "--chat", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("] prompt ") == 20  # every question answered (one speed line each)
    assert err.count("older turns are dropped") == 1
    assert "but the context holds" not in err and "Traceback" not in err  # the dead end, as generate says it
