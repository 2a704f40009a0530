"""Prefill matrix products on the CPU's bf16 units (oneDNN through torch).

A prompt of many tokens multiplies every weight row by many activation rows, so the work is
arithmetic, not memory traffic. On 2 cores the integer kernels (``engine.kernels.kquants`` /
``legacy``) reach ~35-100 GMAC/s; oneDNN's bf16 GEMM reaches 400-950 GMAC/s on AMX and ~2x the
integer kernels on AVX512-BF16 (``vdpbf16ps``). Dequantizing a matrix costs ~0.2 ns per element,
so it pays once a weight row meets ~30 tokens (:func:`applies` decides; :mod:`engine.ops` and
:mod:`engine.kernels.grouped` ask it).

``dequant_rows(w, r0, r1) -> float32 [r1 - r0, n]``: rows r0..r1 of a prepared weight, each value
exactly what the reference dequantizer gives (``engine.quant.dequantize``, same operation
order), one block at a time, rows in parallel. :func:`mm` multiplies in the process's
:func:`mode`: both operands rounded to bf16 (nearest even), products summed in float32, and a
float32 result (FPMATH, AMX) or one rounded to bf16 (BF16, AVX512-BF16 without AMX). Versus the
q8 kernels this trades the activations' per-block int8 rounding (llama.cpp's) for bf16 rounding:
finer for activations, and the dequantized weights are rounded to bf16 too (see PREFILL_TYPES).
Either mode keeps prompt logits closer to an exact float64 reference than llama.cpp's own
(tests/test_prompt_accuracy.py holds that on every quantized type, on both processor kinds).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from numba import njit, prange

from engine.kernels import scratch
from engine.kernels.prepare import PreparedWeight
from engine.quant.formats import QType

TYPES = (QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.Q4_K, QType.Q5_K, QType.Q6_K)  # dequant_rows
# Types whose prompt products go through bf16. 4- and 5-bit codes only: a weight's bf16 rounding
# (2^-9 relative) is ~15x below their quantization error, and logits stay within the q8 kernels'
# bounds against llama.cpp (tests/test_parity_llama.py). For Q6_K and Q8_0 the measured argmax
# agreement with llama.cpp fell from 100 % to 89-92 % (also with the weights split into two bf16
# terms: the activations' rounding dominates), so those keep the q8 kernels.
PREFILL_TYPES = (QType.Q4_0, QType.Q5_0, QType.Q4_K, QType.Q5_K)


@njit(cache=True, nogil=True, inline="always")
def _store(f, out, at, m):
    """out[at:at+m] = f[:m]. Blocks are decoded into a local array first: LLVM then knows the
    stores do not alias the weight bytes and vectorizes the decode (writing straight into ``out``
    measured 2-3x slower for Q4_K/Q6_K; so did one kernel for Q4_K and Q5_K with a flag)."""
    for i in range(m):
        out[at + i] = f[i]


@njit(cache=True, nogil=True, inline="always")
def _scale_min_k4(q, o, j):
    """6-bit scale and min of sub-block j from the 12 packed bytes at q[o:] (get_scale_min_k4)."""
    if j < 4:
        return q[o + j] & 63, q[o + j + 4] & 63
    return (q[o + j + 4] & 0xF) | ((q[o + j - 4] >> 6) << 4), (q[o + j + 4] >> 4) | ((q[o + j] >> 6) << 4)


@njit(cache=True, nogil=True, parallel=True)
def _rows_q4_k(raw, s, r0, r1, out):
    nb = s.shape[1] // 2
    for i in prange(r1 - r0):
        w, sr, f = raw[r0 + i], s[r0 + i], np.empty(256, np.float32)
        for b in range(nb):
            o = b * 144
            d, dm = sr[2 * b], sr[2 * b + 1]
            for j in range(4):
                sc0, m0 = _scale_min_k4(w, o + 4, 2 * j)
                sc1, m1 = _scale_min_k4(w, o + 4, 2 * j + 1)
                a0, b0 = d * np.float32(sc0), dm * np.float32(m0)
                a1, b1 = d * np.float32(sc1), dm * np.float32(m1)
                for l in range(32):
                    q = w[o + 16 + 32 * j + l]
                    f[64 * j + l] = a0 * np.float32(q & 15) - b0
                    f[64 * j + 32 + l] = a1 * np.float32(q >> 4) - b1
            _store(f, out[i], 256 * b, 256)


@njit(cache=True, nogil=True, parallel=True)
def _rows_q5_k(raw, s, r0, r1, out):
    nb = s.shape[1] // 2
    for i in prange(r1 - r0):
        w, sr, f = raw[r0 + i], s[r0 + i], np.empty(256, np.float32)
        for b in range(nb):
            o = b * 176
            d, dm = sr[2 * b], sr[2 * b + 1]
            for j in range(4):
                sc0, m0 = _scale_min_k4(w, o + 4, 2 * j)
                sc1, m1 = _scale_min_k4(w, o + 4, 2 * j + 1)
                a0, b0 = d * np.float32(sc0), dm * np.float32(m0)
                a1, b1 = d * np.float32(sc1), dm * np.float32(m1)
                for l in range(32):
                    q = w[o + 48 + 32 * j + l]
                    h = w[o + 16 + l]
                    q0 = (q & 15) | (((h >> (2 * j)) & 1) << 4)
                    q1 = (q >> 4) | (((h >> (2 * j + 1)) & 1) << 4)
                    f[64 * j + l] = a0 * np.float32(q0) - b0
                    f[64 * j + 32 + l] = a1 * np.float32(q1) - b1
            _store(f, out[i], 256 * b, 256)


@njit(cache=True, nogil=True, parallel=True)
def _rows_q6_k(raw, s, r0, r1, out):
    nb = s.shape[1]
    for i in prange(r1 - r0):
        w, sr, f = raw[r0 + i], s[r0 + i], np.empty(256, np.float32)
        for b in range(nb):
            o = b * 210
            d = sr[b]
            for half in range(2):
                ql, qh, sc = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half
                for k in range(4):
                    shift_lo = 0 if k < 2 else 4
                    a0 = d * np.float32(np.int8(w[sc + 2 * k]))  # l < 16
                    a1 = d * np.float32(np.int8(w[sc + 2 * k + 1]))  # l >= 16
                    for l in range(32):
                        lo = (np.int32(w[ql + 32 * (k & 1) + l]) >> shift_lo) & 15
                        hi = (np.int32(w[qh + l]) >> (2 * k)) & 3
                        a = a0 if l < 16 else a1
                        f[128 * half + 32 * k + l] = a * np.float32((lo | (hi << 4)) - 32)
            _store(f, out[i], 256 * b, 256)


@njit(cache=True, nogil=True, parallel=True)
def _rows_legacy(qt, raw, s, r0, r1, out):
    """Q8_0 (qt 8), Q4_0 (2), Q5_0 (6): 32-element blocks, d per block in ``s``."""
    nb = s.shape[1]
    for i in prange(r1 - r0):
        w, sr, f = raw[r0 + i], s[r0 + i], np.empty(32, np.float32)
        for b in range(nb):
            d = sr[b]
            if qt == 8:
                o = b * 34
                for l in range(32):
                    f[l] = np.float32(np.int8(w[o + 2 + l])) * d
            elif qt == 2:
                o = b * 18
                for l in range(16):
                    q = w[o + 2 + l]
                    f[l] = np.float32(np.int32(q & 15) - 8) * d
                    f[16 + l] = np.float32(np.int32(q >> 4) - 8) * d
            else:
                o = b * 22
                qh = np.uint32(w[o + 2]) | (np.uint32(w[o + 3]) << 8) | (np.uint32(w[o + 4]) << 16)
                qh |= np.uint32(w[o + 5]) << 24
                for l in range(16):
                    q = w[o + 6 + l]
                    hi0 = np.int32((qh >> np.uint32(l)) & np.uint32(1))
                    hi1 = np.int32((qh >> np.uint32(l + 16)) & np.uint32(1))
                    f[l] = np.float32((np.int32(q & 15) | (hi0 << 4)) - 16) * d
                    f[16 + l] = np.float32((np.int32(q >> 4) | (hi1 << 4)) - 16) * d
            _store(f, out[i], 32 * b, 32)


def dequant_rows(w: PreparedWeight, r0: int, r1: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows [r0, r1) of ``w`` (experts stacked: row e·rows + r) -> float32 [r1 - r0, n]."""
    if w.qtype not in TYPES:
        raise ValueError(f"no row dequantizer for {w.qtype.name}")
    if out is None:
        out = np.empty((r1 - r0, w.n), np.float32)
    if w.qtype == QType.Q4_K:
        _rows_q4_k(w.raw, w.scales, r0, r1, out)
    elif w.qtype == QType.Q5_K:
        _rows_q5_k(w.raw, w.scales, r0, r1, out)
    elif w.qtype == QType.Q6_K:
        _rows_q6_k(w.raw, w.scales, r0, r1, out)
    else:
        _rows_legacy(int(w.qtype), w.raw, w.scales, r0, r1, out)
    return out


