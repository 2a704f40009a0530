"""Quantization formats: the block table, numpy reference (de)quantizers.

Public API::

    dequantize(raw: uint8 [..., row_bytes] | float array, qtype) -> float32 [..., n]
    quantize(x: float32 [..., n], qtype) -> uint8 [..., row_bytes]
        (F32 -> float32, F16 -> float16, BF16 -> uint16 bit patterns, all [..., n])
"""

from engine.quant.formats import FORMATS, WEIGHT_TYPES, BlockFormat, QType, block_format, tensor_bytes
from engine.quant.quantize import quantize
from engine.quant.reference import dequantize

__all__ = [
    "FORMATS",
    "WEIGHT_TYPES",
    "BlockFormat",
    "QType",
    "block_format",
    "dequantize",
    "quantize",
    "tensor_bytes",
]
