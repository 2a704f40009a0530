"""Where a prompt's time goes on the product's target placement: a 12 GiB card, the whole trunk on it, the routed
experts in the GPU expert cache. Each layer's expert call is split (the device synchronized around each part):
the prompt uploads (``_upload`` of the experts with enough tokens, and the wait for them), the hits and uploaded
experts on the device (``_device_outputs``), the rare misses on the CPU (``_host_outputs``); the rest of the
prompt is the trunk (attention, norms, routing) and the hand-overs. Per prompt length: one warm run, then one
measured run of another prompt (a fresh KV cache; the expert cache as the warm run left it).
SHARPI_PROMPT_UPLOAD_MIN sets the upload threshold as in the engine.

  PYTHONPATH=. python3 packaging/gpu_labs/prompt_split.py F [PROMPTS ...]     # F: the 30B-A3B-geometry file

Measured on an H100 box (session 11, docs/benchmarks.md). The first split showed 2.1 of a 2048-token prompt's
5.9 s inside the expert calls but in none of their parts: the cache's bookkeeping in Python (a set built per
pair for the profiler, a slot looked up per pair), since done with numpy. After it (threshold 16 / 4 / 1):
  512 tokens   404 / 313 / 162 tok/s — CPU experts 0.43 s, device 0.22, uploads 0.39 (814) at 16
  2048 tokens  579 / 343 / 192 tok/s — CPU experts 1.15 s, device 0.92, uploads 0.45 (778), trunk 0.91 at 16
Lower thresholds upload more than the 60 % cache keeps (3724 / 16330 uploads for 2048 tokens): the layers
evict each other's experts within a pass.
"""

import sys
import time
from collections import defaultdict

import torch

from engine.api import LoadOptions, Session
from engine.generate.sampling import SamplingParams
from engine.plan import DeviceProfile, PlanRequest
from engine.runtime.expert_cache import CachedExperts

spent: dict[str, float] = defaultdict(float)
count: dict[str, int] = defaultdict(int)


def timed(name, fn, before=True, after=True):
    """Time calls of a CachedExperts method under ``name``, the device synchronized before and after the call
    (not for the uploads' host copies and issue, whose copies land in the wait's part)."""

    def wrapper(self, *a, **k):
        cuda = self.device.type == "cuda"
        if cuda and before:
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            if cuda and after:
                torch.cuda.synchronize(self.device)
            spent[name] += time.perf_counter() - t
            count[name] += 1

    return wrapper


# generate(max_tokens=1) runs the prompt's forward passes only: every call below is a prompt's
CachedExperts.forward = timed("expert call", CachedExperts.forward)
CachedExperts._device_outputs = timed("device experts", CachedExperts._device_outputs)
CachedExperts._host_outputs = timed("CPU experts", CachedExperts._host_outputs)
CachedExperts._upload = timed("upload (host copy, issue)", CachedExperts._upload, before=False, after=False)
CachedExperts.sync = timed("upload (wait)", CachedExperts.sync, before=False)


def main(path: str, prompts: list[int]) -> None:
    n_ctx = max(prompts) + 16
    with Session.load(path, LoadOptions(n_ctx=n_ctx, device="cuda")) as s:
        s.apply(s.plan(PlanRequest(ctx=n_ctx, kv_type="f32", n_gpu_layers=s.args.n_layer, moe="cache"),
                       DeviceProfile(vram_bytes=12 << 30)))  # fmt: skip
        print(s.applied.describe(), flush=True)
        for n in prompts:
            for label, a in (("warm", 7), ("measured", 11)):  # another prompt after the warm one
                ids = [(a * i) % 5000 + 10 for i in range(n)]
                s.reset()
                spent.clear()
                count.clear()
                t = time.perf_counter()
                *_, last = s.generate(prompt_ids=ids, params=SamplingParams.greedy(max_tokens=1))
                total = time.perf_counter() - t
                if label == "warm":
                    continue
                calls = spent["expert call"]
                parts = ", ".join(f"{k} {v:.2f} s ({count[k]})" for k, v in sorted(spent.items()) if k != "expert call")
                print(f"prompt {n}: {total:.2f} s ({last.prompt_tok_s:.1f} tok/s); expert calls {calls:.2f} s: {parts}; "
                      f"trunk and the rest {total - calls:.2f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [512, 2048])
