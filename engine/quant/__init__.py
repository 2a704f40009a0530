"""Quantization formats: the block table, numpy reference (de)quantizers.

Public API::

    dequantize(raw: uint8 [..., row_bytes] | float array, qtype) -> float32 [..., n]
    quantize(x: float32 [..., n], qtype) -> uint8 [..., row_bytes]   (float types return their dtype)
"""

from engine.quant.formats import FORMATS, WEIGHT_TYPES, BlockFormat, QType, block_format, tensor_bytes

__all__ = ["FORMATS", "WEIGHT_TYPES", "BlockFormat", "QType", "block_format", "tensor_bytes"]
