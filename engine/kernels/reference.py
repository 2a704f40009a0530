"""Numpy reference model of the CPU kernels: the specification they are tested against.

Two variants of ``y = W·x``, for every weight type:

* **exact-float**: multiply by the exactly dequantized weights, accumulate in float64.
* **q8-activation**: round the activations the way llama.cpp's CPU backend does before a
  quantized dot product (``vec_dot_type`` of ggml-cpu's ``type_traits_cpu``) and then take the
  integer dot products block by block, as ``ggml_vec_dot_<w>_<a>`` does:

  ====================  ===============  ==================================================
  weight                activations      ggml rule re-implemented here
  ====================  ===============  ==================================================
  Q8_0, Q4_0, Q5_0,     Q8_0             x86 ``quantize_row_q8_0`` (AVX path): d = amax/127
  MXFP4, IQ4_NL
                                         stored as fp16; q = round-half-even(x · (127/amax))
  Q2_K, Q3_K, Q4_K,     Q8_K             ``quantize_row_q8_K_ref``: iscale = -127/max where max
  Q5_K, Q6_K, IQ4_XS,                    is the signed value of largest magnitude;
  IQ2_XXS, IQ2_XS,                       q = min(127, nearest_int(iscale·x)); d = 1/iscale (f32);
  IQ2_S, IQ3_XXS, IQ3_S                  bsums = sums of 16 consecutive q
  F16                   F16              round-to-nearest-even fp32 → fp16
  BF16                  BF16             ``GGML_FP32_TO_BF16``: round-to-nearest-even
  F32                   F32              none
  ====================  ===============  ==================================================

Weights are decoded here into integer codes and scales (``unpack``) by code written from the
block layouts in ``engine.quant.formats``; a test checks that decoding against the independent
dequantizer.
"""

from __future__ import annotations

import numpy as np

from engine.quant import iquants
from engine.quant.formats import QType, block_format
from engine.quant.reference import IQ4NL_VALUES, MXFP4_VALUES

QK = 256  # super-block size of the K-quants

LEGACY_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.MXFP4, QType.IQ4_NL)
K_TYPES = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, *iquants.IQ_TYPES)
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)


# ---------------------------------------------------------------------------------------------
# Activation rounding (what llama.cpp does to x before a dot product with a weight type)
# ---------------------------------------------------------------------------------------------


def quantize_q8_0_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [..., n] -> (qs int8 [..., n], d float32 [..., n/32]); ggml x86 quantize_row_q8_0.

    ``d`` is the fp16 scale read back as float32 (the value the dot product multiplies by).
    """
    x = np.asarray(x, dtype=np.float32)
    xb = x.reshape(*x.shape[:-1], -1, 32)
    bad = ~np.isfinite(xb).all(axis=-1)  # a NaN or an infinity: scale NaN, codes 0 (as quantize_q8_0)
    xb = np.where(bad[..., None], np.float32(0), xb)
    amax = np.abs(xb).max(axis=-1)  # [..., nb] f32
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * iscale[..., None])  # f32 product, round half to even (_mm256_round_ps)
    q = np.clip(q, -128, 127).astype(np.int8)  # the pack instructions saturate
    return q.reshape(x.shape), np.where(bad, np.float32(np.nan), d).astype(np.float32)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int``: add 1.5·2^23 in float32 and read the mantissa (round half to even)."""
    t = (v.astype(np.float32) + np.float32(12582912.0)).view(np.int32)
    return (t & 0x007FFFFF) - 0x00400000


