"""Quantized weights for the Triton kernel tests (imported by their subprocess scripts)."""

from __future__ import annotations

import numpy as np
import torch

from engine.quant import quantize
from engine.quant.formats import block_format


def blocks(q, rows: int, n: int, dev, gen: np.random.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes] of ggml type ``q`` on ``dev``: quantized Gaussians
    (engine.quant.quantize) for small shapes; for big ones random block bytes with random
    realistic scale fields (numpy quantization of trunk-sized matrices takes minutes)."""
    if rows * n <= 1 << 18:
        return torch.from_numpy(quantize(gen.standard_normal((rows, n)).astype(np.float32) / np.sqrt(n), q)).to(dev)
    f = block_format(q)
    raw = torch.from_numpy(gen.integers(0, 256, rows * f.row_bytes(n), dtype=np.uint8)).to(dev).view(-1, f.type_size)
    d = torch.from_numpy((gen.random(raw.shape[0]) + 0.5).astype(np.float16) / np.float16(30 * np.sqrt(n))).to(dev)
    at = {"Q6_K": (208,)}.get(q.name, (0, 2) if q.name in ("Q4_K", "Q5_K") else (0,))
    for o in at:
        raw[:, o : o + 2] = d.view(torch.uint8).view(-1, 2)
    return raw.reshape(rows, -1)
