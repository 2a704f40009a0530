"""The sampler's fast path (no full sort of the vocabulary) against the chain written with a full sort
(Sampler.reference): the same head order, the same draws."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generate.sampling import Sampler, SamplingParams, head_order


def _cases():
    rng = np.random.default_rng(7)
    V = 5000
    normal = rng.standard_normal(V).astype(np.float32) * 3
    ties = np.round(rng.standard_normal(V) * 2).astype(np.float32)  # many equal values, at every cut
    masked = normal.copy()
    masked[rng.choice(V, V - 30, replace=False)] = -np.inf  # only 30 finite: k can pass them
    close = 1.0 + np.arange(V, dtype=np.float64)[::-1] * 1e-12  # equal in float32, ordered in float64
    nan = normal.astype(np.float64)
    nan[rng.choice(V, 3, replace=False)] = np.nan
    return {"normal": normal.astype(np.float64), "ties": ties.astype(np.float64), "masked": masked.astype(np.float64),
            "close": close, "nan": nan}  # fmt: skip


@pytest.mark.parametrize("name", ["normal", "ties", "masked", "close", "nan"])
@pytest.mark.parametrize("k", [1, 7, 40, 256, 4999, 5000, 6000])
def test_head_order_is_the_stable_sorts_head(name, k):
    x = _cases()[name]
    want = np.argsort(-x, kind="stable")[:k]
    np.testing.assert_array_equal(head_order(x, k), want)


def _logits(kind: str, V: int, rng) -> np.ndarray:
    x = (rng.standard_normal(V) * 3).astype(np.float32)
    if kind == "peaked":  # a model's: a few tokens far above the rest
        x[rng.choice(V, 5, replace=False)] = 14 + rng.standard_normal(5)
    elif kind == "flat":  # the top-p mass spread over thousands of tokens: the head must grow
        x = (rng.standard_normal(V) * 0.3).astype(np.float32)
    elif kind == "ties":
        x = np.round(x).astype(np.float32)
    return x


SETTINGS = [
    SamplingParams(seed=3),
    SamplingParams(repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1, seed=3),
    SamplingParams(top_k=0, seed=3),
    SamplingParams(top_k=0, top_p=0.5, min_p=0.0, seed=3),
    SamplingParams(top_k=0, top_p=1.0, seed=3),
    SamplingParams(top_k=0, top_p=1.0, min_p=0.0, temperature=1.5, seed=3),
    SamplingParams(top_k=1, temperature=1.0, seed=3),
    SamplingParams(top_k=3, top_p=0.2, min_p=0.0, seed=3),
    SamplingParams(top_k=100000, seed=3),
]


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
@pytest.mark.parametrize("i", range(len(SETTINGS)))
def test_sampler_draws_what_the_full_sort_chain_draws(kind, i):
    p = SETTINGS[i]
    rng = np.random.default_rng(11)
    fast, ref = Sampler(p), Sampler(p)
    history = list(rng.integers(0, 3000, 80))
    for V in (3000, 40000):
        for _ in range(12):
            x = _logits(kind, V, rng)
            assert fast(x, history) == ref.reference(x, history)


def test_the_head_grows_until_it_holds_the_top_p_mass():
    """Flat logits put the 0.95 mass far past the first head (Sampler.HEAD): the head must grow, and the
    kept set then equals the reference's (the draw over a too-short head would differ in what it can pick)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(40000) * 0.3).astype(np.float32)
    p = SamplingParams(top_k=0, top_p=0.95, min_p=0.0, temperature=1.0, seed=1)
    fast, ref = Sampler(p), Sampler(p)
    got = {fast(x) for _ in range(400)}
    want = {ref.reference(x) for _ in range(400)}
    assert got == want and len(got) > 300  # hundreds of distinct tokens: far past a head of 256


# -- the settings, checked in one place ----------------------------------------------------------------
@pytest.mark.parametrize(
    "given, field, want",
    [
        ({"temperature": -1.0}, "temperature", 0.0),  # below 0: greedy, as llama.cpp
        ({"top_k": -5}, "top_k", 0),  # off
        ({"top_p": 1.5}, "top_p", 1.0),  # off
        ({"seed": -1}, "seed", None),  # random, as llama.cpp's -1
        ({"seed": np.int64(7)}, "seed", 7),
        ({"stop": ["a", "b"]}, "stop", ("a", "b")),
    ],
)
def test_sampling_params_clamp_what_peers_treat_as_off(given, field, want):
    assert getattr(SamplingParams(**given), field) == want


@pytest.mark.parametrize(
    "given, named",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"repeat_last_n": -1}, "repeat_last_n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": "END"}, "stop"),
    ],
)
def test_sampling_params_reject_the_rest_naming_the_parameter(given, named):
    from engine.errors import UsageError

    with pytest.raises(UsageError, match=f"sampling parameter {named}"):
        SamplingParams(**given)


@pytest.mark.parametrize("top_p", [0.0, 1e-9])
def test_the_smallest_top_p_keeps_the_best_token(top_p):
    logits = np.array([0.1, 3.0, -1.0, 2.9], np.float32)
    s = Sampler(SamplingParams(top_k=0, top_p=top_p, min_p=0.0, temperature=1.0, seed=0))
    assert {s(logits) for _ in range(20)} == {1}


def test_cli_says_which_setting_is_wrong_before_loading(capsys):
    from engine.cli.main import main

    assert main(["run", "-p", "hi", "--min-p", "2", "-n", "4"]) != 0
    err = capsys.readouterr().err
    assert "sampling parameter min_p" in err and "layers" not in err  # no model was loaded first


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1e-300},
        {"frequency_penalty": -1e308, "repeat_last_n": 0},
        {"presence_penalty": -1e308, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
        {"repeat_penalty": 1e-300},
        {"repeat_penalty": 1e300},
    ],
)
def test_extreme_finite_settings_still_draw_a_token(settings):
    """Finite settings at the edge of float64 (a temperature near 0, huge penalties) draw a token, as the
    reference chain does, instead of NaN probabilities."""
    from engine.generate.sampling import Sampler, SamplingParams

    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    s = Sampler(SamplingParams(seed=1, **settings))
    history = [3, 3, 7, 9]
    tok = s(logits, history)
    assert 0 <= tok < 1000
    assert Sampler(SamplingParams(seed=1, **settings)).reference(logits, history) == tok


@pytest.mark.parametrize("V", [1000, 32000, 151936, 262147])
def test_chunked_selection_equals_the_scan(V):
    """The head selection by chunk maxima (_at_least_kth) returns the plain heap scan's indices exactly: random,
    many ties, sorted both ways (the bound's worst and best cases), and NaN (the scan's path)."""
    from engine.generate.sampling import _at_least_kth, _scan_at_least_kth

    rng = np.random.default_rng(V)
    x = (rng.standard_normal(V) * 3).astype(np.float32)
    nan = x.copy()
    nan[::7] = np.nan
    for key in (x, np.round(x), np.sort(x), np.sort(x)[::-1].copy(), nan, np.zeros(V, np.float32)):
        for k in (1, 2, 40, 100, 1024):
            assert np.array_equal(_at_least_kth(key, k), _scan_at_least_kth(key, k)), (k, key[:3])
