"""``sharpi bench device-kernels``: the fused Triton GEMV's GB/s against the GPU's measured
memory bandwidth and against the torch dequantize-then-matmul reference.

Workloads as in the CPU kernel bench: a trunk-sized 4096×2048 matrix, and a decode step's routed
experts (8 of 64 stacked 768×2048 gate matrices, read in place through byte offsets).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.quant.formats import QType, block_format
from engine.runtime import triton_gemv
from engine.runtime.tdequant import dequantize
from engine.synth.fill import _FIELDS


def _timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(np.median(times))


def measure_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device read+write GB/s of a large copy (counted as 2 × bytes moved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), 10)
    return 2 * nbytes / t / 1e9


def _random_blocks(qtype: QType, rows: int, n: int) -> torch.Tensor:
    f = block_format(qtype)
    blocks = np.frombuffer(np.random.default_rng(0).bytes(rows * f.row_bytes(n)), np.uint8).copy()
    blocks = blocks.reshape(-1, f.type_size)
    _FIELDS[qtype](blocks, 1.0 / np.sqrt(n))
    return torch.from_numpy(blocks.reshape(-1)).cuda()


def _workload(qtype: QType, rows: int, n: int, E: int, P: int, reps: int) -> dict:
    """P matrices [rows, n] of a stack of E, read in place through byte offsets."""
    pool = _random_blocks(qtype, E * rows, n)
    row_bytes = block_format(qtype).row_bytes(n)
    ids = torch.arange(P, dtype=torch.int64, device="cuda") * (E // P)
    offs = ids * rows * row_bytes
    X = torch.randn(P, n, device="cuda")
    W = pool.view(E * rows, row_bytes)
    fused = _timed(lambda: triton_gemv.gemv(pool, offs, X, qtype, rows, n), reps)

    def reference():
        for p in range(P):
            e = int(ids[p])
            dequantize(W[e * rows : (e + 1) * rows], qtype, n) @ X[p]

    ref = _timed(reference, max(5, reps // 5))
    nbytes = P * rows * row_bytes
    return {"fused_s": fused, "reference_s": ref, "gb_s": nbytes / fused / 1e9, "speedup": ref / fused}


def bench_type(qtype: QType, reps: int = 50) -> dict:
    return {
        "trunk": _workload(qtype, 4096, 2048, 1, 1, reps),
        "experts": _workload(qtype, 768, 2048, 64, 8, reps),
    }


def run(types=triton_gemv.SUPPORTED) -> dict:
    bw = measure_bandwidth()
    rep = {"device": torch.cuda.get_device_name(), "bandwidth_gb_s": bw, "types": {}}
    for q in types:
        r = bench_type(QType(q))
        for w in r.values():
            w["fraction"] = w["gb_s"] / bw
        rep["types"][QType(q).name] = r
    return rep
