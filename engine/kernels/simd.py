"""256-bit SIMD vectors for numba kernels, as numba types backed by LLVM vector registers.

numba cannot be relied on to auto-vectorize block-quantized dot products: small integer
arithmetic is widened to int64, lane arrays live in memory behind alias checks, and per-block
horizontal sums dominate. These intrinsics let a kernel say exactly what llama.cpp's AVX2 code
says (ggml-cpu/arch/x86/quants.c) while the values stay in registers across loop iterations:

* ``I8x32``, ``I16x16``, ``I32x8``, ``F32x8``: vectors of 32 bytes.
* integer dot steps: ``maddubs`` (u8·s8 pairs → i16, x86 ``pmaddubsw``) and ``madd`` (i16 pairs
  → i32, ``pmaddwd``); on CPUs without AVX2 the same operations are emitted as plain LLVM
  vector IR (``maddubs_generic``/``madd_generic``), which any backend can lower.
* loads from 1-D numpy arrays at an element offset (unaligned, no bounds check: callers index
  within the row they were given), nibble/bit unpacking, broadcasts, float conversion.

The per-format table lookups (MXFP4 and IQ4_NL/IQ4_XS codes to levels) are :mod:`engine.kernels.lookups`'.

Every intrinsic is a pure function of its arguments; vectors are values, never arrays.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numba
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, models, register_model

from engine import config


class Vec(types.Type):
    """A SIMD vector of ``count`` elements of numba scalar type ``elem``."""

    def __init__(self, elem, count):
        self.elem = elem
        self.count = count
        super().__init__(name=f"Vec{count}x{elem}")


I8x32 = Vec(types.int8, 32)
I16x16 = Vec(types.int16, 16)
I32x8 = Vec(types.int32, 8)
F32x8 = Vec(types.float32, 8)

_LL = {types.int8: ir.IntType(8), types.int16: ir.IntType(16), types.int32: ir.IntType(32)}
_LL[types.float32] = ir.FloatType()
_i32 = ir.IntType(32)


def _vt(t: Vec) -> ir.VectorType:
    return ir.VectorType(_LL[t.elem], t.count)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _vt(fe_type))


_FEATURES = llvm_binding.get_host_cpu_features().flatten().split(",")
HAS_AVX2 = "+avx2" in _FEATURES
# VNNI dot steps on 256-bit vectors: AVX-VNNI, or AVX512-VNNI with AVX512VL (LLVM names both
# ``llvm.x86.avx512.vpdp*.256`` and picks the encoding). SHARPI_NO_VNNI=1 turns them off (tests
# hold the two paths together; EngineOptions.vnni, read here at import from engine.config.current()).
HAS_VNNI = HAS_AVX2 and ("+avxvnni" in _FEATURES or {"+avx512vnni", "+avx512vl"} <= set(_FEATURES))
if not config.current().vnni:
    HAS_VNNI = False
    # numba keys its on-disk cache by signature and the CPU's feature string, not by this switch:
    # compile for the CPU without VNNI, so LLVM emits none either and the two builds are cached apart.
    _FEATURES = [{"+avxvnni": "-avxvnni", "+avx512vnni": "-avx512vnni"}.get(f, f) for f in _FEATURES if f]
    numba.config.CPU_FEATURES = ",".join(_FEATURES)


# --- helpers used inside codegen ------------------------------------------------------------


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _const(vt: ir.VectorType, v):
    return ir.Constant(vt, [v] * vt.count)


def _splat(builder, vt: ir.VectorType, val):
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(_i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_i32, vt.count), None))


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_i32, len(idx)), list(idx)))


def _int_cast(builder, v, ty):
    if v.type.width > ty.width:
        return builder.trunc(v, ty)
    if v.type.width < ty.width:
        return builder.sext(v, ty)
    return v


def _data_ptr(context, builder, aryty, ary, off, elem_ll):
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.gep(data, [off])
    return builder.bitcast(ptr, ir.PointerType(elem_ll))


def _check_array(arr, dtypes, what):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype in dtypes):
        raise TypingError(f"{what}: expected a 1-D array of {dtypes}, got {arr}")


# --- loads ----------------------------------------------------------------------------------


@intrinsic
def load_i8x32(typingctx, arr, off):
    """32 bytes of a uint8/int8 array from element ``off``."""
    _check_array(arr, (types.uint8, types.int8), "load_i8x32")

    def codegen(context, builder, sig, args):
        return builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], _vt(I8x32)), align=1)

    return I8x32(arr, off), codegen


@intrinsic
def load_i16x16(typingctx, arr, off):
    """16 int16 values from element ``off``."""
    _check_array(arr, (types.int16, types.uint16), "load_i16x16")

    def codegen(context, builder, sig, args):
        return builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], _vt(I16x16)), align=2)

    return I16x16(arr, off), codegen


@intrinsic
def load_i8x16_as_i16(typingctx, arr, off):
    """16 signed bytes from element ``off``, sign-extended to int16 lanes."""
    _check_array(arr, (types.uint8, types.int8), "load_i8x16_as_i16")

    def codegen(context, builder, sig, args):
        v = builder.load(
            _data_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), 16)), align=1
        )
        return builder.sext(v, _vt(I16x16))

    return I16x16(arr, off), codegen


@intrinsic
def load_f32x8(typingctx, arr, off):
    """8 float32 values from element ``off``."""
    _check_array(arr, (types.float32,), "load_f32x8")

    def codegen(context, builder, sig, args):
        return builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], _vt(F32x8)), align=4)

    return F32x8(arr, off), codegen


@intrinsic
def load_f16x8(typingctx, arr, off):
    """8 fp16 bit patterns (uint16 array) from element ``off``, converted exactly to float32."""
    _check_array(arr, (types.uint16, types.int16), "load_f16x8")

    def codegen(context, builder, sig, args):
        h = builder.load(
            _data_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.HalfType(), 8)), align=2
        )
        return builder.fpext(h, _vt(F32x8))

    return F32x8(arr, off), codegen


@intrinsic
def load_bf16x8(typingctx, arr, off):
    """8 bf16 bit patterns (uint16 array) from element ``off``, converted exactly to float32."""
    _check_array(arr, (types.uint16, types.int16), "load_bf16x8")

    def codegen(context, builder, sig, args):
        return _load_bf16(context, builder, sig, args)

    return F32x8(arr, off), codegen


def _load_bf16(context, builder, sig, args):
    """Codegen: 8 bf16 bit patterns at element args[1] of the 1-D array args[0], widened exactly to float32."""
    h = builder.load(
        _data_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(16), 8)), align=2
    )
    u = builder.shl(builder.zext(h, _vt(I32x8)), _const(_vt(I32x8), 16))
    return builder.bitcast(u, _vt(F32x8))


@intrinsic
def load_kv8(typingctx, arr, off):
    """8 values of a KV-cache row as float32: a float32 array read as is, a uint16 array read as bf16 bit
    patterns (exact widening). The array's dtype picks the format when the kernel compiles."""
    _check_array(arr, (types.float32, types.uint16), "load_kv8")
    bf16 = arr.dtype == types.uint16

    def codegen(context, builder, sig, args):
        if not bf16:
            return builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], _vt(F32x8)), align=4)
        return _load_bf16(context, builder, sig, args)

    return F32x8(arr, off), codegen


