"""Integer (dp4a) building blocks for the quantized decode kernels: activations quantized to 8-bit
blocks, weights decoded as 32-bit words, 4 multiply-adds per instruction.

Activations (llama.cpp's CUDA ``quantize_q8_1`` idea, our own rounding rule, same in the reference):
each row of ``X float32 [R, n]`` is cut into blocks of 32; per block ``d = amax / 127``,
``q = trunc(x / d + copysign(0.5, x / d))`` (round half away from zero; IEEE division; q = 0 when
d = 0) as int8, packed 4 a word (little-endian) → ``XQ int32 [R, n/4]``, ``XD float32 [R, n/32]``,
and the sums ``XS float32 [R, n/16]`` = ``d · Σ q`` over each 16 elements — the *dequantized*
activations' sums, so the weights' offsets (Q4_0's −8, Q6_K's −32, the K-quants' mins) come out as
``offset · XS`` and the kernels compute exactly ``dequantize(W) · dequantize_act(X)`` (up to float
summation order). ``engine.runtime.references.quantize_act_reference`` is the specification (torch).

Weights: :func:`q8_block` walks a tile of ``BR`` rows × ``NB`` blocks, loads each 32-byte (Q4_0: 16)
run of quants as int32 words ``[BR, NB, NW]`` (Q4_K/Q5_K 4-byte aligned: vector loads; the
2-byte-aligned Q4_0/Q8_0/Q6_K: two uint16 loads combined), unpacks 4 codes a word with
``w & 0x0F0F0F0F`` / ``(w >> 4) & 0x0F0F0F0F`` (Q5_K/Q6_K OR in their high bits with word ops), and
``dp4a`` (PTX via ``tl.inline_asm_elementwise``; ``ASM=False``: the same arithmetic in plain
Triton, for the interpreter) against the activation words. Each word's integer sum (Q4_K/Q5_K, loaded 16
bytes a thread: the sum of those 4 words, in integers) is scaled in float (weight scale ×
activation scale) into ``acc [BT, BR, NB, NA]``; per-block offset terms go to
``accb [BT, BR, NB]``; the caller sums both once after its K walk. The block layouts are ggml's
(``vec_dot_q4_0_q8_1`` … ``vec_dot_q6_K_q8_1`` compute the same sums).
"""

from __future__ import annotations

import torch

from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl

# Per type: NW, int32 words per part of a block (one dp4a operand vector); NPART parts a block;
# NA, the accumulator's last axis (words, or 16-byte groups of them where loads are that wide).
WORDS = {2: (4, 1, 4), 8: (8, 1, 8), 12: (8, 4, 2), 13: (8, 4, 2), 14: (8, 4, 8)}
QBLK = 32  # activation block (elements)


def int32_view(W: torch.Tensor) -> torch.Tensor:
    """The flat uint8 pool as int32 (the kernels' word loads), or itself where its size is not a
    multiple of 4 (then only 2-byte-aligned types, which load halves, may use it)."""
    W = W.reshape(-1)
    return W.view(torch.int32) if W.numel() % 4 == 0 and W.data_ptr() % 4 == 0 else W


def use_asm(device: torch.device) -> bool:
    """PTX dp4a on a compiled CUDA device; the plain-Triton emulation in the interpreter."""
    return qb.compiled(device)


def q8_geometry(qtype) -> dict:
    g = qb.geometry(qtype)
    nw, npart, na = WORDS[g["QT"]]
    return {"QT": g["QT"], "TS": g["TS"], "QK": g["QK"], "NW": nw, "NA": na, "NPART": npart, "ALIGN": g["ALIGN"]}


