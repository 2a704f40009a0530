"""Fused routed-expert kernels over the raw quantized slots of the device expert pool.

Decode (a few tokens), two launches for all k experts of all T tokens:

- :func:`moe_decode` runs ``_gate_up_kernel`` — per (token, expert) pair and tile of F rows: gather
  the slot by byte offset, dequantize gate and up in registers, ``h = SiLU(gate·x) · (up·x)``
  (ggml_swiglu_split) → ``H [T·K, F]`` — then ``_down_kernel`` — per token and tile of D rows: loop
  over the token's k experts inside the program, ``y += w_k · (down_k · h_k)`` → ``Y [T, D]``.
  Deterministic (no atomics); a pair whose slot offset is −1 is skipped (a cache miss computed
  elsewhere).

Prefill (many tokens), tokens sorted by expert:

- :func:`grouped_matmul` — entries sorted by group, each group's rows of X times one quantized
  matrix; each program dequantizes a weight tile once for a tile of up to BT of its group's entries
  (:func:`tile_starts`: a table built on the device, so nothing waits for the host) and multiplies
  with ``tl.dot``. :func:`moe_prefill` builds the MoE from it; the trunk's matrices with more than a
  few tokens use the same kernel over one matrix (:func:`one_matrix`, :func:`dense_matmul`).
  Operands (``kernel_select.prefill_precision``): bfloat16 — x rounded once per launch group, the
  weights rounded in registers, tensor-core MMA, float32 accumulation (the CUDA default) — or float32
  (tf32×3 on CUDA: float32 accuracy, the reference-equivalent path).

:func:`moe_decode` runs the integer (dp4a, q8-activation) kernels of ``triton_q8_moe`` where
``kernel_select.act_mode`` / ``moe_act`` say so (``SHARPI_DEVICE_ACT=q8`` or ``act="q8"``; the default
is the exact-float kernels below).

References with the same signatures (``*_reference``: torch dequantize-then-matmul) are in
:mod:`engine.runtime.references`; ``tests/triton/`` holds them together.
"""

from __future__ import annotations

import torch

from engine import config
from engine.config import EngineOptions
from engine.models.layers import silu_mul
from engine.quant.formats import QType, block_format
from engine.runtime import kernel_select as ks
from engine.runtime import triton_q4k_moe, triton_q8_moe
from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl


def _geo(qtype: QType, suffix: str = "") -> dict:
    return {k + suffix: v for k, v in qb.geometry(qtype).items()}


