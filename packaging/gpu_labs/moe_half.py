"""Half-block lanes for the lean Q4_K MoE kernels (engine.runtime.triton_q4k_moe): a thread owns *half* a Q4_K
block (its 16-byte header and 64 of its 128 quant bytes: sub-blocks 4h … 4h + 3) instead of whole blocks, so a
row's blocks spread over twice the lanes and a program's tile needs half the registers — the lever Nsight
Compute pointed at (the adopted kernels run 1–1.5 warps a scheduler, ~70 % of stalls on loads). Same arithmetic
per sub-block as triton_q4k_moe._dot_block; the two halves' sums meet in the tile's reduction.

- ``gate_up_kernel``: tile [2·NB, BR] (half-blocks × rows), a thread holds the gate and the up half of its lane.
- ``down_kernel``: tile [K·NL, BR], NL = next_power_of_2(2·NBF) half-block lanes an expert (lanes ≥ 2·NBF repeat
  the last half and are dropped), one half a thread.

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_half.py     # parity, no GPU
  PYTHONPATH=. python3 packaging/gpu_labs/moe_half.py                        # + H100 timings (~1 min)
"""
# ruff: noqa: E731, B023

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from engine.quant.formats import QType, block_format
from engine.runtime import triton_q4k_moe as q4
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

Q = QType.Q4_K


@triton.jit
def _load_half(P, hs):
    """Half hs [A, B] (0/1) of the Q4_K blocks at int32 pointers P [A, B]: the header and 4 quant quarters."""
    m = tl.arange(0, 4)[None, None, :]
    p = P[:, :, None] + m
    pq = p + 4 + 16 * hs[:, :, None]
    return tl.load(p), tl.load(pq), tl.load(pq + 4), tl.load(pq + 8), tl.load(pq + 12)


@triton.jit
def _dot_half(blk, hs, X, XDp, XSp, ASM: tl.constexpr):
    """Dot products [A, B] of the loaded halves with the q8 activations of that half: X (int32 pointers to its
    32 XQ words), XDp (its 4 scales), XSp (its 8 half-sums)."""
    m = tl.arange(0, 4)[None, None, :]
    hdr0, s0, s1, s2 = q4._w4(blk[0])
    sc_lo = s0 & 0x3F3F3F3F
    mn_lo = s1 & 0x3F3F3F3F
    sc_hi = (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030)
    mn_hi = ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030)
    scw = tl.where(hs == 0, sc_lo, sc_hi)
    mnw = tl.where(hs == 0, mn_lo, mn_hi)
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
        ia = q4._chain(qa & 0x0F0F0F0F, tl.load(px + 16 * c), zi, ASM)
        ia = q4._chain(qz & 0x0F0F0F0F, tl.load(px + (16 * c + 4)), ia, ASM)
        ib = q4._chain(qa & -0x0F0F0F10, tl.load(px + (16 * c + 8)), zi, ASM)
        ib = q4._chain(qz & -0x0F0F0F10, tl.load(px + (16 * c + 12)), ib, ASM)
        sca = q4._byte(scw, 2 * c, ASM)
        scb = q4._byte(scw, 2 * c + 1, ASM)
        mna = q4._byte(mnw, 2 * c, ASM)
        mnb = q4._byte(mnw, 2 * c + 1, ASM)
        alo += (ia * sca).to(tl.float32) * dx[2 * c]
        ahi += (ib * scb).to(tl.float32) * dx[2 * c + 1]
        amn += mna.to(tl.float32) * (sv[4 * c] + sv[4 * c + 1]) + mnb.to(tl.float32) * (sv[4 * c + 2] + sv[4 * c + 3])
    return d * (alo + ahi * 0.0625) - dmin * amn


