"""What a kernel in a PDL chain (a decode step's CUDA graph) costs at the least, under the rule of
engine.runtime.triton_qblocks.pdl_enter (prefetch, wait, release): an empty kernel, and a pure
read of a q-sized matrix (4.7 MB) from HBM (distinct matrices) or from L2 (one matrix again and
again). The floor a GEMV body of that size can reach.
Run: PYTHONPATH=. python3 packaging/gpu_labs/chain_floors.py"""
# ruff: noqa: B023, E702, E401, E731

import math

import torch
import triton
import triton.language as tl

from engine.bench import device_kernels as dk
from engine.runtime import triton_qblocks as qb


@triton.jit
def empty_k(Y, PDL: tl.constexpr):
    qb.pdl_enter(PDL)
    tl.store(Y + tl.program_id(0), 1.0)


@triton.jit
def read_k(W, Y, nw, NXT, nxt_bytes, nxt_share, BR: tl.constexpr, BW: tl.constexpr, STEPS: tl.constexpr,
           PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr, PN: tl.constexpr, LB: tl.constexpr):  # fmt: skip
    """XOR of BR rows of nw int32 words a program (BW words a step). PN: prefetch the next kernel's
    weights into L2 first (this program's share); LB: the loads before the PDL wait."""
    r0 = tl.program_id(0) * BR
    if PN:
        start = tl.program_id(0).to(tl.int64) * nxt_share
        qb.prefetch_l2(NXT, start, tl.minimum(nxt_share, nxt_bytes - start), NT)
    if PF:
        qb.prefetch_rows(W, 0, r0, 1 << 30, BR, nw * 4, NT)
    if not LB:
        qb.pdl_enter(PDL)
    rows = r0 + tl.arange(0, BR)
    base = W.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * nw + tl.arange(0, BW)[None, :]
    acc = tl.zeros([BR, BW], dtype=tl.int32)
    for s in tl.static_range(STEPS):
        acc ^= tl.load(base + s * BW)
    if LB:
        qb.pdl_enter(PDL)
    tl.store(Y + rows, tl.xor_sum(acc, 1))


def main():
    bw = dk.measure_bandwidth()
    print(f"bw {bw:.0f} GB/s", flush=True)
    y = torch.empty(1 << 16, device="cuda")
    for G, w in ((132, 4), (264, 4), (512, 4), (1024, 1), (1024, 4)):
        for pdl in (0, 1):
            us = dk._graph_us([lambda: empty_k[(G,)](y, PDL=qb.pdl(y.device) and pdl, num_warps=w, **qb.launch_kw(qb.pdl(y.device) and pdl))] * 200)[0]
            print(f"empty kernel, {G} programs x {w} warps, pdl {pdl}: {us:.2f} us", flush=True)
    rows, rb = 4096, 1152  # q: [4096, 2048] Q4_K
    nbytes = rows * rb
    copies = max(48, math.ceil(1e9 / nbytes))
    mats = torch.randint(0, 255, (copies, nbytes), dtype=torch.uint8, device="cuda")
    for BR, w in ((4, 1), (8, 2), (16, 4)):
        BW = 32  # words a row a step: 16 bytes a thread
        steps = rb // 4 // BW
        for pdl, pn, lb in ((1, 0, 0), (1, 1, 1), (1, 2, 1), (1, 3, 1), (1, 2, 0), (1, 4, 1)):
            def call(m, nxt):
                p = qb.pdl(m.device) and pdl
                share = -(-nbytes // (rows // BR) // 16) * 16
                read_k[(rows // BR,)](m, y, rb // 4, nxt, nbytes, share, BR=BR, BW=BW, STEPS=steps, PDL=p,
                                      PF=p and not pn, NT=32 * w, PN=int(pn > 0), LB=lb, num_warps=w, **qb.launch_kw(p))  # fmt: skip
            hbm = dk._graph_us([lambda i=i: call(mats[i], mats[(i + max(pn, 1)) % copies]) for i in range(copies)])[0]
            f = lambda us: f"{us:5.2f} us ({nbytes / us / 1e3 / bw:4.0%})"
            l2 = f"  L2 {f(dk._graph_us([lambda: call(mats[0], mats[0])] * copies)[0])}" if pn == 0 and lb == 0 else ""
            print(f"pure read q-size BR{BR} w{w} pdl {pdl} prefetch {pn} ahead loads-before-wait {lb}: HBM {f(hbm)}{l2}", flush=True)


if __name__ == "__main__":
    main()
