"""Lean routed-expert (MoE) decode kernels: Q4_K weights, q8 activations (triton_q8's format), in the
style of q4k_lean.py — whole rows a program, block headers as words with compile-time byte positions,
dp4a chained through its accumulate operand, weights read as int32 words of the slot pool.

The bench's decode step (engine.bench.device_kernels.moe_workload): one token, K = 8 (token, expert)
pairs, gate/up [F, D] = [768, 2048], down [D, F], all Q4_K in one slot pool; slot offset −1 skips a pair.

- ``gate_up_kernel``, grid (F/BR, T·K): h[q, rows] = SiLU(gate_q[rows]·x) · (up_q[rows]·x), x given
  quantized (XQ, XD, XS). It waits (PDL) before reading the slot table. Variant "A" stores h as float32
  [T·K, F] (one more ``triton_q8.quantize_act`` launch quantizes it); variant "B" (BR a multiple of 32)
  quantizes its 32-blocks of h on the spot (``triton_q8.quant_tile`` / ``store_q8``, the same rounding
  rule as ``quantize_act_reference``). GS=1 puts gate and up blocks on separate threads (twice the
  threads). PF: one thread prefetches the program's gate and up rows into L2 once the slot is known.
- ``down_kernel``, grid (D/BR, T): y[rows] = Σ_k w_k · down_k[rows]·h_k; its experts' rows are
  prefetched into L2 before its PDL wait (as in triton_q8_moe). A row is 3 blocks. KT=0: a
  ``static_range`` over the K experts, the row's blocks on 4 lanes (the 4th repeats the 3rd and is
  dropped); KT=1: the K experts on a tensor axis, a ``static_range`` over the row's 3 blocks; KT=2:
  experts × 4 block lanes on one axis, one block a thread (the most threads).

Layout: a thread owns whole Q4_K blocks (a tensor [blocks or experts, rows] of block pointers, the first
axis on the fastest lanes, so sums over it stay inside a warp and a thread's rows share their activation
loads). Per block it loads the 16-byte header (d, dmin, 12 scale bytes as 4 words), 8 × 16 bytes of
quants, the activation block's scales XD (2 × 16 bytes) and 16-sums XS (4 × 16 bytes); the 16 6-bit
scales and mins come from 4 words (3 LOP3/SHF) and one PRMT each; the high nibbles go to dp4a as
``w & 0xF0F0F0F0`` (16 × the code, one LOP3 instead of a shift and a LOP3; the 1/16 is applied once a
block); the integer sum of a sub-block is multiplied by its integer scale (IMAD); d and dmin come in
once at the end of the block. No masks: a skipped pair's h is written as 0 by the gate/up kernel, and
the down kernel reads slot 0's rows for it (a wasted read on the rare skip, an exact 0 contribution).

Parity (Triton's interpreter) against triton_q8_moe.moe_decode_q8_reference; static sm_90 profile with
Triton 3.6's ptxas (/tmp/lab/sassprof.py, dumps under /tmp/moe_lean/); on a GPU, CUDA-graph timings
beside triton_moe.moe_decode f32 / q8. Run from the repository root:
  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_lean.py [quick]   # parity, no GPU
  PYTHONPATH=/tmp/t36:. python3 packaging/gpu_labs/moe_lean.py sass                # static profile
  PYTHONPATH=. python3 packaging/gpu_labs/moe_lean.py                              # GPU timings (~4 min)
"""
# ruff: noqa: B023, E702, E401, E731

import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

from engine.quant.formats import QType, block_format
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

Q = QType.Q4_K


# -- building blocks: whole blocks a thread (engine.runtime.triton_q4k_moe grew out of this lab and now
# gives a thread half a block; its dp4a chain and byte helpers are shared) ----------------------------
from engine.runtime import triton_q4k_moe as q4  # noqa: E402


@triton.jit
def _load_block(P):
    """The Q4_K blocks at int32 pointers P [A, B] (16-byte aligned): the header [A, B, 4] and the 8
    16-byte quarters of the quants, one 16-byte load each."""
    p = P[:, :, None] + tl.arange(0, 4)[None, None, :]
    return (tl.load(p), tl.load(p + 4), tl.load(p + 8), tl.load(p + 12), tl.load(p + 16), tl.load(p + 20),
            tl.load(p + 24), tl.load(p + 28), tl.load(p + 32))  # fmt: skip