@intrinsic
def store_kv8(typingctx, arr, off, v):
    """arr[off:off+8] = v (F32x8): float32 as is, or for a uint16 array bf16 bit patterns rounded to nearest
    even (torch's float32 → bfloat16 conversion; a NaN stays a quiet NaN). No bounds check."""
    _check_array(arr, (types.float32, types.uint16), "store_kv8")
    if v != F32x8:
        raise TypingError(f"store_kv8: expected an F32x8 value, got {v}")
    bf16 = arr.dtype == types.uint16

    def codegen(context, builder, sig, args):
        if not bf16:
            ptr = _data_ptr(context, builder, sig.args[0], args[0], args[1], _vt(F32x8))
            builder.store(args[2], ptr, align=4)
            return context.get_dummy_value()
        i32 = _vt(I32x8)
        u = builder.bitcast(args[2], i32)
        odd = builder.and_(builder.lshr(u, _const(i32, 16)), _const(i32, 1))
        r = builder.lshr(builder.add(builder.add(u, _const(i32, 0x7FFF)), odd), _const(i32, 16))
        nan = builder.fcmp_unordered("uno", args[2], args[2])
        quiet = builder.or_(builder.lshr(u, _const(i32, 16)), _const(i32, 0x40))
        r = builder.select(nan, quiet, r)
        h = builder.trunc(r, ir.VectorType(ir.IntType(16), 8))
        ptr = _data_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(16), 8))
        builder.store(h, ptr, align=2)
        return context.get_dummy_value()

    return types.none(arr, off, v), codegen


