"""One place that picks the kernel for a weight type; the public CPU matmul entry points.

All kernels share one gather form, so decode GEMV, prefill matmul and routed experts are the
same call with different index arrays::

    out[i, t] = W[rows[i]] · x[xi[i] + t]      rows, xi int64 [M]; out float32 [M, T]

``q8_act=False`` multiplies by the exactly dequantized weights; ``q8_act=True`` first rounds the
activations as llama.cpp's CPU backend does (see ``engine.kernels.reference``).
"""

from __future__ import annotations

import numpy as np

from engine.kernels import floats, kquants, legacy
from engine.kernels.prepare import PreparedWeight
from engine.kernels.reference import round_to_bf16, round_to_f16
from engine.quant.formats import QType


def _block_sums(X: np.ndarray, size: int) -> np.ndarray:
    """X float32 [K, n] -> float32 [K, n/size] sums of consecutive blocks."""
    return X.reshape(X.shape[0], -1, size).sum(axis=-1, dtype=np.float32)


def _run_exact(w: PreparedWeight, X: np.ndarray, rows: np.ndarray, xi: np.ndarray, out: np.ndarray):
    q, raw, s = w.qtype, w.raw, w.scales
    if q == QType.F32:
        floats.gemv_f32(raw, rows, xi, X, out)
    elif q == QType.F16:
        floats.gemv_f16(raw, rows, xi, X, out)
    elif q == QType.BF16:
        floats.gemv_bf16(raw, rows, xi, X, out)
    elif q == QType.Q8_0:
        legacy.gemv_q8_0_f(raw, s, rows, xi, X, out)
    elif q == QType.Q4_0:
        legacy.gemv_q4_0_f(raw, s, rows, xi, X, out)
    elif q == QType.Q5_0:
        legacy.gemv_q5_0_f(raw, s, rows, xi, X, out)
    elif q == QType.Q4_K:
        kquants.gemv_q4_k_f(raw, s, rows, xi, X, _block_sums(X, 32), out)
    elif q == QType.Q5_K:
        kquants.gemv_q5_k_f(raw, s, rows, xi, X, _block_sums(X, 32), out)
    elif q == QType.Q6_K:
        kquants.gemv_q6_k_f(raw, s, rows, xi, X, out)
    else:  # prepare_weight rejects other types
        raise AssertionError(q)


def _round_activations(qtype: QType, X: np.ndarray) -> np.ndarray:
    """The float activation rounding llama.cpp applies for float weights (vec_dot_type)."""
    if qtype == QType.F16:
        return round_to_f16(X)
    if qtype == QType.BF16:
        return round_to_bf16(X)
    return X


def gemv_rows(
    w: PreparedWeight, X: np.ndarray, rows: np.ndarray, xi: np.ndarray, T: int = 1, *, q8_act: bool
) -> np.ndarray:
    """The gather form: out[i, t] = W[rows[i]] · X[xi[i] + t].

    X float32 [K, n]; rows int64 [M] (global row ids, expert e's row r is e·out + r);
    xi int64 [M] (first activation row of output i); T tokens per output row.
    Returns float32 [M, T].
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    xi = np.ascontiguousarray(xi, dtype=np.int64)
    out = np.empty((rows.shape[0], T), np.float32)
    if q8_act and w.qtype in (QType.F16, QType.BF16):
        X = _round_activations(w.qtype, X)
    if q8_act and w.qtype not in (QType.F32, QType.F16, QType.BF16):
        from engine.kernels import q8

        q8.run(w, X, rows, xi, out)
    else:
        _run_exact(w, X, rows, xi, out)
    return out


def matvec(w: PreparedWeight, x: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """y = W·x. w: one matrix [R, n] (all R rows of a stack); x float32 [n] -> y float32 [R]."""
    R = w.raw.shape[0]
    rows = np.arange(R, dtype=np.int64)
    return gemv_rows(w, x[None, :], rows, np.zeros(R, np.int64), 1, q8_act=q8_act)[:, 0]


def matmul(w: PreparedWeight, X: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """Y = X·Wᵀ. X float32 [T, n] -> Y float32 [T, R]."""
    R = w.raw.shape[0]
    T = X.shape[0]
    rows = np.arange(R, dtype=np.int64)
    return np.ascontiguousarray(gemv_rows(w, X, rows, np.zeros(R, np.int64), T, q8_act=q8_act).T)
