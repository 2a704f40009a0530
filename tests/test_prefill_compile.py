"""The tiled prompt kernel (triton_moe._grouped_kernel) compiles for sm_90 — Hopper, which CI lacks; Triton's
ptxas needs no GPU — with every quant type's default launch settings: on bfloat16 operands to warpgroup MMA
(``wgmma``), on float32 ones to ``mma.sync`` (tf32x3). The interpreter accepts shapes and operand types the
compiler rejects (tl.dot's ≥ 16 sides, equal operand dtypes), so the interpreter tests alone cannot say this."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from engine.config import EngineOptions  # noqa: E402
from engine.quant.formats import QType  # noqa: E402
from engine.runtime import kernel_select as ks  # noqa: E402
from engine.runtime import triton_moe as tm  # noqa: E402
from engine.runtime import triton_qblocks as qb  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        EngineOptions.from_env().triton_interpret,
        reason="TRITON_INTERPRET: Triton interprets the kernels, compiles none",
    ),
]
H100 = "NVIDIA H100 80GB HBM3"


def _ptx(q: QType, bf16: bool, dense: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    c = ks.launch("grouped_bf16" if bf16 else "grouped", q, 768, H100, EngineOptions())
    sig = {"W": "*u8", "TLO": "*i64", "SEG": "*i64", "TOK": "*i64", "X": "*bf16" if bf16 else "*fp32", "Y": "*fp32",
           "woff": "i32", "R": "i32", "J": "i32", "n": "i32", "row_bytes": "i32", "nb": "i32"}  # fmt: skip
    cex = dict(qb.geometry(q), BR=c["BR"], NB=c["NB"], BT=c["BT"], PREC="tf32" if bf16 else "tf32x3",
               OPS=1 if bf16 else 0, DENSE=dense)  # fmt: skip
    sig = dict(sig, **{k: "constexpr" for k in cex})
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn=tm._grouped_kernel, signature=sig, constexprs=cex, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": c["num_warps"]}).asm["ptx"]


@pytest.mark.parametrize("dense", [False, True], ids=["grouped", "dense"])
@pytest.mark.parametrize("q", qb.SUPPORTED, ids=[q.name for q in qb.SUPPORTED])
def test_bf16_prefill_kernel_compiles_to_wgmma(q, dense):
    text = _ptx(q, True, dense)
    assert "wgmma.mma_async" in text and "bf16" in text


def test_f32_prefill_kernel_compiles_to_mma():
    assert "mma.sync" in _ptx(QType.Q4_K, False, False)
