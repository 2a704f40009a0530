"""Numpy reference quantizers: float32 rows -> the bytes of every weight format.

Follows ggml's *reference* quantizers (``quantize_row_*_ref`` in ggml-quants.c, used by
llama.cpp when no importance matrix is given), re-implemented in float32 and vectorised over
blocks. Q8_0/Q4_0/Q5_0/F16/BF16 equal ``gguf.quants.quantize`` bit for bit. The K-quants run
the same searches (``make_qkx2_quants`` / ``make_qx_quants``) with the same float32 operations
in the same order — sums included, see :func:`_seq_sum` — and were measured byte-identical to
llama.cpp's libggml-base (tests/test_quant_reference.py). A build of ggml that contracts to FMA
could break a rare near-tie differently; the accuracy would still be the format's.

Output types: block formats give uint8 [..., row_bytes]; F32 gives float32 [..., n], F16 float16
[..., n], BF16 the uint16 bit patterns [..., n]. :func:`engine.quant.dequantize` accepts each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from engine.quant import iquants
from engine.quant.formats import QType, block_format, pack_blocks, to_f16

_F32 = np.float32
GROUP_MAX_EPS = _F32(1e-15)  # ggml: a group whose |max| is below this is all zero
_CHUNK_ELEMENTS = 1 << 16  # blocks are quantized in chunks of this many values (cache-sized)


# ---------------------------------------------------------------- rounding helpers


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int``: round half to even (float32 in, float32 out; exact integers)."""
    return np.rint(v)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero (float32 in, float32 out)."""
    a = np.abs(v)
    r = np.floor(a)
    r += (a - r) >= _F32(0.5)  # a - r is exact, so the comparison is too
    return np.copysign(r, v)


def _recip_or_zero(d: np.ndarray) -> np.ndarray:
    """ggml's ``id = d ? 1.0f/d : 0.0f``."""
    out = np.zeros_like(d)
    np.divide(_F32(1), d, out=out, where=d != 0)
    return out


# ---------------------------------------------------------------- 32-element block types