if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        W, SLOT, X, H, F, D, K, go, uo, g_row_bytes, u_row_bytes, g_nb, u_nb,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr,
        QTu: tl.constexpr, TSu: tl.constexpr, QKu: tl.constexpr, PWu: tl.constexpr, NPARTu: tl.constexpr,
        ALIGNu: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, STEPS: tl.constexpr, STEPSu: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """H[q, rows] = SiLU(gate_q[rows]·x_t) · (up_q[rows]·x_t) for pair q = t·K + k (slot SLOT[q])."""
        qb.pdl_enter(PDL)  # SLOT comes from the routing kernel (the down kernel may read it once released)
        q = tl.program_id(1)
        slot = tl.load(SLOT + q)
        if slot != -1:
            rows = tl.program_id(0) * BR + tl.arange(0, BR)
            rmask = rows < F
            xrow = X + (q // K).to(tl.int64) * D
            base = tl.multiple_of(slot, 16)
            # gate is summed before up starts, so its [BR, NB, PW] accumulator is dead by then
            g3 = tl.zeros([BR, NB, PW], dtype=tl.float32)
            g3 = qb.acc_rows(
                g3, W, base + go + rows.to(tl.int64) * g_row_bytes, rmask, 0, g_nb, xrow, 1.0,
                QT, TS, QK, PW, NPART, ALIGN, NB, STEPS,
            )  # fmt: skip
            g = tl.sum(tl.sum(g3, axis=2), axis=1)
            u3 = tl.zeros([BR, NB, PWu], dtype=tl.float32)
            u3 = qb.acc_rows(
                u3, W, base + uo + rows.to(tl.int64) * u_row_bytes, rmask, 0, u_nb, xrow, 1.0,
                QTu, TSu, QKu, PWu, NPARTu, ALIGNu, NB, STEPSu,
            )  # fmt: skip
            u = tl.sum(tl.sum(u3, axis=2), axis=1)
            h = g / (1.0 + tl.exp(-g)) * u
            tl.store(H + q.to(tl.int64) * F + rows, h, mask=rmask)

    @triton.jit
    def _down_pair(acc3, W, SLOT, Hh, WT, t, k, rows, rmask, F, do, row_bytes, nb, K: tl.constexpr,
                   QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
                   ALIGN: tl.constexpr, NB: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
        """acc3 += WT[t, k] · down_{t,k}[rows] · H[t·K + k] (nothing when k ≥ K or the pair has no slot)."""
        q = t * K + k
        slot = tl.load(SLOT + q, mask=k < K, other=-1)
        wt = tl.load(WT + q, mask=k < K, other=0.0)
        kb1 = tl.where(slot != -1, nb, 0)
        rowoff = tl.multiple_of(tl.where(slot != -1, slot, 0), 16) + do + rows.to(tl.int64) * row_bytes
        return qb.acc_rows(
            acc3, W, rowoff, rmask, 0, kb1, Hh + q.to(tl.int64) * F, wt, QT, TS, QK, PW, NPART, ALIGN, NB, STEPS
        )

    @triton.jit
    def _down_kernel(
        W, SLOT, Hh, WT, Y, D, F, do, row_bytes, nb, K: tl.constexpr,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, KSPLIT: tl.constexpr, STEPS: tl.constexpr,
        PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr,
    ):  # fmt: skip
        """Y[g, t, rows] = Σ_k WT[t, k] · down_{t,k}[rows] · H[t·K + k] over the pairs with a slot, k in
        group g of KSPLIT groups of the k experts (the caller adds the groups: more programs, no atomics).
        With PDL the rows are prefetched into L2 while the gate/up kernel runs (it released this kernel
        only after its own wait, so SLOT is final)."""
        t = tl.program_id(1)
        g = tl.program_id(2)
        r0 = tl.program_id(0) * BR
        rows = r0 + tl.arange(0, BR)
        rmask = rows < D
        PER: tl.constexpr = (K + KSPLIT - 1) // KSPLIT
        if PF:
            qb.prefetch_pairs(W, SLOT, t, g * PER, D, r0, do, row_bytes, K, PER, BR, NT)
        qb.pdl_enter(PDL)
        acc3 = tl.zeros([BR, NB, PW], dtype=tl.float32)
        # Masks instead of branches (a missing slot walks zero blocks); up to 4 experts a program the
        # walk is unrolled, so with STEPS > 0 all of their weight loads can be in flight together
        # (8 unrolled experts exhaust ptxas: 32 registers and spills on sm_90).
        if PER <= 4:
            for j in tl.static_range(PER):
                acc3 = _down_pair(acc3, W, SLOT, Hh, WT, t, g * PER + j, rows, rmask, F, do, row_bytes, nb, K,
                                  QT, TS, QK, PW, NPART, ALIGN, NB, STEPS)  # fmt: skip
        else:
            for j in range(PER):
                acc3 = _down_pair(acc3, W, SLOT, Hh, WT, t, g * PER + j, rows, rmask, F, do, row_bytes, nb, K,
                                  QT, TS, QK, PW, NPART, ALIGN, NB, STEPS)  # fmt: skip
        T = tl.num_programs(1)
        tl.store(Y + (g * T + t).to(tl.int64) * D + rows, tl.sum(tl.sum(acc3, axis=2), axis=1), mask=rmask)

    @triton.jit
    def _grouped_kernel(
        W, TLO, SEG, TOK, X, Y, woff, R, J, n, row_bytes, nb,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
        OPS: tl.constexpr, DENSE: tl.constexpr,
    ):  # fmt: skip
        """Y[j, rows] = W_j[rows] · X[TOK[j]] for the entries j of tile z = program_id(1), W_j the matrix at
        byte SEG[j] + woff of W (16-aligned). Tile z: the entries j in [TLO[z], TLO[z] + BT) with SEG[j] = SEG[TLO[z]]
        (a group's entries are consecutive); TLO[z] = −1: no tile. DENSE: one matrix at byte woff, tile z
        the matrix at byte 0, tile z the entries [z·BT, z·BT + BT) of J, TOK[j] = j (TLO, SEG, TOK, woff unread).

        OPS 0: X float32, float32 operands (``tl.dot`` at PREC: tf32x3 on CUDA). OPS 1: X bfloat16, the
        weight tile rounded to bfloat16 (to nearest even) in registers, bfloat16 MMA. OPS 2 (Triton's
        interpreter): OPS 1's operands, multiplied as float32 (exact products). Accumulation float32.
        The tile is acc [BR, BT] = W tile [BR, NB·PW] · Xᵀ tile [NB·PW, BT]: BR, BT, NB·PW ≥ 16, powers of 2."""
        z = tl.program_id(1)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        if DENSE:
            lo = z * BT
            rowoff = rows.to(tl.int64) * row_bytes
        else:
            lo = tl.load(TLO + z)
            s0 = tl.load(SEG + tl.maximum(lo, 0))
            rowoff = tl.multiple_of(s0 + woff, 16) + rows.to(tl.int64) * row_bytes
        if lo >= 0:
            jj = lo + tl.arange(0, BT)
            if DENSE:
                jmask = jj < J
                tok = jj.to(tl.int64)
            else:
                jmask = (jj < J) & (tl.load(SEG + jj, mask=jj < J, other=-1) == s0)
                tok = tl.load(TOK + jj, mask=jmask, other=0).to(tl.int64)
            l = tl.arange(0, PW)
            acc = tl.zeros([BR, BT], dtype=tl.float32)
            for b0 in range(0, nb, NB):
                b = b0 + tl.arange(0, NB)
                boff, m2 = qb.block_offsets(rowoff, b, nb, rmask, TS, ALIGN)
                for i in tl.static_range(NPART):
                    w = tl.reshape(qb.part(W, boff, m2, QT, i, PW), [BR, NB * PW])
                    xcol = tl.reshape(b[:, None] * QK + i * PW + l[None, :], [NB * PW])
                    xok = tl.reshape((b < nb)[:, None] & (l < PW)[None, :], [NB * PW])
                    xt = tl.load(X + tok[None, :] * n + xcol[:, None], mask=xok[:, None] & jmask[None, :], other=0.0)
                    if OPS == 1:  # bfloat16 MMA (the conversion rounds to nearest even)
                        w = w.to(tl.bfloat16)
                    elif OPS == 2:  # the same products in float32 (the interpreter's bf16 dot is unusable)
                        w = qb.round_bf16(w)
                        xt = xt.to(tl.float32)
                    acc = tl.dot(w, xt, acc, input_precision=PREC)
            tl.store(Y + jj[None, :].to(tl.int64) * R + rows[:, None], acc, mask=rmask[:, None] & jmask[None, :])


# -- decode ------------------------------------------------------------------------------------
def moe_decode(
    pool: torch.Tensor,
    slot_off: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    roles: dict[str, tuple[int, QType, int, int]],
    act: str | None = None,
    xq: tuple | None = None,
    options: EngineOptions | None = None,
) -> torch.Tensor:
    """Σ_k weights[t, k] · down(SiLU(gate·x_t) · up·x_t) over the experts whose slot is given.

    pool uint8 [n_slots·stride] (flat or [n_slots, stride]); slot_off int64 [T, K] byte offset of
    each pair's slot from the pool's base (−1: skip the pair; any other value is read, also one that points
    outside the pool — at an expert's page-locked host copy, read over the bus: ``expert_pool.HostMirror``);
    x float32 [T, D]; weights float32 [T, K];
    roles: {"gate"|"up"|"down": (byte offset in the slot, qtype, rows, n)} -> float32 [T, D].
    act: "q8" | "f32" | None (``kernel_select.act_mode``). The launches are ``kernel_select.moe_kernels``':
    in q8 mode, gate and up Q4_K, the lean kernels of triton_q4k_moe (down Q4_K: all lean; else h in float
    into the exact-float down kernel, i.e. ``references.moe_decode_q8_reference(..., round_h=False)``);
    other types triton_q8_moe; f32 the exact-float kernels below.
    xq: x already in triton_q8's format (``triton_q8.quantize_act(x)``'s three tensors, e.g. from the
    norm kernel before: ``step_kernels.add_rms_norm(..., q8=True)``), used by the lean kernels.
    options: the engine options (launch tables; default ``config.current()``).
    """
    T, K = slot_off.shape
    (go, gq, F, D), (uo, uq, _, _), (do, dq, _, _) = (roles[r] for r in ("gate", "up", "down"))
    gq, uq, dq = QType(gq), QType(uq), QType(dq)
    name = ks.device_name(x.device)
    pdl = qb.pdl(x.device)
    slots = slot_off.reshape(-1).contiguous()
    k_gate_up, k_down = ks.moe_kernels(roles, ks.act_mode(x.device, act, options))
    c = ks.launch(k_gate_up, gq, F * T * K, name, options)
    if k_gate_up == "moe_q4k_gate_up":  # the lean Q4_K kernels: h in float
        H = triton_q4k_moe.gate_up(pool, slots, x, roles, K, c, xq)
        if k_down == "moe_q4k_down":
            return triton_q4k_moe.down(pool, slots, H, weights, roles, K, ks.launch(k_down, dq, D * T, name, options))
        # else: h in float into the exact-float down kernel below (no q8 down beats it for these types)
    elif k_gate_up == "moe_q8_gate_up":
        cd = ks.launch(k_down, dq, D * T, name, options)
        return triton_q8_moe.moe_decode_q8(pool, slot_off, x, weights, roles, c, cd)
    else:
        H = torch.empty((T * K, F), dtype=torch.float32, device=x.device)
        g_nb, u_nb, lim = D // qb.GEOMETRY[gq][1], D // qb.GEOMETRY[uq][1], c.get("UNROLL", ks.UNROLL)
        _gate_up_kernel[(triton.cdiv(F, c["BR"]), T * K)](
            pool, slots, x.contiguous(), H, F, D, K, go, uo, block_format(gq).row_bytes(D),
            block_format(uq).row_bytes(D), g_nb, u_nb, BR=c["BR"], NB=c["NB"], STEPS=qb.steps(g_nb, c["NB"], lim),
            STEPSu=qb.steps(u_nb, c["NB"], lim), PDL=pdl, num_warps=c["num_warps"], **_geo(gq), **_geo(uq, "u"),
            **qb.launch_kw(pdl),
        )  # fmt: skip
    c = ks.launch(k_down, dq, D * T, name, options)
    nks = max(1, min(c.get("KSPLIT", 1), K))
    Y = torch.empty((nks, T, D), dtype=torch.float32, device=x.device)
    d_nb = F // qb.GEOMETRY[dq][1]
    _down_kernel[(triton.cdiv(D, c["BR"]), T, nks)](
        pool, slots, H, weights.to(torch.float32).contiguous(), Y, D, F, do, block_format(dq).row_bytes(F), d_nb,
        K=K, BR=c["BR"], NB=c["NB"], KSPLIT=nks, STEPS=qb.steps(d_nb, c["NB"], c.get("UNROLL", ks.UNROLL)),
        PDL=pdl, PF=qb.prefetch(pdl), NT=32 * c["num_warps"], num_warps=c["num_warps"], **_geo(dq), **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y[0] if nks == 1 else Y.sum(0)


# -- prefill -----------------------------------------------------------------------------------
def _launch_name(X: torch.Tensor) -> str:
    return "grouped_bf16" if X.dtype == torch.bfloat16 else "grouped"


def _ops(X: torch.Tensor, options: EngineOptions | None) -> dict:
    """The kernel's operand constexprs for X's dtype: OPS (0 float32, 1 bfloat16 MMA, 2 bfloat16 emulated in
    the interpreter) and PREC, tl.dot's input precision (tf32x3 — float32 accuracy — for float32 operands on
    CUDA; the compiler's default for bfloat16, whose products are exact; "ieee" in the interpreter)."""
    bf16 = X.dtype == torch.bfloat16
    if not qb.compiled(X.device, options):
        return {"OPS": 2 if bf16 else 0, "PREC": "ieee"}
    return {"OPS": 1, "PREC": "tf32"} if bf16 else {"OPS": 0, "PREC": "tf32x3"}


def operand(X: torch.Tensor, precision: str) -> torch.Tensor:
    """X [T, n] as the tiled kernels take it for ``precision`` ("bf16" | "f32": ``kernel_select.prefill_precision``),
    contiguous; rounded to bfloat16 once here, never per tile."""
    return X.to(torch.bfloat16 if precision == "bf16" else torch.float32).contiguous()


if triton is not None:

    @triton.jit
    def _max_i32(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _tile_starts_kernel(SEG, OUT, J, n_tiles, BT: tl.constexpr, CH: tl.constexpr):
        """One program walks the J entries CH at a time, carrying the tiles found so far and the start of the
        group running into the next chunk: :func:`tile_starts_reference`'s table in one launch."""
        count = tl.zeros([], dtype=tl.int32)  # tiles found so far
        gstart = tl.zeros([], dtype=tl.int32)  # where the group running into this chunk started
        for c0 in range(0, J, CH):
            j = c0 + tl.arange(0, CH)
            m = j < J
            s = tl.load(SEG + j, mask=m, other=-1)
            sp = tl.load(SEG + j - 1, mask=m & (j > 0), other=-1)
            new = (s != sp) | (j == 0)
            start = tl.associative_scan(tl.where(new, j, 0), 0, _max_i32)  # each entry's group start
            start = tl.maximum(start, gstart)
            head = m & (s != -1) & ((j - start) % BT == 0)
            hi = head.to(tl.int32)
            idx = count + tl.cumsum(hi, 0) - 1
            tl.store(OUT + idx, j.to(tl.int64), mask=head & (idx < n_tiles))
            count += tl.sum(hi, 0)
            gstart = tl.max(tl.where(m, start, 0), 0)
        for t0 in range(0, n_tiles, CH):
            t = t0 + tl.arange(0, CH)
            tl.store(OUT + t, tl.full([CH], -1, tl.int64), mask=(t >= count) & (t < n_tiles))


def tile_starts(seg: torch.Tensor, BT: int, n_tiles: int) -> torch.Tensor:
    """The tiles of :func:`grouped_matmul` over entries sorted by group: int64 [n_tiles], each tile's first
    entry (−1: no tile). seg int64 [J]: each entry's group (its matrix's byte offset), equal groups
    consecutive, −1 for entries to skip. A group of c entries has ceil(c / BT) tiles; n_tiles must bound
    their sum (Σ ceil(c_g / BT) ≤ (J + G·(BT − 1)) / BT for G groups). No host sync: one Triton launch where
    Triton runs (a prompt's layer is bound by its launches' host cost), else :func:`tile_starts_reference`."""
    J = seg.shape[0]
    if triton is None or (seg.device.type != "cuda" and not config.current().triton_interpret):
        return tile_starts_reference(seg, BT, n_tiles)
    out = torch.empty(n_tiles, dtype=torch.int64, device=seg.device)
    if n_tiles:
        _tile_starts_kernel[(1,)](seg.contiguous(), out, J, n_tiles, BT=BT, CH=1024, num_warps=4)
    return out


def tile_starts_reference(seg: torch.Tensor, BT: int, n_tiles: int) -> torch.Tensor:
    """:func:`tile_starts` in torch ops (about 17 launches): the reference the kernel is held to."""
    J = seg.shape[0]
    pos = torch.arange(J, dtype=torch.int64, device=seg.device)
    new = torch.ones(J, dtype=torch.bool, device=seg.device)
    new[1:] = seg[1:] != seg[:-1]  # [J] an entry that starts its group
    first = torch.cummax(torch.where(new, pos, 0), 0).values  # [J] where each entry's group starts
    head = ((pos - first) % BT == 0) & (seg != -1)  # [J] the entries that start a tile
    idx = torch.where(head, torch.cumsum(head, 0) - 1, n_tiles)  # the rest land in a spare last entry
    out = torch.full((n_tiles + 1,), -1, dtype=torch.int64, device=seg.device)
    return out.scatter_(0, idx, pos)[:n_tiles]


def max_tiles(J: int, groups: int, BT: int) -> int:
    """The most tiles :func:`tile_starts` can need for J entries in at most ``groups`` groups."""
    return min(J, (J + groups * (BT - 1)) // BT)


def grouped_matmul(
    pool: torch.Tensor,
    seg: torch.Tensor,
    woff: int,
    tok: torch.Tensor,
    X: torch.Tensor,
    qtype: QType,
    rows: int,
    n: int,
    groups: int,
    cfg: dict | None = None,
    options: EngineOptions | None = None,
    tiles: dict | None = None,
) -> torch.Tensor:
    """Y float32 [J, rows] with Y[j] = W_j · X[tok[j]], W_j the matrix [rows, n] at byte seg[j] + woff of pool.

    pool uint8 (flat); seg int64 [J] each entry's matrix (byte offset, 16-aligned with woff), entries of
    one matrix consecutive, −1: skip the entry (its row of Y is left unwritten; any other value, negative too,
    is read: a host copy's offset, ``moe_decode``); tok int64 [J] rows of X
    [T, n], float32 (float32 operands) or bfloat16 (:func:`operand`; tensor-core MMA); groups: a bound on
    the distinct matrices in seg (sizes the grid: no host sync). cfg: launch settings (default
    ``kernel_select.launch("grouped" | "grouped_bf16", ...)``); tiles: a dict shared by the calls over
    the same seg, keyed by BT, to build each tile table once.
    """
    qtype = QType(qtype)
    J = tok.shape[0]
    c = cfg or ks.launch(_launch_name(X), qtype, rows, ks.device_name(X.device), options)
    BT = c["BT"]
    Y = torch.empty((J, rows), dtype=torch.float32, device=X.device)
    nt = max_tiles(J, max(1, min(groups, J)), BT)
    if tiles is None or BT not in tiles:
        tlo = tile_starts(seg, BT, nt)
        if tiles is not None:
            tiles[BT] = tlo
    else:
        tlo = tiles[BT]
    _grouped_kernel[(triton.cdiv(rows, c["BR"]), nt)](
        pool, tlo, seg, tok, X.contiguous(), Y, woff, rows, J, n, block_format(qtype).row_bytes(n),
        n // qb.GEOMETRY[qtype][1], BR=c["BR"], NB=c["NB"], BT=BT, DENSE=False, **_ops(X, options),
        num_warps=c["num_warps"], **_geo(qtype),
    )  # fmt: skip
    return Y


def dense_matmul(
    raw: torch.Tensor, X: torch.Tensor, qtype: QType, rows: int, n: int, cfg: dict | None = None,
    options: EngineOptions | None = None,
) -> torch.Tensor:  # fmt: skip
    """raw uint8 [rows, row_bytes] times X [T, n] (float32, or bfloat16: :func:`grouped_matmul`) ->
    float32 [T, rows]: the grouped kernel over one matrix, tile by tile (any T)."""
    qtype = QType(qtype)
    T = X.shape[0]
    c = cfg or ks.launch(_launch_name(X), qtype, rows, ks.device_name(X.device), options)
    Y = torch.empty((T, rows), dtype=torch.float32, device=X.device)
    if T == 0:
        return Y
    _grouped_kernel[(triton.cdiv(rows, c["BR"]), triton.cdiv(T, c["BT"]))](
        raw.reshape(-1), raw, raw, raw, X.contiguous(), Y, 0, rows, T, n, block_format(qtype).row_bytes(n),
        n // qb.GEOMETRY[qtype][1], BR=c["BR"], NB=c["NB"], BT=c["BT"], DENSE=True, **_ops(X, options),
        num_warps=c["num_warps"], **_geo(qtype),
    )  # fmt: skip
    return Y


def one_matrix(
    raw: torch.Tensor, X: torch.Tensor, qtype: QType, rows: int, n: int, options: EngineOptions | None = None
) -> torch.Tensor:
    """raw uint8 [rows, row_bytes] times X float32 [T, n] -> float32 [T, rows], tile by tile (any T), on
    the operands ``kernel_select.prefill_precision`` picks."""
    return dense_matmul(raw, operand(X, ks.prefill_precision(X.device, options)), qtype, rows, n, options=options)


def moe_prefill(
    pool: torch.Tensor,
    slot_off: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    roles: dict[str, tuple[int, QType, int, int]],
    options: EngineOptions | None = None,
    n_experts: int | None = None,
) -> torch.Tensor:
    """:func:`moe_decode`'s contract for many tokens: pairs sorted by slot, each expert's weight
    tiles read once per BT of its tokens (three grouped launches — two where up's rows follow gate's in the
    slot with the same type — and a deterministic combine), on the
    operands ``kernel_select.prefill_precision`` picks. No host sync: the grid is bounded by the pairs
    and ``n_experts`` (the most distinct slots the pairs can name: the layer's experts, some of them perhaps
    at host-copy offsets outside the pool; default T·K, or the pool's slots when it is [n_slots, stride])."""
    T, K = slot_off.shape
    J = T * K
    if J == 0:
        return torch.zeros_like(x, dtype=torch.float32)
    precision = ks.prefill_precision(x.device, options)
    groups = min(J, n_experts) if n_experts else min(J, pool.shape[0] if pool.dim() == 2 else J)
    pool = pool.reshape(-1)
    flat = slot_off.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [J] pair indices sorted by slot; skipped pairs (−1) together
    seg = flat[order]  # [J] each sorted pair's slot
    tok = order // K
    (go, gq, F, D), (uo, uq, _, _), (do, dq, _, _) = (roles[r] for r in ("gate", "up", "down"))
    xo = operand(x, precision)  # rounded once for gate and up
    tiles: dict = {}
    if gq == uq and uo == go + F * block_format(gq).row_bytes(D):  # up's rows follow gate's: one launch of 2F rows
        gu = grouped_matmul(pool, seg, go, tok, xo, gq, 2 * F, D, groups, options=options, tiles=tiles)
        g, u = gu[:, :F], gu[:, F:]
    else:
        g = grouped_matmul(pool, seg, go, tok, xo, gq, F, D, groups, options=options, tiles=tiles)
        u = grouped_matmul(pool, seg, uo, tok, xo, uq, F, D, groups, options=options, tiles=tiles)
    h = operand(silu_mul(g, u), precision)  # [J, F], sorted order
    ident = torch.arange(J, dtype=torch.int64, device=x.device)
    d = grouped_matmul(pool, seg, do, ident, h, dq, D, F, groups, options=options, tiles=tiles)  # [J, D]
    w = weights.reshape(-1)[order, None].to(torch.float32)
    out = torch.empty((J, D), dtype=torch.float32, device=x.device)
    out[order] = torch.where(seg[:, None] != -1, d * w, 0.0)  # skipped pairs' rows of d were never written
    return out.view(T, K, D).sum(1)