def quantize_q8_K_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [..., n] -> (qs int8 [..., n], d float32 [..., n/256], bsums int16 [..., n/16]).

    ggml ``quantize_row_q8_K_ref``; note the negative scale: q ≈ x / d with d = -max/127.
    """
    x = np.asarray(x, dtype=np.float32)
    xb = x.reshape(*x.shape[:-1], -1, QK)
    bad = ~np.isfinite(xb).all(axis=-1)  # a NaN or an infinity: scale NaN, codes 0 (as quantize_q8_K)
    xb = np.where(bad[..., None], np.float32(0), xb)
    idx = np.abs(xb).argmax(axis=-1)  # first index of the largest |x|, as ggml's strict '>'
    mx = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]  # signed, f32
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127) / np.where(zero, 1, mx)).astype(np.float32)
    q = np.minimum(127, _nearest_int(xb * iscale[..., None]))
    q = np.where(zero[..., None], 0, q).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, 1, iscale)).astype(np.float32)
    d = np.where(bad, np.float32(np.nan), d).astype(np.float32)
    bsums = q.reshape(*q.shape[:-1], QK // 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q.reshape(x.shape), d, bsums.reshape(*x.shape[:-1], -1)


def round_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest fp16 (ties to even), returned as float32."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even, ggml ``GGML_FP32_TO_BF16``), returned as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, (u | 0x400000) & 0xFFFF0000, r)  # quiet NaN, as ggml does
    return r.astype(np.uint32).view(np.float32)


def activation_type(qtype: QType) -> QType:
    """llama.cpp's ``vec_dot_type`` for a weight type on the CPU."""
    qtype = QType(qtype)
    if qtype in LEGACY_TYPES:
        return QType.Q8_0
    if qtype in K_TYPES:
        return QType.Q8_K
    return qtype


# ---------------------------------------------------------------------------------------------
# Weight decoding into integer codes and scales
# ---------------------------------------------------------------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> float64 [...] (little-endian fp16)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float64)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes [..., 12] -> 6-bit (scale, min) [..., 8] each; ggml ``get_scale_min_k4``."""
    s = s.astype(np.int64)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, mn


def _k3_scales(s: np.ndarray) -> np.ndarray:
    """12 packed bytes [..., 12] -> the 16 six-bit Q3_K scales [..., 16] (0..63, value − 32 not applied),
    written from ggml's ``dequantize_row_q3_K`` word shuffle: aux[0..3] = 32-bit words."""
    w = np.ascontiguousarray(s.astype(np.uint8)).view("<u4").astype(np.int64)  # [..., 3]
    a0, a1, tmp = w[..., 0], w[..., 1], w[..., 2]
    m1, m2 = 0x03030303, 0x0F0F0F0F
    aux = np.stack(
        [
            (a0 & m2) | (((tmp >> 0) & m1) << 4),
            (a1 & m2) | (((tmp >> 2) & m1) << 4),
            ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4),
            ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4),
        ],
        axis=-1,
    ).astype("<u4")
    return aux.view(np.uint8).astype(np.int64)  # [..., 16]


class Unpacked:
    """A quantized matrix as integer codes and scales.

    ``w = d[block] · sc[sub] · q − dmin[block] · m[sub]`` with ``sub`` of ``sub_size`` elements.
    q int64 [R, n]; d, dmin float64 [R, nb]; sc, m int64 [R, n/sub_size] (m zero when unused).
    """

    def __init__(self, q, d, dmin, sc, m, block: int, sub: int):
        self.q, self.d, self.dmin, self.sc, self.m = q, d, dmin, sc, m
        self.block, self.sub = block, sub

    def dequantize(self) -> np.ndarray:
        """-> float64 [R, n]."""
        R, n = self.q.shape
        per = self.block // self.sub
        d = np.repeat(self.d, per, axis=1) * self.sc  # [R, n/sub]
        dm = np.repeat(self.dmin, per, axis=1) * self.m
        w = self.q.reshape(R, -1, self.sub) * d[..., None] - dm[..., None]
        return w.reshape(R, n)


