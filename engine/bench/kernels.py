"""Kernel benchmark: achieved GB/s of the CPU GEMV kernels against this machine's read bandwidth.

Workloads (numbers follow the synthetic qwen3moe of docs/benchmarks.md):

* ``bandwidth``: a numba parallel sum over a 1 GiB float32 array, best of several runs.
* ``experts``: one decode step of routed experts — K = 8 experts of gate + up [768, 2048] and
  down [2048, 768], taken from stacks of 64 experts through ``moe_ffn``. Each repetition uses
  8 experts the previous 7 did not, cycling through all 64, so the bytes come from DRAM.
* ``trunk``: one [4096, 2048] GEMV; enough copies of the matrix are cycled that the working set
  exceeds ``min_working_set`` bytes (so it is not served from cache either).

* ``1-core compute``: one thread on an L2-resident [256, 2048] matrix, in thread CPU time:
  the rate the kernel's arithmetic allows, i.e. its headroom over the memory system.

GB/s counts weight bytes read (the quantized blocks; scale side arrays and activations are
not counted). Times are medians over repetitions after a warm-up, taken in three rounds; the
lowest round median is reported (robust to a neighbour's burst on a shared machine).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import numba
import numpy as np
from numba import njit, prange

from engine.kernels.dispatch import gemv_acts, matvec, prepare_activations
from engine.kernels.moe import moe_ffn
from engine.kernels.prepare import PreparedWeight, prepare_weight
from engine.kernels.simd import hsum_f32, load_f32x8, vadd, zero_f32
from engine.kernels.testing import random_weight
from engine.quant.formats import WEIGHT_TYPES, QType, block_format

EXPERTS, EXPERT_FF, HIDDEN, TOP_K = 64, 768, 2048, 8
TRUNK_ROWS = 4096


@njit(cache=True, nogil=True, parallel=True)
def _read_sum(a, nchunks):
    """Sum of a float32 [n] array (n a multiple of 32·nchunks), read once, lane-wise."""
    part = np.zeros(nchunks, np.float32)
    ch = a.shape[0] // nchunks
    for c in prange(nchunks):
        a0 = zero_f32()
        a1 = zero_f32()
        a2 = zero_f32()
        a3 = zero_f32()
        for o in range(c * ch, (c + 1) * ch, 32):
            a0 = vadd(a0, load_f32x8(a, o))
            a1 = vadd(a1, load_f32x8(a, o + 8))
            a2 = vadd(a2, load_f32x8(a, o + 16))
            a3 = vadd(a3, load_f32x8(a, o + 24))
        part[c] = hsum_f32(vadd(vadd(a0, a1), vadd(a2, a3)))
    return part.sum()


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> dict:
    """Read bandwidth with the current numba thread count: {'best_gbs', 'median_gbs', 'bytes'}."""
    nchunks = 64 * numba.get_num_threads()
    n = nbytes // 4 // (32 * nchunks) * (32 * nchunks)
    a = np.ones(n, np.float32)
    _read_sum(a, nchunks)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _read_sum(a, nchunks)
        times.append(time.perf_counter() - t)
    return {"bytes": a.nbytes, "best_gbs": a.nbytes / min(times) / 1e9, "median_gbs": a.nbytes / np.median(times) / 1e9}


@dataclass
class KernelResult:
    qtype: str
    variant: str  # "q8" (activations rounded as llama.cpp) or "exact"
    experts_ms: float  # median time of one decode step's routed experts (8 × gate, up, down)
    experts_gbs: float
    trunk_ms: float  # median time of one [4096, 2048] GEMV
    trunk_gbs: float
    disturbed: bool  # median > 1.5 × fastest: other work shared the cores, rerun when quiet
    core_gbs: float = 0.0  # one core, weights in L2, CPU time: the rate compute alone allows


def _times(fn, reps: int, warmup: int = 2, rounds: int = 3) -> tuple[float, float]:
    """(median of the least disturbed round, fastest call) in seconds of ``fn(i)``.

    ``reps`` calls after ``warmup`` are split into ``rounds`` rounds; on a machine shared with
    other work a round that a neighbour's burst hit has a visibly higher median, so the lowest
    round median is the robust figure (a plain median when ``rounds`` is 1).
    """
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        fn(warmup + i)
        times.append(time.perf_counter() - t)
    per = max(1, reps // max(1, rounds))
    medians = [float(np.median(times[r : r + per])) for r in range(0, reps - per + 1, per)]
    return min(medians), float(np.min(times))


def _bench_experts(
    qtype: QType, q8_act: bool, reps: int, rng: np.random.Generator, shape: tuple[int, int, int, int]
) -> tuple[tuple, int]:
    """(median, fastest) seconds of one decode step's routed experts, and the weight bytes it reads."""
    E, F, D, K = shape
    gate = prepare_weight(qtype, random_weight(qtype, (E, F, D), rng))
    up = prepare_weight(qtype, random_weight(qtype, (E, F, D), rng))
    down = prepare_weight(qtype, random_weight(qtype, (E, D, F), rng))
    x = rng.standard_normal(D, dtype=np.float32)
    order = rng.permutation(E)
    wts = np.full(K, 1.0 / K, np.float32)

    def step(i: int) -> None:  # K experts the previous steps did not touch, cycling through all E
        ids = order[(np.arange(K) + K * i) % E]
        moe_ffn(gate, up, down, x, ids, wts, q8_act=q8_act)

    return _times(step, reps), K * (gate.nbytes + up.nbytes + down.nbytes) // E


