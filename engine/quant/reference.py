"""Numpy reference dequantizers: the readable specification of every weight format.

Each ``_dequant_*`` function takes the named fields of ``[nb]`` blocks (sliced out of the raw
bytes with the offsets of :mod:`engine.quant.formats`) and returns the ``[nb, block_size]``
float32 values. The arithmetic is done in float32 in the same order as ggml's
``dequantize_row_*`` (and ``gguf.quants``), so results agree bit for bit; the numba kernels in
``engine/kernels/`` are tested against these functions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.quant import iquants
from engine.quant.formats import QType, block_format

_F32 = np.float32


def block_fields(blocks: np.ndarray, qtype: QType | int) -> dict[str, np.ndarray]:
    """Split raw blocks into their named fields (views, no copy).

    blocks: uint8 [nb, type_size]. Returns {field name: array [nb, count]} with the field's dtype
    from the format table (e.g. Q4_K: d f16 [nb,1], dmin f16 [nb,1], scales u8 [nb,12], qs u8 [nb,128]).
    """
    fmt = block_format(qtype)
    if blocks.ndim != 2 or blocks.shape[1] != fmt.type_size or blocks.dtype != np.uint8:
        raise ValueError(f"{fmt.name} blocks must be uint8 [nb, {fmt.type_size}], got {blocks.dtype} {blocks.shape}")
    out = {}
    for f in fmt.fields:
        off = fmt.field_offset(f.name)
        # A column slice keeps a unit stride on the last axis, which is all .view() needs.
        out[f.name] = blocks[:, off : off + f.nbytes].view(f.dtype)
    return out


def unpack_scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of a Q4_K/Q5_K block; agrees with ggml ``get_scale_min_k4``.

    scales: uint8 [..., 12] -> (sc uint8 [..., 8], m uint8 [..., 8]).
    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales/mins 4-7 keep their low
    nibbles in bytes 8-11 (scale low, min high) and their top 2 bits in the top bits of bytes 0-7.
    """
    s = scales.astype(np.uint8, copy=False)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def fp16_to_f32(v: np.ndarray) -> np.ndarray:
    """float16 (any shape) -> float32, exact."""
    return v.astype(np.float32)


# ---------------------------------------------------------------- 32-element block types


