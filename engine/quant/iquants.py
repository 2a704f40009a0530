"""The IQ2/IQ3 grid types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (what "UD" dynamic quants mix in).

Each 256-element block holds an fp16 ``d``, odd integer scales ``2s + 1`` (s a 4-bit field) of groups of 32
(IQ2_XS, IQ2_S: 16) elements, and for every 8 (IQ3: 4) elements an index into a table of points whose
coordinates are small positive integers (the grid), plus one sign bit per element. An element is

    d · mult · (2s + 1) · grid[index][j] · (±1)

with ``mult`` 1/8 for the IQ2 types (ggml: ``d·(0.5 + s)·0.25``), 1/4 for IQ3_XXS (``d·(0.5 + s)·0.5``) and 1
for IQ3_S (``d·(1 + 2s)``). Signs come 8 to a byte; IQ2_XXS, IQ2_XS and IQ3_XXS store only 7 of them and
the eighth makes the count of negatives even (ggml's ``ksigns_iq2xs``: the byte is i | parity(i) << 7).

Block layouts (ggml-common.h ``block_iq*``), offsets in bytes:

- IQ2_XXS (66): d | qs u16[32]; group g of 32 reads two u32 at 2 + 8g: the first holds 4 grid indices
  (one byte per 8 elements), the second 4 seven-bit sign indices (bits 7l..7l+6) and s in bits 28..31.
- IQ2_XS (74): d | qs u16[32] (9-bit grid index | 7-bit sign index << 9, one per 8 elements) | scales[8]
  (group g: elements 32g..32g+15 take the low nibble, 32g+16..32g+31 the high one).
- IQ2_S (82): d | qs[32] (low 8 bits of the 10-bit index, one per 8) | signs[32] (one byte per 8) |
  qh[8] (group g: bits 2l, 2l+1 are index bits 8, 9 of its l-th 8) | scales[8] (as IQ2_XS).
- IQ3_XXS (98): d | qs[64] (one grid index per 4 elements) | 8 u32 (group g: 4 seven-bit sign indices,
  s in bits 28..31).
- IQ3_S (110): d | qs[64] (low 8 bits of the 9-bit index per 4) | qh[8] (group g: bit j is the ninth bit
  of its j-th index) | signs[32] (one byte per 8) | scales[4] (group g: nibble g % 2 of byte g // 2).

The grids and ``ksigns`` are the gguf package's tables (``gguf.quants``), read once here as data. The
dequantizers compute in float32 in ggml's order (``db = d·(0.5 + s)·0.25``, then ``db·grid·sign``), so they
equal ``gguf.quants`` and ``dequantize_row_iq*`` bit for bit. The quantizers make valid, reasonable test
data, not ggml's importance-weighted search (which needs an importance matrix): per 8 elements the signs of
x (the parity types flip the smallest one when the count of negatives is odd), per group the best of a few
scales with the nearest grid point to each 8 (4), then 4-bit group scales of an fp16 d.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import quants as _gq

from engine.quant.formats import QType, pack_blocks, to_f16

_F32 = np.float32
QK = 256


def _grid(cls) -> np.ndarray:
    """gguf's grid of ``cls`` as uint8 [points, coordinates]."""
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.uint8))


GRIDS: dict[QType, np.ndarray] = {
    QType.IQ2_XXS: _grid(_gq.IQ2_XXS),  # [256, 8], values 8, 25, 43
    QType.IQ2_XS: _grid(_gq.IQ2_XS),  # [512, 8]
    QType.IQ2_S: _grid(_gq.IQ2_S),  # [1024, 8]
    QType.IQ3_XXS: _grid(_gq.IQ3_XXS),  # [256, 4], values 4, 12, ..., 52, 62
    QType.IQ3_S: _grid(_gq.IQ3_S),  # [512, 4], values 1, 3, ..., 15
}
KSIGNS = np.frombuffer(_gq.IQ2_XXS.ksigns, np.uint8).copy()  # [128]: i | parity(i) << 7
IQ_TYPES = (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S)
# element = d · SCALE_MULT · (2s + 1) · grid · sign
SCALE_MULT: dict[QType, float] = {
    QType.IQ2_XXS: 0.125,
    QType.IQ2_XS: 0.125,
    QType.IQ2_S: 0.125,
    QType.IQ3_XXS: 0.25,
    QType.IQ3_S: 1.0,
}
SCALE_GROUP = {QType.IQ2_XXS: 32, QType.IQ2_XS: 16, QType.IQ2_S: 16, QType.IQ3_XXS: 32, QType.IQ3_S: 32}
PARITY_SIGNS = (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ3_XXS)  # 7 stored sign bits per 8 elements


