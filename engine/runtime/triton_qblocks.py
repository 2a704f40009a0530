"""Triton building blocks shared by the quantized device kernels: dequantize a tile of raw GGUF
blocks in registers.

A tile is ``BR`` rows × ``NB`` consecutive blocks of a row-major quantized matrix whose block
starts are the byte offsets ``boff [BR, NB]`` into the uint8 pool ``W``. Each block type is
split into ``NPART`` parts of ``PW`` consecutive elements (part ``i`` covers elements
``i·PW … i·PW+PW-1`` of every block), so every kernel — GEMV, fused MoE, tiled prefill — walks
``for i in static_range(NPART)``, asks :func:`part` for the float32 tile ``[BR, NB, PW]`` and
multiplies it with the matching activations ``x[b·QK + i·PW + l]``. Loads run along each row's
bytes (contiguous 16- or 32-byte runs per block), so a warp's loads coalesce.

The decoders follow ggml's ``dequantize_row_q4_0 / q5_0 / q8_0 / q2_K / q3_K / q4_K / q5_K / q6_K /
mxfp4 / iq4_nl / iq4_xs`` (the same rules as ``engine.quant.reference`` and the torch reference
``engine.runtime.references``). Integers become floats with the exponent trick (``bits(2²³ + q) − 2²³``: an
OR and a subtract, no int→float conversion instruction) — exact for the small codes here. The 16-level
tables of MXFP4 and IQ4 are looked up in four packed 32-bit words (:func:`_level`).
"""

from __future__ import annotations

import contextlib
import contextvars
from functools import cache

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None
try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from engine import config
from engine.quant.formats import QType, block_format
from engine.quant.reference import IQ4NL_VALUES, MXFP4_VALUES

SUPPORTED = (
    QType.Q4_0,
    QType.Q5_0,
    QType.Q8_0,
    QType.Q2_K,
    QType.Q3_K,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
    QType.MXFP4,
    QType.IQ4_NL,
    QType.IQ4_XS,
)
# The types whose kernels have been compiled and held to the references on a CUDA GPU; on a compiled device
# kernel_select.fused serves only these (a type added to SUPPORTED keeps the torch references there until a CUDA
# run of tests/triton checks it). Q2_K, Q3_K, Q5_0, MXFP4, IQ4_NL and IQ4_XS: their expert cache and resident
# experts through the fused and grouped kernels equal to the CPU engine on an H200 (2026-11-28, 261c5c3).
CUDA_CHECKED = SUPPORTED
# Per type, how the kernels walk a block: (part width PW, parts NPART, ALIGN: the alignment every block start has
# when the matrix starts 16-byte aligned, so loads can be that wide). A block's bytes and elements are the format
# table's (``engine.quant.formats.block_format``).
_WALK: dict[QType, tuple[int, int, int]] = {
    QType.Q4_0: (16, 2, 2),
    QType.Q5_0: (16, 2, 2),
    QType.Q8_0: (32, 1, 2),
    QType.Q2_K: (32, 8, 4),
    QType.Q3_K: (32, 8, 2),
    QType.Q4_K: (32, 8, 16),
    QType.Q5_K: (32, 8, 16),
    QType.Q6_K: (32, 8, 2),
    QType.MXFP4: (16, 2, 1),
    QType.IQ4_NL: (16, 2, 2),
    QType.IQ4_XS: (32, 8, 8),
}
# Per type: (type_size bytes, block elements QK, PW, NPART, ALIGN).
GEOMETRY: dict[QType, tuple[int, int, int, int, int]] = {
    q: (block_format(q).type_size, block_format(q).block_size, *walk) for q, walk in _WALK.items()
}


def _pack_levels(levels: tuple[int, ...]) -> tuple[int, ...]:
    """16 int8 levels -> four 32-bit words of four bytes each (level i: byte i % 4 of word i // 4)."""
    b = [v & 0xFF for v in levels]
    return tuple(sum(b[4 * w + k] << (8 * k) for k in range(4)) for w in range(4))


