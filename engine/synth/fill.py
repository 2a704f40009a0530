"""Fill a geometry-only GGUF's data region with random but well-scaled quantized blocks.

Quantizing tens of GB of random floats takes an hour in numpy; writing random block bytes with
fixed, sensible scale fields takes minutes. Each block format gets scale fields chosen so a
weight's elements have mean ≈ 0 and std ≈ 1/sqrt(fan_in) (1 for embeddings), which keeps
activations finite through dozens of layers: good enough for speed and memory work on the
real shapes (never for accuracy work — use ``write_model`` for that).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from engine.errors import UsageError
from engine.gguf import open_gguf
from engine.quant import iquants
from engine.quant.formats import QType, block_format

CHUNK = 64 << 20  # bytes generated and written at a time

# Per block type: std of the integer code the d scale multiplies, and a function writing the
# fixed fields of blocks [n, type_size] for element std ``s``.
_K_SCALES = np.array([160] * 8 + [0] * 4, np.uint8)  # all eight 6-bit scales and mins = 32


def _f16(x: float) -> np.ndarray:
    return np.array([x], np.float16).view(np.uint8)


def _q4_k(b: np.ndarray, s: float) -> None:  # element = 32·d·(q − 7.5), q uniform 0..15
    d = s / (32 * 4.61)
    b[:, 0:2], b[:, 2:4], b[:, 4:16] = _f16(d), _f16(7.5 * d), _K_SCALES


def _q5_k(b: np.ndarray, s: float) -> None:  # element = 32·d·(q − 15.5), q uniform 0..31
    d = s / (32 * 9.23)
    b[:, 0:2], b[:, 2:4], b[:, 4:16] = _f16(d), _f16(15.5 * d), _K_SCALES


def _q6_k(b: np.ndarray, s: float) -> None:  # element = 16·d·(q − 32), q uniform 0..63
    b[:, 192:208], b[:, 208:210] = 16, _f16(s / (16 * 18.5))


def _q2_k(b: np.ndarray, s: float) -> None:  # element = 8·d·q − 8·dmin, q uniform 0..3 (mean 1.5, std 1.118)
    d = s / (8 * 1.118)
    b[:, 0:16], b[:, 80:82], b[:, 82:84] = 0x88, _f16(d), _f16(1.5 * d)


# Q3_K: sub-block scales alternating +16, −16 (stored 48, 16), so a row's elements average to 0
_K3_SCALES = np.array([0] * 8 + [0xFF, 0x55, 0xFF, 0x55], np.uint8)


def _q3_k(b: np.ndarray, s: float) -> None:  # element = ±16·d·(q − 4), q uniform 0..7 (rms 2.35)
    b[:, 96:108], b[:, 108:110] = _K3_SCALES, _f16(s / (16 * 2.35))


def _q8_0(b: np.ndarray, s: float) -> None:  # element = d·q, q uniform −128..127
    b[:, 0:2] = _f16(s / 73.9)


def _q4_0(b: np.ndarray, s: float) -> None:  # element = d·(q − 8)
    b[:, 0:2] = _f16(s / 4.61)


def _q5_0(b: np.ndarray, s: float) -> None:  # element = d·(q − 16)
    b[:, 0:2] = _f16(s / 9.23)


def _mxfp4(b: np.ndarray, s: float) -> None:  # element = 2^(e−128)·v, v uniform over the 16 values (std 5.85)
    b[:, 0] = int(np.clip(np.rint(np.log2(s / 5.85)) + 128, 0, 255))


def _iq4_nl(b: np.ndarray, s: float) -> None:  # element = d·kvalues_iq4nl[q], q uniform 0..15 (rms 67.4)
    b[:, 0:2] = _f16(s / 67.4)


def _iq4_xs(b: np.ndarray, s: float) -> None:  # element = ±16·d·kvalues[q]: group scales 48, 16, 48, ... (±16)
    b[:, 0:2], b[:, 2:4], b[:, 4:8] = _f16(s / (16 * 67.4)), np.array([0x77, 0x77], np.uint8), 0


def _iq_grid(t: QType) -> Callable[[np.ndarray, float], None]:
    """The IQ2/IQ3 grid types: element = d·mult·(2s + 1)·grid·sign with random indices, signs and 4-bit
    scales s (rms of 2s + 1 over 0..15: √341); only d is set."""
    rms = float(np.sqrt(np.mean(iquants.GRIDS[t].astype(np.float64) ** 2)))

    def fields(b: np.ndarray, s: float) -> None:
        b[:, 0:2] = _f16(s / (iquants.SCALE_MULT[t] * np.sqrt(341.0) * rms))

    return fields


_FIELDS: dict[QType, Callable[[np.ndarray, float], None]] = {
    **{t: _iq_grid(t) for t in iquants.IQ_TYPES},
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.Q3_K: _q3_k,
    QType.Q2_K: _q2_k,
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q5_0: _q5_0,
    QType.MXFP4: _mxfp4,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
}


def _floats(name: str, shape: tuple[int, ...], rng: np.random.Generator, n: int) -> np.ndarray:
    if name.endswith(".ssm_a"):  # Gated DeltaNet's −exp(A_log): a decay per head, always negative
        return -np.exp(0.5 * rng.standard_normal(n, dtype=np.float32))
    if len(shape) == 1:  # norms ≈ 1, biases and gates ≈ 0
        return (1.0 if "norm" in name else 0.0) + 0.02 * rng.standard_normal(n, dtype=np.float32)
    std = 3.0 if "ffn_gate_inp" in name else 1.0  # routers spread their logits
    return rng.standard_normal(n, dtype=np.float32) * np.float32(std / np.sqrt(shape[-1]))


def fill_random_blocks(
    path: str | os.PathLike, seed: int = 0, progress: Callable[[int, int], None] | None = None
) -> int:
    """Overwrite every tensor's data in ``path`` with random blocks; returns bytes written."""
    with open_gguf(path) as gf:
        tensors = [(t.name, t.qtype, t.shape, t.offset, t.nbytes) for t in gf.tensors.values()]
    total = sum(t[4] for t in tensors)
    rng = np.random.default_rng(seed)
    done = 0
    with open(path, "r+b") as f:
        for name, qtype, shape, offset, nbytes in tensors:
            f.seek(offset)
            if qtype in (QType.F32, QType.F16, QType.BF16):
                vals = _floats(name, shape, rng, int(np.prod(shape)))
                data = {QType.F32: vals, QType.F16: vals.astype(np.float16)}.get(qtype)
                if data is None:  # BF16: the top half of the f32 bits
                    data = (vals.view(np.uint32) >> 16).astype(np.uint16)
                f.write(data.tobytes())
            elif qtype in _FIELDS:
                fmt = block_format(qtype)
                std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[-1])
                step = CHUNK // fmt.type_size * fmt.type_size
                for start in range(0, nbytes, step):
                    blocks = np.frombuffer(rng.bytes(min(step, nbytes - start)), np.uint8).copy()
                    blocks = blocks.reshape(-1, fmt.type_size)
                    _FIELDS[qtype](blocks, float(std))
                    f.write(blocks.tobytes())
            else:
                raise UsageError(f"cannot fill tensor {name!r} of type {qtype.name}")
            done += nbytes
            if progress:
                progress(done, total)
    return done