def grid_words(qtype: QType) -> np.ndarray:
    """The grid as little-endian words (uint64 for the 8-wide IQ2 grids, uint32 for the 4-wide IQ3 ones):
    byte j of word i is grid[i][j]."""
    g = GRIDS[QType(qtype)]
    return np.ascontiguousarray(g).view(np.uint64 if g.shape[1] == 8 else np.uint32)[:, 0].copy()


def sign_masks() -> np.ndarray:
    """uint64 [256]: byte j of word b is 0xFF where bit j of the sign byte b is set, else 0."""
    b = np.arange(256, dtype=np.uint64)[:, None]
    bits = (b >> np.arange(8, dtype=np.uint64)) & np.uint64(1)
    return (bits * np.uint64(0xFF) << (np.uint64(8) * np.arange(8, dtype=np.uint64))).sum(axis=1, dtype=np.uint64)


# ---------------------------------------------------------------- decoding to codes


@dataclass(frozen=True)
class Codes:
    """Blocks [nb] decoded: grid indices idx int64 [nb, 256 / width], sign bytes sb uint8 [nb, 32] (the
    eighth bit of the parity types filled in), scale fields s int64 [nb, 256 / SCALE_GROUP] (0..15)."""

    idx: np.ndarray
    sb: np.ndarray
    s: np.ndarray


def _u32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view("<u4").astype(np.int64)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """uint8 [..., k] -> int64 [..., 2k]: low nibble then high of each byte."""
    b = b.astype(np.int64)
    return np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def decode(qtype: QType, blk: np.ndarray) -> Codes:
    """uint8 [nb, type_size] -> :class:`Codes` (the layouts of the module docstring)."""
    qtype = QType(qtype)
    nb = blk.shape[0]
    if qtype == QType.IQ2_XXS:
        w = _u32(blk[:, 2:66]).reshape(nb, 8, 2)
        idx = (w[..., 0:1] >> (8 * np.arange(4))) & 255  # [nb, 8, 4]
        si = (w[..., 1:2] >> (7 * np.arange(4))) & 127
        return Codes(idx.reshape(nb, 32), KSIGNS[si].reshape(nb, 32), w[..., 1] >> 28)
    if qtype == QType.IQ2_XS:
        q = np.ascontiguousarray(blk[:, 2:66]).view("<u2").astype(np.int64)  # [nb, 32]
        return Codes(q & 511, KSIGNS[q >> 9], _nibbles(blk[:, 66:74]))
    if qtype == QType.IQ2_S:
        qh = blk[:, 66:74].astype(np.int64)[..., None]  # [nb, 8, 1]
        hi = ((qh >> (2 * np.arange(4))) & 3).reshape(nb, 32)
        idx = blk[:, 2:34].astype(np.int64) | (hi << 8)
        return Codes(idx, blk[:, 34:66].copy(), _nibbles(blk[:, 74:82]))
    if qtype == QType.IQ3_XXS:
        w = _u32(blk[:, 66:98])  # [nb, 8]
        si = (w[..., None] >> (7 * np.arange(4))) & 127
        return Codes(blk[:, 2:66].astype(np.int64), KSIGNS[si].reshape(nb, 32), w >> 28)
    if qtype == QType.IQ3_S:
        qh = blk[:, 66:74].astype(np.int64)[..., None]
        hi = ((qh >> np.arange(8)) & 1).reshape(nb, 64)
        idx = blk[:, 2:66].astype(np.int64) | (hi << 8)
        return Codes(idx, blk[:, 74:106].copy(), _nibbles(blk[:, 106:110]))
    raise KeyError(qtype)