@intrinsic
def load_nibbles16(typingctx, arr, off):
    """16 bytes at ``off`` -> 32 bytes: low nibbles then high nibbles (q4_0/q5_0 element order)."""
    _check_array(arr, (types.uint8, types.int8), "load_nibbles16")

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(ir.IntType(8), 16)
        v = builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], v16), align=1)
        lo = builder.and_(v, _const(v16, 15))
        hi = builder.lshr(v, _const(v16, 4))
        return _shuffle(builder, lo, hi, range(32))

    return I8x32(arr, off), codegen


@intrinsic
def bits_to_bytes(typingctx, word):
    """uint32 -> I8x32 whose byte i is bit i of ``word`` (0 or 1)."""

    def codegen(context, builder, sig, args):
        w = _int_cast(builder, args[0], _i32)
        bits = builder.bitcast(w, ir.VectorType(ir.IntType(1), 32))
        return builder.zext(bits, _vt(I8x32))

    return I8x32(word), codegen


@intrinsic
def k4_scales(typingctx, arr, off):
    """The 12 packed bytes of a q4_K/q5_K block at ``off`` -> I16x16 [scale 0..7, min 0..7].

    Bytes 0..3 hold scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7; bytes 4..7 the
    same for the mins; bytes 8..11 the low 4 bits of scales 4..7 (low nibble) and mins 4..7
    (high nibble) — ggml ``get_scale_min_k4``, done on 32-bit words.
    """
    _check_array(arr, (types.uint8, types.int8), "k4_scales")

    def codegen(context, builder, sig, args):
        p = _data_ptr(context, builder, sig.args[0], args[0], args[1], _i32)
        a = builder.load(p, align=1)
        b = builder.load(builder.gep(p, [ir.Constant(_i32, 1)]), align=1)
        c = builder.load(builder.gep(p, [ir.Constant(_i32, 2)]), align=1)

        def k(x):
            return ir.Constant(_i32, x)

        sc_lo = builder.and_(a, k(0x3F3F3F3F))
        mn_lo = builder.and_(b, k(0x3F3F3F3F))
        top_a = builder.shl(builder.and_(builder.lshr(a, k(6)), k(0x03030303)), k(4))
        top_b = builder.shl(builder.and_(builder.lshr(b, k(6)), k(0x03030303)), k(4))
        sc_hi = builder.or_(builder.and_(c, k(0x0F0F0F0F)), top_a)
        mn_hi = builder.or_(builder.and_(builder.lshr(c, k(4)), k(0x0F0F0F0F)), top_b)
        v = ir.Constant(ir.VectorType(_i32, 4), ir.Undefined)
        for i, part in enumerate((sc_lo, sc_hi, mn_lo, mn_hi)):
            v = builder.insert_element(v, part, k(i))
        return builder.zext(builder.bitcast(v, ir.VectorType(ir.IntType(8), 16)), _vt(I16x16))

    return I16x16(arr, off), codegen


@intrinsic
def k3_scales(typingctx, arr, off):
    """The 12 packed bytes of a q3_K block at ``off`` -> I16x16 of its 16 signed sub-block scales
    (the stored 6 bits − 32): low 4 bits in bytes 0..7 (scales 0..7 low nibbles, 8..15 high), top 2
    bits in bytes 8..11 — ggml ``dequantize_row_q3_K``'s kmask1/kmask2 shuffle on 32-bit words.
    """
    _check_array(arr, (types.uint8, types.int8), "k3_scales")

    def codegen(context, builder, sig, args):
        p = _data_ptr(context, builder, sig.args[0], args[0], args[1], _i32)
        a = builder.load(p, align=1)
        b = builder.load(builder.gep(p, [ir.Constant(_i32, 1)]), align=1)
        t = builder.load(builder.gep(p, [ir.Constant(_i32, 2)]), align=1)

        def k(x):
            return ir.Constant(_i32, x)

        def top(shift):
            return builder.shl(builder.and_(builder.lshr(t, k(shift)), k(0x03030303)), k(4))

        parts = (
            builder.or_(builder.and_(a, k(0x0F0F0F0F)), top(0)),
            builder.or_(builder.and_(b, k(0x0F0F0F0F)), top(2)),
            builder.or_(builder.and_(builder.lshr(a, k(4)), k(0x0F0F0F0F)), top(4)),
            builder.or_(builder.and_(builder.lshr(b, k(4)), k(0x0F0F0F0F)), top(6)),
        )
        v = ir.Constant(ir.VectorType(_i32, 4), ir.Undefined)
        for i, part in enumerate(parts):
            v = builder.insert_element(v, part, k(i))
        wide = builder.zext(builder.bitcast(v, ir.VectorType(ir.IntType(8), 16)), _vt(I16x16))
        return builder.sub(wide, _const(_vt(I16x16), 32))

    return I16x16(arr, off), codegen


