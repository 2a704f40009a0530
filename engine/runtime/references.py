"""The torch references of the device kernels, together: the specification each Triton kernel is tested
against (tests/triton hold them together), and the slow path the
runtime takes where no Triton kernel applies (``SHARPI_DEVICE_KERNELS=reference``, types or devices
without one).

- :func:`dequantize` / :func:`dequantize_at`: raw GGUF block bytes ``uint8 [R, row_bytes]`` already on
  the device -> float32 ``[R, n]``. Written from the block layouts in ``engine.quant.formats`` (the
  same ggml ``dequantize_row_*`` rules as the numpy reference in ``engine.quant.reference``, which a
  test holds it to). The Triton kernels compute from the same bytes without this expansion.
- q8 activations (``triton_q8``'s rounding rule): :func:`quantize_act_reference` (the specification of
  ``triton_q8.quantize_act``), :func:`dequantize_act`, :func:`q8_round_trip`.
- GEMV and fused MoE, dequantize-then-matmul: :func:`gemv_reference` (``triton_gemv.gemv``),
  :func:`gemv_q8_reference` / :func:`matmul_q8_reference` (``triton_q8_gemv``, and
  ``triton_q4k_gemv``), :func:`moe_decode_reference` (``triton_moe.moe_decode``),
  :func:`moe_decode_q8_reference` (``triton_q8_moe`` and ``triton_q4k_moe``).
- The tiled prompt kernels on bfloat16 operands (``triton_moe``, ``kernel_select.prefill_precision``
  "bf16"): :func:`round_bf16`, :func:`matmul_bf16_reference` (``one_matrix``),
  :func:`moe_prefill_bf16_reference` (``moe_prefill``). On float32 operands those kernels are held to
  the exact references (``dequantize``, :func:`moe_decode_reference`).
- The one-token step kernels (``step_kernels``): :func:`add_rms_norm_reference`,
  :func:`qk_rope_kv_reference`, :func:`route_reference`, :func:`delta_net_step_reference`,
  :func:`gated_norm_reference`.

Each ``*_reference`` has the signature of the kernel wrapper it specifies. This module imports no
Triton code (only torch, ``engine.quant`` and ``engine.models.layers``), so every kernel module may
import it.
"""

from __future__ import annotations

import torch

from engine.models.layers import (
    apply_rope_table,
    causal_conv1d,
    delta_gates,
    expand_heads,
    gated_delta_rule,
    gated_rms_norm,
    l2_norm,
    rms_norm_fused,
    route_softmax_topk,
    silu_mul,
)
from engine.quant import iquants
from engine.quant.formats import QType, block_format
from engine.quant.reference import IQ4NL_VALUES, MXFP4_VALUES

QBLK = 32  # activation block of the q8 rule (triton_q8.QBLK)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> float32 [...]."""
    return b.contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _blocks(raw: torch.Tensor, qtype: QType) -> torch.Tensor:
    f = block_format(qtype)
    return raw.reshape(raw.shape[0], -1, f.type_size)  # [R, nb, type_size]


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes [..., 12] -> 8 six-bit scales and mins, each [..., 8] (get_scale_min_k4)."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).float(), torch.cat([lo_m, hi_m], -1).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = qs.to(torch.int32)
    return q & 0xF, q >> 4


def _q8_0(b):  # dequantize_row_q8_0
    return _f16(b[..., 0:2])[..., None] * b[..., 2:34].view(torch.int8).float()


def _q4_0(b):  # dequantize_row_q4_0: low nibbles are elements 0..15, high 16..31
    lo, hi = _nibbles(b[..., 2:18])
    return _f16(b[..., 0:2])[..., None] * (torch.cat([lo, hi], -1) - 8).float()


def _q5_0(b):  # dequantize_row_q5_0: 32 high bits in a little-endian uint32
    qh = b[..., 2:6].to(torch.int64)
    qh = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
    bits = (qh[..., None] >> torch.arange(32, device=b.device)) & 1  # [.., 32]
    lo, hi = _nibbles(b[..., 6:22])
    q = torch.cat([lo, hi], -1) | (bits.to(torch.int32) << 4)
    return _f16(b[..., 0:2])[..., None] * (q - 16).float()


