"""CPU kernels, exact-float variant: every weight type against float64 dequantize(W) @ x."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import reference as ref
from engine.kernels.dispatch import gemv_rows, matmul, matvec
from engine.kernels.prepare import prepare_weight
from engine.kernels.testing import random_weight
from engine.quant import WEIGHT_TYPES, QType, dequantize, quantize
from engine.quant.iquants import IQ_TYPES

ALL = list(WEIGHT_TYPES)
K_QUANTS = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, *IQ_TYPES)  # rows of 256


def smallest_n(q: QType) -> int:
    return 256 if q in K_QUANTS else 32


def check_close(y: np.ndarray, W: np.ndarray, X: np.ndarray, rtol: float = 1e-5):
    """|y − W·x| ≤ rtol · (|W|·|x|) element-wise, with W, X in float64. y [T, R], X [T, n]."""
    exact = X.astype(np.float64) @ W.T
    bound = rtol * (np.abs(X.astype(np.float64)) @ np.abs(W).T) + 1e-30
    err = np.abs(y.astype(np.float64) - exact)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_unpack_matches_independent_dequantizer(qtype):
    """Our integer decoding of the blocks (the reference model's basis) equals engine.quant."""
    rng = np.random.default_rng(1)
    raw = random_weight(qtype, (5, 2 * smallest_n(qtype)), rng)
    np.testing.assert_array_equal(ref.dequantize_ref(qtype, raw), dequantize(raw, qtype).astype(np.float64))


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_matvec_matmul_exact(qtype):
    rng = np.random.default_rng(2)
    for rows, n in [(1, smallest_n(qtype)), (7, 2816 if qtype not in K_QUANTS else 2816), (129, 512)]:
        raw = random_weight(qtype, (rows, n), rng)
        w = prepare_weight(qtype, raw)
        W = dequantize(raw, qtype).astype(np.float64)
        x = rng.standard_normal(n, dtype=np.float32)
        y = matvec(w, x, q8_act=False)
        assert y.shape == (rows,) and y.dtype == np.float32
        check_close(y[None], W, x[None])
        for T in (1, 3, 17):
            X = rng.standard_normal((T, n), dtype=np.float32)
            Y = matmul(w, X, q8_act=False)
            assert Y.shape == (T, rows) and Y.dtype == np.float32
            check_close(Y, W, X)
            # matvec and matmul are the same computation token by token
            np.testing.assert_allclose(Y[-1], matvec(w, X[-1], q8_act=False), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_exact_on_quantized_real_values(qtype):
    """Weights from engine.quant.quantize (realistic codes) and the numpy reference agree."""
    rng = np.random.default_rng(3)
    n = 512
    raw = quantize(rng.standard_normal((33, n), dtype=np.float32) * 0.05, qtype)
    x = rng.standard_normal(n, dtype=np.float32)
    y = matvec(prepare_weight(qtype, raw), x, q8_act=False)
    np.testing.assert_allclose(y, ref.matvec_ref(qtype, raw, x, q8_act=False), rtol=1e-4, atol=1e-5)


def test_f16_subnormal_inf_and_tail():
    """The bit-level fp16 decode handles subnormals, signed zeros and infinities, any n."""
    h = np.array([0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF, 0xFBFF, 0x8000, 0x0000, 0x3C00], np.uint16)
    W = h.view(np.float16).reshape(-1, 1)  # one value per row; n = 1 is all tail
    y = matvec(prepare_weight(QType.F16, W), np.ones(1, np.float32), q8_act=False)
    np.testing.assert_array_equal(y, W[:, 0].astype(np.float32))
    W40 = np.tile(h.view(np.float16)[:4], 10).reshape(1, 40)  # 32 lanes + a tail of 8
    y = matvec(prepare_weight(QType.F16, W40), np.ones(40, np.float32), q8_act=False)
    assert y[0] == np.float32(W40.astype(np.float64).sum())
    Wi = np.array([[np.inf, 1.0]], np.float16)
    assert np.isinf(matvec(prepare_weight(QType.F16, Wi), np.ones(2, np.float32), q8_act=False)[0])


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0, QType.F16], ids=lambda q: q.name)
def test_stacked_experts_gather(qtype):
    """gemv_rows over a stack [E, out, in] computes chosen experts' rows against chosen inputs."""
    rng = np.random.default_rng(4)
    E, F, n = 6, 9, 256
    raw = random_weight(qtype, (E, F, n), rng)
    w = prepare_weight(qtype, raw)
    assert w.shape == (E, F, n) and w.n_experts == 6 and w.rows == F
    ids = np.array([4, 1, 5])
    X = rng.standard_normal((3, n), dtype=np.float32)
    rows = (ids[:, None] * F + np.arange(F)).ravel()
    xi = np.repeat(np.arange(3), F)
    out = gemv_rows(w, X, rows, xi, q8_act=False)[:, 0].reshape(3, F)
    for k, e in enumerate(ids):
        check_close(out[k][None], dequantize(raw[e], qtype).astype(np.float64), X[k][None])


