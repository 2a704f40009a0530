"""The GPU time of one decode step alone: the captured CUDA graph of the Qwen3-30B-A3B-geometry file (whole
trunk and every expert resident) replayed back to back, timed with CUDA events — no host copies, syncs or
route bookkeeping between steps, so the figure does not move with the host's noise the way `sharpi bench`'s
tok/s does on a shared machine. Default session (activations rounded like llama.cpp: q8 kernels in graphs)
against --exact-float, alternating.

  PYTHONPATH=. python3 labs/step_replay.py /tmp/qwen3-30b-a3b-random.gguf [ROUNDS]

Results (H100 boxes, 2026-11-22, 23b3d83 to f43ccfb): docs/benchmarks-gpu.md, "The decode step".
"""

import contextlib
import sys

import numpy as np
import torch

from engine.api import LoadOptions, Session
from engine.plan import DeviceProfile, PlanRequest


@contextlib.contextmanager
def resident_session(path: str, q8_act: bool = True, n_ctx: int = 96):
    """The file loaded on CUDA with the whole trunk and every expert resident (a 30 GiB budget), f32 KV."""
    with Session.load(path, LoadOptions(n_ctx=n_ctx, device="cuda", q8_act=q8_act)) as s:
        p = s.plan(PlanRequest(ctx=n_ctx, kv_type="f32", n_gpu_layers=s.args.n_layer, moe="resident"),
                   DeviceProfile(vram_bytes=30 << 30, reserve_bytes=0))  # fmt: skip
        s.apply(p)
        yield s


def step_us(path: str, q8_act: bool, reps: int = 200) -> float:
    with resident_session(path, q8_act) as s:
        s.logits(list(range(1, 9)), batch=False)  # captures the bucket of positions 0..15
        g = s.model.decode_graph
        bucket = min(g.graphs)
        for _ in range(10):
            g.replay(bucket)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            g.replay(bucket)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / reps


if __name__ == "__main__":
    path, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    got = {True: [], False: []}
    for _ in range(rounds):
        for q8 in (True, False):
            got[q8].append(step_us(path, q8))
            print(f"{'default' if q8 else 'exact-float'}: {got[q8][-1]:.0f} us a step", flush=True)
    d, e = np.median(got[True]), np.median(got[False])
    print(f"median: default {d:.0f} us ({1e6 / d:.0f} tok/s GPU-bound), exact-float {e:.0f} us ({1e6 / e:.0f}); "
          f"{e / d:.2f}x", flush=True)  # fmt: skip
