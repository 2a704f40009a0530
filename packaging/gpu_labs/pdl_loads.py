# ruff: noqa: B023, E702, E401  (lab script: lambdas run inside the loop iteration that made them)
"""Programmatic dependent launch (PDL) and L2 prefetch on chains of one-matrix launches in a CUDA
graph: pure loads first (weights loaded before the PDL wait, or prefetched: PF1 one line per thread,
PF2 one bulk prefetch per program), then the Q4_K GEMV body of engine.runtime (qb.acc_rows).
Run on the GPU machine from the repo root: PYTHONPATH=. python3 packaging/gpu_labs/pdl_loads.py
(written for the first PDL rule, release before wait; docs/benchmarks-gpu.md has the results)."""

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.bench import device_kernels as dk
from engine.quant.formats import QType, block_format
from engine.runtime import triton_gemv as tg
from engine.runtime import triton_qblocks as qb


@triton.jit
def _pf_lines(base, nbytes, NT: tl.constexpr):
    # one prefetch.global.L2 per 128-byte line, spread over the program's threads (duplicates harmless)
    i = tl.arange(0, NT)
    nl = tl.cdiv(nbytes, 128)
    for r in tl.static_range(4):
        j = tl.minimum(i + r * NT, nl - 1)
        p = base + j.to(tl.int64) * 128
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _pf_bulk(base, nbytes, NT: tl.constexpr):
    i = tl.arange(0, NT)
    p = base + i.to(tl.int64) * 0
    tl.inline_asm_elementwise(
        "{ .reg .pred q; setp.eq.u32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [p, i, i * 0 + nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def load_k(
    W,
    X,
    Y,
    nw,
    BR: tl.constexpr,
    BW: tl.constexpr,
    STEPS: tl.constexpr,
    PDL: tl.constexpr,
    PF: tl.constexpr,
    NT: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    base = W + rows.to(tl.int64)[:, None] * nw + tl.arange(0, BW)[None, :]
    if PF == 1:
        _pf_lines((W + tl.program_id(0).to(tl.int64) * BR * nw).to(tl.pointer_type(tl.uint8)), BR * nw * 4, NT)
    if PF == 2:
        _pf_bulk((W + tl.program_id(0).to(tl.int64) * BR * nw).to(tl.pointer_type(tl.uint8)), BR * nw * 4, NT)
    if PDL:
        gdc_launch_dependents()
    acc = tl.zeros([BR, BW], dtype=tl.int32)
    if PDL and PF == 0:
        for s in tl.static_range(STEPS):
            acc ^= tl.load(base + s * BW)
        gdc_wait()
    else:
        if PDL:
            gdc_wait()
        for s in tl.static_range(STEPS):
            acc ^= tl.load(base + s * BW)
    x = tl.load(X)
    tl.store(Y + rows, tl.xor_sum(acc, 1) + x)


@triton.jit
def gemv_k(
    W,
    X,
    Y,
    R,
    n,
    row_bytes,
    nb,
    QT: tl.constexpr,
    TS: tl.constexpr,
    QK: tl.constexpr,
    PW: tl.constexpr,
    NPART: tl.constexpr,
    ALIGN: tl.constexpr,
    BR: tl.constexpr,
    NB: tl.constexpr,
    STEPS: tl.constexpr,
    PDL: tl.constexpr,
    PF: tl.constexpr,
    NT: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    rowoff = rows.to(tl.int64) * row_bytes
    if PF == 1:
        _pf_lines(W + tl.program_id(0).to(tl.int64) * BR * row_bytes, BR * row_bytes, NT)
    if PF == 2:
        _pf_bulk(W + tl.program_id(0).to(tl.int64) * BR * row_bytes, BR * row_bytes, NT)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc3 = tl.zeros([BR, NB, PW], dtype=tl.float32)
    acc3 = qb.acc_rows(acc3, W, rowoff, rmask, 0, nb, X, 1.0, QT, TS, QK, PW, NPART, ALIGN, NB, STEPS)
    tl.store(Y + rows, tl.sum(tl.sum(acc3, axis=2), axis=1), mask=rmask)


bw = dk.measure_bandwidth()
print(f"copy bw {bw:.0f} GB/s", flush=True)
GB = 1e9
Y = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
for name, rows, nw, BR, BW, warps in (
    ("q 4096x288w", 4096, 288, 8, 32, 4),
    ("q 4096x256w", 4096, 256, 4, 64, 4),
    ("moe gu 12288x288w", 12288, 288, 8, 32, 4),
    ("kv 512x288w", 512, 288, 2, 32, 4),
):
    nbytes = rows * nw * 4
    copies = max(8, math.ceil(GB / nbytes))
    W = torch.randint(-(2**31), 2**31 - 1, (copies, rows * nw), dtype=torch.int32, device="cuda")
    X = torch.zeros(4, dtype=torch.int32, device="cuda")
    steps = nw // BW
    print(f"{name}: {nbytes / 1e6:.2f} MB ideal {nbytes / bw / 1e3:.2f} us", flush=True)
    for pdl, pf in ((0, 0), (1, 0), (0, 1), (1, 1), (1, 2)):
        try:
            us = dk._graph_us(
                [
                    lambda m=m: load_k[(triton.cdiv(rows, BR),)](
                        m,
                        X,
                        Y,
                        nw,
                        BR=BR,
                        BW=BW,
                        STEPS=steps,
                        PDL=pdl,
                        PF=pf,
                        NT=32 * warps,
                        num_warps=warps,
                        launch_pdl=bool(pdl),
                    )
                    for m in W
                ]
            )[0]
            print(
                f"   load PDL{pdl} PF{pf}: {us:6.2f} us {nbytes / us / 1e3:6.0f} GB/s ({nbytes / us / 1e3 / bw:4.0%})",
                flush=True,
            )
        except Exception as e:
            print("   err", pdl, pf, type(e).__name__, str(e)[:300], flush=True)
    del W
torch.cuda.empty_cache()
q = QType.Q4_K
for wl in ("q", "o", "kv"):
    rows, n = dk.TRUNK[wl]
    nbytes = rows * block_format(q).row_bytes(n)
    copies = max(48, math.ceil(GB / nbytes))
    mats = dk.random_matrix(q, rows, n, copies)
    x = torch.randn(1, n, device="cuda")
    y = torch.empty(rows, device="cuda")
    c = tg.launch("gemv", q, rows, tg.device_name(x.device))
    nb = n // 256
    ref = tg.matmul(mats[0], x, q, rows, n)
    base = dk._graph_us([lambda m=m: tg.matmul(m, x, q, rows, n) for m in mats])[0]
    print(f"Q4_K {wl} current matmul: {base:6.2f} us ({nbytes / base / 1e3 / bw:4.0%}) cfg {c}", flush=True)
    for pdl, pf in ((0, 0), (1, 0), (1, 1), (1, 2)):
        for br, nbk, w in ((c["BR"], c["NB"], c["num_warps"]), (4, 8, 4), (8, 8, 8), (16, 8, 8), (4, 4, 2)):
            try:
                st = qb.steps(nb, nbk)
                f = lambda m: gemv_k[(triton.cdiv(rows, br),)](
                    m,
                    x,
                    y,
                    rows,
                    n,
                    block_format(q).row_bytes(n),
                    nb,
                    BR=br,
                    NB=nbk,
                    STEPS=st,
                    PDL=pdl,
                    PF=pf,
                    NT=32 * w,
                    num_warps=w,
                    launch_pdl=bool(pdl),
                    **qb.geometry(q),
                )
                f(mats[0])
                err = (y - ref[0]).abs().max().item()
                us = dk._graph_us([lambda m=m: f(m) for m in mats])[0]
                print(
                    f"   gemv PDL{pdl} PF{pf} BR{br} NB{nbk} w{w}: {us:6.2f} us ({nbytes / us / 1e3 / bw:4.0%}) err {err:.1e}",
                    flush=True,
                )
            except Exception as e:
                print("   err", pdl, pf, br, type(e).__name__, str(e)[:300], flush=True)
    del mats
    torch.cuda.empty_cache()
