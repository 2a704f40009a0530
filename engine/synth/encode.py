"""Which ggml type each tensor gets, and turning float32 values into that type's bytes.

Type rules, as llama.cpp's quantizer applies them (``llama_tensor_get_type`` in
``src/llama-quant.cpp``): norms, biases, the router and other 1-D tensors stay F32; K-quants need
rows that are a multiple of 256, so a tensor with shorter rows falls back to a 32-block type
(Q4_K -> Q5_0, Q5_K -> Q5_0 *where llama.cpp uses Q5_1, which SharpI does not support*,
Q6_K -> Q8_0, Q2_K and Q3_K -> Q4_0 *where llama.cpp uses IQ4_NL: the same 4.5 bits, kept from before
SharpI read IQ4_NL*, IQ4_XS and the IQ2/IQ3 grid types -> IQ4_NL); a 32-block type on rows not a multiple of 32 falls back to F16.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engine.errors import UsageError
from engine.quant.formats import WEIGHT_TYPES, QType, block_format, tensor_bytes
from engine.synth.specs import QUANTIZABLE_KINDS, TensorDecl

K_FALLBACK: dict[QType, QType] = {
    QType.Q2_K: QType.Q4_0,
    QType.Q3_K: QType.Q4_0,
    QType.Q4_K: QType.Q5_0,
    QType.Q5_K: QType.Q5_0,
    QType.Q6_K: QType.Q8_0,
    QType.IQ4_XS: QType.IQ4_NL,
    QType.IQ2_XXS: QType.IQ4_NL,
    QType.IQ2_XS: QType.IQ4_NL,
    QType.IQ2_S: QType.IQ4_NL,
    QType.IQ3_XXS: QType.IQ4_NL,
    QType.IQ3_S: QType.IQ4_NL,
}


def parse_qtype(t: QType | int | str) -> QType:
    """``"q4_k"``, ``"Q4_K"``, ``12`` or ``QType.Q4_K`` -> ``QType.Q4_K`` (weight types only)."""
    try:
        q = QType[t.upper()] if isinstance(t, str) else QType(t)
    except (KeyError, ValueError):
        q = None
    if q not in WEIGHT_TYPES:
        names = ", ".join(x.name for x in WEIGHT_TYPES)
        raise UsageError(f"unsupported weight type {t!r} (supported: {names})")
    return q


@dataclass(frozen=True)
class TensorPlan:
    """A declared tensor with the type it is written in.

    ``requested`` is the type asked for (weight type or override); ``qtype`` differs from it when
    the row length forced a fallback.
    """

    decl: TensorDecl
    qtype: QType
    requested: QType

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.decl.shape

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.qtype, self.shape)

    @property
    def fell_back(self) -> bool:
        return self.qtype != self.requested


def _matches(name: str, pattern: str) -> bool:
    """Glob ``pattern`` against the full name or the name without ``blk.N.`` and ``.weight``."""
    short = name.removesuffix(".weight")
    if short.startswith("blk."):
        short = short.split(".", 2)[2]
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(short, pattern)


def fit_row(qtype: QType, row: int) -> QType:
    """``qtype``, or the type llama.cpp falls back to when rows of length ``row`` don't fit it."""
    if row % block_format(qtype).block_size == 0:
        return qtype
    fallback = K_FALLBACK.get(qtype, QType.F16)
    return fit_row(fallback, row)


def plan_types(
    decls: list[TensorDecl],
    weight_type: QType | str,
    overrides: Mapping[str, QType | str] | None = None,
) -> list[TensorPlan]:
    """Types for every tensor: ``weight_type`` for matrices (embeddings, output, projections,
    experts), then ``overrides`` (glob pattern -> type, later patterns win, e.g.
    ``{"ffn_down*": "Q6_K", "output": "Q6_K"}``); F32 for everything else."""
    base = parse_qtype(weight_type)
    rules = [(p, parse_qtype(t)) for p, t in (overrides or {}).items()]
    plans = []
    for d in decls:
        want = QType.F32
        if d.kind in QUANTIZABLE_KINDS:
            want = base
            for pattern, t in rules:
                if _matches(d.name, pattern):
                    want = t
        plans.append(TensorPlan(d, fit_row(want, d.row), want))
    return plans


def encode(x: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 [..., n] -> an array whose raw bytes are the GGUF data of ``qtype``.

    F32 -> float32, F16 -> float16, BF16 -> uint16 bits, block types -> uint8 [..., row_bytes],
    all through ``engine.quant.quantize`` (which agrees with ggml's ``quantize_row_*_ref``).
    """
    from engine.quant import quantize

    out = quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)
    return np.ascontiguousarray(out)
