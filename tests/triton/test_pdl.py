"""Programmatic dependent launch (engine.runtime.triton_qblocks.pdl) on a GPU: a captured chain of PDL
kernels computes exactly what the same calls compute launched one by one. (When PDL is on, and the
PTX of the PDL variants: tests/test_pdl.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quant.formats import QType
from engine.runtime import step_kernels, triton_gemv, triton_moe
from engine.runtime import triton_qblocks as qb
from tests.triton import CUDA_ONLY
from tests.triton_data import blocks, expert_pool


@pytest.mark.cuda
@CUDA_ONLY
def test_a_captured_pdl_chain_equals_the_eager_calls():
    dev = torch.device("cuda", 0)
    gen = np.random.default_rng(7)
    D, F, E, K, H = 2048, 768, 16, 8, 4096
    q = QType.Q4_K
    wq = blocks(q, H, D, dev, gen)
    wk = blocks(q, 512, D, dev, gen)
    wo = blocks(QType.Q6_K, D, H, dev, gen)
    wr = torch.from_numpy(gen.standard_normal((E, D)).astype(np.float32) / 40).to(dev)
    norm = torch.from_numpy(gen.random(D).astype(np.float32) + 0.5).to(dev)
    pool, stride, roles = expert_pool((q, q, QType.Q6_K), F, D, E, dev, gen)
    table = torch.arange(E, device=dev, dtype=torch.int64) * stride
    x0 = torch.from_numpy(gen.standard_normal((1, D)).astype(np.float32)).to(dev)
    ids = torch.empty((1, K), dtype=torch.int64, device=dev)

    def chain(x):
        outs = []
        for _ in range(3):  # kernels reading what the one before wrote, buffers reused by the allocator
            _, h = step_kernels.add_rms_norm(x, None, norm, 1e-6)
            a = triton_gemv.matmul(wq, h, q, H, D)
            kk = triton_gemv.matmul(wk, h, q, 512, D)
            o = triton_gemv.matmul(wo, a, QType.Q6_K, D, H)
            x, h2 = step_kernels.add_rms_norm(x, o, norm, 1e-6)
            w, off = step_kernels.route(h2 @ wr.T, K, True, table, ids)
            y = triton_moe.moe_decode(pool.reshape(-1), off, h2, w, roles)
            x = x + y
            outs += [a, kk, o, y]
        return outs + [x]

    eager = [t.clone() for t in chain(x0)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(x0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert qb.pdl(dev) == int(torch.cuda.get_device_capability(dev)[0] >= 9)
        captured = chain(x0)
    for _ in range(5):
        for t in captured:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(eager, captured)):
            assert torch.equal(a, b), (i, (a - b).abs().max().item())
