"""Block geometry of every ggml type SharpI reads: quant formats are data.

Each format is a list of named fields; bytes per block is their sum, so the table documents the
layout it sizes. Layouts follow ggml's ``block_*`` structs (ggml-common.h).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

QType = GGMLQuantizationType


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str  # numpy dtype string
    count: int

    @property
    def nbytes(self) -> int:
        import numpy as np

        return np.dtype(self.dtype).itemsize * self.count


@dataclass(frozen=True)
class BlockFormat:
    qtype: QType
    block_size: int  # elements per block
    fields: tuple[Field, ...]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return sum(f.nbytes for f in self.fields)

    @property
    def name(self) -> str:
        return self.qtype.name

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` elements (``n`` must be a multiple of ``block_size``)."""
        return n // self.block_size * self.type_size

    def field_offset(self, name: str) -> int:
        off = 0
        for f in self.fields:
            if f.name == name:
                return off
            off += f.nbytes
        raise KeyError(name)


def _fmt(qtype: QType, block: int, *fields: tuple[str, str, int]) -> BlockFormat:
    return BlockFormat(qtype, block, tuple(Field(*f) for f in fields))


FORMATS: dict[QType, BlockFormat] = {
    f.qtype: f
    for f in (
        _fmt(QType.F32, 1, ("v", "<f4", 1)),
        _fmt(QType.F16, 1, ("v", "<f2", 1)),
        _fmt(QType.BF16, 1, ("v", "<u2", 1)),
        # block_q8_0: fp16 scale, 32 signed bytes
        _fmt(QType.Q8_0, 32, ("d", "<f2", 1), ("qs", "i1", 32)),
        # block_q4_0: fp16 scale, 32 nibbles (low nibbles = elements 0..15, high = 16..31)
        _fmt(QType.Q4_0, 32, ("d", "<f2", 1), ("qs", "u1", 16)),
        # block_q5_0: fp16 scale, 32 high bits, 32 low nibbles
        _fmt(QType.Q5_0, 32, ("d", "<f2", 1), ("qh", "u1", 4), ("qs", "u1", 16)),
        # block_q4_K: super-block scale and min, 8 6-bit (scale, min) pairs packed in 12 bytes
        _fmt(QType.Q4_K, 256, ("d", "<f2", 1), ("dmin", "<f2", 1), ("scales", "u1", 12), ("qs", "u1", 128)),
        # block_q5_K: as Q4_K plus one high bit per element
        _fmt(
            QType.Q5_K,
            256,
            ("d", "<f2", 1),
            ("dmin", "<f2", 1),
            ("scales", "u1", 12),
            ("qh", "u1", 32),
            ("qs", "u1", 128),
        ),
        # block_q2_K: 16 sub-block (scale | min << 4) bytes, 2-bit codes (bits 2j of qs[32h + l] for element
        # 128h + 32j + l), fp16 d and dmin
        _fmt(QType.Q2_K, 256, ("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2", 1), ("dmin", "<f2", 1)),
        # block_q3_K: high bit of every element (bit 4h + j of hmask[l] for element 128h + 32j + l), low
        # 2 bits (bits 2j of qs[32h + l]), 16 six-bit sub-block scales (value − 32) packed in 12 bytes, fp16 d
        _fmt(QType.Q3_K, 256, ("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2", 1)),
        # block_q6_K: low 4 bits, high 2 bits, 16 signed 8-bit sub-block scales, fp16 scale
        _fmt(QType.Q6_K, 256, ("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2", 1)),
        # block_mxfp4: e8m0 shared exponent (scale 2^(e-128) of the doubled e2m1 codes), 32 nibbles
        # (low nibbles = elements 0..15, high = 16..31), each an index into the e2m1 values
        _fmt(QType.MXFP4, 32, ("e", "u1", 1), ("qs", "u1", 16)),
        # block_iq4_nl: fp16 scale, 32 nibbles (low nibbles = elements 0..15, high = 16..31), each an index
        # into the non-linear table kvalues_iq4nl (engine.quant.reference.IQ4NL_VALUES)
        _fmt(QType.IQ4_NL, 32, ("d", "<f2", 1), ("qs", "u1", 16)),
        # block_iq4_xs: fp16 d, 8 six-bit group scales (value − 32; low 4 bits in the nibbles of scales_l,
        # top 2 bits at bits 2j of scales_h), 8 groups of 32 with iq4_nl's nibble order in qs[16j:16j+16]
        _fmt(QType.IQ4_XS, 256, ("d", "<f2", 1), ("scales_h", "<u2", 1), ("scales_l", "u1", 4), ("qs", "u1", 128)),
        # The IQ2/IQ3 grid types (engine.quant.iquants documents the layouts): fp16 d, grid indices, signs,
        # 4-bit scales of groups of 32 (IQ2_XS, IQ2_S: 16)
        _fmt(QType.IQ2_XXS, 256, ("d", "<f2", 1), ("qs", "<u2", 32)),
        _fmt(QType.IQ2_XS, 256, ("d", "<f2", 1), ("qs", "<u2", 32), ("scales", "u1", 8)),
        _fmt(
            QType.IQ2_S,
            256,
            ("d", "<f2", 1),
            ("qs", "u1", 32),
            ("signs", "u1", 32),
            ("qh", "u1", 8),
            ("scales", "u1", 8),
        ),
        _fmt(QType.IQ3_XXS, 256, ("d", "<f2", 1), ("qs", "u1", 64), ("sas", "<u4", 8)),
        _fmt(
            QType.IQ3_S,
            256,
            ("d", "<f2", 1),
            ("qs", "u1", 64),
            ("qh", "u1", 8),
            ("signs", "u1", 32),
            ("scales", "u1", 4),
        ),
        # block_q8_K: activations for K-quant dot products (f32 scale, 16 partial sums)
        _fmt(QType.Q8_K, 256, ("d", "<f4", 1), ("qs", "i1", 256), ("bsums", "<i2", 16)),
    )
}

