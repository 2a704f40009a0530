"""Triton GEMV straight from quantized GGUF blocks: gather by byte offset, dequantize in
registers, dot with the activations — no float copy of the weights.

``gemv(pool, offsets, X, qtype, rows, n) -> Y``: for each p, ``Y[p] = W_p · X[p]`` where ``W_p`` is
the ``[rows, n]`` matrix whose raw bytes start at ``pool[offsets[p]]`` (a trunk matrix: one offset
per token, all 0; cached experts: a slot's role offset per (token, expert) pair). The reference it
must equal is ``engine.runtime.tdequant.dequantize`` followed by a matmul (see
``tests/test_triton_gemv.py``, which runs these kernels in Triton's interpreter on the CPU).
Launch settings are data: :data:`LAUNCH` (rows per program by type), tunable per GPU.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs go without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

from engine.quant.formats import QType, block_format

SUPPORTED = (QType.Q4_0, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K)
# Rows per program (BLOCK_R): the documented default; tuned values can override per device name.
LAUNCH: dict[str, dict[str, int]] = {"default": {"Q4_0": 32, "Q8_0": 32, "Q4_K": 16, "Q5_K": 16, "Q6_K": 16}}


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _f16(p, mask):
        """fp16 at byte pointer(s) p (little-endian) -> float32 (0 where masked off)."""
        lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _k4_scale_min(sb, s: tl.constexpr, mask):
        """6-bit scale and min of sub-block s from the 12 packed bytes at sb [BR] (get_scale_min_k4)."""
        if s < 4:
            sc = tl.load(sb + s, mask=mask, other=0).to(tl.int32) & 63
            m = tl.load(sb + s + 4, mask=mask, other=0).to(tl.int32) & 63
        else:
            a = tl.load(sb + s + 4, mask=mask, other=0).to(tl.int32)
            sc = (a & 0xF) | ((tl.load(sb + s - 4, mask=mask, other=0).to(tl.int32) >> 6) << 4)
            m = (a >> 4) | ((tl.load(sb + s, mask=mask, other=0).to(tl.int32) >> 6) << 4)
        return sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def _gemv_kernel(W, OFFS, X, Y, R, n, row_bytes, nb, QT: tl.constexpr, BR: tl.constexpr):
        p = tl.program_id(1)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        base = W + tl.load(OFFS + p) + rows.to(tl.int64) * row_bytes  # [BR] byte pointers
        x = X + p.to(tl.int64) * n
        acc = tl.zeros([BR], dtype=tl.float32)
        l32 = tl.arange(0, 32)
        for b in range(nb):
            if QT == 8:  # Q8_0: d, int8[32]
                blk = base + b * 34
                d = _f16(blk, rmask)
                q = tl.load(blk[:, None] + 2 + l32[None, :], mask=rmask[:, None], other=0).to(tl.int8, bitcast=True)
                xv = tl.load(x + b * 32 + l32)
                acc += d * tl.sum(q.to(tl.float32) * xv[None, :], axis=1)
            elif QT == 2:  # Q4_0: d, 16 bytes: low nibbles elements 0..15, high 16..31
                blk = base + b * 18
                d = _f16(blk, rmask)
                l16 = tl.arange(0, 16)
                q = tl.load(blk[:, None] + 2 + l16[None, :], mask=rmask[:, None], other=0).to(tl.int32)
                xl = tl.load(x + b * 32 + l16)
                xh = tl.load(x + b * 32 + 16 + l16)
                s = tl.sum(((q & 0xF) - 8).to(tl.float32) * xl[None, :], axis=1)
                s += tl.sum(((q >> 4) - 8).to(tl.float32) * xh[None, :], axis=1)
                acc += d * s
            elif QT == 12 or QT == 13:  # Q4_K / Q5_K: 4 chunks of 64 = low nibbles then high
                if QT == 12:
                    blk = base + b * 144
                    qs = blk + 16
                else:
                    blk = base + b * 176
                    qs = blk + 48
                d = _f16(blk, rmask)
                dmin = _f16(blk + 2, rmask)
                for j in tl.static_range(4):
                    q = tl.load(qs[:, None] + j * 32 + l32[None, :], mask=rmask[:, None], other=0).to(tl.int32)
                    lo = q & 0xF
                    hi = q >> 4
                    if QT == 13:  # one high bit per element: bit 2j (low half) / 2j+1 (high half) of qh[l]
                        qh = tl.load(blk[:, None] + 16 + l32[None, :], mask=rmask[:, None], other=0).to(tl.int32)
                        lo = lo | (((qh >> (2 * j)) & 1) << 4)
                        hi = hi | (((qh >> (2 * j + 1)) & 1) << 4)
                    xl = tl.load(x + b * 256 + j * 64 + l32)
                    xh = tl.load(x + b * 256 + j * 64 + 32 + l32)
                    sc0, m0 = _k4_scale_min(blk + 4, 2 * j, rmask)
                    sc1, m1 = _k4_scale_min(blk + 4, 2 * j + 1, rmask)
                    acc += d * (
                        sc0 * tl.sum(lo.to(tl.float32) * xl[None, :], axis=1)
                        + sc1 * tl.sum(hi.to(tl.float32) * xh[None, :], axis=1)
                    )
                    acc -= dmin * (m0 * tl.sum(xl) + m1 * tl.sum(xh))
            else:  # Q6_K: ql[128], qh[64], int8 scales[16], d — two halves of 128
                blk = base + b * 210
                d = _f16(blk + 208, rmask)
                first = l32[None, :] < 16
                for h in tl.static_range(2):
                    ql = blk + 64 * h
                    qh = tl.load(blk[:, None] + 128 + 32 * h + l32[None, :], mask=rmask[:, None], other=0).to(tl.int32)
                    a = tl.load(ql[:, None] + l32[None, :], mask=rmask[:, None], other=0).to(tl.int32)
                    c = tl.load(ql[:, None] + 32 + l32[None, :], mask=rmask[:, None], other=0).to(tl.int32)
                    for g in tl.static_range(4):
                        if g == 0:
                            q = (a & 0xF) | ((qh & 3) << 4)
                        elif g == 1:
                            q = (c & 0xF) | (((qh >> 2) & 3) << 4)
                        elif g == 2:
                            q = (a >> 4) | (((qh >> 4) & 3) << 4)
                        else:
                            q = (c >> 4) | (((qh >> 6) & 3) << 4)
                        sa = (
                            tl.load(blk + 192 + 8 * h + 2 * g, mask=rmask, other=0)
                            .to(tl.int8, bitcast=True)
                            .to(tl.float32)
                        )
                        sb = (
                            tl.load(blk + 193 + 8 * h + 2 * g, mask=rmask, other=0)
                            .to(tl.int8, bitcast=True)
                            .to(tl.float32)
                        )
                        sc = tl.where(first, sa[:, None], sb[:, None])  # [BR, 32]: 16 values per scale
                        xv = tl.load(x + b * 256 + 128 * h + 32 * g + l32)
                        acc += d * tl.sum(sc * (q - 32).to(tl.float32) * xv[None, :], axis=1)
        tl.store(Y + p.to(tl.int64) * R + rows, acc, mask=rmask)


def gemv(
    pool: torch.Tensor, offsets: torch.Tensor, X: torch.Tensor, qtype: QType, rows: int, n: int, device_name: str = ""
) -> torch.Tensor:
    """pool uint8 [...] (contiguous); offsets int64 [P] byte offsets; X float32 [P, n] -> float32 [P, rows]."""
    qtype = QType(qtype)
    fmt = block_format(qtype)
    P = X.shape[0]
    Y = torch.empty((P, rows), dtype=torch.float32, device=X.device)
    br = LAUNCH.get(device_name, LAUNCH["default"])[qtype.name]
    grid = (triton.cdiv(rows, br), P)
    _gemv_kernel[grid](
        pool, offsets, X.contiguous(), Y, rows, n, fmt.row_bytes(n), n // fmt.block_size, QT=int(qtype), BR=br
    )
    return Y
