"""Triton quantized GEMV (engine.runtime.triton_gemv), the exact-float kernels (act="f32"; the q8/dp4a
kernels are test_q8.py's) vs the torch dequantize-then-matmul reference: in Triton's interpreter small
awkward shapes, compiled on CUDA trunk-sized ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quant import QType
from engine.runtime import references as refs
from engine.runtime import triton_gemv as tg
from tests.triton import BIG
from tests.triton_data import blocks

TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS")
# Awkward shapes: rows not a multiple of any tile, K = 256·odd; big: trunk-sized (CUDA only).
SHAPES = ((37, 768), (5, 256)) if not BIG else ((4096, 2048), (517, 2304), (2048, 4096))
# UNROLL 4: short K walks unrolled, longer ones a runtime loop (both kinds on the big shapes)
CONFIGS = (
    {"BR": 4, "NB": 2, "num_warps": 4, "SPLIT": 1, "UNROLL": 4},
    {"BR": 8, "NB": 4, "num_warps": 2, "SPLIT": 3, "UNROLL": 0},
)


@pytest.mark.parametrize(("rows", "n"), SHAPES, ids=[f"{r}x{n}" for r, n in SHAPES])
@pytest.mark.parametrize("name", TYPES)
def test_gemv_and_matmul_match_the_reference(name, rows, n, device, big):
    q = QType[name]
    rng = np.random.default_rng((0, int(q), rows, n))
    # realistic scales: quantized Gaussian weights, two matrices side by side in one pool
    raw = torch.cat([blocks(q, rows, n, device, rng) for _ in range(2)])
    pool = raw.reshape(-1).contiguous()
    rb = raw.shape[1]
    X = torch.from_numpy(rng.standard_normal((3, n)).astype(np.float32)).to(device)
    offs = torch.tensor([0, rows * rb, 0], dtype=torch.int64, device=device)  # matrix 0, 1, 0
    ref = refs.gemv_reference(pool, offs, X, q, rows, n)
    for cfg in (*CONFIGS, None):  # None: the launch tables' settings (kernel_select)
        Y = tg.gemv(pool, offs, X, q, rows, n, cfg, act="f32")
        err = ((Y - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (name, rows, n, cfg, err)
    X3 = X[:3] if not big else torch.from_numpy(rng.standard_normal((7, n)).astype(np.float32)).to(device)
    Y = tg.matmul(pool[: rows * rb].view(rows, rb), X3, q, rows, n, CONFIGS[1], act="f32")
    ref = refs.gemv_reference(pool, torch.zeros(len(X3), dtype=torch.int64, device=device), X3, q, rows, n)
    err = ((Y - ref).norm() / ref.norm()).item()
    assert err < 1e-5, (name, rows, n, "matmul", err)
