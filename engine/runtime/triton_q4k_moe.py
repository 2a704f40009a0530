"""Routed-expert decode for Q4_K experts on q8 activations with the fewest instructions a weight byte:
the fast path of :func:`engine.runtime.triton_moe.moe_decode` in q8 mode when gate and up are Q4_K
(a Q4_K_M file's experts; its down is Q4_K or, on a third to a half of the layers, Q6_K).

Contract (T tokens, K experts a token, model width D, expert width F, both multiples of 256; ``pool`` the
device slot pool, uint8; ``slots`` int64 [T·K], the byte offset of pair q = t·K + k's slot, −1 for a pair
served elsewhere; ``roles`` {"gate" | "up" | "down": (byte offset in the slot, qtype, rows, cols)}, role
offsets 16-byte aligned — :func:`applies_gate_up`, :func:`applies`):

- :func:`gate_up` -> H float32 [T·K, F]: ``H[q] = SiLU(gate_q · x̂_t) · (up_q · x̂_t)`` (ggml_swiglu_split),
  ``H[q] = 0`` for a skipped pair. x̂ is x [T, D] through ``triton_q8``'s rounding (``XQ`` int32 words of
  four int8 codes, ``XD`` a scale per 32, ``XS`` a dequantized sum per 16); handed in as ``xq`` (the norm
  kernel writes it: ``step_kernels.add_rms_norm(q8=True)``) or made by one ``quantize_act`` launch here.
  Kernel :func:`_gate_up_kernel`, grid (F/BR, T·K): whole rows a program.
- :func:`down` -> Y float32 [T, D]: ``Y[t] = Σ_k weights[t, k] · down_{t,k} · ĥ_{t·K+k}``, ĥ = H through the
  same rounding (one ``quantize_act`` launch); a skipped pair adds nothing. Kernel :func:`_down_kernel`,
  grid (D/BR, T): the experts × a row's half-blocks on one tile axis.
- Reference: :func:`engine.runtime.references.moe_decode_q8_reference` (``round_h=False`` when the down
  is not Q4_K and h goes to the exact-float down kernel): the same integer dp4a products, so equal up to
  the order of float32 sums (``tests/triton/``).

Byte layout: a Q4_K block is 144 bytes (36 int32 words) for 256 weights — d and dmin (float16), 12 bytes
of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of 4-bit codes (ggml's ``block_q4_K``). A
thread owns *half* a block: its 16-byte header and quant bytes 64·h … 64·h + 63 (sub-blocks 4h … 4h + 3),
five 16-byte loads; the two halves' products sum to the block's. Half a block keeps a thread's registers
low enough for several warps a scheduler (the measurements: docs/lab-notebook.md, "Routed-expert Q4_K
kernels").
- the 6-bit scales and mins of the half's 4 sub-blocks come out of the header words at once with
  masks and shifts, one byte each by a ``prmt``;
- high nibbles go to dp4a as ``w & 0xF0F0F0F0`` (16 × the code; the 1/16 is applied once a half);
- dp4a runs as chains through its accumulate operand (inline PTX; the interpreter runs the same
  arithmetic in plain Triton); the integer sum of a sub-block is scaled by its integer scale
  before it becomes a float, and d and dmin come in once a half.
Two tile orientations, the launch setting ``TILE``, with the same results: [half-blocks, rows] (``"halves"``,
the default: :func:`_gate_up_kernel`, :func:`_down_kernel`) and [rows, half-blocks] (``"rows"``:
:func:`_gate_up_kernel_t`, :func:`_down_kernel_t`). Triton picks a tile's blocked layout, and which
orientation gives a thread several rows at one half-block (activations loaded once, a row's sum in its
warp) depends on the Triton version, so ``kernel_select``'s ``triton=<version>.json`` tables choose by the
installed one.
A skipped pair (slot offset −1) gets h = 0 from the gate/up kernel; the down kernel reads slot 0's
rows for it and drops that half's product with a select (never multiplied: slot 0 may hold junk).
"""

from __future__ import annotations

import torch

from engine.quant.formats import QType
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl
BLOCK_WORDS = tl.constexpr(36) if tl is not None else 36  # int32 words a block (144 bytes)

QK = 256  # elements a Q4_K block


def applies_gate_up(roles: dict) -> bool:
    """Whether the gate/up kernel takes these expert roles: gate and up Q4_K, F and D multiples of 256,
    role offsets 16-byte aligned (the slot pool aligns roles to 256 bytes)."""
    (go, gq, F, D), (uo, uq, _, _), (do, _, _, _) = (roles[r] for r in ("gate", "up", "down"))
    same = QType(gq) == QType(uq) == QType.Q4_K
    return same and F % QK == 0 and D % QK == 0 and go % 16 == uo % 16 == do % 16 == 0


