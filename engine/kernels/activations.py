"""Activation quantization for the Q8-activation kernels, as llama.cpp's CPU backend does it.

numba versions of ``reference.quantize_q8_0_ref`` / ``quantize_q8_K_ref`` (the tests hold them
equal bit for bit):

* ``quantize_q8_0``: ggml x86 ``quantize_row_q8_0`` (AVX path): per 32 values, amax in float32,
  d = amax/127 stored as fp16, codes = round-half-even(x · (127/amax)). The kernels multiply by
  the fp16-rounded d, as ggml does.
* ``quantize_q8_K``: ggml ``quantize_row_q8_K_ref`` (what x86 uses): per 256 values, ``max`` is
  the signed value of largest magnitude (first one on ties), iscale = −127/max,
  codes = min(127, nearest_int(iscale·x)), d = 1/iscale (float32, negative when max > 0), and
  bsums = sums of each 16 codes.

A block that holds a NaN or an infinity gets the scale NaN and zero codes (both functions): every dot
product over it is NaN, so a broken activation reaches the logits' finite check instead of being rounded
into finite codes (or dividing by zero).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def round_f16(v):
    """float32 -> the nearest fp16 value (ties to even), returned as float32."""
    a = abs(np.float64(v))
    if a >= 65520.0:  # halfway between 65504 and 2^16 rounds (to even) up to infinity
        r = math.inf if not math.isnan(a) else a
    elif a < 2.0**-14:  # fp16 subnormals: fixed quantum 2^-24
        r = np.rint(a * 2.0**24) * 2.0**-24
    else:
        _, e = math.frexp(a)  # a = m·2^e, 0.5 ≤ m < 1: 11 significant bits -> quantum 2^(e-11)
        q = 2.0 ** (e - 11)
        r = np.rint(a / q) * q
    return np.float32(-r if v < 0 else r)


@njit(cache=True, nogil=True)
def quantize_q8_0(X):
    """X float32 [K, n] (n % 32 == 0) -> (qa int8 [K, n], da float32 [K, n/32], asum int32 [K, n/32]).

    ``asum`` holds the sums of the codes of each block (for the −8/−16 offsets of Q4_0/Q5_0).
    """
    K, n = X.shape
    nb = n // 32
    qa = np.empty((K, n), np.int8)
    da = np.empty((K, nb), np.float32)
    asum = np.empty((K, nb), np.int32)
    c127 = np.float32(127.0)
    for k in range(K):
        for b in range(nb):
            amax = np.float32(0.0)
            z = np.float32(0.0)  # 0, or NaN when the block holds a NaN or an infinity
            for l in range(32):
                amax = max(amax, abs(X[k, 32 * b + l]))
                z += X[k, 32 * b + l] * np.float32(0.0)
            if z != 0:
                qa[k, 32 * b : 32 * b + 32] = 0
                da[k, b] = np.nan
                asum[k, b] = 0
                continue
            da[k, b] = round_f16(amax / c127)
            iscale = c127 / amax if amax != 0 else np.float32(0.0)
            t = 0
            for l in range(32):
                v = np.int8(min(127.0, max(-128.0, np.rint(X[k, 32 * b + l] * iscale))))
                qa[k, 32 * b + l] = v
                t += v
            asum[k, b] = t
    return qa, da, asum


@njit(cache=True, nogil=True)
def quantize_q8_K(X):
    """X float32 [K, n] (n % 256 == 0) -> (qa int8 [K, n], da float32 [K, n/256], bsums int16 [K, n/16])."""
    K, n = X.shape
    nb = n // 256
    qa = np.empty((K, n), np.int8)
    da = np.empty((K, nb), np.float32)
    bsums = np.empty((K, n // 16), np.int16)
    for k in range(K):
        for b in range(nb):
            o = 256 * b
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            z = np.float32(0.0)  # 0, or NaN when the block holds a NaN or an infinity
            for l in range(256):
                ax = abs(X[k, o + l])
                z += X[k, o + l] * np.float32(0.0)
                if ax > amax:
                    amax = ax
                    mx = X[k, o + l]
            if z != 0:
                da[k, b] = np.nan
                qa[k, o : o + 256] = 0
                bsums[k, 16 * b : 16 * b + 16] = 0
                continue
            if amax == 0:
                da[k, b] = 0.0
                qa[k, o : o + 256] = 0
                bsums[k, 16 * b : 16 * b + 16] = 0
                continue
            iscale = np.float32(-127.0) / mx
            for l in range(256):
                v = np.rint(iscale * X[k, o + l])  # ggml nearest_int: round half to even
                qa[k, o + l] = np.int8(min(127.0, v))
            for g in range(16):
                s = 0
                for l in range(16):
                    s += qa[k, o + 16 * g + l]
                bsums[k, 16 * b + g] = s
            da[k, b] = np.float32(1.0) / iscale
    return qa, da, bsums