def _mxfp4(b):  # dequantize_row_mxfp4: e8m0 exponent, low nibbles are elements 0..15, high 16..31
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    e = b[..., 0].to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=b.device) << e, (e - 1) << 23)
    d = bits.view(torch.float32)  # 2^(e-128)
    lo, hi = _nibbles(b[..., 1:17])
    return d[..., None] * values[torch.cat([lo, hi], -1).long()]


def _q2_k(b):  # dequantize_row_q2_K: 16 (scale | min << 4) bytes, qs[64], d, dmin; element 128h + 32j + l
    lead = b.shape[:-1]
    s = b[..., 0:16].to(torch.int32)
    qs = b[..., 16:80].to(torch.int32).reshape(*lead, 2, 1, 32)
    q = ((qs >> (2 * torch.arange(4, device=b.device, dtype=torch.int32))[:, None]) & 3).float().reshape(*lead, 16, 16)
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    dl = d[..., None] * (s & 0xF).float()  # [.., 16]
    ml = dmin[..., None] * (s >> 4).float()
    return (dl[..., None] * q - ml[..., None]).flatten(-2)


def _q3_k(b):  # dequantize_row_q3_K: hmask[32], qs[64], 12 bytes of 6-bit scales, d; element 128h + 32j + l
    lead = b.shape[:-1]
    s = b[..., 96:108].to(torch.int32)
    low4 = torch.cat([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], -1)  # [.., 16]
    top = (s[..., None, 8:12] >> (2 * torch.arange(4, device=b.device, dtype=torch.int32))[:, None]) & 3
    sc = ((low4 | (top.reshape(*lead, 16) << 4)) - 32).float()  # scale i: low bits byte i % 8, top 2 bits
    qs = b[..., 32:96].to(torch.int32).reshape(*lead, 2, 1, 32)
    low = (qs >> (2 * torch.arange(4, device=b.device, dtype=torch.int32))[:, None]) & 3  # [.., 2, 4, 32]
    hm = b[..., 0:32].to(torch.int32).reshape(*lead, 1, 1, 32)
    high = (hm >> torch.arange(8, device=b.device, dtype=torch.int32).reshape(2, 4, 1)) & 1  # bit 4h + j
    q = (low - 4 * (1 - high)).float().reshape(*lead, 16, 16)
    return (_f16(b[..., 108:110])[..., None, None] * sc[..., None] * q).flatten(-2)


def _q4_k(b):  # dequantize_row_q4_K: 4 chunks of 64: low nibbles then high nibbles of 32 bytes
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_min_k4(b[..., 4:16])  # [.., 8]
    lo, hi = _nibbles(b[..., 16:144].reshape(*b.shape[:-1], 4, 32))
    q = torch.stack([lo, hi], -2).reshape(*b.shape[:-1], 8, 32).float()  # sub-block j: 32 values
    return (d[..., None, None] * sc[..., None] * q - dmin[..., None, None] * m[..., None]).flatten(-2)


def _q5_k(b):  # dequantize_row_q5_K: as Q4_K with bit j of qh[l] the high bit of sub-block j
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_min_k4(b[..., 4:16])
    qh = b[..., 16:48].to(torch.int32)  # [.., 32]
    lo, hi = _nibbles(b[..., 48:176].reshape(*b.shape[:-1], 4, 32))
    q = torch.stack([lo, hi], -2).reshape(*b.shape[:-1], 8, 32)
    high = (qh[..., None, :] >> torch.arange(8, device=b.device)[:, None]) & 1  # [.., 8, 32]
    q = (q | (high << 4)).float()
    return (d[..., None, None] * sc[..., None] * q - dmin[..., None, None] * m[..., None]).flatten(-2)


