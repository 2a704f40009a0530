"""What the segmented CUDA-graph step costs when a bucket is first reached: the 12 GiB placement with
the experts on the CPU (49 graphs a bucket for the 30B-A3B geometry), a 4096-token context; for every
attention bucket, the first token there (it captures the bucket's segments) against the next one
(replays), and the device memory the captures took (free memory before and after, as the driver
reports it; the graphs' pool is not charged to the planner's arena).

  PYTHONPATH=. python3 labs/segment_capture.py /tmp/qwen3-30b-a3b-random.gguf

Results (H100 box, 2026-11-22, 3bb62f5 and 4c7de29): docs/benchmarks-gpu.md, "The 12 GiB placement as CUDA-graph
segments".
"""

import sys
import time

import torch

from engine.api import LoadOptions, Session
from engine.plan import DeviceProfile, PlanRequest
from engine.runtime.graph_decode import bucket, buckets

N_CTX = 4096


def main(path: str) -> None:
    with Session.load(path, LoadOptions(n_ctx=N_CTX, device="cuda")) as s:
        s.apply(s.plan(PlanRequest(ctx=N_CTX, kv_type="f32", n_gpu_layers=s.args.n_layer, moe="cpu"),
                       DeviceProfile(vram_bytes=12 << 30)))  # fmt: skip
        g, m, cache = s.model.decode_graph, s.model, s.cache
        print(s.applied.describe(), flush=True)
        g.capture = False  # one uncaptured step first: numba compiles, first touches of the host experts
        m.forward([5], 0, cache)
        g.capture = True
        total = 0
        for b in buckets(N_CTX):
            pos = b - 1 if b > 16 else 0
            assert bucket(pos, N_CTX) == b
            torch.cuda.synchronize()
            free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
            t = time.perf_counter()
            m.forward([7], pos, cache)
            first = time.perf_counter() - t
            torch.cuda.synchronize()
            took, reserved = free0 - torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved() - res0
            total += took
            t = time.perf_counter()
            for _ in range(3):
                m.forward([7], pos, cache)
            steady = (time.perf_counter() - t) / 3
            print(f"bucket {b:5d}: first token {first * 1e3:7.1f} ms ({len(g.graphs[b])} graphs captured), then "
                  f"{steady * 1e3:5.1f} ms; device memory {took / 2**20:7.1f} MiB, of it torch's allocator "
                  f"{reserved / 2**20:.1f} (all buckets so far "
                  f"{total / 2**20:.1f})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
