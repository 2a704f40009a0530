"""Dequantization in torch, on any device: the reference device kernel for quantized weights.

``dequantize(raw, qtype, n) -> float32 [R, n]`` from raw GGUF block bytes ``uint8 [R, row_bytes]``
already on the device. Written from the block layouts in ``engine.quant.formats`` (the same ggml
``dequantize_row_*`` rules as the numpy reference in ``engine.quant.reference``, which a test holds
it to). The Triton kernels of the CUDA issue compute from the same bytes without this expansion.
"""

from __future__ import annotations

import torch

from engine.quant.formats import QType, block_format


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


_BLOCK_FNS = {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q5_0: _q5_0,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
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
