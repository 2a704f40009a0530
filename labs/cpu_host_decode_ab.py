"""The whole-model host decode (``DecoderModel._host_decode``: numpy between the fused layer calls,
routes recorded once a token) against the per-layer path it replaces (each layer's ``__call__``,
torch wrapping between layers, a route record per layer), alternating token by token in one process
after a prompt. Prints wall ms and the calling thread's CPU ms per token, median and minimum.

  PYTHONPATH=. python3 labs/cpu_host_decode_ab.py /tmp/bench_qwen3moe_q4k.gguf [--prompt 512] [--tokens 40]

With ``NUMBA_NUM_THREADS=1`` the calling thread's CPU time is the whole token's work (steadier than
wall time on a shared machine); at 2 threads compare the wall times.
"""

import argparse
import statistics
import time

import numpy as np

from engine.api import LoadOptions, Session
from engine.models.base import DecoderModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    P, N = args.prompt, args.tokens
    with Session.load(args.model, LoadOptions(n_ctx=P + 2 * N + 16)) as s:
        m, cache = s.model, s.cache
        ids = [int(t) for t in np.random.default_rng(0).integers(8, s.args.n_vocab - 8, P)]
        m.forward(ids, 0, cache, all_logits=False)
        whole = DecoderModel._host_decode.__get__(m)
        res = {"per layer": ([], []), "whole model": ([], [])}
        pos = P
        for i in range(2 * N + 4):
            which = "whole model" if i % 2 else "per layer"
            m._host_decode = whole if i % 2 else (lambda *a: None)
            c0, t0 = time.thread_time(), time.perf_counter()
            m.forward([5], pos, cache, all_logits=False)
            t1, c1 = time.perf_counter(), time.thread_time()
            pos += 1
            if i >= 4:  # the first steps after the prompt fault scratch back in
                res[which][0].append((t1 - t0) * 1e3)
                res[which][1].append((c1 - c0) * 1e3)
        del m._host_decode
        for k, (w, c) in res.items():
            print(
                f"{k:<12} wall ms median {statistics.median(w):.2f} min {min(w):.2f} | "
                f"thread CPU ms median {statistics.median(c):.2f} min {min(c):.2f}"
            )


if __name__ == "__main__":
    main()
