"""Prefill on the bf16 matrix units (engine.kernels.bf16): exact dequantization, the products
against a float64 model of bf16 rounding, the grouped experts with both paths mixed, and a model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.api import LoadOptions, Session
from engine.kernels import bf16
from engine.kernels.grouped import grouped_moe_ffn
from engine.kernels.moe import moe_ffn
from engine.kernels.prepare import prepare_weight
from engine.kernels.testing import random_weight
from engine.quant import dequantize
from engine.synth.writer import write_model
from tests.oracle import random_tokens


def _bf(a: np.ndarray) -> np.ndarray:
    """float64 values of ``a`` rounded to bf16 (nearest even), the rounding oneDNN applies."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).double().numpy()


@pytest.mark.parametrize("qtype", bf16.TYPES, ids=lambda q: q.name)
def test_dequant_rows_equal_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_weight(qtype, (3, 37, 512), rng)  # stacked experts; awkward row ranges
    w = prepare_weight(qtype, raw)
    full = dequantize(raw, qtype).reshape(3 * 37, 512)
    for r0, r1 in [(0, 111), (36, 75), (5, 6)]:
        np.testing.assert_array_equal(bf16.dequant_rows(w, r0, r1), full[r0:r1])


@pytest.mark.parametrize("qtype", bf16.PREFILL_TYPES, ids=lambda q: q.name)
def test_matmul_is_bf16_products_with_f32_accumulation(qtype, monkeypatch):
    monkeypatch.setattr(bf16, "ROW_BLOCK", 48)  # several row blocks and a partial one
    rng = np.random.default_rng(3)
    raw = random_weight(qtype, (130, 768), rng)
    X = rng.standard_normal((33, 768), dtype=np.float32) * 3
    got = bf16.matmul(prepare_weight(qtype, raw), X)
    Xb, Wb = _bf(X), _bf(dequantize(raw, qtype))
    want = Xb @ Wb.T
    scale = np.abs(Xb) @ np.abs(Wb).T
    assert np.abs(got - want).max() <= 2e-6 * scale.max()
    # and bf16 rounding is all that separates it from exact float products
    exact = X.astype(np.float64) @ dequantize(raw, qtype).astype(np.float64).T
    assert np.abs(got - exact).max() <= 2e-2 * scale.max()


def test_grouped_mixes_bf16_and_integer_experts(monkeypatch):
    """Experts with ≥ MIN_TOKENS tokens go through bf16, the rest through the q8 kernels; each
    pair's output equals its path's model and the top-k sum is taken in order."""
    from engine.quant.formats import QType

    monkeypatch.setattr(bf16, "ENABLED", True)
    monkeypatch.setattr(bf16, "MIN_TOKENS", 6)
    rng = np.random.default_rng(5)
    E, F, D, T, K = 5, 256, 512, 12, 2
    gate, up = (prepare_weight(QType.Q4_K, random_weight(QType.Q4_K, (E, F, D), rng)) for _ in range(2))
    down = prepare_weight(QType.Q5_K, random_weight(QType.Q5_K, (E, D, F), rng))
    ids = np.stack([rng.choice(E, K, replace=False, p=[0.45, 0.35, 0.1, 0.05, 0.05]) for _ in range(T)])
    w = rng.random((T, K), dtype=np.float32)
    X = rng.standard_normal((T, D), dtype=np.float32)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert (counts >= 6).any() and ((counts > 0) & (counts < 6)).any()  # both paths run
    got = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True)
    G, U, Dn = (dequantize(m.raw, m.qtype).reshape(E, -1, m.n) for m in (gate, up, down))
    want = np.zeros((T, D))
    tol = np.zeros((T, D))
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            if counts[e] >= 6:
                x = _bf(X[t])
                g, u = _bf(G[e]) @ x, _bf(U[e]) @ x
                h = g / (1 + np.exp(-g)) * u
                o = _bf(Dn[e]) @ _bf(h)
                tol[t] += abs(w[t, k]) * (np.abs(_bf(Dn[e])) @ np.abs(_bf(h))) * 1e-4
            else:  # the q8 kernels' own output for this pair, exactly
                o = moe_ffn(gate, up, down, X[t], np.array([e]), np.array([1.0], np.float32), q8_act=True)
                tol[t] += 1e-6 * np.abs(o)
            want[t] += w[t, k] * o.astype(np.float64)
    assert (np.abs(got - want) <= tol + 1e-6).all()


def test_model_prefill_on_bf16_agrees_with_q8_kernels(tmp_path, monkeypatch):
    """A quantized model's prompt logits through the bf16 units stay close to the q8 kernels'
    (both are roundings of the same products) and pick the same tokens."""
    path = write_model(tmp_path / "m.gguf", "qwen3moe", seed=8, layers=2, weight_type="Q4_K").path
    tokens = random_tokens(48, 1024, seed=5)
    out = {}
    for enabled in (False, True):
        monkeypatch.setattr(bf16, "ENABLED", enabled)
        monkeypatch.setattr(bf16, "MIN_TOKENS", 8)
        with Session.load(str(path), LoadOptions(n_ctx=64, device="cpu")) as s:
            out[enabled] = s.logits(tokens, batch=True)
    a, b = out[False], out[True]
    assert not np.array_equal(a, b)  # the bf16 path really ran
    assert np.abs(a - b).mean() <= 0.05 * np.abs(a).mean()
    assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() >= 0.90  # as the exact-float mode vs llama.cpp