def _bench_trunk(
    qtype: QType, q8_act: bool, reps: int, rng: np.random.Generator, min_working_set: int, rows: int, n: int
) -> tuple[tuple, int]:
    """(median, fastest) seconds of one [rows, n] GEMV over copies cycled past the caches; bytes."""
    one = block_format(qtype).row_bytes(n) * rows
    copies = max(1, -(-min_working_set // one))
    w = prepare_weight(qtype, random_weight(qtype, (copies * rows, n), rng))
    mats = [
        PreparedWeight(qtype, (rows, n), w.raw[c * rows : (c + 1) * rows], w.scales[c * rows : (c + 1) * rows])
        for c in range(copies)
    ]
    x = rng.standard_normal(n, dtype=np.float32)
    return _times(lambda i: matvec(mats[i % copies], x, q8_act=q8_act), reps), one


def compute_rate(qtype: QType, *, q8_act: bool, rows: int = 256, n: int = HIDDEN, reps: int = 50) -> float:
    """GB/s of weights one thread's GEMV consumes when memory is not the limit (L2-resident
    [rows, n] matrix, thread CPU time, best of 5): the compute ceiling per core."""
    rng = np.random.default_rng(1)
    w = prepare_weight(qtype, random_weight(qtype, (rows, n), rng))
    x = rng.standard_normal(n, dtype=np.float32)
    acts = prepare_activations(qtype, x[None], q8_act=q8_act)
    idx = np.arange(rows, dtype=np.int64)
    zeros = np.zeros(rows, np.int64)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        gemv_acts(w, acts, idx, zeros, q8_act=q8_act)
        best = float("inf")
        for _ in range(5):
            t = time.thread_time()
            for _ in range(reps):
                gemv_acts(w, acts, idx, zeros, q8_act=q8_act)
            best = min(best, (time.thread_time() - t) / reps)
    finally:
        numba.set_num_threads(threads)
    return w.nbytes / best / 1e9


def bench_type(
    qtype: QType,
    *,
    q8_act: bool,
    reps: int = 40,
    min_working_set: int = 512 << 20,
    seed: int = 0,
    experts: tuple[int, int, int, int] = (EXPERTS, EXPERT_FF, HIDDEN, TOP_K),
    trunk: tuple[int, int] = (TRUNK_ROWS, HIDDEN),
) -> KernelResult:
    """Time one weight type on the expert (E, F, D, K) and trunk (rows, n) workloads."""
    rng = np.random.default_rng(seed)
    (t_exp, f_exp), exp_bytes = _bench_experts(qtype, q8_act, reps, rng, experts)
    (t_trunk, f_trunk), trunk_bytes = _bench_trunk(qtype, q8_act, reps, rng, min_working_set, *trunk)
    return KernelResult(
        qtype.name,
        "q8" if q8_act else "exact",
        t_exp * 1e3,
        exp_bytes / t_exp / 1e9,
        t_trunk * 1e3,
        trunk_bytes / t_trunk / 1e9,
        t_exp > 1.5 * f_exp or t_trunk > 1.5 * f_trunk,
        compute_rate(qtype, q8_act=q8_act),
    )


def machine_info() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu": model, "cores": os.cpu_count(), "threads": numba.get_num_threads(), "loadavg": load}


def run(types: list[QType] | None = None, variants: tuple[bool, ...] = (True, False), reps: int = 40) -> dict:
    """The whole benchmark as plain data: machine, bandwidth and one KernelResult per (type, variant)."""
    info = machine_info()
    bw = measure_bandwidth()
    results = []
    for q in types or list(WEIGHT_TYPES):
        for q8 in variants:
            results.append(asdict(bench_type(QType(q), q8_act=q8, reps=reps)))
    return {"machine": info, "bandwidth": bw, "results": results}


def format_table(report: dict) -> str:
    bw = report["bandwidth"]["best_gbs"]
    m = report["machine"]
    lines = [
        f"CPU: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; load {m['loadavg'][0]:.2f}",
        f"read bandwidth: {bw:.1f} GB/s best, {report['bandwidth']['median_gbs']:.1f} GB/s median",
        "",
        f"{'type':<6} {'variant':<7} {'experts ms':>10} {'GB/s':>6} {'of bw':>6}   {'trunk ms':>8} {'GB/s':>6} "
        f"{'of bw':>6}   {'1-core compute GB/s':>19}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['qtype']:<6} {r['variant']:<7} {r['experts_ms']:>10.3f} {r['experts_gbs']:>6.1f} "
            f"{r['experts_gbs'] / bw:>6.0%}   {r['trunk_ms']:>8.3f} {r['trunk_gbs']:>6.1f} {r['trunk_gbs'] / bw:>6.0%}"
            f"   {r.get('core_gbs', 0.0):>19.1f}" + ("   (disturbed)" if r["disturbed"] else "")
        )
    if any(r["disturbed"] for r in report["results"]):
        lines.append("(disturbed: median > 1.5 × fastest run; other work shared the cores, rerun when quiet)")
    return "\n".join(lines)
