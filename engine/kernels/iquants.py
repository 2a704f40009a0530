"""GEMV kernels for the IQ2/IQ3 grid types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S.

One block decoder for the five types (``_group``, picked by ggml type id) and one row dot per variant
(``dot_f``: exact float; ``dot_q8``/``dot4_q8``: Q8_K activations), written once for all of them with the
type id ``qt`` as first argument (the fused MoE and grouped kernels call them so). Layouts and the
element value ``d·mult·(2s + 1)·grid·sign`` are in ``engine.quant.iquants``; ``prepare_weight`` stores
``d·mult`` per block (exact: mult is a power of two), so every type's block scale is one float here.

A 32-element group decodes as ggml's AVX2 code does (``ggml_vec_dot_iq2_xxs_q8_K`` etc.): four 8-byte grid
rows (IQ3: eight 4-byte ones) read as 64-bit words and four 64-bit sign masks (0x00/0xFF per byte: the
parity types look their 7-bit index up in ``ksigns``) combine into 32 signed bytes ``(g ^ m) − m``, one
vector; the odd scales 2s + 1 multiply the pair sums (per 16 elements for IQ2_XS and IQ2_S). The q8 dot is
ggml's integer sum Σ_g (2s+1)·Σ grid·sign·q8 per block, times d·mult·d8 in float32; the exact-float dot
multiplies the same signed bytes, as floats, by x and each 16's Σ by d·mult·(2s + 1) (the dequantizer's
float32 scale, exactly).

The parallel gather drivers are ``engine.kernels.drivers``' templates, specialised once for all five types
(``gemv_f(raw, s, rows, xi, X, out)``, ``gemv_q8(raw, s, rows, xi, qa, da, bsums, out)``: the gather signature
of the other families, ``engine.kernels.dispatch``): each row's type follows from its bytes per block
(``type_of_row``), so one compiled driver serves every IQ type. ``KERNELS`` maps each type to that pair.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from engine.kernels import drivers
from engine.kernels.drivers import specialise
from engine.kernels.simd import (
    I8x32,
    I16x16,
    fma_i32,
    hsum_f32,
    i8_to_f32,
    load_f32x8,
    load_i8x32,
    load_u32,
    madd_acc,
    maddss,
    vfma,
    vfma_s,
    zero_f32,
    zero_i32,
)
from engine.quant.formats import QType, block_format
from engine.quant.iquants import IQ_TYPES, KSIGNS, grid_words, sign_masks

IQ_IDS = tuple(int(t) for t in IQ_TYPES)  # 16 IQ2_XXS, 17 IQ2_XS, 22 IQ2_S, 18 IQ3_XXS, 21 IQ3_S

# Tables as module globals: numba freezes them into the compiled code.
_G2XXS = grid_words(QType.IQ2_XXS)  # uint64 [256]
_G2XS = grid_words(QType.IQ2_XS)  # uint64 [512]
_G2S = grid_words(QType.IQ2_S)  # uint64 [1024]
_G3XXS = grid_words(QType.IQ3_XXS).astype(np.uint64)  # [256], 4 bytes each
_G3S = grid_words(QType.IQ3_S).astype(np.uint64)  # [512]
_SMASK = sign_masks()  # uint64 [256]: sign byte -> 0x00/0xFF bytes
_KSMASK = _SMASK[KSIGNS]  # uint64 [128]: 7-bit sign index -> mask (the eighth sign by parity)
_U32 = np.uint64(32)


@intrinsic
def signed_grid(typingctx, g0, g1, g2, g3, m0, m1, m2, m3):
    """Four 64-bit grid words and four sign masks -> I8x32 (g ^ m) − m: byte j of word i is element
    8i + j, negated where its mask byte is 0xFF."""

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        v4 = ir.VectorType(i64, 4)

        def vec(vals, tys):
            v = ir.Constant(v4, ir.Undefined)
            for i, (a, t) in enumerate(zip(vals, tys)):
                a = context.cast(builder, a, t, types.uint64)
                v = builder.insert_element(v, a, ir.Constant(ir.IntType(32), i))
            return builder.bitcast(v, ir.VectorType(ir.IntType(8), 32))

        g = vec(args[:4], sig.args[:4])
        m = vec(args[4:], sig.args[4:])
        return builder.sub(builder.xor(g, m), m)

    return I8x32(g0, g1, g2, g3, m0, m1, m2, m3), codegen


@intrinsic
def scale_pair(typingctx, a, b):
    """Two scalars -> I16x16 with lanes 0..7 = a (the pair sums of elements 0..15), 8..15 = b."""

    def codegen(context, builder, sig, args):
        i16 = ir.IntType(16)
        v = ir.Constant(ir.VectorType(i16, 16), ir.Undefined)
        x = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), i16)
        y = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), i16)
        for i in range(16):
            v = builder.insert_element(v, x if i < 8 else y, ir.Constant(ir.IntType(32), i))
        return v

    return I16x16(a, b), codegen


@njit(cache=True, nogil=True, inline="always")
def block_bytes(qt):
    """Bytes of one 256-element block of type ``qt``."""
    if qt == 16:
        return 66
    if qt == 17:
        return 74
    if qt == 22:
        return 82
    if qt == 18:
        return 98
    return 110  # 21: IQ3_S


@njit(cache=True, nogil=True, inline="always")
def _u16(w, p):
    return np.int64(w[p]) | (np.int64(w[p + 1]) << 8)


@njit(cache=True, nogil=True, inline="always")
def _w3(table, a, b):
    """Two 4-byte grid rows as one 64-bit word (a in the low half)."""
    return table[a] | (table[b] << _U32)


@njit(cache=True, nogil=True, inline="always")
def _group(qt, w, o, g):
    """Group g (elements 32g..32g+31) of the block at byte o -> (I8x32 grid·sign, odd scale of elements
    0..15, odd scale of 16..31)."""
    if qt == 16:  # IQ2_XXS: u32 of 4 grid indices, u32 of 4 sign indices | s << 28
        a = load_u32(w, o + 2 + 8 * g)
        b = load_u32(w, o + 6 + 8 * g)
        ls = 2 * (b >> 28) + 1
        v = signed_grid(
            _G2XXS[a & 255],
            _G2XXS[(a >> 8) & 255],
            _G2XXS[(a >> 16) & 255],
            _G2XXS[(a >> 24) & 255],
            _KSMASK[b & 127],
            _KSMASK[(b >> 7) & 127],
            _KSMASK[(b >> 14) & 127],
            _KSMASK[(b >> 21) & 127],
        )
        return v, ls, ls
    if qt == 17 or qt == 22:
        sc = np.int64(w[o + 66 + g]) if qt == 17 else np.int64(w[o + 74 + g])
        if qt == 17:  # IQ2_XS: u16 = 9-bit grid index | 7-bit sign index << 9
            q0 = _u16(w, o + 2 + 8 * g)
            q1 = _u16(w, o + 4 + 8 * g)
            q2 = _u16(w, o + 6 + 8 * g)
            q3 = _u16(w, o + 8 + 8 * g)
            v = signed_grid(
                _G2XS[q0 & 511],
                _G2XS[q1 & 511],
                _G2XS[q2 & 511],
                _G2XS[q3 & 511],
                _KSMASK[q0 >> 9],
                _KSMASK[q1 >> 9],
                _KSMASK[q2 >> 9],
                _KSMASK[q3 >> 9],
            )
        else:  # IQ2_S: qs low bytes, qh's 2 bits each, a sign byte per 8
            p = o + 2 + 4 * g
            h = np.int64(w[o + 66 + g])
            v = signed_grid(
                _G2S[np.int64(w[p]) | ((h << 8) & 0x300)],
                _G2S[np.int64(w[p + 1]) | ((h << 6) & 0x300)],
                _G2S[np.int64(w[p + 2]) | ((h << 4) & 0x300)],
                _G2S[np.int64(w[p + 3]) | ((h << 2) & 0x300)],
                _SMASK[w[p + 32]],
                _SMASK[w[p + 33]],
                _SMASK[w[p + 34]],
                _SMASK[w[p + 35]],
            )
        return v, 2 * (sc & 15) + 1, 2 * (sc >> 4) + 1
    p = o + 2 + 8 * g
    if qt == 18:  # IQ3_XXS: 8 grid indices, then a u32 of 4 sign indices | s << 28
        b = load_u32(w, o + 66 + 4 * g)
        ls = 2 * (b >> 28) + 1
        v = signed_grid(
            _w3(_G3XXS, w[p], w[p + 1]),
            _w3(_G3XXS, w[p + 2], w[p + 3]),
            _w3(_G3XXS, w[p + 4], w[p + 5]),
            _w3(_G3XXS, w[p + 6], w[p + 7]),
            _KSMASK[b & 127],
            _KSMASK[(b >> 7) & 127],
            _KSMASK[(b >> 14) & 127],
            _KSMASK[(b >> 21) & 127],
        )
        return v, ls, ls
    # IQ3_S: 8 low index bytes, bit j of qh[g] the ninth bit of index j, a sign byte per 8, s in a nibble
    h = np.int64(w[o + 66 + g])
    ls = 2 * ((np.int64(w[o + 106 + g // 2]) >> (4 * (g % 2))) & 15) + 1
    sp = o + 74 + 4 * g
    v = signed_grid(
        _w3(_G3S, np.int64(w[p]) | ((h << 8) & 256), np.int64(w[p + 1]) | ((h << 7) & 256)),
        _w3(_G3S, np.int64(w[p + 2]) | ((h << 6) & 256), np.int64(w[p + 3]) | ((h << 5) & 256)),
        _w3(_G3S, np.int64(w[p + 4]) | ((h << 4) & 256), np.int64(w[p + 5]) | ((h << 3) & 256)),
        _w3(_G3S, np.int64(w[p + 6]) | ((h << 2) & 256), np.int64(w[p + 7]) | ((h << 1) & 256)),
        _SMASK[w[sp]],
        _SMASK[w[sp + 1]],
        _SMASK[w[sp + 2]],
        _SMASK[w[sp + 3]],
    )
    return v, ls, ls


# --- exact float ------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def dot_f(qt, w, s, x):
    """One row: Σ_blocks Σ_16s d·mult·(2s + 1) · Σ float(grid·sign)·x."""
    acc = zero_f32()
    nbytes = block_bytes(qt)
    for b in range(s.shape[0]):
        o = b * nbytes
        d = s[b]
        for g in range(8):
            v, l0, l1 = _group(qt, w, o, g)
            xo = 256 * b + 32 * g
            ta = vfma(i8_to_f32(v, 1), load_f32x8(x, xo + 8), vfma(i8_to_f32(v, 0), load_f32x8(x, xo), zero_f32()))
            tb = vfma(
                i8_to_f32(v, 3), load_f32x8(x, xo + 24), vfma(i8_to_f32(v, 2), load_f32x8(x, xo + 16), zero_f32())
            )
            acc = vfma_s(tb, d * np.float32(l1), vfma_s(ta, d * np.float32(l0), acc))
    return hsum_f32(acc)


# --- Q8_K activations -------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def dot_q8(qt, w, s, qa, da):
    """One row against one Q8_K activation row (qa int8 [n], da float32 [n/256])."""
    acc = zero_f32()
    nbytes = block_bytes(qt)
    for b in range(s.shape[0]):
        o = b * nbytes
        iacc = zero_i32()
        for g in range(8):
            v, l0, l1 = _group(qt, w, o, g)
            iacc = madd_acc(iacc, maddss(v, load_i8x32(qa, 256 * b + 32 * g)), scale_pair(l0, l1))
        acc = fma_i32(iacc, s[b] * da[b], acc)
    return hsum_f32(acc)


@njit(cache=True, nogil=True)
def dot4_q8(qt, w, s, qa, da, k):
    """One row against activation rows k..k+3 (one decode of each group) -> 4 float32, each equal to
    ``dot_q8`` on its row."""
    a0, a1, a2, a3 = qa[k], qa[k + 1], qa[k + 2], qa[k + 3]
    f0 = zero_f32()
    f1 = zero_f32()
    f2 = zero_f32()
    f3 = zero_f32()
    nbytes = block_bytes(qt)
    for b in range(s.shape[0]):
        o = b * nbytes
        i0 = zero_i32()
        i1 = zero_i32()
        i2 = zero_i32()
        i3 = zero_i32()
        for g in range(8):
            v, l0, l1 = _group(qt, w, o, g)
            sc = scale_pair(l0, l1)
            xo = 256 * b + 32 * g
            i0 = madd_acc(i0, maddss(v, load_i8x32(a0, xo)), sc)
            i1 = madd_acc(i1, maddss(v, load_i8x32(a1, xo)), sc)
            i2 = madd_acc(i2, maddss(v, load_i8x32(a2, xo)), sc)
            i3 = madd_acc(i3, maddss(v, load_i8x32(a3, xo)), sc)
        d = s[b]
        f0 = fma_i32(i0, d * da[k, b], f0)
        f1 = fma_i32(i1, d * da[k + 1, b], f1)
        f2 = fma_i32(i2, d * da[k + 2, b], f2)
        f3 = fma_i32(i3, d * da[k + 3, b], f3)
    return hsum_f32(f0), hsum_f32(f1), hsum_f32(f2), hsum_f32(f3)


# --- the parallel gather drivers (engine.kernels.drivers), one for the five types ----------------------


@njit(cache=True, nogil=True, inline="always")
def type_of_row(w, s):
    """The IQ type id of a row ``w`` from its bytes per 256-element block (``s`` holds one scale a block): 66,
    74, 82, 98 and 110 bytes name one type each, so one driver serves the five without a type argument."""
    b = w.shape[0] // s.shape[0]
    if b == 66:
        return 16
    if b == 74:
        return 17
    if b == 82:
        return 22
    if b == 98:
        return 18
    return 21


@njit(cache=True, nogil=True, inline="always")
def _dot_f_row(w, s, x):
    return dot_f(type_of_row(w, s), w, s, x)


@njit(cache=True, nogil=True, inline="always")
def _dot_q8_row(w, s, qa, da, bsums):
    return dot_q8(type_of_row(w, s), w, s, qa, da)


@njit(cache=True, nogil=True, inline="always")
def _dot4_q8_row(w, s, qa, da, bsums, k):
    return dot4_q8(type_of_row(w, s), w, s, qa, da, k)


_PARALLEL = {"parallel": True}
gemv_f = specialise(drivers.gemv_f, "gemv_f", __name__, _PARALLEL, _DOT=_dot_f_row)
gemv_q8 = specialise(drivers.gemv_q8, "gemv_q8", __name__, _PARALLEL, _DOT=_dot_q8_row, _DOT4=_dot4_q8_row)

# The dispatch table's entry points: (exact-float, q8) of each type; one pair serves all five.
KERNELS = {t: (gemv_f, gemv_q8) for t in IQ_TYPES}
assert all(block_bytes.py_func(int(t)) == block_format(t).type_size for t in IQ_TYPES)
