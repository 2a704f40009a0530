"""Q4_K GEMV with fewer instructions per weight: the quants load as 32-bit words and each 4-bit code
becomes a float by one shift and one LOP3, as f = 1 + q/16 (bits 0x3F800000 | q << 19); the
weight is then one FMA, w = S·f − M with S = 16·d·sc and M = 16·d·sc + dmin·m per (row, block,
sub-block), and the product a second FMA: 4 instructions per element against ~9 in
triton_qblocks.part (byte loads, PRMT, the 2^23 magic and its subtraction).

Not adopted: written after the session's GPU time was spent, so it has parity (the interpreter)
and a static sm_90 profile (`python3 packaging/gpu_labs/q4k_words.py sass`, Triton 3.6's ptxas)
but no timing yet. Run on the GPU machine: PYTHONPATH=. python3 packaging/gpu_labs/q4k_words.py
"""
# ruff: noqa: B023, E702, E401  (lab script: lambdas run inside the loop iteration that made them)

import math
import os
import sys

import torch
import triton
import triton.language as tl

from engine.runtime import triton_qblocks as qb


@triton.jit
def _code(word, SH: tl.constexpr):
    """The 4 bits at bit SH of each word moved to bits 19..22 of 1.0f: f = 1 + q/16 (one shift, one LOP3)."""
    if SH <= 19:
        t = word << (19 - SH)
    else:
        t = word >> (SH - 19)
    return ((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _codes(word, LO: tl.constexpr):
    """int32 words [BR, NB, 8] -> f = 1 + q/16 [BR, NB, 32] for the low (LO) or high nibble of each byte
    (element 4j + i is byte i of word j); the byte positions are compile-time shifts."""
    H: tl.constexpr = 0 if LO else 4
    f0 = _code(word, H)
    f1 = _code(word, 8 + H)
    f2 = _code(word, 16 + H)
    f3 = _code(word, 24 + H)
    f = tl.join(tl.join(f0, f2), tl.join(f1, f3))  # [BR, NB, 8, 2, 2]: (p, q) = byte 2p + q
    return tl.reshape(f, [word.shape[0], word.shape[1], 32])


@triton.jit
def _sbyte(w1, w2, w3, J: tl.constexpr):
    """Byte J (0..11) of a K-quant block's packed scales, from its three words."""
    if J < 4:
        w = w1
    elif J < 8:
        w = w2
    else:
        w = w3
    return (w >> (8 * (J % 4))) & 0xFF


@triton.jit
def _scale_min(w1, w2, w3, S: tl.constexpr):
    """6-bit scale and min of sub-block S (ggml get_scale_min_k4) from the scale words, as floats."""
    if S < 4:
        sc = _sbyte(w1, w2, w3, S) & 63
        m = _sbyte(w1, w2, w3, S + 4) & 63
    else:
        a = _sbyte(w1, w2, w3, S + 4)
        sc = (a & 0xF) | ((_sbyte(w1, w2, w3, S - 4) >> 6) << 4)
        m = (a >> 4) | ((_sbyte(w1, w2, w3, S) >> 6) << 4)
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def q4k_words_kernel(W, X, Y, R, row_bytes, BR: tl.constexpr, NB: tl.constexpr, STEPS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    rowoff = tl.minimum(rows, R - 1).to(tl.int64) * row_bytes
    l32 = tl.arange(0, 32)
    j8 = tl.arange(0, 8)
    W32 = W.to(tl.pointer_type(tl.int32))
    acc3 = tl.zeros([BR, NB, 32], dtype=tl.float32)
    for s in tl.static_range(STEPS):
        b = s * NB + tl.arange(0, NB)
        boff = tl.multiple_of(rowoff[:, None] + b[None, :].to(tl.int64) * 144, [16, 16])  # [BR, NB]
        widx = tl.multiple_of(boff // 4, [4, 4])  # word index of each block: 16-byte aligned
        # the block header as 4 words in one 16-byte load: d | dmin, then the 12 scale bytes
        hdr = tl.load(W32 + widx[:, :, None] + tl.arange(0, 4)[None, None, :])
        w02, w13 = tl.split(tl.reshape(hdr, [BR, NB, 2, 2]))
        w0, w2 = tl.split(w02)
        w1, w3 = tl.split(w13)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        for c in tl.static_range(4):
            word = tl.load(W32 + (widx + 4 + 8 * c)[:, :, None] + j8[None, None, :])  # [BR, NB, 8], 16-byte loads
            for h in tl.static_range(2):
                sc, mn = _scale_min(w1, w2, w3, 2 * c + h)
                S = 16.0 * d * sc
                M = S + dmin * mn
                f = _codes(word, h == 0)
                w = tl.fma(f, S[:, :, None], -M[:, :, None])
                xv = tl.load(X + b[:, None] * 256 + (64 * c + 32 * h) + l32[None, :])  # [NB, 32]
                acc3 += w * xv[None, :, :]
    tl.store(Y + rows, tl.sum(tl.sum(acc3, axis=2), axis=1), mask=rmask)


def q4k_words(raw, x, rows, n, BR=8, NB=8, warps=4):
    nb = n // 256
    y = torch.empty(rows, dtype=torch.float32, device=x.device)
    q4k_words_kernel[(triton.cdiv(rows, BR),)](
        raw.reshape(-1), x.reshape(-1), y, rows, nb * 144, BR=BR, NB=NB, STEPS=-(-nb // NB), num_warps=warps
    )
    return y


def sass():
    """Registers and SASS instruction mix of this kernel and of triton_gemv's, compiled for sm_90
    without a GPU (the JIT's 16-byte divisibility hints on pointers and sizes, as at run time)."""
    import collections
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.quant.formats import QType
    from engine.runtime import triton_gemv as tg

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

    def build(fn, sig, cex, warps, div16):
        names = list(sig) + list(cex)
        sig = dict(sig, **{k: "constexpr" for k in cex})
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}
        k = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=cex, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps},
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
            fh.write(k.asm["cubin"])
        res = subprocess.run(
            [f"{bindir}/cuobjdump", "--dump-resource-usage", fh.name], capture_output=True, text=True
        ).stdout
        regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", res).groups()
        ops = collections.Counter()
        for line in subprocess.run(
            [f"{bindir}/nvdisasm", "-c", fh.name], capture_output=True, text=True
        ).stdout.splitlines():
            m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
            if m:
                ops[m.group(1).split(".")[0]] += 1
        return int(regs), int(stack), ops

    for BR, NB, w in ((8, 8, 4), (4, 8, 4), (16, 8, 4), (8, 8, 8), (8, 4, 4)):
        nbytes = BR * 8 * 144
        sig = {"W": "*u8", "X": "*fp32", "Y": "*fp32", "R": "i32", "row_bytes": "i32"}
        r1 = build(
            q4k_words_kernel, sig, {"BR": BR, "NB": NB, "STEPS": -(-8 // NB)}, w, ("W", "X", "Y", "R", "row_bytes")
        )
        sig0 = {
            "W": "*u8",
            "OFFS": "*i64",
            "X": "*fp32",
            "Y": "*fp32",
            "R": "i32",
            "n": "i32",
            "row_bytes": "i32",
            "nb": "i32",
            "T": "i32",
        }
        cex0 = dict(qb.geometry(QType.Q4_K), BR=BR, NB=NB, BT=1, SPLIT=1, STEPS=qb.steps(8, NB), PDL=0, PF=0, NT=32 * w)
        r0 = build(tg._gemv_kernel, sig0, cex0, w, ("W", "OFFS", "X", "Y", "R", "n", "row_bytes"))
        for name, (regs, stack, ops) in (("triton_gemv", r0), ("words", r1)):
            tot = sum(ops.values())
            mix = " ".join(
                f"{o}:{ops[o]}" for o in ("FFMA", "FADD", "FMUL", "LOP3", "PRMT", "SHF", "LDG", "LDS", "BAR")
            )
            print(
                f"K=2048 BR{BR} NB{NB} w{w} {name:11}: regs {regs} stack {stack}, {tot} SASS/thread = "
                f"{tot * 32 * w / nbytes:.1f} per weight byte; {mix}"
            )


if __name__ == "__main__":
    from engine.quant.formats import QType
    from engine.runtime.tdequant import dequantize

    if sys.argv[1:] == ["sass"]:
        sass()
    elif not torch.cuda.is_available():  # parity in Triton's interpreter (TRITON_INTERPRET=1)
        gen = torch.Generator().manual_seed(0)
        rows, n = 16, 2048
        raw = torch.randint(0, 256, (rows * 8 * 144,), dtype=torch.uint8, generator=gen)
        blocks = raw.view(-1, 144)
        blocks[:, 0:2] = torch.tensor([0.004], dtype=torch.float16).view(torch.uint8)
        blocks[:, 2:4] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        x = torch.randn(1, n, generator=gen)
        ref = dequantize(raw.view(rows, -1), QType.Q4_K, n).double() @ x[0].double()
        for BR, NB in ((8, 8), (4, 4), (16, 2)):
            y = q4k_words(raw, x, rows, n, BR, NB)
            print(
                f"BR{BR} NB{NB}: max |y - ref| / max |ref| = {((y.double() - ref).abs().max() / ref.abs().max()).item():.1e}"
            )
    else:
        from engine.bench import device_kernels as dk
        from engine.runtime import triton_gemv as tg

        bw = dk.measure_bandwidth()
        q = QType.Q4_K
        for wl in ("q", "o"):
            rows, n = dk.TRUNK[wl]
            nbytes = rows * n // 256 * 144
            mats = dk.random_matrix(q, rows, n, max(48, math.ceil(1e9 / nbytes)))
            x = torch.randn(1, n, device="cuda")
            ref = dequantize(mats[0].view(rows, -1), q, n) @ x[0]
            base = dk._graph_us([lambda m=m: tg.matmul(m, x, q, rows, n) for m in mats])[0]
            print(f"{wl}: triton_gemv {base:.2f} us ({nbytes / base / 1e3 / bw:.0%})", flush=True)
            for BR, NB, w in ((8, 8, 4), (4, 8, 4), (16, 8, 4), (8, 8, 8), (8, 4, 4)):
                y = q4k_words(mats[0], x, rows, n, BR, NB, w)
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                us = dk._graph_us([lambda m=m: q4k_words(m, x, rows, n, BR, NB, w) for m in mats])[0]
                print(
                    f"   words BR{BR} NB{NB} w{w}: {us:.2f} us ({nbytes / us / 1e3 / bw:.0%}) err {err:.1e}", flush=True
                )
