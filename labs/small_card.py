"""Decode on the product's target placement — a 12 GiB card, the whole trunk on it, the routed experts on
the CPU (``cpu``) or in the GPU expert cache with misses on the CPU (``cache``) — eager (``SHARPI_CUDA_GRAPH=0``)
against the segmented CUDA-graph step (the default: the trunk between two MoE layers as one graph replay,
the experts through their backend between replays). Greedy, 16-token prompt, GEN generated, after one
warm run (graph captures, first touches, the cache's warm-up); per run, the share of a token spent in the
expert backend's calls (the CPU kernels; the cache's forward).

  PYTHONPATH=. python3 labs/small_card.py /tmp/qwen3-30b-a3b-random.gguf [ROUNDS] [--threads]

Results (H100 boxes, 2026-11-22, cabcf91 to 96e162a): docs/benchmarks-gpu.md, "The 12 GiB placement as CUDA-graph
segments".
"""

import cProfile
import io
import os
import pstats
import sys
import time

import numba
import numpy as np

from engine.api import LoadOptions, Session
from engine.experts import CpuExperts
from engine.generate.sampling import SamplingParams
from engine.plan import DeviceProfile, PlanRequest
from engine.runtime.expert_cache import CachedExperts

PROMPT, GEN = 16, 32
spent = {"s": 0.0, "calls": 0}


def timed(fn):
    """Time the one-token calls of an expert backend method (self, layer, x, ...)."""

    def wrapper(*a, **k):
        if a[2].shape[0] != 1:
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent["s"] += time.perf_counter() - t
            spent["calls"] += 1

    return wrapper


CpuExperts.forward_rows = timed(CpuExperts.forward_rows)
CachedExperts.forward = timed(CachedExperts.forward)
CachedExperts.host_misses = timed(CachedExperts.host_misses)  # the graph step's cache layers


def run(s) -> tuple[float, float]:
    """(decode tok/s, ms a token in the expert backend's one-token calls) of one greedy run."""
    s.reset()
    spent.update(s=0.0, calls=0)
    *_, last = s.generate(prompt_ids=list(range(1, PROMPT + 1)), params=SamplingParams.greedy(max_tokens=GEN))
    steps = max(spent["calls"] / s.args.n_layer, 1)
    return last.decode_tok_s, spent["s"] / steps


def main(path: str, rounds: int) -> None:
    n_ctx = PROMPT + GEN + 16
    with Session.load(path, LoadOptions(n_ctx=n_ctx, device="cuda")) as s:
        for moe in ("cpu", "cache"):
            for graph in ("0", "1"):
                os.environ["SHARPI_CUDA_GRAPH"] = graph
                p = s.plan(PlanRequest(ctx=n_ctx, kv_type="f32", n_gpu_layers=s.args.n_layer, moe=moe),
                           DeviceProfile(vram_bytes=12 << 30))  # fmt: skip
                s.apply(p)
                run(s)  # warm: captures, first touches, the cache fills
                got = [run(s) for _ in range(rounds)]
                tps = [t for t, _ in got]
                med = float(np.median(tps))
                exp_ms = float(np.median([e for _, e in got])) * 1e3
                print(f"{moe:5s} graphs={graph}: {' / '.join(f'{t:.2f}' for t in tps)} tok/s (median {med:.2f} = "
                      f"{1e3 / med:.1f} ms a token); expert backend ~{exp_ms:.1f} ms a token; "
                      f"{s.applied.describe()}", flush=True)  # fmt: skip
        # The CPU-experts graph step again: numba thread counts (memory-bound kernels on SMT cores), then
        # a profile of the host's time.
        os.environ["SHARPI_CUDA_GRAPH"] = "1"
        s.apply(s.plan(PlanRequest(ctx=n_ctx, kv_type="f32", n_gpu_layers=s.args.n_layer, moe="cpu"),
                       DeviceProfile(vram_bytes=12 << 30)))  # fmt: skip
        run(s)
        full = numba.get_num_threads()
        for t in sorted({max(1, full // 2), full}) if "--threads" in sys.argv else ():
            numba.set_num_threads(t)
            got = [run(s) for _ in range(rounds)]
            print(f"cpu graphs=1, {t} numba threads: {' / '.join(f'{a:.2f}' for a, _ in got)} tok/s; expert backend "
                  f"{' / '.join(f'{e * 1e3:.1f}' for _, e in got)} ms a token", flush=True)  # fmt: skip
        numba.set_num_threads(full)
        pr = cProfile.Profile()
        pr.enable()
        run(s)
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
        print(out.getvalue()[-5000:], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 2)
