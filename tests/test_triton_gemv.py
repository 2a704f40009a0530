"""Triton quantized GEMV vs the torch dequantize-then-matmul reference (Triton's CPU interpreter
here; the same test runs compiled on a CUDA machine)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import sys, numpy as np, torch
from engine.quant import QType, quantize
from engine.runtime import triton_gemv as tg
from engine.runtime.tdequant import dequantize
dev = sys.argv[1]
rng = np.random.default_rng(0)
for name in ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
    q = QType[name]
    for rows, n in ((7, 256), (33, 512)):
        raw = np.concatenate([quantize(rng.standard_normal((rows, n)).astype(np.float32) * 0.1, q) for _ in range(2)])
        pool = torch.from_numpy(raw.reshape(-1).copy()).to(dev)
        row_bytes = raw.shape[1]
        X = torch.from_numpy(rng.standard_normal((3, n)).astype(np.float32)).to(dev)
        offs = torch.tensor([0, rows * row_bytes, 0], dtype=torch.int64, device=dev)  # expert 0, 1, 0
        Y = tg.gemv(pool, offs, X, q, rows, n)
        W = dequantize(pool.view(2 * rows, row_bytes), q, n).reshape(2, rows, n)
        ref = torch.stack([W[0] @ X[0], W[1] @ X[1], W[0] @ X[2]])
        err = (Y - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, (name, rows, n, err)
        print(name, rows, n, f"{err:.1e}")
print("ok")
"""


def _run(device: str, env: dict) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, device], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_triton_gemv_matches_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    assert _run("cpu", env).strip().endswith("ok")


@pytest.mark.cuda
def test_triton_gemv_matches_reference_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    assert _run("cuda", dict(os.environ)).strip().endswith("ok")
