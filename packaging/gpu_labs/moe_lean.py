"""Lean routed-expert (MoE) decode kernels: Q4_K weights, q8 activations (triton_q8's format), in the
style of q4k_lean.py — whole rows a program, block headers as words with compile-time shifts, dp4a
chained through its accumulate operand, weights read as int32 words of the slot pool.

One decode token, K (token, expert) pairs, gate/up [F, D], down [D, F] (the bench's Qwen3-30B-A3B
shapes: F = 768, D = 2048, K = 8), all Q4_K in one slot pool (engine.bench.device_kernels._slot_pool):

- ``gate_up_kernel``, grid (F/BR, T·K): h[q, rows] = SiLU(gate_q[rows]·x) · (up_q[rows]·x) with x
  pre-quantized (XQ, XD, XS). Variant "A" stores h as float32 [T·K, F] (quantized by one more
  ``triton_q8.quantize_act`` launch); variant "B" (BR a multiple of 32) quantizes its whole 32-blocks
  of h on the spot (``triton_q8.quant_tile`` / ``store_q8``: the same rounding rule).
- ``down_kernel``, grid (D/BR, T): y[rows] = Σ_k w_k · down_k[rows]·h_k. KT=0: ``static_range`` over
  the K experts, a row's 3 blocks on 4 lanes (one masked); KT=1: the K experts on a tensor axis (each
  thread one (row, expert) pair), ``static_range`` over the row's 3 blocks — 8× the threads.
  Prefetches its experts' rows into L2 before its PDL wait (as triton_q8_moe's down kernel).

Layout ("whole blocks"): a thread owns whole Q4_K blocks, so per block it loads the 16-byte header
once (d, dmin and the 12 scale bytes as 4 words), 8 × 16 bytes of quants, the block's activation
scales XD (2 × 16 bytes) and 16-sums XS (4 × 16 bytes), and extracts each sub-block's scale and min
once (no thread repeats another's scale work, as the [.., 2, 4] split of q4k_lean does). The high
nibbles go to dp4a as ``w & 0xF0F0F0F0`` (16 × the code: one LOP3 instead of a shift and a LOP3; the
1/16 is applied once per block), the integer dp4a sum is multiplied by the integer scale (IMAD), and
the block's float sums take d and dmin once at its end. Skipped pairs (slot offset −1): gate/up
branches out; down masks the weight, XD and XS loads (h of a skipped pair is never written).

Parity (Triton's interpreter) against triton_q8_moe.moe_decode_q8_reference; static sm_90 profile
with Triton 3.6's ptxas (/tmp/lab/sassprof.py); on a GPU, timings against triton_moe.moe_decode.
Run:
  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_lean.py        # parity, no GPU
  PYTHONPATH=/tmp/t36:. python3 packaging/gpu_labs/moe_lean.py sass             # static profile
  PYTHONPATH=. python3 packaging/gpu_labs/moe_lean.py                           # GPU: timings
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


# -- building blocks ---------------------------------------------------------------------------
@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + Σ over 4 bytes of a (unsigned) × b (signed)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        s = c
        for k in tl.static_range(4):
            s += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
        return s


@triton.jit
def _w4(t):
    """[A, B, 4] -> its 4 slices along the last axis, in order (a thread holds all 4: register renames)."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2]))
    a0, a1 = tl.split(a)  # elements 0, 2
    b0, b1 = tl.split(b)  # elements 1, 3
    return a0, b0, a1, b1


