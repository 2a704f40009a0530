"""What the GPU time of one decode step is made of: the captured CUDA graph of a file (whole trunk and every
expert resident) replayed under torch.profiler (CUPTI), its kernels grouped by name — launches and µs per
step, largest first — so the share of the quantized matrices against the glue (attention, norms, routing,
copies) shows.

  PYTHONPATH=. python3 labs/step_profile.py /tmp/qwen3-30b-a3b-random.gguf [--exact-float]

Results (H100 box, 2026-11-22, 04e3977 and f43ccfb): docs/benchmarks-gpu.md, "The decode step".
"""

import collections
import contextlib
import sys
import time

import torch

from engine.api import LoadOptions, Session
from engine.plan import DeviceProfile, PlanRequest

REPS = 20


@contextlib.contextmanager
def resident_session(path: str, q8_act: bool = True, n_ctx: int = 96):
    """The file loaded on CUDA with the whole trunk and every expert resident (a 30 GiB budget), f32 KV."""
    with Session.load(path, LoadOptions(n_ctx=n_ctx, device="cuda", q8_act=q8_act)) as s:
        p = s.plan(PlanRequest(ctx=n_ctx, kv_type="f32", n_gpu_layers=s.args.n_layer, moe="resident"),
                   DeviceProfile(vram_bytes=30 << 30, reserve_bytes=0))  # fmt: skip
        s.apply(p)
        yield s


def main(path: str, q8_act: bool) -> None:
    with resident_session(path, q8_act) as s:
        L = s.args.n_layer
        s.logits(list(range(1, 9)), batch=False)  # captures the bucket of positions 0..15
        g = s.model.decode_graph
        bucket = min(g.graphs)
        for _ in range(5):
            g.replay(bucket)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(REPS):
            g.replay(bucket)
        torch.cuda.synchronize()
        print(f"graph replay wall time {(time.perf_counter() - t0) / REPS * 1e6:.0f} us a step", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                g.replay(bucket)
            torch.cuda.synchronize()
        tot, cnt = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.name if len(e.name) < 90 else e.name[:87] + "..."
                tot[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                cnt[name] += 1
        step = sum(tot.values()) / REPS
        print(f"{L} layers, {'default' if q8_act else 'exact-float'}: kernel time {step:.0f} us a step, "
              f"{sum(cnt.values()) / REPS:.0f} launches", flush=True)  # fmt: skip
        for name, us in tot.most_common(40):
            print(f"{us / REPS:8.1f} us {us / REPS / step:5.1%} {cnt[name] / REPS:6.0f}x  {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--exact-float" not in sys.argv)
