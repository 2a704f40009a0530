"""One decode step (T = 1) of a host MoE decoder layer in a single numba call.

The torch blocks (``engine.models.blocks``) are the math for every placement; for one token on
the host, their numba twins (``DecoderLayer.decode_host``) already replace ~60 torch ops per layer
by ~15 kernel calls. This module goes one step further for the common case — every matrix of the
layer in a type the fused q8 kernels serve, an F32 router, routed experts on the CPU, no shared
expert, an F32 KV cache on the host — and runs the whole layer inside numba: RMS norm, q/k/v
GEMVs, q/k norm and RoPE, the KV write, attention, the output projection, routing and the two
fused expert kernels, with no Python between them. The GEMVs are the kernels' own drivers
(``engine.kernels.kquants``/``legacy``/``floats``), the expert steps ``engine.kernels.moe_fused``,
so the result is bit-identical to ``DecoderLayer.decode_host`` (tests/test_host_decode.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels import floats, kquants, legacy
from engine.kernels.moe_fused import FUSED_TYPES, moe_down_q8, moe_gate_up_q8, quantize_for
from engine.models.layers import attention_host, qk_norm_rope_host, rms_norm_host, route_host
from engine.quant.formats import QType

_QK_NORM = {None: 0, "head": 1, "proj": 2}


@njit(cache=True, nogil=True)
def gemv_q8(qt, raw, s, qa, da, asum, bsums):
    """W·x for one token: raw uint8 [R, row_bytes] of ggml type ``qt`` (a fused type), s its
    scales, (qa, da, asum, bsums) = ``quantize_for(qt, x [1, n])``. Returns float32 [R]."""
    R = raw.shape[0]
    rows = np.arange(R)
    xi = np.zeros(R, np.int64)
    out = np.empty((R, 1), np.float32)
    if qt == 12:
        kquants.gemv_q4_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 13:
        kquants.gemv_q5_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 14:
        kquants.gemv_q6_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 8:
        legacy.gemv_q8_0_q8(raw, s, rows, xi, qa, da, asum, out)
    elif qt == 2:
        legacy.gemv_q4_0_q8(raw, s, rows, xi, qa, da, asum, out)
    elif qt == 6:
        legacy.gemv_q5_0_q8(raw, s, rows, xi, qa, da, asum, out)
    else:
        out[:] = np.nan
    return out.reshape(R)


@njit(cache=True, nogil=True)
def decode_moe_layer(
    x, attn_norm, ffn_norm, eps,
    qt_q, wq, sq, qt_k, wk, sk, qt_v, wv, sv, bq, bk, bv,
    q_norm, k_norm, qk_mode, cos, sin, neox, H, Hkv, hd,
    Kc, Vc, pos,
    qt_o, wo, so,
    router, k_top, renorm,
    qt_gu, wg, sg, wu, su, qt_d, wd, sd,
):  # fmt: skip
    """x float32 [D] of the token at position ``pos`` -> (x' float32 [D], expert ids int64 [K]).

    x' = x + attn(rms_norm(x)); x' += experts(rms_norm(x')), exactly as ``DecoderLayer`` with
    ``Attention`` and ``MoE`` (no shared expert). Writes k, v into row ``pos`` of the cache arrays
    Kc, Vc float32 [n_ctx, Hkv·hd]. Biases and norm weights may be empty arrays (absent).
    """
    D = x.shape[0]
    h = rms_norm_host(x, attn_norm, eps).reshape(1, D)
    a = quantize_for(qt_q, h)
    q = gemv_q8(qt_q, wq, sq, a[0], a[1], a[2], a[3])
    if qt_k != qt_q:
        a = quantize_for(qt_k, h)
    k = gemv_q8(qt_k, wk, sk, a[0], a[1], a[2], a[3])
    if qt_v != qt_k:
        a = quantize_for(qt_v, h)
    v = gemv_q8(qt_v, wv, sv, a[0], a[1], a[2], a[3])
    if bq.shape[0]:
        q += bq
        k += bk
        v += bv
    qk_norm_rope_host(q, k, q_norm, k_norm, qk_mode, eps, cos, sin, neox, H, Hkv, hd)
    Kc[pos] = k
    Vc[pos] = v
    o = attention_host(q, Kc, Vc, pos + 1, H, Hkv, hd)
    a = quantize_for(qt_o, o.reshape(1, o.shape[0]))
    x = x + gemv_q8(qt_o, wo, so, a[0], a[1], a[2], a[3])
    h = rms_norm_host(x, ffn_norm, eps).reshape(1, D)
    E = router.shape[0]
    logits = np.empty((E, 1), np.float32)
    floats.gemv_f32(router, np.arange(E), np.zeros(E, np.int64), h, logits)
    ids, w = route_host(logits.reshape(E), k_top, renorm)
    a = quantize_for(qt_gu, h)
    F = wg.shape[0] // E
    _, qa, da, asum, bsums = moe_gate_up_q8(qt_gu, wg, sg, wu, su, ids, a[0], a[1], a[2], a[3], F, qt_d)
    return x + moe_down_q8(qt_d, wd, sd, ids, w, qa, da, asum, bsums, D), ids


class HostMoEStep:
    """The arguments of :func:`decode_moe_layer` for one layer, gathered once at build time."""

    def __init__(self, layer, attn, moe, stacks):
        a = attn.a
        f32 = np.float32
        lin = [attn.wq, attn.wk, attn.wv]
        empty = np.zeros(0, f32)
        biases = [np.asarray(w.bias.numpy(), f32) if w.bias is not None else empty for w in lin]
        self.i = attn.i
        self.moe = moe
        self.head = (layer._attn_norm, layer._ffn_norm, f32(layer.eps))
        qkv = []
        for w in lin:
            qkv += [int(w.w.qtype), w.w.raw, w.w.scales]
        self.qkv = (*qkv, *biases)
        qn, kn = attn._norms
        self.attn = (qn, kn, _QK_NORM[attn.qk_norm])
        self.shape = (a.rope_neox, a.n_head, a.n_head_kv, a.head_dim)
        self.out = (int(attn.wo.w.qtype), attn.wo.w.raw, attn.wo.w.scales)
        self.route = (moe.router.w.raw, moe.k, moe.renormalise)
        g, u, d = stacks.gate, stacks.up, stacks.down
        self.experts = (int(g.qtype), g.raw, g.scales, u.raw, u.scales, int(d.qtype), d.raw, d.scales)

    @classmethod
    def build(cls, layer) -> HostMoEStep | None:
        """The fused step for ``layer`` (a ``DecoderLayer``), or None when it does not apply."""
        from engine.experts import CpuExperts
        from engine.kernels.grouped import fused_grouped

        attn, moe = layer.attn, layer.ffn
        if not (layer.host and hasattr(moe, "router") and moe.shared is None):
            return None
        if not isinstance(moe.experts, CpuExperts) or moe.router.w.qtype != QType.F32 or moe.router.bias is not None:
            return None
        mats = [attn.wq, attn.wk, attn.wv, attn.wo]
        if not all(w.q8_act and w.w.qtype in FUSED_TYPES for w in mats):
            return None
        if (attn.wq.bias is None) != (attn.wk.bias is None) or (attn.wk.bias is None) != (attn.wv.bias is None):
            return None
        stacks = moe.experts.stacks.get(attn.i)
        if stacks is None or not fused_grouped(stacks.gate, stacks.up, stacks.down, moe.experts.q8_act):
            return None
        return cls(layer, attn, moe, stacks)

    def __call__(self, x: np.ndarray, pos: int, Kc: np.ndarray, Vc: np.ndarray, cos, sin) -> np.ndarray:
        """x float32 [D] -> float32 [D]; writes the cache row ``pos``; records the routing."""
        y, ids = decode_moe_layer(
            x, *self.head, *self.qkv, *self.attn, cos, sin, *self.shape, Kc, Vc, pos, *self.out, *self.route,
            *self.experts,
        )  # fmt: skip
        self.moe.note_route(ids)
        return y