# --- lane-wise integer ops ------------------------------------------------------------------


def _binop(name):
    def impl(typingctx, a, b):
        if not (isinstance(a, Vec) and a == b):
            raise TypingError(f"{name}: expected two vectors of one type, got {a}, {b}")

        op = {"add": "fadd", "sub": "fsub"}.get(name, name) if a.elem == types.float32 else name

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(*args)

        return a(a, b), codegen

    return intrinsic(impl)


vadd = _binop("add")
vsub = _binop("sub")
vand = _binop("and_")
vor = _binop("or_")


def _shift(name):
    def impl(typingctx, a, k):
        if not isinstance(a, Vec) or a.elem == types.float32:
            raise TypingError(f"{name}: expected an integer vector, got {a}")

        def codegen(context, builder, sig, args):
            vt = _vt(sig.args[0])
            return getattr(builder, name)(args[0], _splat(builder, vt, _int_cast(builder, args[1], vt.element)))

        return a(a, k), codegen

    return intrinsic(impl)


vshl = _shift("shl")
vshr = _shift("lshr")  # logical: bytes are treated as unsigned


@intrinsic
def splat8(typingctx, x):
    """Scalar -> I8x32 of that byte."""

    def codegen(context, builder, sig, args):
        return _splat(builder, _vt(I8x32), _int_cast(builder, args[0], ir.IntType(8)))

    return I8x32(x), codegen


@intrinsic
def splat16(typingctx, x):
    """Scalar -> I16x16."""

    def codegen(context, builder, sig, args):
        return _splat(builder, _vt(I16x16), _int_cast(builder, args[0], ir.IntType(16)))

    return I16x16(x), codegen


@intrinsic
def bcast16(typingctx, v, k):
    """I16x16 -> I16x16 with every lane = v[k] (k a constant after unrolling)."""

    def codegen(context, builder, sig, args):
        return _splat(builder, _vt(I16x16), builder.extract_element(args[0], _int_cast(builder, args[1], _i32)))

    return I16x16(v, k), codegen


@intrinsic
def bcast16_pair(typingctx, v, k):
    """I16x16 -> lanes 0..7 = v[k], lanes 8..15 = v[k+1] (scales of two 16-element groups)."""

    def codegen(context, builder, sig, args):
        k0 = _int_cast(builder, args[1], _i32)
        a = _splat(builder, _vt(I16x16), builder.extract_element(args[0], k0))
        b = _splat(builder, _vt(I16x16), builder.extract_element(args[0], builder.add(k0, ir.Constant(_i32, 1))))
        return _shuffle(builder, a, b, [*range(8), *range(24, 32)])

    return I16x16(v, k), codegen


