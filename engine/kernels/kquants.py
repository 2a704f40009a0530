"""GEMV kernels for the 256-element K-quant types Q4_K, Q5_K and Q6_K.

Gather signature shared by all families (see ``engine.kernels.dispatch``)::

    kernel(raw uint8 [R, row_bytes], s float32 [R, S], rows int64 [M], xi int64 [M],
           <activations>, out float32 [M, T])
    out[i, t] = W[rows[i]] · x[xi[i] + t]

``s`` holds (d, dmin) interleaved per block for Q4_K/Q5_K and d for Q6_K (``prepare``).

Exact-float kernels (``*_f``) take X float32 [K, n] and, for Q4_K/Q5_K, Xs float32 [K, n/32]
(sums of x over each 32-block, to apply the mins once per sub-block). Q8-activation kernels
(``*_q8``) take ggml's Q8_K activations: qa int8 [K, n], da float32 [K, n/256] and, for the mins
of Q4_K/Q5_K, as float32 [K, n/32] (sums of the codes over each 32-block, i.e. pairs of bsums).

Block layouts (ggml-common.h):
q4_K = d | dmin | scales[12] (8 packed 6-bit scale/min pairs) | qs[128]: chunk j of 64 elements
uses qs[32j..32j+32], low nibbles for sub-block 2j, high nibbles for sub-block 2j+1;
q5_K = as q4_K with qh[32] before qs: bit 2j / 2j+1 of qh[l] is the fifth bit of element l of
sub-block 2j / 2j+1; q6_K = ql[128] | qh[64] | scales int8[16] | d, values q − 32 in 16-element
sub-blocks (``dequantize_row_q6_K``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

CHUNK = 8  # rows per parallel work item


@njit(cache=True, nogil=True, fastmath=True)
def _reduce(acc):
    s = np.float32(0.0)
    for l in range(acc.shape[0]):
        s += acc[l]
    return s


@njit(cache=True, nogil=True)
def _scale_min_k4(w, o, j):
    """6-bit (scale, min) of sub-block j from the 12 bytes at w[o:]; ggml ``get_scale_min_k4``."""
    if j < 4:
        return np.int32(w[o + j] & 63), np.int32(w[o + j + 4] & 63)
    sc = (w[o + j + 4] & 15) | ((w[o + j - 4] >> 6) << 4)
    m = (w[o + j + 4] >> 4) | ((w[o + j] >> 6) << 4)
    return np.int32(sc), np.int32(m)


# --- exact-float -----------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_k_f(w, s, x, xs, acc):
    acc[:] = 0.0
    mins = np.float32(0.0)
    for b in range(s.shape[0] // 2):
        d = s[2 * b]
        dmin = s[2 * b + 1]
        o = b * 144
        for j in range(4):
            sc1, m1 = _scale_min_k4(w, o + 4, 2 * j)
            sc2, m2 = _scale_min_k4(w, o + 4, 2 * j + 1)
            d1 = d * np.float32(sc1)
            d2 = d * np.float32(sc2)
            mins += dmin * (np.float32(m1) * xs[8 * b + 2 * j] + np.float32(m2) * xs[8 * b + 2 * j + 1])
            qo = o + 16 + 32 * j
            xo = 256 * b + 64 * j
            for l in range(32):
                v = w[qo + l]
                acc[l] += (d1 * np.float32(v & 15)) * x[xo + l]
                acc[32 + l] += (d2 * np.float32(v >> 4)) * x[xo + 32 + l]
    return _reduce(acc) - mins


@njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_k_f(w, s, x, xs, acc):
    acc[:] = 0.0
    mins = np.float32(0.0)
    for b in range(s.shape[0] // 2):
        d = s[2 * b]
        dmin = s[2 * b + 1]
        o = b * 176
        for j in range(4):
            sc1, m1 = _scale_min_k4(w, o + 4, 2 * j)
            sc2, m2 = _scale_min_k4(w, o + 4, 2 * j + 1)
            d1 = d * np.float32(sc1)
            d2 = d * np.float32(sc2)
            mins += dmin * (np.float32(m1) * xs[8 * b + 2 * j] + np.float32(m2) * xs[8 * b + 2 * j + 1])
            qo = o + 48 + 32 * j
            ho = o + 16
            xo = 256 * b + 64 * j
            for l in range(32):
                v = w[qo + l]
                h = w[ho + l] >> (2 * j)
                lo = (v & 15) | ((h & 1) << 4)
                hi = (v >> 4) | ((h & 2) << 3)
                acc[l] += (d1 * np.float32(lo)) * x[xo + l]
                acc[32 + l] += (d2 * np.float32(hi)) * x[xo + 32 + l]
    return _reduce(acc) - mins


@njit(cache=True, nogil=True, fastmath=True)
def _dot_q6_k_f(w, s, x, acc):
    acc[:] = 0.0
    for b in range(s.shape[0]):
        d = s[b]
        for h in range(2):  # two halves of 128 elements
            o = b * 210
            qlo = o + 64 * h
            qho = o + 128 + 32 * h
            so = o + 192 + 8 * h
            xo = 256 * b + 128 * h
            for g in range(2):  # 16-element sub-blocks share a scale
                s0 = d * np.float32(np.int8(w[so + g]))
                s1 = d * np.float32(np.int8(w[so + g + 2]))
                s2 = d * np.float32(np.int8(w[so + g + 4]))
                s3 = d * np.float32(np.int8(w[so + g + 6]))
                for ll in range(16):
                    L = 16 * g + ll
                    a = np.int32(w[qlo + L])
                    c = np.int32(w[qlo + 32 + L])
                    hb = np.int32(w[qho + L])
                    q1 = ((a & 15) | ((hb & 3) << 4)) - 32
                    q2 = ((c & 15) | (((hb >> 2) & 3) << 4)) - 32
                    q3 = ((a >> 4) | (((hb >> 4) & 3) << 4)) - 32
                    q4 = ((c >> 4) | (((hb >> 6) & 3) << 4)) - 32
                    acc[L] += (s0 * np.float32(q1)) * x[xo + L]
                    acc[32 + L] += (s1 * np.float32(q2)) * x[xo + 32 + L]
                    acc[64 + L] += (s2 * np.float32(q3)) * x[xo + 64 + L]
                    acc[96 + L] += (s3 * np.float32(q4)) * x[xo + 96 + L]
    return _reduce(acc)


@njit(cache=True, nogil=True, parallel=True)
def gemv_q4_k_f(raw, s, rows, xi, X, Xs, out):
    M, T = out.shape
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(64, np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            r = rows[i]
            for t in range(T):
                k = xi[i] + t
                out[i, t] = _dot_q4_k_f(raw[r], s[r], X[k], Xs[k], acc)


@njit(cache=True, nogil=True, parallel=True)
def gemv_q5_k_f(raw, s, rows, xi, X, Xs, out):
    M, T = out.shape
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(64, np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            r = rows[i]
            for t in range(T):
                k = xi[i] + t
                out[i, t] = _dot_q5_k_f(raw[r], s[r], X[k], Xs[k], acc)


@njit(cache=True, nogil=True, parallel=True)
def gemv_q6_k_f(raw, s, rows, xi, X, out):
    M, T = out.shape
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(128, np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            r = rows[i]
            for t in range(T):
                out[i, t] = _dot_q6_k_f(raw[r], s[r], X[xi[i] + t], acc)
