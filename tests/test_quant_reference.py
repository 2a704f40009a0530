"""The numpy reference (de)quantizers against independent references.

- ``gguf.quants`` (an independent numpy implementation): dequantization of every block type,
  bit for bit; quantization of F16/BF16/Q8_0/Q4_0/Q5_0, bit for bit.
- ggml itself (``quantize_row_*_ref`` / ``dequantize_row_*`` in llama.cpp's libggml-base), when
  llama-cpp-python is installed: every block type, K-quants included.
- Round-trip error of each format on Gaussian data, measured (bounds leave ~5% headroom).
"""

from __future__ import annotations

import ctypes
import os

import gguf.quants as gq
import numpy as np
import pytest

from engine.quant import FORMATS, QType, block_format, dequantize, quantize
from engine.quant.formats import WEIGHT_TYPES
from engine.quant.quantize import pack_scale_min_k4
from engine.quant.reference import block_fields, unpack_scale_min_k4

K_TYPES = [QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS]
IQ_GRID_TYPES = [QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S]
BLOCK_TYPES = [t for t in WEIGHT_TYPES if block_format(t).block_size > 1]
BLOCK_TYPES += [t for t in IQ_GRID_TYPES if t not in BLOCK_TYPES]
# Quantized by a simple scale fit for test data, not ggml's search (engine.quant.quantize): bytes differ
NOT_GGML_QUANTIZER = (QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS, *IQ_GRID_TYPES)
ALL_TYPES = [QType.F32, QType.F16, QType.BF16, *BLOCK_TYPES]


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns of a float32 array (so -0.0 != 0.0 and NaN == NaN)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def random_blocks(rng: np.random.Generator, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Random block bytes uint8 [*shape, type_size] whose fp16 fields hold realistic scales.

    Raw random bits in an fp16 field would mostly be huge, inf or NaN; real scales are small
    (|d| in 1e-5..1, either sign; the K-quants' d/dmin are positive in practice but any sign decodes).
    """
    fmt = block_format(qtype)
    raw = rng.integers(0, 256, (*shape, fmt.type_size), dtype=np.uint8)
    for f in fmt.fields:
        if f.dtype == "<f2":
            mag = 10.0 ** rng.uniform(-5, 0, shape)
            sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
            off = fmt.field_offset(f.name)
            raw[..., off : off + 2] = (mag * sign).astype("<f2")[..., None].view(np.uint8)
    return raw


def awkward_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 [8, n]: Gaussian rows of scale 0.1..100 (rows 0, 6, 7), a zero row (1), a row on a
    half-integer grid (2: rounding ties), a row with one huge outlier (3), a row of constants (4),
    and a row of tiny values (5) whose fp16 scales are subnormal or flush to zero."""
    x = rng.standard_normal((8, n)) * 10.0 ** rng.uniform(-1, 2, (8, 1))
    x[1] = 0
    x[2] = rng.integers(-254, 255, n) / 2  # x / d hits .5 exactly for Q8_0 (d = 1)
    x[3, n // 3] = 3e3
    x[4] = -0.75
    x[5] = rng.standard_normal(n) * 1e-6
    return x.astype(np.float32)


def rel_rms(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2)))


# ---------------------------------------------------------------- dequantize vs gguf


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 3)], ids=str)
def test_dequantize_matches_gguf_bit_for_bit(qtype, lead):
    rng = np.random.default_rng(int(qtype) * 10 + len(lead))
    raw = random_blocks(rng, qtype, (*lead, 3)).reshape(*lead, -1)  # [*lead, 3 * type_size]
    ours = dequantize(raw, qtype)
    assert ours.dtype == np.float32
    assert ours.shape == (*lead, 3 * block_format(qtype).block_size)
    np.testing.assert_array_equal(bits(ours), bits(gq.dequantize(raw, qtype)))


EDGE_F16 = [0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 1.0, -1.0, 65504.0, -65504.0, np.inf, -np.inf, np.nan]


