# ruff: noqa: B023, E702, E401  (lab script: lambdas run inside the loop iteration that made them)
"""Q4_K GEMV on the tensor cores: exact bf16 codes (128 + q) times x split into three bf16 parts,
one K=32 dot per sub-block, scaled per (row, sub-block) in the accumulator."""

import math
import os

import torch
import triton
import triton.language as tl

from engine.runtime import triton_qblocks as qb


@triton.jit
def _xsplit(X, off, l, col):
    xv = tl.load(X + off + l)  # [32] f32
    x1 = xv.to(tl.bfloat16)
    r1 = xv - x1.to(tl.float32)
    x2 = r1.to(tl.bfloat16)
    x3 = (r1 - x2.to(tl.float32)).to(tl.bfloat16)
    z = tl.zeros([32, 16], dtype=tl.bfloat16)
    bt = tl.where(
        col[None, :] == 0,
        x1[:, None],
        tl.where(col[None, :] == 1, x2[:, None], tl.where(col[None, :] == 2, x3[:, None], z)),
    )
    return bt, tl.sum(xv, 0)


@triton.jit
def q4k_mma_kernel(
    W,
    X,
    Y,
    R,
    row_bytes,
    nb,
    BR: tl.constexpr,
    NBS: tl.constexpr,
    PDL: tl.constexpr,
    NT: tl.constexpr,
    F32DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    r0 = pid * BR
    rows = r0 + tl.arange(0, BR)
    rmask = rows < R
    rowoff = tl.minimum(rows, R - 1).to(tl.int64) * row_bytes
    if PDL:
        qb.prefetch_l2(W, r0.to(tl.int64) * row_bytes, tl.minimum(R - r0, BR).to(tl.int64) * row_bytes, NT)
    qb.pdl_enter(PDL)
    l = tl.arange(0, 32)
    col = tl.arange(0, 16)
    acc = tl.zeros([BR, 16], dtype=tl.float32)
    corr = tl.zeros([BR], dtype=tl.float32)
    for b in tl.static_range(NBS):
        blk = W + rowoff + b * 144
        d = qb._f16(blk, rmask)
        dmin = qb._f16(blk + 2, rmask)
        for c in tl.static_range(4):
            u = tl.load(blk[:, None] + (16 + 32 * c) + l[None, :]).to(tl.int16)  # [BR, 32]
            for h in tl.static_range(2):
                if h == 0:
                    nib = u & 0xF
                else:
                    nib = (u >> 4) & 0xF
                a = (nib | 0x4300).to(tl.bfloat16, bitcast=True)  # 128 + q, exact
                bt, xs = _xsplit(X, b * 256 + (2 * c + h) * 32, l, col)
                if F32DOT:  # Triton's interpreter multiplies bf16 wrongly: the same exact values in float32
                    out = tl.dot(a.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
                else:
                    out = tl.dot(a, bt, out_dtype=tl.float32)  # [BR, 16]
                sc, mn = qb._k4_scale_min(blk + 4, 2 * c + h, rmask)
                ds = d * sc
                acc += out * ds[:, None]
                corr += (128.0 * ds + dmin * mn) * xs
    y = tl.sum(tl.where(col[None, :] < 3, acc, 0.0), axis=1) - corr
    tl.store(Y + rows, y, mask=rmask)


def q4k_mma(raw, x, rows, n, BR=16, warps=4, pdl=0):
    nb = n // 256
    y = torch.empty(rows, dtype=torch.float32, device=x.device)
    q4k_mma_kernel[(triton.cdiv(rows, BR),)](
        raw.reshape(-1),
        x.reshape(-1),
        y,
        rows,
        nb * 144,
        nb,
        BR=BR,
        NBS=nb,
        PDL=pdl,
        NT=32 * warps,
        F32DOT=int(os.environ.get("TRITON_INTERPRET") == "1"),
        num_warps=warps,
        **qb.launch_kw(pdl),
    )
    return y


# Run: PYTHONPATH=. python3 packaging/gpu_labs/q4k_tensor_cores_v1.py  (GPU: timings; without one: parity in Triton's
# interpreter, TRITON_INTERPRET=1). Correct (~3e-7 relative) but 3-6x slower than the float kernels
# on the H100 (docs/benchmarks-gpu.md, session 4), so not adopted.
if __name__ == "__main__":
    from engine.quant.formats import QType
    from engine.runtime.tdequant import dequantize

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    if dev == "cpu":
        rows, n = 32, 512
        raw = torch.randint(0, 256, (rows * (n // 256) * 144,), dtype=torch.uint8)
        blocks = raw.view(-1, 144)
        d = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        blocks[:, 0:2] = d
        blocks[:, 2:4] = torch.tensor([0.03], dtype=torch.float16).view(torch.uint8)
        x = torch.randn(n)
        y = q4k_mma(raw, x, rows, n)
        ref = dequantize(raw.view(rows, -1), QType.Q4_K, n) @ x
        print("rel err", ((y - ref).abs().max() / ref.abs().max()).item())
    else:
        from engine.bench import device_kernels as dk
        from engine.runtime import triton_gemv as tg

        bw = dk.measure_bandwidth()
        print(f"bw {bw:.0f}")
        q = QType.Q4_K
        for wl in ("q", "o", "kv"):
            rows, n = dk.TRUNK[wl]
            nbytes = rows * n // 256 * 144
            copies = max(48, math.ceil(1e9 / nbytes))
            mats = dk.random_matrix(q, rows, n, copies)
            x = torch.randn(1, n, device="cuda")
            ref = dequantize(mats[0].view(rows, -1), q, n) @ x[0]
            base = dk._graph_us([lambda m=m: tg.matmul(m, x, q, rows, n) for m in mats])[0]
            print(f"{wl}: current {base:.2f} us ({nbytes / base / 1e3 / bw:.0%})", flush=True)
            for BR, w in ((16, 4), (32, 4), (64, 4), (16, 2), (32, 8), (64, 8)):
                for pdl in (0, 1):
                    try:
                        y = q4k_mma(mats[0], x, rows, n, BR, w, pdl)
                        err = ((y - ref).abs().max() / ref.abs().max()).item()
                        us = dk._graph_us([lambda m=m: q4k_mma(m, x, rows, n, BR, w, pdl) for m in mats])[0]
                        print(
                            f"   mma BR{BR} w{w} pdl{pdl}: {us:.2f} us ({nbytes / us / 1e3 / bw:.0%}) err {err:.1e}",
                            flush=True,
                        )
                    except Exception as e:
                        print("   err", BR, w, pdl, type(e).__name__, str(e)[:300], flush=True)
