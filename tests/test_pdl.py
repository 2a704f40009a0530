"""Programmatic dependent launch (engine.runtime.triton_qblocks.pdl): when it is on, and that a
captured chain of PDL kernels computes exactly what the same calls compute launched one by one."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from engine.runtime import triton_qblocks as qb  # noqa: E402


def test_pdl_is_off_without_a_captured_cuda_stream(engine_env):
    assert qb.pdl(torch.device("cpu")) == 0
    engine_env({"TRITON_INTERPRET": "1"})
    assert qb.pdl(torch.device("cuda", 0)) == 0  # the interpreter has no grid dependency control
    assert qb.launch_kw(0) == {}
    assert qb.launch_kw(1) == {"launch_pdl": True}


def test_prefetch_follows_pdl_unless_turned_off(engine_env):
    engine_env({"SHARPI_PDL_PREFETCH": None})
    assert (qb.prefetch(0), qb.prefetch(1)) == (0, 1)
    engine_env({"SHARPI_PDL_PREFETCH": "0"})
    assert qb.prefetch(1) == 0


def test_pdl_is_off_outside_graph_capture_and_when_disabled(engine_env):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    engine_env({"TRITON_INTERPRET": None})
    dev = torch.device("cuda", 0)
    assert qb.pdl(dev) == 0  # eager launches: never
    engine_env({"SHARPI_PDL": "0"})
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


COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.quant.formats import QType
from engine.runtime import step_kernels as sk, triton_gemv as tg, triton_moe as tm, triton_q8 as t8
from engine.runtime import triton_q8_gemv as g8, triton_q8_moe as m8, triton_qblocks as qb
from engine.bench import read_floor as rf
from engine.runtime import triton_q4k_moe as m4
from engine.runtime import triton_q4k_gemv as qg

def ptx(fn, sig, cex, warps=4):
    sig = dict(sig, **{k: "constexpr" for k in cex})
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=cex, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]

g, g8q = qb.geometry(QType.Q4_K), t8.q8_geometry(QType.Q4_K)
gemv = {"W": "*u8", "OFFS": "*i64", "X": "*fp32", "Y": "*fp32", "R": "i32", "n": "i32", "row_bytes": "i32", "nb": "i32",
        "T": "i32"}
q8gemv = {"W": "*u8", "W32": "*i32", "META": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "Y": "*fp32", "R": "i32",
          "n32": "i32", "row_bytes": "i32", "nb": "i32", "T": "i32", "ystride": "i32"}
down = {"W": "*u8", "SLOT": "*i64", "Hh": "*fp32", "WT": "*fp32", "Y": "*fp32", "D": "i32", "F": "i32", "do": "i32",
        "row_bytes": "i32", "nb": "i32"}
q8down = {"W": "*u8", "W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32", "HS": "*fp32", "WT": "*fp32",
          "Y": "*fp32", "D": "i32", "nh32": "i32", "do": "i32", "row_bytes": "i32", "nb": "i32"}
cases = [  # (name, ptx, prefetches)
    ("gemv", ptx(tg._gemv_kernel, gemv, dict(g, BR=8, NB=8, BT=1, SPLIT=2, STEPS=1, PDL=1, PF=1, NT=128)), 1),
    ("gemv, slot offsets", ptx(tg._gemv_kernel, gemv, dict(g, BR=8, NB=8, BT=1, SPLIT=1, STEPS=1, PDL=1, PF=0, NT=128)), 0),
    ("q8 gemv", ptx(g8._q8_gemv_kernel, q8gemv, dict(g8q, BR=16, NB=8, BT=1, SPLIT=1, STEPS=1, M=1, ASM=True, PDL=1, PF=1,
                                                      NT=128)), 1),
    ("moe down", ptx(tm._down_kernel, down, dict(g, K=8, BR=8, NB=4, KSPLIT=4, STEPS=1, PDL=1, PF=1, NT=128)), 2),
    ("q8 moe down", ptx(m8._q8_down_kernel, q8down, dict(g8q, K=8, BR=16, NB=4, KSPLIT=2, STEPS=1, ASM=True, PDL=1, PF=1,
                                                         NT=128)), 4),
    ("add + norm", ptx(sk._add_rms_norm_kernel, {"X": "*fp32", "Y": "*fp32", "W": "*fp32", "XO": "*fp32", "HO": "*fp32",
                                                 "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "eps": "fp32"},
                       dict(D=2048, BD=2048, HAS_Y=True, Q8=True, PDL=1), 8), 0),
    ("q4k gemv", ptx(qg._gemv_kernel, {"W": "*u8", "W32": "*i32", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "Y": "*fp32",
                                       "R": "i32"}, dict(NB=8, BR=8, ASM=True, PDL=1, PF=1, NT=64), 2), 1),
    ("route", ptx(sk._route_kernel, {"LOGITS": "*fp32", "TABLE": "*i64", "W": "*fp32", "IDS": "*i64", "OFF": "*i64",
                                     "E": "i32"}, dict(K=8, KP=8, BE=128, RENORM=True, PDL=1), 1), 0),
    ("q4k moe gate/up", ptx(m4._gate_up_kernel, {"W32": "*i32", "SLOT": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32",
                                                   "H": "*fp32", "go": "i64", "uo": "i64"},
                             dict(F=768, K=8, NB=8, BR=8, ASM=True, PDL=1), 1), 0),
    ("q4k moe down", ptx(m4._down_kernel, {"W": "*u8", "W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32",
                                           "HS": "*fp32", "WT": "*fp32", "Y": "*fp32", "do": "i64"},
                          dict(D=2048, K=8, NBF=3, BR=4, ASM=True, PDL=1, PF=1, NT=32), 1), 8),
    ("read floor", ptx(rf._read_kernel, {"W": "*i32", "NXT": "*u8", "Y": "*i32", "nwords": "i64", "nxt_bytes": "i64",
                                         "nxt_share": "i32"}, dict(STEPS=8, NT=128, PDL=1)), 1),
]
for name, text, pf in cases:
    got = (text.count("griddepcontrol.wait"), text.count("griddepcontrol.launch_dependents"),
           text.count("cp.async.bulk.prefetch.L2"))
    assert got == (1, 1, pf), (name, got)
    assert text.index("griddepcontrol.wait") < text.index("griddepcontrol.launch_dependents"), name  # wait, then release
    if pf:
        assert text.index("cp.async.bulk.prefetch.L2") < text.index("griddepcontrol.wait"), name  # prefetch first
print("ok")
"""


def test_pdl_kernels_compile_for_sm90_with_wait_before_release():
    """The PDL variants run only on a Hopper GPU, which CI lacks: compile them for sm_90 here (Triton's
    ptxas needs no GPU) and check each waits once, then releases once, with its prefetches before
    the wait (one per slot of the program's experts in the MoE down kernels)."""
    from tests.triton_data import run_script

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    assert run_script(COMPILE, [], env).strip().endswith("ok")