def _q6_k(b):  # dequantize_row_q6_K: two halves of 128, four 32-wide groups each
    ql = b[..., 0:128].to(torch.int32).reshape(*b.shape[:-1], 2, 64)
    qh = b[..., 128:192].to(torch.int32).reshape(*b.shape[:-1], 2, 32)
    sc = b[..., 192:208].view(torch.int8).float().reshape(*b.shape[:-1], 2, 8)
    d = _f16(b[..., 208:210])
    q1 = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
    q2 = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
    q3 = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = (torch.stack([q1, q2, q3, q4], -2) - 32).float()  # [.., 2, 4, 32]
    # group g (of 4) of half h uses scales 2g and 2g+1 for its two 16-value runs
    s = sc.reshape(*sc.shape[:-1], 4, 2)[..., None].expand(*sc.shape[:-1], 4, 2, 16).reshape(*sc.shape[:-1], 4, 32)
    return (d[..., None, None, None] * s * q).flatten(-3)


def _iq4_levels(qs: torch.Tensor) -> torch.Tensor:
    """[.., 16k] nibble bytes -> kvalues_iq4nl levels [.., k, 32] (per 16 bytes: low nibbles then high)."""
    q = qs.to(torch.int32).reshape(*qs.shape[:-1], -1, 16)
    values = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=qs.device)
    return values[torch.cat([q & 0xF, q >> 4], -1).long()]


def _iq4_nl(b):  # dequantize_row_iq4_nl: d | qs[16]
    return _f16(b[..., 0:2])[..., None] * _iq4_levels(b[..., 2:18])[..., 0, :]


