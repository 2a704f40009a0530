"""Where an eager one-token device step goes (an architecture without the CUDA-graph step, e.g. gpt-oss):
cProfile of a few decode steps on a placement, sorted by own time, with the step's median wall time.

  PYTHONPATH=. python3 labs/eager_step_profile.py F [--vram 30] [--moe resident] [--steps 8]
"""

import argparse
import cProfile
import pstats
import time

import torch

from engine.api import LoadOptions, Session
from engine.plan import DeviceProfile, PlanRequest

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--vram", type=float, default=30)
ap.add_argument("--moe", default="resident")
ap.add_argument("--steps", type=int, default=8)
a = ap.parse_args()
with Session.load(a.model, LoadOptions(n_ctx=256, device="cuda")) as s:
    p = s.plan(PlanRequest(ctx=256, moe=a.moe), DeviceProfile(vram_bytes=int(a.vram * 2**30)))
    s.apply(p)
    print(p.moe_mode, p.n_gpu_layers, flush=True)
    toks = list(range(100, 116))
    s.logits(toks, batch=True)
    ts = []
    pr = cProfile.Profile()
    for t in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if t >= 2:
            pr.enable()
        s.model.forward([200 + t], len(toks) + t, s.cache)
        torch.cuda.synchronize()
        pr.disable()
        ts.append(time.perf_counter() - t0)
    print("step ms", [round(x * 1e3, 1) for x in ts], flush=True)
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
