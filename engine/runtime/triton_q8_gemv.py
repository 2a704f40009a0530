"""Integer (dp4a) GEMV / small-T matmul over raw GGUF blocks with q8 activations (triton_q8).

``gemv_q8(pool, offsets, X, qtype, rows, n)`` and ``matmul_q8(raw, X, qtype, rows, n)`` have the
contracts of :func:`engine.runtime.triton_gemv.gemv` / ``matmul`` (which call them in q8
mode, ``kernel_select.act_mode``); ``matmul_many_q8(raws, X, qtype, rows, n)`` multiplies several matrices of one qtype and
width n (a layer's q, k and v) by the same X in one launch — one trunk matrix per launch cannot
pass ~50-60 % of the bandwidth even for a plain copy (launch, ramp-up, tail).

Each call quantizes X once (``triton_q8.quantize_act``: one small launch). The references
(``engine.runtime.references.gemv_q8_reference`` / ``matmul_q8_reference``) dequantize the weights and
multiply by the *dequantized q8 activations* (``references.q8_round_trip``), so the kernels meet them
to float rounding.
"""

from __future__ import annotations

import torch

from engine.quant.formats import QType, block_format
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl

if triton is not None:

    @triton.jit
    def _q8_gemv_kernel(
        W, W32, META, XQ, XD, XS, Y, R, n32, row_bytes, nb, T, ystride,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, NW: tl.constexpr, NA: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr,
        STEPS: tl.constexpr, M: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
        NT: tl.constexpr,
    ):  # fmt: skip
        """Y[s, p·BT + t, col + rows] = Σ over K-slice s of W[rows] · Xq[p·BT + t].

        M == 1: one matrix per pair p, at byte offset META[p] (gemv: BT = 1; matmul: one pair).
        M > 1: M matrices side by side (program axis 0 runs over all their row tiles); META [4, M]
        holds per matrix its byte offset from W, rows, first row tile and first output column.
        PF: META is constant (trunk matrices): the tile's rows are prefetched into L2 before the PDL wait."""
        pid = tl.program_id(0)
        p = tl.program_id(1)
        s = tl.program_id(2)
        if not PF:
            qb.pdl_enter(PDL)
        if M == 1:
            off = tl.load(META + p)
            nrows = R
            tile = pid
            col = 0
        else:
            i = 0
            for j in tl.static_range(1, M):
                i += (pid >= tl.load(META + 2 * M + j)).to(tl.int32)
            off = tl.load(META + i)
            nrows = tl.load(META + M + i)
            tile = pid - tl.load(META + 2 * M + i)
            col = tl.load(META + 3 * M + i)
        rows = tile * BR + tl.arange(0, BR)
        rmask = rows < nrows
        rowoff = tl.multiple_of(off, 16) + rows.to(tl.int64) * row_bytes  # [BR]
        if PF:
            qb.prefetch_rows(W, off, tile * BR, tl.where(s == 0, nrows, 0), BR, row_bytes, NT)  # K slice 0
            qb.pdl_enter(PDL)
        per = tl.cdiv(tl.cdiv(nb, SPLIT), NB) * NB
        kb0 = s * per
        kb1 = tl.minimum(kb0 + per, nb)
        tok = p * BT + tl.arange(0, BT)
        tmask = tok < T
        xr = tok.to(tl.int64)
        acc = tl.zeros([BT, BR, NB, NA], dtype=tl.float32)
        accb = tl.zeros([BT, BR, NB], dtype=tl.float32)
        one = tl.full([BT], 1.0, tl.float32)
        acc, accb = t8.walk(acc, accb, W, W32, rowoff, rmask, kb0, kb1, XQ, XD, XS, xr, n32, tmask, one,
                            QT, TS, QK, NW, ALIGN, NB, STEPS, ASM)  # fmt: skip
        y = tl.sum(tl.sum(acc, axis=3), axis=2) + tl.sum(accb, axis=2)  # [BT, BR]
        yp = Y + (s * T + tok[:, None]).to(tl.int64) * ystride + col + rows[None, :]
        tl.store(yp, y, mask=tmask[:, None] & rmask[None, :])


