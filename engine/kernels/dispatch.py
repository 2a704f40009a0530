"""One place that picks the kernel for a weight type; the public CPU matmul entry points.

All kernels share one gather form, so decode GEMV, prefill matmul and routed experts are the
same call with different index arrays::

    out[i, t] = W[rows[i]] · x[xi[i] + t]      rows, xi int64 [M]; out float32 [M, T]

``q8_act=False`` multiplies by the exactly dequantized weights; ``q8_act=True`` first rounds the
activations as llama.cpp's CPU backend does (see ``engine.kernels.reference``, which implements
the same signatures in numpy: ``matvec_ref``, ``matmul_ref``, ``moe_ffn_ref``).
"""

from __future__ import annotations

import functools

import numpy as np

from engine.kernels import floats, iquants, kquants, kquants_exact, legacy
from engine.kernels.activations import quantize_q8_0, quantize_q8_K
from engine.kernels.prepare import PreparedWeight
from engine.kernels.reference import round_to_bf16, round_to_f16
from engine.quant.formats import QType

# qtype -> (exact-float kernel, q8-activation kernel); float types have one kernel for both.
KERNELS = {
    QType.F32: (floats.gemv_f32, floats.gemv_f32),
    QType.F16: (floats.gemv_f16, floats.gemv_f16),
    QType.BF16: (floats.gemv_bf16, floats.gemv_bf16),
    QType.Q8_0: (legacy.gemv_q8_0_f, legacy.gemv_q8_0_q8),
    QType.Q4_0: (legacy.gemv_q4_0_f, legacy.gemv_q4_0_q8),
    QType.Q5_0: (legacy.gemv_q5_0_f, legacy.gemv_q5_0_q8),
    QType.MXFP4: (legacy.gemv_mxfp4_f, legacy.gemv_mxfp4_q8),
    QType.IQ4_NL: (legacy.gemv_iq4_nl_f, legacy.gemv_iq4_nl_q8),
    QType.IQ4_XS: (kquants_exact.gemv_iq4_xs_f, kquants.gemv_iq4_xs_q8),
    QType.Q2_K: (kquants_exact.gemv_q2_k_f, kquants.gemv_q2_k_q8),
    QType.Q3_K: (kquants_exact.gemv_q3_k_f, kquants.gemv_q3_k_q8),
    QType.Q4_K: (kquants_exact.gemv_q4_k_f, kquants.gemv_q4_k_q8),
    QType.Q5_K: (kquants_exact.gemv_q5_k_f, kquants.gemv_q5_k_q8),
    QType.Q6_K: (kquants_exact.gemv_q6_k_f, kquants.gemv_q6_k_q8),
    **iquants.KERNELS,  # IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (Q8_K activations)
}
_FLOAT = (QType.F32, QType.F16, QType.BF16)
_LEGACY = (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.MXFP4, QType.IQ4_NL)  # Q8_0 activations
_MINS = {QType.Q4_K: 32, QType.Q5_K: 32, QType.Q2_K: 16}  # exact kernels: sums of x over each sub-block


