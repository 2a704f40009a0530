"""The routed experts of a decode token in ONE launch, split along the expert width F instead of by phase:
program (j, q) computes h's 32·R rows j·32R … of pair q (gate/up, SiLU — the engine's half-block code,
triton_q4k_moe._gate_up_rows), rounds them to q8 itself (they are whole q8 blocks: triton_q8's rule, no
other program needed), then multiplies the down matrix's matching 32·R columns (sub-blocks of one Q4_K
block, all D rows) by them and adds w_q · that into Y[t] with float atomics. No quantize-h launch, no second
weight launch, no ramp between them; the down bytes can be prefetched into L2 while the gate/up rows stream.
The cost: a float atomic a row a program (D · F/(32R) · K of them), and each program reads the 16-byte header
and 32 quant bytes of every down row (L2 serves the siblings' share; HBM reads each byte once).

Y must be zero before the launch: the launch zeroes the *next* call's buffer (after its PDL wait), the
engine's form of which is "the consumer zeroes what it read".

Measured on the H100 (2026-11-22, docs/benchmarks-gpu.md "Session 9"): slower. Best 16.49 µs (R 2, 8 warps)
against the engine's 14.17 µs for the same 21.2 MB; plain stores instead of the atomics change nothing
(18.49 against 18.67 µs at R 2, 16 warps), so the loss is each program's down phase waiting behind its own
gate/up phase — and one 21.2 MB read launch reaches 82 % of the copy bandwidth, the same as the two
launches (81 %), so the launch count was not what held the engine's call at 50 %.

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_split.py     # parity, no GPU
  PYTHONPATH=. python3 packaging/gpu_labs/moe_split.py                        # + H100 timings
  (SP = "R,warps,RC,PF,ATOM ..." settings swept: R sub-blocks a program, rows a phase-2 chunk, the down
  prefetch, atomics (0: plain stores, wrong sums, timing only))
"""
# ruff: noqa: E731, B023

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_half import cfgs  # noqa: E402  ("a,b,... a,b,..." launch settings from $var)

from engine.quant.formats import QType  # noqa: E402
from engine.runtime import triton_q4k_moe as q4  # noqa: E402
from engine.runtime import triton_q8 as t8  # noqa: E402
from engine.runtime import triton_qblocks as qb  # noqa: E402

Q = QType.Q4_K


