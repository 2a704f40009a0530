"""Fused routed-expert kernels for the Q8-activation path: two numba calls per layer.

``moe_gate_up_q8`` computes h = SiLU(gate·x) ⊙ (up·x) for the K chosen experts in one parallel
loop (gate and up rows read side by side) and quantizes h for the down projection;
``moe_down_q8`` runs the K down projections and their weighted sum. Each picks the row kernel
by ggml type id inside numba (``_row_q8``), so one compiled function serves every quantized type
and no per-type, per-expert or per-step Python work remains (the 3-call path in ``moe`` costs
~10 numba dispatches and 3 parallel regions per layer, which matters on many-core machines).

Activations travel as one tuple of four arrays for both activation formats:
(qa int8 [K, n], da float32 [K, n/32 or n/256], asum int32 [K, n/32], bsums int16 [K, n/16]);
the arrays a format does not use are [K, 0].
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.kernels.activations import quantize_q8_0, quantize_q8_K
from engine.kernels.iquants import IQ_IDS, dot_q8
from engine.kernels.kquants import (
    _dot2_q4_k_q8,
    _dot_iq4_xs_q8,
    _dot_q2_k_q8,
    _dot_q3_k_q8,
    _dot_q4_k_q8,
    _dot_q5_k_q8,
    _dot_q6_k_q8,
)
from engine.kernels.legacy import _dot_iq4_nl_q8, _dot_mxfp4_q8, _dot_q4_0_q8, _dot_q5_0_q8, _dot_q8_0_q8
from engine.kernels.simd import prefetch, prefetch_array, prefetch_distance
from engine.quant.formats import WEIGHT_TYPES, QType, block_format

FUSED_TYPES = tuple(t for t in WEIGHT_TYPES if block_format(t).block_size > 1)  # every block type we load
_K_IDS = (
    int(QType.Q2_K),
    int(QType.Q3_K),
    int(QType.Q4_K),
    int(QType.Q5_K),
    int(QType.Q6_K),
    int(QType.IQ4_XS),
    *IQ_IDS,
)
CHUNK = 16


@njit(cache=True, nogil=True, inline="always")
def _row_q8(qt, w, s, qa, da, asum, bsums):
    """One weight row of ggml type ``qt`` against one quantized activation row."""
    if qt == 12:
        return _dot_q4_k_q8(w, s, qa, da, bsums)
    if qt == 13:
        return _dot_q5_k_q8(w, s, qa, da, bsums)
    if qt == 14:
        return _dot_q6_k_q8(w, s, qa, da, bsums)
    if qt == 11:
        return _dot_q3_k_q8(w, s, qa, da, bsums)
    if qt == 10:
        return _dot_q2_k_q8(w, s, qa, da, bsums)
    if qt == 8:
        return _dot_q8_0_q8(w, s, qa, da, asum)
    if qt == 2:
        return _dot_q4_0_q8(w, s, qa, da, asum)
    if qt == 6:
        return _dot_q5_0_q8(w, s, qa, da, asum)
    if qt == 39:
        return _dot_mxfp4_q8(w, s, qa, da, asum)
    if qt == 20:
        return _dot_iq4_nl_q8(w, s, qa, da, asum)
    if qt == 23:
        return _dot_iq4_xs_q8(w, s, qa, da, bsums)
    if qt == 16 or qt == 17 or qt == 18 or qt == 21 or qt == 22:  # the IQ2/IQ3 grid types
        return dot_q8(qt, w, s, qa, da)
    return np.float32(np.nan)


@njit(cache=True, nogil=True, inline="always")
def _next_pair(k, r, n):
    """The pair after (expert slot k, row r) with n rows an expert. The pair loops step through
    pairs this way instead of dividing each index by n (a 64-bit division a row cost the short
    down rows ~25 % of their time)."""
    r += 1
    if r == n:
        return k + 1, 0
    return k, r


@njit(cache=True, nogil=True)
def quantize_for(qt, X):
    """X float32 [K, n] -> the four activation arrays for weights of ggml type ``qt``."""
    K = X.shape[0]
    # Q8_K activations: the K-quants, IQ4_XS and the IQ2/IQ3 grid types
    if qt == 10 or qt == 11 or qt == 12 or qt == 13 or qt == 14 or qt == 23 or (16 <= qt <= 18 or 21 <= qt <= 22):
        qa, da, bsums = quantize_q8_K(X)
        return qa, da, np.empty((K, 0), np.int32), bsums
    qa, da, asum = quantize_q8_0(X)
    return qa, da, asum, np.empty((K, 0), np.int16)


@njit(cache=True, nogil=True, parallel=True)
def moe_gate_up_q8(qt, graw, gs, uraw, us, ids, qa, da, asum, bsums, F, qt_down):
    """h[k] = SiLU(gate[ids[k]]·x) ⊙ (up[ids[k]]·x), then h quantized for the down type.

    graw/uraw uint8 [E·F, row_bytes] (gate, up of one type ``qt``); gs/us their scales;
    ids int64 [K]; (qa, da, asum, bsums) the quantized x (one row). Returns (h float32 [K, F],
    and h's four activation arrays for type ``qt_down``).
    """
    K = ids.shape[0]
    M = K * F
    h = np.empty((K, F), np.float32)
    ahead = prefetch_distance(graw)
    for c in prange((M + CHUNK - 1) // CHUNK):
        i0 = c * CHUNK
        k, f = i0 // F, i0 % F  # pair i = k·F + f: expert slot k, row f (one division a chunk)
        j = i0 + ahead  # the pair to prefetch, as (kj, fj)
        kj, fj = j // F, j % F
        for _ in range(i0, min(M, i0 + CHUNK)):
            if j < M:
                rj = ids[kj] * F + fj
                prefetch_array(graw[rj])
                prefetch_array(uraw[rj])
                prefetch(gs[rj], 0)
                prefetch(us[rj], 0)
            r = ids[k] * F + f
            if qt == 12:  # gate and up rows side by side on one activation load
                g, u = _dot2_q4_k_q8(graw[r], gs[r], uraw[r], us[r], qa[0], da[0], bsums[0])
            else:
                g = _row_q8(qt, graw[r], gs[r], qa[0], da[0], asum[0], bsums[0])
                u = _row_q8(qt, uraw[r], us[r], qa[0], da[0], asum[0], bsums[0])
            h[k, f] = g / (np.float32(1.0) + np.exp(-g)) * u
            k, f = _next_pair(k, f, F)
            j += 1
            kj, fj = _next_pair(kj, fj, F)
    qa2, da2, asum2, bsums2 = quantize_for(qt_down, h)
    return h, qa2, da2, asum2, bsums2


@njit(cache=True, nogil=True, parallel=True)
def moe_down_q8(qt, draw, ds, ids, weights, qa, da, asum, bsums, D):
    """y = Σ_k weights[k]·down[ids[k]]·h[k] (k in order). draw uint8 [E·D, row_bytes];
    (qa, da, asum, bsums) the quantized h [K, F]. Returns float32 [D]."""
    K = ids.shape[0]
    M = K * D
    o = np.empty(M, np.float32)
    ahead = prefetch_distance(draw)
    pairs = qt == 12 and D % 2 == 0 and CHUNK % 2 == 0  # Q4_K: rows d, d+1 of one expert together
    for c in prange((M + CHUNK - 1) // CHUNK):
        i0 = c * CHUNK
        i1 = min(M, i0 + CHUNK)
        k, d = i0 // D, i0 % D  # as in moe_gate_up_q8: one division a chunk
        j = i0 + ahead
        kj, dj = j // D, j % D
        step = 2 if pairs else 1
        for i in range(i0, i1, step):
            for _ in range(step):
                if j < M:
                    rj = ids[kj] * D + dj
                    prefetch_array(draw[rj])
                    prefetch(ds[rj], 0)
                j += 1
                kj, dj = _next_pair(kj, dj, D)
            r = ids[k] * D + d
            if pairs:
                o[i], o[i + 1] = _dot2_q4_k_q8(draw[r], ds[r], draw[r + 1], ds[r + 1], qa[k], da[k], bsums[k])
                d += 1
            else:
                o[i] = _row_q8(qt, draw[r], ds[r], qa[k], da[k], asum[k], bsums[k])
            k, d = _next_pair(k, d, D)
    y = np.zeros(D, np.float32)
    for k in range(K):
        w = np.float32(weights[k])
        for d in range(D):
            y[d] += w * o[k * D + d]
    return y
