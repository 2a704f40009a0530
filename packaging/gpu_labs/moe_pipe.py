"""Persistent, software-pipelined Q4_K MoE kernels: a grid of P programs (a few per SM) that each walk
several row tiles, the loads of tile i + 1 issued before tile i's arithmetic, against the engine's
one-wave kernels (triton_q4k_moe: 768 gate/up programs, 512 down programs, every load issued at
once and the arithmetic after); and ``down_blocks_kernel``, the down without the engine's repeated
lanes. Same arithmetic (the engine's _load_half/_dot_half): bit for bit the engine's in the interpreter,
< 1e-6 compiled (ptxas contracts the float ops differently). Measured on the H100 (session 7,
docs/benchmarks-gpu.md), not adopted: the best pipelined gate/up equals the one wave (7.94 against
7.97 µs), every pipelined down is slower (5.9 against 5.4), and the block-loop down too (6.8–8.1).

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_pipe.py     # parity, no GPU
  PYTHONPATH=. python3 packaging/gpu_labs/moe_pipe.py                        # + H100 sweep
  (GP / DP = "BR,warps,programs-per-SM,DB ..." choose the gate/up and down settings swept; DB 0 = no
  double buffer, a tile's loads then its arithmetic)
"""
# ruff: noqa: E731, B023

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_half  # noqa: E402  (its chain_setup: the timed chain; cfgs)

from engine.quant.formats import QType  # noqa: E402
from engine.runtime import triton_q4k_moe as q4  # noqa: E402
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

Q = QType.Q4_K
BW = q4.BLOCK_WORDS


@triton.jit
def _load_half_m(P, hs, u, NU, slot):
    """triton_q4k_moe._load_half with every load masked off where u >= NU or slot < 0 (slot a scalar or
    [A]): a tile past the end, or a skipped pair, loads nothing."""
    p = P[:, :, None] + tl.arange(0, 4)[None, None, :]
    pq = p + 4 + 16 * hs[:, :, None]
    z = hs * 0  # tensor compares (the interpreter rejects a mask built from scalar ones)
    m = (((z + u) < NU) & ((z + slot) >= 0))[:, :, None]
    return (tl.load(p, mask=m), tl.load(pq, mask=m), tl.load(pq + 4, mask=m), tl.load(pq + 8, mask=m),
            tl.load(pq + 12, mask=m))  # fmt: skip


