"""CPU kernels, Q8-activation variant: activation rounding and integer dot products vs numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from engine.kernels import reference as ref
from engine.kernels import simd
from engine.kernels.activations import quantize_q8_0, quantize_q8_K, round_f16
from engine.kernels.dispatch import matmul, matvec
from engine.kernels.prepare import prepare_weight
from engine.kernels.testing import random_weight
from engine.quant import WEIGHT_TYPES, QType, dequantize
from engine.quant.iquants import IQ_TYPES

ALL = list(WEIGHT_TYPES)
K_QUANTS = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, *IQ_TYPES)  # rows of 256


def awkward_activations(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    """Normal values plus blocks that hit rounding ties, a zero block and a lone spike."""
    X = rng.standard_normal((T, n), dtype=np.float32)
    X[0, :32] = np.arange(-16, 16, dtype=np.float32) + 0.5  # q8_0 ties once scaled...
    X[0, 31] = 127.0  # ...by exactly 1 (amax 127)
    if T > 1:
        X[1, : min(n, 256)] = 0.0  # all-zero block: d = 0
    X[-1, -1] = -50.0  # largest magnitude negative: q8_K's negative max
    return X


def test_round_f16_matches_numpy():
    rng = np.random.default_rng(10)
    v = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-9, 5, 5000),
            np.float32([0.0, 6.0e-8, 2.98e-8, 2.9802322e-08, 65504.0, 65519.99, 65520.0, 1e9, 2.0**-14, 1 + 2**-11]),
        ]
    ).astype(np.float32)
    got = np.array([round_f16(x) for x in v], np.float32)
    with np.errstate(over="ignore"):  # 65520 and 1e9 overflow to inf, as they should
        expect = v.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("T,n", [(1, 32), (3, 256), (17, 2816)])
def test_quantize_q8_0_equals_reference(T, n):
    X = awkward_activations(np.random.default_rng(11), T, n)
    qa, da, asum = quantize_q8_0(X)
    rq, rd = ref.quantize_q8_0_ref(X)
    np.testing.assert_array_equal(qa, rq)
    np.testing.assert_array_equal(da, rd)
    np.testing.assert_array_equal(asum, rq.reshape(T, -1, 32).astype(np.int64).sum(-1))
    assert qa.min() >= -127  # the sign trick in the kernels relies on this


@pytest.mark.parametrize("T,n", [(1, 256), (3, 512), (17, 2816)])
def test_quantize_q8_K_equals_reference(T, n):
    X = awkward_activations(np.random.default_rng(12), T, n)
    qa, da, bs = quantize_q8_K(X)
    rq, rd, rb = ref.quantize_q8_K_ref(X)
    np.testing.assert_array_equal(qa, rq)
    np.testing.assert_array_equal(da, rd)
    np.testing.assert_array_equal(bs, rb)
    assert qa.min() >= -127


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_block_with_a_nan_or_inf_quantizes_to_a_nan_scale(bad):
    """Such a block's scale is NaN and its codes 0 (kernel = reference), so it cannot round into finite codes
    (nor divide by zero: an infinite max made q8_K's 1/iscale raise ZeroDivisionError); the other blocks
    are unchanged."""
    X = awkward_activations(np.random.default_rng(13), 3, 512)
    X[1, 300] = bad
    clean = X.copy()
    clean[1, 256:] = 0
    for quant, reference, per in (
        (quantize_q8_0, ref.quantize_q8_0_ref, 32),
        (quantize_q8_K, ref.quantize_q8_K_ref, 256),
    ):
        got, want, ok = quant(X), reference(X), quant(clean)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g[..., : w.shape[-1]], w)  # q8_0's asum is the kernel's alone
        qa, da = got[0], got[1]
        blk = 300 // per
        assert np.isnan(da[1, blk]) and np.isfinite(np.delete(da, blk, axis=1)).all() and np.isfinite(da[[0, 2]]).all()
        assert not qa[1, blk * per : (blk + 1) * per].any()
        np.testing.assert_array_equal(np.delete(da, blk, axis=1)[[0, 2]], np.delete(ok[1], blk, axis=1)[[0, 2]])


def test_q8_K_reference_follows_ggml_conventions():
    """Hand-checked facts of quantize_row_q8_K_ref: negative scale, ties to even, bsums."""
    x = np.zeros(256, np.float32)
    x[0] = 2.0  # max: iscale = -127/2
    x[1] = 1.0 / 127.0  # -0.5 exactly after scaling by -63.5 → ties to even: -0 → 0
    x[2] = 3.0 / 127.0  # -1.5 → -2
    q, d, bs = ref.quantize_q8_K_ref(x[None])
    assert d[0, 0] == np.float32(1.0) / np.float32(-63.5)
    assert q[0, 0] == -127 and q[0, 1] == 0 and q[0, 2] == -2
    assert bs[0, 0] == -129 and np.all(bs[0, 1:] == 0)


def check_close(y, Y_ref, W, Xq, rtol=2e-5):
    """|y − ref| ≤ rtol·(|W|·|x̂|) with x̂ the rounded activations the dot actually uses."""
    bound = rtol * (np.abs(Xq).astype(np.float64) @ np.abs(W).T) + 1e-30
    err = np.abs(y.astype(np.float64) - Y_ref.astype(np.float64))
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


def rounded_activations(qtype: QType, X: np.ndarray) -> np.ndarray:
    """The activations as the q8 dot sees them, in float64 (for the error bound)."""
    if qtype in (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.MXFP4, QType.IQ4_NL):
        q, d = ref.quantize_q8_0_ref(X)
        return q.reshape(len(X), -1, 32) * d[..., None].astype(np.float64)
    if qtype in K_QUANTS:
        q, d, _ = ref.quantize_q8_K_ref(X)
        return q.reshape(len(X), -1, 256) * d[..., None].astype(np.float64)
    return X.astype(np.float64)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_matvec_matmul_q8(qtype):
    rng = np.random.default_rng(13)
    small = 256 if qtype in K_QUANTS else 32
    for rows, n in [(1, small), (7, 2816), (129, 512)]:
        raw = random_weight(qtype, (rows, n), rng)
        w = prepare_weight(qtype, raw)
        W = dequantize(raw, qtype).astype(np.float64)
        for T in (1, 3, 17):
            X = awkward_activations(rng, T, n)
            Y = matmul(w, X, q8_act=True)
            Xq = rounded_activations(qtype, X).reshape(T, n)
            check_close(Y, ref.matmul_ref(qtype, raw, X, q8_act=True), W, Xq)
            # prefill decodes 4 tokens per weight block: still bit-identical to token-by-token decode
            # (grouped prefill relies on it)
            np.testing.assert_array_equal(Y, np.stack([matvec(w, x, q8_act=True) for x in X]))
        # the rounding is what llama.cpp does, not noise: q8 and exact differ, but only a little
        x = rng.standard_normal(n, dtype=np.float32)
        exact = W @ x.astype(np.float64)
        diff = np.abs(matvec(w, x, q8_act=True) - exact)
        assert np.max(diff) <= 0.05 * (np.abs(W) @ np.abs(x)).max()


def test_q8_reference_independent_of_unpack():
    """The integer-dot reference equals dequantized-weights × dequantized-activations."""
    rng = np.random.default_rng(14)
    for qtype in (QType.Q4_0, QType.Q2_K, QType.Q3_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, *IQ_TYPES):
        raw = random_weight(qtype, (5, 512), rng)
        X = rng.standard_normal((2, 512), dtype=np.float32)
        Xq = rounded_activations(qtype, X).reshape(2, 512)
        expect = Xq @ dequantize(raw, qtype).astype(np.float64).T
        np.testing.assert_allclose(ref.matmul_ref(qtype, raw, X, q8_act=True), expect, rtol=1e-5, atol=1e-6)


@njit(cache=False)
def _both_paths(a, b, c):
    x = simd.load_i8x32(a, 0)
    y = simd.load_i8x32(b, 0)
    p16 = simd.load_i16x16(c, 0)
    fast = simd.hsum_i32(simd.madd(simd.maddubs(x, y), p16))
    slow = simd.hsum_i32(simd.madd_generic(simd.maddubs_generic(x, y), p16))
    return fast, slow


def test_generic_simd_fallback_matches_native():
    """The plain-IR fallback used on CPUs without AVX2 computes what pmaddubsw/pmaddwd do."""
    rng = np.random.default_rng(15)
    for _ in range(20):
        a = rng.integers(0, 256, 32).astype(np.uint8)
        b = rng.integers(-128, 128, 32).astype(np.int8)
        c = rng.integers(-300, 300, 16).astype(np.int16)
        fast, slow = _both_paths(a, b, c)
        assert fast == slow


@njit(cache=False)
def _vnni_steps(u, s, p, q):
    x, y = simd.load_i8x32(u, 0), simd.load_i8x32(s, 0)
    a16, b16 = simd.load_i16x16(p, 0), simd.load_i16x16(q, 0)
    base = simd.madd(simd.maddubs(x, y), simd.splat16(1))  # a nonzero accumulator
    got = (
        simd.hsum_i32(simd.madd_acc(base, a16, b16)),
        simd.hsum_i32(simd.dot_ub_sb(base, x, y)),
        simd.hsum_i32(simd.dot_sb_sb(base, y, y)),
    )
    want = (
        simd.hsum_i32(simd.vadd(base, simd.madd(a16, b16))),
        simd.hsum_i32(simd.vadd(base, simd.madd(simd.maddubs(x, y), simd.splat16(1)))),
        simd.hsum_i32(simd.vadd(base, simd.madd(simd.maddss(y, y), simd.splat16(1)))),
    )
    return got, want


def test_vnni_switch_reaches_the_compiler():
    """SHARPI_NO_VNNI=1 (tests/suite.sh's masked run) compiles for the CPU without VNNI: no VNNI
    steps from simd and none from LLVM, and numba caches those builds apart from the VNNI ones (its
    cache key holds the feature string, not the switch)."""
    from numba.core.registry import cpu_target

    from engine import config

    compiled_for = cpu_target.target_context.codegen()._get_host_cpu_features()
    if config.current().vnni:
        cpu_has = bool(simd.HAS_AVX2 and {"+avxvnni", "+avx512vnni"} & set(simd._FEATURES))
        assert cpu_has == simd.HAS_VNNI
    else:
        assert not simd.HAS_VNNI
        assert "+avx512vnni" not in compiled_for.split(",") and "+avxvnni" not in compiled_for.split(",")


@pytest.mark.parametrize("vnni", [simd.HAS_VNNI], ids=lambda v: f"vnni={v}")
def test_fused_dot_steps_equal_their_compositions(vnni):
    """madd_acc / dot_ub_sb / dot_sb_sb (vpdpwssd / vpdpbusd where the CPU has VNNI) equal the
    pmaddwd / pmaddubsw compositions they replace, lane sums included, over the code ranges the
    kernels feed them (unsigned codes ≤ 128, activations in [-127, 127])."""
    rng = np.random.default_rng(16)
    for _ in range(50):
        u = rng.integers(0, 129, 32).astype(np.uint8)
        s = rng.integers(-127, 128, 32).astype(np.int8)
        p = rng.integers(-32768, 32768, 16).astype(np.int16)
        q = rng.integers(-32768, 32768, 16).astype(np.int16)
        got, want = _vnni_steps(u, s, p, q)
        assert got == want