_IQ4_WORDS = _pack_levels(tuple(int(v) for v in IQ4NL_VALUES))
_MXFP4_WORDS = _pack_levels(tuple(int(v) for v in MXFP4_VALUES))


def geometry(qtype: QType) -> dict:
    """The constexpr arguments a kernel needs for ``qtype``: QT, TS, QK, PW, NPART, ALIGN."""
    ts, qk, pw, npart, align = GEOMETRY[QType(qtype)]
    return {"QT": int(QType(qtype)), "TS": ts, "QK": qk, "PW": pw, "NPART": npart, "ALIGN": align}


if triton is not None:

    @triton.jit
    def _u2f(u):
        """int32 u in [0, 2²³) -> float32, exactly (2²³ + u as float bits, minus 2²³)."""
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def round_bf16(v):
        """float32 v rounded to the nearest bfloat16 (ties to even), as float32: torch's ``.to(bfloat16)``
        and CUDA's ``cvt.rn.bf16.f32`` on finite values, in integer ops (Triton's interpreter truncates)."""
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)

    @triton.jit
    def _f16(p, mask):
        """fp16 at even byte pointers p (little-endian) -> float32 (0 where masked off)."""
        h = tl.load(p.to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
        return h.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _byte(p, mask):
        return tl.load(p, mask=mask, other=0).to(tl.int32)

    IQ4_W0 = tl.constexpr(_IQ4_WORDS[0])
    IQ4_W1 = tl.constexpr(_IQ4_WORDS[1])
    IQ4_W2 = tl.constexpr(_IQ4_WORDS[2])
    IQ4_W3 = tl.constexpr(_IQ4_WORDS[3])
    MX_W0 = tl.constexpr(_MXFP4_WORDS[0])
    MX_W1 = tl.constexpr(_MXFP4_WORDS[1])
    MX_W2 = tl.constexpr(_MXFP4_WORDS[2])
    MX_W3 = tl.constexpr(_MXFP4_WORDS[3])

    @triton.jit
    def _level(n, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
        """int32 codes n in [0, 16) -> the int8 level n of the table packed in W0..W3, as float32."""
        w = tl.where(n < 8, tl.where(n < 4, W0, W1), tl.where(n < 12, W2, W3)).to(tl.int64)
        v = ((w >> ((n & 3) * 8).to(tl.int64)) & 0xFF).to(tl.int32)
        return ((v ^ 0x80) - 0x80).to(tl.float32)

    @triton.jit
    def _nibble(blk, off: tl.constexpr, l, m3, HIGH: tl.constexpr):
        """int32 [BR, NB, PW]: the low (HIGH 0) or high nibbles of the bytes at blk + off + l."""
        u = tl.load(blk[:, :, None] + off + l[None, None, :], mask=m3, other=0).to(tl.int32)
        if HIGH:
            u = u >> 4
        else:
            u = u & 0xF
        return u

    @triton.jit
    def _q3k_scale(sc, S: tl.constexpr, mask):
        """Q3_K's 6-bit scale S (0..15) from its 12 packed bytes at sc, minus 32, as float32."""
        if S < 8:
            low = _byte(sc + S, mask) & 0xF
        else:
            low = _byte(sc + (S - 8), mask) >> 4
        top = (_byte(sc + (8 + S % 4), mask) >> (2 * (S // 4))) & 3
        return ((low | (top << 4)) - 32).to(tl.float32)

    @triton.jit
    def _k4_scale_min(sb, S: tl.constexpr, mask):
        """6-bit scale and min of sub-block S from the 12 packed bytes at sb (get_scale_min_k4)."""
        if S < 4:
            sc = _byte(sb + S, mask) & 63
            m = _byte(sb + S + 4, mask) & 63
        else:
            a = _byte(sb + S + 4, mask)
            sc = (a & 0xF) | ((_byte(sb + S - 4, mask) >> 6) << 4)
            m = (a >> 4) | ((_byte(sb + S, mask) >> 6) << 4)
        return sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def part(W, boff, mask, QT: tl.constexpr, I: tl.constexpr, PW: tl.constexpr):
        """Part I of the blocks at byte offsets boff [BR, NB] of pool W -> float32 [BR, NB, PW]."""
        blk = W + boff  # [BR, NB] block starts
        l = tl.arange(0, PW)
        m3 = mask[:, :, None]
        if QT == 8:  # Q8_0: d, int8 qs[32]
            d = _f16(blk, mask)
            u = tl.load(blk[:, :, None] + 2 + l[None, None, :], mask=m3, other=0).to(tl.int32)
            q = (((u ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True)) - 8388736.0  # int8 value
            w = d[:, :, None] * q
        elif QT == 2:  # Q4_0: d, qs[16]: low nibbles are elements 0..15, high nibbles 16..31
            d = _f16(blk, mask)
            u = _nibble(blk, 2, l, m3, I)
            q = ((u | 0x4B000000).to(tl.float32, bitcast=True)) - 8388616.0  # nibble - 8
            w = d[:, :, None] * q
        elif QT == 12 or QT == 13:  # Q4_K / Q5_K: sub-block I = nibble I%2 of qs[32·(I//2) + l]
            if QT == 12:
                u = tl.load(blk[:, :, None] + (16 + 32 * (I // 2)) + l[None, None, :], mask=m3, other=0)
            else:
                u = tl.load(blk[:, :, None] + (48 + 32 * (I // 2)) + l[None, None, :], mask=m3, other=0)
            u = u.to(tl.int32)
            if I % 2 == 0:
                u = u & 0xF
            else:
                u = u >> 4
            if QT == 13:  # Q5_K: bit I of qh[l] is the fifth bit
                qh = tl.load(blk[:, :, None] + 16 + l[None, None, :], mask=m3, other=0).to(tl.int32)
                u = u | (((qh >> I) & 1) << 4)
            d = _f16(blk, mask)
            dmin = _f16(blk + 2, mask)
            sc, mn = _k4_scale_min(blk + 4, I, mask)
            w = (d * sc)[:, :, None] * _u2f(u) - (dmin * mn)[:, :, None]
        elif QT == 6:  # Q5_0: d, qh (32 bits, little-endian), qs[16]; element e's fifth bit is bit e of qh
            d = _f16(blk, mask)
            u = _nibble(blk, 6, l, m3, I)
            e = I * 16 + l  # element index in the block
            qh = tl.load(blk[:, :, None] + 2 + (e // 8)[None, None, :], mask=m3, other=0).to(tl.int32)
            u = u | (((qh >> (e % 8)[None, None, :]) & 1) << 4)
            q = ((u | 0x4B000000).to(tl.float32, bitcast=True)) - 8388624.0  # code - 16
            w = d[:, :, None] * q
        elif QT == 10:  # Q2_K: scales[16] (scale | min << 4), qs[64], d, dmin; part I = half I//4, shift I%4
            N: tl.constexpr = I // 4
            J: tl.constexpr = I % 4
            u = tl.load(blk[:, :, None] + (16 + 32 * N) + l[None, None, :], mask=m3, other=0).to(tl.int32)
            u = (u >> (2 * J)) & 3
            sa = _byte(blk + (8 * N + 2 * J), mask)
            sb = _byte(blk + (8 * N + 2 * J + 1), mask)
            lo16 = l[None, None, :] < 16
            sc = tl.where(lo16, (sa & 0xF)[:, :, None], (sb & 0xF)[:, :, None]).to(tl.float32)
            mn = tl.where(lo16, (sa >> 4)[:, :, None], (sb >> 4)[:, :, None]).to(tl.float32)
            d = _f16(blk + 80, mask)[:, :, None]
            dmin = _f16(blk + 82, mask)[:, :, None]
            w = (d * sc) * _u2f(u) - dmin * mn
        elif QT == 11:  # Q3_K: hmask[32], qs[64], scales[12], d; part I = half I//4, shift I%4, hmask bit I
            N: tl.constexpr = I // 4
            J: tl.constexpr = I % 4
            u = tl.load(blk[:, :, None] + (32 + 32 * N) + l[None, None, :], mask=m3, other=0).to(tl.int32)
            hm = tl.load(blk[:, :, None] + l[None, None, :], mask=m3, other=0).to(tl.int32)
            q = ((u >> (2 * J)) & 3) - 4 * (1 - ((hm >> I) & 1))  # -4 .. 3
            sa = _q3k_scale(blk + 96, 2 * I, mask)
            sb = _q3k_scale(blk + 96, 2 * I + 1, mask)
            d = _f16(blk + 108, mask)
            sc = tl.where(l[None, None, :] < 16, (d * sa)[:, :, None], (d * sb)[:, :, None])
            w = sc * q.to(tl.float32)
        elif QT == 39:  # MXFP4: e8m0 exponent e, qs[16]: low nibbles are elements 0..15, high 16..31
            e = _byte(blk, mask)
            bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
            d = bits.to(tl.float32, bitcast=True)  # 2^(e-128), ggml's GGML_E8M0_TO_FP32_HALF
            u = _nibble(blk, 1, l, m3, I)
            w = d[:, :, None] * _level(u, MX_W0, MX_W1, MX_W2, MX_W3)
        elif QT == 20:  # IQ4_NL: d, qs[16]: low nibbles are elements 0..15, high 16..31; kvalues_iq4nl levels
            d = _f16(blk, mask)
            u = _nibble(blk, 2, l, m3, I)
            w = d[:, :, None] * _level(u, IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3)
        elif QT == 23:  # IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; part I = group I of 32, dl = d·(ls − 32)
            d = _f16(blk, mask)
            ls = (_byte(blk + (4 + I // 2), mask) >> (4 * (I % 2))) & 0xF
            ls = ls | (((_byte(blk + (2 + I // 4), mask) >> (2 * (I % 4))) & 3) << 4)
            dl = d * (ls - 32).to(tl.float32)
            u = tl.load(blk[:, :, None] + (8 + 16 * I) + (l % 16)[None, None, :], mask=m3, other=0).to(tl.int32)
            u = tl.where(l[None, None, :] < 16, u & 0xF, u >> 4)
            w = dl[:, :, None] * _level(u, IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3)
        else:  # Q6_K: ql[128], qh[64], int8 scales[16], d; half H = I//4, group G = I%4
            H: tl.constexpr = I // 4
            G: tl.constexpr = I % 4
            ql = tl.load(blk[:, :, None] + (64 * H + 32 * (G % 2)) + l[None, None, :], mask=m3, other=0)
            qh = tl.load(blk[:, :, None] + (128 + 32 * H) + l[None, None, :], mask=m3, other=0).to(tl.int32)
            ql = ql.to(tl.int32)
            if G < 2:
                ql = ql & 0xF
            else:
                ql = ql >> 4
            u = ql | (((qh >> (2 * G)) & 3) << 4)
            sa = tl.load(blk + (192 + 8 * H + 2 * G), mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            sb = tl.load(blk + (193 + 8 * H + 2 * G), mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = _f16(blk + 208, mask)
            sc = tl.where(l[None, None, :] < 16, (d * sa)[:, :, None], (d * sb)[:, :, None])  # 16 values a scale
            w = sc * (((u | 0x4B000000).to(tl.float32, bitcast=True)) - 8388640.0)  # q - 32
        return w

    @triton.jit
    def prefetch_l2(W, start, nbytes, NT: tl.constexpr):
        """One bulk L2 prefetch (``cp.async.bulk.prefetch.L2``, sm_90) of the 16-byte-aligned bytes inside
        [start, start + nbytes) of W, issued by one thread of the program (NT: its thread count)."""
        a = (start + 15) // 16 * 16
        size = tl.maximum((start + nbytes) // 16 * 16 - a, 0).to(tl.int32)
        i = tl.arange(0, NT)
        tl.inline_asm_elementwise(
            "{ .reg .pred q; setp.eq.u32 q, $2, 0; setp.ne.and.u32 q, $3, 0, q; "
            "@q cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [W + a + i.to(tl.int64) * 0, i, i * 0 + size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def prefetch_rows(W, off, r0, R, BR: tl.constexpr, row_bytes, NT: tl.constexpr):
        """prefetch_l2 of a program's tile of rows [r0, min(r0 + BR, R)) of the matrix at byte off of W
        (R ≤ r0: nothing)."""
        prefetch_l2(W, off + r0.to(tl.int64) * row_bytes, tl.minimum(R - r0, BR).to(tl.int64) * row_bytes, NT)

    @triton.jit
    def prefetch_pairs(W, SLOT, t, k0, R, r0, roff, row_bytes, K: tl.constexpr, PER: tl.constexpr,
                       BR: tl.constexpr, NT: tl.constexpr):  # fmt: skip
        """prefetch_rows of the matrix at byte roff of the slots of pairs t·K + k0 … + PER - 1 (slot offset
        −1: none). SLOT must be final before this kernel's PDL wait (see pdl_enter)."""
        for j in tl.static_range(PER):
            slot = tl.load(SLOT + t * K + k0 + j, mask=k0 + j < K, other=-1)
            prefetch_rows(W, tl.where(slot != -1, slot, 0) + roff, r0, tl.where(slot != -1, R, 0), BR, row_bytes, NT)

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """Programmatic dependent launch (PDL > 0; the launch passes ``launch_pdl=True``): wait until the
        previous kernel has finished and its writes are visible, then let the next kernel start
        launching. Before this call a kernel may read only what no earlier kernel of the step writes
        (weights, constant tables) — it issues its weight prefetches there — with one exception: the
        kernel released by this one may read what the kernel *before* this one wrote (the routing
        table, in the MoE down kernel), because the release comes after this wait. Releasing after
        the wait also keeps at most one kernel waiting ahead (released before it, each kernel would
        release the next at once, and a whole chain would sit on the SMs prefetching). Every program
        calls this on every path: a grid that skipped the wait could finish before its predecessor."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def block_offsets(rowoff, b, nb_end, rmask, TS: tl.constexpr, ALIGN: tl.constexpr):
        """Byte offsets [BR, NB] of blocks b [NB] of the rows starting at rowoff [BR], and the mask."""
        boff = tl.multiple_of(rowoff[:, None] + b[None, :].to(tl.int64) * TS, [ALIGN, ALIGN])
        return boff, rmask[:, None] & (b < nb_end)[None, :]

    @triton.jit
    def _acc_step(acc3, W, rowoff, rmask, b0, kb1, xrow, xscale,
                  QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
                  ALIGN: tl.constexpr, NB: tl.constexpr):  # fmt: skip
        """acc3 += blocks b0 … b0+NB-1 (those < kb1) of the rows at rowoff times xscale·xrow."""
        l = tl.arange(0, PW)
        b = b0 + tl.arange(0, NB)
        boff, m2 = block_offsets(rowoff, b, kb1, rmask, TS, ALIGN)
        for i in tl.static_range(NPART):
            w = part(W, boff, m2, QT, i, PW)  # [BR, NB, PW]
            xv = tl.load(xrow + b[:, None] * QK + i * PW + l[None, :], mask=(b < kb1)[:, None], other=0.0)
            acc3 += w * (xv * xscale)[None, :, :]
        return acc3

    @triton.jit
    def acc_rows(acc3, W, rowoff, rmask, kb0, kb1, xrow, xscale,
                 QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
                 ALIGN: tl.constexpr, NB: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
        """acc3 [BR, NB, PW] += the rows at rowoff [BR] over blocks [kb0, kb1) times xscale·xrow, element-wise
        (sum acc3 over its last two axes for the dot products; one reduction after all K is cheaper).

        STEPS > 0: the caller knows kb1 - kb0 ≤ STEPS·NB and the walk is unrolled — straight-line code,
        so every step's loads can be in flight at once (a decode GEMV is latency-bound: a runtime loop
        waits for memory once per step). STEPS = 0: a runtime loop (long rows)."""
        if STEPS == 0:
            for b0 in range(kb0, kb1, NB):
                acc3 = _acc_step(acc3, W, rowoff, rmask, b0, kb1, xrow, xscale, QT, TS, QK, PW, NPART, ALIGN, NB)
        else:
            for j in tl.static_range(STEPS):
                acc3 = _acc_step(
                    acc3, W, rowoff, rmask, kb0 + j * NB, kb1, xrow, xscale, QT, TS, QK, PW, NPART, ALIGN, NB
                )
        return acc3


@cache
def _pdl_device(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index)[0] >= 9


def compiled(device, options: config.EngineOptions | None = None) -> bool:
    """Triton compiles for ``device``: a CUDA device, not Triton's interpreter (``TRITON_INTERPRET=1``;
    ``options`` default: ``config.current()``)."""
    return device.type == "cuda" and not (options or config.current()).triton_interpret


def _gdc_compiled() -> bool:
    """Triton has grid dependency control and compiles (its interpreter has none)."""
    return gdc_wait is not None and not config.current().triton_interpret


_WARMUP = contextvars.ContextVar("sharpi_graph_warmup", default=False)


@contextlib.contextmanager
def graph_warmup():
    """Launches inside run as they will inside the CUDA graph captured next: the eager warm-up of a
    decode step (``graph_decode``) or of a benched chain. With it the warm-up compiles and loads the
    very kernel variants the capture records (PDL on, q8 activations), so nothing is compiled while
    the stream is capturing (a compile there can invalidate the capture:
    ``cudaErrorStreamCaptureInvalidated``), and the warm-up computes what a replay does."""
    token = _WARMUP.set(True)
    try:
        yield
    finally:
        _WARMUP.reset(token)


def in_graph_step() -> bool:
    """Whether launches now go into a CUDA graph step: the current stream is capturing, or this is the
    warm-up of one (:func:`graph_warmup`)."""
    import torch

    return _WARMUP.get() or torch.cuda.is_current_stream_capturing()


def pdl(device) -> int:
    """1 where a kernel launched now on ``device`` uses programmatic dependent launch — compiled Triton
    on a CUDA device of compute capability ≥ 9 (Hopper), while a CUDA graph is being captured (the
    decode step, the kernel bench; or its warm-up: :func:`in_graph_step`), ``$SHARPI_PDL`` not ``0`` — else 0. With it each kernel of a
    chain starts launching, and prefetching its weights into L2, while the previous one runs: one
    launch of a trunk matrix alone cannot pass ~50 % of the memory bandwidth. Launches from Python
    (no graph) are far apart, so there it would change nothing but the launch path."""
    if device.type != "cuda" or not _gdc_compiled():
        return 0
    if not in_graph_step():  # eager launches (the common case): one query
        return 0
    return int(pdl_supported(device.index if device.index is not None else 0))


def pdl_supported(index: int | None = None) -> bool:
    """Whether CUDA device ``index`` (default: the current one) runs the kernels with programmatic
    dependent launch inside graphs: compiled Triton with grid dependency control, compute capability
    ≥ 9, and ``$SHARPI_PDL`` not ``0``."""
    import torch

    if not _gdc_compiled() or not torch.cuda.is_available():
        return False
    if not config.current().pdl:
        return False
    return _pdl_device(torch.cuda.current_device() if index is None else index)


def prefetch(pdl_flag: int) -> int:
    """1 where a PDL kernel also prefetches its weights into L2 before its wait (the default);
    ``$SHARPI_PDL_PREFETCH=0`` keeps PDL without the prefetches (to tell the two apart)."""
    return int(bool(pdl_flag) and config.current().pdl_prefetch)


def launch_kw(flag: int) -> dict:
    """The launch keyword a PDL kernel needs (none otherwise: the interpreter takes no such keyword)."""
    return {"launch_pdl": True} if flag else {}


# K walks of at most this many tile steps are unrolled (a launch setting "UNROLL" overrides it).
UNROLL = 16


def steps(blocks: int, nb_tile: int, limit: int = UNROLL) -> int:
    """The STEPS constexpr for a walk over ``blocks`` blocks ``nb_tile`` at a time: unrolled up to
    ``limit`` steps, else 0 (a runtime loop)."""
    s = -(-blocks // nb_tile)
    return s if s <= limit else 0