@intrinsic
def dup_high16(typingctx, v):
    """I16x16 -> [v[8], v[8], v[9], v[9], ..., v[15], v[15]] (each min for its two bsums)."""

    def codegen(context, builder, sig, args):
        return _shuffle(builder, args[0], args[0], [8 + i // 2 for i in range(16)])

    return I16x16(v), codegen


@intrinsic
def zero_i32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_vt(I32x8), None)

    return I32x8(), codegen


@intrinsic
def hsum_i32(typingctx, v):
    """Sum of the 8 lanes of an I32x8, as int64."""

    def codegen(context, builder, sig, args):
        s = _call(builder, "llvm.vector.reduce.add.v8i32", _i32, [args[0]])
        return builder.sext(s, ir.IntType(64))

    return types.int64(v), codegen


# --- integer dot-product steps --------------------------------------------------------------


def _maddubs_ir(builder, a, b):
    """Generic pmaddubsw: unsigned a × signed b, adjacent pairs summed, saturated to int16."""
    v32 = ir.VectorType(_i32, 32)
    p = builder.mul(builder.zext(a, v32), builder.sext(b, v32))
    s = builder.add(_shuffle(builder, p, p, range(0, 32, 2)), _shuffle(builder, p, p, range(1, 32, 2)))
    v16 = ir.VectorType(_i32, 16)
    s = _call(builder, "llvm.smax.v16i32", v16, [s, _const(v16, -32768)])
    s = _call(builder, "llvm.smin.v16i32", v16, [s, _const(v16, 32767)])
    return builder.trunc(s, _vt(I16x16))


def _madd_ir(builder, a, b):
    """Generic pmaddwd: int16 × int16, adjacent pairs summed to int32."""
    v16 = ir.VectorType(_i32, 16)
    p = builder.mul(builder.sext(a, v16), builder.sext(b, v16))
    return builder.add(_shuffle(builder, p, p, range(0, 16, 2)), _shuffle(builder, p, p, range(1, 16, 2)))


def _typed2(a, b, t_in, t_out, name):
    if a != t_in or b != t_in:
        raise TypingError(f"{name}: expected two {t_in}, got {a}, {b}")
    return t_out(a, b)


@intrinsic
def maddubs_generic(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return _maddubs_ir(builder, *args)

    return _typed2(a, b, I8x32, I16x16, "maddubs"), codegen


@intrinsic
def madd_generic(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return _madd_ir(builder, *args)

    return _typed2(a, b, I16x16, I32x8, "madd"), codegen


@intrinsic
def maddubs(typingctx, a, b):
    """I8x32 unsigned a, I8x32 signed b -> I16x16: a[2i]·b[2i] + a[2i+1]·b[2i+1] (saturating)."""

    def codegen(context, builder, sig, args):
        if HAS_AVX2:
            return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vt(I16x16), args)
        return _maddubs_ir(builder, *args)

    return _typed2(a, b, I8x32, I16x16, "maddubs"), codegen


@intrinsic
def madd(typingctx, a, b):
    """I16x16 a, b -> I32x8: a[2i]·b[2i] + a[2i+1]·b[2i+1]."""

    def codegen(context, builder, sig, args):
        if HAS_AVX2:
            return _call(builder, "llvm.x86.avx2.pmadd.wd", _vt(I32x8), args)
        return _madd_ir(builder, *args)

    return _typed2(a, b, I16x16, I32x8, "madd"), codegen


def _vnni(builder, name, acc, a, b):
    v8 = _vt(I32x8)
    return _call(builder, f"llvm.x86.avx512.{name}.256", v8, [acc, builder.bitcast(a, v8), builder.bitcast(b, v8)])


@intrinsic
def madd_acc(typingctx, acc, a, b):
    """I32x8 acc + madd(a, b) for I16x16 a, b: one ``vpdpwssd`` where the CPU has VNNI."""
    if acc != I32x8:
        raise TypingError(f"madd_acc: expected an I32x8 accumulator, got {acc}")

    def codegen(context, builder, sig, args):
        acc, a, b = args
        if HAS_VNNI:
            return _vnni(builder, "vpdpwssd", acc, a, b)
        if HAS_AVX2:
            return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _vt(I32x8), [a, b]))
        return builder.add(acc, _madd_ir(builder, a, b))

    return I32x8(acc, *_typed2(a, b, I16x16, I32x8, "madd_acc").args), codegen


def _sum4_ir(builder, a, b):
    """Generic vpdpbusd without the accumulator: unsigned a × signed b, groups of 4 summed to int32."""
    v32 = ir.VectorType(_i32, 32)
    p = builder.mul(builder.zext(a, v32), builder.sext(b, v32))
    s = [_shuffle(builder, p, p, range(i, 32, 4)) for i in range(4)]
    return builder.add(builder.add(s[0], s[1]), builder.add(s[2], s[3]))


