"""What the GPU time of one decode step is made of: the captured CUDA graph of a file (whole trunk and every
expert resident) replayed under torch.profiler (CUPTI), its kernels grouped by name — launches and µs per
step, largest first — so the share of the quantized matrices against the glue (attention, norms, routing,
copies) shows.

  PYTHONPATH=. python3 packaging/gpu_labs/step_profile.py /tmp/qwen3-30b-a3b-random.gguf [--exact-float]
"""

import collections
import sys

import torch
from step_replay import resident_session  # the script's own folder is on sys.path

REPS = 20


def main(path: str, q8_act: bool) -> None:
    with resident_session(path, q8_act) as s:
        L = s.args.n_layer
        s.logits(list(range(1, 9)), batch=False)  # captures the bucket of positions 0..15
        g = s.model.decode_graph
        bucket = min(g.graphs)
        for _ in range(5):
            g.replay(bucket)
        torch.cuda.synchronize()
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
