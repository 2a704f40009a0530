"""Data for the Triton kernel tests (tests/triton and the graph tests): quantized weights, expert pools,
routing cases; and die_with_parent for a test that starts a child interpreter."""

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
    if q.name == "MXFP4":  # an e8m0 exponent near 2^-5 (2^(e-128)), not a random one
        raw[:, 0] = torch.from_numpy(gen.integers(120, 124, raw.shape[0], dtype=np.uint8)).to(dev)
        return raw.reshape(rows, -1)
    at = {"Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}.get(q.name, (0, 2) if q.name in ("Q4_K", "Q5_K") else (0,))
    for o in at:
        raw[:, o : o + 2] = d.view(torch.uint8).view(-1, 2)
    return raw.reshape(rows, -1)


def expert_pool(types, F: int, D: int, E: int, dev, gen: np.random.Generator):
    """E slots of gate [F, D] | up [F, D] | down [D, F] of ggml types ``types`` (each role 256-byte
    aligned, :func:`blocks` data) -> (pool uint8 [E, stride] on ``dev``, stride, roles
    {"gate"|"up"|"down": (byte offset in a slot, qtype, rows, n)})."""
    per = dict(zip(("gate", "up", "down"), ((types[0], F, D), (types[1], F, D), (types[2], D, F))))
    roles, o = {}, 0
    for r, (q, rows, n) in per.items():
        roles[r] = (o, q, rows, n)
        o += -(-rows * block_format(q).row_bytes(n) // 256) * 256
    pool = torch.zeros((E, o), dtype=torch.uint8, device=dev)
    for e in range(E):
        for r, (q, rows, n) in per.items():
            raw = blocks(q, rows, n, dev, gen).reshape(-1)
            pool[e, roles[r][0] : roles[r][0] + raw.numel()] = raw
    return pool, o, roles


def die_with_parent() -> None:
    """``preexec_fn`` for a test's child interpreter: on Linux the kernel kills it when the pytest process
    dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) — a pytest stopped by ``timeout`` on the GPU machine once
    left a CUDA script running that slowed the next benchmark. Elsewhere: nothing."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def routing_case(T: int, K: int, E: int, D: int, stride: int, dev, gen: np.random.Generator):
    """T tokens routed to K of E slots: (slot_off int64 [T, K] byte offsets, with pair (1, 0) a
    miss (−1) when T > 1; x float32 [T, D]; weights float32 [T, K]) on ``dev``."""
    ids = torch.from_numpy(np.stack([gen.permutation(E)[:K] for _ in range(T)])).to(dev)
    slot_off = ids * stride
    if T > 1:
        slot_off[1, 0] = -1  # a miss: served elsewhere, skipped by the kernels
    x = torch.from_numpy(gen.standard_normal((T, D)).astype(np.float32)).to(dev)
    w = torch.from_numpy(gen.random((T, K)).astype(np.float32)).to(dev)
    return slot_off, x, w
