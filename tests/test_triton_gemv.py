"""Triton quantized GEMV (engine.runtime.triton_gemv), the exact-float kernels (act="f32"; the
q8/dp4a kernels are tests/test_triton_q8.py's) vs the torch dequantize-then-matmul
reference: Triton's CPU interpreter here (small awkward shapes); compiled on a CUDA machine with
trunk-sized ones. Each case runs in a subprocess so TRITON_INTERPRET applies from import time."""

from __future__ import annotations

import os

import pytest

from tests.triton_data import run_script

pytest.importorskip("triton")

SCRIPT = r"""
import sys, numpy as np, torch
from engine.quant import QType
from engine.runtime import references as refs, triton_gemv as tg
dev, big = sys.argv[1], sys.argv[2] == "big"
rng = np.random.default_rng(0)

from tests.triton_data import blocks

# Awkward shapes: rows not a multiple of any tile, K = 256·odd; big: trunk-sized (CUDA only).
shapes = ((37, 768), (5, 256)) if not big else ((4096, 2048), (517, 2304), (2048, 4096))
# UNROLL 4: short K walks unrolled, longer ones a runtime loop (both kinds on the big shapes)
configs = ({"BR": 4, "NB": 2, "num_warps": 4, "SPLIT": 1, "UNROLL": 4}, {"BR": 8, "NB": 4, "num_warps": 2, "SPLIT": 3, "UNROLL": 0})
for name in ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
    q = QType[name]
    for rows, n in shapes:
        # realistic scales: quantized Gaussian weights, two matrices side by side in one pool
        raw = torch.cat([blocks(q, rows, n, dev, rng) for _ in range(2)])
        pool = raw.reshape(-1).contiguous()
        rb = raw.shape[1]
        X = torch.from_numpy(rng.standard_normal((3, n)).astype(np.float32)).to(dev)
        offs = torch.tensor([0, rows * rb, 0], dtype=torch.int64, device=dev)  # matrix 0, 1, 0
        ref = refs.gemv_reference(pool, offs, X, q, rows, n)
        for cfg in configs + (None,):  # None: the launch tables' settings (kernel_select)
            Y = tg.gemv(pool, offs, X, q, rows, n, cfg, act="f32")
            err = ((Y - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (name, rows, n, cfg, err)
        X3 = X[:3] if not big else torch.from_numpy(rng.standard_normal((7, n)).astype(np.float32)).to(dev)
        Y = tg.matmul(pool[: rows * rb].view(rows, rb), X3, q, rows, n, configs[1], act="f32")
        ref = refs.gemv_reference(pool, torch.zeros(len(X3), dtype=torch.int64, device=dev), X3, q, rows, n)
        err = ((Y - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (name, rows, n, "matmul", err)
        print(name, rows, n, f"{err:.1e}", flush=True)
print("ok")
"""


def test_triton_gemv_matches_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    assert run_script(SCRIPT, ["cpu", "small"], env).strip().endswith("ok")


@pytest.mark.cuda
def test_triton_gemv_matches_reference_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    assert run_script(SCRIPT, ["cuda", "big"], dict(os.environ)).strip().endswith("ok")
