"""OpenAI gpt-oss (``gpt-oss``): its quirks live and held to llama.cpp, its experts' fast paths to their
references. (F32 logits and greedy continuations against llama.cpp: tests/test_parity_llama.py; every placement
against the CPU engine: tests/test_runtime.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.gguf import open_gguf
from engine.kernels import reference as ref
from engine.kernels.grouped import grouped_moe_ffn, grouped_moe_ffn_ref
from engine.kernels.moe import ExpertGLU, glu_act, moe_ffn
from engine.kernels.prepare import prepare_weight
from engine.models import build_model
from engine.models.layers import YaRN, attention, swiglu_oai
from engine.quant import QType, quantize
from tests.oracle import llama_logits, random_tokens

N = 40


def _forward(model, tokens) -> np.ndarray:
    return model.forward(tokens, 0, model.new_cache(64)).numpy()


def test_quirks_are_live(synth_model):
    """Each quirk moves the logits of the synthetic file (whose llama.cpp parity, ≤ 1e-4, is
    tests/test_parity_llama.py's): the sinks, the window of the even layers, YaRN's ramp and its cos/sin
    scale, the clamped SwiGLU and the experts' biases."""
    m = synth_model("gpt-oss", "F32")
    toks = random_tokens(N, 1024, seed=3)
    with open_gguf(m.path) as gf:
        model = build_model(gf, q8_act=False)
        assert [layer.attn.window for layer in model.layers] == [8, 0]  # set_swa_pattern(2)
        base = _forward(model, toks)

        def moved() -> float:
            return float(np.abs(_forward(model, toks) - base).max())

        sinks = [layer.attn.sinks for layer in model.layers]
        for layer in model.layers:
            layer.attn.sinks = None
        assert moved() > 0.05
        for layer, s in zip(model.layers, sinks):
            layer.attn.sinks = s
        for layer in model.layers:
            layer.attn.window = 0
        assert moved() > 0.05
        model.configure([model.w] * 2, list(model.devices), dict(model._backends), model.w)
        yarn = model.yarn
        for changed in (dataclasses.replace(yarn, ext_factor=0.0), dataclasses.replace(yarn, attn_factor=0.75)):
            model.yarn = changed
            assert moved() > 0.05
        model.yarn = yarn
        assert moved() == 0.0
        cpu = model.experts_of(0)
        stacks = {i: cpu.host_stacks(i) for i in (0, 1)}
        for change in (dict(act="silu"), dict(gate_bias=None, up_bias=None, down_bias=None)):
            for i, s in stacks.items():
                cpu._host[i] = dataclasses.replace(s, glu=dataclasses.replace(s.glu, **change))
            assert moved() > 0.05


def test_yarn_corr_dims_and_scale():
    """ggml_rope_yarn_corr_dims for gpt-oss's numbers (head 64, base 150000, 4096 positions, factor 32): the ramp
    runs over pairs 8 … 18; cos and sin are scaled by 1 + 0.1·ln 32; past the ramp the angle is interpolated."""
    y = YaRN(factor=32.0, n_ctx_orig=4096)
    assert y.corr_dims(64, 150000.0) == (8.0, 18.0)
    theta, mscale = y.angles(np.array([0, 5, 1000]), 64, 150000.0)
    assert mscale == pytest.approx(1 + 0.1 * np.log(32), rel=1e-6)
    extrap = YaRN(factor=1.0, n_ctx_orig=4096, ext_factor=0.0).angles(np.array([1000]), 64, 150000.0)[0][0]
    np.testing.assert_allclose(theta[2, :8], extrap[:8], rtol=1e-6)  # ramp 1: extrapolated
    np.testing.assert_allclose(theta[2, 19:], extrap[19:] / 32, rtol=1e-6)  # ramp 0: interpolated


def test_sinks_take_probability_from_every_position():
    """The sink column only takes probability: a sink of −inf is plain attention; a large one scales every
    output towards zero."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, n, 16, generator=g) for n in (4, 2, 2))
    plain = attention(q, k, v, 0)
    assert torch.allclose(attention(q, k, v, 0, sinks=torch.full((4,), -float("inf"))), plain)
    assert attention(q, k, v, 0, sinks=torch.full((4,), 30.0)).abs().max() < 1e-6


def test_swiglu_oai_numpy_equals_torch():
    """The host (numpy) and torch clamped SwiGLU agree, the clamps included (values past ±7)."""
    rng = np.random.default_rng(1)
    g, u = (rng.standard_normal((4, 64), dtype=np.float32) * 6 for _ in range(2))
    glu = ExpertGLU(act="swiglu_oai")
    want = swiglu_oai(torch.from_numpy(g), torch.from_numpy(u)).numpy()
    np.testing.assert_allclose(glu_act(glu, g, u), want, rtol=1e-6, atol=1e-6)
    assert (np.abs(g) > 7).any() and (np.abs(u) > 7).any()


E, F, D = 6, 256, 512


@pytest.mark.parametrize("qtype", [QType.F32, QType.MXFP4])
@pytest.mark.parametrize("q8_act", [False, True], ids=["exact", "q8"])
def test_biased_experts_fast_paths_equal_reference(qtype, q8_act):
    """Biased, clamped experts through the per-token kernel and the grouped prompt path equal the numpy
    reference (``reference.moe_ffn_ref`` with the same ExpertGLU)."""
    rng = np.random.default_rng(5)
    raws = [
        quantize(rng.standard_normal(shape, dtype=np.float32) * 0.08, qtype)
        for shape in ((E, F, D),) * 2 + ((E, D, F),)
    ]
    g, u, d = (prepare_weight(qtype, r) for r in raws)
    glu = ExpertGLU(
        *(rng.standard_normal(s, dtype=np.float32) * 0.5 for s in ((E, F), (E, F), (E, D))), "swiglu_oai", 1.702, 7.0
    )
    X = rng.standard_normal((7, D), dtype=np.float32) * 2
    ids = np.stack([rng.choice(E, 3, replace=False) for _ in range(7)]).astype(np.int64)
    W = rng.dirichlet(np.ones(3), 7).astype(np.float32)
    want = np.stack(
        [ref.moe_ffn_ref((qtype,) * 3, *raws, X[t], ids[t], W[t], q8_act=q8_act, glu=glu) for t in range(7)]
    )
    scale = np.abs(want).max()
    token = np.stack([moe_ffn(g, u, d, X[t], ids[t], W[t], q8_act=q8_act, glu=glu) for t in range(7)])
    grouped = grouped_moe_ffn(g, u, d, X, ids, W, q8_act=q8_act, glu=glu)
    tol = 1e-5 if not q8_act else 1e-2  # q8: h re-quantized between the layers (a last bit may move a code)
    for got in (token, grouped, grouped_moe_ffn_ref(g, u, d, X, ids, W, q8_act=q8_act, glu=glu)):
        assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale
    np.testing.assert_allclose(token, grouped, rtol=1e-5, atol=1e-6 * scale)
    plain = grouped_moe_ffn(g, u, d, X, ids, W, q8_act=q8_act)
    assert np.abs(plain - grouped).max() > 0.05 * scale  # the biases and the activation are live


@pytest.mark.llama
@pytest.mark.parametrize("q8_act", [True, False], ids=["q8", "exact"])
def test_mxfp4_experts_statistically_equal_llama_cpp(tmp_path, q8_act):
    """MXFP4 experts (as gpt-oss ships them) in an otherwise F32 file: the thresholds of test_parity_llama's
    quantized models, prompt and token by token (q8: mean |Δ| < 0.05, argmax ≥ 95 %; exact: < 0.1, ≥ 90 %)."""
    pytest.importorskip("llama_cpp")
    from engine.synth.writer import write_model

    m = write_model(tmp_path / "mx.gguf", "gpt-oss", seed=11, type_overrides={"*_exps": "MXFP4"})
    assert m.types()["blk.0.ffn_up_exps.weight"] == QType.MXFP4 and not m.fallbacks
    toks = random_tokens(64, 1024, seed=9)
    want = llama_logits(m.path, toks)
    with open_gguf(m.path) as gf:
        model = build_model(gf, q8_act=q8_act)
        pre = _forward(model, toks)
        cache = model.new_cache(128)
        dec = np.concatenate([model.forward([t], i, cache).numpy() for i, t in enumerate(toks)])
    mean_max, agree_min = (0.05, 0.95) if q8_act else (0.1, 0.90)
    for got in (pre, dec):
        mean, agree = float(np.abs(got - want).mean()), float((got.argmax(-1) == want.argmax(-1)).mean())
        assert mean < mean_max and agree >= agree_min, (mean, agree)


# -- sliding-window layers keep their window (and a slack) in a ring ---------------------------------------------


def test_ring_keeps_the_window_and_computes_the_same(synth_model, monkeypatch):
    """With a slack of 4 the even layer's K/V is a ring of 12 rows (window 8) under a 64-position context:
    a whole prompt, the same prompt in two parts (the second longer than the ring) and token-by-token decode all
    give the logits of the full-length cache."""
    from engine import kv_layout

    m = synth_model("gpt-oss", "F32")
    toks = random_tokens(N, 1024, seed=3)
    with open_gguf(m.path) as gf:
        model = build_model(gf, q8_act=False)
        full = _forward(model, toks)
        monkeypatch.setattr(kv_layout, "KV_WINDOW_SLACK", 4)
        cache = model.new_cache(64)
        assert cache.rings == {0: (8, 12)} and cache.k[0].q.shape[0] == 12 and cache.k[1].q.shape[0] == 64
        np.testing.assert_allclose(model.forward(toks, 0, cache).numpy(), full, atol=1e-5)
        cache = model.new_cache(64)
        parts = [model.forward(toks[:5], 0, cache), model.forward(toks[5:], 5, cache)]
        np.testing.assert_allclose(torch.cat(parts).numpy(), full, atol=1e-5)
        cache = model.new_cache(64)
        dec = np.concatenate([model.forward([t], i, cache).numpy() for i, t in enumerate(toks)])
        np.testing.assert_allclose(dec, full, atol=1e-5)
        # a new prompt may reuse a prefix only where the ring still holds the window before it
        # (the ring holds positions 28 … 39; the query at `keep` needs keep − 7 … keep − 1)
        assert cache.reusable_prefix(N, N) == N and cache.reusable_prefix(N - 5, N) == N - 5
        assert cache.reusable_prefix(N - 6, N) == 0


@pytest.mark.llama
def test_ring_equals_llama_cpp(synth_model, monkeypatch):
    """The ring (12 rows for the window of 8) against llama.cpp's full-size SWA cache: ≤ 1e-4, prompt and decode."""
    from engine import kv_layout

    pytest.importorskip("llama_cpp")
    m = synth_model("gpt-oss", "F32")
    toks = random_tokens(N, 1024, seed=3)
    want = llama_logits(m.path, toks)
    monkeypatch.setattr(kv_layout, "KV_WINDOW_SLACK", 4)
    with open_gguf(m.path) as gf:
        model = build_model(gf)
        pre = _forward(model, toks)
        cache = model.new_cache(64)
        dec = np.concatenate([model.forward([t], i, cache).numpy() for i, t in enumerate(toks)])
    assert np.abs(pre - want).max() <= 1e-4 and np.abs(dec - want).max() <= 1e-4


def test_planner_prices_the_ring_and_mxfp4(synth_geometry):
    """gpt-oss-120b at 4096 and 32768 positions: the 18 sliding layers' K/V is priced at 128 + 256 positions, the
    18 global ones' at the context; one expert's gate is 2880·2880 MXFP4 elements (17 bytes per 32)."""
    from engine.kv_layout import KV_WINDOW_SLACK, kv_layer_bytes
    from engine.plan.sizing import cache_bytes, layer_cache_bytes
    from engine.plan.spec import ModelSpec

    g = synth_geometry("gpt-oss-120b")
    with open_gguf(g.path) as gf:
        spec = ModelSpec.from_gguf(gf)
    assert [lay.kv_window for lay in spec.layers[:4]] == [128, 0, 128, 0]
    assert spec.layers[0].expert_role_bytes["gate"] == 2880 * 2880 // 32 * 17
    ring = kv_layer_bytes("bf16", 512, 128 + KV_WINDOW_SLACK)
    for ctx in (4096, 32768):
        assert layer_cache_bytes(spec, 0, "bf16", ctx) == ring
        assert layer_cache_bytes(spec, 1, "bf16", ctx) == kv_layer_bytes("bf16", 512, ctx)
        assert cache_bytes(spec, range(36), "bf16", ctx) == 18 * ring + 18 * kv_layer_bytes("bf16", 512, ctx)


def test_every_placement_with_the_ring_matches_the_cpu_engine(tmp_path, monkeypatch):
    """tests/test_runtime.py's placements (cpu, cache, resident, n_cpu_moe, streamed, splits) with the sliding
    layers' K/V in a ring (slack 4: 12 rows of the 64-position context): the CPU engine's logits, and the runtime
    allocates what the planner priced, kind by kind."""
    from dataclasses import replace

    from engine import kv_layout
    from engine.plan import PlanRequest
    from engine.synth.writer import write_model
    from tests.test_runtime import CTX, STREAM_MIN, _cases, _profile_for, _run, _session

    monkeypatch.setattr(kv_layout, "KV_WINDOW_SLACK", 4)
    path = write_model(tmp_path / "g.gguf", "gpt-oss", seed=3, layers=3).path
    tokens = random_tokens(20, 1024, seed=1)
    with _session(path) as s:
        assert set(s.cache.rings) == {0, 2}
        ref_prefill, ref_decode = _run(s, tokens)
        for label, req, g, slots in _cases(s):
            placement = s.plan(PlanRequest(ctx=CTX, kv_type="f32", **req), _profile_for(s, n_gpu_layers=g, slots=slots))
            streamed = label.startswith("stream")
            s.apply(placement, replace(s.engine_options, prompt_stream_min=STREAM_MIN) if streamed else None)
            prefill, decode = _run(s, tokens)
            assert np.abs(prefill - ref_prefill).max() <= 1e-5, label
            assert np.abs(decode - ref_decode).max() <= 1e-5, label
            priced = placement.device.to_dict()
            priced.pop("total")
            assert dict(s.applied.arena.by_kind) == {
                k: v for k, v in priced.items() if v or k in s.applied.arena.by_kind
            }