def _launch(W, meta, Xq, qtype, rows, n, T, bt, pairs, cfg, m, out_rows, constant: bool = False) -> torch.Tensor:
    """constant: no kernel writes meta (trunk matrices), so their rows may be prefetched before the PDL wait."""
    XQ, XD, XS = Xq
    pdl = qb.pdl(XQ.device)
    g = t8.q8_geometry(qtype)
    nb = n // g["QK"]
    split = max(1, min(cfg.get("SPLIT", 1), nb))
    out = torch.empty((split, T, out_rows), dtype=torch.float32, device=XQ.device)
    tiles = meta[1] if m > 1 else triton.cdiv(rows, cfg["BR"])
    per = triton.cdiv(triton.cdiv(nb, split), cfg["NB"]) * cfg["NB"]
    _q8_gemv_kernel[(tiles, pairs, split)](
        W, t8.int32_view(W), meta[0] if m > 1 else meta, XQ, XD, XS, out, rows, n // t8.QBLK, block_format(qtype).row_bytes(n), nb, T,
        out_rows, BR=cfg["BR"], NB=cfg["NB"], BT=bt, SPLIT=split, STEPS=qb.steps(per, cfg["NB"], cfg.get("UNROLL", qb.UNROLL)),
        M=m, ASM=t8.use_asm(XQ.device), PDL=pdl, PF=int(qb.prefetch(pdl) and constant), NT=32 * cfg["num_warps"],
        num_warps=cfg["num_warps"], **g, **qb.launch_kw(pdl),
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(0)


def gemv_q8(pool, offsets, X, qtype, rows, n, cfg) -> torch.Tensor:
    """triton_gemv.gemv's contract (pool uint8, offsets int64 [P], X float32 [P, n] -> [P, rows])."""
    Xq = t8.quantize_act(X)
    P = offsets.shape[0]
    return _launch(pool, offsets, Xq, QType(qtype), rows, n, P, 1, P, cfg, 1, rows)


def matmul_q8(raw, X, qtype, rows, n, cfg, zero) -> torch.Tensor:
    """triton_gemv.matmul's contract (raw uint8 [rows, row_bytes], X float32 [T, n], T ≤ 8 -> [T, rows])."""
    T = X.shape[0]
    Xq = t8.quantize_act(X)
    return _launch(
        raw.reshape(-1), zero, Xq, QType(qtype), rows, n, T, triton.next_power_of_2(T), 1, cfg, 1, rows, True
    )


_META: dict[tuple, tuple[torch.Tensor, int]] = {}


def _many_meta(raws: list[torch.Tensor], rows: list[int], br: int) -> tuple[torch.Tensor, int]:
    """META int64 [4, M] (byte offset from raws[0], rows, first tile, first column) and the tile count,
    made once per (matrices, tile) — the trunk's weights stay put, so a decode step uploads nothing."""
    key = (tuple(r.data_ptr() for r in raws), tuple(rows), br, raws[0].device)
    hit = _META.get(key)
    if hit is None:
        base = raws[0].data_ptr()
        offs = [r.data_ptr() - base for r in raws]
        if any(o % 16 for o in offs):
            raise ValueError("matmul_many: matrices must start 16-byte aligned")
        tiles = [-(-r // br) for r in rows]
        starts = [sum(tiles[:i]) for i in range(len(rows))]
        cols = [sum(rows[:i]) for i in range(len(rows))]
        meta = torch.tensor([offs, rows, starts, cols], dtype=torch.int64).to(raws[0].device)
        hit = _META[key] = (meta, sum(tiles))
    return hit


def matmul_many_q8(raws, X, qtype, rows, n, cfg) -> torch.Tensor:
    """Matrices raws[i] uint8 [rows[i], row_bytes] (one qtype, width n) times X float32 [T, n] in one
    launch -> float32 [T, Σ rows] (matrix i's rows at columns Σ rows[:i] …)."""
    T = X.shape[0]
    Xq = t8.quantize_act(X)
    meta = _many_meta(list(raws), list(rows), cfg["BR"])
    return _launch(
        raws[0], meta, Xq, QType(qtype), 0, n, T, triton.next_power_of_2(T), 1, cfg, len(raws), sum(rows), True
    )