# --- when and how prefill uses it ---------------------------------------------------------------

MIN_TOKENS = 32  # activation rows per weight row from which dequantize + bf16 GEMM beats the q8 kernels
ROW_BLOCK = 4096  # weight rows dequantized at a time (a few MB: stays in L2/L3 for the GEMM)

# How products go through the bf16 units (:func:`mode` picks one per process):
FPMATH = "fpmath"  # float32 tensors under oneDNN's bf16 fpmath mode: bf16 products, f32 sums, f32 result
BF16 = "bf16"  # bf16 tensors: bf16 products, f32 sums, the result rounded to bf16
OFF = "off"  # the q8 kernels for every product (llama.cpp's arithmetic)
MODE: str | None = None  # the chosen mode; None until :func:`mode` first runs (tests set it)


def _cpu_features() -> set[str]:
    import llvmlite.binding as llvm

    return set(llvm.get_host_cpu_features().flatten().split(","))


def fpmath_rounds() -> bool:
    """Whether oneDNN really rounds to bf16 under the fpmath mode on this CPU.

    It does where it runs the product on AMX (``brg_matmul:avx512_core_amx``). On AVX512-BF16
    without AMX (AMD Zen 4) it picks its plain float32 kernel (``brg_matmul:avx512_core``) and the
    mode changes nothing, so it is no faster than float32 and slower than the q8 kernels; the same
    happens where ``ONEDNN_MAX_CPU_ISA`` masks AMX. A 64 x 64 product tells the two apart: 1 + 2^-10
    is not a bf16 value, so rounded inputs give exactly 1 where float32 gives 1 + 2^-10. (Products of
    16 x 16 and smaller take a plain float32 path even on AMX, torch 2.13: the probe must be as large as
    the prompt's products, which are far larger.)
    """
    import torch

    a = torch.full((64, 64), 1.0 + 2.0**-10)
    b = torch.zeros((64, 64))
    b[0, 0] = 1.0
    with bf16_products():
        y = float((a @ b)[0, 0])
    return y == 1.0


