"""Routed experts for one token: gate/up, SiLU(gate)·up and down over the chosen experts.

The stacked tensors stay as they are in the GGUF (``[E, out, in]``, one ``PreparedWeight`` each);
expert e's row r is global row e·out + r, so all K experts of a matrix are one gather-GEMV call
(``engine.kernels.dispatch.gemv_acts``) — three kernel calls per layer instead of 3·K.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.dispatch import gemv_acts, prepare_activations
from engine.kernels.prepare import PreparedWeight


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SiLU(g)·u in float32 (g, u float32 [...])."""
    with np.errstate(over="ignore"):  # exp(-g) = inf for very negative g gives SiLU = -0
        return (g / (np.float32(1.0) + np.exp(-g)) * u).astype(np.float32, copy=False)


def moe_ffn(
    gate: PreparedWeight,
    up: PreparedWeight,
    down: PreparedWeight,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    q8_act: bool,
) -> np.ndarray:
    """y = Σ_k weights[k] · down[ids[k]] · (SiLU(gate[ids[k]]·x) ⊙ up[ids[k]]·x).

    gate, up: stacks [E, F, D]; down: stack [E, D, F]; x float32 [D]; ids int [K];
    weights float32 [K] (routing is the caller's business). Returns float32 [D].
    The sum runs over k in the given order.
    """
    F = gate.rows
    D = down.rows
    K = len(ids)
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(weights) != K or (K and (ids.min() < 0 or ids.max() >= gate.n_experts)):
        raise IndexError(f"expert ids {ids} must be K = {len(weights)} values in [0, {gate.n_experts})")
    if up.shape != gate.shape or down.shape != (gate.n_experts, D, F) or x.shape != (D,):
        raise ValueError(f"stacks {gate.shape}, {up.shape}, {down.shape} and x {x.shape} do not fit")
    rows_gu = (ids[:, None] * F + np.arange(F)).ravel()  # [K·F]
    zeros = np.zeros(K * F, np.int64)
    acts = prepare_activations(gate.qtype, x[None, :], q8_act=q8_act)
    g = gemv_acts(gate, acts, rows_gu, zeros, q8_act=q8_act)
    if up.qtype != gate.qtype:
        acts = prepare_activations(up.qtype, x[None, :], q8_act=q8_act)
    u = gemv_acts(up, acts, rows_gu, zeros, q8_act=q8_act)
    h = silu_mul(g, u).reshape(K, F)  # [K, F]
    rows_d = (ids[:, None] * D + np.arange(D)).ravel()  # [K·D]
    xi = np.repeat(np.arange(K, dtype=np.int64), D)
    o = gemv_acts(down, prepare_activations(down.qtype, h, q8_act=q8_act), rows_d, xi, q8_act=q8_act)
    y = np.zeros(D, np.float32)
    for k in range(K):  # top-k order
        y += np.float32(weights[k]) * o[k * D : (k + 1) * D, 0]
    return y
