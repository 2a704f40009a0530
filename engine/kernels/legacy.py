"""GEMV kernels for the 32-element block types Q8_0, Q4_0, Q5_0, MXFP4 and IQ4_NL.

Gather signature shared by all families (see ``engine.kernels.dispatch``)::

    kernel(raw uint8 [R, row_bytes], d float32 [R, n/32], rows int64 [M], xi int64 [M],
           <activations>, out float32 [M, T])
    out[i, t] = W[rows[i]] · x[xi[i] + t]

Exact-float kernels (``*_f``) take X float32 [K, n]. Q8-activation kernels (``*_q8``) take the
activations as ggml Q8_0 blocks, qa int8 [K, n], da float32 [K, n/32] (the fp16 scales) and
asum int32 [K, n/32] (code sums, for the −8/−16 offsets of Q4_0/Q5_0), and compute Σ_b d_w·d_a·Σ q_w·q_a like ``ggml_vec_dot_{q8_0,q4_0,q5_0}_q8_0``: exact int32 block
sums (pmaddubsw/pmaddwd), scaled and accumulated lane-wise in float32.

Block layouts (ggml-common.h): q8_0 = d fp16 | qs int8[32];
q4_0 = d | qs[16] (low nibbles: elements 0..15, high: 16..31), value q − 8;
q5_0 = d | qh u32 (bit j = fifth bit of element j) | qs[16], value q − 16;
mxfp4 = e u8 | qs[16] (nibble order as q4_0), value MXFP4_VALUES[q] (the doubled e2m1 values), and
``d`` the block's 2^(e−128) (``prepare_weight``); its q8 dot is ``ggml_vec_dot_mxfp4_q8_0``'s;
iq4_nl = d | qs[16] (nibble order as q4_0), value IQ4NL_VALUES[q] (ggml's kvalues_iq4nl), its q8 dot
``ggml_vec_dot_iq4_nl_q8_0``'s (the levels through one table lookup, signed × signed bytes).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels import drivers
from engine.kernels.drivers import specialise
from engine.kernels.lookups import load_iq4nl_codes, load_mxfp4_codes
from engine.kernels.simd import (
    bits_to_bytes,
    dot_sb_sb,
    dot_ub_sb,
    fma_i32,
    hsum_f32,
    i8_to_f32,
    load_f32x8,
    load_i8x32,
    load_nibbles16,
    load_u32,
    splat8,
    vfma,
    vfma_s,
    vor,
    vshl,
    vsub,
    zero_f32,
    zero_i32,
)


@njit(cache=True, nogil=True, inline="always")
def _codes_q8_0(w, b):
    return load_i8x32(w, b * 34 + 2)


@njit(cache=True, nogil=True, inline="always")
def _ucodes_q4_0(w, b):
    """Unsigned codes 0..15 (value + 8)."""
    return load_nibbles16(w, b * 18 + 2)


@njit(cache=True, nogil=True, inline="always")
def _ucodes_q5_0(w, b):
    """Unsigned codes 0..31 (value + 16)."""
    o = b * 22
    return vor(load_nibbles16(w, o + 6), vshl(bits_to_bytes(load_u32(w, o + 2)), 4))


@njit(cache=True, nogil=True, inline="always")
def _codes_mxfp4(w, b):
    """Signed codes −12..12 (the doubled e2m1 values)."""
    return load_mxfp4_codes(w, b * 17 + 1)


@njit(cache=True, nogil=True, inline="always")
def _codes_iq4_nl(w, b):
    """Signed levels −127..113 (kvalues_iq4nl)."""
    return load_iq4nl_codes(w, b * 18 + 2)


@njit(cache=True, nogil=True, inline="always")
def _codes_q4_0(w, b):
    return vsub(_ucodes_q4_0(w, b), splat8(8))


@njit(cache=True, nogil=True, inline="always")
def _codes_q5_0(w, b):
    return vsub(_ucodes_q5_0(w, b), splat8(16))


# --- per-row dot products: one template a shape, specialised on the type's codes ---------------

# The templates' placeholders, bound per type by ``specialise`` (engine.kernels.drivers).
_CODES = _UCODES = _OFFSET = None


@njit(cache=True, nogil=True, inline="always")
def _exact_block(q, x, xo):
    """Σ over one block of float(q)·x as an F32x8 (q: I8x32 signed codes)."""
    t = vfma(i8_to_f32(q, 0), load_f32x8(x, xo), zero_f32())
    t = vfma(i8_to_f32(q, 1), load_f32x8(x, xo + 8), t)
    t = vfma(i8_to_f32(q, 2), load_f32x8(x, xo + 16), t)
    return vfma(i8_to_f32(q, 3), load_f32x8(x, xo + 24), t)


def _dot_f(w, d, x):
    """Exact-float row dot of a type with signed codes _CODES."""
    acc = zero_f32()
    for b in range(d.shape[0]):
        acc = vfma_s(_exact_block(_CODES(w, b), x, 32 * b), d[b], acc)
    return hsum_f32(acc)


def _dot_signed_q8(w, d, qa, da, asum):
    """Q8 row dot of a type with signed codes _CODES (signed × signed bytes)."""
    acc = zero_f32()
    for b in range(d.shape[0]):
        iv = dot_sb_sb(zero_i32(), _CODES(w, b), load_i8x32(qa, 32 * b))
        acc = fma_i32(iv, d[b] * da[b], acc)
    return hsum_f32(acc)


def _dot_unsigned_q8(w, d, qa, da, asum):
    """Q8 row dot of a type with unsigned codes _UCODES = value + _OFFSET:
    Σ (u − offset)·a = Σ u·a − offset·Σ a, the unsigned codes straight into pmaddubsw."""
    acc = zero_f32()
    corr = np.float32(0.0)
    for b in range(d.shape[0]):
        dd = d[b] * da[b]
        acc = fma_i32(dot_ub_sb(zero_i32(), _UCODES(w, b), load_i8x32(qa, 32 * b)), dd, acc)
        corr += dd * np.float32(asum[b])
    return hsum_f32(acc) - np.float32(_OFFSET) * corr


# --- four tokens at once (prefill): each weight block is decoded once for all four -----------


@njit(cache=True, nogil=True, inline="always")
def _q8_step(q, a, b, scale, acc):
    """acc + scale·Σ q·a over block b (q signed codes; a activation row)."""
    return fma_i32(dot_sb_sb(zero_i32(), q, load_i8x32(a, 32 * b)), scale, acc)


@njit(cache=True, nogil=True, inline="always")
def _u_step(u, a, b, scale, acc):
    """acc + scale·Σ u·a over block b (u unsigned codes)."""
    return fma_i32(dot_ub_sb(zero_i32(), u, load_i8x32(a, 32 * b)), scale, acc)


def _dot4_signed(w, d, qa, da, asum, k):
    """Signed codes _CODES (Q8_0, MXFP4, IQ4_NL) against activation rows k..k+3."""
    a0, a1, a2, a3 = qa[k], qa[k + 1], qa[k + 2], qa[k + 3]
    f0 = zero_f32()
    f1 = zero_f32()
    f2 = zero_f32()
    f3 = zero_f32()
    for b in range(d.shape[0]):
        q = _CODES(w, b)
        db = d[b]
        f0 = _q8_step(q, a0, b, db * da[k, b], f0)
        f1 = _q8_step(q, a1, b, db * da[k + 1, b], f1)
        f2 = _q8_step(q, a2, b, db * da[k + 2, b], f2)
        f3 = _q8_step(q, a3, b, db * da[k + 3, b], f3)
    return hsum_f32(f0), hsum_f32(f1), hsum_f32(f2), hsum_f32(f3)


def _dot4_unsigned(w, d, qa, da, asum, k):
    """Unsigned codes _UCODES = value + _OFFSET (Q4_0, Q5_0) against activation rows k..k+3."""
    a0, a1, a2, a3 = qa[k], qa[k + 1], qa[k + 2], qa[k + 3]
    f0 = zero_f32()
    f1 = zero_f32()
    f2 = zero_f32()
    f3 = zero_f32()
    c0 = np.float32(0.0)
    c1 = np.float32(0.0)
    c2 = np.float32(0.0)
    c3 = np.float32(0.0)
    for b in range(d.shape[0]):
        u = _UCODES(w, b)
        db = d[b]
        s0 = db * da[k, b]
        s1 = db * da[k + 1, b]
        s2 = db * da[k + 2, b]
        s3 = db * da[k + 3, b]
        f0 = _u_step(u, a0, b, s0, f0)
        f1 = _u_step(u, a1, b, s1, f1)
        f2 = _u_step(u, a2, b, s2, f2)
        f3 = _u_step(u, a3, b, s3, f3)
        c0 += s0 * np.float32(asum[k, b])
        c1 += s1 * np.float32(asum[k + 1, b])
        c2 += s2 * np.float32(asum[k + 2, b])
        c3 += s3 * np.float32(asum[k + 3, b])
    o = np.float32(_OFFSET)
    return hsum_f32(f0) - o * c0, hsum_f32(f1) - o * c1, hsum_f32(f2) - o * c2, hsum_f32(f3) - o * c3


# --- the kernels of each type: row dots (the fused MoE and grouped kernels inline them too) and
# the parallel gather drivers (engine.kernels.drivers) -----------------------------------------

_INLINE = {"inline": "always"}
_PARALLEL = {"parallel": True}

_dot_q8_0_f = specialise(_dot_f, "_dot_q8_0_f", __name__, _CODES=_codes_q8_0)
_dot_q4_0_f = specialise(_dot_f, "_dot_q4_0_f", __name__, _CODES=_codes_q4_0)
_dot_q5_0_f = specialise(_dot_f, "_dot_q5_0_f", __name__, _CODES=_codes_q5_0)
_dot_mxfp4_f = specialise(_dot_f, "_dot_mxfp4_f", __name__, _CODES=_codes_mxfp4)
_dot_iq4_nl_f = specialise(_dot_f, "_dot_iq4_nl_f", __name__, _CODES=_codes_iq4_nl)

_dot_q8_0_q8 = specialise(_dot_signed_q8, "_dot_q8_0_q8", __name__, _INLINE, _CODES=_codes_q8_0)
_dot_mxfp4_q8 = specialise(_dot_signed_q8, "_dot_mxfp4_q8", __name__, _INLINE, _CODES=_codes_mxfp4)
_dot_iq4_nl_q8 = specialise(_dot_signed_q8, "_dot_iq4_nl_q8", __name__, _INLINE, _CODES=_codes_iq4_nl)
_dot_q4_0_q8 = specialise(_dot_unsigned_q8, "_dot_q4_0_q8", __name__, _INLINE, _UCODES=_ucodes_q4_0, _OFFSET=8.0)
_dot_q5_0_q8 = specialise(_dot_unsigned_q8, "_dot_q5_0_q8", __name__, _INLINE, _UCODES=_ucodes_q5_0, _OFFSET=16.0)

_dot4_q8_0_q8 = specialise(_dot4_signed, "_dot4_q8_0_q8", __name__, _CODES=_codes_q8_0)
_dot4_mxfp4_q8 = specialise(_dot4_signed, "_dot4_mxfp4_q8", __name__, _CODES=_codes_mxfp4)
_dot4_iq4_nl_q8 = specialise(_dot4_signed, "_dot4_iq4_nl_q8", __name__, _CODES=_codes_iq4_nl)
_dot4_q4_0_q8 = specialise(_dot4_unsigned, "_dot4_q4_0_q8", __name__, _UCODES=_ucodes_q4_0, _OFFSET=8.0)
_dot4_q5_0_q8 = specialise(_dot4_unsigned, "_dot4_q5_0_q8", __name__, _UCODES=_ucodes_q5_0, _OFFSET=16.0)

gemv_q8_0_f = specialise(drivers.gemv_f, "gemv_q8_0_f", __name__, _PARALLEL, _DOT=_dot_q8_0_f)
gemv_q4_0_f = specialise(drivers.gemv_f, "gemv_q4_0_f", __name__, _PARALLEL, _DOT=_dot_q4_0_f)
gemv_q5_0_f = specialise(drivers.gemv_f, "gemv_q5_0_f", __name__, _PARALLEL, _DOT=_dot_q5_0_f)
gemv_mxfp4_f = specialise(drivers.gemv_f, "gemv_mxfp4_f", __name__, _PARALLEL, _DOT=_dot_mxfp4_f)
gemv_iq4_nl_f = specialise(drivers.gemv_f, "gemv_iq4_nl_f", __name__, _PARALLEL, _DOT=_dot_iq4_nl_f)

gemv_q8_0_q8 = specialise(drivers.gemv_q8, "gemv_q8_0_q8", __name__, _PARALLEL, _DOT=_dot_q8_0_q8, _DOT4=_dot4_q8_0_q8)
gemv_q4_0_q8 = specialise(drivers.gemv_q8, "gemv_q4_0_q8", __name__, _PARALLEL, _DOT=_dot_q4_0_q8, _DOT4=_dot4_q4_0_q8)
gemv_q5_0_q8 = specialise(drivers.gemv_q8, "gemv_q5_0_q8", __name__, _PARALLEL, _DOT=_dot_q5_0_q8, _DOT4=_dot4_q5_0_q8)
gemv_mxfp4_q8 = specialise(
    drivers.gemv_q8, "gemv_mxfp4_q8", __name__, _PARALLEL, _DOT=_dot_mxfp4_q8, _DOT4=_dot4_mxfp4_q8
)
gemv_iq4_nl_q8 = specialise(
    drivers.gemv_q8, "gemv_iq4_nl_q8", __name__, _PARALLEL, _DOT=_dot_iq4_nl_q8, _DOT4=_dot4_iq4_nl_q8
)