def test_prepare_is_zero_copy_and_rejects_bad_rows():
    from engine.errors import SharpIError

    rng = np.random.default_rng(5)
    raw = random_weight(QType.Q4_K, (4, 512), rng)
    w = prepare_weight(QType.Q4_K, raw)
    assert np.shares_memory(w.raw, raw) and not w.raw.flags.writeable
    assert w.scales.shape == (4, 4) and w.scales.dtype == np.float32
    with pytest.raises(SharpIError):
        prepare_weight(QType.Q4_K, raw[:, :100])
    with pytest.raises(SharpIError):
        prepare_weight(QType.Q4_K, raw, n=256)


def test_gather_refuses_out_of_range_indices():
    """The kernels do not bounds-check, so the public entry points must."""
    rng = np.random.default_rng(6)
    w = prepare_weight(QType.Q8_0, random_weight(QType.Q8_0, (4, 64), rng))
    X = np.ones((2, 64), np.float32)
    ok = np.array([0, 3])
    gemv_rows(w, X, ok, np.array([0, 1]), q8_act=True)
    with pytest.raises(IndexError):
        gemv_rows(w, X, np.array([0, 4]), np.array([0, 0]), q8_act=True)
    with pytest.raises(IndexError):
        gemv_rows(w, X, ok, np.array([0, -1]), q8_act=False)
    with pytest.raises(IndexError):
        gemv_rows(w, X, ok, np.array([0, 1]), T=2, q8_act=False)
    with pytest.raises(ValueError):
        gemv_rows(w, np.ones((2, 32), np.float32), ok, ok, q8_act=False)


@pytest.mark.parametrize("avx2", [True, False])
def test_mxfp4_code_lookup_both_ways(monkeypatch, avx2):
    """``lookups.load_mxfp4_codes``: one pshufb with AVX2, the e2m1 decoding in plain vector IR elsewhere —
    both give the 16 values of every nibble, low nibbles first (read back through the exact-float row dot
    on one-hot activations, compiled here after the patch)."""
    from numba import njit

    from engine.kernels import legacy, lookups, simd

    monkeypatch.setattr(simd, "HAS_AVX2", avx2 and simd.HAS_AVX2)
    dot = njit(legacy._dot_mxfp4_f.py_func)  # its inlined helpers are lowered again: the patched path
    qs = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    row = np.concatenate([[128], qs]).astype(np.uint8)  # e = 128: scale 1
    d = np.ones(1, np.float32)
    got = [dot(row, d, np.eye(32, dtype=np.float32)[i]) for i in range(32)]
    want = np.array(lookups.MXFP4_VALUES, np.float32)
    np.testing.assert_array_equal(got, np.concatenate([want, want[::-1]]))


@pytest.mark.parametrize("avx2", [True, False])
def test_iq4nl_code_lookup_both_ways(monkeypatch, avx2):
    """``lookups.load_iq4nl_codes``: one pshufb with AVX2, a select per level elsewhere — both give
    kvalues_iq4nl of every nibble, low nibbles first (through the IQ4_NL exact-float row dot on one-hot
    activations, compiled here after the patch)."""
    from numba import njit

    from engine.kernels import legacy, lookups, simd

    monkeypatch.setattr(simd, "HAS_AVX2", avx2 and simd.HAS_AVX2)
    dot = njit(legacy._dot_iq4_nl_f.py_func)
    qs = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    row = np.concatenate([np.array([1.0], "<f2").view(np.uint8), qs]).astype(np.uint8)  # d = 1
    d = np.ones(1, np.float32)
    got = [dot(row, d, np.eye(32, dtype=np.float32)[i]) for i in range(32)]
    want = np.array(lookups.IQ4NL_VALUES, np.float32)
    np.testing.assert_array_equal(got, np.concatenate([want, want[::-1]]))
