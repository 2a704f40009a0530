"""Where the routed-expert kernels lose: the engine's Q4_K gate/up and down launches (triton_q4k_moe) beside
kernels with the *same grid and the same loads* that only XOR what they load, so the gap between a kernel
and its read-only twin is the arithmetic's, and the gap between that twin and a coalesced read of the same
bytes is the access pattern's.

Probes (gate/up: grid F/BR × pairs, BR rows of gate and of up a program; down: grid D/BR × tokens, BR rows
of the token's K experts a program):
  engine      the engine's kernel
  pattern     the engine's weight loads (_load_half's tile: a thread owns half a block, lanes strided by
              the 72-byte halves), XORed
  pattern+x   the same and the activation loads of _dot_half (q8 words, sub-block scales, 16-sums)
  coalesced   the same bytes a program read as consecutive 16-byte words (a warp: 512 contiguous bytes)
  coalesced+x coalesced, plus the activation loads of the pattern

Measured on the H100 (session 10, docs/benchmarks-gpu.md): the arithmetic costs ~0.2 µs a kernel, the activation
loads 1.2 µs (gate/up) and 0.8 µs (down), the weights' strided pattern nothing; x̂ chunk-major wins 0.1–0.2 µs a
kernel and nothing on the call. Not adopted.

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_probe.py     # runs every probe once
  PYTHONPATH=. python3 packaging/gpu_labs/moe_probe.py                        # H100 chain timings
  PYTHONPATH=. python3 packaging/gpu_labs/moe_probe.py --sass                 # sm_90 counts, no GPU
"""
# ruff: noqa: E731, B023

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_half  # noqa: E402

from engine.runtime import triton_q4k_moe as q4  # noqa: E402
from engine.runtime import triton_q8 as t8  # noqa: E402
from engine.runtime import triton_qblocks as qb  # noqa: E402

BW = tl.constexpr(36)  # int32 words a Q4_K block


@triton.jit
def _xor5(blk):
    a = blk[0] ^ blk[1] ^ blk[2] ^ blk[3] ^ blk[4]
    return tl.xor_sum(a, axis=2)


@triton.jit
def _xor_act(X, XC: tl.constexpr, XDp, XSp, EV: tl.constexpr):
    """The activation loads of _dot_half for one half (32 q8 words in 8 16-byte chunks XC words apart, 4
    scales, 8 16-sums), XORed; EV their eviction policy."""
    m = tl.arange(0, 4)[None, None, :]
    px = X[:, :, None] + m
    a = tl.load(px, eviction_policy=EV)
    for j in tl.static_range(1, 8):
        a ^= tl.load(px + j * XC, eviction_policy=EV)
    a ^= tl.load(XDp[:, :, None] + m, eviction_policy=EV).to(tl.int32, bitcast=True)
    ps = XSp[:, :, None] + m
    a ^= tl.load(ps, eviction_policy=EV).to(tl.int32, bitcast=True)
    a ^= tl.load(ps + 4, eviction_policy=EV).to(tl.int32, bitcast=True)
    return tl.xor_sum(a, axis=2)


@triton.jit
def _load_half_c(P, hs, CM: tl.constexpr, EV: tl.constexpr):
    """triton_q4k_moe._load_half with a cache modifier and an eviction policy on the loads."""
    p = P[:, :, None] + tl.arange(0, 4)[None, None, :]
    pq = p + 4 + 16 * hs[:, :, None]
    return (tl.load(p, cache_modifier=CM, eviction_policy=EV), tl.load(pq, cache_modifier=CM, eviction_policy=EV),
            tl.load(pq + 4, cache_modifier=CM, eviction_policy=EV), tl.load(pq + 8, cache_modifier=CM, eviction_policy=EV),
            tl.load(pq + 12, cache_modifier=CM, eviction_policy=EV))  # fmt: skip