@triton.jit
def _split4(t):
    """[A, 4] -> its 4 columns (a thread holds all 4)."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _dot8(q0, q1, q2, q3, q4_, q5, q6, q7, HW, ASM: tl.constexpr):
    """Σ over 32 nibbles (8 words [A], already masked) × the 8 ĥ words at HW (uniform loads)."""
    z = tl.zeros(q0.shape, dtype=tl.int32)
    s = q4._dp4a(q0, tl.load(HW + 0), z, ASM)
    s = q4._dp4a(q1, tl.load(HW + 1), s, ASM)
    s = q4._dp4a(q2, tl.load(HW + 2), s, ASM)
    s = q4._dp4a(q3, tl.load(HW + 3), s, ASM)
    s = q4._dp4a(q4_, tl.load(HW + 4), s, ASM)
    s = q4._dp4a(q5, tl.load(HW + 5), s, ASM)
    s = q4._dp4a(q6, tl.load(HW + 6), s, ASM)
    return q4._dp4a(q7, tl.load(HW + 7), s, ASM)


@triton.jit
def split_kernel(W, W32, SLOT, XQ, XD, XS, WT, HQ, HD, HS, Y, YZ, go, uo, do, nzero,
                 F: tl.constexpr, D: tl.constexpr, K: tl.constexpr, R: tl.constexpr, RC: tl.constexpr,
                 ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, ATOM: tl.constexpr, NT: tl.constexpr,
                 ZC: tl.constexpr):  # fmt: skip
    qb.pdl_enter(PDL)
    j = tl.program_id(0)
    q = tl.program_id(1)
    NJ: tl.constexpr = F // (32 * R)
    p = q * NJ + j
    zi = p * ZC + tl.arange(0, ZC)
    tl.store(YZ + zi, tl.zeros([ZC], dtype=tl.float32), mask=zi < nzero)  # the next call's Y
    slot = tl.load(SLOT + q)
    if slot >= 0:
        NB: tl.constexpr = D // 256
        NBF: tl.constexpr = F // 256
        RWB: tl.constexpr = 144 * NBF  # bytes a down row
        if PF:
            share = (D * RWB // NJ + 15) // 16 * 16
            st = j.to(tl.int64) * share
            qb.prefetch_l2(W, slot + do + st, tl.minimum(share, D * RWB - st), NT)
        h = q4._gate_up_rows(W32, SLOT, XQ, XD, XS, go, uo, q, j * (32 * R), K, NB, 32 * R, ASM)
        words, dh, sh = t8.quant_tile(tl.reshape(h, [R, 32]), R)
        blk = j * R + tl.arange(0, R)
        t8.store_q8(HQ, HD, HS, q, blk, blk < F // 32, words, dh, sh, F // 32)
        tl.debug_barrier()  # ĥ of this program, stored by all its threads, read back as uniform loads
        t = q // K
        wk = tl.load(WT + q)
        sb0 = (j * (32 * R)) % 256 // 32  # first sub-block of block b
        b = j * (32 * R) // 256
        c = sb0 // 2  # the 32 quant bytes holding sub-blocks 2c (low nibbles) and 2c + 1 (high)
        hs = sb0 // 4
        hq0 = HQ + q.to(tl.int64) * (F // 4) + j * (8 * R)
        for r0 in tl.static_range(0, D, RC):
            rows = r0 + tl.arange(0, RC)
            P = W32 + ((slot + do) // 4 + b * 36) + rows * (RWB // 4)
            m4 = tl.arange(0, 4)[None, :]
            hdr0, s0, s1, s2 = _split4(tl.load(P[:, None] + m4))
            qa = _split4(tl.load(P[:, None] + (4 + 8 * c) + m4))
            qz = _split4(tl.load(P[:, None] + (8 + 8 * c) + m4))
            scw = tl.where(hs == 0, s0 & 0x3F3F3F3F, (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030))
            mnw = tl.where(hs == 0, s1 & 0x3F3F3F3F, ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030))
            d = (hdr0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((hdr0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            alo = tl.zeros([RC], dtype=tl.float32)
            amn = tl.zeros([RC], dtype=tl.float32)
            for r in tl.static_range(R):
                sb = sb0 + r
                nib = 4 * (sb % 2)
                jj = 8 * (sb % 4)
                M = 0x0F0F0F0F
                ia = _dot8((qa[0] >> nib) & M, (qa[1] >> nib) & M, (qa[2] >> nib) & M, (qa[3] >> nib) & M,
                           (qz[0] >> nib) & M, (qz[1] >> nib) & M, (qz[2] >> nib) & M, (qz[3] >> nib) & M,
                           hq0 + 8 * r, ASM)  # fmt: skip
                sc = (scw >> jj) & 0xFF
                mn = (mnw >> jj) & 0xFF
                rb = q.to(tl.int64) * (F // 32) + j * R + r
                alo += (ia * sc).to(tl.float32) * tl.load(HD + rb)
                amn += mn.to(tl.float32) * (tl.load(HS + 2 * rb) + tl.load(HS + 2 * rb + 1))
            y = wk * (d * alo - dmin * amn)
            if ATOM:
                tl.atomic_add(Y + t * D + rows, y, sem="relaxed")
            else:
                tl.store(Y + t * D + rows, y)


class Split:
    """One routed-expert call per layer in one launch (buffers held; Y alternates between two)."""

    def __init__(self, T, K, F, D, dev):
        self.T, self.K, self.F, self.D = T, K, F, D
        self.HQ = torch.empty((T * K, F // 4), dtype=torch.int32, device=dev)
        self.HD = torch.empty((T * K, F // 32), dtype=torch.float32, device=dev)
        self.HS = torch.empty((T * K, F // 16), dtype=torch.float32, device=dev)
        self.Y = [torch.zeros((T, D), dtype=torch.float32, device=dev) for _ in range(2)]
        self.i = 0

    def __call__(self, pool, slots, xq, w, roles, R=1, warps=8, RC=2048, pf=0, atom=1):
        (go, _, F, D), (uo, _, _, _), (do, _, _, _) = roles["gate"], roles["up"], roles["down"]
        XQ, XD, XS = xq
        dev = XQ.device
        pdl = qb.pdl(dev)
        y, yz = self.Y[self.i], self.Y[1 - self.i]
        self.i = 1 - self.i
        nprog = (F // (32 * R)) * slots.numel()
        zc = triton.next_power_of_2(-(-yz.numel() // nprog))
        flat = pool.reshape(-1)
        split_kernel[(F // (32 * R), slots.numel())](
            flat, flat.view(torch.int32), slots, XQ, XD, XS, w.reshape(-1).contiguous(), self.HQ, self.HD, self.HS,
            y, yz, go, uo, do, yz.numel(), F=F, D=D, K=self.K, R=R, RC=min(RC, D), ASM=t8.use_asm(dev), PDL=pdl,
            PF=qb.prefetch(pdl) * pf, ATOM=atom, NT=32 * warps, ZC=zc, num_warps=warps, **qb.launch_kw(pdl),
        )  # fmt: skip
        return y


def parity(dev):
    from engine.runtime.triton_q8_moe import moe_decode_q8_reference
    from tests.triton_data import expert_pool, routing_case

    rng = np.random.default_rng(5)
    F, D, E, K = (512, 512, 3, 2) if dev == "cpu" else (768, 2048, 16, 8)
    pool, stride, roles = expert_pool((Q, Q, Q), F, D, E, dev, rng)
    for T in (1, 3):
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        slots = slot_off.reshape(-1).contiguous()
        want = moe_decode_q8_reference(pool, slot_off, x, w, roles)
        xq = t8.quantize_act(x)
        for R, wp, RC, _pf, _at in cfgs(
            "SP", "1,8,2048,0,1 2,8,256,0,1" if dev == "cpu" else "1,8,2048,0,1 2,16,512,1,1"
        ):
            sp = Split(T, K, F, D, dev)
            for _ in range(3):  # the zeroing of the other buffer, round and round
                got = sp(pool, slots, xq, w, roles, R, wp, RC).clone()
                e = ((got - want).norm() / want.norm()).item()
                assert e < 2e-5, (T, R, wp, RC, e)
        print(f"parity T={T}: the one-launch split matches moe_decode_q8_reference (< 2e-5)", flush=True)


def gpu():
    import moe_half

    from engine.bench import read_floor
    from engine.runtime import triton_moe as tm

    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    us = read_floor.read_floor_us([nbytes], lambda calls: (graph(calls), 0.0))
    print(f"read floor, one {nbytes / 1e6:.1f} MB launch: {frac(us, nbytes)}", flush=True)
    us = read_floor.read_floor_us([gu_bytes, dn_bytes], lambda calls: (graph(calls), 0.0))
    print(f"read floor, gate/up + down launches: {frac(us, nbytes)}", flush=True)
    us = graph([lambda o=o: tm.moe_decode(pool, o.view(1, K), x, w, roles, act="q8", xq=xq) for o in offs])
    print(f"engine moe_decode (x̂ given: gate/up, quantize h, down): {frac(us, nbytes)}", flush=True)
    sp = Split(1, K, F, D, "cuda")
    for R, wp, RC, pf, at in cfgs(
        "SP",
        "1,8,2048,0,1 1,8,2048,1,1 1,8,512,1,1 1,4,2048,1,1 2,8,2048,1,1 2,16,2048,1,1 2,16,512,1,1 "
        "1,8,2048,1,0 2,16,2048,1,0",
    ):
        try:
            us = graph([lambda o=o: sp(pool, o, xq, w, roles, R, wp, RC, pf, at) for o in offs])
            print(f"split R {R} warps {wp} RC {RC} PF {pf} ATOM {at}: {frac(us, nbytes)}", flush=True)
        except Exception as e:  # noqa: BLE001 - a setting that fails to compile just loses
            print(f"split R {R} warps {wp} RC {RC} PF {pf} ATOM {at}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        parity("cpu")
    else:
        parity("cuda")
        gpu()
    sys.exit(0)