def _quant_q8_0(x: np.ndarray) -> np.ndarray:
    # quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d)
    d = np.abs(x).max(axis=1) / _F32(127)  # [nb]
    q = round_half_away(x * _recip_or_zero(d)[:, None])  # [nb, 32]
    return pack_blocks(QType.Q8_0, len(x), d=to_f16(d), qs=q.astype(np.int8))


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude per row, first one on ties. x: [nb, n] -> [nb]."""
    i = np.abs(x).argmax(axis=1)
    return x[np.arange(len(x)), i]


def _quant_q4_0(x: np.ndarray) -> np.ndarray:
    # quantize_row_q4_0_ref: d = max / -8 (max = the signed value of largest magnitude, which
    # maps to -8 exactly), q = min(15, trunc(x / d + 8.5)); element j < 16 in the low nibble
    d = _signed_absmax(x) / _F32(-8)
    q = np.minimum(np.trunc(x * _recip_or_zero(d)[:, None] + _F32(8.5)), 15).astype(np.uint8)
    return pack_blocks(QType.Q4_0, len(x), d=to_f16(d), qs=q[:, :16] | (q[:, 16:] << 4))


def _quant_q5_0(x: np.ndarray) -> np.ndarray:
    # quantize_row_q5_0_ref: d = max / -16, q = min(31, trunc(x / d + 16.5)); low nibbles as in
    # Q4_0, the 5th bit of element j goes to bit j of the little-endian uint32 qh
    d = _signed_absmax(x) / _F32(-16)
    q = np.minimum(np.trunc(x * _recip_or_zero(d)[:, None] + _F32(16.5)), 31).astype(np.uint8)
    qs = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    qh = ((q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return pack_blocks(QType.Q5_0, len(x), d=to_f16(d), qh=qh.astype("<u4").view(np.uint8), qs=qs)


# ---------------------------------------------------------------- K-quant searches


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0 in index order, like ggml's C loops (numpy's pairwise sums round differently).

    a: [n, ...] -> [...]. Reducing the outer axis of a C-contiguous array adds whole rows in turn.
    """
    return np.add.reduce(np.ascontiguousarray(a), axis=0)


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted (scale, min) search of ggml ``make_qkx2_quants`` (use_mad=false), per group.

    x, w: float32 [G, n] values and weights. Fits x ~ scale * L - the_min with L in 0..nmax:
    starts from the grid of nmax steps over [min(x, 0), max(x)], then tries nstep+1 grids of
    (nmax + rmin + rdelta*i) steps, solving weighted least squares for (scale, min) on each (min
    kept <= 0), and keeps the fit with the smallest weighted squared error. As in ggml, an
    accepted fit moves ``min``, so later grids start from it.
    Returns scale float32 [G], the_min float32 [G] (>= 0), L uint8 [G, n] of the kept fit.
    """
    # Element-major [n, G] so that every sum runs in ggml's order (see _seq_sum).
    x = np.ascontiguousarray(x.T)
    w = np.ascontiguousarray(w.T)
    mn = np.minimum(x.min(axis=0), 0)  # [G]; the min is never positive
    mx = x.max(axis=0)
    flat = mx == mn  # constant groups: L = 0, scale = 0
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)

    iscale = _F32(nmax) / np.where(flat, _F32(1), mx - mn)
    scale = _F32(1) / iscale
    L = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)  # [n, G]
    diff = scale * L + mn - x
    best = _seq_sum(w * (diff * diff))
    for i in range(nstep + 1):
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(i) + _F32(nmax)) / np.where(flat, _F32(1), mx - mn)
        laux = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
        wl = w * laux
        sum_l = _seq_sum(wl)
        sum_l2 = _seq_sum(wl * laux)
        sum_xl = _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0  # a positive min is not representable: refit the scale alone
        if pos.any():
            this_min = np.where(pos, _F32(0), this_min)
            this_scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, _F32(1)), this_scale)
        diff = this_scale * laux + this_min - x
        err = _seq_sum(w * (diff * diff))
        better = ok & (err < best)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
        np.copyto(L, laux, where=better)
    scale = np.where(flat, _F32(0), scale)
    L[:, flat] = 0
    return scale, -mn, np.ascontiguousarray(L.T.astype(np.uint8))


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric scale search of ggml ``make_qx_quants`` with rmse_type=1 (weights x^2), per group.

    x: float32 [G, n]. Fits x ~ scale * l with l in -nmax..nmax-1: starts from the grid that maps
    the signed max to -nmax, then tries the 18 grids -(nmax + 0.1*i)/max (i = -9..9, i != 0),
    keeping the least-squares scale with the best weighted fit.
    Returns scale float32 [G] (0 for all-zero groups), L uint8 [G, n] (= l + nmax) of the kept fit.
    """
    mx = _signed_absmax(x)  # [G]
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx_safe = np.where(zero, _F32(1), mx)
    x = np.ascontiguousarray(x.T)  # [n, G]: sums in ggml's order (see _seq_sum)
    w = x * x
    wx = w * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        l = np.clip(nearest_int(iscale * x), -nmax, nmax - 1)
        return l, _seq_sum(wx * l), _seq_sum((w * l) * l)

    l, sumlx, suml2 = fit(_F32(-nmax) / mx_safe)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0))
    best = scale * sumlx
    L = l
    for i in (*range(-9, 0), *range(1, 10)):
        l, sumlx, suml2 = fit(-(_F32(nmax) + _F32(0.1) * _F32(i)) / mx_safe)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        s = sumlx / np.where(suml2 > 0, suml2, _F32(1))
        scale = np.where(better, s, scale)
        best = np.where(better, s * sumlx, best)
        L = np.where(better, l, L)
    scale = np.where(zero, _F32(0), scale)
    L = (L + nmax).astype(np.uint8)
    L[:, zero] = 0
    return scale, np.ascontiguousarray(L.T)


# ---------------------------------------------------------------- 256-element K-quants


def pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into 12 bytes (inverse of ``get_scale_min_k4``).

    ls, lm: uint8 [nb, 8] in 0..63 -> uint8 [nb, 12].
    """
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    b0 = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)  # scales 0-3, top bits of scales 4-7
    b4 = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)  # mins 0-3, top bits of mins 4-7
    b8 = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)  # low nibbles of scales/mins 4-7
    return np.concatenate([b0, b4, b8], axis=1)


def _quant_qk_asym(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Shared body of quantize_row_q4_K_ref / quantize_row_q5_K_ref.

    x: float32 [nb, 256] -> (d f16 [nb], dmin f16 [nb], scales u8 [nb, 12], L u8 [nb, 8, 32]).
    """
    nb = len(x)
    xs = x.reshape(nb, 8, 32)
    # Per-sub-block weights: rms of the sub-block plus |x| (large values matter more).
    av_x = np.sqrt(_seq_sum(np.moveaxis(xs * xs, 2, 0)) / _F32(32))  # [nb, 8]
    w = av_x[:, :, None] + np.abs(xs)
    scales, mins, L = make_qkx2_quants(xs.reshape(-1, 32), w.reshape(-1, 32), nmax, rmin, 0.1, nstep)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.reshape(nb, 8, 32)

    # Sub-block scales and mins become 6-bit multiples of a per-block fp16 d and dmin.
    max_scale = np.maximum(scales.max(axis=1), 0)
    max_min = np.maximum(mins.max(axis=1), 0)
    inv_scale = np.where(max_scale > 0, _F32(63) / np.where(max_scale > 0, max_scale, 1), _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / np.where(max_min > 0, max_min, 1), _F32(0))
    # uint8_t ls = nearest_int(...); MIN(63, ls): a negative value would wrap, then clamp to 63
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales).astype(np.int32) & 0xFF, 63)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins).astype(np.int32) & 0xFF, 63)
    d = to_f16(max_scale / _F32(63))
    dmin = to_f16(max_min / _F32(63))

    # Requantize each sub-block against its stored scale; a zero scale keeps the search's L.
    d_sub = (d.astype(_F32)[:, None] * ls.astype(_F32))[:, :, None]  # [nb, 8, 1]
    dm_sub = (dmin.astype(_F32)[:, None] * lm.astype(_F32))[:, :, None]
    live = d_sub != 0
    q = np.clip(nearest_int((xs + dm_sub) / np.where(live, d_sub, _F32(1))), 0, nmax)
    L = np.where(live, q, L).astype(np.uint8)
    return d, dmin, pack_scale_min_k4(ls, lm), L


def _quant_q4_k(x: np.ndarray) -> np.ndarray:
    # quantize_row_q4_K_ref: make_qkx2_quants(32, 15, ..., rmin=-1, rdelta=0.1, nstep=20)
    d, dmin, scales, L = _quant_qk_asym(x, 15, -1.0, 20)
    nb = len(x)
    pairs = L.reshape(nb, 4, 2, 32)  # chunk c holds sub-blocks 2c (low nibble) and 2c+1 (high)
    qs = pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)
    return pack_blocks(QType.Q4_K, nb, d=d, dmin=dmin, scales=scales, qs=qs)