@triton.jit
def _gu_fetch(W32, SLOT, u, NU, TK, go, uo, off, hs, RW: tl.constexpr, BR: tl.constexpr):
    """Unit u (pair q = u % TK, row tile u // TK): its slot and the gate and up halves of its tile."""
    ok = u < NU
    uc = tl.minimum(u, NU - 1)
    q = uc % TK
    r0 = (uc // TK) * BR
    slot = tl.load(SLOT + q)
    base = tl.maximum(slot, 0) // 4 + r0 * RW
    gb = _load_half_m(W32 + tl.multiple_of(base + go // 4, 4) + off, hs, u, NU, slot)
    ub = _load_half_m(W32 + tl.multiple_of(base + uo // 4, 4) + off, hs, u, NU, slot)
    return gb, ub, q, r0, slot, ok


@triton.jit
def gate_up_pipe_kernel(W32, SLOT, XQ, XD, XS, H, go, uo, NU, TK, F: tl.constexpr, K: tl.constexpr,
                        NB: tl.constexpr, BR: tl.constexpr, ITERS: tl.constexpr, DB: tl.constexpr,
                        ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The engine's gate/up rows over units u = pid, pid + P, … (ITERS of them), tile i + 1's loads
    in flight during tile i's arithmetic (DB)."""
    qb.pdl_enter(PDL)
    P = tl.num_programs(0)
    RW: tl.constexpr = BW * NB
    e = tl.arange(0, 2 * NB)
    b = e // 2
    zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
    hs = (e % 2)[:, None] + zp
    off = b[:, None] * BW + tl.arange(0, BR)[None, :] * RW
    u = tl.program_id(0)
    gb, ub, q, r0, slot, ok = _gu_fetch(W32, SLOT, u, NU, TK, go, uo, off, hs, RW, BR)
    for i in tl.static_range(ITERS):
        if DB and i + 1 < ITERS:
            gn, un, qn, rn, sn, okn = _gu_fetch(W32, SLOT, u + P, NU, TK, go, uo, off, hs, RW, BR)
        t = q // K
        X = XQ + t * (64 * NB) + (zp + (b * 64 + (e % 2) * 32)[:, None])
        XDp = XD + t * (8 * NB) + (zp + (b * 8 + (e % 2) * 4)[:, None])
        XSp = XS + t * (16 * NB) + (zp + (b * 16 + (e % 2) * 8)[:, None])
        g = tl.sum(q4._dot_half(gb, hs, X, XDp, XSp, ASM), axis=0)
        v = tl.sum(q4._dot_half(ub, hs, X, XDp, XSp, ASM), axis=0)
        h = tl.where(slot >= 0, g / (1.0 + tl.exp(-g)) * v, 0.0)
        tl.store(
            H + q.to(tl.int64) * F + r0 + tl.arange(0, BR),
            h,
            mask=(r0 + tl.arange(0, BR) >= 0) & (tl.arange(0, BR) * 0 + u < NU),
        )
        if i + 1 < ITERS:
            if DB:
                gb, ub, q, r0, slot, ok = gn, un, qn, rn, sn, okn
            else:
                gb, ub, q, r0, slot, ok = _gu_fetch(W32, SLOT, u + P, NU, TK, go, uo, off, hs, RW, BR)
            u += P


@triton.jit
def _dn_fetch(W32, SLOT, u, NU, T, do, b, lane, NL: tl.constexpr, NBF: tl.constexpr, K: tl.constexpr,
              BR: tl.constexpr, RW: tl.constexpr, hs):  # fmt: skip
    """Unit u (token u % T, row tile u // T) of the down: its pairs' slots and its tile's halves."""
    ok = u < NU
    uc = tl.minimum(u, NU - 1)
    t = uc % T
    r0 = (uc // T) * BR
    q = t * K + tl.arange(0, K * NL) // NL
    slot = tl.load(SLOT + q)
    rows = r0 + tl.arange(0, BR)
    P = W32 + (tl.multiple_of((tl.maximum(slot, 0) + do) // 4 + b * BW, 4)[:, None] + (rows * RW)[None, :])
    return _load_half_m(P, hs, u, NU, slot[:, None]), t, r0, q, slot, ok


@triton.jit
def down_pipe_kernel(W32, SLOT, HQ, HD, HS, WT, Y, do, NU, T, D: tl.constexpr, K: tl.constexpr,
                     NBF: tl.constexpr, BR: tl.constexpr, ITERS: tl.constexpr, DB: tl.constexpr,
                     ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The engine's down over row tiles u = pid, pid + P, …, pipelined like gate_up_pipe_kernel."""
    qb.pdl_enter(PDL)
    P = tl.num_programs(0)
    RW: tl.constexpr = BW * NBF
    NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
    e = tl.arange(0, K * NL)
    lane = e % NL
    lc = tl.minimum(lane, 2 * NBF - 1)
    b = lc // 2
    hv = lc % 2
    zp = tl.zeros([K * NL, BR], dtype=tl.int32)
    hs = hv[:, None] + zp
    u = tl.program_id(0)
    blk, t, r0, q, slot, ok = _dn_fetch(W32, SLOT, u, NU, T, do, b, lane, NL, NBF, K, BR, RW, hs)
    for i in tl.static_range(ITERS):
        if DB and i + 1 < ITERS:
            bn, tn, rn, qn, sn, okn = _dn_fetch(W32, SLOT, u + P, NU, T, do, b, lane, NL, NBF, K, BR, RW, hs)
        keep = (lane < 2 * NBF) & (slot >= 0)
        wk = tl.load(WT + q)
        X = HQ + (zp + (q * (64 * NBF) + b * 64 + hv * 32)[:, None])
        XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
        XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
        v = q4._dot_half(blk, hs, X, XDp, XSp, ASM)
        y = tl.sum(tl.where(keep[:, None], v * wk[:, None], 0.0), axis=0)
        tl.store(
            Y + t * D + r0 + tl.arange(0, BR), y, mask=(r0 + tl.arange(0, BR) >= 0) & (tl.arange(0, BR) * 0 + u < NU)
        )
        if i + 1 < ITERS:
            if DB:
                blk, t, r0, q, slot, ok = bn, tn, rn, qn, sn, okn
            else:
                blk, t, r0, q, slot, ok = _dn_fetch(W32, SLOT, u + P, NU, T, do, b, lane, NL, NBF, K, BR, RW, hs)
            u += P


@triton.jit
def down_blocks_kernel(W32, SLOT, HQ, HD, HS, WT, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr,
                       BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The engine's down without its padded lanes: a [2·K, BR] tile of (expert, half) × rows walks a row's
    NBF blocks in an unrolled loop (the engine puts experts × next_power_of_2(2·NBF) lanes on one axis:
    at NBF = 3 a quarter of its lanes repeat a half and are dropped)."""
    t = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    qb.pdl_enter(PDL)
    RW: tl.constexpr = BW * NBF
    rows = r0 + tl.arange(0, BR)
    e = tl.arange(0, 2 * K)
    hv = e % 2
    q = t * K + e // 2
    slot = tl.load(SLOT + q)
    wk = tl.load(WT + q)
    zp = tl.zeros([2 * K, BR], dtype=tl.int32)
    hs = hv[:, None] + zp
    base = (tl.maximum(slot, 0) + do) // 4
    acc = tl.zeros([2 * K, BR], dtype=tl.float32)
    for b in tl.static_range(NBF):
        P = W32 + (tl.multiple_of(base + b * BW, 4)[:, None] + (rows * RW)[None, :])
        X = HQ + (zp + (q * (64 * NBF) + b * 64 + hv * 32)[:, None])
        XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
        XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
        acc += q4._dot_half(q4._load_half(P, hs), hs, X, XDp, XSp, ASM)
    y = tl.sum(tl.where((slot >= 0)[:, None], acc * wk[:, None], 0.0), axis=0)
    tl.store(Y + t * D + rows, y)


def down_blocks(pool, slots, hq, weights, roles, K, BR, warps):
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    dev = HQ.device
    pdl = qb.pdl(dev)
    T = slots.numel() // K
    Y = torch.empty((T, D), dtype=torch.float32, device=dev)
    down_blocks_kernel[(D // BR, T)](
        pool.reshape(-1).view(torch.int32), slots, HQ, HD, HS, weights, Y, do, D=D, K=K, NBF=F // 256, BR=BR,
        ASM=t8.use_asm(dev), PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def _programs(nu, per_sm):
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
    return min(nu, per_sm * sms)


def gate_up(pool, slots, xq, roles, K, BR, warps, per_sm, db):
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    XQ, XD, XS = xq
    dev = XQ.device
    pdl = qb.pdl(dev)
    tk = slots.numel()
    nu = tk * (F // BR)
    P = _programs(nu, per_sm)
    H = torch.empty((tk, F), dtype=torch.float32, device=dev)
    gate_up_pipe_kernel[(P,)](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, H, go, uo, nu, tk, F=F, K=K, NB=D // 256, BR=BR,
        ITERS=triton.cdiv(nu, P), DB=db, ASM=t8.use_asm(dev), PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return H


def down(pool, slots, hq, weights, roles, K, BR, warps, per_sm, db):
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    dev = HQ.device
    pdl = qb.pdl(dev)
    T = slots.numel() // K
    nu = T * (D // BR)
    P = _programs(nu, per_sm)
    Y = torch.empty((T, D), dtype=torch.float32, device=dev)
    down_pipe_kernel[(P,)](
        pool.reshape(-1).view(torch.int32), slots, HQ, HD, HS, weights, Y, do, nu, T, D=D, K=K, NBF=F // 256, BR=BR,
        ITERS=triton.cdiv(nu, P), DB=db, ASM=t8.use_asm(dev), PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def parity(dev):
    from tests.triton_data import expert_pool, routing_case

    rng = np.random.default_rng(3)
    F, D, E, K = (512, 512, 3, 2) if dev == "cpu" else (768, 2048, 16, 8)
    pool, stride, roles = expert_pool((Q, Q, Q), F, D, E, dev, rng)
    gcf = moe_half.cfgs("GP", "8,2,1,1 4,2,1,0") if dev == "cpu" else moe_half.cfgs("GP", "8,2,2,1 8,4,2,1 4,2,3,1 8,2,2,0")
    dcf = moe_half.cfgs("DP", "4,2,1,1 2,1,1,0") if dev == "cpu" else moe_half.cfgs("DP", "4,4,2,1 4,2,2,1 2,2,2,0")
    for T in (1, 3):
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        slots = slot_off.reshape(-1).contiguous()
        xq = t8.quantize_act(x)
        ref_h = q4.gate_up(pool, slots, x, roles, K, {"BR": 8, "num_warps": 2}, xq)
        for c in gcf:
            h = gate_up(pool, slots, xq, roles, K, *c)
            e = ((h - ref_h).norm() / ref_h.norm()).item()  # bit for bit in the interpreter; ptxas may contract
            assert e < 1e-6, ("gate/up", c, e)  # the two kernels' float ops differently
        ref_y = q4.down(pool, slots, ref_h, w, roles, K, {"BR": 4, "num_warps": 1, "PF": 0})
        hq = t8.quantize_act(ref_h)
        for c in moe_half.cfgs("DB", "4,1 8,2") if dev == "cpu" else moe_half.cfgs("DB", "4,1 8,2 2,1 16,4"):
            y = down_blocks(pool, slots, hq, w.to(torch.float32).contiguous(), roles, K, *c)
            e = ((y - ref_y).norm() / ref_y.norm()).item()
            assert e < 1e-6, ("down blocks", c, e)
        for c in dcf:
            y = down(pool, slots, hq, w.to(torch.float32).contiguous(), roles, K, *c)
            e = ((y - ref_y).norm() / ref_y.norm()).item()
            assert e < 1e-6, ("down", c, e)
    print("parity: the pipelined kernels equal the engine's (< 1e-6)", flush=True)


def gpu():
    from engine.runtime import triton_moe as tm

    _, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    us = graph([lambda o=o: q4.gate_up(pool, o, x, roles, K, {"BR": 8, "num_warps": 2}, xq) for o in offs])
    print(f"gate/up engine (8 rows x 2 warps, one wave): {frac(us, gu_bytes)}", flush=True)
    best_g = (us, None)
    for c in moe_half.cfgs("GP", "8,2,3,1"):
        try:
            us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, *c) for o in offs])
        except Exception as ex:  # noqa: BLE001  (a setting that does not compile: report and go on)
            print(f"gate/up pipe {c}: {type(ex).__name__} {str(ex)[:120]}", flush=True)
            continue
        print(f"gate/up pipe BR,warps,per-SM,DB {c}: {frac(us, gu_bytes)}", flush=True)
        best_g = min(best_g, (us, c), key=lambda z: z[0])
    wf = w.to(torch.float32).contiguous()
    us = graph([lambda o=o: down_engine(pool, o, hq, wf, roles, K) for o in offs])
    print(f"down engine (4 rows x 1 warp, one wave): {frac(us, dn_bytes)}", flush=True)
    best_d = (us, None)
    for c in moe_half.cfgs("DB", "4,1 2,1 8,1 8,2 4,2 16,2 16,4 8,4 32,4"):
        us = graph([lambda o=o: down_blocks(pool, o, hq, wf, roles, K, *c) for o in offs])
        print(f"down blocks-loop BR,warps {c}: {frac(us, dn_bytes)}", flush=True)
        best_d = min(best_d, (us, ("blocks",) + c), key=lambda z: z[0])
    for c in moe_half.cfgs("DP", "4,2,2,1"):
        try:
            us = graph([lambda o=o: down(pool, o, hq, wf, roles, K, *c) for o in offs])
        except Exception as ex:  # noqa: BLE001
            print(f"down pipe {c}: {type(ex).__name__} {str(ex)[:120]}", flush=True)
            continue
        print(f"down pipe BR,warps,per-SM,DB {c}: {frac(us, dn_bytes)}", flush=True)
        best_d = min(best_d, (us, c), key=lambda z: z[0])
    print(f"best gate/up {best_g}, best down {best_d}", flush=True)
    calls = {"engine moe_decode (x̂ given)": lambda o: tm.moe_decode(pool, o.view(1, K), x, w, roles, act="q8", xq=xq)}
    if best_d[1] and best_d[1][0] == "blocks":
        calls["engine gate/up, quantize h, blocks-loop down"] = lambda o: down_blocks(
            pool,
            o,
            t8.quantize_act(q4.gate_up(pool, o, x, roles, K, {"BR": 8, "num_warps": 2}, xq)),
            wf,
            roles,
            K,
            *best_d[1][1:],
        )
    for label, fn in calls.items():
        us = graph([lambda o=o: fn(o) for o in offs])
        print(f"whole call, {label}: {frac(us, nbytes)}", flush=True)


def down_engine(pool, slots, hq, wf, roles, K):
    """The engine's down kernel on h already quantized (4 rows x 1 warp, PF 0)."""
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    dev = HQ.device
    pdl = qb.pdl(dev)
    Y = torch.empty((1, D), dtype=torch.float32, device=dev)
    flat = pool.reshape(-1)
    q4._down_kernel[(D // 4, 1)](
        flat, flat.view(torch.int32), slots, HQ, HD, HS, wf, Y, do, D=D, K=K, NBF=F // 256, BR=4,
        ASM=t8.use_asm(dev), PDL=pdl, PF=0, NT=32, num_warps=1, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        parity("cpu")
    else:
        parity("cuda")
        gpu()
    sys.exit(0)
