"""GEMV kernels for float weights: F32, F16 and BF16 (stored as uint16 bit patterns).

Every kernel has the gather signature shared by all families (see ``engine.kernels.dispatch``)::

    kernel(W [R, n], rows int64 [M], xi int64 [M], X float32 [K, n], out float32 [M, T])
    out[i, t] = W[rows[i]] · X[xi[i] + t]

llama.cpp rounds activations to F16/BF16 before ``ggml_vec_dot_f16``/``_bf16``; the dispatcher
does that rounding on X, so one kernel serves both variants. Products and sums are float32,
lane-wise over 32 lanes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

LANES = 32
CHUNK = 8  # rows per parallel work item


@njit(cache=True, nogil=True, fastmath=True)
def _reduce(acc):
    s = np.float32(0.0)
    for l in range(acc.shape[0]):
        s += acc[l]
    return s


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def gemv_f32(W, rows, xi, X, out):
    M, T = out.shape
    n = X.shape[1]
    n32 = n - n % LANES
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(LANES, np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            w = W[rows[i]]
            for t in range(T):
                x = X[xi[i] + t]
                acc[:] = 0.0
                for o in range(0, n32, LANES):
                    for l in range(LANES):
                        acc[l] += w[o + l] * x[o + l]
                for j in range(n32, n):  # tail of a row that is not a multiple of 32
                    acc[0] += w[j] * x[j]
                out[i, t] = _reduce(acc)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def gemv_bf16(W, rows, xi, X, out):
    M, T = out.shape
    n = X.shape[1]
    n32 = n - n % LANES
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(LANES, np.float32)
        bits = np.empty(LANES, np.uint32)
        wf = bits.view(np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            w = W[rows[i]]
            for t in range(T):
                x = X[xi[i] + t]
                acc[:] = 0.0
                for o in range(0, n32, LANES):
                    for l in range(LANES):
                        bits[l] = np.uint32(w[o + l]) << 16  # bf16 is the top half of an f32
                    for l in range(LANES):
                        acc[l] += wf[l] * x[o + l]
                for j in range(n32, n):
                    bits[0] = np.uint32(w[j]) << 16
                    acc[0] += wf[0] * x[j]
                out[i, t] = _reduce(acc)


@njit(cache=True, nogil=True)
def _f16_to_f32(h16, bits, wf):
    """One fp16 bit pattern -> float32 (scalar path for row tails), via ``bits``/``wf`` scratch."""
    h = np.uint32(h16)
    em = h & np.uint32(0x7FFF)
    b = (em << 13) | ((h & np.uint32(0x8000)) << 16)
    if em >= 0x7C00:
        b += np.uint32(0x38000000)
    bits[0] = b
    return wf[0] * np.float32(5.192296858534828e33)


@njit(cache=True, nogil=True, parallel=True)
def gemv_f16(W, rows, xi, X, out):
    # fp16 -> f32 without float16 support: move exponent+mantissa into place (<< 13), then
    # multiply by 2^112 to re-bias the exponent (this also scales subnormals exactly); inf/NaN
    # get their exponent pre-raised so the multiply lands on 255. No fastmath: keep subnormals.
    M, T = out.shape
    n = X.shape[1]
    n32 = n - n % LANES
    two112 = np.float32(5.192296858534828e33)  # 2**112
    for c in prange((M + CHUNK - 1) // CHUNK):
        acc = np.empty(LANES, np.float32)
        bits = np.empty(LANES, np.uint32)
        wf = bits.view(np.float32)
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            w = W[rows[i]]
            for t in range(T):
                x = X[xi[i] + t]
                acc[:] = 0.0
                for o in range(0, n32, LANES):
                    for l in range(LANES):
                        h = np.uint32(w[o + l])
                        em = h & np.uint32(0x7FFF)
                        b = (em << 13) | ((h & np.uint32(0x8000)) << 16)
                        if em >= 0x7C00:
                            b += np.uint32(0x38000000)
                        bits[l] = b
                    for l in range(LANES):
                        acc[l] += (wf[l] * two112) * x[o + l]
                for j in range(n32, n):
                    acc[0] += _f16_to_f32(w[j], bits, wf) * x[j]
                out[i, t] = _reduce(acc)
