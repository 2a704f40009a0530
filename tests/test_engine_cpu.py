"""CPU engine pieces that need no oracle: KV narrowing, sampling, stop strings, grouped routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import UsageError
from engine.generate.loop import StopMatcher
from engine.generate.sampling import Sampler, SamplingParams
from engine.gguf import open_gguf
from engine.models import build_model
from engine.synth.writer import write_model
from tests.oracle import random_tokens


@pytest.fixture(scope="module")
def qwen3moe_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cpu") / "m.gguf", "qwen3moe", seed=21, layers=3).path


def _logits(path, tokens, kv_type):
    with open_gguf(path) as gf:
        m = build_model(gf)
        cache = m.new_cache(128, kv_type)
        out = np.concatenate([m.forward([t], i, cache).numpy() for i, t in enumerate(tokens)])
        return out, cache.storage_dtype(), cache.nbytes


@pytest.mark.parametrize("kv_type,dtype,bound", [("bf16", torch.bfloat16, 0.25), ("q8_0", torch.int8, 0.6)])
def test_kv_narrowing_is_argmax_stable_and_really_applied(qwen3moe_path, kv_type, dtype, bound):
    tokens = random_tokens(40, 1024, seed=4)
    ref, ref_dtype, ref_bytes = _logits(qwen3moe_path, tokens, "f32")
    got, got_dtype, got_bytes = _logits(qwen3moe_path, tokens, kv_type)
    assert ref_dtype == torch.float32 and got_dtype == dtype  # no silent f32 fallback
    assert got_bytes < ref_bytes * (0.51 if kv_type == "bf16" else 0.27)
    top5 = np.argsort(-got, axis=-1)[:, :5]
    assert all(ref[i].argmax() in top5[i] for i in range(len(tokens)))
    delta = np.abs(got - ref).max()
    assert 0 < delta < bound, delta


def test_kv_type_from_environment(qwen3moe_path):
    from engine.api import LoadOptions, Session
    from engine.config import EngineOptions

    engine = EngineOptions.from_env({"SHARPI_KV_DTYPE": "bf16"})  # what the process environment would give
    with Session.load(str(qwen3moe_path), LoadOptions(n_ctx=16, engine=engine)) as s:
        assert s.kv_type == "bf16" and s.cache.storage_dtype() == torch.bfloat16
    with open_gguf(qwen3moe_path) as gf:
        assert build_model(gf).new_cache(16).storage_dtype() == torch.float32  # a bare cache: f32 unless told


def test_q8_0_kv_needs_width_multiple_of_32(tmp_path):
    path = write_model(tmp_path / "odd.gguf", "qwen3", seed=1, heads=4, kv_heads=1, head_dim=40).path
    with open_gguf(path) as gf:
        m = build_model(gf)
        with pytest.raises(UsageError, match="multiple of 32"):
            m.new_cache(16, "q8_0")
        m.new_cache(16, "bf16")  # the other dtypes still work


def test_context_overflow_is_a_clear_error(qwen3moe_path):
    with open_gguf(qwen3moe_path) as gf:
        m = build_model(gf)
        cache = m.new_cache(8)
        with pytest.raises(UsageError, match="context full"):
            m.forward(list(range(10, 20)), 0, cache)


def test_greedy_sampler_is_argmax_and_seeded_sampling_repeats():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(500).astype(np.float32)
    assert Sampler(SamplingParams.greedy())(logits) == int(np.argmax(logits))
    assert Sampler(SamplingParams(top_k=1, temperature=1.0))(logits) == int(np.argmax(logits))
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=42)
    a = [Sampler(p)(logits) for _ in range(3)]
    s = Sampler(p)
    draws = [s(logits) for _ in range(200)]
    assert a[0] == a[1] == a[2]  # same seed, same first draw
    assert len(set(draws)) > 3  # but it does sample
    top50 = set(np.argsort(-logits)[:50].tolist())
    assert set(draws) <= top50


def test_penalties_push_repeated_tokens_down():
    logits = np.zeros(10, np.float32)
    logits[3] = 2.0
    s = Sampler(SamplingParams.greedy(repeat_penalty=4.0, presence_penalty=1.0))
    assert s(logits, history=[3, 3]) != 3
    assert Sampler(SamplingParams.greedy())(logits, history=[3, 3]) == 3


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(("</end>",))
    out = []
    for piece in ["Hello </", "e", "nd> tail"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped
    m = StopMatcher(("XYZ",))
    assert m.feed("abX")[0] == "ab" and m.feed("a")[0] == "Xa"
