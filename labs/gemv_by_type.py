"""Where the exact-float Triton GEMV's time goes in a decode step, by weight type and shape: a file loaded on
CUDA with every expert resident, CUDA graphs off, each ``triton_gemv._run`` launch timed with CUDA events
(a launch's device time plus its launch gap) and grouped by (qtype, rows, n, offsets, tokens, launch settings),
with the bytes each reads and the GB/s that makes. Eager launches: the figures include the host's gaps, so they rank
the groups; the graph step's own kernel times are labs/step_profile.py's.

  PYTHONPATH=. python3 labs/gemv_by_type.py F [--steps 8]

Made for gpt-oss-20b (Q8_0 trunk, MXFP4 experts), whose graph step spends 80 % of its 10 ms in ``_gemv_kernel``.
"""

import argparse
import collections

import torch

from engine import config
from engine.api import LoadOptions, Session
from engine.plan import DeviceProfile, PlanRequest
from engine.quant.formats import QType, block_format
from engine.runtime import kernel_select as ks
from engine.runtime import triton_gemv

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--steps", type=int, default=8)
a = ap.parse_args()

times: dict[tuple, list] = collections.defaultdict(list)
real = triton_gemv._run


def timed(pool, offsets, X, qtype, rows, n, bt, cfg, constant_offsets=False):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    y = real(pool, offsets, X, qtype, rows, n, bt, cfg, constant_offsets)
    e.record()
    key = (QType(qtype).name, rows, n, offsets.shape[0], X.shape[0], bt, tuple(sorted(cfg.items())))
    times[key].append((s, e))
    return y


with config.overriding(cuda_graph="off"), Session.load(a.model, LoadOptions(n_ctx=256, device="cuda")) as sess:
    sess.apply(sess.plan(PlanRequest(ctx=256, moe="resident"), DeviceProfile(vram_bytes=30 << 30)))
    toks = list(range(100, 116))
    sess.logits(toks, batch=True)
    for t in range(4):  # warm
        sess.logits([200 + t], batch=False)
    triton_gemv._run = timed
    for t in range(a.steps):
        sess.logits([300 + t], batch=False)
    torch.cuda.synchronize()
    triton_gemv._run = real
    print(f"act mode on this device: {ks.act_mode(torch.device('cuda'), None, None)}")
    tot = 0.0
    rows_out = []
    for key, ev in times.items():
        q, rows, n, P, T, bt, cfg = key
        us = sum(s.elapsed_time(e) for s, e in ev) * 1e3 / a.steps
        nbytes = P * block_format(QType[q]).row_bytes(n) * rows * len(ev) / a.steps
        tot += us
        rows_out.append((us, q, rows, n, P, T, len(ev) / a.steps, nbytes / us / 1e3, dict(cfg)))
    for us, q, rows, n, P, T, k, gbs, cfg in sorted(rows_out, reverse=True):
        print(
            f"{us:8.0f} us  {q:6s} rows {rows:6d} n {n:5d} offsets {P:2d} T {T}  {k:4.0f}x a step  {gbs:7.0f} GB/s  {cfg}"
        )
    print(f"total {tot:.0f} us a step in _run")
