"""Prefill on the bf16 units (engine.kernels.bf16): exact dequantization, the products of each mode
against a float64 model of its rounding (chosen from what oneDNN does on this CPU, so both modes
run and are checked on every x86-64 processor), the grouped experts with both paths mixed, and a
model."""

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


def _mm_model(mode: str, X: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float64 model of ``bf16.mm(X, W)`` in ``mode``, the bound of its float32 summation) for
    float32 X [T, n], W [R, n]. FPMATH rounds the inputs only where oneDNN does (AMX); elsewhere it
    is a float32 product. BF16 rounds the inputs, sums in float32 and rounds the result to bf16."""
    if mode == bf16.FPMATH and not bf16.fpmath_rounds():
        Xb, Wb = X.astype(np.float64), W.astype(np.float64)
    else:
        Xb, Wb = _bf(X), _bf(W)
    want = Xb @ Wb.T
    tol = 2e-6 * (np.abs(Xb) @ np.abs(Wb).T).max()
    if mode == bf16.BF16:
        # the float32 sum (its order is the kernel's) may cross a bf16 rounding edge: one bf16 step, ≤ |want| · 2^-7
        return _bf(want), tol + np.abs(want) * 2.0**-7
    return want, np.full_like(want, tol)


def test_fpmath_probe_matches_what_onednn_does():
    """fpmath_rounds() agrees with a bigger product: rounded inputs exactly where it says so."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((17, 300), dtype=np.float32)
    W = rng.standard_normal((40, 300), dtype=np.float32)
    with bf16.bf16_products():
        got = (torch.from_numpy(X) @ torch.from_numpy(W).T).double().numpy()
    exact = X.astype(np.float64) @ W.astype(np.float64).T
    rounded = _bf(X) @ _bf(W).T
    assert (np.abs(got - rounded).max() < np.abs(got - exact).max()) == bf16.fpmath_rounds()


@pytest.mark.parametrize("flag, want", [("0", "off"), ("fpmath", "fpmath"), ("bf16", "bf16"), ("BF16 ", "bf16")])
def test_mode_flag(flag, want):
    assert bf16.detect_mode(flag) == want


def test_mode_by_cpu(monkeypatch):
    """AMX-like rounding picks FPMATH; AVX512-BF16 without it picks BF16; no bf16 units, OFF (or BF16
    when forced with "1")."""
    monkeypatch.setattr(bf16, "fpmath_rounds", lambda: True)
    assert bf16.detect_mode("") == bf16.FPMATH
    monkeypatch.setattr(bf16, "fpmath_rounds", lambda: False)
    monkeypatch.setattr(bf16, "_cpu_features", lambda: {"+avx512f", "+avx512bf16"})
    assert bf16.detect_mode("auto") == bf16.BF16
    monkeypatch.setattr(bf16, "_cpu_features", lambda: {"+avx2"})
    assert bf16.detect_mode("") == bf16.OFF and bf16.detect_mode("1") == bf16.BF16
    with pytest.raises(ValueError, match="SHARPI_BF16"):
        bf16.detect_mode("yes")


@pytest.mark.parametrize("mode", [bf16.FPMATH, bf16.BF16])
@pytest.mark.parametrize("qtype", bf16.PREFILL_TYPES, ids=lambda q: q.name)
def test_matmul_is_bf16_products_with_f32_accumulation(qtype, mode, monkeypatch):
    monkeypatch.setattr(bf16, "MODE", mode)
    monkeypatch.setattr(bf16, "ROW_BLOCK", 48)  # several row blocks and a partial one
    rng = np.random.default_rng(3)
    raw = random_weight(qtype, (130, 768), rng)
    X = rng.standard_normal((33, 768), dtype=np.float32) * 3
    got = bf16.matmul(prepare_weight(qtype, raw), X)
    W = dequantize(raw, qtype)
    want, tol = _mm_model(mode, X, W)
    assert (np.abs(got - want) <= tol).all(), np.abs(got - want).max()
    # and bf16 rounding is all that separates it from exact float products
    exact = X.astype(np.float64) @ W.astype(np.float64).T
    assert np.abs(got - exact).max() <= 2e-2 * (np.abs(X) @ np.abs(W).T).max()


@pytest.mark.parametrize("mode", [bf16.FPMATH, bf16.BF16])
def test_grouped_mixes_bf16_and_integer_experts(mode, monkeypatch):
    """Experts with ≥ MIN_TOKENS tokens go through bf16, the rest through the q8 kernels; each
    pair's output equals its path's model and the top-k sum is taken in order."""
    from engine.quant.formats import QType

    monkeypatch.setattr(bf16, "MODE", mode)
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
                gu, _ = _mm_model(mode, X[t : t + 1], np.concatenate([G[e], U[e]]))
                g, u = gu.reshape(2, -1)
                h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
                o = _mm_model(mode, h[None, :], Dn[e])[0][0]
                # float32 sums (FPMATH); BF16 also rounds g, u and o, so h may differ by a bf16 step
                rel = 1e-4 if mode == bf16.FPMATH else 2.0**-8
                tol[t] += abs(w[t, k]) * ((np.abs(_bf(Dn[e])) @ np.abs(_bf(h))) * rel + np.abs(o) * rel)
            else:  # the q8 kernels' own output for this pair, exactly
                o = moe_ffn(gate, up, down, X[t], np.array([e]), np.array([1.0], np.float32), q8_act=True)
                tol[t] += 1e-6 * np.abs(o)
            want[t] += w[t, k] * o.astype(np.float64)
    assert (np.abs(got - want) <= tol + 1e-6).all()


@pytest.mark.parametrize("mode", [bf16.FPMATH, bf16.BF16])
def test_model_prefill_on_bf16_agrees_with_q8_kernels(tmp_path, monkeypatch, mode):
    """A quantized model's prompt logits through the bf16 units stay close to the q8 kernels'
    (both are roundings of the same products) and pick the same tokens."""
    path = write_model(tmp_path / "m.gguf", "qwen3moe", seed=8, layers=2, weight_type="Q4_K").path
    tokens = random_tokens(48, 1024, seed=5)
    out = {}
    for m in (bf16.OFF, mode):
        monkeypatch.setattr(bf16, "MODE", m)
        monkeypatch.setattr(bf16, "MIN_TOKENS", 8)
        with Session.load(str(path), LoadOptions(n_ctx=64, device="cpu")) as s:
            out[m] = s.logits(tokens, batch=True)
    a, b = out[bf16.OFF], out[mode]
    assert not np.array_equal(a, b)  # the bf16 path really ran
    assert np.abs(a - b).mean() <= 0.05 * np.abs(a).mean()
    assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() >= 0.90  # as the exact-float mode vs llama.cpp