@pytest.mark.parametrize(
    "qtype", [QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS, *IQ_GRID_TYPES], ids=lambda q: q.name
)
def test_low_bit_k_quants_edge_scales_match_gguf(qtype):
    """Every fp16 field at an edge value (signed zeros, subnormals, ±65504, ±inf, NaN) with the packed
    scale bytes all-zero, all-ones or random: the values equal gguf.quants bit for bit (NaNs as NaNs)."""
    fmt = block_format(qtype)
    rng = np.random.default_rng(9)
    n = len(EDGE_F16)
    raw = rng.integers(0, 256, (3 * n * n, fmt.type_size), dtype=np.uint8)
    halves = [f for f in fmt.fields if f.dtype == "<f2"]
    for i, f in enumerate(halves):  # every pair of edge values over the fp16 fields
        v = np.array(EDGE_F16, np.float16)[(np.arange(len(raw)) // n**i) % n]
        off = fmt.field_offset(f.name)
        raw[:, off : off + 2] = v.astype("<f2")[:, None].view(np.uint8)
    # IQ4_XS: scales_h and scales_l (all-zero: every ls − 32 = −32; all-ones: +31); the IQ grid types: all
    # fields but d (IQ2_XXS, IQ3_XXS keep their scales in the top nibble of the sign words)
    iq = qtype in IQ_GRID_TYPES
    for f in fmt.fields:
        if f.name.startswith("scales") or (iq and f.name != "d"):
            sc = fmt.field_offset(f.name)
            raw[: n * n, sc : sc + f.nbytes] = 0
            raw[n * n : 2 * n * n, sc : sc + f.nbytes] = 0xFF
    with np.errstate(invalid="ignore", over="ignore"):
        ours = dequantize(raw.reshape(-1), qtype)
        want = gq.dequantize(raw.reshape(-1), qtype)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(bits(ours)[~nan], bits(want)[~nan])


def test_dequantize_float_types_accept_arrays_and_bytes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert dequantize(x, QType.F32) is x
    np.testing.assert_array_equal(dequantize(x.view(np.uint8), QType.F32), x)

    h = x.astype(np.float16)
    for raw in (h, h.view(np.uint8)):
        got = dequantize(raw, QType.F16)
        np.testing.assert_array_equal(bits(got), bits(gq.dequantize(h.view(np.uint8), QType.F16)))

    b = rng.integers(0, 1 << 16, (3, 64), dtype=np.uint16)  # any bit pattern, NaNs included
    want = gq.dequantize(b.view(np.uint8), QType.BF16)
    for raw in (b, b.view(np.int16), b.view(np.uint8)):
        np.testing.assert_array_equal(bits(dequantize(raw, QType.BF16)), bits(want))


def test_scale_min_k4_pack_unpack_roundtrip():
    # every 6-bit (scale, min) value in every slot
    v = np.arange(64, dtype=np.uint8)
    ls = np.stack([np.roll(v, j) for j in range(8)], axis=1)  # [64, 8]
    lm = np.stack([np.roll(v[::-1], 3 * j) for j in range(8)], axis=1)
    sc, m = unpack_scale_min_k4(pack_scale_min_k4(ls, lm))
    np.testing.assert_array_equal(sc, ls)
    np.testing.assert_array_equal(m, lm)


def test_block_fields_use_the_format_offsets():
    rng = np.random.default_rng(2)
    raw = random_blocks(rng, QType.Q6_K, (5,))
    f = block_fields(raw, QType.Q6_K)
    assert [k for k in f] == ["ql", "qh", "scales", "d"]
    np.testing.assert_array_equal(f["d"].view(np.uint8), raw[:, 208:210])
    assert f["scales"].dtype == np.int8 and f["scales"].shape == (5, 16)


# ---------------------------------------------------------------- quantize vs gguf


@pytest.mark.parametrize(
    "qtype", [QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.MXFP4], ids=lambda q: q.name
)
def test_quantize_matches_gguf_bit_for_bit(qtype):
    x = awkward_rows(np.random.default_rng(3), 512)
    ours = quantize(x, qtype)
    want = gq.quantize(x, qtype)
    expected_dtype = {QType.F16: np.float16, QType.BF16: np.uint16}.get(qtype, np.uint8)
    assert ours.dtype == expected_dtype
    np.testing.assert_array_equal(ours.view(np.uint8), want.view(np.uint8))


def test_quantize_f32_is_a_float32_copy():
    x = np.arange(64, dtype=np.float64).reshape(2, 32)
    q = quantize(x, QType.F32)
    assert q.dtype == np.float32 and q.shape == (2, 32)
    np.testing.assert_array_equal(q, x)


# ---------------------------------------------------------------- round trip

# Relative RMS error on N(0, 1) data, measured with this code (bit-identical to ggml's reference
# quantizers): F16 2.1e-4, BF16 1.66e-3, Q8_0 0.536%, Q4_0 8.61%, Q5_0 4.28%, Q4_K 7.15%,
# Q5_K 3.62%, Q6_K 1.78%. The lower bound catches a type silently quantized as another.
ROUNDTRIP_BOUNDS = {
    QType.F32: (0.0, 0.0),
    QType.F16: (1.5e-4, 2.3e-4),
    QType.BF16: (1.3e-3, 1.8e-3),
    QType.Q8_0: (0.0045, 0.0057),
    QType.Q4_0: (0.075, 0.090),
    QType.Q5_0: (0.037, 0.045),
    QType.Q4_K: (0.062, 0.075),
    QType.Q5_K: (0.031, 0.038),
    QType.Q6_K: (0.015, 0.0187),
    QType.MXFP4: (0.105, 0.125),  # a power-of-two scale and 8 magnitudes: coarser than Q4_0
    QType.Q3_K: (0.14, 0.165),  # 15.4 % with the simple test-data fit (ggml's search does better)
    QType.Q2_K: (0.26, 0.30),  # 28.3 %, the same caveat
    QType.IQ4_NL: (0.072, 0.082),  # 7.77 %, the same caveat (a least-squares refit of the absmax scale)
    QType.IQ4_XS: (0.072, 0.082),  # 7.81 %
    # the grid types' test-data quantizer (engine.quant.iquants: the best of 8 scales a group, nearest grid
    # points; ggml's search with an importance matrix does better)
    QType.IQ2_XXS: (0.32, 0.36),  # 34.3 %
    QType.IQ2_XS: (0.27, 0.31),  # 29.3 %
    QType.IQ2_S: (0.23, 0.26),  # 24.7 %
    QType.IQ3_XXS: (0.17, 0.19),  # 18.0 %
    QType.IQ3_S: (0.12, 0.14),  # 13.1 %
}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_roundtrip_error_on_gaussian_data(qtype):
    x = np.random.default_rng(4).standard_normal((32, 2048)).astype(np.float32)
    q = quantize(x, qtype)
    y = dequantize(q, qtype)
    if q.dtype == np.uint8:  # an independent decoder reads our bytes the same way
        np.testing.assert_array_equal(bits(y), bits(gq.dequantize(q, qtype)))
    lo, hi = ROUNDTRIP_BOUNDS[qtype]
    assert lo <= rel_rms(y, x) <= hi


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_awkward_rows_roundtrip(qtype):
    rng = np.random.default_rng(5)
    x = awkward_rows(rng, 1024)
    y = dequantize(quantize(x, qtype), qtype)
    assert np.isfinite(y).all()
    assert not np.any(y[1]), "an all-zero row must decode to zeros"
    # the outlier itself is kept to ~1e-3 (MXFP4: a power-of-two scale over the values 8 and 12 at the top
    # of the range, up to 20 % off; 3000 becomes 3072; IQ4_*: the least-squares refit of the block scale
    # trades the outlier for the rest of its block, 3000 becomes 2984.5; the IQ grid types have no zero level:
    # the outlier shares a grid point with 7 (IQ3: 3) small values and the fit trades it for them, measured
    # IQ2_XXS 1576, IQ2_XS 2083, IQ2_S 2085, IQ3_XXS 2678, IQ3_S 2631)
    tol = {QType.MXFP4: 0.025, QType.IQ4_NL: 0.01, QType.IQ4_XS: 0.01, QType.IQ2_XXS: 0.5}.get(qtype, 2e-3)
    tol = {QType.IQ2_XS: 0.35, QType.IQ2_S: 0.35, QType.IQ3_XXS: 0.15, QType.IQ3_S: 0.15}.get(qtype, tol)
    assert abs(y[3, 1024 // 3] - 3e3) <= tol * 3e3
    np.testing.assert_allclose(y[4], -0.75, rtol=2e-3)  # a constant row is (nearly) exact
    # Row 5 (|x| ~ 1e-6) is not bounded: its fp16 scales flush to zero or lose bits, as in ggml
    # (test_matches_ggml_reference_quantizer checks those bytes); it must only stay finite.
    for r in (0, 2, 6, 7):
        assert rel_rms(y[r], x[r]) <= ROUNDTRIP_BOUNDS[qtype][1] * 1.3


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_blocks_are_independent(qtype):
    """An outlier changes its own block only: the other blocks' bytes are unchanged."""
    fmt = block_format(qtype)
    x = np.random.default_rng(6).standard_normal((2, 4 * 256)).astype(np.float32)
    spiked = x.copy()
    spiked[1, 300] = 1e4
    a = quantize(x, qtype).reshape(-1, fmt.type_size)
    b = quantize(spiked, qtype).reshape(-1, fmt.type_size)
    changed = np.flatnonzero((a != b).any(axis=1))
    assert changed.tolist() == [(1024 + 300) // fmt.block_size]


def test_all_zero_blocks_encode_as_zero_scales():
    z = np.zeros((2, 512), np.float32)
    for qtype in BLOCK_TYPES:
        q = quantize(z, qtype)
        f = block_fields(q.reshape(-1, block_format(qtype).type_size), qtype)
        assert not f["e" if qtype == QType.MXFP4 else "d"].astype(np.float32).any(), qtype.name
        assert not np.any(dequantize(q, qtype))
    assert not quantize(z, QType.Q6_K).any(), "ggml stores an all-zero Q6_K block as zero bytes"


# ---------------------------------------------------------------- shapes and validation


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_shapes_one_row_and_stacked_experts(qtype):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 4, 512)).astype(np.float32)  # [E, out, in]
    q = quantize(w, qtype)
    flat = quantize(w.reshape(12, 512), qtype)
    per_row = block_format(qtype).row_bytes(512) if q.dtype == np.uint8 else 512
    assert q.shape == (3, 4, per_row)
    np.testing.assert_array_equal(q.reshape(flat.shape), flat)
    assert dequantize(q, qtype).shape == (3, 4, 512)
    one = quantize(w[0, 0], qtype)  # a single 1-D row
    assert one.shape == (per_row,)
    np.testing.assert_array_equal(one, q[0, 0])
    np.testing.assert_array_equal(dequantize(one, qtype), dequantize(q, qtype)[0, 0])


@pytest.mark.parametrize("qtype", K_TYPES + IQ_GRID_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [32, 128, 288])
def test_k_quants_need_rows_of_256(qtype, n):
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, n), np.float32), qtype)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.MXFP4], ids=lambda q: q.name)
def test_32_block_types_need_rows_of_32(qtype):
    quantize(np.zeros((2, 96), np.float32), qtype)  # fine
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), qtype)


