"""Random weights for kernel tests and benchmarks (not used by the engine itself)."""

from __future__ import annotations

import numpy as np

from engine.quant.formats import QType, block_format

# byte offsets of the fp16 scales inside a block, overwritten with sane values
_FP16_FIELDS = {
    QType.Q8_0: (0,),
    QType.Q4_0: (0,),
    QType.Q5_0: (0,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.Q3_K: (108,),
    QType.Q2_K: (80, 82),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
    QType.IQ2_XXS: (0,),
    QType.IQ2_XS: (0,),
    QType.IQ2_S: (0,),
    QType.IQ3_XXS: (0,),
    QType.IQ3_S: (0,),
    QType.MXFP4: (),  # its scale is the exponent byte: set below
}


def random_weight(qtype: QType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random weights of numpy-order ``shape`` (last axis = elements per row).

    Quantized types: uniformly random block bytes (every code and packed scale pattern occurs)
    with fp16 scales drawn from [1e-3, 2e-2]; returns uint8 [..., row_bytes]. F32/F16: normal
    values as float32/float16 [..., n]; BF16: uint16 bit patterns [..., n].
    """
    qtype = QType(qtype)
    *lead, n = shape
    if qtype == QType.F32:
        return rng.standard_normal(shape, dtype=np.float32)
    if qtype == QType.F16:
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    if qtype == QType.BF16:
        return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    f = block_format(qtype)
    nb = n // f.block_size
    raw = rng.integers(0, 256, (*lead, nb, f.type_size), dtype=np.uint8)
    for o in _FP16_FIELDS[qtype]:
        d = rng.uniform(1e-3, 2e-2, (*lead, nb)).astype(np.float16)
        raw[..., o : o + 2] = d[..., None].view(np.uint8)
    if qtype == QType.MXFP4:  # scales 2^-9 .. 2^-5: elements up to ±0.375, as the fp16 scales above give
        raw[..., 0] = rng.integers(119, 124, (*lead, nb), dtype=np.uint8)
    return raw.reshape(*lead, nb * f.type_size)
