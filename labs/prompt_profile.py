"""Where a prompt's time goes with the whole model resident on the GPU (``--vram 30GiB --moe resident``): one
prompt's forward pass (last position's logits only, as generation runs it) timed wall-clock, then run under
torch.profiler (CPU and CUDA activity), its CUDA kernels grouped by name — µs and launches a prompt, largest
first — and the sum of kernel time against the wall time (the gap is the host: Python, launches, syncs).

    PYTHONPATH=. python3 labs/prompt_profile.py F [--tokens 512] [--vram 30] [--ops torch] [--no-profile]

--ops torch runs the device layers on TorchOps (the reference ops) instead of FusedTorchOps, for an A/B.

Results: docs/benchmarks-gpu.md, "A prompt with everything on the GPU".
"""

import argparse
import collections
import statistics
import time

import numpy as np
import torch

from engine.api import LoadOptions, Session
from engine.plan import DeviceProfile, PlanRequest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vram", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ops", choices=("fused", "torch"), default="fused")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="the host's Python time by function (cProfile) instead")
    a = ap.parse_args()
    if a.ops == "torch":
        import engine.models.blocks as blocks
        from engine.models.ops import TorchOps

        blocks.FusedTorchOps = TorchOps
    T, n_ctx = a.tokens, a.tokens + 64
    with Session.load(a.path, LoadOptions(n_ctx=n_ctx, device="cuda")) as s:
        p = s.plan(PlanRequest(ctx=n_ctx, n_gpu_layers=s.args.n_layer, moe="resident"),
                   DeviceProfile(vram_bytes=a.vram << 30, reserve_bytes=0))  # fmt: skip
        s.apply(p)
        rng = np.random.default_rng(0)
        V = s.model.args.n_vocab if hasattr(s.model.args, "n_vocab") else 100000
        prompts = [rng.integers(100, min(V, 100000), T).tolist() for _ in range(a.reps + 2)]

        def run(ids):
            s.reset()
            s.model.forward(ids, 0, s.cache, all_logits=False)
            torch.cuda.synchronize()

        run(prompts[0])
        run(prompts[1])
        walls = []
        for ids in prompts[2:]:
            t = time.perf_counter()
            run(ids)
            walls.append((time.perf_counter() - t) * 1e3)
        wall = statistics.median(walls)
        print(f"[{a.ops} ops] {T}-token prompt, {s.args.n_layer} layers: wall {wall:.1f} ms ({T / wall * 1e3:.0f} tok/s); runs "
              + ", ".join(f"{w:.1f}" for w in walls), flush=True)  # fmt: skip
        if a.no_profile:
            return
        if a.cprofile:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            run(prompts[2])
            pr.disable()
            st = pstats.Stats(pr)
            st.sort_stats("tottime").print_stats(35)
            st.sort_stats("cumulative").print_stats(40)
            return
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            run(prompts[2])
        tot, cnt = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.name if len(e.name) < 100 else e.name[:97] + "..."
                tot[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                cnt[name] += 1
        k = sum(tot.values()) / 1e3
        print(f"kernel time {k:.1f} ms ({k / wall:.0%} of the wall), {sum(cnt.values())} launches", flush=True)
        for name, us in tot.most_common(45):
            print(f"{us / 1e3:8.2f} ms {us / 1e3 / k:5.1%} {cnt[name]:6d}x  {name}", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)


if __name__ == "__main__":
    main()
