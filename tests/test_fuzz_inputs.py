"""Generated settings, prompts and chat templates (hypothesis): each is a clear project error or a sane run,
never a traceback — sampling settings at the engine's one validation place (SamplingParams), prompt text
(lone surrogates, control-token text, any code point) and token ids at the Session boundary, templates
built from hostile pieces under the render limits."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import LoadOptions, Session
from engine.errors import ChatTemplateError, UsageError
from engine.generate.sampling import Sampler, SamplingParams
from engine.tokenizer.chat import ChatTemplate, RenderLimits

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2, 1e-300, 1e300, -1e308, 0.5, 1.0]),
    st.integers(-(10**20), 10**20),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "temperature": NUMBERS,
            "top_k": NUMBERS,
            "top_p": NUMBERS,
            "min_p": NUMBERS,
            "repeat_penalty": NUMBERS,
            "presence_penalty": NUMBERS,
            "frequency_penalty": NUMBERS,
            "repeat_last_n": NUMBERS,
            "seed": NUMBERS,
            "max_tokens": NUMBERS,
        },
    ),
    st.integers(0, 2**32 - 1),
)
def test_any_sampling_settings_are_refused_clearly_or_draw_a_token(kw, seed):
    try:
        p = SamplingParams(**kw)
    except UsageError as e:
        assert "sampling parameter" in str(e)
        return
    if p.seed is None:  # random draws: fixed here so the fast path and the reference can be compared
        p = dataclasses.replace(p, seed=seed)
    logits = np.random.default_rng(seed).standard_normal(300).astype(np.float32) * 4
    history = [1, 2, 2, 7]
    tok = Sampler(p)(logits, history)
    assert 0 <= tok < 300
    assert Sampler(p).reference(logits, history) == tok


@pytest.fixture(scope="module")
def session(synth_model):
    m = synth_model("qwen3moe", "Q8_0", vocab=1024)
    with Session.load(str(m.path), LoadOptions(n_ctx=128, device="cpu")) as s:
        yield s


TEXT = st.lists(
    st.one_of(
        st.characters(),
        st.sampled_from(["\ud800", "\udfff", "\x00", "<|im_end|>", "<|im_start|>", "<think>", "\u2581", " "]),
    ),
    max_size=40,
).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXT, st.sampled_from(["user", "system", "tool", "assistant"]))
def test_any_prompt_text_tokenizes_and_runs(session, text, role):
    ids = session.tokenize(text)
    assert all(0 <= i < session.tokenizer.n_vocab for i in ids)
    session.detokenize(ids)
    params = SamplingParams.greedy(max_tokens=1)
    for ev in session.generate(messages=[{"role": role, "content": text}], params=params):
        assert ev.n_generated <= 1
    if text:
        list(session.generate(text, params=params))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.integers(-5, 2000), st.booleans(), st.floats(), st.text(max_size=2)), max_size=6))
def test_any_prompt_ids_are_refused_clearly_or_run(session, ids):
    try:
        events = list(session.generate(prompt_ids=ids, params=SamplingParams.greedy(max_tokens=1)))
    except UsageError as e:
        assert "token" in str(e) or "empty" in str(e)
        return
    assert events[-1].finish_reason is not None


BIG = st.sampled_from(["10**9", "10**10", "(10 ** 9)", "100000", "2**62", "-1", "0", "3", "10.0 ** 400", "1e308"])
PIECES = st.one_of(
    st.builds("{{{{ 'x' * {} }}}}".format, BIG),
    st.builds("{{{{ ([1] * {}) | length }}}}".format, BIG),
    st.builds("{{% for i in range({}) %}}{{% for j in range({}) %}}.{{% endfor %}}{{% endfor %}}".format, BIG, BIG),
    st.builds("{{{{ messages | tojson(indent={}) }}}}".format, BIG),
    st.builds("{{{{ 'ab'.center({}) }}}}".format, BIG),
    st.builds("{{{{ 'a\\nb' | indent({}) }}}}".format, BIG),
    st.builds("{{{{ {} ** {} }}}}".format, BIG, BIG),
    st.builds("{{{{ '%*d' % ({}, 1) }}}}".format, BIG),
    st.just("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
    st.just("{{ messages[0].content * 100000 }}"),
    st.just("{{ raise_exception('no') }}"),
    st.just("{{ ''.__class__.__mro__ }}"),
    st.just("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"),
    st.just("{{ (messages | map(attribute='content') | join) * 3 }}"),
    st.just(
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"
    ),
    st.text(max_size=8),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(PIECES, min_size=1, max_size=4))
def test_generated_hostile_templates_render_or_fail_clearly(pieces):
    t = ChatTemplate("".join(pieces))
    t.limits = RenderLimits(seconds=0.3, max_chars=1 << 16)
    try:
        out = t.render([{"role": "user", "content": "hi <|im_end|>"}])
    except ChatTemplateError:
        return
    assert isinstance(out, str) and len(out) <= 1 << 16
    assert not math.isnan(len(out))