@intrinsic
def dot_ub_sb(typingctx, acc, a, b):
    """I32x8 acc + Σ of each 4 products of unsigned bytes a and signed bytes b (I8x32 each).

    Equal to ``acc + madd(maddubs(a, b), 1)`` whenever no pair sum saturates int16, which holds
    for the codes used here (a ≤ 128, |b| ≤ 127: |a·b + a'·b'| ≤ 32512). One ``vpdpbusd`` with VNNI."""
    if acc != I32x8:
        raise TypingError(f"dot_ub_sb: expected an I32x8 accumulator, got {acc}")

    def codegen(context, builder, sig, args):
        acc, a, b = args
        if HAS_VNNI:
            return _vnni(builder, "vpdpbusd", acc, a, b)
        ones = _const(_vt(I16x16), 1)
        if HAS_AVX2:
            p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vt(I16x16), [a, b])
            return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _vt(I32x8), [p, ones]))
        return builder.add(acc, _sum4_ir(builder, a, b))

    return I32x8(acc, *_typed2(a, b, I8x32, I16x16, "dot_ub_sb").args), codegen


@intrinsic
def dot_sb_sb(typingctx, acc, a, b):
    """I32x8 acc + Σ of each 4 products of signed bytes a and b: ``dot_ub_sb(acc, |a|, b·sign(a))``
    (ggml's trick; ``b`` must not hold −128, which q8 activation codes never do)."""
    if acc != I32x8:
        raise TypingError(f"dot_sb_sb: expected an I32x8 accumulator, got {acc}")

    def codegen(context, builder, sig, args):
        acc, a, b = args
        vt = _vt(I8x32)
        absa = _call(builder, "llvm.abs.v32i8", vt, [a, ir.Constant(ir.IntType(1), 0)])
        if HAS_AVX2:
            sb = _call(builder, "llvm.x86.avx2.psign.b", vt, [b, a])
        else:
            zero = ir.Constant(vt, None)
            neg = builder.icmp_signed("<", a, zero)
            isz = builder.icmp_signed("==", a, zero)
            sb = builder.select(isz, zero, builder.select(neg, builder.sub(zero, b), b))
        if HAS_VNNI:
            return _vnni(builder, "vpdpbusd", acc, absa, sb)
        if HAS_AVX2:
            p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vt(I16x16), [absa, sb])
            return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _vt(I32x8), [p, _const(_vt(I16x16), 1)]))
        return builder.add(acc, _sum4_ir(builder, absa, sb))

    return I32x8(acc, *_typed2(a, b, I8x32, I16x16, "dot_sb_sb").args), codegen


@intrinsic
def maddss(typingctx, a, b):
    """Signed × signed bytes, pairs summed to int16: maddubs(|a|, b·sign(a)) (ggml's trick).

    ``b`` must not hold −128 (its negation would wrap); q8 activation codes never do.
    """

    def codegen(context, builder, sig, args):
        a, b = args
        vt = _vt(I8x32)
        absa = _call(builder, "llvm.abs.v32i8", vt, [a, ir.Constant(ir.IntType(1), 0)])
        if HAS_AVX2:
            sb = _call(builder, "llvm.x86.avx2.psign.b", vt, [b, a])
            return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vt(I16x16), [absa, sb])
        zero = ir.Constant(vt, None)
        neg = builder.icmp_signed("<", a, zero)
        isz = builder.icmp_signed("==", a, zero)
        sb = builder.select(isz, zero, builder.select(neg, builder.sub(zero, b), b))
        return _maddubs_ir(builder, absa, sb)

    return _typed2(a, b, I8x32, I16x16, "maddss"), codegen


def _fmadd(builder, a, b, c):
    """a·b + c, allowed to fuse into one FMA (rounded once) where the CPU has it."""
    return builder.fadd(builder.fmul(a, b, flags=("contract",)), c, flags=("contract",))


# --- float ----------------------------------------------------------------------------------


@intrinsic
def zero_f32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_vt(F32x8), None)

    return F32x8(), codegen


@intrinsic
def fma_i32(typingctx, iv, s, acc):
    """acc + float(iv)·s: I32x8, scalar float32, F32x8 -> F32x8."""
    if iv != I32x8 or acc != F32x8:
        raise TypingError(f"fma_i32: expected (I32x8, float, F32x8), got {iv}, {acc}")

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[0], _vt(F32x8))
        s = _splat(builder, _vt(F32x8), context.cast(builder, args[1], sig.args[1], types.float32))
        return _fmadd(builder, f, s, args[2])

    return F32x8(iv, s, acc), codegen


@intrinsic
def vfma(typingctx, a, b, acc):
    """acc + a·b, all F32x8."""

    def codegen(context, builder, sig, args):
        return _fmadd(builder, args[0], args[1], args[2])

    return F32x8(a, b, acc), codegen


