"""Routed experts for one token: gate/up, SiLU(gate)·up and down over the chosen experts.

The stacked tensors stay as they are in the GGUF (``[E, out, in]``, one ``PreparedWeight`` each);
expert e's row r is global row e·out + r, so all K experts of a matrix are one gather-GEMV call
(``engine.kernels.dispatch.gemv_acts``) — three kernel calls per layer instead of 3·K. With
activations rounded as llama.cpp does and quantized experts, two fused calls do the whole layer
(``engine.kernels.moe_fused``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from engine.kernels.dispatch import gemv_acts, prepare_activations
from engine.kernels.moe_fused import FUSED_TYPES, moe_down_q8, moe_gate_up_q8, quantize_for
from engine.kernels.prepare import PreparedWeight


@dataclass(frozen=True)
class ExpertGLU:
    """Routed experts that are not plain SwiGLU: per-expert biases on the gate, up and down projections
    (float32 [E, F], [E, F], [E, D], or None) and the gated activation ``act``: "silu" (ggml_swiglu_split)
    or "swiglu_oai" (gpt-oss: ggml_swiglu_oai with ``alpha`` and ``limit``). An expert's output is then
    down·act(gate·x + bg, up·x + bu) + bd, weighted by its routing weight after the down bias (llama.cpp's
    build_moe_ffn with the ``*_exps_b`` biases)."""

    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    # device type -> the three biases as tensors there (gate, up, down; [E, ·]), set by the architecture where its
    # layer's weights live on that device (charged with the layer's trunk); the device expert pool computes with
    # them instead of uploading copies of the arrays above.
    on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def hidden(self, experts: np.ndarray, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """act(g + bg, u + bu) for rows of ``experts`` int [n]: g, u float32 [n, F] -> [n, F]."""
        if self.gate_bias is not None:
            g = g + self.gate_bias[experts]
        if self.up_bias is not None:
            u = u + self.up_bias[experts]
        return glu_act(self, g, u)

    def out(self, experts: np.ndarray, o: np.ndarray) -> np.ndarray:
        """o + bd for rows of ``experts``: o float32 [n, D]."""
        return o if self.down_bias is None else o + self.down_bias[experts]


def glu_act(glu: ExpertGLU | None, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The gated activation of ``glu`` (None: SwiGLU) on float32 arrays, in float32 as ggml's CPU ops."""
    with np.errstate(over="ignore"):
        if glu is None or glu.act == "silu":
            return (g / (np.float32(1.0) + np.exp(-g)) * u).astype(np.float32, copy=False)
        if glu.act == "swiglu_oai":  # ggml_vec_swiglu_oai: min(x, limit), clamp(y, ±limit), x·σ(αx)·(y + 1)
            x = np.minimum(g, np.float32(glu.limit))
            y = np.clip(u, np.float32(-glu.limit), np.float32(glu.limit))
            h = x / (np.float32(1.0) + np.exp(np.float32(glu.alpha) * -x))
            return (h * (y + np.float32(1.0))).astype(np.float32, copy=False)
    raise ValueError(f"unknown expert activation {glu.act!r}")


@njit(cache=True, nogil=True)
def silu_mul(g, u):
    """SiLU(g)·u: g, u float32 [M, 1] (kernel outputs) -> float32 [M]."""
    h = np.empty(g.shape[0], np.float32)
    for i in range(g.shape[0]):
        v = g[i, 0]
        h[i] = v / (np.float32(1.0) + np.exp(-v)) * u[i, 0]  # exp overflow -> inf -> SiLU = -0
    return h


@njit(cache=True, nogil=True)
def expert_rows(ids, rows_per_expert):
    """Global row ids of experts ``ids`` [K] in a stack of ``rows_per_expert``-row matrices,
    and the index of each row's expert: (rows int64 [K·rows], k int64 [K·rows])."""
    K = ids.shape[0]
    rows = np.empty(K * rows_per_expert, np.int64)
    ks = np.empty(K * rows_per_expert, np.int64)
    for k in range(K):
        for r in range(rows_per_expert):
            rows[k * rows_per_expert + r] = ids[k] * rows_per_expert + r
            ks[k * rows_per_expert + r] = k
    return rows, ks


@njit(cache=True, nogil=True)
def weighted_sum(o, weights):
    """Σ_k weights[k]·o[k] in k order: o float32 [K·D, 1] -> float32 [D]."""
    K = weights.shape[0]
    D = o.shape[0] // K
    y = np.zeros(D, np.float32)
    for k in range(K):
        w = np.float32(weights[k])
        for i in range(D):
            y[i] += w * o[k * D + i, 0]
    return y


def moe_ffn(
    gate: PreparedWeight,
    up: PreparedWeight,
    down: PreparedWeight,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    q8_act: bool,
    fused: bool = True,
    glu: ExpertGLU | None = None,
) -> np.ndarray:
    """y = Σ_k weights[k] · down[ids[k]] · (SiLU(gate[ids[k]]·x) ⊙ up[ids[k]]·x).

    gate, up: stacks [E, F, D]; down: stack [E, D, F]; x float32 [D]; ids int [K];
    weights float32 [K] (routing is the caller's business). Returns float32 [D].
    The sum runs over k in the given order. ``fused=False`` forces the 3-call path (tests); ``glu``: the
    experts' biases and activation where not plain SwiGLU (:class:`ExpertGLU`, the 3-call path).
    """
    F = gate.rows
    D = down.rows
    K = len(ids)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(weights) != K or (K and (ids.min() < 0 or ids.max() >= gate.n_experts)):
        raise IndexError(f"expert ids {ids} must be K = {len(weights)} values in [0, {gate.n_experts})")
    if up.shape != gate.shape or down.shape != (gate.n_experts, D, F) or x.shape != (D,):
        raise ValueError(f"stacks {gate.shape}, {up.shape}, {down.shape} and x {x.shape} do not fit")
    if (
        glu is None
        and fused
        and q8_act
        and gate.qtype == up.qtype
        and gate.qtype in FUSED_TYPES
        and down.qtype in FUSED_TYPES
    ):
        qx = quantize_for(int(gate.qtype), x[None, :].astype(np.float32, copy=False))
        _, *qh = moe_gate_up_q8(int(gate.qtype), gate.raw, gate.scales, up.raw, up.scales, ids, *qx, F, int(down.qtype))
        w = np.ascontiguousarray(weights, dtype=np.float32)
        return moe_down_q8(int(down.qtype), down.raw, down.scales, ids, w, *qh, D)
    rows_gu, _ = expert_rows(ids, F)  # [K·F]
    zeros = np.zeros(K * F, np.int64)
    acts = prepare_activations(gate.qtype, x[None, :], q8_act=q8_act)
    g = gemv_acts(gate, acts, rows_gu, zeros, q8_act=q8_act)
    if up.qtype != gate.qtype:
        acts = prepare_activations(up.qtype, x[None, :], q8_act=q8_act)
    u = gemv_acts(up, acts, rows_gu, zeros, q8_act=q8_act)
    h = silu_mul(g, u).reshape(K, F) if glu is None else glu.hidden(ids, g.reshape(K, F), u.reshape(K, F))
    rows_d, xi = expert_rows(ids, D)  # [K·D]; row i reads h[xi[i]]
    o = gemv_acts(down, prepare_activations(down.qtype, h, q8_act=q8_act), rows_d, xi, q8_act=q8_act)
    if glu is not None:
        o = np.ascontiguousarray(glu.out(ids, o.reshape(K, D)).reshape(K * D, 1))
    return weighted_sum(o, np.asarray(weights, dtype=np.float32))  # top-k order
