"""Prepared weights: the mapped bytes plus a small side array of decoded scales.

``prepare_weight`` runs once per tensor at load. It keeps the raw block bytes as a zero-copy
2-D view ``[R, row_bytes]`` (R = all rows, experts stacked) and decodes every fp16 block scale
to float32 once, so kernels never convert fp16 in their inner loops (numba has no float16):

==============  ======================================  ===========================
qtype           ``scales`` float32 [R, S]               side array / weight bytes
==============  ======================================  ===========================
Q8_0            d per 32-block (S = n/32)               4/34 = 11.8 %
Q4_0, Q5_0      d per 32-block                          4/18 = 22 %, 4/22 = 18 %
Q4_K, Q5_K      (d, dmin) per 256-block (S = 2·n/256)   8/144 = 5.6 %, 8/176 = 4.5 %
Q6_K            d per 256-block (S = n/256)             4/210 = 1.9 %
Q3_K            d per 256-block (S = n/256)             4/110 = 3.6 %
Q2_K            (d, dmin) per 256-block (S = 2·n/256)   8/84 = 9.5 %
MXFP4           2^(e-128) per 32-block (S = n/32)       4/17 = 24 %
IQ4_NL          d per 32-block (S = n/32)               4/18 = 22 %
IQ4_XS          d per 256-block (S = n/256)             4/136 = 2.9 %
IQ2_XXS, IQ2_XS d·mult per 256-block (S = n/256; mult     4/66 = 6.1 %, 4/74 = 5.4 %,
IQ2_S, IQ3_XXS  engine.quant.iquants.SCALE_MULT, a      4/82 = 4.9 %, 4/98 = 4.1 %,
IQ3_S           power of two: exact)                    4/110 = 3.6 %
F32, F16, BF16  none (S = 0)                            0
==============  ======================================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import SharpIError
from engine.quant.formats import QType, block_format, is_supported_weight_type
from engine.quant.iquants import IQ_TYPES, SCALE_MULT

# byte offset of the fp16 super-block scale(s) inside a block
_SCALE_OFFSETS: dict[QType, tuple[int, ...]] = {
    QType.Q8_0: (0,),
    QType.Q4_0: (0,),
    QType.Q5_0: (0,),
    QType.Q4_K: (0, 2),  # d, dmin
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.Q3_K: (108,),
    QType.Q2_K: (80, 82),  # d, dmin
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),  # the 6-bit group scales stay packed: the kernels decode them
    **{t: (0,) for t in IQ_TYPES},  # likewise their 4-bit group scales
}
_FLOAT_DTYPES = {QType.F32: np.float32, QType.F16: np.uint16, QType.BF16: np.uint16}


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """A weight matrix (or a stack of expert matrices) ready for the kernels.

    raw: uint8 [R, row_bytes] for quantized types; float32 [R, n] for F32; uint16 [R, n] (the
    bit patterns) for F16/BF16. A view of the caller's (memory-mapped) array where possible.
    scales: float32 [R, S], see the module table. ``shape`` is the logical numpy-order shape,
    ``(out, in)`` or ``(E, out, in)``; R = prod(shape[:-1]).
    """

    qtype: QType
    shape: tuple[int, ...]
    raw: np.ndarray
    scales: np.ndarray

    @property
    def n(self) -> int:
        """Input features (elements per row)."""
        return self.shape[-1]

    @property
    def rows(self) -> int:
        """Output rows of one matrix (``out``)."""
        return self.shape[-2]

    @property
    def n_experts(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def nbytes(self) -> int:
        """Bytes of the weight data (not counting the scale side array)."""
        return int(self.raw.nbytes)


def _as_rows(raw: np.ndarray, width: int, dtype) -> np.ndarray:
    """Reshape [..., width] to a 2-D [R, width] view of ``dtype``, copying only if needed."""
    a = np.asarray(raw)
    if a.dtype != dtype:
        a = np.ascontiguousarray(a).view(np.uint8).view(dtype)
    a = np.ascontiguousarray(a.reshape(-1, width)).view()  # no copy for a mapped tensor
    a.setflags(write=False)  # kernels only read; one numba signature for mmaps and arrays
    return a


def prepare_weight(qtype: QType | int, raw: np.ndarray, n: int | None = None) -> PreparedWeight:
    """Wrap a weight tensor for the kernels.

    qtype: ggml type. raw: uint8 [..., row_bytes] block bytes (any quantized or float type), or
    for float types an array of their own dtype [..., n] (float32, float16, or uint16 for BF16).
    n: elements per row, checked against the row width when given.
    """
    if not is_supported_weight_type(qtype):
        raise SharpIError(f"weight type {qtype} is not supported by the CPU kernels")
    qtype = QType(qtype)
    fmt = block_format(qtype)
    a = np.asarray(raw)
    if a.ndim < 2:
        raise SharpIError(f"weight must be at least 2-D, got shape {a.shape}")
    if a.dtype == np.uint8:
        row_bytes = a.shape[-1]
        if row_bytes % fmt.type_size:
            raise SharpIError(f"{qtype.name} row of {row_bytes} bytes is not a whole number of blocks")
        width = row_bytes // fmt.type_size * fmt.block_size
    else:
        if qtype not in _FLOAT_DTYPES or a.dtype.itemsize != fmt.type_size:
            raise SharpIError(f"{qtype.name} weight cannot arrive as dtype {a.dtype}")
        width = a.shape[-1]
    if n is not None and n != width:
        raise SharpIError(f"{qtype.name} rows hold {width} elements, expected {n}")
    shape = (*a.shape[:-1], width)
    if qtype in _FLOAT_DTYPES:
        rows = _as_rows(a, width, _FLOAT_DTYPES[qtype])
        return PreparedWeight(qtype, shape, rows, np.zeros((rows.shape[0], 0), np.float32))
    rows = _as_rows(a, a.shape[-1], np.uint8)
    R = rows.shape[0]
    blocks = rows.reshape(R, -1, fmt.type_size)
    if qtype == QType.MXFP4:  # the e8m0 exponent byte, as the float its codes are multiplied by
        from engine.quant.reference import e8m0_half

        return PreparedWeight(qtype, shape, rows, np.ascontiguousarray(e8m0_half(blocks[:, :, 0])))
    parts = [blocks[:, :, o : o + 2].copy().view("<f2")[..., 0] for o in _SCALE_OFFSETS[qtype]]
    scales = np.stack(parts, axis=-1).astype(np.float32).reshape(R, -1)  # [R, nb·k] interleaved
    if qtype in SCALE_MULT:  # the IQ grid types: d·mult (exact), so every block scale is one float
        scales *= np.float32(SCALE_MULT[qtype])
    return PreparedWeight(qtype, shape, rows, np.ascontiguousarray(scales))