def _iq4_xs(b):  # dequantize_row_iq4_xs: d | scales_h u16 | scales_l[4] | qs[128]; dl = d·(ls − 32)
    sl = b[..., 4:8].to(torch.int32)
    lo = torch.stack([sl & 0xF, sl >> 4], -1).flatten(-2)  # [.., 8]
    sh = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)
    hi = (sh[..., None] >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    dl = _f16(b[..., 0:2])[..., None] * ((lo | (hi << 4)) - 32).float()  # [.., 8]
    return (dl[..., None] * _iq4_levels(b[..., 8:136])).flatten(-2)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """[.., 4k] bytes -> [.., k] int64 little-endian words."""
    w = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def _nib(b: torch.Tensor) -> torch.Tensor:
    """[.., k] bytes -> [.., 2k] int64: low nibble then high of each byte."""
    q = b.to(torch.int64)
    return torch.stack([q & 0xF, q >> 4], -1).flatten(-2)


def _iq_grid(b, qtype):  # dequantize_row_iq2_xxs .. iq3_s (layouts: engine.quant.iquants)
    lead, dev = b.shape[:-1], b.device
    ar = torch.arange(8, device=dev, dtype=torch.int64)
    ks = torch.tensor(iquants.KSIGNS, dtype=torch.int64, device=dev)
    if qtype == QType.IQ2_XXS:  # per 32: u32 of 4 grid indices, u32 of 4 seven-bit sign indices | s << 28
        w = _u32(b[..., 2:66]).reshape(*lead, 8, 2)
        idx, sb, s = (w[..., 0:1] >> (8 * ar[:4])) & 255, ks[(w[..., 1:2] >> (7 * ar[:4])) & 127], w[..., 1] >> 28
    elif qtype == QType.IQ2_XS:  # u16 = 9-bit index | 7-bit sign index << 9; 4-bit scales per 16
        q = b[..., 2:66].to(torch.int64).reshape(*lead, 32, 2)
        q = q[..., 0] | (q[..., 1] << 8)
        idx, sb, s = q & 511, ks[q >> 9], _nib(b[..., 66:74])
    elif qtype == QType.IQ2_S:  # low index bytes, a sign byte per 8, 2 high index bits each in qh
        hi = ((b[..., 66:74].to(torch.int64)[..., None] >> (2 * ar[:4])) & 3).flatten(-2)
        idx, sb, s = b[..., 2:34].to(torch.int64) | (hi << 8), b[..., 34:66].to(torch.int64), _nib(b[..., 74:82])
    elif qtype == QType.IQ3_XXS:  # an index per 4, then per 32 a u32 of 4 sign indices | s << 28
        w = _u32(b[..., 66:98])
        idx, sb, s = b[..., 2:66].to(torch.int64), ks[(w[..., None] >> (7 * ar[:4])) & 127], w >> 28
    else:  # IQ3_S: low index bytes, bit j of qh[g] the ninth bit of index j, a sign byte per 8, nibble scales
        hi = ((b[..., 66:74].to(torch.int64)[..., None] >> ar) & 1).flatten(-2)
        idx, sb, s = b[..., 2:66].to(torch.int64) | (hi << 8), b[..., 74:106].to(torch.int64), _nib(b[..., 106:110])
    d = _f16(b[..., 0:2])[..., None]
    s = s.reshape(*lead, -1).float()
    if qtype == QType.IQ3_S:
        db = d * (1 + 2 * s)
    else:
        db = d * (0.5 + s) * (0.5 if qtype == QType.IQ3_XXS else 0.25)
    grid = torch.tensor(iquants.GRIDS[qtype], dtype=torch.float32, device=dev)
    g = grid[idx.reshape(*lead, -1)].reshape(*lead, db.shape[-1], -1)
    neg = ((sb.reshape(*lead, 32, 1) >> ar) & 1).reshape(*lead, db.shape[-1], -1)
    return (db[..., None] * g * (1 - 2 * neg).float()).flatten(-2)


_BLOCK_FNS = {
    **{t: (lambda b, t=t: _iq_grid(b, t)) for t in iquants.IQ_TYPES},
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q5_0: _q5_0,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.MXFP4: _mxfp4,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
}


def dequantize_at(pool: torch.Tensor, off: int, qtype: QType, rows: int, n: int) -> torch.Tensor:
    """The matrix [rows, n] whose raw bytes start at byte ``off`` of ``pool`` (uint8, any shape,
    contiguous; a slot pool or a trunk matrix) -> float32 [rows, n] on its device."""
    rb = block_format(qtype).row_bytes(n)
    return dequantize(pool.reshape(-1)[off : off + rows * rb].view(rows, rb), qtype, n)


def dequantize(raw: torch.Tensor, qtype: QType, n: int) -> torch.Tensor:
    """raw uint8 [R, row_bytes] (any device) -> float32 [R, n] on the same device."""
    qtype = QType(qtype)
    R = raw.shape[0]
    if qtype == QType.F32:
        return raw.contiguous().view(torch.float32).reshape(R, n)
    if qtype == QType.F16:
        return raw.contiguous().view(torch.float16).reshape(R, n).float()
    if qtype == QType.BF16:
        return raw.contiguous().view(torch.bfloat16).reshape(R, n).float()
    return _BLOCK_FNS[qtype](_blocks(raw, qtype)).reshape(R, n)


# -- q8 activations (triton_q8) -------------------------------------------------------------------
def quantize_act_reference(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification of ``triton_q8.quantize_act``: (q int8 [R, n], d float32 [R, n/32], s float32 [R, n/16])."""
    R, n = X.shape
    x = X.to(torch.float32).reshape(R, n // QBLK, QBLK)
    amax = x.abs().amax(-1)
    d = amax / torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division (CUDA torch multiplies by 1/scalar)
    v = x / d[..., None]
    q = torch.trunc(v + torch.where(v >= 0, 0.5, -0.5))
    q = torch.where(d[..., None] > 0, q, 0.0).to(torch.int8)
    s = q.reshape(R, n // 16, 16).sum(-1, dtype=torch.int32).to(torch.float32) * d.repeat_interleave(2, -1)
    return q.reshape(R, n), d, s


def dequantize_act(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 [R, n], d [R, n/32] -> the activations the q8 kernels multiply by, float32 [R, n]."""
    R, n = q.shape
    return (q.reshape(R, -1, QBLK).to(torch.float32) * d[..., None]).reshape(R, n)


def q8_round_trip(X: torch.Tensor) -> torch.Tensor:
    """X float32 [R, n] -> dequantize_act(quantize_act_reference(X)) (what the q8 references multiply by)."""
    q, d, _ = quantize_act_reference(X)
    return dequantize_act(q, d)


# -- GEMV (triton_gemv, triton_q8_gemv, triton_q4k_gemv) ---------------------------------------------
def gemv_reference(
    pool: torch.Tensor, offsets: torch.Tensor, X: torch.Tensor, qtype: QType, rows: int, n: int
) -> torch.Tensor:
    """``triton_gemv.gemv``'s contract by torch dequantize-then-matmul: pool uint8 [...]; offsets int64
    [P] byte offsets; X float32 [P, n] -> float32 [P, rows]."""
    return torch.stack([dequantize_at(pool, o, qtype, rows, n) @ X[p] for p, o in enumerate(offsets.tolist())])


def gemv_q8_reference(pool, offsets, X, qtype, rows, n) -> torch.Tensor:
    """``triton_q8_gemv.gemv_q8`` by torch: dequantized weights times the dequantized q8 activations."""
    return gemv_reference(pool, offsets, q8_round_trip(X), qtype, rows, n)


def matmul_q8_reference(raw, X, qtype, rows, n) -> torch.Tensor:
    """``triton_q8_gemv.matmul_q8`` (and ``triton_q4k_gemv.gemv``) by torch: raw uint8 [rows, row_bytes],
    X float32 [T, n] -> [T, rows]."""
    return q8_round_trip(X) @ dequantize(raw.reshape(rows, -1), qtype, n).T


# -- fused MoE decode (triton_moe, triton_q8_moe, triton_q4k_moe) ------------------------------------
def moe_decode_reference(pool, slot_off, x, weights, roles) -> torch.Tensor:
    """``triton_moe.moe_decode`` by torch dequantize-then-matmul, pair by pair: pool uint8 slots; slot_off
    int64 [T, K] (−1: skip the pair); x float32 [T, D]; weights float32 [T, K]; roles {"gate"|"up"|"down":
    (byte offset in the slot, qtype, rows, n)} -> float32 [T, D]."""
    y = torch.zeros_like(x, dtype=torch.float32)
    for t, k in zip(*torch.nonzero(slot_off >= 0, as_tuple=True)):
        s = int(slot_off[t, k])
        g, u, d = (dequantize_at(pool, s + roles[r][0], *roles[r][1:]) for r in ("gate", "up", "down"))
        y[t] += weights[t, k] * (d @ silu_mul(g @ x[t], u @ x[t]))
    return y


def moe_decode_q8_reference(pool, slot_off, x, weights, roles, round_h: bool = True) -> torch.Tensor:
    """``triton_q8_moe.moe_decode_q8`` by torch: dequantized weights, x and h through the q8 rounding rule
    (h in float with ``round_h=False``: triton_moe's q8 mode for a Q4_K gate/up over another down type)."""
    y = torch.zeros_like(x, dtype=torch.float32)
    xq = q8_round_trip(x)
    for t, k in zip(*torch.nonzero(slot_off >= 0, as_tuple=True)):
        s = int(slot_off[t, k])
        g, u, d = (dequantize_at(pool, s + roles[r][0], *roles[r][1:]) for r in ("gate", "up", "down"))
        h = silu_mul(g @ xq[t], u @ xq[t])
        h = q8_round_trip(h[None])[0] if round_h else h
        y[t] += weights[t, k] * (d @ h)
    return y


# -- the tiled prompt kernels on bfloat16 operands (triton_moe, prefill precision "bf16") ---------------
def round_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 rounded to the nearest bfloat16 (ties to even), back as float32."""
    return t.to(torch.bfloat16).to(torch.float32)


def matmul_bf16_reference(raw: torch.Tensor, X: torch.Tensor, qtype: QType, rows: int, n: int) -> torch.Tensor:
    """``triton_moe.one_matrix`` on bfloat16 operands by torch: raw uint8 [rows, row_bytes], X float32
    [T, n] -> float32 [T, rows]; X and the dequantized W rounded to bfloat16, the products (exact) summed
    in float64. The kernel differs only by its float32 accumulation."""
    W = round_bf16(dequantize(raw.reshape(rows, -1), qtype, n))
    return (round_bf16(X).double() @ W.double().T).float()


def moe_prefill_bf16_reference(pool, slot_off, x, weights, roles) -> torch.Tensor:
    """``triton_moe.moe_prefill`` on bfloat16 operands by torch: :func:`moe_decode_reference` with x, the
    dequantized matrices and h rounded to bfloat16 before each product, sums in float64."""
    y = torch.zeros_like(x, dtype=torch.float64)
    xb = round_bf16(x).double()
    for t, k in zip(*torch.nonzero(slot_off >= 0, as_tuple=True)):
        s = int(slot_off[t, k])
        g, u, d = (
            round_bf16(dequantize_at(pool, s + roles[r][0], *roles[r][1:])).double() for r in ("gate", "up", "down")
        )
        h = round_bf16(silu_mul(g @ xb[t], u @ xb[t]).float()).double()
        y[t] += float(weights[t, k]) * (d @ h)
    return y.float()


# -- the one-token step kernels (step_kernels) -------------------------------------------------------
def add_rms_norm_reference(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float, q8: bool = False):
    """``step_kernels.add_rms_norm`` in torch (the q8 copy by :func:`quantize_act_reference`, its codes
    packed four to a little-endian int32 word)."""
    if y is not None:
        x = x + y
    h = rms_norm_fused(x, w, eps)
    if not q8:
        return x, h
    q, d, s = quantize_act_reference(h)
    return x, h, (q.contiguous().view(torch.int32), d, s)


def qk_rope_kv_reference(q, k, v, q_norm, k_norm, eps, cos, sin, perm, pos, kc, vc, n_head, n_head_kv, head_dim):
    """``step_kernels.qk_rope_kv`` in torch (the static step's own ops)."""
    qk = torch.cat([q, k], dim=1).reshape(1, n_head + n_head_kv, head_dim)
    if q_norm is not None:
        w = torch.cat([q_norm.expand(n_head, head_dim), k_norm.expand(n_head_kv, head_dim)])
        qk = rms_norm_fused(qk, None, eps) * w
    qk = apply_rope_table(qk, cos, sin, perm)
    kc.index_copy_(0, pos, qk[:, n_head:].reshape(1, -1).to(kc.dtype))
    vc.index_copy_(0, pos, v.to(vc.dtype))
    return qk[:, :n_head]


def route_reference(
    logits: torch.Tensor, k: int, renormalise: bool, table: torch.Tensor, ids_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``step_kernels.route`` in torch (``route_softmax_topk`` and a table lookup)."""
    ids, w = route_softmax_topk(logits, k, renormalise)
    ids_out.copy_(ids)
    return w, table[ids]


def delta_net_step_reference(
    qkv, b, a, conv_state, ssm, conv_w, dt_bias, A, n_k_heads, head_k, n_v_heads, head_v, grouping, eps
):
    """``step_kernels.delta_net_step`` in torch: the reference layer's own one-token ops (``TorchOps.delta_net``
    at T = 1), the states advanced in place."""
    c, conv = causal_conv1d(qkv, conv_w, conv_state)
    c = torch.nn.functional.silu(c)
    kd = n_k_heads * head_k
    q = l2_norm(c[:, :kd].reshape(1, n_k_heads, head_k), eps)
    k = l2_norm(c[:, kd : 2 * kd].reshape(1, n_k_heads, head_k), eps)
    v = c[:, 2 * kd :].reshape(1, n_v_heads, head_v)
    q, k = expand_heads(q, n_v_heads, grouping), expand_heads(k, n_v_heads, grouping)
    beta, g = delta_gates(b, a, dt_bias, A)
    o, S = gated_delta_rule(q, k, v, g, beta, ssm)
    conv_state.copy_(conv)
    ssm.copy_(S)
    return o.reshape(1, -1)


def gated_norm_reference(o, z, w, n_v_heads: int, head_v: int, eps: float):
    """``step_kernels.gated_norm`` in torch (``layers.gated_rms_norm``)."""
    shape = (o.shape[0], n_v_heads, head_v)
    return gated_rms_norm(o.reshape(shape), z.reshape(shape), w, eps).reshape(o.shape[0], -1)