@intrinsic
def vfma_s(typingctx, a, s, acc):
    """acc + a·s: F32x8, scalar, F32x8."""

    def codegen(context, builder, sig, args):
        sv = _splat(builder, _vt(F32x8), context.cast(builder, args[1], sig.args[1], types.float32))
        return _fmadd(builder, args[0], sv, args[2])

    return F32x8(a, s, acc), codegen


@intrinsic
def i8_to_f32(typingctx, v, part):
    """Bytes 8·part .. 8·part+7 of an I8x32 (signed) -> F32x8 (``part`` constant after unrolling)."""

    def codegen(context, builder, sig, args):
        p = _int_cast(builder, args[1], _i32)
        idx = [builder.add(builder.mul(p, ir.Constant(_i32, 8)), ir.Constant(_i32, i)) for i in range(8)]
        v8 = ir.Constant(ir.VectorType(ir.IntType(8), 8), ir.Undefined)
        for i, ix in enumerate(idx):
            v8 = builder.insert_element(v8, builder.extract_element(args[0], ix), ir.Constant(_i32, i))
        return builder.sitofp(v8, _vt(F32x8))

    return F32x8(v, part), codegen


@intrinsic
def hsum_f32(typingctx, v):
    """Sum of the 8 lanes of an F32x8 (pairwise tree), as float32."""

    def codegen(context, builder, sig, args):
        x = args[0]
        for width in (4, 2, 1):
            hi = _shuffle(builder, x, x, [width + i for i in range(width)])
            lo = _shuffle(builder, x, x, range(width))
            x = builder.fadd(lo, hi)
        return builder.extract_element(x, ir.Constant(_i32, 0))

    return types.float32(v), codegen


@intrinsic
def load_u32(typingctx, arr, off):
    """Little-endian uint32 from 4 bytes at element ``off`` of a uint8 array, as int64."""
    _check_array(arr, (types.uint8, types.int8), "load_u32")

    def codegen(context, builder, sig, args):
        v = builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], _i32), align=1)
        return builder.zext(v, ir.IntType(64))

    return types.int64(arr, off), codegen


@intrinsic
def lane16(typingctx, v, k):
    """Lane k of an I16x16, as int64."""

    def codegen(context, builder, sig, args):
        e = builder.extract_element(args[0], _int_cast(builder, args[1], _i32))
        return builder.sext(e, ir.IntType(64))

    return types.int64(v, k), codegen


@intrinsic
def i16_to_f32(typingctx, v, half):
    """Lanes 8·half .. 8·half+7 of an I16x16 -> F32x8."""

    def codegen(context, builder, sig, args):
        lo = _shuffle(builder, args[0], args[0], range(8))
        hi = _shuffle(builder, args[0], args[0], range(8, 16))
        h = builder.icmp_signed("!=", _int_cast(builder, args[1], _i32), ir.Constant(_i32, 0))
        return builder.sitofp(builder.select(h, hi, lo), _vt(F32x8))

    return F32x8(v, half), codegen


@intrinsic
def prefetch(typingctx, arr, off):
    """Hint the cache line holding element ``off`` of a 1-D array into the cache level PREFETCH_LOCALITY names
    (2: L2, prefetcht1; never faults)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        raise TypingError(f"prefetch: expected a 1-D array, got {arr}")

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(ir.IntType(8)))
        zero, locality, one = (ir.Constant(_i32, v) for v in (0, PREFETCH_LOCALITY, 1))
        _call(builder, "llvm.prefetch.p0", ir.VoidType(), [ptr, zero, locality, one])
        return context.get_dummy_value()

    return types.none(arr, off), codegen


PREFETCH_AHEAD = 8192  # bytes of weight rows to request before they are needed
PREFETCH_LOCALITY = 2  # LLVM's locality of a prefetch: 3 prefetcht0 (L1), 2 prefetcht1 (L2), 0 prefetchnta


@njit(cache=True, nogil=True, inline="always")
def prefetch_array(a):
    """Prefetch every cache line of a contiguous 1-D array."""
    step = max(1, 64 // a.itemsize)
    for o in range(0, a.shape[0], step):
        prefetch(a, o)


@njit(cache=True, nogil=True, inline="always")
def prefetch_distance(raw):
    """How many rows ahead of the current one to prefetch, for rows of ``raw`` [R, width]."""
    return max(1, min(16, PREFETCH_AHEAD // max(1, raw.shape[1] * raw.itemsize)))