def unpack(qtype: QType, raw: np.ndarray) -> Unpacked:
    """raw uint8 [R, row_bytes] of a quantized type -> ``Unpacked``."""
    qtype = QType(qtype)
    fmt = block_format(qtype)
    R = raw.shape[0]
    blk = np.asarray(raw, dtype=np.uint8).reshape(R, -1, fmt.type_size)  # [R, nb, bytes]
    nb = blk.shape[1]
    off = {f.name: fmt.field_offset(f.name) for f in fmt.fields}
    ones = np.ones((R, nb), np.int64)
    zeros = np.zeros((R, nb), np.float64)

    if qtype == QType.Q8_0:  # block_q8_0: d, qs[32] signed
        q = blk[..., 2:34].view(np.int8).astype(np.int64)
        return Unpacked(q.reshape(R, -1), _f16(blk[..., 0:2]), zeros, ones, ones * 0, 32, 32)
    if qtype in (QType.Q4_0, QType.Q5_0):  # low nibbles: elements 0..15, high: 16..31
        qs = blk[..., off["qs"] : off["qs"] + 16].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [R, nb, 32]
        if qtype == QType.Q4_0:
            q = q - 8
        else:  # bit j of the 32-bit qh is the fifth bit of element j
            qh = blk[..., 2:6].copy().view("<u4")[..., 0].astype(np.int64)  # [R, nb]
            bits = (qh[..., None] >> np.arange(32)) & 1
            q = (q | (bits << 4)) - 16
        return Unpacked(q.reshape(R, -1), _f16(blk[..., 0:2]), zeros, ones, ones * 0, 32, 32)
    if qtype == QType.MXFP4:  # e | qs[16]: codes index the doubled e2m1 values, scale 2^(e-128)
        qs = blk[..., 1:17].astype(np.int64)
        idx = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [R, nb, 32]
        q = MXFP4_VALUES.astype(np.int64)[idx]
        d = np.ldexp(1.0, blk[..., 0].astype(np.int64) - 128)  # [R, nb] float64, exact
        return Unpacked(q.reshape(R, -1), d, zeros, ones, ones * 0, 32, 32)
    if qtype == QType.IQ4_NL:  # d | qs[16]: codes index kvalues_iq4nl, low nibbles first
        qs = blk[..., 2:18].astype(np.int64)
        q = IQ4NL_VALUES.astype(np.int64)[np.concatenate([qs & 15, qs >> 4], axis=-1)]  # [R, nb, 32]
        return Unpacked(q.reshape(R, -1), _f16(blk[..., 0:2]), zeros, ones, ones * 0, 32, 32)
    if qtype == QType.IQ4_XS:  # d | scales_h u16 | scales_l[4] | qs[128]: 8 groups of 32, scale ls − 32
        qs = blk[..., 8:136].astype(np.int64).reshape(R, nb, 8, 16)
        q = IQ4NL_VALUES.astype(np.int64)[np.concatenate([qs & 15, qs >> 4], axis=-1)]  # [R, nb, 8, 32]
        sl = blk[..., 4:8].astype(np.int64)  # [R, nb, 4]
        lo = np.stack([sl & 15, sl >> 4], axis=-1).reshape(R, nb, 8)
        sh = blk[..., 2].astype(np.int64) | (blk[..., 3].astype(np.int64) << 8)  # [R, nb]
        hi = (sh[..., None] >> (2 * np.arange(8))) & 3
        sc = (lo | (hi << 4)) - 32
        return Unpacked(
            q.reshape(R, -1), _f16(blk[..., 0:2]), zeros, sc.reshape(R, -1), np.zeros_like(sc).reshape(R, -1), QK, 32
        )
    if qtype in iquants.IQ_TYPES:  # grid·sign codes, odd scales 2s + 1, d·mult (engine.quant.iquants)
        c = iquants.decode(qtype, blk.reshape(R * nb, -1))
        q = iquants.signed_values(qtype, c).reshape(R, -1)
        d = _f16(blk[..., 0:2]) * iquants.SCALE_MULT[qtype]
        sc = (2 * c.s + 1).reshape(R, -1)
        return Unpacked(q, d, zeros, sc, np.zeros_like(sc), QK, iquants.SCALE_GROUP[qtype])
    if qtype in (QType.Q4_K, QType.Q5_K):
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, m = _k4_scales(blk[..., 4:16])  # [R, nb, 8]
        qs = blk[..., off["qs"] : off["qs"] + 128].astype(np.int64).reshape(R, nb, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3)  # [R, nb, 4 chunks, 2 halves, 32]
        if qtype == QType.Q5_K:  # bit (2·chunk + half) of qh[l] is the fifth bit
            qh = blk[..., off["qh"] : off["qh"] + 32].astype(np.int64)  # [R, nb, 32]
            bit = np.arange(8).reshape(4, 2, 1)
            q = q | (((qh[:, :, None, None, :] >> bit) & 1) << 4)
        return Unpacked(q.reshape(R, -1), d, dmin, sc.reshape(R, -1), m.reshape(R, -1), QK, 32)
    if qtype == QType.Q2_K:  # scales[16] (sc | m << 4) | qs[64] | d | dmin; element 128h + 32j + l
        qs = blk[..., 16:80].astype(np.int64).reshape(R, nb, 2, 1, 32)
        q = (qs >> (2 * np.arange(4)).reshape(4, 1)) & 3  # [R, nb, 2 halves, 4, 32]
        s = blk[..., 0:16].astype(np.int64)  # [R, nb, 16]
        d, dmin = _f16(blk[..., 80:82]), _f16(blk[..., 82:84])
        return Unpacked(q.reshape(R, -1), d, dmin, (s & 15).reshape(R, -1), (s >> 4).reshape(R, -1), QK, 16)
    if qtype == QType.Q3_K:  # hmask[32] | qs[64] | scales[12] | d; element 128h + 32j + l
        qs = blk[..., 32:96].astype(np.int64).reshape(R, nb, 2, 1, 32)
        low = (qs >> (2 * np.arange(4)).reshape(4, 1)) & 3  # [R, nb, 2 halves, 4, 32]
        hm = blk[..., 0:32].astype(np.int64).reshape(R, nb, 1, 1, 32)
        high = (hm >> np.arange(8).reshape(2, 4, 1)) & 1  # bit 4h + j
        q = low - 4 * (1 - high)  # −4..3
        sc = _k3_scales(blk[..., 96:108]) - 32  # [R, nb, 16]
        d = _f16(blk[..., 108:110])
        return Unpacked(q.reshape(R, -1), d, zeros, sc.reshape(R, -1), np.zeros_like(sc).reshape(R, -1), QK, 16)
    if qtype == QType.Q6_K:
        ql = blk[..., 0:128].astype(np.int64).reshape(R, nb, 2, 64)  # per 128-half: 64 bytes
        qh = blk[..., 128:192].astype(np.int64).reshape(R, nb, 2, 32)
        sc = blk[..., 192:208].view(np.int8).astype(np.int64)  # [R, nb, 16]
        d = _f16(blk[..., 208:210])
        lo = np.stack(
            [ql[..., 0:32] & 15, ql[..., 32:64] & 15, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], axis=3
        )  # [R, nb, 2, 4 quarters, 32]
        hi = (qh[:, :, :, None, :] >> (2 * np.arange(4)).reshape(4, 1)) & 3
        q = (lo | (hi << 4)) - 32
        return Unpacked(q.reshape(R, -1), d, zeros, sc.reshape(R, -1), np.zeros_like(sc).reshape(R, -1), QK, 16)
    raise KeyError(f"not a quantized type: {qtype.name}")


