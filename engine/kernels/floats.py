"""GEMV kernels for float weights: F32, F16 and BF16 (F16/BF16 as uint16 bit patterns).

Gather signature shared by all families (see ``engine.kernels.dispatch``)::

    kernel(W [R, n], rows int64 [M], xi int64 [M], X float32 [K, n], out float32 [M, T])
    out[i, t] = W[rows[i]] · X[xi[i] + t]

Weights are widened exactly to float32 in registers (F16 through the hardware half→float
conversion, BF16 by a 16-bit shift); products are accumulated lane-wise in float32 over four
independent F32x8 accumulators. llama.cpp rounds activations to F16/BF16 before
``ggml_vec_dot_f16``/``_bf16``; the dispatcher applies that rounding to X for ``q8_act``, so one
kernel serves both variants.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.kernels.simd import (
    hsum_f32,
    load_bf16x8,
    load_f16x8,
    load_f32x8,
    prefetch_array,
    prefetch_distance,
    vadd,
    vfma,
    zero_f32,
)

CHUNK = 16  # rows per parallel work item


@njit(cache=True, nogil=True)
def f16_bits_to_f32(h):
    """One fp16 bit pattern -> float32 (scalar; used for row tails)."""
    h = np.int64(h)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = m * 2.0**-24
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = (1024 + m) * 2.0 ** (e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(cache=True, nogil=True)
def bf16_bits_to_f32(h):
    """One bf16 bit pattern -> float32 (scalar; used for row tails)."""
    buf = np.empty(1, np.uint32)
    buf[0] = np.uint32(h) << 16
    return buf.view(np.float32)[0]


@njit(cache=True, nogil=True)
def _dot_f32(w, x):
    n = x.shape[0]
    n32 = n - n % 32
    a0 = zero_f32()
    a1 = zero_f32()
    a2 = zero_f32()
    a3 = zero_f32()
    for o in range(0, n32, 32):
        a0 = vfma(load_f32x8(w, o), load_f32x8(x, o), a0)
        a1 = vfma(load_f32x8(w, o + 8), load_f32x8(x, o + 8), a1)
        a2 = vfma(load_f32x8(w, o + 16), load_f32x8(x, o + 16), a2)
        a3 = vfma(load_f32x8(w, o + 24), load_f32x8(x, o + 24), a3)
    s = hsum_f32(vadd(vadd(a0, a1), vadd(a2, a3)))
    for j in range(n32, n):
        s += w[j] * x[j]
    return s


@njit(cache=True, nogil=True)
def _dot_f16(w, x):
    n = x.shape[0]
    n32 = n - n % 32
    a0 = zero_f32()
    a1 = zero_f32()
    a2 = zero_f32()
    a3 = zero_f32()
    for o in range(0, n32, 32):
        a0 = vfma(load_f16x8(w, o), load_f32x8(x, o), a0)
        a1 = vfma(load_f16x8(w, o + 8), load_f32x8(x, o + 8), a1)
        a2 = vfma(load_f16x8(w, o + 16), load_f32x8(x, o + 16), a2)
        a3 = vfma(load_f16x8(w, o + 24), load_f32x8(x, o + 24), a3)
    s = hsum_f32(vadd(vadd(a0, a1), vadd(a2, a3)))
    for j in range(n32, n):
        s += f16_bits_to_f32(w[j]) * x[j]
    return s


@njit(cache=True, nogil=True)
def _dot_bf16(w, x):
    n = x.shape[0]
    n32 = n - n % 32
    a0 = zero_f32()
    a1 = zero_f32()
    a2 = zero_f32()
    a3 = zero_f32()
    for o in range(0, n32, 32):
        a0 = vfma(load_bf16x8(w, o), load_f32x8(x, o), a0)
        a1 = vfma(load_bf16x8(w, o + 8), load_f32x8(x, o + 8), a1)
        a2 = vfma(load_bf16x8(w, o + 16), load_f32x8(x, o + 16), a2)
        a3 = vfma(load_bf16x8(w, o + 24), load_f32x8(x, o + 24), a3)
    s = hsum_f32(vadd(vadd(a0, a1), vadd(a2, a3)))
    for j in range(n32, n):
        s += bf16_bits_to_f32(w[j]) * x[j]
    return s


@njit(cache=True, nogil=True, parallel=True)
def gemv_f32(W, rows, xi, X, out):
    M, T = out.shape
    ahead = prefetch_distance(W)
    for c in prange((M + CHUNK - 1) // CHUNK):
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            j = i + ahead  # stream the weights: request row rows[j] now
            if j < M:
                prefetch_array(W[rows[j]])
            for t in range(T):
                out[i, t] = _dot_f32(W[rows[i]], X[xi[i] + t])


@njit(cache=True, nogil=True, parallel=True)
def gemv_f16(W, rows, xi, X, out):
    M, T = out.shape
    ahead = prefetch_distance(W)
    for c in prange((M + CHUNK - 1) // CHUNK):
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            j = i + ahead  # stream the weights: request row rows[j] now
            if j < M:
                prefetch_array(W[rows[j]])
            for t in range(T):
                out[i, t] = _dot_f16(W[rows[i]], X[xi[i] + t])


@njit(cache=True, nogil=True, parallel=True)
def gemv_bf16(W, rows, xi, X, out):
    M, T = out.shape
    ahead = prefetch_distance(W)
    for c in prange((M + CHUNK - 1) // CHUNK):
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            j = i + ahead  # stream the weights: request row rows[j] now
            if j < M:
                prefetch_array(W[rows[j]])
            for t in range(T):
                out[i, t] = _dot_bf16(W[rows[i]], X[xi[i] + t])
