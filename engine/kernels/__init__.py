"""numba CPU kernels computing directly on quantized GGUF blocks.

Public API::

    prepare_weight(qtype, raw [..., row_bytes]) -> PreparedWeight      (once per tensor, at load)
    matvec(w, x float32 [n], *, q8_act) -> float32 [R]                  (decode)
    matmul(w, X float32 [T, n], *, q8_act) -> float32 [T, R]            (prefill)
    gemv_rows(w, X, rows, xi, T, *, q8_act) -> float32 [M, T]           (gather form)
    moe_ffn(gate, up, down, x, ids, weights, *, q8_act) -> float32 [D]  (routed experts, one token)

``q8_act=True`` rounds activations as llama.cpp's CPU backend does (Q8_0 / Q8_K blocks, F16 /
BF16) and takes integer block dot products; ``q8_act=False`` multiplies by the exactly
dequantized weights. The numpy reference with the same semantics is ``engine.kernels.reference``
(``matvec_numpy``, ``matmul_numpy``, ``moe_ffn_numpy`` take the same arguments; ``*_ref`` take
qtype + raw bytes); the kernel for each type is chosen in one place,
``engine.kernels.dispatch.KERNELS``.
"""

from engine.kernels.dispatch import gemv_rows, matmul, matvec
from engine.kernels.moe import moe_ffn
from engine.kernels.prepare import PreparedWeight, prepare_weight

__all__ = ["PreparedWeight", "gemv_rows", "matmul", "matvec", "moe_ffn", "prepare_weight"]