def dequantize_ref(qtype: QType, raw: np.ndarray) -> np.ndarray:
    """Weights [R, row_bytes] (uint8, or the float dtype for F32/F16/BF16) -> float64 [R, n]."""
    qtype = QType(qtype)
    if qtype == QType.F32:
        return np.asarray(raw).view(np.float32).astype(np.float64)
    if qtype == QType.F16:
        return np.asarray(raw).view(np.float16).astype(np.float64)
    if qtype == QType.BF16:
        u = np.asarray(raw).view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).astype(np.float64)
    return unpack(qtype, raw).dequantize()


# ---------------------------------------------------------------------------------------------
# The two variants of y = W·x
# ---------------------------------------------------------------------------------------------


def matmul_ref(qtype: QType, raw: np.ndarray, X: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """Y = X·Wᵀ. raw [R, row_bytes] (or float [R, n]); X float32 [T, n] -> Y float32 [T, R]."""
    qtype = QType(qtype)
    X = np.asarray(X, dtype=np.float32)
    if not q8_act or qtype == QType.F32:
        return (X.astype(np.float64) @ dequantize_ref(qtype, raw).T).astype(np.float32)
    if qtype == QType.F16:
        return (round_to_f16(X).astype(np.float64) @ dequantize_ref(qtype, raw).T).astype(np.float32)
    if qtype == QType.BF16:
        return (round_to_bf16(X).astype(np.float64) @ dequantize_ref(qtype, raw).T).astype(np.float32)
    u = unpack(qtype, raw)
    R, n = u.q.shape
    T = X.shape[0]
    if qtype in LEGACY_TYPES:
        qa, da = quantize_q8_0_ref(X)  # [T, n], [T, nb]
        # integer block dots [T, R, nb], then d_w·d_a per block in float64
        sumi = np.einsum("rbi,tbi->trb", u.q.reshape(R, -1, 32), qa.astype(np.int64).reshape(T, -1, 32))
        return np.einsum("trb,rb,tb->tr", sumi.astype(np.float64), u.d, da.astype(np.float64)).astype(np.float32)
    qa, da, bsums = quantize_q8_K_ref(X)  # [T, n], [T, nb], [T, n/16]
    S = u.sub
    sub_dot = np.einsum("rsi,tsi->trs", u.q.reshape(R, -1, S), qa.astype(np.int64).reshape(T, -1, S))
    nsub = QK // S
    isum = (sub_dot * u.sc[None]).reshape(T, R, -1, nsub).sum(-1)  # [T, R, nb] exact integers
    y = np.einsum("trb,rb,tb->tr", isum.astype(np.float64), u.d, da.astype(np.float64))
    if qtype in (QType.Q2_K, QType.Q4_K, QType.Q5_K):  # mins use the activation sums over each sub-block
        asum = bsums.astype(np.int64).reshape(T, -1, S // 16).sum(-1)  # [T, n/S]
        msum = (u.m[None] * asum[:, None, :]).reshape(T, R, -1, nsub).sum(-1)  # [T, R, nb]
        y -= np.einsum("trb,rb,tb->tr", msum.astype(np.float64), u.dmin, da.astype(np.float64))
    return y.astype(np.float32)


def matvec_ref(qtype: QType, raw: np.ndarray, x: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """y = W·x. raw [R, row_bytes] (or float [R, n]); x float32 [n] -> y float32 [R]."""
    return matmul_ref(qtype, raw, np.asarray(x, np.float32)[None], q8_act=q8_act)[0]


def moe_ffn_ref(
    qtypes: tuple[QType, QType, QType],
    gate_raw: np.ndarray,
    up_raw: np.ndarray,
    down_raw: np.ndarray,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    q8_act: bool,
    glu=None,
) -> np.ndarray:
    """Routed experts for one token: Σ_k w_k · down[e_k] · (silu(gate[e_k]·x) ⊙ up[e_k]·x).

    gate_raw, up_raw [E, F, row_bytes]; down_raw [E, D, row_bytes]; x float32 [D];
    ids int [K]; weights float32 [K] -> float32 [D]. ``glu`` (an ``engine.kernels.moe.ExpertGLU``): the
    biases and activation of gpt-oss's experts, w_k · (down[e_k]·act(gate[e_k]·x + bg, up[e_k]·x + bu) + bd),
    in float64 here.
    """
    y = np.zeros(down_raw.shape[1], np.float64)
    for e, w in zip(ids, weights):
        g = matvec_ref(qtypes[0], gate_raw[e], x, q8_act=q8_act).astype(np.float64)
        u = matvec_ref(qtypes[1], up_raw[e], x, q8_act=q8_act).astype(np.float64)
        if glu is None:
            with np.errstate(over="ignore"):
                h = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
            y += float(w) * matvec_ref(qtypes[2], down_raw[e], h, q8_act=q8_act)
            continue
        g = g + (0.0 if glu.gate_bias is None else glu.gate_bias[e])
        u = u + (0.0 if glu.up_bias is None else glu.up_bias[e])
        with np.errstate(over="ignore"):
            if glu.act == "swiglu_oai":
                xg, yu = np.minimum(g, glu.limit), np.clip(u, -glu.limit, glu.limit)
                h = (xg / (1.0 + np.exp(-glu.alpha * xg)) * (yu + 1.0)).astype(np.float32)
            else:
                h = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
        o = matvec_ref(qtypes[2], down_raw[e], h, q8_act=q8_act).astype(np.float64)
        y += float(w) * (o + (0.0 if glu.down_bias is None else glu.down_bias[e]))
    return y.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The same entry points as engine.kernels (PreparedWeight in, same shapes out), in numpy
# ---------------------------------------------------------------------------------------------


def matvec_numpy(w, x: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """numpy twin of ``engine.kernels.matvec``: w PreparedWeight [R, n]; x float32 [n] -> [R]."""
    return matvec_ref(w.qtype, w.raw, x, q8_act=q8_act)


def matmul_numpy(w, X: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """numpy twin of ``engine.kernels.matmul``: X float32 [T, n] -> float32 [T, R]."""
    return matmul_ref(w.qtype, w.raw, X, q8_act=q8_act)


def moe_ffn_numpy(gate, up, down, x: np.ndarray, ids, weights, *, q8_act: bool) -> np.ndarray:
    """numpy twin of ``engine.kernels.moe_ffn`` (stacks as PreparedWeight) -> float32 [D]."""
    E = gate.n_experts
    raws = [m.raw.reshape(E, m.rows, -1) for m in (gate, up, down)]
    return moe_ffn_ref((gate.qtype, up.qtype, down.qtype), *raws, x, ids, weights, q8_act=q8_act)
