"""The read floor of a decode step's kernel chain: what a kernel that only *reads* its weights reaches
in a CUDA graph with programmatic dependent launch (PDL), in the best arrangement found: each launch
first prefetches its successor's bytes into L2, loads its own before the PDL wait, then waits and
releases the next launch (``triton_qblocks.pdl_enter``). No GEMV over the same bytes can beat it, so
``sharpi bench device-kernels`` prints it beside each workload (the arrangements compared:
docs/lab-notebook.md, "Read floors").
"""

from __future__ import annotations

import math

import torch

from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl

NT = 128  # threads a program (4 warps)
STEPS = 8  # 16-byte loads a thread
PER = NT * 4 * STEPS  # int32 words a program

if triton is not None:

    @triton.jit
    def _read_kernel(W, NXT, Y, nwords, nxt_bytes, nxt_share, STEPS: tl.constexpr, NT: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
        """XOR of this program's PER words of W into Y[program]; with PDL, prefetch this program's share of
        the next launch's bytes (NXT) first and load before the wait."""
        pid = tl.program_id(0)
        if PDL:
            start = pid.to(tl.int64) * nxt_share
            qb.prefetch_l2(NXT, start, tl.minimum(nxt_share, nxt_bytes - start), NT)
        i = pid.to(tl.int64) * (NT * 4 * STEPS) + tl.arange(0, NT * 4)
        acc = tl.zeros([NT * 4], dtype=tl.int32)
        for s in tl.static_range(STEPS):
            j = i + s * (NT * 4)
            acc ^= tl.load(W + j, mask=j < nwords, other=0)
        qb.pdl_enter(PDL)
        tl.store(Y + pid, tl.xor_sum(acc, 0))


def _launch(buf: torch.Tensor, nxt: torch.Tensor, y: torch.Tensor) -> None:
    words = buf.view(torch.int32)
    grid = triton.cdiv(words.numel(), PER)
    share = -(-nxt.numel() // grid // 16) * 16
    pdl = qb.pdl(buf.device)
    _read_kernel[(grid,)](words, nxt, y, words.numel(), nxt.numel(), share, STEPS=STEPS, NT=NT, PDL=pdl,
                          num_warps=NT // 32, **qb.launch_kw(pdl))  # fmt: skip


def read_floor_us(sizes: list[int], graph_us) -> float:
    """µs per call of a chain of pure-read launches of ``sizes`` bytes each (one call: those launches in
    order, e.g. gate/up then down), over distinct buffers totalling ≥ 1 GB, timed by ``graph_us`` (the
    bench's CUDA-graph timer: list of calls -> (graph µs per call, eager µs per call))."""
    sizes = [max(16, s // 16 * 16) for s in sizes]
    calls = max(48, math.ceil(1e9 / sum(sizes)))
    bufs = [torch.empty((calls, s), dtype=torch.uint8, device="cuda") for s in sizes]
    for b in bufs:
        b.random_(0, 256)
    y = torch.empty(max(triton.cdiv(s // 4, PER) for s in sizes), dtype=torch.int32, device="cuda")
    seq = [(b, c) for c in range(calls) for b in range(len(sizes))]  # launch order

    def call(i):
        for j in range(len(sizes)):
            k = i * len(sizes) + j
            b, c = seq[k]
            nb, nc = seq[(k + 1) % len(seq)]
            _launch(bufs[b][c], bufs[nb][nc], y)

    return graph_us([lambda i=i: call(i) for i in range(calls)])[0]
