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
def _xor_act(X, XDp, XSp):
    """The activation loads of _dot_half for one half (32 q8 words, 4 scales, 8 16-sums), XORed."""
    m = tl.arange(0, 4)[None, None, :]
    px = X[:, :, None] + m
    a = tl.load(px) ^ tl.load(px + 4) ^ tl.load(px + 8) ^ tl.load(px + 12)
    a ^= tl.load(px + 16) ^ tl.load(px + 20) ^ tl.load(px + 24) ^ tl.load(px + 28)
    a ^= tl.load(XDp[:, :, None] + m).to(tl.int32, bitcast=True)
    ps = XSp[:, :, None] + m
    a ^= tl.load(ps).to(tl.int32, bitcast=True) ^ tl.load(ps + 4).to(tl.int32, bitcast=True)
    return tl.xor_sum(a, axis=2)


@triton.jit
def gate_up_probe(W32, SLOT, XQ, XD, XS, H, go, uo, F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                  BR: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """MODE 0 pattern, 1 pattern+x, 2 coalesced, 3 coalesced+x (module docstring)."""
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
        acc = _xor5(q4._load_half(W32 + tl.multiple_of((slot + go) // 4, 4) + off, hs))
        acc ^= _xor5(q4._load_half(W32 + tl.multiple_of((slot + uo) // 4, 4) + off, hs))
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
        X = XQ + t * (64 * NB) + (zp + (b * 64 + (e % 2) * 32)[:, None])
        XDp = XD + t * (8 * NB) + (zp + (b * 8 + (e % 2) * 4)[:, None])
        XSp = XS + t * (16 * NB) + (zp + (b * 16 + (e % 2) * 8)[:, None])
        acc ^= _xor_act(X, XDp, XSp)
    h = tl.xor_sum(acc, axis=0).to(tl.float32)
    tl.store(H + q.to(tl.int64) * F + rows, h)


@triton.jit
def down_probe(W32, SLOT, HQ, HD, HS, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr, BR: tl.constexpr,
               MODE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
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
        acc = _xor5(q4._load_half(P, hv[:, None] + zp))
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
        X = HQ + (zp + (q * (64 * NBF) + b * 64 + hv * 32)[:, None])
        XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
        XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
        acc ^= _xor_act(X, XDp, XSp)
    tl.store(Y + t * D + rows, tl.xor_sum(acc, axis=0).to(tl.float32))


MODES = {"pattern": 0, "pattern+x": 1, "coalesced": 2, "coalesced+x": 3}


def gate_up(pool, slots, xq, roles, K, BR, warps, mode):
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    XQ, XD, XS = xq
    pdl = qb.pdl(XQ.device)
    H = torch.empty((slots.numel(), F), dtype=torch.float32, device=XQ.device)
    gate_up_probe[(F // BR, slots.numel())](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, H, go, uo, F=F, K=K, NB=D // 256, BR=BR,
        MODE=mode, PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return H


def down(pool, slots, hq, roles, K, BR, warps, mode):
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    pdl = qb.pdl(HQ.device)
    T = slots.numel() // K
    Y = torch.empty((T, D), dtype=torch.float32, device=HQ.device)
    down_probe[(D // BR, T)](
        pool.reshape(-1).view(torch.int32), slots, HQ, HD, HS, Y, do, D=D, K=K, NBF=F // 256, BR=BR, MODE=mode,
        PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


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


def gpu():
    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    for BR, wp in moe_half.cfgs("GU", "8,2 16,4"):
        us = graph([lambda o=o: moe_half.gate_up(pool, o, x, xq, roles, K, BR, wp) for o in offs])
        print(f"gate/up BR {BR} warps {wp} engine      {frac(us, gu_bytes)}", flush=True)
        for name, mode in MODES.items():
            us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, BR, wp, mode) for o in offs])
            print(f"gate/up BR {BR} warps {wp} {name:11s} {frac(us, gu_bytes)}", flush=True)
    for BR, wp in moe_half.cfgs("DN", "4,1 8,2"):
        us = graph([lambda o=o: moe_half.down(pool, o, hq, w, roles, K, BR, wp) for o in offs])
        print(f"down BR {BR} warps {wp} engine      {frac(us, dn_bytes)}", flush=True)
        for name, mode in MODES.items():
            us = graph([lambda o=o: down(pool, o, hq, roles, K, BR, wp, mode) for o in offs])
            print(f"down BR {BR} warps {wp} {name:11s} {frac(us, dn_bytes)}", flush=True)


def sass():
    """Each probe's sm_90 code counted offline (moe_rows.show_sass)."""
    from moe_rows import show_sass

    s_gu = {"W32": "*i32", "SLOT": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "H": "*fp32", "go": "i32",
            "uo": "i32"}  # fmt: skip
    s_dn = {"W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32", "HS": "*fp32", "Y": "*fp32", "do": "i32"}
    k = lambda sig, **kw: ({**sig, **{c: "constexpr" for c in kw}}, kw)
    for name, mode in MODES.items():
        sig, kw = k(s_gu, F=768, K=8, NB=8, BR=8, MODE=mode, PDL=1)
        show_sass(f"gate/up 8,2 {name}", gate_up_probe, sig, kw, 2)
        sig, kw = k(s_dn, D=2048, K=8, NBF=3, BR=4, MODE=mode, PDL=1)
        show_sass(f"down 4,1 {name}", down_probe, sig, kw, 1)


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        smoke()
    else:
        gpu()
