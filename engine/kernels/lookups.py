"""Per-format table lookups for the numba kernels: 4-bit codes to signed-byte levels in an ``I8x32``.

MXFP4 (e2m1, doubled) and IQ4_NL/IQ4_XS (ggml's ``kvalues_iq4nl``) store 16 nibbles a 32-element
group; these intrinsics unpack them (low nibbles then high, the q4_0 order) and map each to its
level: one ``pshufb`` with AVX2 (the 16-entry table sits in both 16-byte lanes), elsewhere the
same mapping in plain LLVM vector IR (an e2m1 decoding, or a select chain). The vector types and
codegen helpers are :mod:`engine.kernels.simd`'s, and so is the switch: ``simd.HAS_AVX2`` is read when a
kernel is lowered (the tests patch it there to lower the fallback too).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from engine.kernels import simd
from engine.kernels.simd import I8x32, _call, _check_array, _const, _data_ptr, _shuffle, _vt
from engine.quant.reference import IQ4NL_VALUES as _IQ4NL_TABLE
from engine.quant.reference import MXFP4_VALUES as _MXFP4_TABLE


def _nibbles(context, builder, sig, args):
    """Codegen: the 16 bytes at element args[1] of the 1-D array args[0] -> 32 nibbles as bytes, low then high."""
    v16 = ir.VectorType(ir.IntType(8), 16)
    v = builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], v16), align=1)
    return _shuffle(builder, builder.and_(v, _const(v16, 15)), builder.lshr(v, _const(v16, 4)), range(32))


def _pshufb(builder, values, idx):
    """Codegen: I8x32 of values[idx] (16 signed bytes) in one pshufb, which looks up within each 16-byte
    lane: the table in both."""
    vt = _vt(I8x32)
    table = ir.Constant(vt, [x & 0xFF for x in values * 2])
    return _call(builder, "llvm.x86.avx2.pshuf.b", vt, [table, idx])


# MXFP4 (e2m1) codes as signed bytes, doubled: ggml's kvalues_mxfp4 (engine.quant.reference's table).
MXFP4_VALUES = tuple(int(v) for v in _MXFP4_TABLE)


@intrinsic
def load_mxfp4_codes(typingctx, arr, off):
    """16 bytes of MXFP4 nibbles at ``off`` -> I8x32 of their values (:data:`MXFP4_VALUES`), low nibbles
    then high (elements 0..15, 16..31). One ``pshufb`` with AVX2; elsewhere the e2m1 decoding in
    plain vector IR: magnitude m = code & 7 is m for m < 2, else (2 + (m & 1)) << ((m >> 1) − 1); bit 3 the sign."""
    _check_array(arr, (types.uint8, types.int8), "load_mxfp4_codes")

    def codegen(context, builder, sig, args):
        idx = _nibbles(context, builder, sig, args)
        vt = _vt(I8x32)
        if simd.HAS_AVX2:
            return _pshufb(builder, MXFP4_VALUES, idx)
        m = builder.and_(idx, _const(vt, 7))
        e = builder.lshr(m, _const(vt, 1))
        sub = builder.icmp_unsigned("==", e, _const(vt, 0))
        amt = builder.select(sub, _const(vt, 0), builder.sub(e, _const(vt, 1)))
        big = builder.shl(builder.add(_const(vt, 2), builder.and_(m, _const(vt, 1))), amt)
        mag = builder.select(sub, m, big)
        neg = builder.icmp_unsigned("!=", builder.and_(idx, _const(vt, 8)), _const(vt, 0))
        return builder.select(neg, builder.sub(_const(vt, 0), mag), mag)

    return I8x32(arr, off), codegen


# IQ4_NL/IQ4_XS levels as signed bytes: ggml's kvalues_iq4nl (engine.quant.reference's table).
IQ4NL_VALUES = tuple(int(v) for v in _IQ4NL_TABLE)


@intrinsic
def load_iq4nl_codes(typingctx, arr, off):
    """16 bytes of IQ4_NL nibbles at ``off`` -> I8x32 of their levels (:data:`IQ4NL_VALUES`), low nibbles
    then high (elements 0..15, 16..31). One ``pshufb`` with AVX2 (as ggml's ``vec_dot_iq4_nl_q8_0``);
    elsewhere a select per level in plain vector IR."""
    _check_array(arr, (types.uint8, types.int8), "load_iq4nl_codes")

    def codegen(context, builder, sig, args):
        idx = _nibbles(context, builder, sig, args)
        vt = _vt(I8x32)
        if simd.HAS_AVX2:
            return _pshufb(builder, IQ4NL_VALUES, idx)
        out = _const(vt, IQ4NL_VALUES[0] & 0xFF)
        for k in range(1, 16):
            out = builder.select(
                builder.icmp_unsigned("==", idx, _const(vt, k)), _const(vt, IQ4NL_VALUES[k] & 0xFF), out
            )
        return out

    return I8x32(arr, off), codegen
