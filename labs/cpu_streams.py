"""Whether the CPU expert loops' concurrent read streams cost DRAM bandwidth on a many-core box.

``moe_gate_up_q8`` walks four arrays at once a thread (gate rows, up rows, and their scales: four DRAM
streams), ``moe_down_q8`` two. This reads the same total bytes as 1, 2, 4 or 8 streams a thread — each thread
takes its share of rows and reads row r of every stream in turn, ``--row`` bytes each, as the kernels do — with
numba's parallel loop at each thread count, bytes from DRAM (default ``--gb``: the calibration's CPU working set,
``engine.bench.calibrate.cpu_working_set``, 4× the last-level cache). If four
streams read markedly slower than one, gate and up rows (and their scales) laid side by side in one stream are
the lever for the `--moe cpu` step (docs/benchmarks.md, "GPU: `--moe cpu` by pieces").

  PYTHONPATH=. python3 labs/cpu_streams.py [--threads 8,14,16] [--gb G] [--row 1152] [--reps 5]
"""

import argparse
import os
import time

import numba
import numpy as np
from numba import njit, prange

from engine.bench.calibrate import cpu_working_set
from engine.kernels.moe_fused import CHUNK  # rows a work item, as the expert kernels' parallel loops deal them


@njit(parallel=True, nogil=True)
def read_rows(a, k, words):
    """a uint64 [k, rows · words]: every stream's rows in lockstep; returns a checksum (keeps the loads)."""
    rows = a.shape[1] // words
    n = (rows + CHUNK - 1) // CHUNK
    out = np.zeros(n, np.uint64)
    for c in prange(n):
        acc = np.uint64(0)
        for r in range(c * CHUNK, min(rows, (c + 1) * CHUNK)):
            o = r * words
            for s in range(k):
                for w in range(words):
                    acc += a[s, o + w]
        out[c] = acc
    return out.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    n = os.cpu_count() or 1
    ap.add_argument("--threads", default=",".join(str(t) for t in sorted({1, n // 2, n - n // 8, n}) if t))
    ap.add_argument("--gb", type=float, default=0.0, help="GB read a pass (default: the CPU working set)")
    ap.add_argument("--row", type=int, default=1152, help="bytes of a row (Q4_K, 2,048 wide: 1,152)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    words = a.row // 8
    total = int((a.gb * 1e9) or cpu_working_set()) // (8 * 8 * words) * (8 * 8 * words)  # divisible by every stream count's rows
    print(f"{total / 1e9:.2f} GB read a pass, rows of {words * 8} B, threading layer "
          f"{numba.config.THREADING_LAYER}", flush=True)  # fmt: skip
    print("threads | " + " | ".join(f"{k} stream{'s' if k > 1 else ''} GB/s" for k in (1, 2, 4, 8)), flush=True)
    bufs = {k: np.ones((k, total // 8 // k), np.uint64) for k in (1, 2, 4, 8)}
    for t in [int(x) for x in a.threads.split(",")]:
        numba.set_num_threads(t)
        cells = []
        for k, buf in bufs.items():
            read_rows(buf, k, words)
            best = min(_timed(lambda b=buf, kk=k: read_rows(b, kk, words)) for _ in range(a.reps))
            cells.append(f"{total / best / 1e9:.1f}")
        print(f"{t} | " + " | ".join(cells), flush=True)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