@triton.jit
def _dot_block(blk, X, XDp, XSp, ASM: tl.constexpr):
    """Dot products [A, B] of the loaded blocks blk (_load_block) with the q8 activation blocks at X
    (int32 pointers [A, B] to the block's 64 XQ words), XDp (its 8 scales), XSp (its 16 half-sums)."""
    m = tl.arange(0, 4)[None, None, :]
    hdr0, s0, s1, s2 = q4._w4(blk[0])
    # get_scale_min_k4 of 4 sub-blocks at once: byte j of a word is sub-block j's (or 4 + j's) value
    sc_lo = s0 & 0x3F3F3F3F
    mn_lo = s1 & 0x3F3F3F3F
    sc_hi = (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030)
    mn_hi = ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030)
    d = (hdr0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((hdr0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    pd = XDp[:, :, None] + m
    dx = q4._w4(tl.load(pd)) + q4._w4(tl.load(pd + 4))  # the 8 sub-blocks' activation scales
    ps = XSp[:, :, None] + m
    sv = (
        q4._w4(tl.load(ps)) + q4._w4(tl.load(ps + 4)) + q4._w4(tl.load(ps + 8)) + q4._w4(tl.load(ps + 12))
    )  # 16 half-sums
    px = X[:, :, None] + m
    zi = tl.zeros(d.shape, dtype=tl.int32)
    alo = tl.zeros(d.shape, dtype=tl.float32)
    ahi = tl.zeros(d.shape, dtype=tl.float32)
    amn = tl.zeros(d.shape, dtype=tl.float32)
    for c in tl.static_range(4):
        qa = blk[1 + 2 * c]  # quant bytes 0..15 of chunk c: elements 0..15 of sub-blocks 2c (low), 2c+1 (high)
        qz = blk[2 + 2 * c]  # bytes 16..31: elements 16..31
        # activation words: sub-block 2c is words 16c … 16c + 7 of the block, 2c + 1 the next 8
        ia = q4._chain(qa & 0x0F0F0F0F, tl.load(px + 16 * c), zi, ASM)
        ia = q4._chain(qz & 0x0F0F0F0F, tl.load(px + (16 * c + 4)), ia, ASM)
        ib = q4._chain(qa & -0x0F0F0F10, tl.load(px + (16 * c + 8)), zi, ASM)  # 0xF0F0F0F0: 16 × the code
        ib = q4._chain(qz & -0x0F0F0F10, tl.load(px + (16 * c + 12)), ib, ASM)
        if c < 2:
            scw = sc_lo
            mnw = mn_lo
        else:
            scw = sc_hi
            mnw = mn_hi
        sca = q4._byte(scw, (2 * c) % 4, ASM)
        scb = q4._byte(scw, (2 * c + 1) % 4, ASM)
        mna = q4._byte(mnw, (2 * c) % 4, ASM)
        mnb = q4._byte(mnw, (2 * c + 1) % 4, ASM)
        alo += (ia * sca).to(tl.float32) * dx[2 * c]
        ahi += (ib * scb).to(tl.float32) * dx[2 * c + 1]
        amn += mna.to(tl.float32) * (sv[4 * c] + sv[4 * c + 1]) + mnb.to(tl.float32) * (sv[4 * c + 2] + sv[4 * c + 3])
    return d * (alo + ahi * 0.0625) - dmin * amn


@triton.jit
def _prefetch(W, start, nbytes):
    """cp.async.bulk.prefetch.L2 of bytes [start, start + nbytes) of W (both multiples of 16; nbytes = 0: none),
    one per element — qb.prefetch_l2 with the range per thread (K ranges in one instruction, not K) and
    without its alignment arithmetic (the slot pool's rows are 16-byte aligned)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred q; setp.ne.u32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [W + start, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


# -- kernels -----------------------------------------------------------------------------------
@triton.jit
def gate_up_kernel(W, W32, SLOT, XQ, XD, XS, HQ, HD, HS, go, uo,
                   F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, BR: tl.constexpr, QH: tl.constexpr,
                   GS: tl.constexpr, HOIST: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
                   NT: tl.constexpr):  # fmt: skip
    """h[q, rows] = SiLU(gate_q[rows]·x_t) · (up_q[rows]·x_t), pair q = t·K + k at slot SLOT[q] (bytes; −1:
    h = 0, so the down kernel needs no masks); gate/up at byte offsets go/uo of the slot, NB blocks a row.
    QH: h quantized into HQ/HD/HS (BR a multiple of 32); else float32 into HD [T·K, F]. F % BR == 0.
    GS=0: [NB, BR] tiles, a thread holds the gate and the up block of its (block, row) and loads x once for
    both; GS=1: one [2·NB, BR] tile over both matrices, a thread holds one block (twice the threads).
    PF: one thread prefetches the program's gate and up rows into L2 once the slot is known (loads that
    ptxas schedules after the first math then hit L2)."""
    qb.pdl_enter(PDL)  # SLOT comes from the routing kernel
    q = tl.program_id(1)
    slot = tl.load(SLOT + q)
    r0 = tl.program_id(0) * BR
    if slot >= 0:
        if PF:  # thread 0: the gate rows, thread 1: the up rows
            i = tl.arange(0, NT)
            _prefetch(W, slot + tl.where(i == 0, go, uo) + r0 * (144 * NB), tl.where(i < 2, BR * 144 * NB, 0))
        rows = r0 + tl.arange(0, BR)
        t = q // K
        # blocks on the fastest lanes (the block sum stays in the warp), a thread's rows share the x loads
        if GS:
            e = tl.arange(0, 2 * NB)
            b = e % NB
            zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
            base = tl.multiple_of((slot + tl.where(e < NB, go, uo)) // 4 + b * 36, 4)  # [2·NB] words
            P = W32 + (base[:, None] + (rows * (36 * NB))[None, :])
            X = XQ + t * (64 * NB) + (zp + b[:, None] * 64)
            XDp = XD + t * (8 * NB) + (zp + b[:, None] * 8)
            XSp = XS + t * (16 * NB) + (zp + b[:, None] * 16)
            v = _dot_block(_load_block(P), X, XDp, XSp, ASM)
            g = tl.sum(tl.where((e < NB)[:, None], v, 0.0), axis=0)
            u = tl.sum(tl.where((e >= NB)[:, None], v, 0.0), axis=0)
        else:
            b = tl.arange(0, NB)
            off = tl.multiple_of(b[:, None] * 36 + rows[None, :] * (36 * NB), [4, 4])  # [NB, BR] words
            G = W32 + tl.multiple_of((slot + go) // 4, 4) + off
            U = W32 + tl.multiple_of((slot + uo) // 4, 4) + off
            zp = tl.zeros([NB, BR], dtype=tl.int32)
            X = XQ + t * (64 * NB) + (zp + b[:, None] * 64)
            XDp = XD + t * (8 * NB) + (zp + b[:, None] * 8)
            XSp = XS + t * (16 * NB) + (zp + b[:, None] * 16)
            if HOIST:  # both matrices' loads first (program order)
                gb = _load_block(G)
                ub = _load_block(U)
                g = _dot_block(gb, X, XDp, XSp, ASM)
                u = _dot_block(ub, X, XDp, XSp, ASM)
            else:
                g = _dot_block(_load_block(G), X, XDp, XSp, ASM)
                u = _dot_block(_load_block(U), X, XDp, XSp, ASM)
            g = tl.sum(g, axis=0)
            u = tl.sum(u, axis=0)
        h = g / (1.0 + tl.exp(-g)) * u  # ggml_swiglu_split
    else:
        h = tl.zeros([BR], dtype=tl.float32)
    if QH:
        NBLK: tl.constexpr = BR // 32
        words, d, s = t8.quant_tile(tl.reshape(h, [NBLK, 32]), NBLK)
        blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
        t8.store_q8(HQ, HD, HS, q, blk, blk < F // 32, words, d, s, F // 32)
    else:
        tl.store(HD + q.to(tl.int64) * F + r0 + tl.arange(0, BR), h)


@triton.jit
def down_kernel(W, W32, SLOT, HQ, HD, HS, WT, Y, do,
                D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr, BR: tl.constexpr, KT: tl.constexpr,
                ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Y[t, rows] = Σ_k WT[t, k] · down_{t,k}[rows] · hq[t·K + k], down at byte offset do of the slot, NBF
    blocks a row; D % BR == 0. No masks: a skipped pair (slot −1) reads slot 0's rows against its h = 0.
    KT=0: static_range over the experts, [NBP, BR] tiles (a row's NBF blocks on NBP = next_power_of_2(NBF)
    lanes, the extra lanes repeat the last block and are dropped); KT=1: [K, BR], the experts on the lanes,
    static_range over the row's blocks; KT=2: [K·NBP, BR], experts × block lanes (a thread one block a row)."""
    t = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    RW: tl.constexpr = 36 * NBF  # words a row
    if PF:  # SLOT is final once the previous kernel released this one; thread k < K: expert k's rows
        i = tl.arange(0, NT)
        sl = tl.load(SLOT + t * K + i % K)
        _prefetch(W, tl.maximum(sl, 0) + do + r0 * (RW * 4), tl.where((i < K) & (sl >= 0), BR * RW * 4, 0))
    qb.pdl_enter(PDL)
    rows = r0 + tl.arange(0, BR)
    if KT == 1:  # experts on a tensor axis, [K, BR] (experts on the fastest lanes), the row's blocks one after another
        k = tl.arange(0, K)
        q = t * K + k
        slot = tl.load(SLOT + q)
        wk = tl.load(WT + q)
        zp = tl.zeros([K, BR], dtype=tl.int32)
        P = W32 + (tl.multiple_of((tl.maximum(slot, 0) + do) // 4, 4)[:, None] + (rows * RW)[None, :])
        X = HQ + (zp + (q * (64 * NBF))[:, None])
        XDp = HD + (zp + (q * (8 * NBF))[:, None])
        XSp = HS + (zp + (q * (16 * NBF))[:, None])
        acc = tl.zeros([K, BR], dtype=tl.float32)
        for bb in tl.static_range(NBF):
            acc += _dot_block(_load_block(P + 36 * bb), X + 64 * bb, XDp + 8 * bb, XSp + 16 * bb, ASM)
        y = tl.sum(acc * wk[:, None], axis=0)
    elif KT == 2:  # experts × block lanes on one tensor axis, [K·NBP, BR]
        NBP2: tl.constexpr = triton.next_power_of_2(NBF)
        e = tl.arange(0, K * NBP2)
        lane = e % NBP2
        lc = tl.minimum(lane, NBF - 1)
        q = t * K + e // NBP2
        slot = tl.load(SLOT + q)
        wk = tl.where(lane < NBF, tl.load(WT + q), 0.0)
        zp = tl.zeros([K * NBP2, BR], dtype=tl.int32)
        P = W32 + (tl.multiple_of((tl.maximum(slot, 0) + do) // 4 + lc * 36, 4)[:, None] + (rows * RW)[None, :])
        X = HQ + (zp + (q * (64 * NBF) + lc * 64)[:, None])
        XDp = HD + (zp + (q * (8 * NBF) + lc * 8)[:, None])
        XSp = HS + (zp + (q * (16 * NBF) + lc * 16)[:, None])
        y = tl.sum(_dot_block(_load_block(P), X, XDp, XSp, ASM) * wk[:, None], axis=0)
    else:  # static loop over the experts, a row's blocks on NBP lanes (lanes ≥ NBF repeat block NBF − 1, dropped)
        NBP: tl.constexpr = triton.next_power_of_2(NBF)
        lane = tl.arange(0, NBP)
        lc = tl.minimum(lane, NBF - 1)
        zp = tl.zeros([NBP, BR], dtype=tl.int32)
        off = zp + (rows * RW)[None, :] + (lc * 36)[:, None]
        acc = tl.zeros([NBP, BR], dtype=tl.float32)
        for j in tl.static_range(K):
            q = t * K + j
            slot = tl.load(SLOT + q)
            wk = tl.load(WT + q)
            P = W32 + tl.multiple_of((tl.maximum(slot, 0) + do) // 4, 4) + off
            X = HQ + q * (64 * NBF) + (zp + (lc * 64)[:, None])
            XDp = HD + q * (8 * NBF) + (zp + (lc * 8)[:, None])
            XSp = HS + q * (16 * NBF) + (zp + (lc * 16)[:, None])
            acc += wk * _dot_block(_load_block(P), X, XDp, XSp, ASM)
        y = tl.sum(tl.where((lane < NBF)[:, None], acc, 0.0), axis=0)
    tl.store(Y + t * D + rows, y)


# -- host --------------------------------------------------------------------------------------
def _geometry(roles):
    (go, gq, F, D), (uo, uq, _, _), (do, dq, _, _) = (roles[r] for r in ("gate", "up", "down"))
    assert QType(gq) == QType(uq) == QType(dq) == Q and D % 256 == 0 and F % 256 == 0
    assert go % 16 == uo % 16 == do % 16 == 0
    return go, uo, do, F, D


def gate_up(pool, pool32, slots, xq, roles, K, BR, warps, variant, gs=0, hoist=1, pf=None, asm=None, pdl=None):
    """-> (HQ, HD, HS) of h (variant "B": quantized in the kernel) or h float32 [T·K, F] (variant "A")."""
    go, uo, _, F, D = _geometry(roles)
    XQ, XD, XS = xq
    dev = XQ.device
    n = slots.numel()
    asm = t8.use_asm(dev) if asm is None else asm
    pdl = qb.pdl(dev) if pdl is None else pdl
    qh = variant == "B"
    assert F % BR == 0 and (not qh or BR % 32 == 0), (variant, BR)
    if qh:
        HQ = torch.empty((n, F // 4), dtype=torch.int32, device=dev)
        HD = torch.empty((n, F // 32), dtype=torch.float32, device=dev)
        HS = torch.empty((n, F // 16), dtype=torch.float32, device=dev)
    else:
        HQ = HS = XQ
        HD = torch.empty((n, F), dtype=torch.float32, device=dev)
    pf = int(asm) if pf is None else pf  # the bulk L2 prefetch is inline PTX: compiled CUDA only
    gate_up_kernel[(F // BR, n)](
        pool, pool32, slots, XQ, XD, XS, HQ, HD, HS, go, uo, F=F, K=K, NB=D // 256, BR=BR, QH=int(qh), GS=gs,
        HOIST=hoist, ASM=asm, PDL=pdl, PF=pf, NT=32 * warps, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return (HQ, HD, HS) if qh else HD


def down(pool, pool32, slots, hq, weights, roles, K, BR, warps, kt=1, asm=None, pdl=None):
    """-> Y float32 [T, D]."""
    _, _, do, F, D = _geometry(roles)
    HQ, HD, HS = hq
    dev = HQ.device
    T = slots.numel() // K
    asm = t8.use_asm(dev) if asm is None else asm
    pdl = qb.pdl(dev) if pdl is None else pdl
    assert D % BR == 0
    Y = torch.empty((T, D), dtype=torch.float32, device=dev)
    down_kernel[(D // BR, T)](
        pool, pool32, slots, HQ, HD, HS, weights, Y, do, D=D, K=K, NBF=F // 256, BR=BR, KT=kt, ASM=asm,
        PDL=pdl, PF=qb.prefetch(pdl), NT=32 * warps, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def moe_lean_q(pool, slot_off, xq, weights, roles, BRg=8, wg=2, BRd=8, wd=1, variant="A", kt=1, gs=0, hoist=1,
               pf=None, asm=None, pdl=None):  # fmt: skip
    """triton_moe.moe_decode's contract with x given quantized (triton_q8.quantize_act(x)) -> float32 [T, D]."""
    T, K = slot_off.shape
    pool = pool.reshape(-1)
    pool32 = pool.view(torch.int32)
    slots = slot_off.reshape(-1).contiguous()
    h = gate_up(pool, pool32, slots, xq, roles, K, BRg, wg, variant, gs, hoist, pf, asm, pdl)
    if variant == "A":
        h = t8.quantize_act(h)
    return down(pool, pool32, slots, h, weights.to(torch.float32).contiguous(), roles, K, BRd, wd, kt, asm, pdl)


def moe_lean(pool, slot_off, x, weights, roles, BRg=8, wg=2, BRd=8, wd=1, variant="A", kt=1, gs=0, hoist=1,
             pf=None, asm=None, pdl=None):  # fmt: skip
    """triton_moe.moe_decode's contract (x float32 [T, D]) -> float32 [T, D]."""
    return moe_lean_q(pool, slot_off, t8.quantize_act(x), weights, roles, BRg, wg, BRd, wd, variant, kt, gs, hoist,
                      pf, asm, pdl)  # fmt: skip


# -- configs -----------------------------------------------------------------------------------
# gate/up: a thread holds BR·NB/(32·warps) (block, row) pairs of both matrices (NB = D/256 = 8); gs=1: of one
# matrix. Variant "B" needs BR % 32 == 0. pf=0: no L2 prefetch of the program's rows (default: on, compiled).
GATE_UP = [dict(variant="A", BRg=4, wg=1), dict(variant="A", BRg=8, wg=2), dict(variant="A", BRg=8, wg=1),
           dict(variant="A", BRg=2, wg=1, gs=1), dict(variant="A", BRg=4, wg=1, pf=0),
           dict(variant="B", BRg=32, wg=8), dict(variant="B", BRg=32, wg=4, hoist=0),
           dict(variant="B", BRg=32, wg=8, gs=1)]  # fmt: skip
# down: kt=1: a thread holds BR·K/(32·warps) (expert, row) pairs, 3 blocks each; kt=2: BR·4K/(32·warps)
# (expert, block lane, row) triples, one block each (a quarter of the lanes repeat a block); kt=0: the
# static loop over the experts, BR·4/(32·warps) (block lane, row) pairs of each expert.
DOWN = [dict(kt=1, BRd=4, wd=1), dict(kt=1, BRd=8, wd=1), dict(kt=1, BRd=8, wd=2), dict(kt=2, BRd=1, wd=1),
        dict(kt=2, BRd=2, wd=1), dict(kt=2, BRd=4, wd=1), dict(kt=0, BRd=8, wd=1), dict(kt=0, BRd=32, wd=4)]  # fmt: skip
GU0, DN0 = GATE_UP[5], DOWN[0]  # each config's partner in the combined timings


def gu_name(c):
    return (f"{c['variant']} BR{c['BRg']} w{c['wg']}" + (" gs" if c.get("gs") else "")
            + (" no-hoist" if c.get("hoist", 1) == 0 else "") + (" no-PF" if c.get("pf") == 0 else ""))  # fmt: skip


def dn_name(c):
    return f"KT{c['kt']} BR{c['BRd']} w{c['wd']}"


def _pool(F, D, slots, gen):
    """device_kernels._slot_pool on the CPU: random Q4_K blocks with its realistic scale fields."""
    from engine.bench.device_kernels import _fill_fields

    roles, off = {}, 0
    for r, (rows, n) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
        roles[r] = (off, Q, rows, n)
        off += -(-rows * block_format(Q).row_bytes(n) // 256) * 256
    pool = torch.zeros((slots, off), dtype=torch.uint8)
    for o, q, rows, n in roles.values():
        nb = rows * block_format(q).row_bytes(n)
        raw = torch.randint(0, 256, (slots, nb), dtype=torch.uint8, generator=gen)
        _fill_fields(raw.view(-1, 144), q, 1.0 / math.sqrt(n))
        pool[:, o : o + nb] = raw
    return pool, off, roles


def parity(full=True):
    """The interpreter (TRITON_INTERPRET=1) against triton_q8_moe.moe_decode_q8_reference. It runs a program at a
    time (~0.3 s each), so: the gate/up configs on F = 256, D = 512, the down configs on F = 768 (rows of 3
    blocks), D = 256, both with T = 2 tokens, K = 2 experts and one pair skipped; with ``full`` also two
    combinations on the bench's shapes (F = 768, D = 2048, T = 1, K = 8; minutes each)."""
    from engine.runtime.triton_q8_moe import moe_decode_q8_reference

    gen = torch.Generator().manual_seed(0)
    cases = [(256, 512, 2, 2, [(gu, DN0) for gu in GATE_UP]), (768, 256, 2, 2, [(GU0, dn) for dn in DOWN])]
    if full:
        cases.append((768, 2048, 1, 8, [(GATE_UP[5], DOWN[1]), (GATE_UP[6], DOWN[2])]))
    worst = 0.0
    for F, D, T, K, cfgs in cases:
        pool, stride, roles = _pool(F, D, 3 * K, gen)
        offs = torch.stack([torch.randperm(3 * K, generator=gen)[:K] for _ in range(T)]) * stride
        if T > 1:
            offs[1, K - 1] = -1  # a skipped pair (a cache miss computed elsewhere)
        x = torch.randn(T, D, generator=gen)
        w = torch.rand(T, K, generator=gen)
        ref = moe_decode_q8_reference(pool, offs, x, w, roles).double()
        for gu, dn in cfgs:
            t0 = time.time()
            y = moe_lean(pool, offs, x, w, roles, **gu, **dn, asm=False, pdl=0).double()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err)
            print(f"F{F} D{D} T{T} K{K}: gate/up {gu_name(gu):22} | down {dn_name(dn):13}: max|y - ref|/max|ref| "
                  f"= {err:.1e}  ({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    print(f"worst {worst:.1e}", "OK" if worst <= 1e-5 else "FAIL", flush=True)


def sass(F=768, D=2048, K=8):
    """Static sm_90 profile (Triton 3.6's ptxas via /tmp/lab/sassprof.py): registers, stack, SASS instructions a
    thread times threads / weight bytes of the program, the instruction mix; dumps under /tmp/moe_lean/."""
    sys.path.insert(0, "/tmp/lab")
    from sassprof import build, load_order, show

    os.makedirs("/tmp/moe_lean", exist_ok=True)
    for c in GATE_UP:
        BR, w = c["BRg"], c["wg"]
        sig = dict(W="*u8", W32="*i32", SLOT="*i64", XQ="*i32", XD="*fp32", XS="*fp32", HQ="*i32", HD="*fp32",
                   HS="*fp32", go="i32", uo="i32")  # fmt: skip
        cex = dict(F=F, K=K, NB=D // 256, BR=BR, QH=int(c["variant"] == "B"), GS=c.get("gs", 0),
                   HOIST=c.get("hoist", 1), ASM=True, PDL=1, PF=c.get("pf", 1), NT=32 * w)  # fmt: skip
        dump = "/tmp/moe_lean/gu_" + gu_name(c).replace(" ", "_") + ".sass"
        r = build(gate_up_kernel, sig, cex, w, ("W", "W32", "SLOT", "XQ", "XD", "XS", "HQ", "HD", "HS"), dump=dump)
        show(f"gate/up {gu_name(c)}", r, BR * 2 * D // 256 * 144, 32 * w)
        print("   LDG before/after first math:", load_order(dump), flush=True)
    for c in DOWN:
        BR, w = c["BRd"], c["wd"]
        sig = dict(W="*u8", W32="*i32", SLOT="*i64", HQ="*i32", HD="*fp32", HS="*fp32", WT="*fp32", Y="*fp32",
                   do="i32")  # fmt: skip
        cex = dict(D=D, K=K, NBF=F // 256, BR=BR, KT=c["kt"], ASM=True, PDL=1, PF=1, NT=32 * w)
        dump = "/tmp/moe_lean/dn_" + dn_name(c).replace(" ", "_") + ".sass"
        r = build(down_kernel, sig, cex, w, ("W", "W32", "SLOT", "HQ", "HD", "HS", "WT", "Y"), dump=dump)
        show(f"down {dn_name(c)}", r, BR * K * F // 256 * 144, 32 * w)
        print("   LDG before/after first math:", load_order(dump), flush=True)


def gpu(dev="cuda"):
    """Timings as device_kernels.moe_workload (CUDA graphs over ≥ 48 layers' distinct slots, PDL where the GPU
    has it): triton_moe.moe_decode f32 / q8, then each config paired with a fixed partner, x pre-quantized
    and with the quantize_act call, and the varied kernel alone. (dev: "cuda"; anything else only for a dry run
    with device_kernels' timing and pool helpers patched.)"""
    from engine.bench import device_kernels as dk
    from engine.runtime import triton_moe
    from engine.runtime.triton_q8_moe import moe_decode_q8_reference

    t_start = time.time()
    bw = dk.measure_bandwidth()
    nbytes = dk._moe_bytes(Q)
    K, F, D = dk.KE, dk.F, dk.D
    gu_bytes = K * 2 * F * block_format(Q).row_bytes(D)
    dn_bytes = nbytes - gu_bytes
    layers = max(48, math.ceil(dk.GB / nbytes))
    pool, stride, roles = dk._slot_pool(Q, layers * K)
    g = torch.Generator().manual_seed(0)
    offs = [(torch.randperm(K, generator=g) + K * i).view(1, K).to(dev) * stride for i in range(layers)]
    x = torch.randn(1, D, device=dev)
    w = torch.rand(1, K, device=dev)
    xq = t8.quantize_act(x)
    ref = moe_decode_q8_reference(pool, offs[0], x, w, roles)
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else dev}: bw {bw:.0f} GB/s, {nbytes / 1e6:.1f} MB a call (gate/up "
          f"{gu_bytes / 1e6:.1f}, down {dn_bytes / 1e6:.1f}), {layers} layers, PDL {qb.pdl_supported()}",
          flush=True)  # fmt: skip
    frac = lambda us, nb=nbytes: f"{us:6.2f} us ({nb / us / 1e3 / bw:4.0%})"
    err = lambda y: ((y.reshape(ref.shape) - ref).abs().max() / ref.abs().max()).item()
    graph = lambda calls: dk._graph_us(calls)[0]

    for act in ("f32", "q8"):
        try:
            e = err(triton_moe.moe_decode(pool, offs[0], x, w, roles, act=act))
            us = graph([lambda o=o: triton_moe.moe_decode(pool, o, x, w, roles, act=act) for o in offs])
            note = "  (x, h not rounded to q8: err is that rounding)" if act == "f32" else ""
            print(f"triton_moe.moe_decode act={act}: {frac(us)}  err {e:.1e}{note}", flush=True)
        except Exception as ex:  # noqa: BLE001
            print(f"triton_moe.moe_decode act={act}: {type(ex).__name__} {str(ex)[:300]}", flush=True)
    flat = pool.reshape(-1)
    p32 = flat.view(torch.int32)
    hq0 = {}  # layer 0's quantized h per gate/up variant, for the down kernels alone
    print("lean  gate/up | down:  whole call, x quantized | with quantize_act(x) | the varied kernel alone", flush=True)
    cfgs = [(gu, DN0, "gu") for gu in GATE_UP] + [(GU0, dn, "dn") for dn in DOWN if dn is not DN0]
    for gu, dn, which in cfgs:
        name = f"{gu_name(gu):22} | {dn_name(dn):13}"
        try:
            t0 = time.time()
            kw = dict(gu, **dn)
            e = err(moe_lean(pool, offs[0], x, w, roles, **kw))
            us = graph([lambda o=o: moe_lean_q(pool, o, xq, w, roles, **kw) for o in offs])
            usq = graph([lambda o=o: moe_lean(pool, o, x, w, roles, **kw) for o in offs])
            if which == "gu":
                a = dict(gs=gu.get("gs", 0), hoist=gu.get("hoist", 1), pf=gu.get("pf"))
                usk = graph([lambda o=o: gate_up(flat, p32, o.reshape(-1), xq, roles, K, gu["BRg"], gu["wg"],
                                                 gu["variant"], **a) for o in offs])  # fmt: skip
                alone = f"gate/up {frac(usk, gu_bytes)}"
            else:
                v = gu["variant"]
                if v not in hq0:
                    h = gate_up(flat, p32, offs[0].reshape(-1), xq, roles, K, gu["BRg"], gu["wg"], v)
                    hq0[v] = t8.quantize_act(h) if v == "A" else h
                usk = graph([lambda o=o: down(flat, p32, o.reshape(-1), hq0[v], w, roles, K, dn["BRd"], dn["wd"],
                                              dn["kt"]) for o in offs])  # fmt: skip
                alone = f"down {frac(usk, dn_bytes)}"
            print(f"{name}: {frac(us)} | {frac(usq)} | {alone}  err {e:.1e}  ({time.time() - t0:.0f} s)", flush=True)
        except Exception as ex:  # noqa: BLE001
            print(f"{name}: {type(ex).__name__} {str(ex)[:300]}", flush=True)
    print(f"total {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["sass"]:
        sass()
    elif not torch.cuda.is_available():
        parity(full=sys.argv[1:] != ["quick"])
    else:
        gpu()
