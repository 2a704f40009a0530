"""Exact-float GEMV kernels for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS: multiply by the exactly dequantized weights.

Gather signature as in ``engine.kernels.kquants``; activations are X float32 [K, n] and, for
Q4_K/Q5_K, Xs float32 [K, n/32] (sums of x over each 32-element sub-block) so that the mins cost
one multiply per sub-block: Σ (d·sc·q − dmin·m)·x = Σ_s d·sc_s·Σ q·x − dmin·Σ_s m_s·Xs_s (Q2_K: Xs
float32 [K, n/16], its sub-blocks' sums).
The integer codes are widened to float32 in registers; sub-block sums are lane-wise F32x8.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels import drivers
from engine.kernels.drivers import specialise
from engine.kernels.kquants import (
    _q2k_codes,
    _q3k_codes,
    _q3k_scales,
    _q4k_codes,
    _q5k_codes,
    _q6k_codes,
    _q6k_scales,
    iq4xs_scale,
    k2_scales,
)
from engine.kernels.lookups import load_iq4nl_codes
from engine.kernels.simd import (
    hsum_f32,
    i8_to_f32,
    i16_to_f32,
    k4_scales,
    lane16,
    load_f32x8,
    splat8,
    vadd,
    vfma,
    vfma_s,
    vsub,
    zero_f32,
)


@njit(cache=True, nogil=True, inline="always")
def _fdot32(q, x, xo):
    """Σ float(q)·x over 32 elements as F32x8 (q: I8x32, values < 128)."""
    t = vfma(i8_to_f32(q, 0), load_f32x8(x, xo), zero_f32())
    t = vfma(i8_to_f32(q, 1), load_f32x8(x, xo + 8), t)
    t = vfma(i8_to_f32(q, 2), load_f32x8(x, xo + 16), t)
    return vfma(i8_to_f32(q, 3), load_f32x8(x, xo + 24), t)


@njit(cache=True, nogil=True, inline="always")
def _fdot16x2(q, x, xo, sa, sb, acc):
    """acc + sa·Σ_{l<16} float(q_l)·x_l + sb·Σ_{16≤l<32} float(q_l)·x_l (Q6_K sub-blocks)."""
    ta = vfma(i8_to_f32(q, 1), load_f32x8(x, xo + 8), vfma(i8_to_f32(q, 0), load_f32x8(x, xo), zero_f32()))
    tb = vfma(i8_to_f32(q, 3), load_f32x8(x, xo + 24), vfma(i8_to_f32(q, 2), load_f32x8(x, xo + 16), zero_f32()))
    return vfma_s(tb, sb, vfma_s(ta, sa, acc))


# Several accumulators: one FMA chain per block would bound the loop by FMA latency.

# The templates' placeholders, bound per type by ``specialise`` (engine.kernels.drivers).
_BLOCK = _CODES = _SCALES = _BIAS = None


def _dot_k4_f(w, s, x, xs):
    """Exact-float row dot of a type with q4_K's scales and mins (Q4_K, Q5_K): blocks of _BLOCK bytes,
    codes _CODES."""
    acc_lo = zero_f32()
    acc_hi = zero_f32()
    acc_m = zero_f32()
    for b in range(s.shape[0] // 2):
        o = b * _BLOCK
        d = s[2 * b]
        sm = k4_scales(w, o + 4)
        acc_m = vfma_s(vfma(i16_to_f32(sm, 1), load_f32x8(xs, 8 * b), zero_f32()), -s[2 * b + 1], acc_m)
        for j in range(4):
            lo, hi = _CODES(w, o, j)
            xo = 256 * b + 64 * j
            acc_lo = vfma_s(_fdot32(lo, x, xo), d * np.float32(lane16(sm, 2 * j)), acc_lo)
            acc_hi = vfma_s(_fdot32(hi, x, xo + 32), d * np.float32(lane16(sm, 2 * j + 1)), acc_hi)
    return hsum_f32(vadd(vadd(acc_lo, acc_hi), acc_m))


@njit(cache=True, nogil=True, inline="always")
def _q6_quarter_f(q, x, xo, d, sc, g, acc):
    return _fdot16x2(q, x, xo, d * np.float32(lane16(sc, g)), d * np.float32(lane16(sc, g + 1)), acc)


def _dot_k16_f(w, s, x):
    """Exact-float row dot of a type with 16 signed sub-block scales (Q3_K, Q6_K): blocks of _BLOCK bytes,
    scales _SCALES, codes _CODES stored as the value + _BIAS."""
    a1 = zero_f32()
    a2 = zero_f32()
    a3 = zero_f32()
    a4 = zero_f32()
    off = splat8(_BIAS)
    for b in range(s.shape[0]):
        o = b * _BLOCK
        d = s[b]
        sc = _SCALES(w, o)
        for h in range(2):
            q1, q2, q3, q4 = _CODES(w, o, h)
            xo = 256 * b + 128 * h
            g = 8 * h
            a1 = _q6_quarter_f(vsub(q1, off), x, xo, d, sc, g, a1)
            a2 = _q6_quarter_f(vsub(q2, off), x, xo + 32, d, sc, g + 2, a2)
            a3 = _q6_quarter_f(vsub(q3, off), x, xo + 64, d, sc, g + 4, a3)
            a4 = _q6_quarter_f(vsub(q4, off), x, xo + 96, d, sc, g + 6, a4)
    return hsum_f32(vadd(vadd(a1, a2), vadd(a3, a4)))


@njit(cache=True, nogil=True)
def _dot_q2_k_f(w, s, x, xs):
    a1 = zero_f32()
    a2 = zero_f32()
    a3 = zero_f32()
    a4 = zero_f32()
    acc_m = zero_f32()
    for b in range(s.shape[0] // 2):
        o = b * 84
        d = s[2 * b]
        sc, mn = k2_scales(w, o)
        t = vfma(i16_to_f32(mn, 0), load_f32x8(xs, 16 * b), zero_f32())
        acc_m = vfma_s(vfma(i16_to_f32(mn, 1), load_f32x8(xs, 16 * b + 8), t), -s[2 * b + 1], acc_m)
        for h in range(2):
            q1, q2, q3, q4 = _q2k_codes(w, o, h)
            xo = 256 * b + 128 * h
            g = 8 * h
            a1 = _q6_quarter_f(q1, x, xo, d, sc, g, a1)
            a2 = _q6_quarter_f(q2, x, xo + 32, d, sc, g + 2, a2)
            a3 = _q6_quarter_f(q3, x, xo + 64, d, sc, g + 4, a3)
            a4 = _q6_quarter_f(q4, x, xo + 96, d, sc, g + 6, a4)
    return hsum_f32(vadd(vadd(vadd(a1, a2), vadd(a3, a4)), acc_m))


@njit(cache=True, nogil=True)
def _dot_iq4_xs_f(w, s, x):
    acc = zero_f32()
    for b in range(s.shape[0]):
        o = b * 136
        d = s[b]
        for j in range(8):  # dl = d·(ls − 32) in float32, as dequantize_row_iq4_xs
            dl = d * np.float32(iq4xs_scale(w, o, j))
            acc = vfma_s(_fdot32(load_iq4nl_codes(w, o + 8 + 16 * j), x, 256 * b + 32 * j), dl, acc)
    return hsum_f32(acc)


# --- the kernels of each type: row dots and the parallel gather drivers (engine.kernels.drivers) --

_dot_q4_k_f = specialise(_dot_k4_f, "_dot_q4_k_f", __name__, _BLOCK=144, _CODES=_q4k_codes)
_dot_q5_k_f = specialise(_dot_k4_f, "_dot_q5_k_f", __name__, _BLOCK=176, _CODES=_q5k_codes)
_dot_q6_k_f = specialise(
    _dot_k16_f, "_dot_q6_k_f", __name__, _BLOCK=210, _SCALES=_q6k_scales, _CODES=_q6k_codes, _BIAS=32
)
_dot_q3_k_f = specialise(
    _dot_k16_f, "_dot_q3_k_f", __name__, _BLOCK=110, _SCALES=_q3k_scales, _CODES=_q3k_codes, _BIAS=4
)

_PARALLEL = {"parallel": True}
gemv_q2_k_f = specialise(drivers.gemv_f_sums, "gemv_q2_k_f", __name__, _PARALLEL, _DOT=_dot_q2_k_f)
gemv_q4_k_f = specialise(drivers.gemv_f_sums, "gemv_q4_k_f", __name__, _PARALLEL, _DOT=_dot_q4_k_f)
gemv_q5_k_f = specialise(drivers.gemv_f_sums, "gemv_q5_k_f", __name__, _PARALLEL, _DOT=_dot_q5_k_f)
gemv_q3_k_f = specialise(drivers.gemv_f, "gemv_q3_k_f", __name__, _PARALLEL, _DOT=_dot_q3_k_f)
gemv_q6_k_f = specialise(drivers.gemv_f, "gemv_q6_k_f", __name__, _PARALLEL, _DOT=_dot_q6_k_f)
gemv_iq4_xs_f = specialise(drivers.gemv_f, "gemv_iq4_xs_f", __name__, _PARALLEL, _DOT=_dot_iq4_xs_f)