def prepare_activations(qtype: QType, X: np.ndarray, *, q8_act: bool) -> tuple[np.ndarray, ...]:
    """X float32 [K, n] -> the activation arrays the ``qtype`` kernel takes after ``xi``.

    exact: (X,) or (X, Xs) for Q4_K/Q5_K (Xs [K, n/32]) and Q2_K (Xs [K, n/16]). q8_act: float types (X rounded to the
    weight's float type,); Q8_0/Q4_0/Q5_0 (qa, da, asum); K-quants (qa, da, bsums).
    Compute once and reuse for every weight of the same type that reads the same X.
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    if qtype in _FLOAT:
        if q8_act and qtype == QType.F16:
            return (round_to_f16(X),)
        if q8_act and qtype == QType.BF16:
            return (round_to_bf16(X),)
        return (X,)
    if not q8_act:
        if qtype in _MINS:
            return X, X.reshape(X.shape[0], -1, _MINS[qtype]).sum(axis=-1, dtype=np.float32)
        return (X,)
    if qtype in _LEGACY:
        return quantize_q8_0(X)
    return quantize_q8_K(X)


def gemv_acts(
    w: PreparedWeight, acts: tuple[np.ndarray, ...], rows: np.ndarray, xi: np.ndarray, T: int = 1, *, q8_act: bool
) -> np.ndarray:
    """``gemv_rows`` with activations already prepared by ``prepare_activations``.

    No index checks (see ``check_indices``): for callers that built rows/xi themselves.
    """
    out = np.empty((rows.shape[0], T), np.float32)
    kernel = KERNELS[w.qtype][1 if q8_act else 0]
    if w.qtype in _FLOAT:
        kernel(w.raw, rows, xi, *acts, out)
    else:
        kernel(w.raw, w.scales, rows, xi, *acts, out)
    return out


def gemv_rows(
    w: PreparedWeight, X: np.ndarray, rows: np.ndarray, xi: np.ndarray, T: int = 1, *, q8_act: bool
) -> np.ndarray:
    """The gather form: out[i, t] = W[rows[i]] · X[xi[i] + t].

    X float32 [K, n]; rows int64 [M] (global row ids: row r of expert e is e·out + r);
    xi int64 [M] (first activation row of output i); T tokens per output row.
    Returns float32 [M, T].
    """
    if X.ndim != 2 or X.shape[1] != w.n:
        raise ValueError(f"activations of shape {X.shape} do not fit a weight of {w.n} inputs")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    xi = np.ascontiguousarray(xi, dtype=np.int64)
    check_indices(w, rows, xi, T, X.shape[0])
    acts = prepare_activations(w.qtype, X, q8_act=q8_act)
    return gemv_acts(w, acts, rows, xi, T, q8_act=q8_act)


def check_indices(w: PreparedWeight, rows: np.ndarray, xi: np.ndarray, T: int, K: int) -> None:
    """The kernels do not bounds-check: refuse indices outside W or X before calling them."""
    if rows.shape != xi.shape or rows.ndim != 1:
        raise ValueError(f"rows {rows.shape} and xi {xi.shape} must be 1-D of one length")
    if rows.size and (rows.min() < 0 or rows.max() >= w.raw.shape[0]):
        raise IndexError(f"row ids must lie in [0, {w.raw.shape[0]})")
    if T < 1 or (xi.size and (xi.min() < 0 or xi.max() + T > K)):
        raise IndexError(f"activation rows xi..xi+{T} must lie in [0, {K})")


@functools.lru_cache(maxsize=64)
def _all_rows(R: int) -> tuple[np.ndarray, np.ndarray]:
    """(arange(R), zeros(R)) int64, built once per R (internal: never written to; left writable so
    the kernels see one array type and compile once)."""
    return np.arange(R, dtype=np.int64), np.zeros(R, np.int64)


def matvec(w: PreparedWeight, x: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """y = W·x. w: a matrix [R, n] (a stack counts as its R = E·out rows); x float32 [n] -> [R]."""
    if x.shape != (w.n,):
        raise ValueError(f"x of shape {x.shape} does not fit a weight of {w.n} inputs")
    rows, zeros = _all_rows(w.raw.shape[0])
    acts = prepare_activations(w.qtype, x[None, :], q8_act=q8_act)
    return gemv_acts(w, acts, rows, zeros, 1, q8_act=q8_act)[:, 0]


def matmul(w: PreparedWeight, X: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """Y = X·Wᵀ. X float32 [T, n] (T ≥ 1) -> Y float32 [T, R]."""
    if X.ndim != 2 or X.shape[1] != w.n or X.shape[0] < 1:
        raise ValueError(f"X of shape {X.shape} does not fit a weight of {w.n} inputs")
    rows, zeros = _all_rows(w.raw.shape[0])
    acts = prepare_activations(w.qtype, X, q8_act=q8_act)
    return np.ascontiguousarray(gemv_acts(w, acts, rows, zeros, X.shape[0], q8_act=q8_act).T)
