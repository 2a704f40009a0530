# ruff: noqa: B023, E702, E401  (lab script: lambdas run inside the loop iteration that made them)
"""Q4_K GEMV on the tensor cores, take 2: x prepared once per call (scaled by a power of two, split into
two fp16 parts, rows permuted to the weights' nibble order), A = 6-bit scale x 4-bit code in fp16 (exact),
one K=256 dot per block, d and the mins applied per (row, block) outside the dot."""

import math
import os

import torch
import triton
import triton.language as tl

from engine.runtime import triton_qblocks as qb


@triton.jit
def prep_x_kernel(X, XB, XS, INV, K, nb, BK: tl.constexpr):
    r = tl.program_id(0)
    k = tl.arange(0, BK)
    km = k < K
    # source element of permuted position k' = b*256 + c*64 + l*2 + h  ->  b*256 + (2c+h)*32 + l
    kk = k % 256
    src = (k - kk) + (2 * (kk // 64) + kk % 2) * 32 + (kk % 64) // 2
    x = tl.load(X + r * K + src, mask=km, other=0.0)
    amax = tl.max(tl.abs(x), 0)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2 amax)
    s = ((127 + 13 - e) << 23).to(tl.float32, bitcast=True)  # |x·s| < 2^14
    s = tl.where(amax > 0, s, 1.0)
    xs = x * s
    x1 = xs.to(tl.float16)
    x2 = (xs - x1.to(tl.float32)).to(tl.float16)
    tl.store(XB + (r * K + k) * 2, x1, mask=km)
    tl.store(XB + (r * K + k) * 2 + 1, x2, mask=km)
    j = tl.arange(0, BK // 32)
    xn = tl.load(X + r * K + j[:, None] * 32 + tl.arange(0, 32)[None, :], mask=(j < K // 32)[:, None], other=0.0)
    tl.store(XS + r * (K // 32) + j, tl.sum(xn, 1), mask=j < K // 32)
    tl.store(INV + r, 1.0 / s)


@triton.jit
def _sc_min(sb, h: tl.constexpr, rmask):
    S = 2 * tl.arange(0, 4) + h  # sub-blocks of nibble half h
    lo = S < 4
    b1 = tl.load(sb[:, None] + tl.where(lo, S, S + 4)[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    b2 = tl.load(sb[:, None] + tl.where(lo, S + 4, S - 4)[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    b3 = tl.load(sb[:, None] + S[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    sc = tl.where(lo[None, :], b1 & 63, (b1 & 0xF) | ((b2 >> 6) << 4))
    m = tl.where(lo[None, :], b2 & 63, (b1 >> 4) | ((b3 >> 6) << 4))
    return sc, m  # int32 [BR, 4]


@triton.jit
def q4k_mma2_kernel(
    W,
    XB,
    XS,
    INV,
    Y,
    R,
    row_bytes,
    BR: tl.constexpr,
    NBS: tl.constexpr,
    PDL: tl.constexpr,
    NT: tl.constexpr,
    F32DOT: tl.constexpr,
    MAGIC: tl.constexpr,
):
    pid = tl.program_id(0)
    r0 = pid * BR
    rows = r0 + tl.arange(0, BR)
    rmask = rows < R
    rowoff = tl.minimum(rows, R - 1).to(tl.int64) * row_bytes
    if PDL:
        qb.prefetch_l2(W, r0.to(tl.int64) * row_bytes, tl.minimum(R - r0, BR).to(tl.int64) * row_bytes, NT)
    qb.pdl_enter(PDL)
    c4 = tl.arange(0, 4)
    l32 = tl.arange(0, 32)
    k256 = tl.arange(0, 256)
    col = tl.arange(0, 16)
    acc = tl.zeros([BR, 16], dtype=tl.float32)
    corr = tl.zeros([BR], dtype=tl.float32)
    for b in tl.static_range(NBS):
        blk = W + rowoff + b * 144
        u = tl.load(blk[:, None, None] + 16 + c4[None, :, None] * 32 + l32[None, None, :]).to(tl.int16)  # [BR,4,32]
        if MAGIC:
            lo = ((u & 0xF) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
            hi = (((u >> 4) & 0xF) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        else:
            lo = (u & 0xF).to(tl.float16)
            hi = ((u >> 4) & 0xF).to(tl.float16)
        sc0, m0 = _sc_min(blk + 4, 0, rmask)
        sc1, m1 = _sc_min(blk + 4, 1, rmask)
        a = tl.reshape(tl.join(lo * sc0.to(tl.float16)[:, :, None], hi * sc1.to(tl.float16)[:, :, None]), [BR, 256])
        xb0 = tl.load(XB + (b * 256 + k256) * 2)
        xb1 = tl.load(XB + (b * 256 + k256) * 2 + 1)
        bt = tl.where(col[None, :] == 0, xb0[:, None], tl.where(col[None, :] == 1, xb1[:, None], 0.0)).to(tl.float16)
        if F32DOT:
            out = tl.dot(a.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, bt, out_dtype=tl.float32)
        d = qb._f16(blk, rmask)
        dmin = qb._f16(blk + 2, rmask)
        xs0 = tl.load(XS + b * 8 + 2 * c4)
        xs1 = tl.load(XS + b * 8 + 2 * c4 + 1)
        acc += out * d[:, None]
        corr += dmin * tl.sum(m0.to(tl.float32) * xs0[None, :] + m1.to(tl.float32) * xs1[None, :], 1)
    y = tl.sum(tl.where(col[None, :] < 2, acc, 0.0), 1) * tl.load(INV) - corr
    tl.store(Y + rows, y, mask=rmask)


def prep(x):
    T, K = x.shape
    XB = torch.empty((T, K, 2), dtype=torch.float16, device=x.device)
    XS = torch.empty((T, K // 32), dtype=torch.float32, device=x.device)
    INV = torch.empty(T, dtype=torch.float32, device=x.device)
    prep_x_kernel[(T,)](x, XB, XS, INV, K, K // 256, BK=triton.next_power_of_2(K), num_warps=4)
    return XB, XS, INV


def q4k_mma2(raw, x, rows, n, BR=32, warps=4, pdl=0, magic=1, px=None):
    XB, XS, INV = px if px is not None else prep(x)
    y = torch.empty(rows, dtype=torch.float32, device=x.device)
    q4k_mma2_kernel[(triton.cdiv(rows, BR),)](
        raw.reshape(-1),
        XB,
        XS,
        INV,
        y,
        rows,
        n // 256 * 144,
        BR=BR,
        NBS=n // 256,
        PDL=pdl,
        NT=32 * warps,
        F32DOT=int(os.environ.get("TRITON_INTERPRET") == "1"),
        MAGIC=magic,
        num_warps=warps,
        **qb.launch_kw(pdl),
    )
    return y


# Run: PYTHONPATH=. python3 packaging/gpu_labs/q4k_tensor_cores.py  (GPU: timings; without one: parity in Triton's
# interpreter, TRITON_INTERPRET=1). Correct (~3e-7 relative) but 3-6x slower than the float kernels
# on the H100 (docs/benchmarks-gpu.md, session 4), so not adopted.
if __name__ == "__main__":
    from engine.quant.formats import QType
    from engine.runtime.tdequant import dequantize

    torch.manual_seed(0)
    if not torch.cuda.is_available():
        rows, n = 32, 512
        raw = torch.randint(0, 256, (rows * (n // 256) * 144,), dtype=torch.uint8)
        blocks = raw.view(-1, 144)
        blocks[:, 0:2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        blocks[:, 2:4] = torch.tensor([0.03], dtype=torch.float16).view(torch.uint8)
        x = torch.randn(1, n) * 300
        ref = dequantize(raw.view(rows, -1), QType.Q4_K, n) @ x[0]
        for magic in (0, 1):
            y = q4k_mma2(raw, x, rows, n, magic=magic)
            print("rel err", magic, ((y - ref).abs().max() / ref.abs().max()).item())
    else:
        from engine.bench import device_kernels as dk
        from engine.runtime import triton_gemv as tg

        bw = dk.measure_bandwidth()
        print(f"bw {bw:.0f}")
        q = QType.Q4_K
        x = torch.randn(1, 2048, device="cuda")
        print("prep alone", dk._graph_us([lambda: prep(x)] * 64)[0], flush=True)
        for wl in ("q", "o", "kv", "moe-ish"):
            rows, n = dk.TRUNK.get(wl, (12288, 2048))
            nbytes = rows * n // 256 * 144
            copies = max(48, math.ceil(1e9 / nbytes))
            mats = dk.random_matrix(q, rows, n, copies)
            x = torch.randn(1, n, device="cuda")
            ref = dequantize(mats[0].view(rows, -1), q, n) @ x[0]
            base = dk._graph_us([lambda m=m: tg.matmul(m, x, q, rows, n) for m in mats])[0]
            print(f"{wl}: current {base:.2f} us ({nbytes / base / 1e3 / bw:.0%})", flush=True)
            px = prep(x)
            for BR, w, magic in ((32, 4, 1), (64, 4, 1), (16, 4, 1), (32, 4, 0)):
                for pdl in (0, 1):
                    try:
                        y = q4k_mma2(mats[0], x, rows, n, BR, w, 0, magic)
                        err = ((y - ref).abs().max() / ref.abs().max()).item()
                        us = dk._graph_us([lambda m=m: q4k_mma2(m, x, rows, n, BR, w, pdl, magic, px) for m in mats])[0]
                        us2 = dk._graph_us([lambda m=m: q4k_mma2(m, x, rows, n, BR, w, pdl, magic) for m in mats])[0]
                        print(
                            f"   mma2 BR{BR} w{w} magic{magic} pdl{pdl}: {us:.2f} us ({nbytes / us / 1e3 / bw:.0%}) with prep {us2:.2f} err {err:.1e}",
                            flush=True,
                        )
                    except Exception as e:
                        print("   err", BR, w, pdl, type(e).__name__, str(e)[:400], flush=True)
