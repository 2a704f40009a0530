"""Half-block lanes for the lean Q4_K MoE kernels: a thread owns *half* a Q4_K block (its 16-byte header and 64
of its 128 quant bytes: sub-blocks 4h … 4h + 3) instead of whole blocks, so a row's blocks spread over twice the
lanes and a program's tile needs half the registers — the lever Nsight Compute pointed at (session 5's kernels
ran 1–1.5 warps a scheduler, ~70 % of stalls on loads). Adopted: the half-block kernels are
engine.runtime.triton_q4k_moe's now; this lab sweeps their settings against session 5's whole-block kernels
(moe_lean.py: gate/up variant "A" 8 rows × 1 warp, down KT2 4 rows × 1 warp), times whole calls, and keeps the
one variant not adopted: ``gate_up_qh_kernel``, h quantized inside the gate/up kernel (BR a multiple of 32).

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_half.py     # parity, no GPU
  PYTHONPATH=. python3 packaging/gpu_labs/moe_half.py                        # + H100 timings (~1 min)
  (GU / DN / GQ = "BR,warps ..." choose the gate/up, down and h-quantizing settings swept)
"""
# ruff: noqa: E731, B023

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_lean  # noqa: E402  (session 5's whole-block kernels)

from engine.quant.formats import QType, block_format  # noqa: E402
from engine.runtime import triton_q4k_moe as q4  # noqa: E402
from engine.runtime import triton_q8 as t8  # noqa: E402
from engine.runtime import triton_qblocks as qb  # noqa: E402

Q = QType.Q4_K