def test_dequantize_rejects_bad_input():
    with pytest.raises(ValueError):
        dequantize(np.zeros((2, 35), np.uint8), QType.Q8_0)  # not whole blocks
    with pytest.raises(ValueError):
        dequantize(np.zeros((2, 34), np.uint16), QType.Q8_0)  # blocks are bytes
    with pytest.raises(ValueError):
        dequantize(np.zeros((2, 7), np.uint8), QType.F32)
    with pytest.raises(ValueError):
        dequantize(np.zeros((2, 8), np.uint8), QType.Q4_1)  # not a supported weight type
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 256), np.float32), QType.Q4_1)


# ---------------------------------------------------------------- ggml itself


def _libggml() -> ctypes.CDLL:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
    if not os.path.exists(path):
        pytest.skip(f"no {path}")
    return ctypes.CDLL(path)


def _ggml_fn(lib: ctypes.CDLL, name: str):
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    return fn


def _ggml_name(qtype: QType) -> str:
    return qtype.name.lower().replace("_k", "_K")  # q8_0, q4_K, ...


@pytest.mark.llama
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_matches_ggml_reference_quantizer(qtype):
    """Bytes equal ggml's quantize_row_*_ref (values only for the test-data quantizers); values equal
    ggml's dequantize_row_*."""
    lib = _libggml()
    fmt = block_format(qtype)
    rng = np.random.default_rng(8)
    x = np.concatenate([awkward_rows(rng, 2048), rng.standard_normal((24, 2048)).astype(np.float32)])
    ours = quantize(x, qtype)
    if (
        qtype in NOT_GGML_QUANTIZER
    ):  # (ggml's IQ2/IQ3 quantizers need ggml_quantize_init's tables: not called)  # only the values: ggml's decoder reads our blocks as ours does
        y = np.zeros(x.size, np.float32)
        _ggml_fn(lib, f"dequantize_row_{_ggml_name(qtype)}")(ours.ctypes.data, y.ctypes.data, y.size)
        np.testing.assert_array_equal(bits(dequantize(ours, qtype)).reshape(-1), bits(y))
    else:
        want = np.zeros((len(x), fmt.row_bytes(2048)), np.uint8)
        _ggml_fn(lib, f"quantize_row_{_ggml_name(qtype)}_ref")(x.ctypes.data, want.ctypes.data, x.size)
        same = (ours.reshape(-1, fmt.type_size) == want.reshape(-1, fmt.type_size)).all(axis=1)
        # Measured: every block identical. Allow a rare near-tie should a build contract to FMA.
        assert same.mean() >= (1.0 if fmt.block_size == 32 else 0.99), f"{(~same).sum()} blocks differ"

    raw = random_blocks(rng, qtype, (64,))
    y = np.zeros(64 * fmt.block_size, np.float32)
    _ggml_fn(lib, f"dequantize_row_{_ggml_name(qtype)}")(raw.ctypes.data, y.ctypes.data, y.size)
    np.testing.assert_array_equal(bits(dequantize(raw.reshape(-1), qtype)), bits(y))


def test_format_table_covers_all_types():
    assert set(ALL_TYPES) <= set(FORMATS)
