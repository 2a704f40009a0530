"""A prompt's matrix product on this CPU in each arithmetic engine.kernels.bf16 can pick: the q8
kernels (off), oneDNN's bf16 fpmath mode (fpmath), and bf16 tensors (bf16); GMAC/s, best of 5,
interleaved, with the process settings the product applies. Also says what oneDNN does under the
fpmath mode here (bf16.fpmath_rounds).

    PYTHONPATH=. python3 labs/cpu_prompt_gemm.py [T] [rows] [cols]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from engine import config, ops
from engine.kernels import bf16
from engine.kernels.prepare import prepare_weight
from engine.kernels.testing import random_weight
from engine.quant.formats import QType


def main() -> None:
    config.apply_process_settings()  # as sharpi and Session do: OpenMP pools that wake fast (GOMP_SPINCOUNT)
    T, R, n = (int(a) for a in (sys.argv[1:] + ["512", "2048", "2048"][len(sys.argv) - 1 :])[:3])
    rng = np.random.default_rng(0)
    X = rng.standard_normal((T, n), dtype=np.float32)
    print(f"fpmath rounds to bf16 here: {bf16.fpmath_rounds()}; auto mode: {bf16.detect_mode()}; T={T} R={R} n={n}")
    for q in (QType.Q4_K, QType.Q4_0, QType.Q5_K):
        w = prepare_weight(q, random_weight(q, (R, n), rng))
        best = {}
        for _ in range(6):
            for mode in (bf16.OFF, bf16.FPMATH, bf16.BF16):
                bf16.MODE = mode
                t = time.perf_counter()
                ops.matmuls((w,), X, q8_act=True)
                best[mode] = min(best.get(mode, 1e9), time.perf_counter() - t)
        print(q.name, "  ".join(f"{m}: {R * n * T / s / 1e9:6.1f} GMAC/s" for m, s in best.items()))


if __name__ == "__main__":
    main()