@triton.jit
def gate_up_probe(W32, SLOT, XQ, XD, XS, H, go, uo, F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                  BR: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr, XT: tl.constexpr = 0, CM: tl.constexpr = "",
                  EW: tl.constexpr = "", EX: tl.constexpr = ""):  # fmt: skip
    """MODE 0 pattern, 1 pattern+x, 2 coalesced, 3 coalesced+x (module docstring); XT: the activations'
    16-byte chunks chunk-major (transposed: a warp's lanes read consecutive chunks); CM / EW: the weight
    loads' cache modifier / eviction policy, EX the activations'."""
    qb.pdl_enter(PDL)
    q = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    slot = tl.load(SLOT + q)
    t = q // K
    e = tl.arange(0, 2 * NB)
    b = e // 2
    zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
    rows = r0 + tl.arange(0, BR)
    if MODE < 2:
        hs = (e % 2)[:, None] + zp
        off = tl.multiple_of(b[:, None] * BW + rows[None, :] * (BW * NB), [4, 4])
        acc = _xor5(_load_half_c(W32 + tl.multiple_of((slot + go) // 4, 4) + off, hs, CM, EW))
        acc ^= _xor5(_load_half_c(W32 + tl.multiple_of((slot + uo) // 4, 4) + off, hs, CM, EW))
    else:  # the program's BR rows of gate, then of up: BR·NB·36 consecutive words each
        n: tl.constexpr = BR * NB * BW
        acc1 = tl.zeros([256], dtype=tl.int32)
        for mo in tl.static_range(2):
            base = tl.multiple_of((slot + (go if mo == 0 else uo)) // 4 + r0 * (NB * BW), 4)
            for s in tl.static_range((n + 255) // 256):
                i = s * 256 + tl.arange(0, 256)
                acc1 ^= tl.load(W32 + base + i, mask=i < n, other=0)
        acc = tl.where((tl.arange(0, 2 * NB) == 0)[:, None], zp + tl.xor_sum(acc1, 0), zp)  # once a row
    if MODE % 2 == 1:
        X = XQ + t * (64 * NB) + (zp + (e * 4 if XT else e * 32)[:, None])
        XDp = XD + t * (8 * NB) + (zp + (b * 8 + (e % 2) * 4)[:, None])
        XSp = XS + t * (16 * NB) + (zp + (b * 16 + (e % 2) * 8)[:, None])
        acc ^= _xor_act(X, 8 * NB if XT else 4, XDp, XSp, EX)
    h = tl.xor_sum(acc, axis=0).to(tl.float32)
    tl.store(H + q.to(tl.int64) * F + rows, h)


@triton.jit
def down_probe(W32, SLOT, HQ, HD, HS, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr, BR: tl.constexpr,
               MODE: tl.constexpr, PDL: tl.constexpr, XT: tl.constexpr = 0, CM: tl.constexpr = "",
               EW: tl.constexpr = "", EX: tl.constexpr = ""):  # fmt: skip
    qb.pdl_enter(PDL)
    t = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    RW: tl.constexpr = BW * NBF
    rows = r0 + tl.arange(0, BR)
    NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
    e = tl.arange(0, K * NL)
    lane = e % NL
    lc = tl.minimum(lane, 2 * NBF - 1)
    b = lc // 2
    hv = lc % 2
    q = t * K + e // NL
    slot = tl.maximum(tl.load(SLOT + q), 0)
    zp = tl.zeros([K * NL, BR], dtype=tl.int32)
    if MODE < 2:
        P = W32 + (tl.multiple_of((slot + do) // 4 + b * BW, 4)[:, None] + (rows * RW)[None, :])
        acc = _xor5(_load_half_c(P, hv[:, None] + zp, CM, EW))
    else:  # each expert's BR rows: BR·RW consecutive words, a [K, 128]-word load at a time
        n: tl.constexpr = BR * RW
        k = tl.arange(0, K)
        sk = tl.load(SLOT + t * K + k)
        base = tl.multiple_of((tl.maximum(sk, 0) + do) // 4 + r0 * RW, 4)
        acc2 = tl.zeros([K, 128], dtype=tl.int32)
        for s in tl.static_range((n + 127) // 128):
            i = s * 128 + tl.arange(0, 128)
            acc2 ^= tl.load(W32 + base[:, None] + i[None, :], mask=(i < n)[None, :], other=0)
        acc = tl.where((e == 0)[:, None], zp + tl.xor_sum(tl.xor_sum(acc2, 1), 0), zp)  # once a row
    if MODE % 2 == 1:
        X = HQ + (zp + (q * (64 * NBF) + (lc * 4 if XT else lc * 32))[:, None])
        XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
        XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
        acc ^= _xor_act(X, 8 * NBF if XT else 4, XDp, XSp, EX)
    tl.store(Y + t * D + rows, tl.xor_sum(acc, axis=0).to(tl.float32))


MODES = {"pattern": 0, "pattern+x": 1, "coalesced": 2, "coalesced+x": 3}
# MODE 1 with: the activations chunk-major (XT), the weights past L1 (.cg), weights evict_first and
# activations evict_last
VARIANTS = {"pattern+xT": dict(MODE=1, XT=1), "pattern+x .cg": dict(MODE=1, CM=".cg"),
            "pattern+xT .cg": dict(MODE=1, XT=1, CM=".cg"),
            "pattern+x ev": dict(MODE=1, EW="evict_first", EX="evict_last")}  # fmt: skip


def transpose_act(XQ, halves):
    """XQ int32 [R, halves·32] (each half's 32 words in 8 chunks of 4) -> chunk-major [R, 8·halves·4]: chunk j of
    half h at words (j·halves + h)·4 … + 3, so consecutive halves' chunk j are consecutive 16 bytes."""
    R = XQ.shape[0]
    return XQ.view(R, halves, 8, 4).transpose(1, 2).contiguous().view(R, -1)


def gate_up(pool, slots, xq, roles, K, BR, warps, mode, **kw):
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    XQ, XD, XS = xq
    pdl = qb.pdl(XQ.device)
    H = torch.empty((slots.numel(), F), dtype=torch.float32, device=XQ.device)
    gate_up_probe[(F // BR, slots.numel())](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, H, go, uo, F=F, K=K, NB=D // 256, BR=BR,
        MODE=mode, PDL=pdl, num_warps=warps, **kw, **qb.launch_kw(pdl),
    )  # fmt: skip
    return H


def down(pool, slots, hq, roles, K, BR, warps, mode, **kw):
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    pdl = qb.pdl(HQ.device)
    T = slots.numel() // K
    Y = torch.empty((T, D), dtype=torch.float32, device=HQ.device)
    down_probe[(D // BR, T)](
        pool.reshape(-1).view(torch.int32), slots, HQ, HD, HS, Y, do, D=D, K=K, NBF=F // 256, BR=BR, MODE=mode,
        PDL=pdl, num_warps=warps, **kw, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


@triton.jit
def _dot_half_x(blk, hs, X, XC: tl.constexpr, XDp, XSp, ASM: tl.constexpr):
    """triton_q4k_moe._dot_half with the half's 8 activation chunks XC words apart (4: the engine's layout;
    4·halves: chunk-major, transpose_act)."""
    m = tl.arange(0, 4)[None, None, :]
    hdr0, s0, s1, s2 = q4._w4(blk[0])
    scw = tl.where(hs == 0, s0 & 0x3F3F3F3F, (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030))
    mnw = tl.where(hs == 0, s1 & 0x3F3F3F3F, ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030))
    d = (hdr0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((hdr0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dx = q4._w4(tl.load(XDp[:, :, None] + m))
    ps = XSp[:, :, None] + m
    sv = q4._w4(tl.load(ps)) + q4._w4(tl.load(ps + 4))
    px = X[:, :, None] + m
    zi = tl.zeros(d.shape, dtype=tl.int32)
    alo = tl.zeros(d.shape, dtype=tl.float32)
    ahi = tl.zeros(d.shape, dtype=tl.float32)
    amn = tl.zeros(d.shape, dtype=tl.float32)
    for c in tl.static_range(2):
        qa = blk[1 + 2 * c]
        qz = blk[2 + 2 * c]
        ia = q4._chain(qa & 0x0F0F0F0F, tl.load(px + XC * (4 * c)), zi, ASM)
        ia = q4._chain(qz & 0x0F0F0F0F, tl.load(px + XC * (4 * c + 1)), ia, ASM)
        ib = q4._chain(qa & -0x0F0F0F10, tl.load(px + XC * (4 * c + 2)), zi, ASM)
        ib = q4._chain(qz & -0x0F0F0F10, tl.load(px + XC * (4 * c + 3)), ib, ASM)
        sca = q4._byte(scw, 2 * c, ASM)
        scb = q4._byte(scw, 2 * c + 1, ASM)
        mna = q4._byte(mnw, 2 * c, ASM)
        mnb = q4._byte(mnw, 2 * c + 1, ASM)
        alo += (ia * sca).to(tl.float32) * dx[2 * c]
        ahi += (ib * scb).to(tl.float32) * dx[2 * c + 1]
        amn += mna.to(tl.float32) * (sv[4 * c] + sv[4 * c + 1]) + mnb.to(tl.float32) * (sv[4 * c + 2] + sv[4 * c + 3])
    return d * (alo + ahi * 0.0625) - dmin * amn


@triton.jit
def gate_up_x_kernel(W32, SLOT, XQ, XD, XS, H, go, uo, F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                     BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, XT: tl.constexpr, CM: tl.constexpr):  # fmt: skip
    """The engine's gate/up kernel with x̂ chunk-major (XT) and a cache modifier on the weights (CM)."""
    qb.pdl_enter(PDL)
    q = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    rows = r0 + tl.arange(0, BR)
    slot = tl.load(SLOT + q)
    if slot >= 0:
        t = q // K
        e = tl.arange(0, 2 * NB)
        b = e // 2
        zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
        hs = (e % 2)[:, None] + zp
        off = tl.multiple_of(b[:, None] * BW + rows[None, :] * (BW * NB), [4, 4])
        gb = _load_half_c(W32 + tl.multiple_of((slot + go) // 4, 4) + off, hs, CM, "")
        ub = _load_half_c(W32 + tl.multiple_of((slot + uo) // 4, 4) + off, hs, CM, "")
        X = XQ + t * (64 * NB) + (zp + (e * 4 if XT else e * 32)[:, None])
        XDp = XD + t * (8 * NB) + (zp + (b * 8 + (e % 2) * 4)[:, None])
        XSp = XS + t * (16 * NB) + (zp + (b * 16 + (e % 2) * 8)[:, None])
        XC: tl.constexpr = 8 * NB if XT else 4
        g = tl.sum(_dot_half_x(gb, hs, X, XC, XDp, XSp, ASM), axis=0)
        u = tl.sum(_dot_half_x(ub, hs, X, XC, XDp, XSp, ASM), axis=0)
        h = g / (1.0 + tl.exp(-g)) * u
    else:
        h = tl.zeros([BR], dtype=tl.float32)
    tl.store(H + q.to(tl.int64) * F + rows, h)


@triton.jit
def down_x_kernel(W32, SLOT, HQ, HD, HS, WT, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr,
                  BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, XT: tl.constexpr, CM: tl.constexpr):  # fmt: skip
    """The engine's down kernel (PF 0) with ĥ chunk-major (XT) and a cache modifier on the weights (CM)."""
    qb.pdl_enter(PDL)
    t = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    RW: tl.constexpr = BW * NBF
    rows = r0 + tl.arange(0, BR)
    NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
    b, hv, q, slot, keep, wk = q4._down_lanes(SLOT, WT, t, tl.arange(0, K * NL), K, NBF)
    lc = 2 * b + hv
    zp = tl.zeros([K * NL, BR], dtype=tl.int32)
    P = W32 + (tl.multiple_of((tl.maximum(slot, 0) + do) // 4 + b * BW, 4)[:, None] + (rows * RW)[None, :])
    hs = hv[:, None] + zp
    X = HQ + (zp + (q * (64 * NBF) + (lc * 4 if XT else lc * 32))[:, None])
    XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
    XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
    XC: tl.constexpr = 8 * NBF if XT else 4
    v = _dot_half_x(_load_half_c(P, hs, CM, ""), hs, X, XC, XDp, XSp, ASM)
    y = tl.sum(tl.where(keep[:, None], v * wk[:, None], 0.0), axis=0)
    tl.store(Y + t * D + rows, y)


def gate_up_x(pool, slots, xq, roles, K, BR, warps, xt=0, cm=""):
    """gate_up_x_kernel -> h float32 [T·K, F]; xq in the engine's layout (transposed here when xt)."""
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    XQ, XD, XS = xq
    if xt:
        XQ = transpose_act(XQ, D // 128)
    pdl = qb.pdl(XQ.device)
    H = torch.empty((slots.numel(), F), dtype=torch.float32, device=XQ.device)
    gate_up_x_kernel[(F // BR, slots.numel())](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, H, go, uo, F=F, K=K, NB=D // 256, BR=BR,
        ASM=t8.use_asm(XQ.device), PDL=pdl, XT=xt, CM=cm, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return H


def down_x(pool, slots, hq, weights, roles, K, BR, warps, xt=0, cm=""):
    """down_x_kernel -> y float32 [T, D]; hq in the engine's layout (transposed here when xt)."""
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    if xt:
        HQ = transpose_act(HQ, F // 128)
    pdl = qb.pdl(HQ.device)
    T = slots.numel() // K
    Y = torch.empty((T, D), dtype=torch.float32, device=HQ.device)
    down_x_kernel[(D // BR, T)](
        pool.reshape(-1).view(torch.int32), slots, HQ, HD, HS, weights, Y, do, D=D, K=K, NBF=F // 256, BR=BR,
        ASM=t8.use_asm(HQ.device), PDL=pdl, XT=xt, CM=cm, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


XVARIANTS = {"engine layout": dict(xt=0), "x chunk-major": dict(xt=1), "x chunk-major .cg": dict(xt=1, cm=".cg"),
             ".cg": dict(cm=".cg")}  # fmt: skip


def parity(dev):
    """The x-layout kernels against the engine's (bit for bit in the interpreter, < 1e-6 compiled)."""
    import numpy as np

    from tests.triton_data import expert_pool, routing_case

    rng = np.random.default_rng(1)
    F, D, E, K = (256, 512, 3, 2) if dev == "cpu" else (768, 2048, 16, 8)
    pool, stride, roles = expert_pool((moe_half.Q,) * 3, F, D, E, dev, rng)
    for T in (1, 2):
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        slots = slot_off.reshape(-1).contiguous()
        xq = t8.quantize_act(x)
        ref_h = q4.gate_up(pool, slots, x, roles, K, {"BR": 8, "num_warps": 2}, xq)
        hq = t8.quantize_act(ref_h)
        ref_y = q4.down(pool, slots, ref_h, w, roles, K, {"BR": 4, "num_warps": 1, "PF": 0})
        for name, kw in XVARIANTS.items():
            h = gate_up_x(pool, slots, xq, roles, K, 8, 2, **kw)
            y = down_x(pool, slots, hq, w.float().contiguous(), roles, K, 4, 1, **kw)
            eh = ((h - ref_h).norm() / ref_h.norm()).item()
            ey = ((y - ref_y).norm() / ref_y.norm()).item()
            assert eh < 1e-6 and ey < 1e-6, (name, eh, ey)
        print(f"parity T={T}: the x-layout kernels match the engine's (< 1e-6)", flush=True)


def smoke():
    """Every probe once in the interpreter (shapes, masks, pointer arithmetic), on a small pool."""
    import numpy as np

    from tests.triton_data import expert_pool, routing_case

    rng = np.random.default_rng(0)
    F, D, E, K = 256, 512, 3, 2
    pool, stride, roles = expert_pool((moe_half.Q,) * 3, F, D, E, "cpu", rng)
    slot_off, x, w = routing_case(1, K, E, D, stride, "cpu", rng)
    slots = slot_off.reshape(-1).contiguous()
    xq = t8.quantize_act(x)
    hq = t8.quantize_act(torch.randn(K, F))
    for name, mode in MODES.items():
        gate_up(pool, slots, xq, roles, K, 8, 2, mode)
        down(pool, slots, hq, roles, K, 4, 1, mode)
        print(f"{name}: ran", flush=True)
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        gate_up(pool, slots, xq, roles, K, 8, 2, kw.pop("MODE"), **kw)
        down(pool, slots, hq, roles, K, 4, 1, 1, **kw)
        print(f"{name}: ran", flush=True)
    parity("cpu")


def gpu():
    parity("cuda")
    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    # the kernels, x̂ / ĥ already in the layout (a norm or gate/up launch would write it)
    xqt = (transpose_act(xq[0], D // 128), *xq[1:])
    hqt = (transpose_act(hq[0], F // 128), *hq[1:])
    for name, kw in XVARIANTS.items():
        kw = dict(kw)
        xt = kw.pop("xt", 0)
        a, b = (xqt, hqt) if xt else (xq, hq)
        for BR, wp in moe_half.cfgs("GU", "8,2 16,4"):
            us = graph([lambda o=o: gate_up_x(pool, o, a, roles, K, BR, wp, **kw) for o in offs])
            print(f"kernel gate/up BR {BR} warps {wp} {name:18s} {frac(us, gu_bytes)}", flush=True)
        for BR, wp in moe_half.cfgs("DN", "4,1 8,2"):
            us = graph([lambda o=o: down_x(pool, o, b, w, roles, K, BR, wp, **kw) for o in offs])
            print(f"kernel down BR {BR} warps {wp} {name:18s} {frac(us, dn_bytes)}", flush=True)
        us = graph([lambda o=o: down_x(pool, o, b, w, roles, K, 4, 1, **kw)
                    if gate_up_x(pool, o, a, roles, K, 8, 2, **kw) is not None else None for o in offs])  # fmt: skip
        print(f"kernel gate/up 8,2 + down 4,1 (no h quantize) {name:18s} {frac(us, nbytes)}", flush=True)
    for BR, wp in moe_half.cfgs("GU", "8,2 16,4"):
        us = graph([lambda o=o: moe_half.gate_up(pool, o, x, xq, roles, K, BR, wp) for o in offs])
        print(f"gate/up BR {BR} warps {wp} engine      {frac(us, gu_bytes)}", flush=True)
        for name, mode in MODES.items():
            us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, BR, wp, mode) for o in offs])
            print(f"gate/up BR {BR} warps {wp} {name:11s} {frac(us, gu_bytes)}", flush=True)
        for name, kw in VARIANTS.items():
            kw = dict(kw)
            mode = kw.pop("MODE")
            us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, BR, wp, mode, **kw) for o in offs])
            print(f"gate/up BR {BR} warps {wp} {name:11s} {frac(us, gu_bytes)}", flush=True)
    for BR, wp in moe_half.cfgs("DN", "4,1 8,2"):
        us = graph([lambda o=o: moe_half.down(pool, o, hq, w, roles, K, BR, wp) for o in offs])
        print(f"down BR {BR} warps {wp} engine      {frac(us, dn_bytes)}", flush=True)
        for name, mode in MODES.items():
            us = graph([lambda o=o: down(pool, o, hq, roles, K, BR, wp, mode) for o in offs])
            print(f"down BR {BR} warps {wp} {name:11s} {frac(us, dn_bytes)}", flush=True)
        for name, kw in VARIANTS.items():
            kw = dict(kw)
            mode = kw.pop("MODE")
            us = graph([lambda o=o: down(pool, o, hq, roles, K, BR, wp, mode, **kw) for o in offs])
            print(f"down BR {BR} warps {wp} {name:11s} {frac(us, dn_bytes)}", flush=True)


def sass():
    """Each probe's sm_90 code counted offline (moe_rows.show_sass)."""
    from moe_rows import show_sass

    s_gu = {"W32": "*i32", "SLOT": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "H": "*fp32", "go": "i32",
            "uo": "i32"}  # fmt: skip
    s_dn = {"W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32", "HS": "*fp32", "Y": "*fp32", "do": "i32"}
    k = lambda sig, **kw: ({**sig, **{c: "constexpr" for c in kw}}, kw)
    for name, mode in MODES.items():
        sig, kw = k(s_gu, F=768, K=8, NB=8, BR=8, MODE=mode, PDL=1, XT=0, CM="", EW="", EX="")
        show_sass(f"gate/up 8,2 {name}", gate_up_probe, sig, kw, 2)
        sig, kw = k(s_dn, D=2048, K=8, NBF=3, BR=4, MODE=mode, PDL=1, XT=0, CM="", EW="", EX="")
        show_sass(f"down 4,1 {name}", down_probe, sig, kw, 1)


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        smoke()
    else:
        gpu()