@triton.jit
def _ld(p, ok, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(p, mask=ok, other=0)
    else:
        return tl.load(p)


@triton.jit
def _chain(w, x, acc, ASM: tl.constexpr):
    """acc + dp4a over the 4 words of w, x [A, B, 4] (one chain through the accumulate operand)."""
    w0, w1, w2, w3 = _w4(w)
    x0, x1, x2, x3 = _w4(x)
    return _dp4a(w0, x0, _dp4a(w1, x1, _dp4a(w2, x2, _dp4a(w3, x3, acc, ASM), ASM), ASM), ASM)


@triton.jit
def _scale_min(s0, s1, s2, S: tl.constexpr):
    """Integer 6-bit scale and min of sub-block S (get_scale_min_k4) from the scale words s0, s1, s2."""
    if S < 4:
        sc = (s0 >> (8 * S)) & 63
        m = (s1 >> (8 * S)) & 63
    else:
        k: tl.constexpr = S - 4
        sc = ((s2 >> (8 * k)) & 0xF) | ((s0 >> (8 * k + 2)) & 0x30)
        m = ((s2 >> (8 * k + 4)) & 0xF) | ((s1 >> (8 * k + 2)) & 0x30)
    return sc, m


@triton.jit
def _u2f(u):
    """int32 u in [0, 2²³) -> float32 (exponent trick: an OR and a subtract)."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _load_block(P, ok, MASKED: tl.constexpr):
    """The Q4_K blocks at int32 pointers P [A, B] (16-byte aligned): header [A, B, 4] and the 8 quarter-chunks
    of quants [A, B, 4] (words 4 + 4i …), one 16-byte load each."""
    m = tl.arange(0, 4)[None, None, :]
    p = P[:, :, None] + m
    ok3 = ok[:, :, None]
    return (_ld(p, ok3, MASKED), _ld(p + 4, ok3, MASKED), _ld(p + 8, ok3, MASKED), _ld(p + 12, ok3, MASKED),
            _ld(p + 16, ok3, MASKED), _ld(p + 20, ok3, MASKED), _ld(p + 24, ok3, MASKED), _ld(p + 28, ok3, MASKED),
            _ld(p + 32, ok3, MASKED))  # fmt: skip


@triton.jit
def _dot_block(blk, X, XDp, XSp, ok, MASKED: tl.constexpr, ASM: tl.constexpr):
    """Dot products [A, B] of the loaded blocks blk (_load_block) with the q8 activation blocks at X (int32
    pointers [A, B] to the block's 64 XQ words), XDp (its 8 XD scales), XSp (its 16 XS sums)."""
    m = tl.arange(0, 4)[None, None, :]
    ok3 = ok[:, :, None]
    hdr0, s0, s1, s2 = _w4(blk[0])
    d = (hdr0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((hdr0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    pd = XDp[:, :, None] + m
    dx = _w4(_ld(pd, ok3, MASKED)) + _w4(_ld(pd + 4, ok3, MASKED))  # 8 sub-block scales
    ps = XSp[:, :, None] + m
    sv = _w4(_ld(ps, ok3, MASKED)) + _w4(_ld(ps + 4, ok3, MASKED)) + _w4(_ld(ps + 8, ok3, MASKED)) \
        + _w4(_ld(ps + 12, ok3, MASKED))  # 16 half-sums  # fmt: skip
    px = X[:, :, None] + m
    zi = tl.zeros(d.shape, dtype=tl.int32)
    alo = tl.zeros(d.shape, dtype=tl.float32)
    ahi = tl.zeros(d.shape, dtype=tl.float32)
    amn = tl.zeros(d.shape, dtype=tl.float32)
    for c in tl.static_range(4):
        qa = blk[1 + 2 * c]  # quants bytes 0..15 of chunk c: elements 0..15 of sub-blocks 2c (low), 2c+1 (high)
        qz = blk[2 + 2 * c]  # bytes 16..31: elements 16..31
        ia = _chain(qz & 0x0F0F0F0F, tl.load(px + (16 * c + 4)), _chain(qa & 0x0F0F0F0F, tl.load(px + 16 * c), zi, ASM), ASM)
        ib = _chain(qz & -0x0F0F0F10, tl.load(px + (16 * c + 12)), _chain(qa & -0x0F0F0F10, tl.load(px + (16 * c + 8)), zi, ASM), ASM)  # 16× (-0x0F0F0F10 = 0xF0F0F0F0)
        sca, mna = _scale_min(s0, s1, s2, 2 * c)
        scb, mnb = _scale_min(s0, s1, s2, 2 * c + 1)
        alo += (ia * sca).to(tl.float32) * dx[2 * c]
        ahi += (ib * scb).to(tl.float32) * dx[2 * c + 1]
        amn += _u2f(mna) * (sv[4 * c] + sv[4 * c + 1]) + _u2f(mnb) * (sv[4 * c + 2] + sv[4 * c + 3])
    return d * (alo + ahi * 0.0625) - dmin * amn


# -- kernels -----------------------------------------------------------------------------------
@triton.jit
def gate_up_kernel(W32, SLOT, XQ, XD, XS, HQ, HD, HS, gw, uw,
                   F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr, BR: tl.constexpr, QH: tl.constexpr,
                   HOIST: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """h[q, rows] = SiLU(gate_q[rows]·x_t) · (up_q[rows]·x_t), pair q = t·K + k at slot SLOT[q] (bytes; −1:
    skip); gate/up at word offsets gw/uw of the slot, NB blocks a row. QH: h quantized into HQ/HD/HS (BR a
    multiple of 32); else float32 into HD [T·K, F]. F % BR == 0."""
    qb.pdl_enter(PDL)  # SLOT comes from the routing kernel
    q = tl.program_id(1)
    slot = tl.load(SLOT + q)
    if slot >= 0:
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        b = tl.arange(0, NB)
        off = tl.multiple_of(rows[:, None] * (36 * NB) + b[None, :] * 36, [4, 4])  # [BR, NB] words
        sw = slot // 4
        G = W32 + tl.multiple_of(sw + gw, 4) + off
        U = W32 + tl.multiple_of(sw + uw, 4) + off
        t = q // K
        zp = tl.zeros([BR, NB], dtype=tl.int32)
        X = XQ + t * (64 * NB) + (zp + b[None, :] * 64)
        XDp = XD + t * (8 * NB) + (zp + b[None, :] * 8)
        XSp = XS + t * (16 * NB) + (zp + b[None, :] * 16)
        ok = zp == 0
        if HOIST:  # both matrices' loads first
            gb = _load_block(G, ok, False)
            ub = _load_block(U, ok, False)
            g = _dot_block(gb, X, XDp, XSp, ok, False, ASM)
            u = _dot_block(ub, X, XDp, XSp, ok, False, ASM)
        else:
            g = _dot_block(_load_block(G, ok, False), X, XDp, XSp, ok, False, ASM)
            u = _dot_block(_load_block(U, ok, False), X, XDp, XSp, ok, False, ASM)
        g = tl.sum(g, axis=1)
        u = tl.sum(u, axis=1)
        h = g / (1.0 + tl.exp(-g)) * u  # ggml_swiglu_split
        if QH:
            NBLK: tl.constexpr = BR // 32
            words, d, s = t8.quant_tile(tl.reshape(h, [NBLK, 32]), NBLK)
            blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
            t8.store_q8(HQ, HD, HS, q, blk, blk < F // 32, words, d, s, F // 32)
        else:
            tl.store(HD + q.to(tl.int64) * F + rows, h)


@triton.jit
def down_kernel(W, W32, SLOT, HQ, HD, HS, WT, Y, dw, do,
                D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr, BR: tl.constexpr, KT: tl.constexpr,
                ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Y[t, rows] = Σ_k WT[t, k] · down_{t,k}[rows] · hq[t·K + k] (pairs with a slot), down at word offset dw
    (byte offset do) of the slot, NBF blocks a row. D % BR == 0."""
    t = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    RW: tl.constexpr = 36 * NBF  # words a row
    if PF:  # SLOT is final once the previous kernel released this one
        qb.prefetch_pairs(W, SLOT, t, 0, D, r0, do, RW * 4, K, K, BR, NT)
    qb.pdl_enter(PDL)
    rows = r0 + tl.arange(0, BR)
    if KT:  # experts on a tensor axis: [BR, K], the row's blocks one after another
        k = tl.arange(0, K)
        q = t * K + k
        slot = tl.load(SLOT + q)
        wk = tl.load(WT + q)
        ok = (slot >= 0)[None, :] & (rows >= 0)[:, None]
        zp = tl.zeros([BR, K], dtype=tl.int32)
        P = W32 + (tl.multiple_of(tl.maximum(slot, 0) // 4 + dw, 4)[None, :] + (rows * RW)[:, None])
        X = HQ + (zp + (q * (64 * NBF))[None, :])
        XDp = HD + (zp + (q * (8 * NBF))[None, :])
        XSp = HS + (zp + (q * (16 * NBF))[None, :])
        acc = tl.zeros([BR, K], dtype=tl.float32)
        for bb in tl.static_range(NBF):
            acc += _dot_block(_load_block(P + 36 * bb, ok, True), X + 64 * bb, XDp + 8 * bb, XSp + 16 * bb, ok,
                              True, ASM)  # fmt: skip
        y = tl.sum(acc * wk[None, :], axis=1)
    else:  # static loop over the experts, a row's blocks on NBP lanes (those ≥ NBF masked)
        NBP: tl.constexpr = triton.next_power_of_2(NBF)
        lane = tl.arange(0, NBP)
        xl = tl.minimum(lane, NBF - 1)  # activation pointers of masked lanes stay inside the row
        zp = tl.zeros([BR, NBP], dtype=tl.int32)
        off = zp + (rows * RW)[:, None] + (lane * 36)[None, :]
        acc = tl.zeros([BR, NBP], dtype=tl.float32)
        for j in tl.static_range(K):
            q = t * K + j
            slot = tl.load(SLOT + q)
            wk = tl.load(WT + q)
            ok = (slot >= 0) & (off >= 0) & (lane < NBF)[None, :]
            P = W32 + tl.multiple_of(tl.maximum(slot, 0) // 4 + dw, 4) + off
            X = HQ + q * (64 * NBF) + (zp + (xl * 64)[None, :])
            XDp = HD + q * (8 * NBF) + (zp + (xl * 8)[None, :])
            XSp = HS + q * (16 * NBF) + (zp + (xl * 16)[None, :])
            acc += wk * _dot_block(_load_block(P, ok, True), X, XDp, XSp, ok, True, ASM)
        y = tl.sum(acc, axis=1)
    tl.store(Y + t * D + rows, y)


# -- host --------------------------------------------------------------------------------------
def _geometry(roles):
    (go, gq, F, D), (uo, uq, _, _), (do, dq, _, _) = (roles[r] for r in ("gate", "up", "down"))
    assert QType(gq) == QType(uq) == QType(dq) == Q and D % 256 == 0 and F % 256 == 0
    assert go % 16 == uo % 16 == do % 16 == 0
    return go, uo, do, F, D


def gate_up(pool32, slots, xq, roles, K, BR, warps, variant, hoist=1, asm=None, pdl=None):
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
    gate_up_kernel[(F // BR, n)](
        pool32, slots, XQ, XD, XS, HQ, HD, HS, go // 4, uo // 4, F=F, K=K, NB=D // 256, BR=BR, QH=int(qh),
        HOIST=hoist, ASM=asm, PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
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
        pool, pool32, slots, HQ, HD, HS, weights, Y, do // 4, do, D=D, K=K, NBF=F // 256, BR=BR, KT=kt, ASM=asm,
        PDL=pdl, PF=qb.prefetch(pdl), NT=32 * warps, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def moe_lean_q(pool, slot_off, xq, weights, roles, BRg=8, wg=2, BRd=8, wd=4, variant="B", kt=1, hoist=1,
               asm=None, pdl=None):  # fmt: skip
    """triton_moe.moe_decode's contract with x given quantized (triton_q8.quantize_act(x)) -> float32 [T, D]."""
    T, K = slot_off.shape
    pool = pool.reshape(-1)
    pool32 = pool.view(torch.int32)
    slots = slot_off.reshape(-1).contiguous()
    h = gate_up(pool32, slots, xq, roles, K, BRg, wg, variant, hoist, asm, pdl)
    if variant == "A":
        h = t8.quantize_act(h)  # rows of skipped pairs hold garbage: the down kernel masks them off
    return down(pool, pool32, slots, h, weights.to(torch.float32).contiguous(), roles, K, BRd, wd, kt, asm, pdl)


def moe_lean(pool, slot_off, x, weights, roles, BRg=8, wg=2, BRd=8, wd=4, variant="B", kt=1, hoist=1,
             asm=None, pdl=None):  # fmt: skip
    """triton_moe.moe_decode's contract (x float32 [T, D]) -> float32 [T, D]."""
    return moe_lean_q(pool, slot_off, t8.quantize_act(x), weights, roles, BRg, wg, BRd, wd, variant, kt, hoist, asm, pdl)


# -- configs -----------------------------------------------------------------------------------
# gate/up (variant, BR, warps, hoist): a thread owns (row, block) pairs: BR·NB/(32·warps) of them (NB = 8)
GATE_UP = [("A", 4, 1, 1), ("A", 8, 2, 1), ("A", 8, 1, 1), ("A", 16, 4, 1), ("B", 32, 8, 1), ("B", 32, 4, 1),
           ("B", 32, 8, 0), ("B", 64, 8, 1)]  # fmt: skip
# down (kt, BR, warps): KT=1: a thread owns (row, expert) pairs, BR·K/(32·warps) of them; KT=0: (row, lane)
DOWN = [(1, 4, 1), (1, 8, 2), (1, 8, 1), (1, 16, 4), (1, 16, 2), (0, 8, 1), (0, 16, 2), (0, 32, 4)]
GU0, DN0 = ("B", 32, 8, 1), (1, 8, 2)  # the partner of each config in the combined timings


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


def parity(quick=False):
    """The interpreter (TRITON_INTERPRET=1) against triton_q8_moe.moe_decode_q8_reference."""
    from engine.runtime.triton_q8_moe import moe_decode_q8_reference

    gen = torch.Generator().manual_seed(0)
    K = 8
    cases = [(256, 512, 1), (768, 2048, 1)] if not quick else [(256, 512, 1)]
    for F, D, T in cases:
        pool, stride, roles = _pool(F, D, 2 * K, gen)
        offs = torch.randperm(2 * K, generator=gen)[:K].view(1, K) * stride
        offs_skip = offs.clone()
        offs_skip[0, 3] = -1  # a skipped pair
        x = torch.randn(T, D, generator=gen)
        w = torch.rand(T, K, generator=gen)
        for name, o in (("all", offs), ("skip", offs_skip)):
            ref = moe_decode_q8_reference(pool, o, x, w, roles).double()
            cfgs = [(gu, DN0) for gu in (("A", 8, 2, 1), ("B", 32, 4, 1), ("B", 64, 8, 0))]
            cfgs += [(("A", 4, 1, 1), dn) for dn in ((1, 8, 2), (0, 16, 2), (1, 16, 4))]
            if F < 768 or name == "skip":
                cfgs = cfgs[1:2] + cfgs[4:5]
            for (v, BRg, wg, ho), (kt, BRd, wd) in cfgs:
                t0 = time.time()
                y = moe_lean(pool, o, x, w, roles, BRg, wg, BRd, wd, v, kt, ho, asm=False, pdl=0).double()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                print(f"F{F} D{D} {name:4}: gate/up {v} BR{BRg} w{wg} hoist{ho} | down KT{kt} BR{BRd} w{wd}: "
                      f"max|y - ref|/max|ref| = {err:.1e}  ({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
                assert err <= 1e-5, err


def sass(F=768, D=2048, K=8):
    sys.path.insert(0, "/tmp/lab")
    from sassprof import build, load_order, show

    os.makedirs("/tmp/moe_lean", exist_ok=True)
    for v, BR, w, ho in GATE_UP:
        sig = dict(W32="*i32", SLOT="*i64", XQ="*i32", XD="*fp32", XS="*fp32", HQ="*i32", HD="*fp32", HS="*fp32",
                   gw="i32", uw="i32")  # fmt: skip
        cex = dict(F=F, K=K, NB=D // 256, BR=BR, QH=int(v == "B"), HOIST=ho, ASM=True, PDL=1)
        dump = f"/tmp/moe_lean/gu_{v}_{BR}_{w}_{ho}.sass"
        r = build(gate_up_kernel, sig, cex, w, ("W32", "SLOT", "XQ", "XD", "XS", "HQ", "HD", "HS"), dump=dump)
        show(f"gate/up {v} BR{BR} w{w} hoist{ho}", r, BR * 2 * D // 256 * 144, 32 * w)
        print("   LDG before/after first math:", load_order(dump), flush=True)
    for kt, BR, w in DOWN:
        sig = dict(W="*u8", W32="*i32", SLOT="*i64", HQ="*i32", HD="*fp32", HS="*fp32", WT="*fp32", Y="*fp32",
                   dw="i32", do="i32")  # fmt: skip
        cex = dict(D=D, K=K, NBF=F // 256, BR=BR, KT=kt, ASM=True, PDL=1, PF=1, NT=32 * w)
        dump = f"/tmp/moe_lean/dn_{kt}_{BR}_{w}.sass"
        r = build(down_kernel, sig, cex, w, ("W", "W32", "SLOT", "HQ", "HD", "HS", "WT", "Y"), dump=dump)
        show(f"down KT{kt} BR{BR} w{w}", r, BR * K * F // 256 * 144, 32 * w)
        print("   LDG before/after first math:", load_order(dump), flush=True)


def gpu():
    from engine.bench import device_kernels as dk
    from engine.runtime import triton_moe
    from engine.runtime.triton_q8_moe import moe_decode_q8_reference

    t_start = time.time()
    bw = dk.measure_bandwidth()
    nbytes = dk._moe_bytes(Q)
    layers = max(48, math.ceil(dk.GB / nbytes))
    pool, stride, roles = dk._slot_pool(Q, layers * dk.KE)
    g = torch.Generator().manual_seed(0)
    offs = [(torch.randperm(dk.KE, generator=g) + dk.KE * i).view(1, dk.KE).cuda() * stride for i in range(layers)]
    x = torch.randn(1, dk.D, device="cuda")
    w = torch.rand(1, dk.KE, device="cuda")
    xq = t8.quantize_act(x)
    ref = moe_decode_q8_reference(pool, offs[0], x, w, roles)
    print(f"{torch.cuda.get_device_name()}: bw {bw:.0f} GB/s, {nbytes / 1e6:.1f} MB a call, {layers} layers, "
          f"PDL {qb.pdl_supported()}", flush=True)  # fmt: skip
    frac = lambda us: f"{us:6.2f} us ({nbytes / us / 1e3 / bw:4.0%})"
    err = lambda y: ((y.reshape(ref.shape) - ref).abs().max() / ref.abs().max()).item()

    for act in ("f32", "q8"):
        us = dk._graph_us([lambda o=o: triton_moe.moe_decode(pool, o, x, w, roles, act=act) for o in offs])[0]
        print(f"triton_moe.moe_decode act={act}: {frac(us)}  err {err(triton_moe.moe_decode(pool, offs[0], x, w, roles, act=act)):.1e}",
              flush=True)  # fmt: skip
    cfgs = [(gu, DN0) for gu in GATE_UP] + [(GU0, dn) for dn in DOWN if dn != DN0]
    for (v, BRg, wg, ho), (kt, BRd, wd) in cfgs:
        name = f"lean {v} gate/up BR{BRg} w{wg} hoist{ho} | down KT{kt} BR{BRd} w{wd}"
        try:
            t0 = time.time()
            kw = dict(BRg=BRg, wg=wg, BRd=BRd, wd=wd, variant=v, kt=kt, hoist=ho)
            e = err(moe_lean(pool, offs[0], x, w, roles, **kw))
            us = dk._graph_us([lambda o=o: moe_lean_q(pool, o, xq, w, roles, **kw) for o in offs])[0]
            usq = dk._graph_us([lambda o=o: moe_lean(pool, o, x, w, roles, **kw) for o in offs])[0]
            print(f"{name}: x quantized {frac(us)} | +quantize {frac(usq)}  err {e:.1e}  ({time.time() - t0:.0f} s)",
                  flush=True)  # fmt: skip
        except Exception as ex:  # noqa: BLE001
            print(f"{name}: {type(ex).__name__} {str(ex)[:300]}", flush=True)
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:] == ["sass"]:
        sass()
    elif not torch.cuda.is_available():
        parity(quick=sys.argv[1:] == ["quick"])
    else:
        gpu()
