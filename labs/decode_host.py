"""Where a decode token's host time goes with the whole model resident on the GPU (CUDA-graph steps): the
token's wall time from the generation loop against the GPU time of a step (graph replays alone), and the
host phases timed inside the loop by wrapping the functions that make them (perf_counter, no profiler), then
a cProfile of the decode alone (a one-token prompt) sorted by cumulative time.

    PYTHONPATH=. python3 labs/decode_host.py F [--prompt 512] [--gen 64] [--rounds 2]

Results: docs/benchmarks.md, "GPU: a decode token's host time, and the 12 GiB default, at 2bcc7ec" and "GPU:
SharpI against llama.cpp (CUDA) at 6c42ace".
"""

import argparse
import collections
import cProfile
import io
import pstats
import time

import numpy as np
import torch

from engine.api import LoadOptions, Session
from engine.generate import sampling
from engine.plan import DeviceProfile, PlanRequest
from engine.runtime import graph_decode

SPENT: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, label: str, sync: bool = False):
    """Wrap ``owner.name`` so its wall time adds to SPENT[label]."""
    f = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[label] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    n_ctx = a.prompt + a.gen + 16
    with Session.load(a.path, LoadOptions(n_ctx=n_ctx, device="cuda")) as s:
        p = s.plan(PlanRequest(ctx=n_ctx, n_gpu_layers=s.args.n_layer, moe="resident"),
                   DeviceProfile(vram_bytes=30 << 30, reserve_bytes=0))  # fmt: skip
        s.apply(p)
        ids = np.random.default_rng(0).integers(100, 100000, a.prompt).tolist()

        def gen(params, prompt=ids):
            s.reset()
            *_, last = s.generate(prompt_ids=prompt, params=params)
            return last

        greedy = sampling.SamplingParams.greedy(max_tokens=a.gen)
        chat = sampling.SamplingParams(max_tokens=a.gen, seed=0)
        gen(greedy)
        gen(chat)
        g = s.model.decode_graph
        torch.cuda.synchronize()
        L = max(g.graphs)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(100):
            g.replay(L)
        e1.record()
        e1.synchronize()
        gpu_us = e0.elapsed_time(e1) * 10
        print(f"GPU step (graph replays alone, bucket {L}): {gpu_us:.0f} us", flush=True)
        timed(s.model, "embed_tokens", "embed_tokens")
        timed(s.model, "_finite", "_finite")
        timed(graph_decode.GraphDecode, "step", "graph step (all)")
        timed(graph_decode.GraphDecode, "_run", "  replay launch")
        timed(graph_decode.GraphDecode, "_sync", "  sync (GPU wait)")
        timed(graph_decode.GraphDecode, "_record", "  _record")
        fwd = type(s.model).forward

        def forward(self, tokens, *a, **k):  # one-token passes only: the prompt's pass is not a token's
            t = time.perf_counter()
            try:
                return fwd(self, tokens, *a, **k)
            finally:
                if len(tokens) == 1:
                    SPENT["model.forward (one token)"] += time.perf_counter() - t

        type(s.model).forward = forward
        timed(sampling.Sampler, "__call__", "sampler")
        timed(type(s.model.profiler), "decode_token", "profiler.decode_token")
        for name, params in (("greedy", greedy), ("chat sampling", chat)):
            for _ in range(a.rounds):
                SPENT.clear()
                last = gen(params)
                n = last.n_generated - 1
                tok_us = 1e6 / last.decode_tok_s
                print(f"{name}: {last.decode_tok_s:.1f} tok/s = {tok_us:.0f} us a token; host share "
                      f"{1 - gpu_us / tok_us:.0%}", flush=True)  # fmt: skip
                for k, v in SPENT.items():
                    print(f"  {k:26s} {v / max(n, 1) * 1e6:8.1f} us a token")
        pr = cProfile.Profile()
        pr.enable()
        gen(greedy, ids[:1])
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(45)
        print(out.getvalue()[-9000:], flush=True)
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[-5000:], flush=True)


if __name__ == "__main__":
    main()
