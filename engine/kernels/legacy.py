"""GEMV kernels for the 32-element block types Q8_0, Q4_0 and Q5_0.

Gather signature shared by all families (see ``engine.kernels.dispatch``)::

    kernel(raw uint8 [R, row_bytes], d float32 [R, n/32], rows int64 [M], xi int64 [M],
           <activations>, out float32 [M, T])
    out[i, t] = W[rows[i]] · x[xi[i] + t]

Exact-float kernels (``*_f``) take X float32 [K, n]. Q8-activation kernels (``*_q8``) take the
activations as ggml's Q8_0 blocks: qa int8 [K, n] and da float32 [K, n/32] (the fp16 scales),
and compute ``Σ_b d_w·d_a·Σ q_w·q_a`` as ``ggml_vec_dot_{q8_0,q4_0,q5_0}_q8_0``. Integer block
products are formed in float32, which holds them exactly (|Σ| ≤ 32·128·128 < 2^24).

Block layouts (ggml-common.h): q8_0 = d fp16 | qs int8[32];
q4_0 = d | qs[16] (low nibbles: elements 0..15, high: 16..31), value q − 8;
q5_0 = d | qh u32 (bit j = fifth bit of element j) | qs[16], value q − 16.
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


# --- Q8_0 ----------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=True)
def _dot_q8_0(w, d, x, acc):
    """w int8 [nb·34] as uint8 bytes; d f32 [nb]; x f32 [n] (weights or q8 codes as floats)."""
    acc[:] = 0.0
    for b in range(d.shape[0]):
        db = d[b]
        o = b * 34 + 2
        xo = b * 32
        for l in range(32):
            q = np.int8(w[o + l])
            acc[l] += (db * np.float32(q)) * x[xo + l]
    return _reduce(acc)


@njit(cache=True, nogil=True, parallel=True)
def gemv_q8_0_f(raw, d, rows, xi, X, out):
    M, T = out.shape
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(32, np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            r = rows[i]
            for t in range(T):
                out[i, t] = _dot_q8_0(raw[r], d[r], X[xi[i] + t], acc)


# --- Q4_0 ----------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=True)
def _dot_q4_0(w, d, x, acc):
    acc[:] = 0.0
    for b in range(d.shape[0]):
        db = d[b]
        o = b * 18 + 2
        xo = b * 32
        for l in range(16):
            v = w[o + l]
            acc[l] += (db * np.float32(np.int32(v & 15) - 8)) * x[xo + l]
            acc[16 + l] += (db * np.float32(np.int32(v >> 4) - 8)) * x[xo + 16 + l]
    return _reduce(acc)


@njit(cache=True, nogil=True, parallel=True)
def gemv_q4_0_f(raw, d, rows, xi, X, out):
    M, T = out.shape
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(32, np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            r = rows[i]
            for t in range(T):
                out[i, t] = _dot_q4_0(raw[r], d[r], X[xi[i] + t], acc)


# --- Q5_0 ----------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=True)
def _dot_q5_0(w, d, x, acc):
    acc[:] = 0.0
    for b in range(d.shape[0]):
        db = d[b]
        o = b * 22
        qh = (
            np.uint32(w[o + 2]) | (np.uint32(w[o + 3]) << 8) | (np.uint32(w[o + 4]) << 16) | (np.uint32(w[o + 5]) << 24)
        )
        o += 6
        xo = b * 32
        for l in range(16):
            v = np.uint32(w[o + l])
            lo = (v & 15) | (((qh >> l) & 1) << 4)
            hi = (v >> 4) | (((qh >> (l + 16)) & 1) << 4)
            acc[l] += (db * np.float32(np.int32(lo) - 16)) * x[xo + l]
            acc[16 + l] += (db * np.float32(np.int32(hi) - 16)) * x[xo + 16 + l]
    return _reduce(acc)


@njit(cache=True, nogil=True, parallel=True)
def gemv_q5_0_f(raw, d, rows, xi, X, out):
    M, T = out.shape
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(32, np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            r = rows[i]
            for t in range(T):
                out[i, t] = _dot_q5_0(raw[r], d[r], X[xi[i] + t], acc)
