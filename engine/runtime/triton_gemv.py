"""Triton GEMV straight from quantized GGUF blocks: gather by byte offset, dequantize in
registers, dot with the activations — no float copy of the weights.

``gemv(pool, offsets, X, qtype, rows, n) -> Y``: for each pair p, ``Y[p] = W_p · X[p]`` where
``W_p`` is the ``[rows, n]`` matrix whose raw bytes start at ``pool[offsets[p]]`` (cached experts:
a slot's role offset per (token, expert) pair). ``matmul(raw, X, qtype, rows, n)``: one matrix,
a few tokens (the trunk at decode): each program reads its weight tile once for all of them.

A program owns ``BR`` rows and walks K ``NB`` blocks at a time (a 2-D tile of BR × NB blocks,
loaded along each row's bytes); with ``SPLIT > 1`` the K range is cut into slices whose partial
sums are added afterwards (matrices with few rows). The reference is
``engine.runtime.references.gemv_reference`` (dequantize, then matmul); ``tests/triton/`` holds them
together in Triton's interpreter and on CUDA.

Two kinds of kernels: ``act="f32"`` — the exact-float kernels below (dequantize each element, float
FMAs) — and ``act="q8"`` — integer dp4a products with the activations rounded to 8-bit blocks
(``triton_q8``, ``triton_q8_gemv``, ``triton_q4k_gemv``). Which one runs, and with which launch
settings (``{"BR", "NB", "num_warps", "SPLIT"}``, an optional ``"UNROLL"`` capping the unrolled K
walk; the JSON tables in ``engine/runtime/launch/``), is :mod:`engine.runtime.kernel_select`'s
choice; ``cfg``/``act`` given here override it (why f32 is the default: docs/lab-notebook.md,
"Activation modes").
"""

from __future__ import annotations

import torch

from engine.config import EngineOptions
from engine.quant.formats import QType, block_format
from engine.runtime import kernel_select as ks
from engine.runtime import triton_q4k_gemv, triton_q8, triton_q8_gemv
from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl
SUPPORTED = qb.SUPPORTED

if triton is not None:

    @triton.jit
    def _gemv_kernel(
        W, OFFS, X, Y, R, n, row_bytes, nb, T,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr,
        STEPS: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr,
    ):  # fmt: skip
        """Y[s, p·BT + t, rows] = Σ over K-slice s of W_p[rows] · X[p·BT + t] (t < BT, p·BT + t < T).
        PF: OFFS is constant (a trunk matrix), so the rows are prefetched into L2 before the PDL wait."""
        p = tl.program_id(1)
        s = tl.program_id(2)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        if PF:
            off = tl.multiple_of(tl.load(OFFS + p), 16)  # slots and matrices start 16-byte aligned
            qb.prefetch_rows(W, off, tl.program_id(0) * BR, tl.where(s == 0, R, 0), BR, row_bytes, NT)  # K slice 0
            qb.pdl_enter(PDL)
        else:
            qb.pdl_enter(PDL)
            off = tl.multiple_of(tl.load(OFFS + p), 16)
        rowoff = off + rows.to(tl.int64) * row_bytes  # [BR] row starts
        per = tl.cdiv(tl.cdiv(nb, SPLIT), NB) * NB  # blocks per K slice, a multiple of NB
        kb0 = s * per
        kb1 = tl.minimum(kb0 + per, nb)
        l = tl.arange(0, PW)
        t0 = p * BT
        if BT == 1:
            acc3 = tl.zeros([BR, NB, PW], dtype=tl.float32)  # summed once, after the K loop
            xrow = X + t0.to(tl.int64) * n
            acc3 = qb.acc_rows(acc3, W, rowoff, rmask, kb0, kb1, xrow, 1.0, QT, TS, QK, PW, NPART, ALIGN, NB, STEPS)
            acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
            tl.store(Y + (s * T + t0).to(tl.int64) * R + rows, acc, mask=rmask)
        else:
            tt = tl.arange(0, BT)
            acc = tl.zeros([BT, BR], dtype=tl.float32)
            for b0 in range(kb0, kb1, NB):
                b = b0 + tl.arange(0, NB)
                boff, m2 = qb.block_offsets(rowoff, b, kb1, rmask, TS, ALIGN)
                for i in tl.static_range(NPART):
                    w = qb.part(W, boff, m2, QT, i, PW)
                    xcol = b[:, None] * QK + i * PW + l[None, :]  # [NB, PW]
                    for t in tl.static_range(BT):
                        # [NB], in vector form: the interpreter rejects a scalar & vector mask
                        ok = (b < kb1) & (b * 0 + t0 + t < T)
                        xv = tl.load(X + (t0 + t).to(tl.int64) * n + xcol, mask=ok[:, None], other=0.0)
                        pt = tl.sum(tl.sum(w * xv[None, :, :], axis=2), axis=1)  # [BR]
                        acc += tl.where(tt[:, None] == t, pt[None, :], 0.0)
            ymask = ((t0 + tt) < T)[:, None] & rmask[None, :]
            tl.store(Y + (s * T + t0 + tt[:, None]).to(tl.int64) * R + rows[None, :], acc, mask=ymask)