def detect_mode(flag: str = "auto") -> str:
    """The mode for this CPU (``flag``: ``EngineOptions.bf16_prefill``, from ``SHARPI_BF16``: "0" off,
    "1" on even without native bf16 units, "fpmath"/"bf16" a mode by name, "auto" by the CPU):

    * oneDNN rounds under the fpmath mode (AMX): FPMATH, float32 results, 400-950 GMAC/s on 2 cores;
    * else AVX512-BF16 (or AMX masked): BF16, bf16 tensors on ``vdpbf16ps`` (~2x the q8 kernels on
      2 Zen 4 cores); their bf16-rounded results keep prompt logits about twice as close to an
      exact float64 reference as llama.cpp's q8 arithmetic (tests/test_prompt_accuracy.py);
    * else OFF: without native bf16 units a bf16 product is emulated and slower than the q8 kernels.
    """
    flag = flag.strip().lower() or "auto"
    if flag == "0":
        return OFF
    if flag in (FPMATH, BF16):
        return flag
    if flag not in ("auto", "1"):
        raise ValueError(f"SHARPI_BF16={flag!r}: expected 0, 1, auto, {FPMATH} or {BF16}")
    if fpmath_rounds():
        return FPMATH
    if flag == "1" or {"+amx-bf16", "+avx512bf16"} & _cpu_features():
        return BF16
    return OFF


def mode() -> str:
    """The process's mode (:func:`detect_mode` of ``engine.config.current().bf16_prefill``, decided
    on first use)."""
    global MODE
    if MODE is None:
        from engine import config

        MODE = detect_mode(config.current().bf16_prefill)
    return MODE


def usable(qtype: QType, q8_act: bool) -> bool:
    """Whether products with a ``qtype`` matrix may go through bf16 at all: the rounded-activation
    mode (``q8_act``; the exact-float mode keeps its exact kernels), a type this module
    dequantizes for prompts (PREFILL_TYPES), and a mode other than OFF (:func:`mode`)."""
    return q8_act and qtype in PREFILL_TYPES and mode() != OFF


def applies(qtype: QType, n_tokens: int, q8_act: bool) -> bool:
    """:func:`usable`, and ``n_tokens`` activation rows per weight row make it pay."""
    return n_tokens >= MIN_TOKENS and usable(qtype, q8_act)


@contextmanager
def bf16_products():
    """float32 torch matmuls inside run under oneDNN's bf16 fpmath mode (see :func:`fpmath_rounds`)."""
    import torch

    m = torch.backends.mkldnn.matmul
    before = m.fp32_precision
    m.fp32_precision = "bf16"
    try:
        yield
    finally:
        m.fp32_precision = before


def mm(X, W):
    """torch float32 X [T, n] times W [R, n]ᵀ -> float32 [T, R] on the bf16 units in :func:`mode`:
    FPMATH, bf16-rounded inputs, float32 sums and result (where oneDNN does round, else plain
    float32); BF16, the same products and sums with the result rounded to bf16."""
    import torch

    if mode() == BF16:
        return torch.nn.functional.linear(X.to(torch.bfloat16), W.to(torch.bfloat16)).float()
    with bf16_products():
        return X @ W.T


def matmul(w: PreparedWeight, X: np.ndarray) -> np.ndarray:
    """X float32 [T, n] times ``w``ᵀ -> float32 [T, R] through :func:`mm`, the weight dequantized
    ROW_BLOCK rows at a time."""
    import torch

    R = w.raw.shape[0]
    Xt = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32))
    y = np.empty((X.shape[0], R), np.float32)
    Y = torch.from_numpy(y)
    buf = scratch.buffer("dequant", min(R, ROW_BLOCK) * w.n).reshape(-1, w.n)
    for r0 in range(0, R, ROW_BLOCK):
        r1 = min(R, r0 + ROW_BLOCK)
        Y[:, r0:r1] = mm(Xt, torch.from_numpy(dequant_rows(w, r0, r1, buf[: r1 - r0])))
    return y