def signed_values(qtype: QType, c: Codes) -> np.ndarray:
    """int64 [nb, 256]: grid · sign of every element."""
    nb = c.idx.shape[0]
    g = GRIDS[QType(qtype)][c.idx].astype(np.int64).reshape(nb, QK)
    neg = ((c.sb[..., None].astype(np.int64) >> np.arange(8)) & 1).reshape(nb, QK)
    return np.where(neg == 1, -g, g)


def dequantize_blocks(qtype: QType, blk: np.ndarray) -> np.ndarray:
    """uint8 [nb, type_size] -> float32 [nb, 256], in ggml's float32 order (bit-exact with gguf.quants)."""
    qtype = QType(qtype)
    nb = blk.shape[0]
    c = decode(qtype, blk)
    d = np.ascontiguousarray(blk[:, 0:2]).view("<f2").astype(_F32)  # [nb, 1]
    s = c.s.astype(_F32)
    with np.errstate(over="ignore", invalid="ignore"):
        if qtype == QType.IQ3_S:
            db = d * (_F32(1) + _F32(2) * s)  # d·(1 + 2s): the integer is exact in float32
        else:
            db = d * (_F32(0.5) + s) * _F32(0.25 if qtype != QType.IQ3_XXS else 0.5)
        per = QK // db.shape[1]
        g = GRIDS[qtype][c.idx].astype(_F32).reshape(nb, -1, per)
        neg = ((c.sb[..., None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(nb, -1, per)
        sign = np.where(neg == 1, _F32(-1), _F32(1))
        return (db[..., None] * g * sign).reshape(nb, QK)


# ---------------------------------------------------------------- test-data quantizer


def _nearest(t: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """t float32 [M, w] -> index of the nearest grid point [M] (least squares)."""
    g = grid.astype(_F32)
    return np.argmin((g * g).sum(axis=1)[None, :] - _F32(2) * (t @ g.T), axis=1)


def _fit(t: np.ndarray, grid: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale groups t [G, k] at scales [G] (> 0) -> (indices [G, k / w], grid values [G, k], the error [G])."""
    G, k = t.shape
    w = grid.shape[1]
    idx = _nearest((t / scale[:, None]).reshape(-1, w), grid).reshape(G, -1)
    g = grid[idx].astype(_F32).reshape(G, k)
    err = ((t - scale[:, None] * g) ** 2).sum(axis=1)
    return idx, g, err


def quantize_blocks(qtype: QType, x: np.ndarray) -> np.ndarray:
    """Test data, not ggml's search: float32 [nb, 256] -> uint8 blocks [nb, type_size].

    Signs: those of x (the parity types flip the element of least |x| in an 8 with an odd count of
    negatives, and fit its value as −|x|). Each scale group tries its largest |x| over each grid level and
    over 8 values from the middle level to the top one, keeps the one with the least squared error after the least-squares refit on its nearest grid
    points; the block's fp16 d maps the largest group scale to s = 15; each group takes the nearest s and
    then the nearest grid point to every 8 (4) elements at its stored scale.
    """
    qtype = QType(qtype)
    grid = GRIDS[qtype]
    sg = SCALE_GROUP[qtype]
    mult = _F32(SCALE_MULT[qtype])
    x = np.asarray(x, _F32)
    nb = x.shape[0]
    a = np.abs(x).reshape(nb, 32, 8)
    neg = (x < 0).reshape(nb, 32, 8)
    if qtype in PARITY_SIGNS:
        odd = neg.sum(axis=-1) % 2 == 1
        flip = np.zeros_like(neg)
        np.put_along_axis(flip, a.argmin(axis=-1)[..., None], odd[..., None], axis=-1)
        neg ^= flip
        a = np.where(flip, -a, a)
    t = a.reshape(-1, sg)  # [G, sg] targets of the positive grid
    gmax = t.max(axis=1)
    live = gmax > 1e-15
    levels = np.unique(grid).astype(_F32)
    best = np.zeros(len(t), _F32)
    best_err = np.full(len(t), np.inf, _F32)
    for lv in np.union1d(levels, np.linspace(levels[len(levels) // 2], levels[-1], 8)):
        sc = np.where(live, gmax / lv, _F32(1))
        _, g, _ = _fit(t, grid, sc)
        gg = (g * g).sum(axis=1)
        sc = np.where(live & (gg > 0), (t * g).sum(axis=1) / np.where(gg > 0, gg, 1), sc).astype(_F32)
        sc = np.where(sc > 0, sc, gmax / levels[-1]).astype(_F32)
        _, _, err = _fit(t, grid, np.where(live, sc, _F32(1)))
        better = err < best_err
        best = np.where(better, sc, best)
        best_err = np.where(better, err, best_err)
    best = np.where(live, best, _F32(0)).reshape(nb, -1)  # [nb, groups]
    d = to_f16(best.max(axis=1) / (_F32(31) * mult))  # [nb]
    dm = d.astype(_F32) * mult
    inv = np.divide(_F32(1), dm, out=np.zeros_like(dm), where=dm > 0)
    s = np.clip(np.rint((best * inv[:, None] - 1) / 2), 0, 15).astype(np.int64)  # [nb, groups]
    stored = dm[:, None] * (2 * s + 1).astype(_F32)
    idx, _, _ = _fit(t, grid, np.where(stored > 0, stored, _F32(1)).reshape(-1))
    idx = idx.reshape(nb, -1)  # [nb, 256 / w]
    bits = (neg.reshape(nb, 32, 8).astype(np.uint8) << np.arange(8, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)
    sign7 = (bits & 127).astype(np.int64)  # [nb, 32]
    if qtype == QType.IQ2_XXS:
        q = np.zeros((nb, 8, 2), np.uint32)
        q[..., 0] = (idx.reshape(nb, 8, 4) << (8 * np.arange(4))).sum(axis=-1)
        q[..., 1] = (sign7.reshape(nb, 8, 4) << (7 * np.arange(4))).sum(axis=-1) | (s << 28)
        return pack_blocks(qtype, nb, d=d, qs=q.reshape(nb, 16).view(np.uint16))
    if qtype == QType.IQ2_XS:
        qs = (idx | (sign7 << 9)).astype(np.uint16)
        return pack_blocks(qtype, nb, d=d, qs=qs, scales=(s[:, 0::2] | (s[:, 1::2] << 4)).astype(np.uint8))
    if qtype == QType.IQ2_S:
        qh = ((idx >> 8).reshape(nb, 8, 4) << (2 * np.arange(4))).sum(axis=-1).astype(np.uint8)
        sc = (s[:, 0::2] | (s[:, 1::2] << 4)).astype(np.uint8)
        return pack_blocks(qtype, nb, d=d, qs=(idx & 255).astype(np.uint8), signs=bits, qh=qh, scales=sc)
    if qtype == QType.IQ3_XXS:
        sas = (sign7.reshape(nb, 8, 4) << (7 * np.arange(4))).sum(axis=-1) | (s << 28)
        return pack_blocks(qtype, nb, d=d, qs=idx.astype(np.uint8), sas=sas.astype(np.uint32))
    if qtype == QType.IQ3_S:
        qh = ((idx >> 8).reshape(nb, 8, 8) << np.arange(8)).sum(axis=-1).astype(np.uint8)
        sc = (s[:, 0::2] | (s[:, 1::2] << 4)).astype(np.uint8)
        return pack_blocks(qtype, nb, d=d, qs=(idx & 255).astype(np.uint8), qh=qh, signs=bits, scales=sc)
    raise KeyError(qtype)