@triton.jit
def gate_up_qh_kernel(W32, SLOT, XQ, XD, XS, HQ, HD, HS, go, uo, F: tl.constexpr, K: tl.constexpr,
                      NB: tl.constexpr, BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The engine's gate/up rows (triton_q4k_moe._gate_up_rows), h quantized here into HQ/HD/HS by triton_q8's
    rule (BR a multiple of 32) instead of stored in float."""
    qb.pdl_enter(PDL)
    q = tl.program_id(1)
    r0 = tl.program_id(0) * BR
    h = q4._gate_up_rows(W32, SLOT, XQ, XD, XS, go, uo, q, r0, K, NB, BR, ASM)
    NBLK: tl.constexpr = BR // 32
    words, d, s = t8.quant_tile(tl.reshape(h, [NBLK, 32]), NBLK)
    blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
    t8.store_q8(HQ, HD, HS, q, blk, blk < F // 32, words, d, s, F // 32)


def gate_up(pool, slots, x, xq, roles, K, BR, warps, qh=False):
    """The engine's gate/up (x̂ = xq given) at this setting -> h float32 [T·K, F], or (qh) h quantized by
    ``gate_up_qh_kernel`` (HQ, HD, HS)."""
    if not qh:
        return q4.gate_up(pool, slots, x, roles, K, {"BR": BR, "num_warps": warps}, xq)
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    XQ, XD, XS = xq
    dev = XQ.device
    pdl = qb.pdl(dev)
    n = slots.numel()
    HQ, HD, HS = (torch.empty((n, F // k), dtype=d, device=dev) for k, d in ((4, torch.int32), (32, torch.float32),
                                                                           (16, torch.float32)))  # fmt: skip
    gate_up_qh_kernel[(F // BR, n)](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, HQ, HD, HS, go, uo, F=F, K=K, NB=D // 256, BR=BR,
        ASM=t8.use_asm(dev), PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return HQ, HD, HS


def down(pool, slots, hq, weights, roles, K, BR, warps, pf=0):
    """The engine's down kernel (triton_q4k_moe._down_kernel) on h already quantized, at this setting
    (pf: its L2 prefetch before the PDL wait) -> Y float32 [T, D]."""
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    dev = HQ.device
    pdl = qb.pdl(dev)
    T = slots.numel() // K
    Y = torch.empty((T, D), dtype=torch.float32, device=dev)
    flat = pool.reshape(-1)
    q4._down_kernel[(D // BR, T)](
        flat, flat.view(torch.int32), slots, HQ, HD, HS, weights, Y, do, D=D, K=K, NBF=F // 256, BR=BR,
        ASM=t8.use_asm(dev), PDL=pdl, PF=qb.prefetch(pdl) * pf, NT=32 * warps, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def whole_gate_up(pool, slots, xq, roles, K):
    """Session 5's whole-block gate/up (moe_lean variant "A", 8 rows × 1 warp, no prefetch) -> h float32."""
    flat = pool.reshape(-1)
    return moe_lean.gate_up(flat, flat.view(torch.int32), slots, xq, roles, K, 8, 1, "A", pf=0)


def whole_down(pool, slots, hq, weights, roles, K):
    """Session 5's whole-block down (moe_lean KT2, 4 rows × 1 warp, its prefetch as adopted then)."""
    flat = pool.reshape(-1)
    return moe_lean.down(flat, flat.view(torch.int32), slots, hq, weights, roles, K, 4, 1, kt=2)


def cfgs(var, default):
    """Launch settings from $var, else ``default``: "a,b,... a,b,..." -> [(a, b, ...), ...] (here: rows a
    program, warps)."""
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
        ref_h = whole_gate_up(pool, slots, xq, roles, K)
        for BR, wp in cfgs("GU", "2,1 4,1 8,1 4,2"):
            h = gate_up(pool, slots, x, xq, roles, K, BR, wp)
            e = ((h - ref_h).norm() / ref_h.norm()).item()
            assert e < 1e-6, (BR, wp, e)
        for BR, wp in cfgs("GQ", "32,4"):
            got = gate_up(pool, slots, x, xq, roles, K, BR, wp, qh=True)
            want = t8.quantize_act(gate_up(pool, slots, x, xq, roles, K, BR, wp))
            assert all(torch.equal(a, b) for a, b in zip(got, want)), ("QH", BR, wp)
        hq = t8.quantize_act(ref_h)
        ref_y = whole_down(pool, slots, hq, w, roles, K)
        for BR, wp in cfgs("DN", "1,1 2,1 1,2 4,1"):
            y = down(pool, slots, hq, w, roles, K, BR, wp)
            e = ((y - ref_y).norm() / ref_y.norm()).item()
            assert e < 1e-6, (BR, wp, e)
        print(f"parity T={T}: the half-block kernels match the whole-block ones (< 1e-6)", flush=True)


def chain_setup():
    """The routed-expert chain these labs time (the bench's moe workload: Q4_K, 30B-A3B shapes, ≥ 1 GB of
    distinct slots, 48+ layers' routes): (bw, K, F, D, nbytes, gate/up bytes, down bytes, pool, roles, the
    layers' slot offsets, x, routing weights, x̂, a quantized h, frac(us, bytes), graph(calls) -> µs)."""
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
    return bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph


def gpu():
    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = chain_setup()
    GU, DN = cfgs("GU", "2,1 4,1 8,1 4,2 8,2"), cfgs("DN", "1,1 2,1 1,2 4,1 2,2")
    us = graph([lambda o=o: whole_gate_up(pool, o, xq, roles, K) for o in offs])
    print(f"gate/up whole blocks (session 5), BR 8 warps 1: {frac(us, gu_bytes)}", flush=True)
    for BR, wp in GU:
        us = graph([lambda o=o: gate_up(pool, o, x, xq, roles, K, BR, wp) for o in offs])
        print(f"gate/up halves BR {BR} warps {wp}: {frac(us, gu_bytes)}", flush=True)
    us = graph([lambda o=o: whole_down(pool, o, hq, w, roles, K) for o in offs])
    print(f"down whole blocks (session 5), BR 4 warps 1: {frac(us, dn_bytes)}", flush=True)
    for BR, wp in DN:
        for pf in (0, 1):
            us = graph([lambda o=o: down(pool, o, hq, w, roles, K, BR, wp, pf) for o in offs])
            print(f"down halves BR {BR} warps {wp} PF {pf}: {frac(us, dn_bytes)}", flush=True)

    for BR, wp in cfgs("GQ", "32,4 32,8 64,8"):
        us = graph([lambda o=o: gate_up(pool, o, x, xq, roles, K, BR, wp, qh=True) for o in offs])
        print(f"gate/up halves, h quantized, BR {BR} warps {wp}: {frac(us, gu_bytes)}", flush=True)
    # whole calls (21.2 MB)
    from engine.runtime import triton_moe as tm

    g8, d4 = cfgs("GBEST", "8,2")[0], cfgs("DBEST", "4,1")[0]
    gq = cfgs("GQBEST", "32,8")[0]
    calls = {
        "engine (moe_decode: quantize x, gate/up, quantize h, down)": lambda o: tm.moe_decode(
            pool, o.view(1, K), x, w, roles, act="q8"
        ),
        "session 5 whole blocks: quantize x, gate/up, quantize h, down": lambda o: whole_down(
            pool, o, t8.quantize_act(whole_gate_up(pool, o, t8.quantize_act(x), roles, K)), w, roles, K
        ),
        "halves: quantize x, gate/up + h quantized, down": lambda o: down(
            pool, o, gate_up(pool, o, x, t8.quantize_act(x), roles, K, *gq, qh=True), w, roles, K, *d4
        ),
        "halves, x quantized before: gate/up, quantize h, down": lambda o: down(
            pool, o, t8.quantize_act(gate_up(pool, o, x, xq, roles, K, *g8)), w, roles, K, *d4
        ),
        "halves, x quantized before: gate/up + h quantized, down": lambda o: down(
            pool, o, gate_up(pool, o, x, xq, roles, K, *gq, qh=True), w, roles, K, *d4
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


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        parity("cpu")
    else:
        parity("cuda")
        gpu()
    sys.exit(0)
