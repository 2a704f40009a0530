"""Small fused kernels of the one-token device step (``runtime.step_ops.DeviceStepOps``), where torch
would launch several tiny kernels in a row — inside a CUDA graph each launch still costs a few µs
of GPU time, and a 48-layer step has thousands of them.

- :func:`qk_rope_kv`: q and k normed per head and rotated, k and v written into the KV cache at
  the token's device position: one launch instead of about nine.
- :func:`add_rms_norm`: the residual add and the following RMS norm: one launch instead of two;
  with ``q8=True`` it also writes the normed row in ``triton_q8``'s activation format (x̂: the
  rounding the lean Q4_K routed-expert kernels multiply by), so the MoE after it needs no
  quantize launch of its own.
- :func:`route`: router logits → softmax → top-k → renormalised weights, the ids written into the
  graph's route record, and each chosen expert's slot byte offset from the resident pool's table:
  one launch instead of six (softmax, topk's two, sum, divide, index).
- :func:`delta_net_step`: one token of the Gated DeltaNet core — the causal conv with its rolling
  state, silu, the L2-normed q and k, the gates and the delta rule on the state — in two launches
  instead of about forty; :func:`gated_norm`: rms_norm(o)·w ⊙ silu(z) per value head in one.

Whether they serve a device is ``kernel_select.step_kernels``'s choice.

Each kernel has a torch reference with the same signature in ``engine.runtime.references``
(``*_reference``); the tests (``tests/triton/test_step_kernels.py``) hold them together in Triton's CPU
interpreter and compiled on CUDA.
"""

from __future__ import annotations

import torch