# Weight types we load and compute on (Q8_K is an activation format only).
WEIGHT_TYPES: tuple[QType, ...] = (
    QType.F32,
    QType.F16,
    QType.BF16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q5_0,
    QType.Q2_K,
    QType.Q3_K,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
    QType.MXFP4,
    QType.IQ4_NL,
    QType.IQ4_XS,
    QType.IQ2_XXS,
    QType.IQ2_XS,
    QType.IQ2_S,
    QType.IQ3_XXS,
    QType.IQ3_S,
)

# The table must agree with the gguf package's sizes: a cheap guard against typos.
for _q, _f in FORMATS.items():
    assert GGML_QUANT_SIZES[_q] == (_f.block_size, _f.type_size), _q


def block_format(qtype: QType | int) -> BlockFormat:
    """The format of ``qtype``; ``KeyError`` for a type we do not support."""
    return FORMATS[QType(qtype)]


def is_supported_weight_type(qtype: QType | int) -> bool:
    try:
        return QType(qtype) in WEIGHT_TYPES
    except ValueError:
        return False


def tensor_bytes(qtype: QType | int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy-order ``shape`` (innermost dimension last)."""
    f = block_format(qtype)
    n = 1
    for s in shape:
        n *= int(s)
    return n // f.block_size * f.type_size


def pack_blocks(qtype: QType | int, nb: int, **fields: np.ndarray) -> np.ndarray:
    """uint8 [nb, type_size] blocks of ``qtype`` from its named fields, laid out as in its format."""
    fmt = block_format(qtype)
    out = np.empty((nb, fmt.type_size), dtype=np.uint8)
    for f in fmt.fields:
        off = fmt.field_offset(f.name)
        v = np.ascontiguousarray(np.asarray(fields[f.name]).astype(f.dtype, copy=False).reshape(nb, f.count))
        out[:, off : off + f.nbytes] = v.view(np.uint8)
    return out


def to_f16(v: np.ndarray) -> np.ndarray:
    """float32 -> float16, round to nearest even (ggml ``GGML_FP32_TO_FP16``); inf on overflow."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16)
