"""How the fused CPU routed-expert kernels scale with threads on a many-core box, and why a 16-core CUDA box's
`--moe cpu` decode reads its experts at about half the box's read bandwidth.

For Qwen3-30B-A3B's expert shape (8 experts of 768 x 2048, Q4_K gate/up, Q6_K down) at each thread count, with
stacks of ``--experts`` experts (default: the calibration's CPU working set, ``engine.bench.calibrate.cpu_working_set``
— 4× the last-level cache — so "cold" reads DRAM as a model's 48 layers do; 64 experts, 196 MB, fit a 300 MiB L3
and time that cache instead): the
read bandwidth (numba parallel sum), then gate/up and down alone, cold (experts cycled) and hot (the same experts
every call), in GB/s a thread. ``--variants`` runs each kernel variant in a child process with a fresh numba cache
(they are compile-time constants): ``ahead=B`` the software prefetch distance in bytes of rows
(``engine.kernels.simd.PREFETCH_AHEAD``; 0: no software prefetch at all, the hardware prefetchers alone),
``loc=L`` the prefetch's locality (``simd.PREFETCH_LOCALITY``: 3 L1, 2 L2, 0 non-temporal), ``chunk=C`` rows a
parallel work item (``moe_fused.CHUNK``); ``base`` is the product's settings. ``--schedule`` also times the kernels
with numba's parallel chunk size set (more, smaller work items a loop).

  PYTHONPATH=. python3 labs/cpu_moe_scaling.py [--threads 1,2,4,8,16] [--variants "base;ahead=0;loc=3;chunk=64"]
      [--schedule] [--experts E]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time


def med_us(fn, reps: int) -> float:
    import numpy as np

    for i in range(5):
        fn(i)
    t = []
    for i in range(reps):
        a = time.perf_counter()
        fn(i)
        t.append(time.perf_counter() - a)
    return float(np.median(t)) * 1e6


def expert_bytes() -> int:
    """One Qwen3-30B-A3B expert: Q4_K gate and up [768, 2048], Q6_K down [2048, 768]."""
    from engine.quant.formats import QType, tensor_bytes

    return 2 * tensor_bytes(QType.Q4_K, (768, 2048)) + tensor_bytes(QType.Q6_K, (2048, 768))


def child(threads: list[int], variant: str, schedule: bool, reps: int, E: int) -> None:
    import numba
    import numpy as np

    from engine.kernels import moe_fused, simd

    v = dict(kv.split("=") for kv in variant.split(",") if "=" in kv)  # before the first compile (fresh cache)
    if "ahead" in v and int(v["ahead"]) == 0:
        from numba import njit

        @njit(inline="always")
        def _no_prefetch(arr, off):
            return None

        @njit(inline="always")
        def _no_prefetch_array(arr):
            return None

        moe_fused.prefetch, moe_fused.prefetch_array = _no_prefetch, _no_prefetch_array  # read when they compile
    elif "ahead" in v:
        simd.PREFETCH_AHEAD = int(v["ahead"])
    simd.PREFETCH_LOCALITY = int(v.get("loc", simd.PREFETCH_LOCALITY))
    moe_fused.CHUNK = int(v.get("chunk", moe_fused.CHUNK))
    from engine.bench.kernels import measure_bandwidth
    from engine.kernels.moe_fused import moe_down_q8, moe_gate_up_q8, quantize_for
    from engine.kernels.prepare import prepare_weight
    from engine.bench.calibrate import last_level_cache_bytes
    from engine.kernels.testing import random_weight
    from engine.quant.formats import QType

    F, D, K = 768, 2048, 8
    rng = np.random.default_rng(0)
    gate = prepare_weight(QType.Q4_K, random_weight(QType.Q4_K, (E, F, D), rng))
    up = prepare_weight(QType.Q4_K, random_weight(QType.Q4_K, (E, F, D), rng))
    down = prepare_weight(QType.Q6_K, random_weight(QType.Q6_K, (E, D, F), rng))
    x = rng.standard_normal(D, dtype=np.float32)
    w = np.full(K, 1 / K, np.float32)
    order = rng.permutation(E)
    cold = [np.ascontiguousarray(order[(np.arange(K) + K * i) % E], dtype=np.int64) for i in range(E)]
    hot = cold[0]
    gu_bytes = K * (gate.nbytes + up.nbytes) // E
    d_bytes = K * down.nbytes // E
    qx = quantize_for(int(QType.Q4_K), x[None])
    _, *qh = moe_gate_up_q8(12, gate.raw, gate.scales, up.raw, up.scales, hot, *qx, F, 14)
    print(f"variant {variant!r}: prefetch ahead {simd.PREFETCH_AHEAD} B, locality {simd.PREFETCH_LOCALITY}, "
          f"chunk {moe_fused.CHUNK}, threading layer {numba.threading_layer()}, stacks of {E} experts "
          f"({(gate.nbytes + up.nbytes + down.nbytes) / 1e6:.0f} MB; last-level cache {last_level_cache_bytes() / 1e6:.0f} MB)",
          flush=True)  # fmt: skip
    print("threads | read GB/s (a thread) | gate/up cold us, GB/s a thread | hot | down cold | hot | chunk", flush=True)
    chunks = [0, 1, 4] if schedule else [0]
    for t in threads:
        numba.set_num_threads(t)
        bw = measure_bandwidth(nbytes=1 << 29, repeats=5)["best_gbs"]
        for cs in chunks:
            numba.set_parallel_chunksize(cs)

            def gu(ids):
                return lambda i: moe_gate_up_q8(12, gate.raw, gate.scales, up.raw, up.scales, ids(i), *qx, F, 14)

            def dn(ids):
                return lambda i: moe_down_q8(14, down.raw, down.scales, ids(i), w, *qh, D)

            r = [
                med_us(gu(lambda i: cold[i % E]), reps),
                med_us(gu(lambda i: hot), reps),
                med_us(dn(lambda i: cold[i % E]), reps),
                med_us(dn(lambda i: hot), reps),
            ]
            nb = [gu_bytes, gu_bytes, d_bytes, d_bytes]
            cells = " | ".join(f"{us:.0f} ({b / us / 1e3 / t:.2f})" for us, b in zip(r, nb))
            print(f"{t} | {bw:.1f} ({bw / t:.2f}) | {cells} | {cs}", flush=True)
        numba.set_parallel_chunksize(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    n = os.cpu_count() or 1
    ap.add_argument("--threads", default=",".join(str(t) for t in sorted({1, 2, 4, 8, n // 2, n - n // 8, n}) if t))
    ap.add_argument("--variants", default="", help='";"-separated, e.g. "base;ahead=0;loc=3;chunk=64"')
    ap.add_argument("--schedule", action="store_true")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--child-variant", default=None)
    ap.add_argument("--experts", type=int, default=0, help="experts a stack (default: the CPU working set's worth)")
    a = ap.parse_args()
    from engine.bench.calibrate import cpu_working_set

    E = a.experts or max(64, -(-cpu_working_set() // expert_bytes()))
    threads = [int(t) for t in a.threads.split(",")]
    if a.child_variant is not None or not a.variants:
        child(threads, a.child_variant or "base", a.schedule, a.reps, E)
        return
    for variant in a.variants.split(";"):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, NUMBA_CACHE_DIR=d)
            cmd = [sys.executable, __file__, "--threads", a.threads, "--reps", str(a.reps), "--child-variant", variant,
                   "--experts", str(E)]  # fmt: skip
            subprocess.run(cmd + (["--schedule"] if a.schedule else []), env=env, check=False)


if __name__ == "__main__":
    main()
