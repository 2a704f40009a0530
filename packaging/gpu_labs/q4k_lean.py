"""Lean Q4_K GEMV on q8 activations (triton_q8's format): the fewest instructions a weight byte and
the most warps in flight. Differences from triton_q8_gemv's Q4_K path:
- a program walks the whole row (no K loop: n ≤ 4096 is 16 blocks) over few rows (BR), so the grid is
  large and a scheduler holds many warps;
- the block header (d, dmin, 12 scale bytes) is one 16-byte load split into words; scales and mins
  come from word shifts and masks with compile-time positions (no byte loads);
- CHAIN: the 4 words of a thread's 16-byte load go through one dp4a chain (accumulate operand),
  not 4 dp4a then 3 adds.
Parity against triton_q8_gemv's reference (dequantized weights · dequantized q8 activations).
Run: PYTHONPATH=. python3 packaging/gpu_labs/q4k_lean.py [sass]
"""
# ruff: noqa: B023, E702, E401, E731

import math
import sys

import torch
import triton
import triton.language as tl

from engine.runtime import triton_qblocks as qb
from engine.runtime.triton_q4k_moe import _dp4a


@triton.jit
def _f16lo(w):
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16hi(w):
    return ((w >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u2f(u):
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _scale_min(s0, s1, s2, S: tl.constexpr):
    """6-bit scale and min of sub-block S (get_scale_min_k4) from the scale words s0, s1, s2."""
    if S < 4:
        sc = (s0 >> (8 * S)) & 63
        m = (s1 >> (8 * S)) & 63
    else:
        k: tl.constexpr = S - 4
        sc = ((s2 >> (8 * k)) & 0xF) | ((s0 >> (8 * k + 2)) & 0x30)
        m = ((s2 >> (8 * k + 4)) & 0xF) | ((s1 >> (8 * k + 2)) & 0x30)
    return _u2f(sc), _u2f(m)


@triton.jit
def _four(t):
    """[BR, NB, 2, 4] -> its 4 slices along the last axis (register renames: a thread holds all 4)."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, a1, b0, b1


@triton.jit
def _four3(t):
    """[BR, NB, 4] -> its 4 slices along the last axis."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def lean_kernel(W32, XQ, XDS, Y, R, row_words, NXT, nxt_bytes, nxt_share,
                NB: tl.constexpr, BR: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr,
                PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr, PN: tl.constexpr, LB: tl.constexpr):  # fmt: skip
    """Y[rows] = W[rows] · x for a Q4_K matrix of NB blocks a row (row_words = 36·NB int32 words).
    PN: prefetch the next kernel's weights (nxt_bytes at NXT) into L2, this program's share, first thing.
    LB: load this program's weights before the PDL wait (they are constant), the activations after."""
    r0 = tl.program_id(0) * BR
    if PN:
        start = tl.program_id(0).to(tl.int64) * nxt_share
        qb.prefetch_l2(NXT, start, tl.minimum(nxt_share, nxt_bytes - start), NT)
    if PF:
        qb.prefetch_rows(W32, 0, r0, R, BR, row_words * 4, NT)
    if not LB:
        qb.pdl_enter(PDL)
    rows = r0 + tl.arange(0, BR)
    rmask = rows < R
    rows = tl.minimum(rows, R - 1)
    b = tl.arange(0, NB)
    base = tl.multiple_of(rows[:, None] * row_words + b[None, :] * 36, [4, 4])  # [BR, NB] word index of blocks
    h = tl.arange(0, 2)
    k = tl.arange(0, 4)
    hk = (4 * h[:, None] + k[None, :])[None, None, :, :]  # [1, 1, 2, 4]
    z = tl.zeros([BR, NB, 2, 4], dtype=tl.int32)
    z3 = tl.zeros([BR, NB, 4], dtype=tl.int32)
    # the block header, one 16-byte load: d | dmin, then the 12 scale bytes as 3 words
    hdr0, s0, s1, s2 = _four3(tl.load(W32 + base[:, :, None] + k[None, None, :]))
    d = _f16lo(hdr0)
    dmin = _f16hi(hdr0)
    acc = tl.zeros([BR, NB], dtype=tl.float32)  # Σ over sub-blocks of sc·dx·isum (times d at the end)
    accb = tl.zeros([BR, NB], dtype=tl.float32)  # Σ of m·sx (times dmin at the end)
    wp = W32 + base[:, :, None, None] + 4 + hk
    xw = z + b[None, :, None, None] * 64 + hk
    xs = z3 + b[None, :, None] * 16 + k[None, None, :]  # XDS words of block b: 4 a sub-block pair
    # all weight loads first: in program order, ptxas keeps them ahead of the math
    w0 = tl.load(wp)
    w1 = tl.load(wp + 8)
    w2 = tl.load(wp + 16)
    w3 = tl.load(wp + 24)
    if LB:
        qb.pdl_enter(PDL)
    for c in tl.static_range(4):
        if c == 0:
            w = w0
        elif c == 1:
            w = w1
        elif c == 2:
            w = w2
        else:
            w = w3
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
        # activation words of sub-blocks 2c, 2c+1 (XQ: 8 words a 32-block), in w's layout (L1 hits)
        xa = tl.load(XQ + xw + 16 * c)
        xb = tl.load(XQ + xw + 16 * c + 8)
        if CHAIN:  # one dp4a chain over the 4 words of a thread's load
            l0, l1, l2, l3 = _four(lo)
            h0, h1, h2, h3 = _four(hi)
            a0, a1, a2, a3 = _four(xa)
            b0, b1, b2, b3 = _four(xb)
            zz = tl.zeros([BR, NB, 2], dtype=tl.int32)
            ia = _dp4a(l0, a0, _dp4a(l1, a1, _dp4a(l2, a2, _dp4a(l3, a3, zz, ASM), ASM), ASM), ASM)
            ib = _dp4a(h0, b0, _dp4a(h1, b1, _dp4a(h2, b2, _dp4a(h3, b3, zz, ASM), ASM), ASM), ASM)
        else:
            ia = tl.sum(_dp4a(lo, xa, z, ASM), axis=3)  # [BR, NB, 2]
            ib = tl.sum(_dp4a(hi, xb, z, ASM), axis=3)
        ia = tl.sum(ia, axis=2).to(tl.float32)  # the two halves of the sub-block (in-thread)
        ib = tl.sum(ib, axis=2).to(tl.float32)
        sca, mna = _scale_min(s0, s1, s2, 2 * c)
        scb, mnb = _scale_min(s0, s1, s2, 2 * c + 1)
        # x side of sub-blocks 2c, 2c+1 in one 16-byte load, in the tile's (row, block) layout
        dxa, dxb, sxa, sxb = _four3(tl.load(XDS + xs + 4 * c).to(tl.int32, bitcast=True))
        dxa = dxa.to(tl.float32, bitcast=True)
        dxb = dxb.to(tl.float32, bitcast=True)
        sxa = sxa.to(tl.float32, bitcast=True)
        sxb = sxb.to(tl.float32, bitcast=True)
        acc += ia * (sca * dxa) + ib * (scb * dxb)
        accb += mna * sxa + mnb * sxb
    y = tl.sum(d * acc - dmin * accb, axis=1)
    tl.store(Y + rows, y, mask=rmask)


def lean_act(xq):
    """triton_q8.quantize_act's (XQ, XD, XS) of one row -> (XQ, XDS): XDS float32 [n/64, 4] holds per pair
    of 32-blocks (2j, 2j+1) their scales d and their 32-element sums d·Σq (one 16-byte load a pair)."""
    XQ, XD, XS = xq
    s32 = XS.reshape(-1, 2).sum(-1)
    return XQ, torch.cat([XD.reshape(-1, 2), s32.reshape(-1, 2)], -1).contiguous()


def lean(raw, xq, rows, n, BR=4, warps=2, CHAIN=1, asm=None, pdl=None, nxt=None, LB=0):
    """raw uint8 [rows·row_bytes] (Q4_K, 16-byte aligned), xq = triton_q8.quantize_act(x) -> y [rows]."""
    XQ, XDS = xq
    nb = n // 256
    y = torch.empty(rows, dtype=torch.float32, device=XQ.device)
    pdl = qb.pdl(XQ.device) if pdl is None else pdl
    asm = (XQ.device.type == "cuda") if asm is None else asm
    lean_kernel[(triton.cdiv(rows, BR),)](
        raw.reshape(-1).view(torch.int32), XQ, XDS, y, rows, nb * 36, raw if nxt is None else nxt,
        0 if nxt is None else nxt.numel(), -(-(0 if nxt is None else nxt.numel()) // triton.cdiv(rows, BR) // 16) * 16, NB=nb, BR=BR, CHAIN=CHAIN, ASM=asm, PDL=pdl,
        PF=qb.prefetch(pdl) and nxt is None, NT=32 * warps, PN=int(nxt is not None and asm), LB=LB, num_warps=warps,
        **qb.launch_kw(pdl),
    )  # fmt: skip
    return y


LEAN_TIMED = [(4, 1, 1), (8, 2, 1), (16, 4, 1), (8, 1, 1), (16, 2, 1), (32, 4, 1)]
CONFIGS = [(BR, w, ch) for BR, w in ((2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (16, 4)) for ch in (0, 1)]


def sass(LBS=0):
    sys.path.insert(0, "/tmp/lab")
    from sassprof import build, load_order, show

    for n in (2048, 4096):
        for BR, w, ch in CONFIGS:
            sig = dict(W32="*i32", XQ="*i32", XDS="*fp32", Y="*fp32", R="i32", row_words="i32",
                       NXT="*u8", nxt_bytes="i64", nxt_share="i32")
            cex = dict(NB=n // 256, BR=BR, CHAIN=ch, ASM=True, PDL=LBS, PF=0, NT=32 * w, PN=LBS, LB=LBS)
            r = build(lean_kernel, sig, cex, w, ("W32", "XQ", "XDS", "Y", "row_words"), dump=f"/tmp/lab/lean_{n}_{BR}_{w}_{ch}.sass")
            show(f"n{n} BR{BR} w{w} chain{ch}", r, BR * n // 256 * 144, 32 * w)
            print("   LDG before/after first math:", load_order(f"/tmp/lab/lean_{n}_{BR}_{w}_{ch}.sass"))


if __name__ == "__main__":
    from engine.quant.formats import QType
    from engine.runtime import triton_q8 as t8
    from engine.runtime import triton_q8_gemv as g8

    q = QType.Q4_K
    if sys.argv[1:2] == ["sass"]:
        sass(int(sys.argv[2]) if sys.argv[2:] else 0)
    elif sys.argv[1:2] == ["ncu"]:  # eager calls for Nsight Compute: ncu ... q4k_lean.py ncu BR w chain
        from engine.bench import device_kernels as dk

        BR, w, ch = (int(a) for a in sys.argv[2:5])
        rows, n = dk.TRUNK["q"]
        mats = dk.random_matrix(q, rows, n, 24)
        xq = lean_act(t8.quantize_act(torch.randn(1, n, device="cuda")))
        for m in mats:
            lean(m, xq, rows, n, BR, w, ch)
        torch.cuda.synchronize()
    elif not torch.cuda.is_available():  # parity in Triton's interpreter (TRITON_INTERPRET=1)
        gen = torch.Generator().manual_seed(0)
        for rows, n in ((13, 2048), (8, 4096)):
            raw = torch.randint(0, 256, (rows * n // 256 * 144,), dtype=torch.uint8, generator=gen)
            blocks = raw.view(-1, 144)
            blocks[:, 0:2] = torch.tensor([0.004], dtype=torch.float16).view(torch.uint8)
            blocks[:, 2:4] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
            x = torch.randn(1, n, generator=gen)
            ref = g8.matmul_q8_reference(raw, x, q, rows, n)[0].double()
            for BR, w, ch in ((4, 1, 0), (4, 2, 1), (16, 4, 1)):
                y = lean(raw, lean_act(t8.quantize_act(x)), rows, n, BR, w, ch, asm=False, pdl=0)
                print(f"rows {rows} n {n} BR{BR} chain{ch}: max |y - ref| / max |ref| = "
                      f"{((y.double() - ref).abs().max() / ref.abs().max()).item():.1e}")  # fmt: skip
    else:
        from engine.bench import device_kernels as dk
        from engine.runtime import triton_gemv as tg

        bw = dk.measure_bandwidth()
        print(f"bw {bw:.0f} GB/s", flush=True)
        for wl in ("q", "o"):
            rows, n = dk.TRUNK[wl]
            nbytes = rows * n // 256 * 144
            copies = max(48, math.ceil(1e9 / nbytes))
            mats = dk.random_matrix(q, rows, n, copies)
            x = torch.randn(1, n, device="cuda")
            xq = lean_act(t8.quantize_act(x))
            ref = g8.matmul_q8_reference(mats[0], x, q, rows, n)[0]
            frac = lambda us: f"{us:6.2f} us ({nbytes / us / 1e3 / bw:4.0%})"
            f32 = dk._graph_us([lambda m=m: tg.matmul(m, x, q, rows, n, act="f32") for m in mats])[0]
            q8 = dk._graph_us([lambda m=m: tg.matmul(m, x, q, rows, n, act="q8") for m in mats])[0]
            l2 = dk._graph_us([lambda: tg.matmul(mats[0], x, q, rows, n, act="f32")] * copies)[0]
            print(f"{wl}: f32 {frac(f32)} | q8 (+quantize) {frac(q8)} | f32 one matrix (L2) {frac(l2)}", flush=True)
            for BR, w, ch in LEAN_TIMED:
                try:
                    y = lean(mats[0], xq, rows, n, BR, w, ch)
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    us2 = dk._graph_us([lambda: lean(mats[0], xq, rows, n, BR, w, ch)] * copies)[0]
                    row = f"   lean BR{BR} w{w} chain{ch}: L2 {frac(us2)} err {err:.1e} |"
                    for pn, lb in ((0, 0), (1, 1), (0, 1)):
                        us = dk._graph_us([lambda i=i: lean(mats[i], xq, rows, n, BR, w, ch, nxt=mats[(i + pn) % copies] if pn else None, LB=lb) for i in range(copies)])[0]
                        row += f" pn{pn}lb{lb} {frac(us)}"
                    print(row, flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"   lean BR{BR} w{w} chain{ch}: {type(e).__name__} {str(e)[:300]}", flush=True)
