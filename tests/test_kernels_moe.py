"""Routed-expert entry point: moe_ffn over stacked [E, out, in] tensors."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import reference as ref
from engine.kernels.dispatch import matmul, matvec
from engine.kernels.moe import moe_ffn, silu_mul
from engine.kernels.prepare import prepare_weight
from engine.quant import QType, quantize

E, F, D, K = 6, 256, 512, 3

CASES = [
    (QType.Q4_K, QType.Q4_K, QType.Q6_K),  # a Q4_K_M file's mix
    (QType.Q4_K, QType.Q4_K, QType.Q4_K),  # all Q4_K: the down rows in pairs too
    (QType.Q8_0, QType.Q8_0, QType.Q8_0),
    (QType.Q5_0, QType.Q5_K, QType.F16),  # mixed: the 3-call path
    (QType.Q4_0, QType.Q4_0, QType.Q5_K),
    (QType.Q5_K, QType.Q5_K, QType.Q5_0),
    (QType.MXFP4, QType.MXFP4, QType.MXFP4),  # gpt-oss's experts
    (QType.Q3_K, QType.Q3_K, QType.Q3_K),
    (QType.Q3_K, QType.Q3_K, QType.Q6_K),  # a Q3_K_M-like mix
    (QType.Q2_K, QType.Q2_K, QType.Q2_K),
    (QType.Q2_K, QType.Q2_K, QType.Q3_K),  # a Q2_K file's mix
    (QType.IQ4_NL, QType.IQ4_NL, QType.IQ4_NL),
    (QType.IQ4_XS, QType.IQ4_XS, QType.IQ4_XS),
    (QType.IQ4_XS, QType.IQ4_XS, QType.IQ4_NL),  # the two activation families in one layer
    (QType.IQ2_XXS, QType.IQ2_XXS, QType.IQ2_XXS),
    (QType.IQ3_XXS, QType.IQ3_XXS, QType.IQ3_XXS),
    (QType.IQ3_S, QType.IQ3_S, QType.IQ3_S),
    (QType.IQ2_XS, QType.IQ2_XS, QType.IQ2_S),
    (QType.IQ2_S, QType.IQ2_S, QType.IQ4_NL),  # a "UD" mix: the two activation families
    (QType.IQ3_XXS, QType.IQ3_XXS, QType.Q4_K),
]


def stacks(qtypes, rng):
    raws = [
        quantize(rng.standard_normal((E, F, D), dtype=np.float32) * 0.05, qtypes[0]),
        quantize(rng.standard_normal((E, F, D), dtype=np.float32) * 0.05, qtypes[1]),
        quantize(rng.standard_normal((E, D, F), dtype=np.float32) * 0.05, qtypes[2]),
    ]
    return raws, [prepare_weight(q, r) for q, r in zip(qtypes, raws)]


@pytest.mark.parametrize("qtypes", CASES, ids=lambda c: "-".join(q.name for q in c))
@pytest.mark.parametrize("q8_act", [False, True], ids=["exact", "q8"])
def test_moe_equals_per_expert_composition(qtypes, q8_act):
    """One gather call per matrix computes exactly what per-expert matvecs compute."""
    rng = np.random.default_rng(20)
    raws, (g, u, d) = stacks(qtypes, rng)
    x = rng.standard_normal(D, dtype=np.float32)
    ids = np.array([5, 0, 3])
    wts = np.array([0.5, 0.3, 0.2], np.float32)
    y = moe_ffn(g, u, d, x, ids, wts, q8_act=q8_act)
    expect = np.zeros(D, np.float32)
    for e, wk in zip(ids, wts):
        ge = matvec(prepare_weight(qtypes[0], raws[0][e]), x, q8_act=q8_act)
        ue = matvec(prepare_weight(qtypes[1], raws[1][e]), x, q8_act=q8_act)
        expect += wk * matvec(prepare_weight(qtypes[2], raws[2][e]), silu_mul(ge[:, None], ue[:, None]), q8_act=q8_act)
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtypes", CASES, ids=lambda c: "-".join(q.name for q in c))
def test_moe_against_numpy_reference(qtypes):
    rng = np.random.default_rng(21)
    raws, (g, u, d) = stacks(qtypes, rng)
    x = rng.standard_normal(D, dtype=np.float32)
    ids = np.array([1, 4, 2])
    wts = np.array([0.6, 0.25, 0.15], np.float32)
    scale = np.abs(ref.moe_ffn_ref(qtypes, *raws, x, ids, wts, q8_act=False)).max()
    y = moe_ffn(g, u, d, x, ids, wts, q8_act=False)
    np.testing.assert_allclose(y, ref.moe_ffn_ref(qtypes, *raws, x, ids, wts, q8_act=False), atol=1e-5 * scale)
    # q8: h is re-quantized between the layers, so a last-bit difference in h may move a code
    y8 = moe_ffn(g, u, d, x, ids, wts, q8_act=True)
    r8 = ref.moe_ffn_ref(qtypes, *raws, x, ids, wts, q8_act=True)
    assert np.abs(y8 - r8).mean() <= 1e-4 * scale
    assert np.abs(y8 - r8).max() <= 1e-2 * scale


@pytest.mark.parametrize("qtypes", CASES, ids=lambda c: "-".join(q.name for q in c))
def test_fused_path_equals_three_call_path(qtypes):
    rng = np.random.default_rng(23)
    _, (g, u, d) = stacks(qtypes, rng)
    x = rng.standard_normal(D, dtype=np.float32)
    ids = np.array([2, 5, 0])
    wts = np.array([0.5, 0.3, 0.2], np.float32)
    fused = moe_ffn(g, u, d, x, ids, wts, q8_act=True)
    plain = moe_ffn(g, u, d, x, ids, wts, q8_act=True, fused=False)
    np.testing.assert_allclose(fused, plain, rtol=1e-6, atol=1e-6 * np.abs(plain).max())


def test_moe_refuses_bad_ids():
    rng = np.random.default_rng(22)
    _, (g, u, d) = stacks(CASES[1], rng)
    x = np.ones(D, np.float32)
    with pytest.raises(IndexError):
        moe_ffn(g, u, d, x, np.array([0, E]), np.ones(2, np.float32), q8_act=True)
    with pytest.raises(ValueError):
        moe_ffn(g, u, d, np.ones(F, np.float32), np.array([0, 1]), np.ones(2, np.float32), q8_act=True)


def test_numpy_twins_take_the_same_arguments():
    """reference.*_numpy accept exactly what the kernels accept and agree with them."""
    rng = np.random.default_rng(24)
    _, (g, u, d) = stacks(CASES[0], rng)
    x = rng.standard_normal(D, dtype=np.float32)
    ids, wts = np.array([3, 1, 4]), np.array([0.5, 0.25, 0.25], np.float32)
    y = moe_ffn(g, u, d, x, ids, wts, q8_act=False)
    np.testing.assert_allclose(ref.moe_ffn_numpy(g, u, d, x, ids, wts, q8_act=False), y, atol=1e-5 * np.abs(y).max())
    X = rng.standard_normal((3, D), dtype=np.float32)
    np.testing.assert_allclose(ref.matmul_numpy(g, X, q8_act=True), matmul(g, X, q8_act=True), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        ref.matvec_numpy(d, X[0][:F], q8_act=False), matvec(d, X[0][:F], q8_act=False), rtol=1e-4, atol=1e-4
    )


def test_q4_k_row_pairs_equal_single_rows():
    """kquants._dot2_q4_k_q8 (two rows on one activation load, used by the fused expert kernels)
    gives each row's single-row dot exactly."""
    from numba import njit

    from engine.kernels.activations import quantize_q8_K
    from engine.kernels.kquants import _dot2_q4_k_q8, _dot_q4_k_q8

    @njit
    def both(raw, s, qa, da, bs):
        R = raw.shape[0]
        one = np.empty(R, np.float32)
        two = np.empty(R, np.float32)
        for r in range(R):
            one[r] = _dot_q4_k_q8(raw[r], s[r], qa[0], da[0], bs[0])
        for r in range(0, R, 2):
            two[r], two[r + 1] = _dot2_q4_k_q8(raw[r], s[r], raw[r + 1], s[r + 1], qa[0], da[0], bs[0])
        return one, two

    rng = np.random.default_rng(25)
    w = prepare_weight(QType.Q4_K, quantize(rng.standard_normal((16, 768), dtype=np.float32), QType.Q4_K))
    qa, da, bs = quantize_q8_K(rng.standard_normal((1, 768), dtype=np.float32))
    one, two = both(w.raw, w.scales, qa, da, bs)
    assert np.abs(one).max() > 0
    np.testing.assert_array_equal(one, two)
