"""Where the down matrices' bytes should leave HBM in the Q4_K routed-expert chain (gate/up, quantize h, down;
triton_q4k_moe). The read floor that reaches 81 % on these bytes (engine/bench/read_floor.py) lets each launch
prefetch its *successor's* bytes into L2; the engine's chain does not: the down reads its 7.1 MB from HBM in
its own launch, after the gate/up's stream has drained (moe_probe.py: its weights alone read at 49 %).

Variants, each a whole call with x̂ given (bit for bit the engine's arithmetic — only prefetches move):
  engine        gate/up, quantize h, down (PF 0: no prefetch anywhere)
  gu-pf         the gate/up kernel, after its PDL wait (the slots are known then), bulk-prefetches each pair's
                down matrix into L2, a 1/(F/BR) share a program (cp.async.bulk.prefetch.L2)
  q-pf          the quantize-h kernel prefetches them before its own wait (it starts while the gate/up runs)
  gu-pf+q-pf    half the bytes each

  down-kgN      (SPLITS) the down over N expert groups, float atomics into y zeroed by the quantize launch

Measured on the H100 (session 10, docs/benchmarks-gpu.md): every placement is slower than none (15.1–15.5 µs a
call against 14.2–14.3); the down takes ~5 µs from L2 as from HBM; the expert-group downs 14.6–16.8. Not adopted.

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_prefetch.py    # parity (no GPU, no prefetch)
  PYTHONPATH=. python3 packaging/gpu_labs/moe_prefetch.py                       # + H100 chain timings
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


@triton.jit
def _prefetch_share(W, SLOT, q, do, nbytes, part, parts, lo, hi, NT: tl.constexpr):
    """Prefetch share ``part`` of ``parts`` of the byte range [lo, hi)·nbytes of pair q's down matrix (at byte
    do of its slot; slot −1: nothing)."""
    slot = tl.load(SLOT + q)
    a = nbytes * lo
    n = nbytes * (hi - lo)
    share = (n // parts + 15) // 16 * 16
    start = part.to(tl.int64) * share
    qb.prefetch_l2(W, slot + do + a + start, tl.where(slot >= 0, tl.minimum(share, n - start), 0), NT)


@triton.jit
def gate_up_pf_kernel(W, W32, SLOT, XQ, XD, XS, H, go, uo, do, down_bytes, F: tl.constexpr, K: tl.constexpr,
                      NB: tl.constexpr, BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, LO: tl.constexpr,
                      HI: tl.constexpr, NT: tl.constexpr, PF: tl.constexpr):  # fmt: skip
    """The engine's gate/up kernel; after the wait it prefetches its share of bytes [LO, HI)/2 of pair q's down."""
    qb.pdl_enter(PDL)
    q = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    if HI > LO and PF:
        _prefetch_share(W, SLOT, q, do, down_bytes // 2, tl.program_id(0), F // BR, LO, HI, NT)
    h = q4._gate_up_rows(W32, SLOT, XQ, XD, XS, go, uo, q, r0, K, NB, BR, ASM)
    tl.store(H + q.to(tl.int64) * F + r0 + tl.arange(0, BR), h)


@triton.jit
def quant_pf_kernel(X, XQ, XD, XS, n32, W, SLOT, do, down_bytes, Y, NY, NBLK: tl.constexpr, PDL: tl.constexpr,
                    LO: tl.constexpr, HI: tl.constexpr, PF: tl.constexpr, ZY: tl.constexpr):  # fmt: skip
    """triton_q8's quantize kernel over h rows (a row a pair); before its wait it prefetches its share of bytes
    [LO, HI)/2 of the pair's down matrix (the slots were final before the gate/up kernel released this one).
    ZY: it also zeroes the NY floats of Y (the down kernel that adds into them runs after this one)."""
    r = tl.program_id(1)
    if HI > LO and PF:
        _prefetch_share(W, SLOT, r, do, down_bytes // 2, tl.program_id(0), tl.num_programs(0), LO, HI, 32)
    qb.pdl_enter(PDL)
    blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
    bm = blk < n32
    x = tl.load(X + r.to(tl.int64) * (32 * n32) + blk[:, None] * 32 + tl.arange(0, 32)[None, :], mask=bm[:, None],
                other=0.0)  # fmt: skip
    words, d, s = t8.quant_tile(x, NBLK)
    t8.store_q8(XQ, XD, XS, r, blk, bm, words, d, s, n32)
    if ZY:
        p = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        share = tl.cdiv(NY, tl.num_programs(0) * tl.num_programs(1))
        i = p * share + tl.arange(0, 256)
        for j in range(0, share, 256):
            tl.store(Y + i + j, tl.zeros([256], dtype=tl.float32), mask=(i + j < NY) & (j + tl.arange(0, 256) < share))


@triton.jit
def down_kg_kernel(W32, SLOT, HQ, HD, HS, WT, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr,
                   BR: tl.constexpr, KG: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The engine's down kernel (PF 0) over K/KG of the token's experts a program (grid axis 2 picks which),
    its rows' partial sums added into Y (zeroed by the quantize-h launch) with float atomics: KG times the
    warps, a KG-th of the serial work a thread."""
    qb.pdl_enter(PDL)
    t = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    KP: tl.constexpr = K // KG
    RW: tl.constexpr = q4.BLOCK_WORDS * NBF
    rows = r0 + tl.arange(0, BR)
    NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
    # this program's KP experts: lanes KP·NL·g … of the token's K·NL
    b, hv, q, slot, keep, wk = q4._down_lanes(SLOT, WT, t, tl.program_id(2) * (KP * NL) + tl.arange(0, KP * NL), K, NBF)
    zp = tl.zeros([KP * NL, BR], dtype=tl.int32)
    P = W32 + (tl.multiple_of((tl.maximum(slot, 0) + do) // 4 + b * q4.BLOCK_WORDS, 4)[:, None] + (rows * RW)[None, :])
    hs = hv[:, None] + zp
    X = HQ + (zp + (q * (64 * NBF) + b * 64 + hv * 32)[:, None])
    XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
    XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
    v = q4._dot_half(q4._load_half(P, hs), hs, X, XDp, XSp, ASM)
    y = tl.sum(tl.where(keep[:, None], v * wk[:, None], 0.0), axis=0)
    tl.atomic_add(Y + t * D + rows, y, sem="relaxed")


def down_kg(pool, slots, hq, weights, roles, K, Y, KG, BR=4, warps=1):
    """down_kg_kernel into Y (already zero) -> Y."""
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    pdl = qb.pdl(HQ.device)
    T = slots.numel() // K
    down_kg_kernel[(D // BR, T, KG)](
        pool.reshape(-1).view(torch.int32), slots, HQ, HD, HS, weights, Y, do, D=D, K=K, NBF=F // 256, BR=BR, KG=KG,
        ASM=t8.use_asm(HQ.device), PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def gate_up(pool, slots, xq, roles, K, lo=0, hi=0, BR=8, warps=2):
    (go, _, F, D), (uo, _, _, _), (do, _, Dd, Fd) = roles["gate"], roles["up"], roles["down"]
    XQ, XD, XS = xq
    pdl = qb.pdl(XQ.device)
    flat = pool.reshape(-1)
    H = torch.empty((slots.numel(), F), dtype=torch.float32, device=XQ.device)
    gate_up_pf_kernel[(F // BR, slots.numel())](
        flat, flat.view(torch.int32), slots, XQ, XD, XS, H, go, uo, do, Dd * (Fd // 256) * 144, F=F, K=K, NB=D // 256,
        BR=BR, ASM=t8.use_asm(XQ.device), PDL=pdl, LO=lo, HI=hi, NT=32 * warps, PF=qb.prefetch(pdl), num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return H


def quantize_h(H, pool, slots, roles, lo=0, hi=0, nblk=8, Y=None):
    """triton_q8.quantize_act(H) with the down prefetch share [lo, hi)/2 -> (HQ, HD, HS); Y: zeroed too."""
    do, _, Dd, Fd = roles["down"]
    R, n = H.shape
    n32 = n // 32
    XQ = torch.empty((R, n // 4), dtype=torch.int32, device=H.device)
    XD = torch.empty((R, n32), dtype=torch.float32, device=H.device)
    XS = torch.empty((R, 2 * n32), dtype=torch.float32, device=H.device)
    pdl = qb.pdl(H.device)
    quant_pf_kernel[(triton.cdiv(n32, nblk), R)](
        H, XQ, XD, XS, n32, pool.reshape(-1), slots, do, Dd * (Fd // 256) * 144, XD if Y is None else Y,
        0 if Y is None else Y.numel(), NBLK=nblk, PDL=pdl, LO=lo, HI=hi, PF=qb.prefetch(pdl), ZY=Y is not None,
        num_warps=1, **qb.launch_kw(pdl),
    )  # fmt: skip
    return XQ, XD, XS


# (gate/up share, quantize share) of the down bytes, in halves
VARIANTS = {"engine": ((0, 0), (0, 0)), "gu-pf": ((0, 2), (0, 0)), "q-pf": ((0, 0), (0, 2)),
            "gu-pf+q-pf": ((0, 1), (1, 2))}  # fmt: skip


SPLITS = ("down-kg2", "down-kg4", "down-kg8")


def call(pool, slots, xq, w, roles, K, v, gu=(8, 2), dn=(4, 1)):
    if v.startswith("down-kg"):  # the split down: quantize h zeroes y
        KG = int(v[7:])
        H = gate_up(pool, slots, xq, roles, K, 0, 0, *gu)
        Y = torch.empty((slots.numel() // K, roles["down"][2]), dtype=torch.float32, device=H.device)
        return down_kg(pool, slots, quantize_h(H, pool, slots, roles, Y=Y), w, roles, K, Y, KG, *dn)
    (glo, ghi), (qlo, qhi) = VARIANTS[v]
    H = gate_up(pool, slots, xq, roles, K, glo, ghi, *gu)
    hq = quantize_h(H, pool, slots, roles, qlo, qhi)
    return moe_half.down(pool, slots, hq, w, roles, K, *dn, pf=0)


def parity(dev):
    import numpy as np

    from engine.runtime import triton_moe as tm
    from tests.triton_data import expert_pool, routing_case

    rng = np.random.default_rng(5)
    F, D, E, K = (256, 512, 3, 2) if dev == "cpu" else (768, 2048, 16, 8)
    pool, stride, roles = expert_pool((moe_half.Q,) * 3, F, D, E, dev, rng)
    for T in (1, 2):
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        slots = slot_off.reshape(-1).contiguous()
        ref = tm.moe_decode(pool, slot_off, x, w, roles, act="q8") if dev != "cpu" else None
        xq = t8.quantize_act(x)
        want = moe_half.down(pool, slots, t8.quantize_act(q4.gate_up(pool, slots, x, roles, K, {"BR": 8, "num_warps": 2},
                                                                      xq)), w, roles, K, 4, 1)  # fmt: skip
        for v in VARIANTS:
            y = call(pool, slots, xq, w, roles, K, v)
            assert torch.equal(y, want), v
        for v in (v for v in SPLITS if int(v[7:]) <= K):
            y = call(pool, slots, xq, w, roles, K, v)
            e = ((y - want).norm() / want.norm()).item()
            assert e < 1e-6, (v, e)  # atomics sum in another order
            if ref is not None:
                assert ((y - ref).norm() / ref.norm()).item() < 1e-6, v
        print(f"parity T={T}: every prefetch placement gives the engine's result bit for bit", flush=True)


def gpu():
    parity("cuda")
    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    for dn in moe_half.cfgs("DN", "4,1 8,1 8,2"):
        for v in SPLITS:
            us = graph([lambda o=o: call(pool, o, xq, w, roles, K, v, dn=dn) for o in offs])
            print(f"call down {dn} {v:12s} {frac(us, nbytes)}", flush=True)
    for gu in moe_half.cfgs("GU", "8,2"):
        for v in VARIANTS:
            us = graph([lambda o=o: call(pool, o, xq, w, roles, K, v, gu) for o in offs])
            print(f"call gate/up {gu} {v:12s} {frac(us, nbytes)}", flush=True)
    # where the time goes in the best placement: each launch alone (its predecessor's prefetch done or not)
    for v in ("engine", "gu-pf"):
        (glo, ghi), _ = VARIANTS[v]
        us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, glo, ghi) for o in offs])
        print(f"gate/up alone {v:12s} {frac(us, gu_bytes)}", flush=True)


if __name__ == "__main__":
    parity("cpu") if os.environ.get("TRITON_INTERPRET") == "1" else gpu()