def applies(roles: dict) -> bool:
    """Whether both kernels take these roles (down Q4_K too)."""
    return applies_gate_up(roles) and QType(roles["down"][1]) == QType.Q4_K


if triton is not None:

    @triton.jit
    def _dp4a(a, b, c, ASM: tl.constexpr):
        """c + Σ over the 4 bytes of a (unsigned) × b (signed)."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)  # fmt: skip
        else:
            s = c
            for k in tl.static_range(4):
                s += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
            return s

    @triton.jit
    def _w4(t):
        """[A, B, 4] -> its 4 slices along the last axis, in order (a thread holds all 4: register renames)."""
        a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2]))
        a0, a1 = tl.split(a)  # elements 0, 2
        b0, b1 = tl.split(b)  # elements 1, 3
        return a0, b0, a1, b1

    @triton.jit
    def _bc(x, like):
        """x broadcast to the shape of ``like`` (nothing to do when they match)."""
        return tl.broadcast_to(x, like.shape)

    @triton.jit
    def _chain(w, x, acc, ASM: tl.constexpr):
        """acc + dp4a over the 4 words of w [A, B, 4] and x (the same shape, or [1, B, 4]: activations shared by
        the tile's rows), one chain through the accumulate operand."""
        w0, w1, w2, w3 = _w4(w)
        x0, x1, x2, x3 = _w4(x)
        d = _dp4a(w3, _bc(x3, w3), acc, ASM)
        d = _dp4a(w2, _bc(x2, w2), d, ASM)
        d = _dp4a(w1, _bc(x1, w1), d, ASM)
        return _dp4a(w0, _bc(x0, w0), d, ASM)

    @triton.jit
    def _byte(w, J: tl.constexpr, ASM: tl.constexpr):
        """Byte J of the words w, zero-extended (one PRMT where shift-and-mask takes two)."""
        if J == 0:
            return w & 0xFF
        elif not ASM:
            return (w >> (8 * J)) & 0xFF
        elif J == 1:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4441;", "=r,r", [w], tl.int32, True, 1)
        elif J == 2:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4442;", "=r,r", [w], tl.int32, True, 1)
        else:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4443;", "=r,r", [w], tl.int32, True, 1)

    @triton.jit
    def _load_half(P, hs):
        """Half hs [A, B] (0 or 1) of the Q4_K blocks at int32 pointers P [A, B] (16-byte aligned): the
        header [A, B, 4] and the 4 16-byte quarters of quant bytes 64·hs … 64·hs + 63 (sub-blocks
        4·hs … 4·hs + 3), one 16-byte load each."""
        p = P[:, :, None] + tl.arange(0, 4)[None, None, :]
        pq = p + 4 + 16 * hs[:, :, None]
        return tl.load(p), tl.load(pq), tl.load(pq + 4), tl.load(pq + 8), tl.load(pq + 12)

    @triton.jit
    def _dot_half(blk, hs, X, XDp, XSp, ASM: tl.constexpr):
        """Dot products [A, B] of the loaded halves blk (_load_half, halves hs) with their q8 activations:
        X (int32 pointers to the half's 32 XQ words), XDp (its 4 sub-block scales), XSp (its 8 16-sums) —
        pointers [A, B], or [1, B] when the tile's A rows share them (the [rows, half-blocks] tiles: loaded
        once a thread). The two halves of a block sum to the whole block's product."""
        m = tl.arange(0, 4)[None, None, :]
        hdr0, s0, s1, s2 = _w4(blk[0])
        # get_scale_min_k4 of 4 sub-blocks at once: byte j of a word is sub-block j's (or 4 + j's) value
        scw = tl.where(hs == 0, s0 & 0x3F3F3F3F, (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030))
        mnw = tl.where(hs == 0, s1 & 0x3F3F3F3F, ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030))
        d = (hdr0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((hdr0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dx = _w4(tl.load(XDp[:, :, None] + m))  # the 4 sub-blocks' activation scales
        ps = XSp[:, :, None] + m
        sa = _w4(tl.load(ps))  # the 16-sums of sub-blocks 0, 1 (two each) …
        sz = _w4(tl.load(ps + 4))  # … and of sub-blocks 2, 3
        px = X[:, :, None] + m
        zi = tl.zeros(d.shape, dtype=tl.int32)
        alo = tl.zeros(d.shape, dtype=tl.float32)
        ahi = tl.zeros(d.shape, dtype=tl.float32)
        amn = tl.zeros(d.shape, dtype=tl.float32)
        for c in tl.static_range(2):
            qa = blk[1 + 2 * c]  # quant bytes 0..15 of chunk c: elements 0..15 of sub-blocks 2c (low), 2c+1 (high)
            qz = blk[2 + 2 * c]  # bytes 16..31: elements 16..31
            # activation words: sub-block 2c is words 16c … 16c + 7 of the half, 2c + 1 the next 8
            ia = _chain(qa & 0x0F0F0F0F, tl.load(px + 16 * c), zi, ASM)
            ia = _chain(qz & 0x0F0F0F0F, tl.load(px + (16 * c + 4)), ia, ASM)
            ib = _chain(qa & -0x0F0F0F10, tl.load(px + (16 * c + 8)), zi, ASM)  # 0xF0F0F0F0: 16 × the code
            ib = _chain(qz & -0x0F0F0F10, tl.load(px + (16 * c + 12)), ib, ASM)
            sca = _byte(scw, 2 * c, ASM)
            scb = _byte(scw, 2 * c + 1, ASM)
            mna = _byte(mnw, 2 * c, ASM)
            mnb = _byte(mnw, 2 * c + 1, ASM)
            alo += (ia * sca).to(tl.float32) * _bc(dx[2 * c], d)
            ahi += (ib * scb).to(tl.float32) * _bc(dx[2 * c + 1], d)
            if c == 0:
                s_a = sa[0] + sa[1]
                s_b = sa[2] + sa[3]
            else:
                s_a = sz[0] + sz[1]
                s_b = sz[2] + sz[3]
            amn += mna.to(tl.float32) * _bc(s_a, d) + mnb.to(tl.float32) * _bc(s_b, d)
        return d * (alo + ahi * 0.0625) - dmin * amn

    @triton.jit
    def _gate_up_rows(W32, SLOT, XQ, XD, XS, go, uo, q, r0, K: tl.constexpr, NB: tl.constexpr, BR: tl.constexpr,
                      ASM: tl.constexpr):  # fmt: skip
        """h [BR] = SiLU(gate_q[rows]·x_t) · (up_q[rows]·x_t), rows r0 … r0 + BR − 1, for pair q = t·K + k at
        byte SLOT[q] of the pool (−1: h = 0); gate/up at byte offsets go/uo of the slot, NB blocks a row.
        [2·NB, BR] tiles: a row's half-blocks on the fastest lanes (a row's sum stays in the warp), a
        thread holds the gate and the up half of its (half-block, row) and loads their activations once."""
        slot = tl.load(SLOT + q)
        if slot != -1:
            rows = r0 + tl.arange(0, BR)
            t = q // K
            e = tl.arange(0, 2 * NB)
            b = e // 2
            zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
            hs = (e % 2)[:, None] + zp
            off = tl.multiple_of(b[:, None] * BLOCK_WORDS + rows[None, :] * (BLOCK_WORDS * NB), [4, 4])  # words
            gb = _load_half(W32 + tl.multiple_of((slot + go) // 4, 4) + off, hs)  # both matrices' loads first
            ub = _load_half(W32 + tl.multiple_of((slot + uo) // 4, 4) + off, hs)
            X = XQ + t * (64 * NB) + (zp + (b * 64 + (e % 2) * 32)[:, None])
            XDp = XD + t * (8 * NB) + (zp + (b * 8 + (e % 2) * 4)[:, None])
            XSp = XS + t * (16 * NB) + (zp + (b * 16 + (e % 2) * 8)[:, None])
            g = tl.sum(_dot_half(gb, hs, X, XDp, XSp, ASM), axis=0)
            u = tl.sum(_dot_half(ub, hs, X, XDp, XSp, ASM), axis=0)
            h = g / (1.0 + tl.exp(-g)) * u  # ggml_swiglu_split
        else:
            h = tl.zeros([BR], dtype=tl.float32)
        return h

    @triton.jit
    def _gate_up_kernel(W32, SLOT, XQ, XD, XS, H, go, uo, F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                        BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """H[q, rows] = :func:`_gate_up_rows` for pair q (program axis 1), F / BR tiles of rows (axis 0)."""
        qb.pdl_enter(PDL)  # SLOT comes from the routing kernel
        q = tl.program_id(1)
        r0 = tl.program_id(0) * BR
        h = _gate_up_rows(W32, SLOT, XQ, XD, XS, go, uo, q, r0, K, NB, BR, ASM)
        tl.store(H + q.to(tl.int64) * F + r0 + tl.arange(0, BR), h)

    @triton.jit
    def _down_lanes(SLOT, WT, t, e, K: tl.constexpr, NBF: tl.constexpr):
        """Token t's experts × half-block lanes e (indices 0 … K·NL − 1 along either tile axis, NL =
        next_power_of_2(2·NBF)) -> (block b, half hv, pair q, its slot, keep, routing weight wk): lanes ≥ 2·NBF
        repeat the last half and are not kept, nor are skipped pairs (slot −1)."""
        NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
        lane = e % NL
        lc = tl.minimum(lane, 2 * NBF - 1)
        b = lc // 2
        hv = lc % 2
        q = t * K + e // NL
        slot = tl.load(SLOT + q)
        keep = (lane < 2 * NBF) & (slot != -1)
        return b, hv, q, slot, keep, tl.load(WT + q)

    @triton.jit
    def _down_kernel(W, W32, SLOT, HQ, HD, HS, WT, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr,
                     BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr):  # fmt: skip
        """Y[t, rows] = Σ_k WT[t, k] · down_{t,k}[rows] · hq[t·K + k], down at byte offset do of the slot, NBF
        blocks a row; D % BR == 0. [K·NL, BR] tiles: experts × half-block lanes on one axis (NL =
        next_power_of_2(2·NBF); lanes ≥ 2·NBF repeat the last half and are dropped), a thread one half-block
        of a row. PF: the experts' rows are prefetched into L2 before the PDL wait (SLOT is final by then:
        the routing kernel wrote it before the gate/up kernel released this one); the launch setting's
        "PF" turns it off (off in the default settings: docs/lab-notebook.md, "Routed-expert Q4_K kernels")."""
        t = tl.program_id(1)
        r0 = tl.program_id(0) * BR
        RW: tl.constexpr = BLOCK_WORDS * NBF  # words a row
        if PF:
            qb.prefetch_pairs(W, SLOT, t, 0, D, r0, do, RW * 4, K, K, BR, NT)
        qb.pdl_enter(PDL)
        rows = r0 + tl.arange(0, BR)
        NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
        b, hv, q, slot, keep, wk = _down_lanes(SLOT, WT, t, tl.arange(0, K * NL), K, NBF)
        zp = tl.zeros([K * NL, BR], dtype=tl.int32)
        P = W32 + (
            tl.multiple_of((tl.where(slot != -1, slot, 0) + do) // 4 + b * BLOCK_WORDS, 4)[:, None]
            + (rows * RW)[None, :]
        )
        hs = hv[:, None] + zp
        X = HQ + (zp + (q * (64 * NBF) + b * 64 + hv * 32)[:, None])
        XDp = HD + (zp + (q * (8 * NBF) + b * 8 + hv * 4)[:, None])
        XSp = HS + (zp + (q * (16 * NBF) + b * 16 + hv * 8)[:, None])
        v = _dot_half(_load_half(P, hs), hs, X, XDp, XSp, ASM)
        y = tl.sum(tl.where(keep[:, None], v * wk[:, None], 0.0), axis=0)
        tl.store(Y + t * D + rows, y)

    @triton.jit
    def _gate_up_kernel_t(W32, SLOT, XQ, XD, XS, H, go, uo, F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                          BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """:func:`_gate_up_kernel` with [rows, half-blocks] tiles (launch setting ``TILE: "rows"``): the
        activation pointers [1, 2·NB] are shared by the tile's rows."""
        qb.pdl_enter(PDL)
        q = tl.program_id(1)
        r0 = tl.program_id(0) * BR
        slot = tl.load(SLOT + q)
        rows = r0 + tl.arange(0, BR)
        if slot != -1:
            t = q // K
            e = tl.arange(0, 2 * NB)[None, :]
            b = e // 2
            hs = e % 2
            off = tl.multiple_of(rows[:, None] * (BLOCK_WORDS * NB) + b * BLOCK_WORDS, [4, 4])
            gb = _load_half(W32 + tl.multiple_of((slot + go) // 4, 4) + off, _bc(hs, off))
            ub = _load_half(W32 + tl.multiple_of((slot + uo) // 4, 4) + off, _bc(hs, off))
            X = XQ + t * (64 * NB) + b * 64 + hs * 32
            XDp = XD + t * (8 * NB) + b * 8 + hs * 4
            XSp = XS + t * (16 * NB) + b * 16 + hs * 8
            g = tl.sum(_dot_half(gb, hs, X, XDp, XSp, ASM), axis=1)
            u = tl.sum(_dot_half(ub, hs, X, XDp, XSp, ASM), axis=1)
            h = g / (1.0 + tl.exp(-g)) * u  # ggml_swiglu_split
        else:
            h = tl.zeros([BR], dtype=tl.float32)
        tl.store(H + q.to(tl.int64) * F + rows, h)

    @triton.jit
    def _down_kernel_t(W, W32, SLOT, HQ, HD, HS, WT, Y, do, D: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr,
                       BR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr):  # fmt: skip
        """:func:`_down_kernel` with [rows, experts × half-block lanes] tiles (``TILE: "rows"``)."""
        t = tl.program_id(1)
        r0 = tl.program_id(0) * BR
        RW: tl.constexpr = BLOCK_WORDS * NBF
        if PF:
            qb.prefetch_pairs(W, SLOT, t, 0, D, r0, do, RW * 4, K, K, BR, NT)
        qb.pdl_enter(PDL)
        rows = r0 + tl.arange(0, BR)
        NL: tl.constexpr = triton.next_power_of_2(2 * NBF)
        b, hv, q, slot, keep, wk = _down_lanes(SLOT, WT, t, tl.arange(0, K * NL)[None, :], K, NBF)
        P = W32 + (
            tl.multiple_of((tl.where(slot != -1, slot, 0) + do) // 4 + b * BLOCK_WORDS, [1, 4]) + rows[:, None] * RW
        )
        X = HQ + q * (64 * NBF) + b * 64 + hv * 32
        XDp = HD + q * (8 * NBF) + b * 8 + hv * 4
        XSp = HS + q * (16 * NBF) + b * 16 + hv * 8
        v = _dot_half(_load_half(P, _bc(hv, P)), hv, X, XDp, XSp, ASM)
        y = tl.sum(tl.where(keep, v * wk, 0.0), axis=1)
        tl.store(Y + t * D + rows, y)


def gate_up(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, roles: dict, K: int, cfg: dict,
            xq: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """h = SiLU(gate·x̂) · (up·x̂) float32 [T·K, F] of the pairs at byte offsets ``slots`` [T·K] (−1: h = 0),
    x̂ = x [T, D] through triton_q8's rounding (``applies_gate_up(roles)``); xq: x̂ already made
    (``triton_q8.quantize_act(x)``'s tensors), else one launch makes it here."""
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    if F % cfg["BR"]:
        raise ValueError(f"Q4_K MoE gate/up launch setting {cfg} does not divide F={F}")
    dev = x.device
    pdl = qb.pdl(dev)
    XQ, XD, XS = xq if xq is not None else t8.quantize_act(x.contiguous())
    H = torch.empty((slots.numel(), F), dtype=torch.float32, device=dev)
    kernel = _gate_up_kernel_t if cfg.get("TILE") == "rows" else _gate_up_kernel
    kernel[(F // cfg["BR"], slots.numel())](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, H, go, uo, F=F, K=K, NB=D // QK, BR=cfg["BR"],
        ASM=t8.use_asm(dev), PDL=pdl, num_warps=cfg["num_warps"], **qb.launch_kw(pdl),
    )  # fmt: skip
    return H


def down(pool: torch.Tensor, slots: torch.Tensor, H: torch.Tensor, weights: torch.Tensor, roles: dict, K: int,
         cfg: dict) -> torch.Tensor:  # fmt: skip
    """Σ_k weights[t, k] · down_k · ĥ_{t·K+k} float32 [T, D], ĥ = H [T·K, F] through triton_q8's rounding
    (``applies(roles)``)."""
    do, _, D, F = roles["down"]
    if D % cfg["BR"]:
        raise ValueError(f"Q4_K MoE down launch setting {cfg} does not divide D={D}")
    T = slots.numel() // K
    dev = H.device
    pdl = qb.pdl(dev)
    HQ, HD, HS = t8.quantize_act(H)
    pool = pool.reshape(-1)
    Y = torch.empty((T, D), dtype=torch.float32, device=dev)
    kernel = _down_kernel_t if cfg.get("TILE") == "rows" else _down_kernel
    kernel[(D // cfg["BR"], T)](
        pool, pool.view(torch.int32), slots, HQ, HD, HS, weights.to(torch.float32).contiguous(), Y, do, D=D, K=K,
        NBF=F // QK, BR=cfg["BR"], ASM=t8.use_asm(dev), PDL=pdl, PF=qb.prefetch(pdl) * cfg.get("PF", 1), NT=32 * cfg["num_warps"],
        num_warps=cfg["num_warps"], **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y
