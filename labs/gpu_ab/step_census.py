"""What one decode step launches and where its host time goes, on a CUDA placement: a census of the
CUDA kernels (count and GPU time by name) and of the host time (top functions by self time) for a
few greedy decode steps after a warm-up, through the public Session API only, so two commits can be
compared on one box (driver.sh runs it in trees A and B).

    PYTHONPATH=TREE python3 labs/gpu_ab/step_census.py FILE.gguf [cache|cpu|resident] [VRAM_GiB]
"""

from __future__ import annotations

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.api import LoadOptions, Session
from engine.plan import PlanRequest

STEPS = 8


def main() -> None:
    path, moe = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "cache")
    vram = int(float(sys.argv[3]) * (1 << 30)) if len(sys.argv) > 3 else 12 << 30
    req = PlanRequest(ctx=1024, moe=moe)
    opts = LoadOptions(n_ctx=1024, device="cuda", placement=req, vram_budget=vram)
    with Session.load(path, opts) as s:
        toks = [100 + 7 * i for i in range(64)]
        s.logits(toks[:40], batch=False)  # warm-up: captures the graphs of the first buckets
        t = time.perf_counter()
        s.logits(toks[:40], batch=False)
        print(f"40 steps from an empty cache: {(time.perf_counter() - t) / 40 * 1e3:.2f} ms a step")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            s.logits(toks[:STEPS], batch=False)
    kernels, gpu_us, host = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
            gpu_us[e.name] += e.device_time
        else:
            host[e.name] += e.self_cpu_time_total
    n = sum(kernels.values())
    print(f"CUDA kernels: {n / STEPS:.1f} a step, GPU {sum(gpu_us.values()) / STEPS / 1e3:.2f} ms a step")
    for name, c in kernels.most_common(25):
        print(f"  {c / STEPS:7.1f} x {gpu_us[name] / c:8.2f} us  {name[:110]}")
    print(f"host self time {sum(host.values()) / STEPS / 1e3:.2f} ms a step; top:")
    for name, us in host.most_common(20):
        print(f"  {us / STEPS / 1e3:8.3f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
