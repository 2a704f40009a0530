"""Programmatic dependent launch (engine.runtime.triton_qblocks.pdl): when it is on, and that each PDL
kernel variant compiles for sm_90 to one wait, then one release, its prefetches before the wait. (That a
captured chain of PDL kernels computes what the calls compute one by one: tests/triton/test_pdl.py.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from engine.config import EngineOptions  # noqa: E402
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


def _ptx(fn, sig: dict, cex: dict, warps: int = 4) -> str:
    """PTX of Triton kernel ``fn`` compiled for sm_90: ``sig`` its runtime arguments' types, ``cex`` its
    constexprs (pointers 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(sig, **{k: "constexpr" for k in cex})
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=cex, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]


def _pdl_cases() -> list:
    """(name, kernel, signature, constexprs, num_warps or None, prefetches) of each PDL kernel variant."""
    from engine.bench import read_floor as rf
    from engine.quant.formats import QType
    from engine.runtime import step_kernels as sk
    from engine.runtime import triton_gemv as tg
    from engine.runtime import triton_moe as tm
    from engine.runtime import triton_q4k_gemv as qg
    from engine.runtime import triton_q4k_moe as m4
    from engine.runtime import triton_q8 as t8
    from engine.runtime import triton_q8_gemv as g8
    from engine.runtime import triton_q8_moe as m8

    g, g8q = qb.geometry(QType.Q4_K), t8.q8_geometry(QType.Q4_K)
    gemv = {"W": "*u8", "OFFS": "*i64", "X": "*fp32", "Y": "*fp32", "R": "i32", "n": "i32", "row_bytes": "i32",
            "nb": "i32", "T": "i32"}  # fmt: skip
    q8gemv = {"W": "*u8", "W32": "*i32", "META": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "Y": "*fp32",
              "R": "i32", "n32": "i32", "row_bytes": "i32", "nb": "i32", "T": "i32", "ystride": "i32"}  # fmt: skip
    down = {"W": "*u8", "SLOT": "*i64", "Hh": "*fp32", "WT": "*fp32", "Y": "*fp32", "D": "i32", "F": "i32", "do": "i32",
            "row_bytes": "i32", "nb": "i32"}  # fmt: skip
    q8down = {"W": "*u8", "W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32", "HS": "*fp32", "WT": "*fp32",
              "Y": "*fp32", "D": "i32", "nh32": "i32", "do": "i32", "row_bytes": "i32", "nb": "i32"}  # fmt: skip
    norm = {"X": "*fp32", "Y": "*fp32", "W": "*fp32", "XO": "*fp32", "HO": "*fp32", "XQ": "*i32", "XD": "*fp32",
            "XS": "*fp32", "eps": "fp32"}  # fmt: skip
    q4k_gemv = {"W": "*u8", "W32": "*i32", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "Y": "*fp32", "R": "i32"}
    route = {"LOGITS": "*fp32", "TABLE": "*i64", "W": "*fp32", "IDS": "*i64", "OFF": "*i64", "E": "i32"}
    q4k_gate_up = {"W32": "*i32", "SLOT": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "H": "*fp32",
                   "go": "i64", "uo": "i64"}  # fmt: skip
    q4k_down = {"W": "*u8", "W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32", "HS": "*fp32", "WT": "*fp32",
                "Y": "*fp32", "do": "i64"}  # fmt: skip
    read = {"W": "*i32", "NXT": "*u8", "Y": "*i32", "nwords": "i64", "nxt_bytes": "i64", "nxt_share": "i32"}
    return [
        ("gemv", tg._gemv_kernel, gemv, dict(g, BR=8, NB=8, BT=1, SPLIT=2, STEPS=1, PDL=1, PF=1, NT=128), None, 1),
        ("gemv, slot offsets", tg._gemv_kernel, gemv,
         dict(g, BR=8, NB=8, BT=1, SPLIT=1, STEPS=1, PDL=1, PF=0, NT=128), None, 0),
        ("q8 gemv", g8._q8_gemv_kernel, q8gemv,
         dict(g8q, BR=16, NB=8, BT=1, SPLIT=1, STEPS=1, M=1, ASM=True, PDL=1, PF=1, NT=128), None, 1),
        ("moe down", tm._down_kernel, down, dict(g, K=8, BR=8, NB=4, KSPLIT=4, STEPS=1, PDL=1, PF=1, NT=128), None, 2),
        ("q8 moe down", m8._q8_down_kernel, q8down,
         dict(g8q, K=8, BR=16, NB=4, KSPLIT=2, STEPS=1, ASM=True, PDL=1, PF=1, NT=128), None, 4),
        ("add + norm", sk._add_rms_norm_kernel, norm, dict(D=2048, BD=2048, HAS_Y=True, Q8=True, PDL=1), 8, 0),
        ("q4k gemv", qg._gemv_kernel, q4k_gemv, dict(NB=8, BR=8, ASM=True, PDL=1, PF=1, NT=64), 2, 1),
        ("route", sk._route_kernel, route, dict(K=8, KP=8, BE=128, RENORM=True, PDL=1), 1, 0),
        ("q4k moe gate/up", m4._gate_up_kernel, q4k_gate_up, dict(F=768, K=8, NB=8, BR=8, ASM=True, PDL=1), 1, 0),
        ("q4k moe down", m4._down_kernel, q4k_down, dict(D=2048, K=8, NBF=3, BR=4, ASM=True, PDL=1, PF=1, NT=32), 1, 8),
        ("read floor", rf._read_kernel, read, dict(STEPS=8, NT=128, PDL=1), None, 1),
    ]  # fmt: skip


@pytest.mark.skipif(
    EngineOptions.from_env().triton_interpret, reason="TRITON_INTERPRET: Triton interprets the kernels, compiles none"
)
def test_pdl_kernels_compile_for_sm90_with_wait_before_release():
    """The PDL variants run only on a Hopper GPU, which CI lacks: compile them for sm_90 here (Triton's
    ptxas needs no GPU) and check each waits once, then releases once, with its prefetches before
    the wait (one per slot of the program's experts in the MoE down kernels)."""
    for name, fn, sig, cex, warps, pf in _pdl_cases():
        text = _ptx(fn, sig, cex) if warps is None else _ptx(fn, sig, cex, warps)
        got = (text.count("griddepcontrol.wait"), text.count("griddepcontrol.launch_dependents"),
               text.count("cp.async.bulk.prefetch.L2"))  # fmt: skip
        assert got == (1, 1, pf), (name, got)
        assert text.index("griddepcontrol.wait") < text.index("griddepcontrol.launch_dependents"), name  # wait, release
        if pf:
            assert text.index("cp.async.bulk.prefetch.L2") < text.index("griddepcontrol.wait"), name  # prefetch first
