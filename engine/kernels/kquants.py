"""GEMV kernels for the 256-element K-quant types Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.

Gather signature shared by all families (see ``engine.kernels.dispatch``)::

    kernel(raw uint8 [R, row_bytes], s float32 [R, S], rows int64 [M], xi int64 [M],
           <activations>, out float32 [M, T])
    out[i, t] = W[rows[i]] · x[xi[i] + t]

``s`` holds (d, dmin) interleaved per block for Q2_K/Q4_K/Q5_K and d for Q3_K/Q6_K (``prepare``).

This module holds the Q8-activation kernels (``*_q8``; the exact-float ones are in
``kquants_exact``). They take
ggml Q8_K activations qa int8 [K, n], da float32 [K, n/256], bsums int16 [K, n/16] and follow
``ggml_vec_dot_q{2,3,4,5,6}_K_q8_K``: per block, exact integer sums Σ_s sc_s·Σ q·q_a (pmaddubsw,
then pmaddwd by the broadcast sub-block scale) scaled by d·d_a; the mins (Q2_K/Q4_K/Q5_K) and the
−32 offset of Q6_K (−4 of Q3_K) are applied through the bsums.

Block layouts (ggml-common.h):
q4_K = d | dmin | scales[12] (8 packed 6-bit scale/min pairs) | qs[128]: chunk j of 64 elements
uses qs[32j..32j+32], low nibbles for sub-block 2j, high nibbles for sub-block 2j+1;
q5_K = as q4_K with qh[32] before qs: bit 2j / 2j+1 of qh[l] is the fifth bit of element l of
sub-block 2j / 2j+1; q6_K = ql[128] | qh[64] | scales int8[16] | d; each 128-element half h uses
ql[64h..64h+64] and qh[32h..32h+32]; quarter k (32 elements) takes low (k = 0, 1) or high
(k = 2, 3) nibbles of ql[64h + 32(k mod 2) + l] and bits 2k, 2k+1 of qh[32h + l]; value q − 32,
sub-blocks of 16 elements (``dequantize_row_q6_K``); q3_K = hmask[32] | qs[64] | scales[12] (16
packed 6-bit scales, value − 32) | d; quarter j of half h (elements 128h + 32j + l) takes bits 2j, 2j+1
of qs[32h + l] and, as bit 2, bit 4h + j of hmask[l]; value q − 4 (the code 0..7 here), sub-blocks of 16
(``dequantize_row_q3_K``); q2_K = scales[16] (sub-block s: scale | min << 4) | qs[64] | d | dmin, the
codes as q3_K's low 2 bits (qs at byte 16), sub-blocks of 16 (``dequantize_row_q2_K``).

IQ4_XS (``dequantize_row_iq4_xs``, also with Q8_K activations) = d | scales_h u16 | scales_l[4] | qs[128]:
group j of 32 elements reads qs[16j:16j+16] as iq4_nl (low nibbles first), levels kvalues_iq4nl, scale
d·(ls_j − 32) with ls_j = nibble j % 2 of scales_l[j // 2] | bits 2j, 2j+1 of scales_h << 4; its q8 dot
follows ``ggml_vec_dot_iq4_xs_q8_K``: signed × signed bytes, pmaddwd by ls_j − 32, one float scale per block.

For prefill (T > 1 tokens per row) four tokens share one decode of the weight codes and scales.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels import drivers
from engine.kernels.drivers import specialise
from engine.kernels.lookups import load_iq4nl_codes
from engine.kernels.simd import (
    bcast16,
    bcast16_pair,
    dup_high16,
    fma_i32,
    hsum_f32,
    k3_scales,
    k4_scales,
    load_i8x16_as_i16,
    load_i8x32,
    load_i16x16,
    madd,
    madd_acc,
    maddss,
    maddubs,
    splat8,
    splat16,
    vand,
    vor,
    vshl,
    vshr,
    vsub,
    zero_f32,
    zero_i32,
)

# --- codes: the unsigned integer values of 32 consecutive elements, as I8x32 ------------------


@njit(cache=True, nogil=True, inline="always")
def _q4k_codes(w, o, j):
    """Sub-blocks 2j and 2j+1 of the q4_K block at byte o: (low, high) nibbles, 0..15."""
    q = load_i8x32(w, o + 16 + 32 * j)
    return vand(q, splat8(15)), vshr(q, 4)


@njit(cache=True, nogil=True, inline="always")
def _q5k_codes(w, o, j):
    """Sub-blocks 2j and 2j+1 of the q5_K block at byte o, 0..31."""
    q = load_i8x32(w, o + 48 + 32 * j)
    qh = load_i8x32(w, o + 16)
    one = splat8(1)
    lo = vor(vand(q, splat8(15)), vshl(vand(vshr(qh, 2 * j), one), 4))
    hi = vor(vshr(q, 4), vshl(vand(vshr(qh, 2 * j + 1), one), 4))
    return lo, hi


@njit(cache=True, nogil=True, inline="always")
def _q6k_codes(w, o, h):
    """The four 32-element quarters of half h of the q6_K block at byte o, 0..63."""
    ql0 = load_i8x32(w, o + 64 * h)
    ql1 = load_i8x32(w, o + 64 * h + 32)
    qh = load_i8x32(w, o + 128 + 32 * h)
    m15 = splat8(15)
    m3 = splat8(3)
    q1 = vor(vand(ql0, m15), vshl(vand(qh, m3), 4))
    q2 = vor(vand(ql1, m15), vshl(vand(vshr(qh, 2), m3), 4))
    q3 = vor(vshr(ql0, 4), vshl(vand(vshr(qh, 4), m3), 4))
    q4 = vor(vshr(ql1, 4), vshl(vshr(qh, 6), 4))
    return q1, q2, q3, q4


@njit(cache=True, nogil=True, inline="always")
def _q2k_codes(w, o, h):
    """The four 32-element quarters of half h of the q2_K block at byte o, 0..3."""
    q = load_i8x32(w, o + 16 + 32 * h)
    m3 = splat8(3)
    return vand(q, m3), vand(vshr(q, 2), m3), vand(vshr(q, 4), m3), vshr(q, 6)


@njit(cache=True, nogil=True, inline="always")
def k2_scales(w, o):
    """The 16 scale bytes of the q2_K block at byte o -> (scales, mins) as I16x16, 4 bits each."""
    v = load_i8x16_as_i16(w, o)
    m15 = splat16(15)
    return vand(v, m15), vand(vshr(v, 4), m15)


@njit(cache=True, nogil=True, inline="always")
def _q3k_codes(w, o, h):
    """The four 32-element quarters of half h of the q3_K block at byte o, 0..7 (the value + 4)."""
    q = load_i8x32(w, o + 32 + 32 * h)
    hm = load_i8x32(w, o)
    m3 = splat8(3)
    one = splat8(1)
    b = 4 * h
    q1 = vor(vand(q, m3), vshl(vand(vshr(hm, b), one), 2))
    q2 = vor(vand(vshr(q, 2), m3), vshl(vand(vshr(hm, b + 1), one), 2))
    q3 = vor(vand(vshr(q, 4), m3), vshl(vand(vshr(hm, b + 2), one), 2))
    q4 = vor(vshr(q, 6), vshl(vand(vshr(hm, b + 3), one), 2))
    return q1, q2, q3, q4


# --- Q8-activation row dots -------------------------------------------------------------------

# The templates' placeholders, bound per type by ``specialise`` (engine.kernels.drivers).
_BLOCK = _CODES = _SCALES = _OFFSET = None


@njit(cache=True, nogil=True, inline="always")
def _q8_pair(lo, hi, qa, xo, sm, j, iacc):
    """iacc + sc[2j]·(lo·qa[xo:xo+32]) + sc[2j+1]·(hi·qa[xo+32:xo+64]), lane-wise int32."""
    iacc = madd_acc(iacc, maddubs(lo, load_i8x32(qa, xo)), bcast16(sm, 2 * j))
    return madd_acc(iacc, maddubs(hi, load_i8x32(qa, xo + 32)), bcast16(sm, 2 * j + 1))


def _dot_k4_q8(w, s, qa, da, bsums):
    """Q8 row dot of a type with q4_K's scales and mins (Q4_K, Q5_K): blocks of _BLOCK bytes, codes _CODES."""
    acc = zero_f32()
    for b in range(s.shape[0] // 2):
        o = b * _BLOCK
        sm = k4_scales(w, o + 4)  # [sc0..7, m0..7]
        iacc = madd(load_i16x16(bsums, 16 * b), dup_high16(sm))  # Σ m·bsum, for the mins
        acc = fma_i32(iacc, -s[2 * b + 1] * da[b], acc)
        iacc = zero_i32()
        for j in range(4):
            lo, hi = _CODES(w, o, j)
            iacc = _q8_pair(lo, hi, qa, 256 * b + 64 * j, sm, j, iacc)
        acc = fma_i32(iacc, s[2 * b] * da[b], acc)
    return hsum_f32(acc)


@njit(cache=True, nogil=True, inline="always")
def _dot2_q4_k_q8(w0, s0, w1, s1, qa, da, bsums):
    """(_dot_q4_k_q8(w0, s0, …), _dot_q4_k_q8(w1, s1, …)): two q4_K rows of one width against one
    activation row, bit-identical to two single-row calls (each row's operations in the same order);
    the activation loads are shared and the two chains interleave."""
    acc0 = zero_f32()
    acc1 = zero_f32()
    for b in range(s0.shape[0] // 2):
        o = b * 144
        sm0 = k4_scales(w0, o + 4)
        sm1 = k4_scales(w1, o + 4)
        bs = load_i16x16(bsums, 16 * b)
        acc0 = fma_i32(madd(bs, dup_high16(sm0)), -s0[2 * b + 1] * da[b], acc0)
        acc1 = fma_i32(madd(bs, dup_high16(sm1)), -s1[2 * b + 1] * da[b], acc1)
        i0 = zero_i32()
        i1 = zero_i32()
        for j in range(4):
            xo = 256 * b + 64 * j
            lo0, hi0 = _q4k_codes(w0, o, j)
            lo1, hi1 = _q4k_codes(w1, o, j)
            a0 = load_i8x32(qa, xo)
            a1 = load_i8x32(qa, xo + 32)
            i0 = madd_acc(i0, maddubs(lo0, a0), bcast16(sm0, 2 * j))
            i0 = madd_acc(i0, maddubs(hi0, a1), bcast16(sm0, 2 * j + 1))
            i1 = madd_acc(i1, maddubs(lo1, a0), bcast16(sm1, 2 * j))
            i1 = madd_acc(i1, maddubs(hi1, a1), bcast16(sm1, 2 * j + 1))
        acc0 = fma_i32(i0, s0[2 * b] * da[b], acc0)
        acc1 = fma_i32(i1, s1[2 * b] * da[b], acc1)
    return hsum_f32(acc0), hsum_f32(acc1)


def _dot_k16_q8(w, s, qa, da, bsums):
    """Q8 row dot of a type with 16 signed sub-block scales and an offset (Q3_K, Q6_K): blocks of _BLOCK
    bytes, scales _SCALES, the offset's correction _OFFSET, codes _CODES."""
    acc = zero_f32()
    for b in range(s.shape[0]):
        o = b * _BLOCK
        sc = _SCALES(w, o)
        iacc = _OFFSET(bsums, b, sc)
        for h in range(2):
            q1, q2, q3, q4 = _CODES(w, o, h)
            iacc = _q6_quarters(q1, q2, q3, q4, qa, 256 * b + 128 * h, sc, 8 * h, iacc)
        acc = fma_i32(iacc, s[b] * da[b], acc)
    return hsum_f32(acc)


@njit(cache=True, nogil=True, inline="always")
def _dot_q2_k_q8(w, s, qa, da, bsums):
    acc = zero_f32()
    for b in range(s.shape[0] // 2):
        o = b * 84
        sc, mn = k2_scales(w, o)
        acc = fma_i32(madd(load_i16x16(bsums, 16 * b), mn), -s[2 * b + 1] * da[b], acc)  # Σ m·bsum
        iacc = zero_i32()
        for h in range(2):
            q1, q2, q3, q4 = _q2k_codes(w, o, h)
            iacc = _q6_quarters(q1, q2, q3, q4, qa, 256 * b + 128 * h, sc, 8 * h, iacc)
        acc = fma_i32(iacc, s[2 * b] * da[b], acc)
    return hsum_f32(acc)


# --- four tokens at once: the weight codes and scales are decoded once for all four ----------


def _dot4_k4_q8(w, s, qa, da, bsums, k):
    """``_dot_k4_q8`` of activation rows k..k+3 against one weight row -> 4 float32 (prefill)."""
    a0, a1, a2, a3 = qa[k], qa[k + 1], qa[k + 2], qa[k + 3]
    f0 = zero_f32()
    f1 = zero_f32()
    f2 = zero_f32()
    f3 = zero_f32()
    for b in range(s.shape[0] // 2):
        o = b * _BLOCK
        sm = k4_scales(w, o + 4)
        md = dup_high16(sm)
        dmin = -s[2 * b + 1]
        f0 = fma_i32(madd(load_i16x16(bsums[k], 16 * b), md), dmin * da[k, b], f0)
        f1 = fma_i32(madd(load_i16x16(bsums[k + 1], 16 * b), md), dmin * da[k + 1, b], f1)
        f2 = fma_i32(madd(load_i16x16(bsums[k + 2], 16 * b), md), dmin * da[k + 2, b], f2)
        f3 = fma_i32(madd(load_i16x16(bsums[k + 3], 16 * b), md), dmin * da[k + 3, b], f3)
        i0 = zero_i32()
        i1 = zero_i32()
        i2 = zero_i32()
        i3 = zero_i32()
        for j in range(4):
            lo, hi = _CODES(w, o, j)
            xo = 256 * b + 64 * j
            i0 = _q8_pair(lo, hi, a0, xo, sm, j, i0)
            i1 = _q8_pair(lo, hi, a1, xo, sm, j, i1)
            i2 = _q8_pair(lo, hi, a2, xo, sm, j, i2)
            i3 = _q8_pair(lo, hi, a3, xo, sm, j, i3)
        d = s[2 * b]
        f0 = fma_i32(i0, d * da[k, b], f0)
        f1 = fma_i32(i1, d * da[k + 1, b], f1)
        f2 = fma_i32(i2, d * da[k + 2, b], f2)
        f3 = fma_i32(i3, d * da[k + 3, b], f3)
    return hsum_f32(f0), hsum_f32(f1), hsum_f32(f2), hsum_f32(f3)


@njit(cache=True, nogil=True, inline="always")
def _q6_quarters(q1, q2, q3, q4, qa, xo, sc, g, iacc):
    iacc = madd_acc(iacc, maddubs(q1, load_i8x32(qa, xo)), bcast16_pair(sc, g))
    iacc = madd_acc(iacc, maddubs(q2, load_i8x32(qa, xo + 32)), bcast16_pair(sc, g + 2))
    iacc = madd_acc(iacc, maddubs(q3, load_i8x32(qa, xo + 64)), bcast16_pair(sc, g + 4))
    return madd_acc(iacc, maddubs(q4, load_i8x32(qa, xo + 96)), bcast16_pair(sc, g + 6))


@njit(cache=True, nogil=True, inline="always")
def _q6_offset(bsums, b, sc):
    """−32·Σ_s sc_s·bsum_s as I32x8 lanes: the codes are stored with +32."""
    return vsub(zero_i32(), vshl(madd(load_i16x16(bsums, 16 * b), sc), 5))


@njit(cache=True, nogil=True, inline="always")
def _q3_offset(bsums, b, sc):
    """−4·Σ_s sc_s·bsum_s as I32x8 lanes: the codes are taken with +4."""
    return vsub(zero_i32(), vshl(madd(load_i16x16(bsums, 16 * b), sc), 2))


@njit(cache=True, nogil=True)
def _dot4_q2_k_q8(w, s, qa, da, bsums, k):
    a0, a1, a2, a3 = qa[k], qa[k + 1], qa[k + 2], qa[k + 3]
    f0 = zero_f32()
    f1 = zero_f32()
    f2 = zero_f32()
    f3 = zero_f32()
    for b in range(s.shape[0] // 2):
        o = b * 84
        sc, mn = k2_scales(w, o)
        dmin = -s[2 * b + 1]
        f0 = fma_i32(madd(load_i16x16(bsums[k], 16 * b), mn), dmin * da[k, b], f0)
        f1 = fma_i32(madd(load_i16x16(bsums[k + 1], 16 * b), mn), dmin * da[k + 1, b], f1)
        f2 = fma_i32(madd(load_i16x16(bsums[k + 2], 16 * b), mn), dmin * da[k + 2, b], f2)
        f3 = fma_i32(madd(load_i16x16(bsums[k + 3], 16 * b), mn), dmin * da[k + 3, b], f3)
        i0 = zero_i32()
        i1 = zero_i32()
        i2 = zero_i32()
        i3 = zero_i32()
        for h in range(2):
            q1, q2, q3, q4 = _q2k_codes(w, o, h)
            xo = 256 * b + 128 * h
            i0 = _q6_quarters(q1, q2, q3, q4, a0, xo, sc, 8 * h, i0)
            i1 = _q6_quarters(q1, q2, q3, q4, a1, xo, sc, 8 * h, i1)
            i2 = _q6_quarters(q1, q2, q3, q4, a2, xo, sc, 8 * h, i2)
            i3 = _q6_quarters(q1, q2, q3, q4, a3, xo, sc, 8 * h, i3)
        d = s[2 * b]
        f0 = fma_i32(i0, d * da[k, b], f0)
        f1 = fma_i32(i1, d * da[k + 1, b], f1)
        f2 = fma_i32(i2, d * da[k + 2, b], f2)
        f3 = fma_i32(i3, d * da[k + 3, b], f3)
    return hsum_f32(f0), hsum_f32(f1), hsum_f32(f2), hsum_f32(f3)


def _dot4_k16_q8(w, s, qa, da, bsums, k):
    """``_dot_k16_q8`` of activation rows k..k+3 against one weight row -> 4 float32 (prefill)."""
    a0, a1, a2, a3 = qa[k], qa[k + 1], qa[k + 2], qa[k + 3]
    f0 = zero_f32()
    f1 = zero_f32()
    f2 = zero_f32()
    f3 = zero_f32()
    for b in range(s.shape[0]):
        o = b * _BLOCK
        sc = _SCALES(w, o)
        i0 = _OFFSET(bsums[k], b, sc)
        i1 = _OFFSET(bsums[k + 1], b, sc)
        i2 = _OFFSET(bsums[k + 2], b, sc)
        i3 = _OFFSET(bsums[k + 3], b, sc)
        for h in range(2):
            q1, q2, q3, q4 = _CODES(w, o, h)
            xo = 256 * b + 128 * h
            i0 = _q6_quarters(q1, q2, q3, q4, a0, xo, sc, 8 * h, i0)
            i1 = _q6_quarters(q1, q2, q3, q4, a1, xo, sc, 8 * h, i1)
            i2 = _q6_quarters(q1, q2, q3, q4, a2, xo, sc, 8 * h, i2)
            i3 = _q6_quarters(q1, q2, q3, q4, a3, xo, sc, 8 * h, i3)
        d = s[b]
        f0 = fma_i32(i0, d * da[k, b], f0)
        f1 = fma_i32(i1, d * da[k + 1, b], f1)
        f2 = fma_i32(i2, d * da[k + 2, b], f2)
        f3 = fma_i32(i3, d * da[k + 3, b], f3)
    return hsum_f32(f0), hsum_f32(f1), hsum_f32(f2), hsum_f32(f3)


# --- IQ4_XS -----------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def iq4xs_scale(w, o, j):
    """The signed scale ls_j − 32 (−32..31) of group j of the iq4_xs block at byte o."""
    lo = (np.int32(w[o + 4 + j // 2]) >> (4 * (j % 2))) & 15
    hi = ((np.int32(w[o + 2]) | (np.int32(w[o + 3]) << 8)) >> (2 * j)) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True, nogil=True, inline="always")
def _iq4xs_block(w, o, qa, xo, iacc):
    """iacc + Σ_j (ls_j − 32)·Σ kv·qa over the 8 groups of the block at byte o (activations from xo)."""
    for j in range(8):
        p = maddss(load_iq4nl_codes(w, o + 8 + 16 * j), load_i8x32(qa, xo + 32 * j))
        iacc = madd_acc(iacc, p, splat16(iq4xs_scale(w, o, j)))
    return iacc


@njit(cache=True, nogil=True, inline="always")
def _dot_iq4_xs_q8(w, s, qa, da, bsums):
    acc = zero_f32()
    for b in range(s.shape[0]):
        iacc = _iq4xs_block(w, b * 136, qa, 256 * b, zero_i32())
        acc = fma_i32(iacc, s[b] * da[b], acc)
    return hsum_f32(acc)


@njit(cache=True, nogil=True)
def _dot4_iq4_xs_q8(w, s, qa, da, bsums, k):
    a0, a1, a2, a3 = qa[k], qa[k + 1], qa[k + 2], qa[k + 3]
    f0 = zero_f32()
    f1 = zero_f32()
    f2 = zero_f32()
    f3 = zero_f32()
    for b in range(s.shape[0]):
        o = b * 136
        i0 = zero_i32()
        i1 = zero_i32()
        i2 = zero_i32()
        i3 = zero_i32()
        for j in range(8):
            q = load_iq4nl_codes(w, o + 8 + 16 * j)
            sc = splat16(iq4xs_scale(w, o, j))
            xo = 256 * b + 32 * j
            i0 = madd_acc(i0, maddss(q, load_i8x32(a0, xo)), sc)
            i1 = madd_acc(i1, maddss(q, load_i8x32(a1, xo)), sc)
            i2 = madd_acc(i2, maddss(q, load_i8x32(a2, xo)), sc)
            i3 = madd_acc(i3, maddss(q, load_i8x32(a3, xo)), sc)
        d = s[b]
        f0 = fma_i32(i0, d * da[k, b], f0)
        f1 = fma_i32(i1, d * da[k + 1, b], f1)
        f2 = fma_i32(i2, d * da[k + 2, b], f2)
        f3 = fma_i32(i3, d * da[k + 3, b], f3)
    return hsum_f32(f0), hsum_f32(f1), hsum_f32(f2), hsum_f32(f3)


# --- the kernels of each type: row dots (the fused MoE and grouped kernels inline them too), four-token
# dots and the parallel gather drivers (engine.kernels.drivers) -----------------------------------


@njit(cache=True, nogil=True, inline="always")
def _q6k_scales(w, o):
    """The 16 signed sub-block scales of the q6_K block at byte o."""
    return load_i8x16_as_i16(w, o + 192)


@njit(cache=True, nogil=True, inline="always")
def _q3k_scales(w, o):
    """The 16 signed sub-block scales of the q3_K block at byte o."""
    return k3_scales(w, o + 96)


_INLINE = {"inline": "always"}
_PARALLEL = {"parallel": True}
_Q4K = {"_BLOCK": 144, "_CODES": _q4k_codes}
_Q5K = {"_BLOCK": 176, "_CODES": _q5k_codes}
_Q6K = {"_BLOCK": 210, "_SCALES": _q6k_scales, "_OFFSET": _q6_offset, "_CODES": _q6k_codes}
_Q3K = {"_BLOCK": 110, "_SCALES": _q3k_scales, "_OFFSET": _q3_offset, "_CODES": _q3k_codes}

_dot_q4_k_q8 = specialise(_dot_k4_q8, "_dot_q4_k_q8", __name__, _INLINE, **_Q4K)
_dot_q5_k_q8 = specialise(_dot_k4_q8, "_dot_q5_k_q8", __name__, _INLINE, **_Q5K)
_dot_q6_k_q8 = specialise(_dot_k16_q8, "_dot_q6_k_q8", __name__, _INLINE, **_Q6K)
_dot_q3_k_q8 = specialise(_dot_k16_q8, "_dot_q3_k_q8", __name__, _INLINE, **_Q3K)

_dot4_q4_k_q8 = specialise(_dot4_k4_q8, "_dot4_q4_k_q8", __name__, **_Q4K)
_dot4_q5_k_q8 = specialise(_dot4_k4_q8, "_dot4_q5_k_q8", __name__, **_Q5K)
_dot4_q6_k_q8 = specialise(_dot4_k16_q8, "_dot4_q6_k_q8", __name__, **_Q6K)
_dot4_q3_k_q8 = specialise(_dot4_k16_q8, "_dot4_q3_k_q8", __name__, **_Q3K)


def _gemv(name, dot, dot4):
    return specialise(drivers.gemv_q8, name, __name__, _PARALLEL, _DOT=dot, _DOT4=dot4)


gemv_q4_k_q8 = _gemv("gemv_q4_k_q8", _dot_q4_k_q8, _dot4_q4_k_q8)
gemv_q5_k_q8 = _gemv("gemv_q5_k_q8", _dot_q5_k_q8, _dot4_q5_k_q8)
gemv_q6_k_q8 = _gemv("gemv_q6_k_q8", _dot_q6_k_q8, _dot4_q6_k_q8)
gemv_q3_k_q8 = _gemv("gemv_q3_k_q8", _dot_q3_k_q8, _dot4_q3_k_q8)
gemv_q2_k_q8 = _gemv("gemv_q2_k_q8", _dot_q2_k_q8, _dot4_q2_k_q8)
gemv_iq4_xs_q8 = _gemv("gemv_iq4_xs_q8", _dot_iq4_xs_q8, _dot4_iq4_xs_q8)
