"""The two kernel entry points the model math calls, in one visible place.

``matmul`` and ``moe_ffn`` route to the numba kernels; ``SHARPI_KERNELS=reference`` (or
``use_reference(True)``) selects the numpy reference models with the same signatures.
"""

from __future__ import annotations

import os

import numpy as np

from engine.kernels import reference as ref
from engine.kernels.prepare import PreparedWeight

_use_reference = os.environ.get("SHARPI_KERNELS", "").lower() == "reference"


def use_reference(flag: bool) -> None:
    global _use_reference
    _use_reference = flag


def matmul(w: PreparedWeight, X: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """Y = X·Wᵀ: X float32 [T, n] -> float32 [T, rows]."""
    if _use_reference:
        return ref.matmul_ref(w.qtype, w.raw, X, q8_act=q8_act)
    from engine.kernels import dispatch

    return dispatch.matmul(w, X, q8_act=q8_act)


def moe_ffn(
    gate: PreparedWeight,
    up: PreparedWeight,
    down: PreparedWeight,
    X: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    q8_act: bool,
) -> np.ndarray:
    """Routed experts for T tokens: X float32 [T, D], ids int64 [T, K], weights float32 [T, K] -> [T, D]."""
    if _use_reference:
        E = gate.n_experts
        g, u, d = (w.raw.reshape(E, w.rows, -1) for w in (gate, up, down))
        qts = (gate.qtype, up.qtype, down.qtype)
        return np.stack([ref.moe_ffn_ref(qts, g, u, d, X[t], ids[t], weights[t], q8_act=q8_act) for t in range(len(X))])
    from engine.kernels import dispatch

    fused = getattr(dispatch, "moe_ffn", None)
    if fused is not None:
        return fused(gate, up, down, X, ids, weights, q8_act=q8_act)
    return _moe_ffn_gather(gate, up, down, X, ids, weights, q8_act=q8_act)


def _moe_ffn_gather(gate, up, down, X, ids, weights, *, q8_act):
    """Per token: the K experts' gate/up rows in one gathered GEMV, then their down rows."""
    from engine.kernels.dispatch import gemv_rows

    T, K = ids.shape
    F, D = gate.rows, down.rows
    Y = np.zeros((T, D), np.float32)
    for t in range(T):
        e = ids[t].astype(np.int64)
        rows = (e[:, None] * F + np.arange(F)).reshape(-1)  # [K*F]
        zero = np.zeros(len(rows), np.int64)
        g = gemv_rows(gate, X[t : t + 1], rows, zero, 1, q8_act=q8_act).reshape(K, F)
        u = gemv_rows(up, X[t : t + 1], rows, zero, 1, q8_act=q8_act).reshape(K, F)
        h = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)  # [K, F]
        drows = (e[:, None] * D + np.arange(D)).reshape(-1)  # [K*D]
        xi = np.repeat(np.arange(K, dtype=np.int64), D)
        d = gemv_rows(down, h, drows, xi, 1, q8_act=q8_act).reshape(K, D)
        acc = np.zeros(D, np.float32)
        for k in range(K):  # sequential, in top-k order, as ggml adds the expert views
            acc += np.float32(weights[t, k]) * d[k]
        Y[t] = acc
    return Y
