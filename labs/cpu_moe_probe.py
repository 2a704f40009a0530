"""Where one token's CPU routed experts spend their time on a many-core box (the 12 GiB placement's hot
path): numba's threading layer, the cost of an empty parallel region, and the fused kernels' pieces
(quantize x, gate/up + SiLU + quantize h, down + weighted sum) for Qwen3-30B-A3B's expert shape with
Q4_K gate/up and Q4_K or Q6_K down, against the machine's read bandwidth. Experts cycle through the
stacks, so the bytes come from DRAM. Then whether torch captures pinned host copies in a CUDA graph.

  PYTHONPATH=. python3 labs/cpu_moe_probe.py

Results (H100 box, 16 cores, 2026-11-22, 0f94f2c): docs/benchmarks-gpu.md, "The 12 GiB placement as CUDA-graph
segments".
"""

import time

import numba
import numpy as np
import torch
from numba import njit, prange

from engine.bench.kernels import measure_bandwidth
from engine.kernels.moe import moe_ffn
from engine.kernels.moe_fused import moe_down_q8, moe_gate_up_q8, quantize_for
from engine.kernels.prepare import prepare_weight
from engine.kernels.testing import random_weight
from engine.quant.formats import QType

E, F, D, K = 64, 768, 2048, 8
REPS = 300


@njit(parallel=True, nogil=True)
def _empty(out):
    for i in prange(out.shape[0]):
        out[i] = i


def med_us(fn, reps: int = REPS) -> float:
    for i in range(5):
        fn(i)
    t = []
    for i in range(reps):
        a = time.perf_counter()
        fn(i)
        t.append(time.perf_counter() - a)
    return float(np.median(t)) * 1e6


def main() -> None:
    full = numba.get_num_threads()
    for t in sorted({full, max(1, full * 3 // 4), max(1, full // 2)}, reverse=True):
        numba.set_num_threads(t)
        experts(t)
    numba.set_num_threads(full)
    graph_copies()


def experts(threads: int) -> None:
    bw = measure_bandwidth()["best_gbs"]
    out = np.zeros(numba.get_num_threads() * 4)
    _empty(out)
    print(f"threads {numba.get_num_threads()}, layer {numba.threading_layer()}, read bw {bw:.1f} GB/s", flush=True)
    print(f"empty parallel region: {med_us(lambda i: _empty(out)):.1f} us", flush=True)
    rng = np.random.default_rng(0)
    gate = prepare_weight(QType.Q4_K, random_weight(QType.Q4_K, (E, F, D), rng))
    up = prepare_weight(QType.Q4_K, random_weight(QType.Q4_K, (E, F, D), rng))
    x = rng.standard_normal(D, dtype=np.float32)
    w = np.full(K, 1 / K, np.float32)
    order = rng.permutation(E)

    def ids(i):
        return np.ascontiguousarray(order[(np.arange(K) + K * i) % E], dtype=np.int64)

    for dt in (QType.Q4_K, QType.Q6_K):
        down = one_down(dt, gate, up, x, w, ids, bw, rng)
    hot = med_us(lambda i: moe_ffn(gate, up, down, x, ids(0), w, q8_act=True))
    print(f"the same experts every call (bytes from the caches where they fit): {hot:.0f} us", flush=True)


def one_down(dt, gate, up, x, w, ids, bw, rng):
    """Time the pieces with a down stack of type ``dt``; returns the stack."""
    down = prepare_weight(dt, random_weight(dt, (E, D, F), rng))
    nbytes = K * (gate.nbytes + up.nbytes + down.nbytes) // E
    gu_bytes = K * (gate.nbytes + up.nbytes) // E
    qx = quantize_for(int(QType.Q4_K), x[None])
    t_q = med_us(lambda i: quantize_for(int(QType.Q4_K), x[None]))
    t_gu = med_us(lambda i: moe_gate_up_q8(12, gate.raw, gate.scales, up.raw, up.scales, ids(i), *qx, F, int(dt)))
    _, *qh = moe_gate_up_q8(12, gate.raw, gate.scales, up.raw, up.scales, ids(0), *qx, F, int(dt))
    t_d = med_us(lambda i: moe_down_q8(int(dt), down.raw, down.scales, ids(i), w, *qh, D))
    t_all = med_us(lambda i: moe_ffn(gate, up, down, x, ids(i), w, q8_act=True))
    t_ids = med_us(lambda i: ids(i))
    floor = nbytes / (bw * 1e3)
    print(
        f"down {dt.name}: whole call {t_all:.0f} us = {nbytes / t_all / 1e3:.1f} GB/s ({nbytes / t_all / 1e3 / bw:.0%}); "
        f"read floor {floor:.0f} us | quantize x {t_q:.1f}, gate/up {t_gu - t_ids:.0f} "
        f"({gu_bytes / (t_gu - t_ids) / 1e3:.1f} GB/s), down {t_d - t_ids:.0f} "
        f"({(nbytes - gu_bytes) / (t_d - t_ids) / 1e3:.1f} GB/s), ids {t_ids:.1f} us",
        flush=True,
    )
    return down


def graph_copies() -> None:
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        a = torch.zeros(4096, device=dev)
        h = torch.zeros(4096, pin_memory=True)
        b = torch.zeros(4096, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            (a + 1).sum()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                c = a * 2 + 1
                h.copy_(c, non_blocking=True)
                b.copy_(h, non_blocking=True)
            a.fill_(3.0)
            g.replay()
            torch.cuda.synchronize()
            print(f"pinned copies captured: D2H {h[0].item()} (7 expected), H2D {b[0].item()}", flush=True)
        except Exception as e:  # noqa: BLE001 (a probe: report what torch says)
            print(f"pinned copies in a capture: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