if triton is not None:

    @triton.jit
    def _dp4a(a, b, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
        """Σ over the 4 bytes of int32 words: a's bytes (unsigned, or signed with SIGNED_A) × b's (signed)."""
        if ASM:
            if SIGNED_A:
                return tl.inline_asm_elementwise(
                    "dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
                )
            else:
                return tl.inline_asm_elementwise(
                    "dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
                )
        else:
            s = (a & 0) + (b & 0)
            for k in tl.static_range(4):
                if SIGNED_A:
                    ak = (a << (24 - 8 * k)) >> 24
                else:
                    ak = (a >> (8 * k)) & 0xFF
                s += ak * ((b << (24 - 8 * k)) >> 24)
            return s

    @triton.jit
    def _words5(b32, OFF: tl.constexpr, mask):
        """The 8 int32 words at byte OFF of the blocks b32 (int32 pointers [BR, NB], 16-byte aligned) as
        [BR, NB, 2, 4]: a thread holds one 16-byte load."""
        k = tl.arange(0, 2)
        m = tl.arange(0, 4)
        p = b32[:, :, None, None] + (OFF // 4 + 4 * k[:, None] + m[None, :])[None, None, :, :]
        return tl.load(p, mask=mask[:, :, None, None], other=0)

    @triton.jit
    def _xq5(XQ, xr, n32, sb, xm, S: tl.constexpr, BR: tl.constexpr):
        """The 8 activation words of 32-block sb + S [NB] of rows xr [BT] as [BT, BR, NB, 2, 4], loaded
        per row of the weight tile (L1 hits) so the load takes the weights' 16-byte-a-thread layout
        (a small [BT, NB, 2, 4] load gets one word a thread, and the weights would be converted to it)."""
        k = tl.arange(0, 2)
        m = tl.arange(0, 4)
        r0 = tl.zeros([BR], dtype=tl.int64)
        p = (XQ + (xr * (8 * n32))[:, None, None, None, None] + r0[None, :, None, None, None]
             + ((sb + S) * 8)[None, None, :, None, None] + (4 * k[:, None] + m[None, :])[None, None, None, :, :])  # fmt: skip
        return tl.load(p, mask=xm[:, None, :, None, None], other=0)

    @triton.jit
    def _isum(w, a, ASM: tl.constexpr):
        """dp4a of weight codes w [BR, NB, 2, 4] (unsigned) and activations a [BT, BR, NB, 2, 4], the 4 words of
        each 16-byte load summed in integers inside the thread -> float32 [BT, BR, NB, 2]."""
        return tl.sum(_dp4a(w[None], a, False, ASM), axis=4).to(tl.float32)

    @triton.jit
    def _words(blk, OFF: tl.constexpr, NW: tl.constexpr, mask, ALIGN: tl.constexpr):
        """int32 words [BR, NB, NW] of the bytes blk + OFF + 4m (blk: uint8 block pointers [BR, NB])."""
        m = tl.arange(0, NW)
        p = blk[:, :, None] + (OFF + 4 * m)[None, None, :]
        m3 = mask[:, :, None]
        if ALIGN >= 4:
            return tl.load(p.to(tl.pointer_type(tl.int32)), mask=m3, other=0)
        else:  # 2-byte aligned blocks: two halves a word
            h = p.to(tl.pointer_type(tl.uint16))
            lo = tl.load(h, mask=m3, other=0).to(tl.int32)
            hi = tl.load(h + 1, mask=m3, other=0).to(tl.int32)
            return lo | (hi << 16)

    @triton.jit
    def _xq(XQ, xr, n32, sb, xm, S: tl.constexpr, W0: tl.constexpr, NW: tl.constexpr, BR: tl.constexpr):
        """int32 activation words [BT, BR, NB, NW]: words W0 … W0+NW-1 of 32-block sb + S [NB] of rows
        xr [BT], repeated per row of the weight tile (same layout as the weights: no conversion)."""
        m = tl.arange(0, NW)
        r0 = tl.zeros([BR], dtype=tl.int64)
        p = (XQ + (xr * (8 * n32))[:, None, None, None] + r0[None, :, None, None]
             + ((sb + S) * 8 + W0)[None, None, :, None] + m[None, None, None, :])  # fmt: skip
        return tl.load(p, mask=xm[:, None, :, None], other=0)

    @triton.jit
    def _xds(XD, XS, xr, n32, sb, xm, S: tl.constexpr, xscale):
        """Scale d and sum d·Σq of 32-block sb + S of rows xr, times xscale: two float32 [BT, NB]."""
        k = xr[:, None] * n32 + (sb + S)[None, :]
        dx = tl.load(XD + k, mask=xm, other=0.0) * xscale[:, None]
        sx = (tl.load(XS + 2 * k, mask=xm, other=0.0) + tl.load(XS + 2 * k + 1, mask=xm, other=0.0)) * xscale[:, None]
        return dx, sx

    @triton.jit
    def _xds16(XD, XS, xr, n32, sb, xm, S: tl.constexpr, xscale):
        """As _xds, with the two 16-element sums apart: dx, s0, s1 [BT, NB]."""
        k = xr[:, None] * n32 + (sb + S)[None, :]
        dx = tl.load(XD + k, mask=xm, other=0.0) * xscale[:, None]
        s0 = tl.load(XS + 2 * k, mask=xm, other=0.0) * xscale[:, None]
        s1 = tl.load(XS + 2 * k + 1, mask=xm, other=0.0) * xscale[:, None]
        return dx, s0, s1

    @triton.jit
    def q8_block(acc, accb, W, W32, boff, m2, XQ, XD, XS, xr, n32, xm, b, xscale,
                 QT: tl.constexpr, QK: tl.constexpr, NW: tl.constexpr, ALIGN: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
        """acc [BT, BR, NB, NA], accb [BT, BR, NB] += the blocks at byte offsets boff [BR, NB] (mask m2) of W
        (uint8; W32: the same memory as int32 where its size allows, else W) times the q8
        activations of rows xr [BT] (int64 row indices of XQ/XD/XS, n32 blocks a row; mask xm [BT, NB])
        at weight blocks b [NB], times xscale [BT]."""
        blk = W + boff
        BR: tl.constexpr = boff.shape[0]
        nsub: tl.constexpr = QK // 32  # 32-element activation blocks per weight block
        # activation-side index of 32-block j of weight block b: b·nsub + j
        sb = b * nsub  # [NB]
        if QT == 2:  # Q4_0: d, qs[16]; low nibbles = elements 0..15, high = 16..31; value q - 8
            w = _words(blk, 2, 4, m2, ALIGN)
            lo = w & 0x0F0F0F0F
            hi = (w >> 4) & 0x0F0F0F0F
            xa = _xq(XQ, xr, n32, sb, xm, 0, 0, 4, BR)
            xb = _xq(XQ, xr, n32, sb, xm, 0, 4, 4, BR)
            dx, sx = _xds(XD, XS, xr, n32, sb, xm, 0, xscale)
            dw = qb._f16(blk, m2)
            i = _dp4a(lo[None], xa, False, ASM) + _dp4a(hi[None], xb, False, ASM)
            acc += i.to(tl.float32) * (dw[None] * dx[:, None])[:, :, :, None]
            accb -= 8.0 * dw[None] * sx[:, None]
        elif QT == 8:  # Q8_0: d, int8 qs[32]
            w = _words(blk, 2, 8, m2, ALIGN)
            xa = _xq(XQ, xr, n32, sb, xm, 0, 0, 8, BR)
            dx, sx = _xds(XD, XS, xr, n32, sb, xm, 0, xscale)
            dw = qb._f16(blk, m2)
            acc += _dp4a(w[None], xa, True, ASM).to(tl.float32) * (dw[None] * dx[:, None])[:, :, :, None]
        elif QT == 12 or QT == 13:  # Q4_K / Q5_K: 32 qs bytes j hold sub-blocks 2j (low) and 2j+1 (high)
            d = qb._f16(blk, m2)
            dmin = qb._f16(blk + 2, m2)
            b32 = W32 + tl.multiple_of(boff // 4, [4, 4])  # the int32 view: alignment the compiler keeps
            if QT == 13:
                qh = _words5(b32, 16, m2)  # bit S of qh[l]: fifth bit of sub-block S
            for j in tl.static_range(4):
                if QT == 12:
                    w = _words5(b32, 16 + 32 * j, m2)
                else:
                    w = _words5(b32, 48 + 32 * j, m2)
                lo = w & 0x0F0F0F0F
                hi = (w >> 4) & 0x0F0F0F0F
                if QT == 13:
                    lo = lo | (((qh >> (2 * j)) << 4) & 0x10101010)
                    hi = hi | (((qh >> (2 * j + 1)) << 4) & 0x10101010)
                sc0, mn0 = qb._k4_scale_min(blk + 4, 2 * j, m2)
                sc1, mn1 = qb._k4_scale_min(blk + 4, 2 * j + 1, m2)
                dxa, sxa = _xds(XD, XS, xr, n32, sb, xm, 2 * j, xscale)
                dxb, sxb = _xds(XD, XS, xr, n32, sb, xm, 2 * j + 1, xscale)
                ia = _isum(lo, _xq5(XQ, xr, n32, sb, xm, 2 * j, BR), ASM)
                ib = _isum(hi, _xq5(XQ, xr, n32, sb, xm, 2 * j + 1, BR), ASM)
                acc += ia * ((d * sc0)[None] * dxa[:, None])[:, :, :, None]
                acc += ib * ((d * sc1)[None] * dxb[:, None])[:, :, :, None]
                accb -= (dmin * mn0)[None] * sxa[:, None] + (dmin * mn1)[None] * sxb[:, None]
        else:  # Q6_K: ql[128], qh[64], int8 scales[16], d; half H, 32 ql bytes c: groups G = c (low), c + 2 (high)
            d = qb._f16(blk + 208, m2)
            for H in tl.static_range(2):
                qh = _words(blk, 128 + 32 * H, 8, m2, ALIGN)
                for c in tl.static_range(2):
                    ql = _words(blk, 64 * H + 32 * c, 8, m2, ALIGN)
                    acc, accb = _q6_group(acc, accb, blk, m2, ql & 0x0F0F0F0F, qh, d, XQ, XD, XS, xr, n32, sb, xm,
                                          xscale, H, c, ASM)  # fmt: skip
                    acc, accb = _q6_group(acc, accb, blk, m2, (ql >> 4) & 0x0F0F0F0F, qh, d, XQ, XD, XS, xr, n32, sb,
                                          xm, xscale, H, c + 2, ASM)  # fmt: skip
        return acc, accb

    @triton.jit
    def _q6_group(acc, accb, blk, m2, nib, qh, d, XQ, XD, XS, xr, n32, sb, xm, xscale,
                  H: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
        """Q6_K group G of half H (elements 128H + 32G + l): low 4 bits nib, bits 2G, 2G+1 of qh; value q - 32."""
        BR: tl.constexpr = nib.shape[0]
        if G < 2:
            q = nib | ((qh << (4 - 2 * G)) & 0x30303030)
        else:
            q = nib | ((qh >> (2 * G - 4)) & 0x30303030)
        S: tl.constexpr = 4 * H + G  # 32-element sub-block
        sa = tl.load(blk + (192 + 8 * H + 2 * G), mask=m2, other=0).to(tl.int8, bitcast=True)
        sbb = tl.load(blk + (193 + 8 * H + 2 * G), mask=m2, other=0).to(tl.int8, bitcast=True)
        sa = d * sa.to(tl.float32)
        sbb = d * sbb.to(tl.float32)
        xa = _xq(XQ, xr, n32, sb, xm, S, 0, 8, BR)
        dx, s0, s1 = _xds16(XD, XS, xr, n32, sb, xm, S, xscale)
        i = _dp4a(q[None], xa, False, ASM).to(tl.float32)  # [BT, BR, NB, 8]
        m = tl.arange(0, 8)
        sw = tl.where(m[None, None, :] < 4, sa[:, :, None], sbb[:, :, None])  # 16 elements a scale
        acc += i * sw[None] * dx[:, None, :, None]
        accb -= 32.0 * (sa[None] * s0[:, None] + sbb[None] * s1[:, None])
        return acc, accb

    @triton.jit
    def _step(acc, accb, W, W32, rowoff, rmask, b0, kb1, XQ, XD, XS, xr, n32, tmask, xscale,
              QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, NW: tl.constexpr, ALIGN: tl.constexpr,
              NB: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
        b = b0 + tl.arange(0, NB)
        boff, m2 = qb.block_offsets(rowoff, b, kb1, rmask, TS, ALIGN)
        xm = tmask[:, None] & (b < kb1)[None, :]
        return q8_block(acc, accb, W, W32, boff, m2, XQ, XD, XS, xr, n32, xm, b, xscale, QT, QK, NW, ALIGN, ASM)

    @triton.jit
    def walk(acc, accb, W, W32, rowoff, rmask, kb0, kb1, XQ, XD, XS, xr, n32, tmask, xscale,
             QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, NW: tl.constexpr, ALIGN: tl.constexpr,
             NB: tl.constexpr, STEPS: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
        """acc/accb += the rows at rowoff [BR] over blocks [kb0, kb1) times the q8 rows xr [BT] (see q8_block);
        STEPS > 0: unrolled (kb1 - kb0 ≤ STEPS·NB), as triton_qblocks.acc_rows."""
        if STEPS == 0:
            for b0 in range(kb0, kb1, NB):
                acc, accb = _step(acc, accb, W, W32, rowoff, rmask, b0, kb1, XQ, XD, XS, xr, n32, tmask, xscale,
                                  QT, TS, QK, NW, ALIGN, NB, ASM)  # fmt: skip
        else:
            for j in tl.static_range(STEPS):
                acc, accb = _step(acc, accb, W, W32, rowoff, rmask, kb0 + j * NB, kb1, XQ, XD, XS, xr, n32, tmask, xscale,
                                  QT, TS, QK, NW, ALIGN, NB, ASM)  # fmt: skip
        return acc, accb

    @triton.jit
    def quant_tile(x, NBLK: tl.constexpr):
        """float32 [NBLK, 32] -> (int32 words [NBLK, 8], d [NBLK], 16-sums d·Σq [NBLK, 2]) (module rule)."""
        amax = tl.max(tl.abs(x), axis=1)
        d = tl.math.div_rn(amax, tl.full([NBLK], 127.0, tl.float32))
        v = tl.math.div_rn(x, tl.broadcast_to(tl.where(d > 0, d, 1.0)[:, None], [NBLK, 32]))  # d = 0: q = 0
        q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32)
        q = tl.where(d[:, None] > 0, q, 0)
        sh = tl.arange(0, 4) * 8
        words = tl.sum((tl.reshape(q, [NBLK, 8, 4]) & 0xFF) << sh[None, None, :], axis=2)  # disjoint bits: sum = or
        s = tl.sum(tl.reshape(q, [NBLK, 2, 16]), axis=2).to(tl.float32) * d[:, None]
        return words, d, s

    @triton.jit
    def store_q8(XQ, XD, XS, row, blk, bm, words, d, s, n32):
        """Store quant_tile's outputs for 32-blocks blk [NBLK] (mask bm) of row ``row``."""
        r = row.to(tl.int64)
        tl.store(XQ + r * (8 * n32) + blk[:, None] * 8 + tl.arange(0, 8)[None, :], words, mask=bm[:, None])
        tl.store(XD + r * n32 + blk, d, mask=bm)
        tl.store(XS + r * (2 * n32) + blk[:, None] * 2 + tl.arange(0, 2)[None, :], s, mask=bm[:, None])

    @triton.jit
    def _quant_kernel(X, XQ, XD, XS, n32, NBLK: tl.constexpr, PDL: tl.constexpr):
        qb.pdl_enter(PDL)
        r = tl.program_id(1)
        blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
        bm = blk < n32
        x = tl.load(X + r.to(tl.int64) * (32 * n32) + blk[:, None] * 32 + tl.arange(0, 32)[None, :],
                    mask=bm[:, None], other=0.0)  # fmt: skip
        words, d, s = quant_tile(x, NBLK)
        store_q8(XQ, XD, XS, r, blk, bm, words, d, s, n32)


def quantize_act(X: torch.Tensor, nblk: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X float32 [R, n] (n a multiple of 32) -> (XQ int32 [R, n/4], XD float32 [R, n/32], XS float32 [R, n/16])."""
    R, n = X.shape
    n32 = n // QBLK
    XQ = torch.empty((R, n // 4), dtype=torch.int32, device=X.device)
    XD = torch.empty((R, n32), dtype=torch.float32, device=X.device)
    XS = torch.empty((R, 2 * n32), dtype=torch.float32, device=X.device)
    pdl = qb.pdl(X.device)
    _quant_kernel[(triton.cdiv(n32, nblk), R)](
        X.contiguous(), XQ, XD, XS, n32, NBLK=nblk, PDL=pdl, num_warps=1, **qb.launch_kw(pdl)
    )
    return XQ, XD, XS


def unpack_words(XQ: torch.Tensor) -> torch.Tensor:
    """int32 [R, n/4] packed codes -> int8 [R, n] (little-endian bytes)."""
    return XQ.contiguous().view(torch.int8).reshape(XQ.shape[0], -1)
