"""Trunk-sized Q4_K GEMV on q8 activations with the routed experts' half-block decoder
(engine.runtime.triton_q4k_moe._load_half / _dot_half): x already in triton_q8's format — as the norm
kernel now writes it (step_kernels.add_rms_norm(q8=True)) — so no quantize launch. Against the exact-float
GEMV a decode graph runs today (triton_gemv.matmul), on the bench's q / o / kv shapes, in CUDA graphs over
≥ 1 GB of distinct matrices (engine.bench.device_kernels' timer).

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/q4k_half_gemv.py     # parity, no GPU
  PYTHONPATH=. python3 packaging/gpu_labs/q4k_half_gemv.py                        # + H100 timings
"""
# ruff: noqa: E731, B023

import os

import numpy as np
import torch
import triton
import triton.language as tl

from engine.quant.formats import QType, block_format
from engine.runtime import triton_q4k_moe as q4
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_q8_gemv as g8
from engine.runtime import triton_qblocks as qb

Q = QType.Q4_K


@triton.jit
def gemv_kernel(W, W32, XQ, XD, XS, Y, R, NB: tl.constexpr, BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                PF: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Y[rows] = W[rows]·x̂ for one token: [2·NB, BR] tiles, a row's half-blocks on the fastest lanes."""
    r0 = tl.program_id(0) * BR
    if PF:
        qb.prefetch_l2(W, r0.to(tl.int64) * (144 * NB), BR * 144 * NB, NT)
    qb.pdl_enter(PDL)
    rows = r0 + tl.arange(0, BR)
    e = tl.arange(0, 2 * NB)
    b = e // 2
    zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
    hs = (e % 2)[:, None] + zp
    off = tl.multiple_of(b[:, None] * 36 + rows[None, :] * (36 * NB), [4, 4])
    X = XQ + (zp + (b * 64 + (e % 2) * 32)[:, None])
    XDp = XD + (zp + (b * 8 + (e % 2) * 4)[:, None])
    XSp = XS + (zp + (b * 16 + (e % 2) * 8)[:, None])
    y = tl.sum(q4._dot_half(q4._load_half(W32 + off, hs), hs, X, XDp, XSp, ASM), axis=0)
    tl.store(Y + rows, y)


def gemv(raw, xq, rows, n, BR, warps, pf=0):
    XQ, XD, XS = xq
    dev = XQ.device
    pdl = qb.pdl(dev)
    Y = torch.empty((1, rows), dtype=torch.float32, device=dev)
    flat = raw.reshape(-1)
    gemv_kernel[(rows // BR,)](
        flat, flat.view(torch.int32), XQ, XD, XS, Y, rows, NB=n // 256, BR=BR, ASM=t8.use_asm(dev), PDL=pdl,
        PF=qb.prefetch(pdl) * pf, NT=32 * warps, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def _cfgs(default):
    return [tuple(map(int, a.split(","))) for a in (os.environ.get("CFG") or default).split()]


def parity(dev):
    from tests.triton_data import blocks

    rng = np.random.default_rng(1)
    for rows, n in ((64, 512), (32, 1024)) if dev == "cpu" else ((4096, 2048), (2048, 4096), (512, 2048)):
        raw = blocks(Q, rows, n, dev, rng)
        x = torch.from_numpy(rng.standard_normal((1, n)).astype(np.float32)).to(dev)
        ref = g8.matmul_q8_reference(raw, x, Q, rows, n)
        for BR, wp in _cfgs("8,2 16,4" if dev == "cpu" else "8,2 16,2 16,4 32,4"):
            y = gemv(raw, t8.quantize_act(x), rows, n, BR, wp)
            e = ((y - ref).norm() / ref.norm()).item()
            assert e < 1e-5, (rows, n, BR, wp, e)
        print(f"parity {rows}x{n}: < 1e-5 of matmul_q8_reference", flush=True)


def gpu():
    import math

    from engine.bench import device_kernels as dk
    from engine.runtime import triton_gemv as tg

    bw = dk.measure_bandwidth()
    print(f"{torch.cuda.get_device_name()}: bw {bw:.0f} GB/s", flush=True)
    for wl in ("q", "o", "kv"):
        rows, n = dk.TRUNK[wl]
        nbytes = rows * block_format(Q).row_bytes(n)
        copies = max(48, math.ceil(dk.GB / nbytes))
        mats = dk.random_matrix(Q, rows, n, copies)
        x = torch.randn(1, n, device="cuda")
        xq = t8.quantize_act(x)
        graph = lambda calls: dk._graph_us(calls)[0]
        frac = lambda us: f"{us:5.2f} us ({nbytes / us / 1e3 / bw:4.0%})"
        us = graph([lambda m=m: tg.matmul(m, x, Q, rows, n, act="f32") for m in mats])
        print(f"{wl} [{rows}, {n}] {nbytes / 1e6:.1f} MB: exact-float GEMV {frac(us)}", flush=True)
        for BR, wp in _cfgs("8,2 16,2 16,4 32,4 32,8 8,1"):
            for pf in (0, 1):
                us = graph([lambda m=m: gemv(m, xq, rows, n, BR, wp, pf) for m in mats])
                print(f"   half-block q8, BR {BR} warps {wp} PF {pf}: {frac(us)}", flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        parity("cpu")
    else:
        parity("cuda")
        gpu()