from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _route_kernel(LOGITS, TABLE, W, IDS, OFF, E, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                      RENORM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """One token: softmax over E logits, the K largest by repeated arg-max (lowest id on ties),
        optionally renormalised; W[K] weights, IDS[K] ids, OFF[K] = TABLE[ids]."""
        qb.pdl_enter(PDL)
        e = tl.arange(0, BE)
        em = e < E
        x = tl.load(LOGITS + e, mask=em, other=-float("inf"))
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(em, p, 0.0)
        p = p / tl.sum(p, 0)
        kk = tl.arange(0, KP)
        wv = tl.zeros([KP], dtype=tl.float32)
        iv = tl.zeros([KP], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(p, 0)
            idx = tl.min(tl.where(p == best, e, BE), 0)
            wv = tl.where(kk == j, best, wv)
            iv = tl.where(kk == j, idx.to(tl.int64), iv)
            p = tl.where(e == idx, -1.0, p)
        if RENORM:
            wv = wv / tl.sum(wv, 0)
        km = kk < K
        tl.store(W + kk, wv, mask=km)
        tl.store(IDS + kk, iv, mask=km)
        tl.store(OFF + kk, tl.load(TABLE + iv, mask=km, other=0), mask=km)

    @triton.jit
    def _bf16_bits(x):
        """float32 -> the int16 bits of bfloat16, rounded to nearest even (finite x)."""
        b = x.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)

    @triton.jit
    def _qk_rope_kv_kernel(Q, K, V, QN, KN, C, S, PERM, POS, KC, VC, QO, eps, H, HD: tl.constexpr,
                           BD: tl.constexpr, NORM: tl.constexpr, KV_BF16: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """Program h < H: query head h; h ≥ H: key head h − H (and its value row). Optional per-head
        RMS norm (weights QN / KN), rotation by the table rows C, S [HD] (x·C + x[PERM]·S), q into
        QO, k and v into row POS of the caches KC, VC [n_ctx, Hkv·HD]."""
        qb.pdl_enter(PDL)
        h = tl.program_id(0)
        d = tl.arange(0, BD)
        dm = d < HD
        perm = tl.load(PERM + d, mask=dm, other=0)
        is_q = h < H
        if is_q:
            src = Q + h * HD
            wn = QN
        else:
            src = K + (h - H) * HD
            wn = KN
        x = tl.load(src + d, mask=dm, other=0.0)
        xp = tl.load(src + perm, mask=dm, other=0.0)
        if NORM:
            r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / HD + eps)
            x = x * r * tl.load(wn + d, mask=dm, other=0.0)
            xp = xp * r * tl.load(wn + perm, mask=dm, other=0.0)
        y = x * tl.load(C + d, mask=dm, other=0.0) + xp * tl.load(S + d, mask=dm, other=0.0)
        if is_q:
            tl.store(QO + h * HD + d, y, mask=dm)
        else:
            kvw = (tl.num_programs(0) - H) * HD
            row = tl.load(POS).to(tl.int64) * kvw + (h - H) * HD
            vv = tl.load(V + (h - H) * HD + d, mask=dm, other=0.0)
            if KV_BF16:  # KC, VC viewed as int16: round to nearest even by hand (as torch's .to)
                tl.store(KC + row + d, _bf16_bits(y), mask=dm)
                tl.store(VC + row + d, _bf16_bits(vv), mask=dm)
            else:
                tl.store(KC + row + d, y, mask=dm)
                tl.store(VC + row + d, vv, mask=dm)

    @triton.jit
    def _add_rms_norm_kernel(X, Y, W, XO, HO, XQ, XD, XS, eps, D: tl.constexpr, BD: tl.constexpr,
                             HAS_Y: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """XO = X + Y; HO = XO · rsqrt(mean(XO²) + eps) · W, one row of D; Q8: HO also into XQ/XD/XS by
        triton_q8's rule (``quant_tile``: bit for bit what ``quantize_act(HO)`` writes; D % 32 == 0)."""
        qb.pdl_enter(PDL)
        d = tl.arange(0, BD)
        dm = d < D
        x = tl.load(X + d, mask=dm, other=0.0)
        if HAS_Y:
            x = x + tl.load(Y + d, mask=dm, other=0.0)
            tl.store(XO + d, x, mask=dm)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / D + eps)
        h = x * r * tl.load(W + d, mask=dm, other=0.0)
        tl.store(HO + d, h, mask=dm)
        if Q8:
            NBLK: tl.constexpr = BD // 32
            words, dq, sq = t8.quant_tile(tl.reshape(h, [NBLK, 32]), NBLK)  # lanes ≥ D are 0: their blocks unused
            blk = tl.arange(0, NBLK)
            t8.store_q8(XQ, XD, XS, tl.program_id(0), blk, blk < D // 32, words, dq, sq, D // 32)

    @triton.jit
    def _gdn_conv_kernel(X, STATE, W, OUT, C, K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
        """Channels c of this block: the window [STATE[0..K-2, c], X[c]] times W[c, :] summed in window
        order, silu'd into OUT[c]; STATE[r, c] <- window[r + 1] (each channel read, then written, by
        this program alone)."""
        qb.pdl_enter(PDL)
        c = tl.program_id(0) * BC + tl.arange(0, BC)
        cm = c < C
        j = tl.arange(0, KP)
        x = tl.load(X + c, mask=cm, other=0.0)
        w = tl.load(W + c[:, None] * K + j[None, :], mask=cm[:, None] & (j[None, :] < K), other=0.0)  # [BC, KP]
        y = tl.zeros([BC], dtype=tl.float32)
        for r in tl.static_range(K):  # window row r: the state's row r, the token's input last
            if r < K - 1:
                xr = tl.load(STATE + r * C + c, mask=cm, other=0.0)
            else:
                xr = x
            if r > 0:
                tl.store(STATE + (r - 1) * C + c, xr, mask=cm)
            wr = tl.sum(tl.where(j[None, :] == r, w, 0.0), 1)
            y = y + xr * wr
        tl.store(OUT + c, y / (1.0 + tl.exp(-y)), mask=cm)

    @triton.jit
    def _gdn_rule_kernel(CV, B, A, DT, AL, S, O, HK, eps, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """Program (j, t): value head j, its state rows t·BV … of S [Hv, DV, DK]. q, k (key head j mod HK
        when TILE, else j // (Hv/HK)) L2-normed from the conv output CV = [q | k | v]; β = sigmoid(B[j]),
        g = softplus(A[j] + DT[j])·AL[j]; rows: S ← S·e^g; S ← S + β(v − S k) kᵀ; O = S q / sqrt(DK)."""
        qb.pdl_enter(PDL)
        j = tl.program_id(0)
        hv = tl.num_programs(0)
        if TILE:
            kh = j % HK
        else:
            kh = j // (hv // HK)
        d = tl.arange(0, BK)
        dm = d < DK
        e = tl.program_id(1) * BV + tl.arange(0, BV)
        em = e < DV
        q = tl.load(CV + kh * DK + d, mask=dm, other=0.0)
        k = tl.load(CV + HK * DK + kh * DK + d, mask=dm, other=0.0)
        v = tl.load(CV + 2 * HK * DK + j * DV + e, mask=em, other=0.0)
        q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), eps) * (1.0 / tl.sqrt(DK * 1.0))
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), eps)
        beta = 1.0 / (1.0 + tl.exp(-tl.load(B + j)))
        x = tl.load(A + j) + tl.load(DT + j)
        g = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))) * tl.load(AL + j)  # torch's softplus
        ptr = S + j * DV * DK + e[:, None] * DK + d[None, :]
        sm = em[:, None] & dm[None, :]
        st = tl.load(ptr, mask=sm, other=0.0) * tl.exp(g)  # [BV, BK]
        dlt = (v - tl.sum(st * k[None, :], 1)) * beta
        st = st + dlt[:, None] * k[None, :]
        tl.store(ptr, st, mask=sm)
        tl.store(O + j * DV + e, tl.sum(st * q[None, :], 1), mask=em)

    @triton.jit
    def _gated_norm_kernel(O, Z, W, Y, eps, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):
        """Value head j: Y = O · rsqrt(mean(O²) + eps) · W ⊙ silu(Z) over its DV values."""
        qb.pdl_enter(PDL)
        j = tl.program_id(0)
        e = tl.arange(0, BV)
        em = e < DV
        o = tl.load(O + j * DV + e, mask=em, other=0.0)
        z = tl.load(Z + j * DV + e, mask=em, other=0.0)
        r = 1.0 / tl.sqrt_rn(tl.sum(o * o, 0) / DV + eps)
        y = o * r * tl.load(W + e, mask=em, other=0.0) * (z / (1.0 + tl.exp(-z)))
        tl.store(Y + j * DV + e, y, mask=em)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float, q8: bool = False):
    """The residual add and the next norm in one launch: x, y float32 [1, D] (y None: no add) ->
    (x + y [1, D], h = rms_norm(x + y) · w [1, D]); with ``q8`` (D % 32 == 0) a third item, h in
    triton_q8's format (XQ int32 [1, D/4], XD [1, D/32], XS [1, D/16]) — ``quantize_act(h)``'s."""
    D = x.shape[-1]
    if q8 and D % 32:
        raise ValueError(f"add_rms_norm: q8 needs D % 32 == 0, got {D}")
    pdl = qb.pdl(x.device)
    h = torch.empty_like(x)
    xo = torch.empty_like(x) if y is not None else x
    if q8:
        n32 = D // 32
        hq = (torch.empty((1, D // 4), dtype=torch.int32, device=x.device),
              torch.empty((1, n32), dtype=torch.float32, device=x.device),
              torch.empty((1, 2 * n32), dtype=torch.float32, device=x.device))  # fmt: skip
    _add_rms_norm_kernel[(1,)](
        x, y if y is not None else x, w, xo, h, *(hq if q8 else (h, h, h)), eps, D=D, BD=triton.next_power_of_2(D),
        HAS_Y=y is not None, Q8=q8, num_warps=8 if D >= 2048 else 4, PDL=pdl, **qb.launch_kw(pdl),
    )  # fmt: skip
    return (xo, h, hq) if q8 else (xo, h)


def qk_rope_kv(q, k, v, q_norm, k_norm, eps, cos, sin, perm, pos, kc, vc, n_head, n_head_kv, head_dim):
    """q [1, H·hd], k, v [1, Hkv·hd] float32 -> q normed (per head, when ``q_norm``/``k_norm`` [hd]
    are given) and rotated [1, H, hd]; k normed and rotated and v written at row ``pos`` (int64 [1])
    of the caches kc, vc (float32 or bfloat16 [n_ctx, Hkv·hd]). cos, sin [1, hd], perm int64 [hd]:
    ``layers.rope_tables`` rows. One launch (concatenate, norm, rotate and two cache writes in torch
    are about nine)."""
    qo = torch.empty((1, n_head, head_dim), dtype=torch.float32, device=q.device)
    norm, bf16 = q_norm is not None, kc.dtype == torch.bfloat16
    pdl = qb.pdl(q.device)
    _qk_rope_kv_kernel[(n_head + n_head_kv,)](
        q.contiguous(), k.contiguous(), v.contiguous(), q_norm if norm else q, k_norm if norm else q, cos, sin,
        perm, pos, kc.view(torch.int16) if bf16 else kc, vc.view(torch.int16) if bf16 else vc, qo, eps, n_head,
        HD=head_dim, BD=triton.next_power_of_2(head_dim), NORM=norm, KV_BF16=bf16, num_warps=1,
        PDL=pdl, **qb.launch_kw(pdl),
    )  # fmt: skip
    return qo


def route(
    logits: torch.Tensor, k: int, renormalise: bool, table: torch.Tensor, ids_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits float32 [1, E] -> (weights float32 [1, k], slot offsets int64 [1, k] = table[ids]);
    the ids int64 [1, k] are written into ``ids_out`` (route_softmax_topk's choice, highest first).
    table int64 [E]: each expert's slot byte offset."""
    E = logits.shape[-1]
    w = torch.empty((1, k), dtype=torch.float32, device=logits.device)
    off = torch.empty((1, k), dtype=torch.int64, device=logits.device)
    pdl = qb.pdl(logits.device)
    _route_kernel[(1,)](
        logits.contiguous(), table, w, ids_out, off, E, K=k, KP=triton.next_power_of_2(k),
        BE=triton.next_power_of_2(E), RENORM=renormalise, num_warps=1, PDL=pdl,
        **qb.launch_kw(pdl),
    )  # fmt: skip
    return w, off


def delta_net_step(qkv, b, a, conv_state, ssm, conv_w, dt_bias, A, n_k_heads, head_k, n_v_heads, head_v, grouping, eps):
    """One token of the Gated DeltaNet core (``TorchOps.delta_net`` at T = 1) in two launches: qkv float32
    [1, C] (C = 2·Hk·dk + Hv·dv, rows q | k | v), b, a [1, Hv] -> o [1, Hv·dv]; the conv window
    conv_state [K−1, C] and the delta-rule state ssm [Hv, dv, dk] advanced in place (a decode graph holds
    their addresses). conv_w [C, K], dt_bias, A [Hv]; grouping ``"tile"`` or ``"interleave"``
    (``layers.expand_heads``)."""
    C, K = conv_w.shape
    Hv, dv, dk = ssm.shape
    if (Hv, dv, dk) != (n_v_heads, head_v, head_k) or 2 * n_k_heads * head_k + n_v_heads * head_v != C:
        raise ValueError(f"delta_net_step: state {tuple(ssm.shape)} / conv {tuple(conv_w.shape)} do not fit the heads")
    pdl = qb.pdl(qkv.device)
    cv = torch.empty((C,), dtype=torch.float32, device=qkv.device)
    BC = 256
    _gdn_conv_kernel[(triton.cdiv(C, BC),)](
        qkv.contiguous(), conv_state, conv_w.contiguous(), cv, C, K=K, KP=triton.next_power_of_2(K), BC=BC,
        num_warps=4, PDL=pdl, **qb.launch_kw(pdl),
    )  # fmt: skip
    o = torch.empty((1, Hv * dv), dtype=torch.float32, device=qkv.device)
    BV = min(32, triton.next_power_of_2(dv))
    _gdn_rule_kernel[(Hv, triton.cdiv(dv, BV))](
        cv, b.contiguous(), a.contiguous(), dt_bias, A, ssm, o, n_k_heads, eps, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=BV, TILE=grouping == "tile", num_warps=4, PDL=pdl, **qb.launch_kw(pdl),
    )  # fmt: skip
    return o


def gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, n_v_heads: int, head_v: int, eps: float):
    """``layers.gated_rms_norm`` for one token in one launch: o, z float32 [1, Hv·dv], w [dv] -> [1, Hv·dv]."""
    y = torch.empty((1, n_v_heads * head_v), dtype=torch.float32, device=o.device)
    pdl = qb.pdl(o.device)
    _gated_norm_kernel[(n_v_heads,)](
        o.contiguous(), z.contiguous(), w, y, eps, DV=head_v, BV=triton.next_power_of_2(head_v), num_warps=4,
        PDL=pdl, **qb.launch_kw(pdl),
    )  # fmt: skip
    return y
