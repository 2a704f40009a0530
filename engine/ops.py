"""The kernel entry points the model math calls, in one visible place.

``matmul``, ``matmuls`` and ``moe_ffn`` route to the numba kernels; ``SHARPI_KERNELS=reference``
(``EngineOptions.host_kernels``, read at import from ``engine.config.current()``; or
``use_reference(True)``) selects the numpy reference models with the same signatures.
"""

from __future__ import annotations

import functools

import numpy as np

from engine import config
from engine.kernels import reference as ref
from engine.kernels.prepare import PreparedWeight
from engine.quant.formats import QType

_use_reference = config.current().host_kernels == "reference"


def use_reference(flag: bool) -> None:
    global _use_reference
    _use_reference = flag


def matmul(w: PreparedWeight, X: np.ndarray, *, q8_act: bool) -> np.ndarray:
    """Y = X·Wᵀ: X float32 [T, n] -> float32 [T, rows]."""
    if _use_reference:
        return ref.matmul_ref(w.qtype, w.raw, X, q8_act=q8_act)
    from engine.kernels import dispatch

    return dispatch.matmul(w, X, q8_act=q8_act)


@functools.lru_cache(maxsize=256)
def _gather_all(R: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows arange(R), xi zeros(R)) int64, read-only, built once per R: every row, token 0."""
    rows, xi = np.arange(R, dtype=np.int64), np.zeros(R, np.int64)
    rows.setflags(write=False)
    xi.setflags(write=False)
    return rows, xi


_K_QUANTS = (  # Q8_K activations
    QType.Q2_K,
    QType.Q3_K,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
    QType.IQ4_XS,
    QType.IQ2_XXS,
    QType.IQ2_XS,
    QType.IQ2_S,
    QType.IQ3_XXS,
    QType.IQ3_S,
)
_LEGACY = (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.MXFP4, QType.IQ4_NL)  # Q8_0 activations


def _activations(qtype: QType, X: np.ndarray, q8_act: bool, prepare) -> tuple[np.ndarray, ...]:
    """``prepare_activations``; a prefill batch of quantized activations is rounded with its rows
    in parallel (``grouped.quantize_rows``, the same values) instead of on one thread."""
    if q8_act and X.shape[0] >= 32 and (qtype in _K_QUANTS or qtype in _LEGACY):
        from engine.kernels.grouped import quantize_rows

        qa, da, asum, bsums = quantize_rows(int(qtype), np.ascontiguousarray(X, dtype=np.float32))
        return (qa, da, bsums) if qtype in _K_QUANTS else (qa, da, asum)
    return prepare(qtype, X, q8_act=q8_act)


def matmuls(ws: tuple[PreparedWeight, ...], X: np.ndarray, *, q8_act: bool) -> list[np.ndarray]:
    """[X·Wᵀ for W in ws]: X float32 [T, n] -> float32 [T, R_i] each. The activations are rounded
    once per weight type and shared, so q, k and v cost one quantization."""
    if _use_reference:
        return [ref.matmul_ref(w.qtype, w.raw, X, q8_act=q8_act) for w in ws]
    from engine.kernels import bf16
    from engine.kernels.dispatch import KERNELS, gemv_acts, prepare_activations

    T = X.shape[0]
    acts: dict = {}
    out = []
    for w in ws:
        if bf16.applies(w.qtype, T, q8_act):  # a prompt: dequantize and use the bf16 matrix units
            out.append(bf16.matmul(w, X))
            continue
        a = acts.get(w.qtype)
        if a is None:
            a = acts[w.qtype] = _activations(w.qtype, X, q8_act, prepare_activations)
        rows, xi = _gather_all(w.raw.shape[0])
        if T == 1:
            out.append(gemv_acts(w, a, rows, xi, 1, q8_act=q8_act).reshape(1, -1))
            continue
        # The kernels write out[i, t] (gather form); handing them the transposed view of a
        # [T, R] array saves the copy a transpose would cost (prefill: 8 MB per projection).
        y = np.empty((T, w.raw.shape[0]), np.float32)
        kernel = KERNELS[w.qtype][1 if q8_act else 0]
        if w.qtype in (QType.F32, QType.F16, QType.BF16):
            kernel(w.raw, rows, xi, *a, y.T)
        else:
            kernel(w.raw, w.scales, rows, xi, *a, y.T)
        out.append(y)
    return out


def moe_ffn(
    gate: PreparedWeight,
    up: PreparedWeight,
    down: PreparedWeight,
    X: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    q8_act: bool,
    skip: np.ndarray | None = None,
    glu=None,
) -> np.ndarray:
    """Routed experts for T tokens: X float32 [T, D], ids int64 [T, K], weights float32 [T, K] -> [T, D];
    skip bool [T, K] or None: pairs left out (computed elsewhere: the expert cache's hits); glu: the experts'
    biases and activation where not plain SwiGLU (``engine.kernels.moe.ExpertGLU``, gpt-oss)."""
    if skip is not None and not np.any(skip):
        skip = None
    if _use_reference:
        from engine.kernels.grouped import grouped_moe_ffn_ref

        return grouped_moe_ffn_ref(gate, up, down, X, ids, weights, q8_act=q8_act, skip=skip, glu=glu)
    if X.shape[0] == 1:  # decode: the fused per-token kernel over the kept pairs
        from engine.kernels.moe import moe_ffn as moe_ffn_token

        if skip is not None:
            keep = ~np.asarray(skip, bool)[0]
            if not keep.any():
                return np.zeros((1, down.rows), np.float32)
            ids, weights = ids[:, keep], weights[:, keep]
        I, W = np.ascontiguousarray(ids[0]), np.ascontiguousarray(weights[0])
        return moe_ffn_token(gate, up, down, X[0], I, W, q8_act=q8_act, glu=glu)[None, :]
    from engine.kernels.grouped import grouped_moe_ffn  # prefill: each selected expert once

    return grouped_moe_ffn(gate, up, down, X, ids, weights, q8_act=q8_act, skip=skip, glu=glu)


PROMPT_SCRATCH_TOKENS = 32  # forward passes this long used prompt-sized scratch


def end_of_prompt(n_tokens: int) -> None:
    """After a forward pass of ``n_tokens``: give prompt-sized scratch back to the OS, so decoding
    does not keep it resident (the grouped kernels' reusable buffers, and the large arrays freed
    to glibc's heap, which it would otherwise keep: ~0.3 GB after a 512-token prompt here)."""
    if n_tokens < PROMPT_SCRATCH_TOKENS:
        return
    from engine.kernels import scratch

    scratch.release()
    _malloc_trim()


def _malloc_trim() -> None:
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # not glibc
            pass
