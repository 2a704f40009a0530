"""Where a prompt's time goes on the product's target placement: a 12 GiB card, the whole trunk on it, the routed
experts in the GPU expert cache. Each layer's expert call (``CachedExperts.forward``) is timed with the device
synchronized around it, and so are its parts listed in ``PARTS``: the prompt's uploads (host copy and issue, then
the wait for them), the hits and uploaded experts on the device, the rare misses on the CPU; the rest of the
prompt is the trunk (attention, norms, routing) and the hand-overs. Per prompt length: one warm run, then one
measured run of another prompt (a fresh KV cache; the expert cache as the warm run left it).
SHARPI_PROMPT_UPLOAD_MIN sets the upload threshold as in the engine.

  PYTHONPATH=. python3 labs/prompt_split.py F [PROMPTS ...]     # F: the 30B-A3B-geometry file

Results (H100 box, 2026-11-23, 4eadf83): docs/benchmarks.md, "A prompt on the 12 GiB expert-cache placement".
"""

import sys
import time
from collections import defaultdict

import torch

from engine.api import LoadOptions, Session
from engine.generate.sampling import SamplingParams
from engine.plan import DeviceProfile, PlanRequest
from engine.runtime.expert_cache import CachedExperts

# The parts of an expert call: label -> (method of CachedExperts, sync before, sync after). These are the cache's
# internals, named here and nowhere else in the lab: a method the engine no longer has is reported and skipped.
PARTS = {
    "device experts": ("_device_outputs", True, True),
    "CPU experts": ("_host_outputs", True, True),
    "upload (host copy, issue)": ("_upload", False, False),  # its copies land in the wait's part
    "upload (wait)": ("sync", False, True),
}

spent: dict[str, float] = defaultdict(float)
count: dict[str, int] = defaultdict(int)


def timed(name, fn, before=True, after=True):
    """Time calls of a CachedExperts method under ``name``, the device synchronized before and after the call."""

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


def instrument() -> None:
    # generate(max_tokens=1) runs the prompt's forward passes only: every call timed is a prompt's
    CachedExperts.forward = timed("expert call", CachedExperts.forward)
    for label, (method, before, after) in PARTS.items():
        fn = getattr(CachedExperts, method, None)
        if fn is None:
            print(f"note: CachedExperts has no {method!r} any more; '{label}' is not split out", flush=True)
            continue
        setattr(CachedExperts, method, timed(label, fn, before, after))


def main(path: str, prompts: list[int]) -> None:
    instrument()
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
