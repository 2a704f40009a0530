"""numba CPU kernels computing directly on quantized GGUF blocks.

Public API (``engine.kernels.dispatch``)::

    prepare_weight(qtype, raw [..., row_bytes]) -> PreparedWeight
    matvec(w, x float32 [n], *, q8_act) -> float32 [R]
    matmul(w, X float32 [T, n], *, q8_act) -> float32 [T, R]
    gemv_rows(w, X, rows, xi, T, *, q8_act) -> float32 [M, T]    (gather form)

The numpy reference with the same semantics is ``engine.kernels.reference``.
"""

from engine.kernels.dispatch import gemv_rows, matmul, matvec
from engine.kernels.prepare import PreparedWeight, prepare_weight

__all__ = ["PreparedWeight", "gemv_rows", "matmul", "matvec", "prepare_weight"]