@triton.jit
def gate_up_kernel(W32, SLOT, XQ, XD, XS, H, HQ, HD, HS, go, uo, F: tl.constexpr, K: tl.constexpr,
                   NB: tl.constexpr, BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, QH: tl.constexpr):  # fmt: skip
    """QH: h quantized here into HQ/HD/HS (BR a multiple of 32), else float32 into H."""
    qb.pdl_enter(PDL)
    q = tl.program_id(1)
    slot = tl.load(SLOT + q)
    r0 = tl.program_id(0) * BR
    if slot >= 0:
        rows = r0 + tl.arange(0, BR)
        t = q // K
        e = tl.arange(0, 2 * NB)
        b = e // 2
        hs = (e % 2)[:, None] + tl.zeros([2 * NB, BR], dtype=tl.int32)
        off = tl.multiple_of(b[:, None] * 36 + rows[None, :] * (36 * NB), [4, 4])
        gb = _load_half(W32 + tl.multiple_of((slot + go) // 4, 4) + off, hs)
        ub = _load_half(W32 + tl.multiple_of((slot + uo) // 4, 4) + off, hs)
        zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
        X = XQ + t * (64 * NB) + (zp + (b * 64 + (e % 2) * 32)[:, None])
        XDp = XD + t * (8 * NB) + (zp + (b * 8 + (e % 2) * 4)[:, None])
        XSp = XS + t * (16 * NB) + (zp + (b * 16 + (e % 2) * 8)[:, None])
        g = tl.sum(_dot_half(gb, hs, X, XDp, XSp, ASM), axis=0)
        u = tl.sum(_dot_half(ub, hs, X, XDp, XSp, ASM), axis=0)
        h = g / (1.0 + tl.exp(-g)) * u
    else:
        h = tl.zeros([BR], dtype=tl.float32)
    if QH:
        NBLK: tl.constexpr = BR // 32
        words, d, s = t8.quant_tile(tl.reshape(h, [NBLK, 32]), NBLK)
        blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
        t8.store_q8(HQ, HD, HS, q, blk, blk < F // 32, words, d, s, F // 32)
    else:
        tl.store(H + q.to(tl.int64) * F + r0 + tl.arange(0, BR), h)


@triton.jit
def down_kernel(W32, SLOT, HQ, HD, HS, WT, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr,
                BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    qb.pdl_enter(PDL)
    t = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    rows = r0 + tl.arange(0, BR)
    NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
    e = tl.arange(0, K * NL)
    lane = e % NL
    lc = tl.minimum(lane, 2 * NBF - 1)
    b = lc // 2
    hv = lc % 2
    q = t * K + e // NL
    slot = tl.load(SLOT + q)
    keep = (lane < 2 * NBF) & (slot >= 0)
    wk = tl.load(WT + q)
    zp = tl.zeros([K * NL, BR], dtype=tl.int32)
    P = W32 + (tl.multiple_of((tl.maximum(slot, 0) + do) // 4 + b * 36, 4)[:, None] + (rows * (36 * NBF))[None, :])
    hs = hv[:, None] + zp
    blk = _load_half(P, hs)
    X = HQ + (zp + (q * (64 * NBF) + b * 64 + hv * 32)[:, None])
    XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
    XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
    v = _dot_half(blk, hs, X, XDp, XSp, ASM)
    y = tl.sum(tl.where(keep[:, None], v * wk[:, None], 0.0), axis=0)
    tl.store(Y + t * D + rows, y)


def gate_up(pool, slots, xq, roles, K, BR, warps, qh=False):
    """-> h float32 [T·K, F], or (qh) h quantized (HQ, HD, HS)."""
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    XQ, XD, XS = xq
    dev = XQ.device
    pdl = qb.pdl(dev)
    n = slots.numel()
    H = torch.empty((n, F), dtype=torch.float32, device=dev) if not qh else XD
    HQ, HD, HS = (torch.empty((n, F // k), dtype=d, device=dev) for k, d in ((4, torch.int32), (32, torch.float32),
                                                                           (16, torch.float32))) if qh else (XQ, XD, XS)  # fmt: skip
    gate_up_kernel[(F // BR, n)](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, H, HQ, HD, HS, go, uo, F=F, K=K, NB=D // 256, BR=BR,
        ASM=t8.use_asm(dev), PDL=pdl, QH=int(qh), num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return (HQ, HD, HS) if qh else H


def down(pool, slots, hq, weights, roles, K, BR, warps):
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    dev = HQ.device
    pdl = qb.pdl(dev)
    T = slots.numel() // K
    Y = torch.empty((T, D), dtype=torch.float32, device=dev)
    down_kernel[(D // BR, T)](
        pool.reshape(-1).view(torch.int32), slots, HQ, HD, HS, weights, Y, do, D=D, K=K, NBF=F // 256, BR=BR,
        ASM=t8.use_asm(dev), PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def _cfgs(var, default):
    """(rows a program, warps) settings from $GU / $DN ("BR,warps ...")."""
    return [tuple(map(int, a.split(","))) for a in (os.environ.get(var) or default).split()]


def parity(dev):
    from tests.triton_data import expert_pool, routing_case

    rng = np.random.default_rng(3)
    F, D, E, K = (256, 512, 3, 2) if dev == "cpu" else (768, 2048, 16, 8)
    pool, stride, roles = expert_pool((Q, Q, Q), F, D, E, dev, rng)
    for T in (1, 3):
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        slots = slot_off.reshape(-1).contiguous()
        xq = t8.quantize_act(x)
        ref_h = q4.gate_up(pool, slots, x, roles, K, {"BR": 8, "num_warps": 1})
        for BR, wp in _cfgs("GU", "2,1 4,1 8,1 4,2"):
            h = gate_up(pool, slots, xq, roles, K, BR, wp)
            e = ((h - ref_h).norm() / ref_h.norm()).item()
            assert e < 1e-6, (BR, wp, e)
        for BR, wp in _cfgs("GQ", "32,4"):
            got = gate_up(pool, slots, xq, roles, K, BR, wp, qh=True)
            want = t8.quantize_act(gate_up(pool, slots, xq, roles, K, BR, wp))
            assert all(torch.equal(a, b) for a, b in zip(got, want)), ("QH", BR, wp)
        hq = t8.quantize_act(ref_h)
        ref_y = q4.down(pool, slots, ref_h, w, roles, K, {"BR": 4, "num_warps": 1})
        for BR, wp in _cfgs("DN", "1,1 2,1 1,2 4,1"):
            y = down(pool, slots, hq, w, roles, K, BR, wp)
            e = ((y - ref_y).norm() / ref_y.norm()).item()
            assert e < 1e-6, (BR, wp, e)
        print(f"parity T={T}: gate/up and down halves match triton_q4k_moe (< 1e-6)", flush=True)


def gpu():
    import math

    from engine.bench import device_kernels as dk

    bw = dk.measure_bandwidth()
    K, F, D = dk.KE, dk.F, dk.D
    nbytes = dk._moe_bytes(Q)
    gu_bytes = K * 2 * F * block_format(Q).row_bytes(D)
    dn_bytes = nbytes - gu_bytes
    layers = max(48, math.ceil(dk.GB / nbytes))
    pool, stride, roles = dk._slot_pool(Q, layers * K)
    g = torch.Generator().manual_seed(0)
    offs = [((torch.randperm(K, generator=g) + K * i).cuda() * stride).contiguous() for i in range(layers)]
    x = torch.randn(1, D, device="cuda")
    w = torch.rand(1, K, device="cuda")
    xq = t8.quantize_act(x)
    hq = t8.quantize_act(torch.randn(K, F, device="cuda"))
    frac = lambda us, nb: f"{us:6.2f} us ({nb / us / 1e3 / bw:4.0%})"
    graph = lambda calls: dk._graph_us(calls)[0]
    print(
        f"{torch.cuda.get_device_name()}: bw {bw:.0f} GB/s; gate/up {gu_bytes / 1e6:.1f} MB, down {dn_bytes / 1e6:.1f} MB"
    )
    XQ, XD, XS = xq
    GU, DN = _cfgs("GU", "2,1 4,1 8,1 4,2 8,2"), _cfgs("DN", "1,1 2,1 1,2 4,1 2,2")
    for BR, wp in ((8, 1),):
        cfg = {"BR": BR, "num_warps": wp}
        us = graph([lambda o=o: q4._gate_up_kernel[(F // BR, K)](
            pool.reshape(-1).view(torch.int32), o, XQ, XD, XS, torch.empty((K, F), device="cuda"), roles["gate"][0],
            roles["up"][0], F=F, K=K, NB=D // 256, BR=BR, ASM=True, PDL=qb.pdl(x.device), num_warps=wp,
            **qb.launch_kw(qb.pdl(x.device))) for o in offs])  # fmt: skip
        print(f"gate/up whole blocks {cfg}: {frac(us, gu_bytes)}", flush=True)
    for BR, wp in GU:
        us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, BR, wp) for o in offs])
        print(f"gate/up halves BR {BR} warps {wp}: {frac(us, gu_bytes)}", flush=True)
    for BR in (4,):
        us = graph([lambda o=o: _down_whole(pool, o, hq, w, roles, K, BR) for o in offs])
        print(f"down whole blocks BR {BR}: {frac(us, dn_bytes)}", flush=True)
    for BR, wp in DN:
        us = graph([lambda o=o: down(pool, o, hq, w, roles, K, BR, wp) for o in offs])
        print(f"down halves BR {BR} warps {wp}: {frac(us, dn_bytes)}", flush=True)

    for BR, wp in _cfgs("GQ", "32,4 32,8 64,8"):
        us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, BR, wp, qh=True) for o in offs])
        print(f"gate/up halves, h quantized, BR {BR} warps {wp}: {frac(us, gu_bytes)}", flush=True)
    # whole calls (21.2 MB)
    from engine.runtime import triton_moe as tm

    g8, d4 = _cfgs("GBEST", "8,2")[0], _cfgs("DBEST", "4,1")[0]
    gq = _cfgs("GQBEST", "32,8")[0]
    os.environ["SHARPI_MOE_ONE"] = "0"
    calls = {
        "production (quantize x, gate/up, quantize h, down)": lambda o: tm.moe_decode(
            pool, o.view(1, K), x, w, roles, act="q8"
        ),
        "halves: quantize x, gate/up, quantize h, down": lambda o: down(
            pool, o, t8.quantize_act(gate_up(pool, o, t8.quantize_act(x), roles, K, *g8)), w, roles, K, *d4
        ),
        "halves: quantize x, gate/up + h quantized, down": lambda o: down(
            pool, o, gate_up(pool, o, t8.quantize_act(x), roles, K, *gq, qh=True), w, roles, K, *d4
        ),
        "halves, x quantized before: gate/up, quantize h, down": lambda o: down(
            pool, o, t8.quantize_act(gate_up(pool, o, xq, roles, K, *g8)), w, roles, K, *d4
        ),
        "halves, x quantized before: gate/up + h quantized, down": lambda o: down(
            pool, o, gate_up(pool, o, xq, roles, K, *gq, qh=True), w, roles, K, *d4
        ),
    }
    for label, fn in calls.items():
        us = graph([lambda o=o: fn(o) for o in offs])
        print(f"{label}: {frac(us, nbytes)}", flush=True)
    # what x̂ costs the ffn norm's launch (step_kernels.add_rms_norm(q8=True)), 96 norms a graph
    from engine.runtime import step_kernels as sk

    xs = [torch.randn(1, D, device="cuda") for _ in range(96)]
    nw = torch.randn(D, device="cuda")
    for q8 in (False, True):
        us = graph([lambda v=v: sk.add_rms_norm(v, v, nw, 1e-6, q8=q8) for v in xs])
        print(f"add_rms_norm D={D} q8={q8}: {us:.2f} us a launch", flush=True)


def _down_whole(pool, slots, hq, w, roles, K, BR):
    """triton_q4k_moe's down kernel alone (h already quantized)."""
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    pdl = qb.pdl(HQ.device)
    Y = torch.empty((1, D), dtype=torch.float32, device="cuda")
    flat = pool.reshape(-1)
    q4._down_kernel[(D // BR, 1)](
        flat, flat.view(torch.int32), slots, HQ, HD, HS, w, Y, do, D=D, K=K, NBF=F // 256, BR=BR, ASM=True, PDL=pdl,
        PF=qb.prefetch(pdl), NT=32, num_warps=1, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        parity("cpu")
    else:
        parity("cuda")
        gpu()
    sys.exit(0)
