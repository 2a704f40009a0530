"""Fused routed-expert decode with integer (dp4a) products and q8 activations (triton_q8).

:func:`moe_decode_q8` has the contract of :func:`engine.runtime.triton_moe.moe_decode` (which calls
it in q8 mode): x is quantized once (``triton_q8.quantize_act``), ``_q8_gate_up_kernel``
computes ``h = SiLU(gate·x) · (up·x)`` for a tile of 32·j rows of one (token, expert) pair and
quantizes it on the spot (a tile holds whole 32-blocks of h), ``_q8_down_kernel`` sums
``w_k · down_k · h_k`` over the token's experts. Deterministic (no atomics); slot offset −1 skips
the pair. ``engine.runtime.references.moe_decode_q8_reference``: torch, with x and h rounded through the same q8 rule.
"""

from __future__ import annotations

import torch

from engine.quant.formats import QType, block_format
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl


def geo(qtype: QType, suffix: str = "") -> dict:
    return {k + suffix: v for k, v in t8.q8_geometry(qtype).items()}


if triton is not None:

    @triton.jit
    def _q8_gate_up_kernel(
        W, W32, SLOT, XQ, XD, XS, HQ, HD, HS, F, nx32, K, go, uo, g_row_bytes, u_row_bytes, g_nb, u_nb,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, NW: tl.constexpr, NA: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr,
        QTu: tl.constexpr, TSu: tl.constexpr, QKu: tl.constexpr, NWu: tl.constexpr, NAu: tl.constexpr,
        NPARTu: tl.constexpr,
        ALIGNu: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, STEPS: tl.constexpr, STEPSu: tl.constexpr,
        ASM: tl.constexpr, QH: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Hq[q, rows] = q8(SiLU(gate_q[rows]·x_t) · (up_q[rows]·x_t)) for pair q = t·K + k (slot SLOT[q]).
        QH (BR a multiple of 32): h quantized here; else h float32 into HD [T·K, F] (quantized after)."""
        qb.pdl_enter(PDL)  # SLOT comes from the routing kernel (the down kernel may read it once released)
        q = tl.program_id(1)
        slot = tl.load(SLOT + q)
        if slot != -1:
            rows = tl.program_id(0) * BR + tl.arange(0, BR)
            rmask = rows < F
            base = tl.multiple_of(slot, 16)
            xr = (q // K).to(tl.int64) + tl.zeros([1], dtype=tl.int64)
            ok = xr >= 0
            one = tl.full([1], 1.0, tl.float32)
            ga = tl.zeros([1, BR, NB, NA], dtype=tl.float32)
            gb = tl.zeros([1, BR, NB], dtype=tl.float32)
            ga, gb = t8.walk(ga, gb, W, W32, base + go + rows.to(tl.int64) * g_row_bytes, rmask, 0, g_nb, XQ, XD, XS,
                             xr, nx32, ok, one, QT, TS, QK, NW, ALIGN, NB, STEPS, ASM)  # fmt: skip
            ua = tl.zeros([1, BR, NB, NAu], dtype=tl.float32)
            ub = tl.zeros([1, BR, NB], dtype=tl.float32)
            ua, ub = t8.walk(ua, ub, W, W32, base + uo + rows.to(tl.int64) * u_row_bytes, rmask, 0, u_nb, XQ, XD, XS,
                             xr, nx32, ok, one, QTu, TSu, QKu, NWu, ALIGNu, NB, STEPSu, ASM)  # fmt: skip
            g = tl.sum(tl.sum(tl.sum(ga, axis=3), axis=2) + tl.sum(gb, axis=2), axis=0)  # [BR]
            u = tl.sum(tl.sum(tl.sum(ua, axis=3), axis=2) + tl.sum(ub, axis=2), axis=0)
            h = tl.where(rmask, g / (1.0 + tl.exp(-g)) * u, 0.0)  # ggml_swiglu_split
            if QH:
                NBLK: tl.constexpr = BR // 32
                words, d, s = t8.quant_tile(tl.reshape(h, [NBLK, 32]), NBLK)
                blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
                t8.store_q8(HQ, HD, HS, q, blk, blk * 32 < F, words, d, s, F // 32)
            else:
                tl.store(HD + q.to(tl.int64) * F + rows, h, mask=rmask)

    @triton.jit
    def _q8_down_pair(acc, accb, W, W32, SLOT, HQ, HD, HS, WT, t, k, rows, rmask, nh32, do, row_bytes, nb,
                      K: tl.constexpr, QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, NW: tl.constexpr,
                      ALIGN: tl.constexpr, NB: tl.constexpr, STEPS: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
        """acc/accb += WT[t, k] · down_{t,k}[rows] · Hq[t·K + k] (nothing when k ≥ K or the pair has no slot)."""
        q = t * K + k
        slot = tl.load(SLOT + q, mask=k < K, other=-1)
        wt = tl.load(WT + q, mask=k < K, other=0.0)
        kb1 = tl.where(slot != -1, nb, 0)
        rowoff = tl.multiple_of(tl.where(slot != -1, slot, 0), 16) + do + rows.to(tl.int64) * row_bytes
        xr = q.to(tl.int64) + tl.zeros([1], dtype=tl.int64)
        return t8.walk(acc, accb, W, W32, rowoff, rmask, 0, kb1, HQ, HD, HS, xr, nh32, xr >= 0,
                       wt + tl.zeros([1], dtype=tl.float32), QT, TS, QK, NW, ALIGN, NB, STEPS, ASM)  # fmt: skip

    @triton.jit
    def _q8_down_kernel(
        W, W32, SLOT, HQ, HD, HS, WT, Y, D, nh32, do, row_bytes, nb, K: tl.constexpr,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, NW: tl.constexpr, NA: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, KSPLIT: tl.constexpr, STEPS: tl.constexpr,
        ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr,
    ):  # fmt: skip
        """Y[g, t, rows] = Σ_k WT[t, k] · down_{t,k}[rows] · Hq[t·K + k], k in group g of KSPLIT (as triton_moe)."""
        t = tl.program_id(1)
        g = tl.program_id(2)
        r0 = tl.program_id(0) * BR
        rows = r0 + tl.arange(0, BR)
        rmask = rows < D
        PER: tl.constexpr = (K + KSPLIT - 1) // KSPLIT
        if PF:  # as triton_moe._down_kernel: SLOT is final once the gate/up kernel released this one
            qb.prefetch_pairs(W, SLOT, t, g * PER, D, r0, do, row_bytes, K, PER, BR, NT)
        qb.pdl_enter(PDL)
        acc = tl.zeros([1, BR, NB, NA], dtype=tl.float32)
        accb = tl.zeros([1, BR, NB], dtype=tl.float32)
        # A runtime loop over the experts: unrolling 4 of them made ptxas spill (sm_90, 255 registers)
        # and compile for minutes; the K walk inside each (STEPS) stays unrolled.
        for j in range(PER):
            acc, accb = _q8_down_pair(acc, accb, W, W32, SLOT, HQ, HD, HS, WT, t, g * PER + j, rows, rmask, nh32, do,
                                      row_bytes, nb, K, QT, TS, QK, NW, ALIGN, NB, STEPS, ASM)  # fmt: skip
        y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2) + tl.sum(accb, axis=2), axis=0)
        T = tl.num_programs(1)
        tl.store(Y + (g * T + t).to(tl.int64) * D + rows, y, mask=rmask)


def moe_decode_q8(pool, slot_off, x, weights, roles, cfg_gate_up: dict, cfg_down: dict) -> torch.Tensor:
    """triton_moe.moe_decode's contract, integer kernels (F a multiple of 32)."""
    T, K = slot_off.shape
    (go, gq, F, D), (uo, uq, _, _), (do, dq, _, _) = (roles[r] for r in ("gate", "up", "down"))
    gq, uq, dq = QType(gq), QType(uq), QType(dq)
    asm = t8.use_asm(x.device)
    pdl = qb.pdl(x.device)
    slots = slot_off.reshape(-1).contiguous()
    XQ, XD, XS = t8.quantize_act(x)
    c = cfg_gate_up
    qh = c["BR"] % 32 == 0  # the tile holds whole 32-blocks of h: quantize them in place
    if qh:
        HQ = torch.empty((T * K, F // 4), dtype=torch.int32, device=x.device)
        HD = torch.empty((T * K, F // 32), dtype=torch.float32, device=x.device)
        HS = torch.empty((T * K, F // 16), dtype=torch.float32, device=x.device)
    else:  # h in float, quantized by one more launch (smaller gate/up tiles: more programs); zeros: a skipped
        HQ = HS = (
            XQ  # pair's row is never written, and quantizing uninitialised floats may overflow (the interpreter raises)
        )
        HD = torch.zeros((T * K, F), dtype=torch.float32, device=x.device)
    g_nb, u_nb, lim = D // qb.GEOMETRY[gq][1], D // qb.GEOMETRY[uq][1], c.get("UNROLL", qb.UNROLL)
    pool = pool.reshape(-1)
    w32 = t8.int32_view(pool)
    _q8_gate_up_kernel[(triton.cdiv(F, c["BR"]), T * K)](
        pool, w32, slots, XQ, XD, XS, HQ, HD, HS, F, D // 32, K, go, uo, block_format(gq).row_bytes(D),
        block_format(uq).row_bytes(D), g_nb, u_nb, BR=c["BR"], NB=c["NB"], STEPS=qb.steps(g_nb, c["NB"], lim),
        STEPSu=qb.steps(u_nb, c["NB"], lim), ASM=asm, QH=qh, PDL=pdl, num_warps=c["num_warps"], **geo(gq),
        **geo(uq, "u"), **qb.launch_kw(pdl),
    )  # fmt: skip
    if not qh:
        HQ, HD, HS = t8.quantize_act(HD)  # rows of skipped pairs are 0: the down kernel skips them too
    c = cfg_down
    ks = max(1, min(c.get("KSPLIT", 1), K))
    Y = torch.empty((ks, T, D), dtype=torch.float32, device=x.device)
    d_nb = F // qb.GEOMETRY[dq][1]
    _q8_down_kernel[(triton.cdiv(D, c["BR"]), T, ks)](
        pool, w32, slots, HQ, HD, HS, weights.to(torch.float32).contiguous(), Y, D, F // 32, do,
        block_format(dq).row_bytes(F), d_nb, K=K, BR=c["BR"], NB=c["NB"], KSPLIT=ks,
        STEPS=qb.steps(d_nb, c["NB"], c.get("UNROLL", qb.UNROLL)), ASM=asm, PDL=pdl, PF=qb.prefetch(pdl), NT=32 * c["num_warps"],
        num_warps=c["num_warps"], **geo(dq), **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y[0] if ks == 1 else Y.sum(0)
