"""Decode tok/s of a chat on the Qwen3-30B-A3B-geometry file (whole trunk and every expert resident, CUDA
graphs) with greedy picking, with the default chat sampling (top-k 40, top-p 0.95, min-p 0.05, T 0.8), and
with that sampling done by the full-sort chain (Sampler.reference, the sampler before 0f0e3c6) — beside the
GPU time of a step (graph replays alone), so the host's share of a token shows. Then a cProfile of one greedy
run: where the host time of a token goes.

  PYTHONPATH=. python3 labs/chat_decode.py /tmp/qwen3-30b-a3b-random.gguf [ROUNDS]
  ... chat_decode.py FILE [ROUNDS] --small-card   # the 12 GiB placement, experts on the CPU

Results (H100 boxes, 2026-11-22, 1af0956 to 8f0cae3): docs/benchmarks.md, "Sampling a token".
"""

import contextlib
import cProfile
import io
import pstats
import sys
from unittest import mock

import numpy as np
import torch

from engine.api import LoadOptions, Session
from engine.generate.sampling import Sampler, SamplingParams
from engine.plan import DeviceProfile, PlanRequest

PROMPT, GEN = 16, 64


@contextlib.contextmanager
def resident_session(path: str, q8_act: bool = True, n_ctx: int = 96):
    """The file loaded on CUDA with the whole trunk and every expert resident (a 30 GiB budget), f32 KV."""
    with Session.load(path, LoadOptions(n_ctx=n_ctx, device="cuda", q8_act=q8_act)) as s:
        p = s.plan(PlanRequest(ctx=n_ctx, kv_type="f32", n_gpu_layers=s.args.n_layer, moe="resident"),
                   DeviceProfile(vram_bytes=30 << 30, reserve_bytes=0))  # fmt: skip
        s.apply(p)
        yield s


def tok_s(s, params) -> float:
    s.reset()
    *_, last = s.generate(prompt_ids=list(range(1, PROMPT + 1)), params=params)
    return last.decode_tok_s


def pickings(s, rounds: int, gen: int) -> dict[str, list[float]]:
    """Decode tok/s of each picking, ``rounds`` runs each, interleaved (after one warm greedy run: in a
    graph session it captures the buckets)."""
    greedy, chat = SamplingParams.greedy(max_tokens=gen), SamplingParams(max_tokens=gen, seed=0)
    tok_s(s, greedy)
    got = {"greedy": [], "chat sampling": [], "chat sampling, full-sort sampler": []}
    for _ in range(rounds):
        got["greedy"].append(tok_s(s, greedy))
        got["chat sampling"].append(tok_s(s, chat))
        with mock.patch.object(Sampler, "__call__", Sampler.reference):
            got["chat sampling, full-sort sampler"].append(tok_s(s, chat))
    return got


def main(path: str, rounds: int) -> None:
    with resident_session(path, n_ctx=PROMPT + GEN + 16) as s:
        got = pickings(s, rounds, GEN)
        g = s.model.decode_graph
        L = max(g.graphs)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(100):
            g.replay(L)
        b.record()
        b.synchronize()
        gpu_us = a.elapsed_time(b) * 10
        print(
            f"GPU step (graph replays alone, bucket {L}): {gpu_us:.0f} us = {1e6 / gpu_us:.0f} tok/s",
            flush=True,
        )
        for k, v in got.items():
            med = float(np.median(v))
            print(f"{k}: {' / '.join(f'{x:.1f}' for x in v)} tok/s; median {med:.1f} = {1e6 / med:.0f} us a token, "
                  f"host share {1 - gpu_us / (1e6 / med):.0%}", flush=True)  # fmt: skip
        pr = cProfile.Profile()
        pr.enable()
        tok_s(s, SamplingParams.greedy(max_tokens=GEN))
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22)
        print(out.getvalue()[-6000:], flush=True)


def small_card(path: str, rounds: int, gen: int = 24) -> None:
    """The same three pickings on the 12 GiB placement with the routed experts on the CPU (the product's
    target machine; eager decode, no graphs): what the sampler is worth at its ~10 tok/s."""
    n_ctx = PROMPT + gen + 16
    with Session.load(path, LoadOptions(n_ctx=n_ctx, device="cuda")) as s:
        p = s.plan(PlanRequest(ctx=n_ctx, kv_type="f32", n_gpu_layers=s.args.n_layer, moe="cpu"),
                   DeviceProfile(vram_bytes=12 << 30))  # fmt: skip
        s.apply(p)
        got = pickings(s, rounds, gen)
        print(f"12 GiB, experts on the CPU ({s.applied.describe()}):", flush=True)
        for k, v in got.items():
            print(f"  {k}: {' / '.join(f'{x:.2f}' for x in v)} tok/s", flush=True)


if __name__ == "__main__":
    if "--small-card" in sys.argv:
        small_card(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 2)
    else:
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