def _quant_q5_k(x: np.ndarray) -> np.ndarray:
    # quantize_row_q5_K_ref: make_qkx2_quants(32, 31, ..., rmin=-0.5, rdelta=0.1, nstep=15)
    d, dmin, scales, L = _quant_qk_asym(x, 31, -0.5, 15)
    nb = len(x)
    pairs = (L & 0xF).reshape(nb, 4, 2, 32)
    qs = pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)
    # The 5th bit of element l of sub-block s goes to bit s of qh[l].
    qh = ((L >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return pack_blocks(QType.Q5_K, nb, d=d, dmin=dmin, scales=scales, qh=qh, qs=qs)


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    # quantize_row_q6_K_ref: 16 sub-blocks of 16 with make_qx_quants(16, 32, ..., rmse_type=1);
    # their scales become int8 multiples of a per-block fp16 d (the largest maps to -128)
    nb = len(x)
    xs = x.reshape(nb, 16, 16)
    scales, L = make_qx_quants_rmse1(xs.reshape(-1, 16), 32)
    scales, L = scales.reshape(nb, 16), L.reshape(nb, 16, 16)
    max_scale = _signed_absmax(scales)  # [nb]
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # such a block is stored as all-zero bytes
    iscale = _F32(-128) / np.where(zero, _F32(1), max_scale)
    d = np.where(zero, np.float16(0), to_f16(_F32(1) / iscale))
    sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # [nb, 16]
    sc[zero] = 0

    d_sub = (d.astype(_F32)[:, None] * sc.astype(_F32))[:, :, None]  # [nb, 16, 1]
    live = d_sub != 0
    q = np.clip(nearest_int(xs / np.where(live, d_sub, _F32(1))), -32, 31) + 32
    L = np.where(live, q, L).astype(np.uint8)
    L[zero] = 0

    # Pack: half h, element 32k + l -> low nibble into ql[l] (k=0), ql[32+l] (k=1), the high
    # nibbles of the same bytes (k=2, 3); top 2 bits into bits 2k..2k+1 of qh[l].
    Lh = L.reshape(nb, 2, 4, 32)
    low = Lh & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = ((Lh >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    return pack_blocks(QType.Q6_K, nb, ql=ql, qh=qh, scales=sc, d=d)


def _quant_q2_k(x: np.ndarray) -> np.ndarray:
    """Test data, not ggml's search: SharpI does not reproduce ``quantize_row_q2_K_ref``
    (``make_qkx2_quants``' refit), only writes valid, well-spread blocks. Each sub-block of 16 takes
    the range [a·min(x, 0), a·max(x)] with the a of 1, 0.9, 0.8, 0.7 that fits it best (least squares on
    the unrounded scale: the outer values may clip); scales and negated mins become 4-bit multiples of
    fp16 d and dmin (the largest → 15, as ggml), and every element the nearest of 0..3 against its
    stored scale and min."""
    nb = len(x)
    xs = x.reshape(nb, 16, 16)
    lo, hi = np.minimum(xs.min(axis=2), 0), xs.max(axis=2)  # [nb, 16]
    shrink = np.array([1.0, 0.9, 0.8, 0.7], _F32)[:, None, None]
    s = (hi - lo) * shrink / _F32(3)  # [4, nb, 16]
    q = np.clip(nearest_int((xs - (lo * shrink)[..., None]) / np.where(s > 0, s, _F32(1))[..., None]), 0, 3)
    err = ((q * s[..., None] + (lo * shrink)[..., None] - xs) ** 2).sum(axis=-1)  # [4, nb, 16]
    a = shrink[err.argmin(axis=0), 0, 0]  # [nb, 16]
    mins, scales = -lo * a, (hi - lo) * a / _F32(3)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)  # [nb]
    d, dmin = to_f16(max_scale / _F32(15)), to_f16(max_min / _F32(15))
    ls = np.clip(nearest_int(scales * _recip_or_zero(d.astype(_F32))[:, None]), 0, 15)
    lm = np.clip(nearest_int(mins * _recip_or_zero(dmin.astype(_F32))[:, None]), 0, 15)
    d_sub = (d.astype(_F32)[:, None] * ls)[:, :, None]  # [nb, 16, 1]
    m_sub = (dmin.astype(_F32)[:, None] * lm)[:, :, None]
    live = d_sub > 0
    q = np.where(live, np.clip(nearest_int((xs + m_sub) / np.where(live, d_sub, _F32(1))), 0, 3), 0)
    L = q.astype(np.uint8).reshape(nb, 2, 4, 32)  # [half h, j, l]: element 128h + 32j + l
    qs = (L << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    sc = ls.astype(np.uint8) | (lm.astype(np.uint8) << 4)
    return pack_blocks(QType.Q2_K, nb, scales=sc, qs=qs.reshape(nb, 64), d=d, dmin=dmin)


def pack_scales_k3(ls: np.ndarray) -> np.ndarray:
    """16 six-bit Q3_K scales uint8 [nb, 16] (0..63) -> the 12 packed bytes [nb, 12]; inverse of
    :func:`engine.quant.reference.unpack_scales_k3`."""
    ls = ls.astype(np.uint8)
    low = (ls[:, 0:8] & 0xF) | ((ls[:, 8:16] & 0xF) << 4)
    top = (ls >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]  # [nb, i // 4, i % 4]
    return np.concatenate([low, top.sum(axis=1, dtype=np.uint8)], axis=1)


def _quant_q3_k(x: np.ndarray) -> np.ndarray:
    """Test data, not ggml's search: SharpI does not reproduce ``quantize_row_q3_K_ref``
    (``make_q3_quants``' iterative refit), only writes valid, well-spread blocks. Each sub-block of 16
    gets the scale that maps its value of largest magnitude to −4 (as ggml's starting point); the 16
    scales become 6-bit multiples of an fp16 d (the largest in magnitude → −32, as ggml), and every
    element the nearest of −4..3 times its stored scale."""
    nb = len(x)
    xs = x.reshape(nb, 16, 16)
    scales = _signed_absmax(xs.reshape(-1, 16)).reshape(nb, 16) / _F32(-4)  # [nb, 16]
    max_scale = _signed_absmax(scales)  # [nb]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = _F32(-32) / np.where(zero, _F32(1), max_scale)
    d = np.where(zero, np.float16(0), to_f16(_F32(1) / iscale))
    ls = np.clip(nearest_int(iscale[:, None] * scales), -32, 31)  # [nb, 16]
    ls[zero] = 0
    d_sub = (d.astype(_F32)[:, None] * ls)[:, :, None]  # [nb, 16, 1]
    live = d_sub != 0
    q = np.where(live, np.clip(nearest_int(xs / np.where(live, d_sub, _F32(1))), -4, 3), 0)
    L = (q + 4).astype(np.uint8).reshape(nb, 2, 4, 32)  # [half h, j, l]: element 128h + 32j + l
    qs = ((L & 3) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    hbits = (L >> 2).reshape(nb, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]  # bit 4h + j
    hmask = hbits.sum(axis=1, dtype=np.uint8)
    return pack_blocks(QType.Q3_K, nb, hmask=hmask, qs=qs.reshape(nb, 64), scales=pack_scales_k3(ls + 32), d=d)


def _quant_mxfp4(x: np.ndarray) -> np.ndarray:
    # gguf.quants.MXFP4: e = floor(log2(amax)) - 2 + 127 (0 for a zero block), then each element the
    # nearest of the doubled e2m1 values times 2^(e-128) (the first on a tie)
    from engine.quant.reference import MXFP4_VALUES, e8m0_half

    nb = len(x)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    d = e8m0_half(e)
    errs = np.abs(d.reshape(nb, 1, 1) * MXFP4_VALUES.astype(_F32).reshape(1, 1, 16) - x.reshape(nb, 32, 1))
    q = np.argmin(errs, axis=-1).astype(np.uint8).reshape(nb, 2, 16)
    return pack_blocks(QType.MXFP4, nb, e=e, qs=q[:, 0] | (q[:, 1] << np.uint8(4)))


def _nearest_iq4(v: np.ndarray) -> np.ndarray:
    """Index (uint8) of the nearest kvalues_iq4nl level to each of ``v`` (float32), the lower on a tie."""
    from engine.quant.reference import IQ4NL_VALUES

    k = IQ4NL_VALUES.astype(_F32)
    mid = (k[1:] + k[:-1]) / _F32(2)
    return np.searchsorted(mid, v, side="right").astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Indices uint8 [..., 32] -> 16 bytes [..., 16]: elements 0..15 low nibbles, 16..31 high."""
    return q[..., :16] | (q[..., 16:] << np.uint8(4))


def _iq4_fit(x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups x [G, 32] at per-group scales [G] -> (indices uint8 [G, 32], the least-squares scale [G] for
    those indices: Σ x·k / Σ k², or the given scale where that is 0)."""
    from engine.quant.reference import IQ4NL_VALUES

    live = scale != 0
    q = _nearest_iq4(x / np.where(live, scale, _F32(1))[:, None])
    q[~live] = 8  # level 1 at scale 0: the value 0
    k = IQ4NL_VALUES[q].astype(_F32)
    kk = (k * k).sum(axis=1)
    return q, np.where(live, (x * k).sum(axis=1) / kk, scale).astype(_F32)


def _quant_iq4_nl(x: np.ndarray) -> np.ndarray:
    """Test data, not ggml's search (``quantize_row_iq4_nl_ref`` tries 15 scales with importance
    weights): the scale maps the value of largest magnitude to −127 (ggml's starting point), every
    element takes the nearest level, then the scale is refit by least squares to those levels and the
    levels chosen once more at the fp16 scale."""
    nb = len(x)
    d = _signed_absmax(x) / _F32(-127)
    d[np.abs(d) < GROUP_MAX_EPS] = 0
    _, d = _iq4_fit(x, d)
    d16 = to_f16(d)
    q, _ = _iq4_fit(x, d16.astype(_F32))
    return pack_blocks(QType.IQ4_NL, nb, d=d16, qs=_pack_nibbles(q))


def _quant_iq4_xs(x: np.ndarray) -> np.ndarray:
    """Test data, not ggml's search: each group of 32 gets its IQ4_NL fit (as :func:`_quant_iq4_nl`), the
    8 scales become 6-bit multiples of an fp16 d (the largest in magnitude → −32, as ggml:
    ``d = −max/32``, ls = nearest_int(scale/d) in −32..31), and every element the nearest level at its
    stored group scale d·ls."""
    nb = len(x)
    xg = x.reshape(nb * 8, 32)
    s = _signed_absmax(xg) / _F32(-127)
    s[np.abs(s) < GROUP_MAX_EPS] = 0
    _, s = _iq4_fit(xg, s)
    s = s.reshape(nb, 8)
    max_scale = _signed_absmax(s)  # [nb]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    d = np.where(zero, np.float16(0), to_f16(-max_scale / _F32(32)))
    inv = _recip_or_zero(d.astype(_F32))
    ls = np.clip(nearest_int(s * inv[:, None]), -32, 31)  # [nb, 8]
    q, _ = _iq4_fit(xg, (d.astype(_F32)[:, None] * ls).reshape(-1))
    L = (ls + 32).astype(np.uint8)
    scales_l = (L[:, 0::2] & 0xF) | ((L[:, 1::2] & 0xF) << 4)
    scales_h = ((L.astype(np.uint16) >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    qs = _pack_nibbles(q).reshape(nb, 128)
    return pack_blocks(QType.IQ4_XS, nb, d=d, scales_h=scales_h, scales_l=scales_l, qs=qs)


QUANTIZE_BLOCKS: dict[QType, Callable[[np.ndarray], np.ndarray]] = {
    QType.Q8_0: _quant_q8_0,
    QType.Q4_0: _quant_q4_0,
    QType.Q5_0: _quant_q5_0,
    QType.Q2_K: _quant_q2_k,
    QType.Q3_K: _quant_q3_k,
    QType.Q4_K: _quant_q4_k,
    QType.Q5_K: _quant_q5_k,
    QType.Q6_K: _quant_q6_k,
    QType.MXFP4: _quant_mxfp4,
    QType.IQ4_NL: _quant_iq4_nl,
    QType.IQ4_XS: _quant_iq4_xs,
    **{t: functools.partial(iquants.quantize_blocks, t) for t in iquants.IQ_TYPES},
}


# ---------------------------------------------------------------- float types


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> bfloat16 bits uint16 [...]; agrees with ggml ``ggml_compute_fp32_to_bf16``.

    Round to nearest even on the dropped 16 bits; NaNs are kept quiet (bit 6 of the top half set).
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return np.where(is_nan, (u >> 16) | 64, rounded).astype(np.uint16)


# ---------------------------------------------------------------- public entry point


def quantize(x: np.ndarray, qtype: QType | int) -> np.ndarray:
    """Encode float values in a weight type.

    x: float [..., n] (converted to float32 first). n must be a multiple of 32 for
    Q8_0/Q4_0/Q5_0/MXFP4/IQ4_NL and of 256 for the K-quants and IQ4_XS (ValueError otherwise).
    Returns uint8 [..., row_bytes] for block types; float32 [..., n] for F32, float16 [..., n]
    for F16 and the bfloat16 bit patterns uint16 [..., n] for BF16.
    """
    qtype = QType(qtype)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("quantize: expected an array with at least one dimension")
    if qtype == QType.F32:
        return x.copy()
    if qtype == QType.F16:
        return to_f16(x)
    if qtype == QType.BF16:
        return f32_to_bf16(x)
    if qtype not in QUANTIZE_BLOCKS:
        raise ValueError(f"quantize: unsupported type {qtype.name}")
    fmt = block_format(qtype)
    n = x.shape[-1]
    if n % fmt.block_size:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {fmt.block_size}, got {n}")
    blocks = np.ascontiguousarray(x).reshape(-1, fmt.block_size)
    out = np.empty((len(blocks), fmt.type_size), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    for i in range(0, len(blocks), step):
        out[i : i + step] = QUANTIZE_BLOCKS[qtype](blocks[i : i + step])
    return out.reshape(*x.shape[:-1], fmt.row_bytes(n))