def _dequant_q8_0(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q8_0: y = qs * d
    d = fp16_to_f32(f["d"])  # [nb, 1]
    return f["qs"].astype(_F32) * d  # [nb, 32]


def _dequant_q4_0(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q4_0: element j < 16 is the low nibble of qs[j], element 16 + j the high one;
    # y = (q - 8) * d
    d = fp16_to_f32(f["d"])
    qs = f["qs"]  # [nb, 16]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int8) - np.int8(8)  # [nb, 32]
    return q.astype(_F32) * d


def _dequant_q5_0(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q5_0: as Q4_0 for the low 4 bits; bit j of the little-endian uint32 qh is
    # the 5th bit of element j; y = (q - 16) * d
    d = fp16_to_f32(f["d"])
    qs = f["qs"]
    qh = f["qh"].view("<u4")  # [nb, 1]
    low = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # [nb, 32]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [nb, 32]
    q = (low | (high << 4)).astype(np.int8) - np.int8(16)
    return q.astype(_F32) * d


# ---------------------------------------------------------------- 256-element K-quants


def _dequant_q2_k(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q2_K: 2 halves of 128; in half h, element 32j + l (j = 0..3) is bits 2j..2j+1 of
    # qs[32h + l]. 16 sub-blocks of 16, byte s of scales = sc | m << 4 (4 bits each);
    # y = (d*sc) * q - (dmin*m) (the products exact in float32, one rounding in the difference)
    nb = f["qs"].shape[0]
    d, dmin = fp16_to_f32(f["d"]), fp16_to_f32(f["dmin"])  # [nb, 1]
    sc = f["scales"]  # [nb, 16]
    d_sub = (d * (sc & 0xF).astype(_F32))[:, :, None]  # [nb, 16, 1]
    m_sub = (dmin * (sc >> 4).astype(_F32))[:, :, None]
    q = (f["qs"].reshape(nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    return (d_sub * q.reshape(nb, 16, 16).astype(_F32) - m_sub).reshape(nb, 256)


def unpack_scales_k3(scales: np.ndarray) -> np.ndarray:
    """The 16 six-bit sub-block scales of a Q3_K block, as stored (0..63; the value is this − 32).

    scales: uint8 [..., 12] -> uint8 [..., 16]. Scale i keeps its low 4 bits in byte i (i < 8, low
    nibble) or byte i − 8 (i ≥ 8, high nibble), its top 2 bits in bits 2(i // 4) of byte 8 + i % 4
    (ggml ``dequantize_row_q3_K``'s kmask1/kmask2 shuffle).
    """
    s = scales.astype(np.uint8, copy=False)
    low = np.concatenate([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], axis=-1)  # [..., 16]
    top = (s[..., None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [..., 4 (i // 4), 4 (i % 4)]
    return low | (top.reshape(*s.shape[:-1], 16) << 4)


def _dequant_q3_k(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q3_K: 2 halves of 128. In half h, element 32j + l (j = 0..3) has its low 2 bits
    # in bits 2j..2j+1 of qs[32h + l] and its high bit in bit 4h + j of hmask[l]; the value is
    # low − 4 where the high bit is clear, low where it is set. 16 sub-blocks of 16, scale (sc − 32):
    # y = (d*(sc − 32)) * q (both products exact in float32)
    nb = f["qs"].shape[0]
    d = fp16_to_f32(f["d"])  # [nb, 1]
    sc = unpack_scales_k3(f["scales"]).astype(np.int8) - np.int8(32)  # [nb, 16]
    low = (f["qs"].reshape(nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    high = (f["hmask"].reshape(nb, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)) & 1
    q = (low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)).reshape(nb, 16, 16).astype(_F32)
    d_sub = (d * sc.astype(_F32))[:, :, None]  # [nb, 16, 1]
    return (d_sub * q).reshape(nb, 256)


def _dequant_q4_k(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q4_K: 8 sub-blocks of 32. Chunk c (64 elements) reads qs[32c:32c+32]:
    # sub-block 2c from the low nibbles, 2c+1 from the high ones; y = (d*sc) * q - (dmin*m)
    nb = f["qs"].shape[0]
    d, dmin = fp16_to_f32(f["d"]), fp16_to_f32(f["dmin"])  # [nb, 1]
    sc, m = unpack_scale_min_k4(f["scales"])  # [nb, 8]
    d_sub = (d * sc.astype(_F32))[:, :, None]  # [nb, 8, 1]
    m_sub = (dmin * m.astype(_F32))[:, :, None]
    qs = f["qs"].reshape(nb, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(nb, 8, 32).astype(_F32)
    return (d_sub * q - m_sub).reshape(nb, 256)


def _dequant_q5_k(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q5_K: Q4_K plus a 5th bit: element l of sub-block s has it in bit s of qh[l]
    nb = f["qs"].shape[0]
    d, dmin = fp16_to_f32(f["d"]), fp16_to_f32(f["dmin"])
    sc, m = unpack_scale_min_k4(f["scales"])
    d_sub = (d * sc.astype(_F32))[:, :, None]
    m_sub = (dmin * m.astype(_F32))[:, :, None]
    qs = f["qs"].reshape(nb, 4, 1, 32)
    low = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(nb, 8, 32)
    high = (f["qh"][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [nb, 8, 32]
    q = (low | (high << 4)).astype(_F32)
    return (d_sub * q - m_sub).reshape(nb, 256)


def _dequant_q6_k(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_q6_K: 2 halves of 128, each with ql[64] and qh[32]. In half h, element
    # 32k + l (k = 0..3) takes its low 4 bits from ql[l] (k=0), ql[32+l] (k=1), ql[l]>>4 (k=2),
    # ql[32+l]>>4 (k=3), and its top 2 bits from bits 2k..2k+1 of qh[l].
    # 16 signed scales, one per 16 elements; y = (d*sc) * (q - 32)
    nb = f["ql"].shape[0]
    d = fp16_to_f32(f["d"])  # [nb, 1]
    ql = f["ql"].reshape(nb, 2, 2, 32)  # [nb, half, ql[0:32] / ql[32:64], l]
    qh = f["qh"].reshape(nb, 2, 1, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # [nb, 2, 4, 32]; k = 0, 1, 2, 3
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(nb, 16, 16).astype(_F32)
    d_sub = (d * f["scales"].astype(_F32))[:, :, None]  # [nb, 16, 1]
    return (d_sub * q).reshape(nb, 256)


# e2m1 values doubled (ggml kvalues_mxfp4); the block scale 2^(e-128) is half of e8m0's 2^(e-127)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """uint8 e8m0 exponents -> float32 2^(e-128) (ggml ``GGML_E8M0_TO_FP32_HALF``; e < 2: subnormal)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def _dequant_mxfp4(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_mxfp4: y[j] = kvalues[q & 15] * d, low nibbles first
    d = e8m0_half(f["e"])  # [nb, 1]
    qs = f["qs"]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [nb, 32]
    with np.errstate(over="ignore"):  # e near 255: infinities, as ggml gives
        return d * MXFP4_VALUES[q].astype(_F32)


# ggml kvalues_iq4nl: the 16 non-linear levels of IQ4_NL and IQ4_XS
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _dequant_iq4_nl(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_iq4_nl: y[j] = d * kvalues[q & 15], low nibbles are elements 0..15
    d = fp16_to_f32(f["d"])  # [nb, 1]
    qs = f["qs"]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [nb, 32]
    return d * IQ4NL_VALUES[q].astype(_F32)


def unpack_scales_iq4_xs(scales_h: np.ndarray, scales_l: np.ndarray) -> np.ndarray:
    """The 8 six-bit group scales of an IQ4_XS block, as stored (0..63; the value is this − 32).

    scales_h uint16 [..., 1], scales_l uint8 [..., 4] -> uint8 [..., 8]: group j keeps its low 4 bits
    in nibble j % 2 of scales_l[j // 2] and its top 2 bits in bits 2j, 2j + 1 of scales_h.
    """
    lo = np.stack([scales_l & 0xF, scales_l >> 4], axis=-1).reshape(*scales_l.shape[:-1], 8)
    hi = (scales_h.astype(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [..., 8]
    return lo | (hi.astype(np.uint8) << 4)


def _dequant_iq4_xs(f: dict[str, np.ndarray]) -> np.ndarray:
    # dequantize_row_iq4_xs: group j (32 elements) reads qs[16j:16j+16] as iq4_nl does;
    # dl = d * (ls − 32) in float32, y = dl * kvalues[q]
    nb = f["qs"].shape[0]
    d = fp16_to_f32(f["d"])  # [nb, 1]
    ls = unpack_scales_iq4_xs(f["scales_h"], f["scales_l"]).astype(np.int8) - np.int8(32)  # [nb, 8]
    dl = (d * ls.astype(_F32))[:, :, None]  # [nb, 8, 1]
    qs = f["qs"].reshape(nb, 8, 16)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [nb, 8, 32]
    return (dl * IQ4NL_VALUES[q].astype(_F32)).reshape(nb, 256)


DEQUANTIZE_BLOCKS: dict[QType, Callable[[dict[str, np.ndarray]], np.ndarray]] = {
    QType.Q8_0: _dequant_q8_0,
    QType.Q4_0: _dequant_q4_0,
    QType.Q5_0: _dequant_q5_0,
    QType.Q2_K: _dequant_q2_k,
    QType.Q3_K: _dequant_q3_k,
    QType.Q4_K: _dequant_q4_k,
    QType.Q5_K: _dequant_q5_k,
    QType.Q6_K: _dequant_q6_k,
    QType.MXFP4: _dequant_mxfp4,
    QType.IQ4_NL: _dequant_iq4_nl,
    QType.IQ4_XS: _dequant_iq4_xs,
}


def dequantize_blocks(blocks: np.ndarray, qtype: QType | int) -> np.ndarray:
    """uint8 [nb, type_size] -> float32 [nb, block_size] for a block-quantized type."""
    qtype = QType(qtype)
    fields = block_fields(blocks, qtype)  # checks the shape
    if qtype in iquants.IQ_TYPES:  # the grid types decode from the bytes (engine.quant.iquants)
        return iquants.dequantize_blocks(qtype, blocks)
    return DEQUANTIZE_BLOCKS[qtype](fields)


# ---------------------------------------------------------------- float types


def _as_bytes_rows(raw: np.ndarray) -> np.ndarray:
    """Any array -> uint8 [..., bytes of the last axis] (a view when the last axis is contiguous)."""
    a = np.asarray(raw)
    if a.ndim == 0:
        raise ValueError("expected an array with at least one dimension")
    if a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16 [...]) -> float32 [...]: the bits are the top half of an f32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _dequant_float(raw: np.ndarray, qtype: QType) -> np.ndarray:
    a = np.asarray(raw)
    if qtype == QType.F32 and a.dtype == np.float32:
        return a
    if qtype == QType.F16 and a.dtype == np.float16:
        return a.astype(np.float32)
    if qtype == QType.BF16 and a.dtype in (np.uint16, np.int16):
        return bf16_to_f32(a.view(np.uint16))
    if a.dtype != np.uint8:
        raise ValueError(f"{qtype.name} data must be its own dtype or raw uint8 bytes, got {a.dtype}")
    item = {QType.F32: "<f4", QType.F16: "<f2", QType.BF16: "<u2"}[qtype]
    if a.shape[-1] % np.dtype(item).itemsize:
        raise ValueError(f"{qtype.name} rows of {a.shape[-1]} bytes are not whole elements")
    v = _as_bytes_rows(a).view(item)
    if qtype == QType.BF16:
        return bf16_to_f32(v)
    return v.astype(np.float32)


# ---------------------------------------------------------------- public entry point


def dequantize(raw: np.ndarray, qtype: QType | int) -> np.ndarray:
    """Decode a tensor of any weight type to float32.

    raw: for block types uint8 [..., row_bytes] (as ``GGUFReader`` ``tensor.data`` or
    :func:`engine.quant.quantize` give it); for F32/F16 the float32/float16 array [..., n] or its
    bytes uint8 [..., n*itemsize]; for BF16 uint16 [..., n] bit patterns or uint8 [..., 2n].
    Returns float32 [..., n] (for F32 input that is already float32, the input itself).
    """
    qtype = QType(qtype)
    if qtype in (QType.F32, QType.F16, QType.BF16):
        return _dequant_float(raw, qtype)
    if qtype not in DEQUANTIZE_BLOCKS and qtype not in iquants.IQ_TYPES:
        raise ValueError(f"dequantize: unsupported type {qtype.name}")
    fmt = block_format(qtype)
    a = np.asarray(raw)
    if a.dtype != np.uint8:
        raise ValueError(f"{qtype.name} data must be uint8 bytes, got {a.dtype}")
    if a.ndim == 0 or a.shape[-1] % fmt.type_size:
        raise ValueError(f"{qtype.name} rows must be a multiple of {fmt.type_size} bytes, got shape {a.shape}")
    lead = a.shape[:-1]
    n = a.shape[-1] // fmt.type_size * fmt.block_size
    blocks = np.ascontiguousarray(a).reshape(-1, fmt.type_size)
    return dequantize_blocks(blocks, qtype).reshape(*lead, n)