def _run(pool, offsets, X, qtype, rows, n, bt, cfg, constant_offsets: bool = False) -> torch.Tensor:
    """Launch the GEMV kernel: X float32 [T, n] in groups of ``bt`` rows, one offset per group
    (``constant_offsets``: no kernel writes them, so the weights may be prefetched before the PDL wait)."""
    pdl = qb.pdl(X.device)
    T = X.shape[0]
    g = qb.geometry(qtype)
    nb = n // g["QK"]
    split = max(1, min(cfg["SPLIT"], nb))
    out = torch.empty((split, T, rows), dtype=torch.float32, device=X.device)
    grid = (triton.cdiv(rows, cfg["BR"]), offsets.shape[0], split)
    per = triton.cdiv(triton.cdiv(nb, split), cfg["NB"]) * cfg["NB"]  # blocks per K slice (as the kernel)
    _gemv_kernel[grid](
        pool, offsets, X, out, rows, n, block_format(qtype).row_bytes(n), nb, T,
        BR=cfg["BR"], NB=cfg["NB"], BT=bt, SPLIT=split, STEPS=qb.steps(per, cfg["NB"], cfg.get("UNROLL", ks.UNROLL)),
        PDL=pdl, PF=int(qb.prefetch(pdl) and constant_offsets), NT=32 * cfg["num_warps"], num_warps=cfg["num_warps"], **g,
        **qb.launch_kw(pdl),
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(0)


def gemv(
    pool: torch.Tensor,
    offsets: torch.Tensor,
    X: torch.Tensor,
    qtype: QType,
    rows: int,
    n: int,
    cfg: dict | None = None,
    act: str | None = None,
    options: EngineOptions | None = None,
) -> torch.Tensor:
    """pool uint8 [...] (contiguous); offsets int64 [P] byte offsets; X float32 [P, n] -> float32 [P, rows].
    act: "q8" | "f32" | None (``kernel_select.act_mode``); options: the engine options (launch tables)."""
    qtype = QType(qtype)
    name = ks.device_name(X.device)
    if ks.act_mode(X.device, act, options) == "q8":
        cfg = cfg or ks.launch("gemv_q8", qtype, rows * X.shape[0], name, options)
        return triton_q8_gemv.gemv_q8(pool, offsets, X.contiguous(), qtype, rows, n, cfg)
    cfg = cfg or ks.launch("gemv", qtype, rows * X.shape[0], name, options)
    return _run(pool, offsets, X.contiguous(), qtype, rows, n, 1, cfg)


def matmul(
    raw: torch.Tensor,
    X: torch.Tensor,
    qtype: QType,
    rows: int,
    n: int,
    cfg: dict | None = None,
    act: str | None = None,
    xq: tuple | None = None,
    options: EngineOptions | None = None,
) -> torch.Tensor:
    """One quantized matrix (raw uint8 [rows, row_bytes]) times X float32 [T, n] -> [T, rows], T ≤ 8.
    The kernel is ``kernel_select.matmul_kernel``'s: in q8 mode, Q4_K, one token, ``triton_q4k_gemv``
    (xq: X already in triton_q8's format, e.g. from the norm kernel; else it quantizes X itself); other
    q8 cases ``triton_q8_gemv``; f32 the exact-float kernel."""
    qtype = QType(qtype)
    T = X.shape[0]
    kernel = ks.matmul_kernel(qtype, n, T, ks.act_mode(X.device, act, options))
    cfg = cfg or ks.launch(kernel, qtype, rows, ks.device_name(X.device), options)
    if kernel == "gemv_q4k":
        return triton_q4k_gemv.gemv(raw, X, rows, n, cfg, xq)
    if kernel == "gemv_q8":
        return triton_q8_gemv.matmul_q8(raw, X.contiguous(), qtype, rows, n, cfg, zero_offset(X.device))
    bt = triton.next_power_of_2(T)
    return _run(raw.reshape(-1), zero_offset(X.device), X.contiguous(), qtype, rows, n, bt, cfg, True)


def matmul_many(
    raws: list[torch.Tensor],
    X: torch.Tensor,
    qtype: QType,
    rows: list[int],
    n: int,
    cfg: dict | None = None,
    act: str | None = None,
    xq: tuple | None = None,
    options: EngineOptions | None = None,
) -> list[torch.Tensor]:
    """Several matrices of one qtype and width n (raws[i] uint8 [rows[i], row_bytes], each 16-byte
    aligned; e.g. a layer's q, k, v) times the same X float32 [T, n], T ≤ 8 -> [T, rows[i]] each.
    q8 mode: Q4_K at one token, one ``triton_q4k_gemv`` launch each on one x̂ (xq, else quantized
    once here); other types one launch for all (plus X's quantization); f32 mode: one :func:`matmul` each."""
    qtype = QType(qtype)
    act = ks.act_mode(X.device, act, options)
    kernel = ks.matmul_kernel(qtype, n, X.shape[0], act)
    if kernel == "gemv_q4k":
        xq = xq if xq is not None else triton_q8.quantize_act(X.contiguous())
        return [matmul(r, X, qtype, R, n, cfg, act, xq, options) for r, R in zip(raws, rows)]
    if kernel != "gemv_q8" or len(raws) == 1:
        return [matmul(r, X, qtype, R, n, cfg, act, options=options) for r, R in zip(raws, rows)]
    cfg = cfg or ks.launch("gemv_q8", qtype, sum(rows), ks.device_name(X.device), options)
    Y = triton_q8_gemv.matmul_many_q8(raws, X.contiguous(), qtype, rows, n, cfg)
    return list(torch.split(Y, list(rows), dim=1))


_ZERO: dict[torch.device, torch.Tensor] = {}


def zero_offset(device: torch.device) -> torch.Tensor:
    """int64 [1] zero on ``device``, made once (a fresh one per call is a fill kernel per GEMV)."""
    z = _ZERO.get(device)
    if z is None:
        z = _ZERO[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return z
