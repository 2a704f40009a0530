"""Programmatic dependent launch (engine.runtime.triton_qblocks.pdl): when it is on, and that a
captured chain of PDL kernels computes exactly what the same calls compute launched one by one."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from engine.runtime import triton_qblocks as qb  # noqa: E402


def test_pdl_is_off_without_a_captured_cuda_stream(monkeypatch):
    assert qb.pdl(torch.device("cpu")) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert qb.pdl(torch.device("cuda", 0)) == 0  # the interpreter has no grid dependency control
    assert qb.launch_kw(0) == {}
    assert qb.launch_kw(1) == {"launch_pdl": True}


def test_prefetch_follows_pdl_unless_turned_off(monkeypatch):
    monkeypatch.delenv(qb.ENV_PREFETCH, raising=False)
    assert (qb.prefetch(0), qb.prefetch(1)) == (0, 1)
    monkeypatch.setenv(qb.ENV_PREFETCH, "0")
    assert qb.prefetch(1) == 0


def test_pdl_is_off_outside_graph_capture_and_when_disabled(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = torch.device("cuda", 0)
    assert qb.pdl(dev) == 0  # eager launches: never
    monkeypatch.setenv(qb.ENV_PDL, "0")
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device=dev)
    with torch.cuda.graph(g):
        x.add_(1)  # a graph must capture something
        assert qb.pdl(dev) == 0


SCRIPT = r"""
import sys, numpy as np, torch
from engine.quant.formats import QType
from engine.runtime import step_kernels, triton_gemv, triton_moe, triton_qblocks as qb
from tests.triton_data import blocks, expert_pool

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
    for a, b in zip(eager, captured):
        assert torch.equal(a, b), (a - b).abs().max().item()
print("pdl", qb.pdl.__name__, "ok")
"""


@pytest.mark.cuda
def test_a_captured_pdl_chain_equals_the_eager_calls():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from tests.triton_data import run_script

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    assert run_script(SCRIPT, [], env).strip().endswith("ok")
