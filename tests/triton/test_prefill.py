"""The tiled prompt kernels (engine.runtime.triton_moe: grouped_matmul, one_matrix, moe_prefill) on bfloat16
operands against their torch references: every quant type the grouped kernel serves, ragged groups (a tile
and a bit), groups no entry names, skipped entries. In Triton's interpreter small shapes (the kernel's
bf16 products emulated in float32, OPS 2); compiled on CUDA the Qwen3-30B-A3B expert and trunk shapes on
the bf16 tensor cores (OPS 1).

Two bounds, u = 2⁻⁹ (bfloat16's unit roundoff: 8 significant bits, round to nearest even):

- against the float64 products of the *bf16-rounded* operands (``references.*_bf16_reference``): the
  kernel's products of two bf16 values are exact in float32, so only its float32 accumulation and, on
  CUDA, a rare one-ulp bf16 flip remain (the compiled dequantization may contract to an FMA where torch
  rounds twice; a flip needs the value within an f32 ulp of a bf16 midpoint, ~2⁻¹⁶ of the weights):
  relative error (Frobenius) ≤ :data:`TIGHT`;
- against the exact float64 product of the unrounded operands, elementwise: |x̃w̃ − xw| ≤ (2u + u²)|xw|
  for each product, float32 accumulation over n terms adds ≤ n·2⁻²⁴ Σ|xw| (γ_n, doubled for the
  tensor cores' accumulation order), the dequantization's float32 rounding 2⁻²²:
  |y − y_exact| ≤ (2u + u² + 2⁻²² + 2n·2⁻²⁴) · (|X| |W|ᵀ).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import config
from engine.quant import QType
from engine.quant.formats import block_format
from engine.runtime import references as refs
from engine.runtime import triton_moe as tm
from engine.runtime import triton_qblocks as qb
from engine.runtime.references import dequantize
from tests.triton import BIG, DEVICE, INTERPRET
from tests.triton_data import blocks, expert_pool, routing_case

Q = QType
TYPES = tuple(qb.SUPPORTED)  # what the grouped kernel serves
U = 2.0**-9
TIGHT = 1e-4 if DEVICE == "cuda" else 1e-5
# The whole MoE rounds twice in series (x, then h = SiLU(gate)·up, to bf16): a weight whose rounding the compiled
# dequantization flips moves h by a bf16 step, which the down product carries — measured 1.5e-4 on an H200
# (Q4_K gate/up, Q6_K down, 300 tokens; 2026-11-27).
TIGHT_MOE = 5e-4 if DEVICE == "cuda" else 1e-5
# The interpreter runs programs one by one: few, large tiles keep it quick (BT 16: ragged groups stay cheap).
INTERPRETER_LAUNCH = {
    "grouped_bf16:*:*": {"BR": 128, "NB": 1, "BT": 16, "num_warps": 4},
    "grouped_bf16:Q4_0:*": {"BR": 128, "NB": 2, "BT": 16, "num_warps": 4},
}
if BIG:
    R_N = {q: (768, 2048) for q in TYPES}
    MOE = [((Q.Q4_K, Q.Q4_K, Q.Q6_K), 768, 2048, 16, 8, 300), ((Q.Q8_0, Q.Q4_0, Q.Q5_K), 768, 2048, 16, 8, 40)]
    TRUNK = ((Q.Q4_K, 4096, 2048, 300), (Q.Q6_K, 2048, 4096, 77))
else:
    R_N = {q: (40, 512 if block_format(q).block_size == 256 else 96) for q in TYPES}
    MOE = [((Q.Q4_K, Q.Q4_K, Q.Q6_K), 256, 512, 5, 2, 20), ((Q.Q8_0, Q.Q4_0, Q.Q5_K), 256, 96, 5, 2, 20)]
    TRUNK = ((Q.Q4_K, 40, 512, 37), (Q.Q6_K, 33, 256, 20))


def _options(precision: str):
    o = replace(config.current(), prefill_precision=precision)
    return replace(o, launch_table=INTERPRETER_LAUNCH) if INTERPRET else o


def _bound(Xr: torch.Tensor, W: torch.Tensor, n: int) -> torch.Tensor:
    """The elementwise bound of the module docstring: [J, rows]."""
    return (2 * U + U * U + 2.0**-22 + 2 * n * 2.0**-24) * (Xr.abs().double() @ W.abs().double().T)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("q", TYPES, ids=[q.name for q in TYPES])
def test_grouped_bf16_matches_the_rounded_reference(q):
    """Groups of 1, BT + 3 (a second, ragged tile), 5 and BT entries over a pool of 7 matrices, 3 of them
    named by no entry; skipped entries (−1) first, as moe_prefill sorts them, and between two groups."""
    o = _options("bf16")
    R, n = R_N[q]
    c = tm.ks.launch("grouped_bf16", q, R, tm.ks.device_name(torch.device(DEVICE)), o)
    BT = c["BT"]
    rng = np.random.default_rng((5, int(q)))
    rb = block_format(q).row_bytes(n)
    stride = -(-R * rb // 256) * 256
    pool = torch.zeros(7 * stride, dtype=torch.uint8, device=DEVICE)
    mats = []
    for m in range(7):
        raw = blocks(q, R, n, DEVICE, rng).reshape(-1)
        pool[m * stride : m * stride + raw.numel()] = raw
        mats.append(dequantize(raw.view(R, rb), q, n))
    runs = [(-1, 2), (5, 1), (1, BT + 3), (-1, 1), (3, 5), (6, BT)]  # (matrix or −1, entries); 0, 2, 4 unnamed
    seg = torch.tensor([m * stride if m >= 0 else -1 for m, c in runs for _ in range(c)], device=DEVICE)
    T = 23
    tok = torch.from_numpy(rng.integers(0, T, seg.numel())).to(DEVICE)
    X = torch.from_numpy(rng.standard_normal((T, n)).astype(np.float32)).to(DEVICE)
    woff = 0
    Y = tm.grouped_matmul(pool, seg, woff, tok, tm.operand(X, "bf16"), q, R, n, 7, options=o)
    keep = (seg >= 0).nonzero().reshape(-1).tolist()
    Xr = refs.round_bf16(X)
    for j in keep:
        W = mats[int(seg[j]) // stride]
        y, x = Y[j : j + 1], X[tok[j]][None]
        tight = (Xr[tok[j]][None].double() @ refs.round_bf16(W).double().T).float()
        assert _rel(y, tight) <= TIGHT, (q.name, j, _rel(y, tight))
        exact = x.double() @ W.double().T
        assert ((y.double() - exact).abs() <= _bound(x, W, n)).all(), (q.name, j)


@pytest.mark.parametrize(("q", "R", "n", "T"), TRUNK, ids=[f"{q.name}-{R}x{n}-T{T}" for q, R, n, T in TRUNK])
def test_one_matrix_bf16_matches_the_rounded_reference(q, R, n, T):
    rng = np.random.default_rng((6, int(q), R, n))
    raw = blocks(q, R, n, DEVICE, rng)
    X = torch.from_numpy(rng.standard_normal((T, n)).astype(np.float32)).to(DEVICE)
    y = tm.one_matrix(raw, X, q, R, n, options=_options("bf16"))
    assert _rel(y, refs.matmul_bf16_reference(raw, X, q, R, n)) <= TIGHT
    W = dequantize(raw, q, n)
    assert ((y.double() - X.double() @ W.double().T).abs() <= _bound(X, W, n)).all()
    # the float32 mode stays the reference-equivalent one
    y32 = tm.one_matrix(raw, X, q, R, n, options=_options("f32"))
    assert _rel(y32, X.double() @ W.double().T) <= (1e-5 if DEVICE == "cpu" else 1e-4)


@pytest.mark.parametrize("case", MOE, ids=["-".join(t.name for t in c[0]) + f"-T{c[5]}" for c in MOE])
def test_moe_prefill_bf16_matches_the_rounded_reference(case):
    """moe_prefill on bf16 operands (x, the weights and h rounded) against moe_prefill_bf16_reference, with a
    skipped pair; and within the bf16 bound of the exact reference."""
    types, F, D, E, K, T = case
    rng = np.random.default_rng((7, *map(int, types), F, D, T))
    pool, stride, roles = expert_pool(types, F, D, E, DEVICE, rng)
    slot_off, x, w = routing_case(T, K, E, D, stride, DEVICE, rng)
    y = tm.moe_prefill(pool, slot_off, x, w, roles, options=_options("bf16"), n_experts=E)
    assert _rel(y, refs.moe_prefill_bf16_reference(pool, slot_off, x, w, roles)) <= TIGHT_MOE
    # three bf16 products in a row: a few u relative to the exact result (loose; the tight check is above)
    assert _rel(y, refs.moe_decode_reference(pool, slot_off, x, w, roles)) <= 8 * U


@pytest.mark.parametrize("BT", [1, 3, 32, 64])
@pytest.mark.parametrize("J", [1, 7, 1024, 2500])  # a chunk of the kernel is 1024 entries: groups run across chunks
def test_tile_starts_kernel_equals_its_reference(BT, J):
    """The one-launch tile table against the torch ops it replaces: sorted groups with skipped (−1) entries
    first, groups spanning the kernel's chunks, table lengths from max_tiles (and one longer: −1 after)."""
    rng = np.random.default_rng((BT, J))
    E = int(rng.integers(1, 40))
    seg = torch.from_numpy(np.sort(rng.integers(-1, E, J)) * 4096).clamp(min=-1)
    seg = seg.to(DEVICE)
    n = tm.max_tiles(J, min(J, E + 1), BT)
    for size in (n, n + 5):
        got = tm.tile_starts(seg, BT, size)
        assert got.device.type == DEVICE
        assert got.cpu().tolist() == tm.tile_starts_reference(seg, BT, size).cpu().tolist()
