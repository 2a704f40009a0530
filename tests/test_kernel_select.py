"""engine.runtime.kernel_select: the launch tables (engine/runtime/launch/*.json) reproduce, bit for bit,
the settings the code resolved before they became JSON (triton_gemv.LAUNCH / LAUNCH_BY_TRITON, the MoE
entries triton_moe added at import, triton_launch.json) for every (device, Triton version, kernel, qtype,
shape class); the tables are read-only; and the kernel choices per (quant types, tokens, step mode)."""

from __future__ import annotations

import itertools

import pytest

from engine.config import EngineOptions
from engine.quant.formats import QType
from engine.runtime import kernel_select as ks

# -- the tables as they were in the code (commit 87e6b1d), frozen here: the JSON must give the same ---------
OLD_GEMV_DEFAULT = {
    "gemv:*:*": {"BR": 8, "NB": 8, "num_warps": 4, "SPLIT": 1},
    "gemv:*:S": {"BR": 2, "NB": 8, "num_warps": 4, "SPLIT": 1},
    "gemv:Q6_K:*": {"BR": 4, "NB": 2, "num_warps": 4, "SPLIT": 1},
    "gemv:Q4_0:*": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},
    "gemv:Q8_0:*": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},
    "gemv:Q4_0:S": {"BR": 2, "NB": 32, "num_warps": 4, "SPLIT": 1},
    "gemv:Q8_0:S": {"BR": 2, "NB": 32, "num_warps": 4, "SPLIT": 1},
    "gemv_q4k:*:*": {"BR": 8, "num_warps": 2, "PF": 1, "TILE": "halves"},
    "gemv_q4k:*:M": {"BR": 4, "num_warps": 1, "PF": 1, "TILE": "halves"},
    "gemv_q8:*:*": {"BR": 16, "NB": 8, "num_warps": 4, "SPLIT": 1},
    "gemv_q8:*:S": {"BR": 4, "NB": 8, "num_warps": 4, "SPLIT": 1},
    "gemv_q8:Q6_K:*": {"BR": 8, "NB": 8, "num_warps": 4, "SPLIT": 1},
    "gemv_q8:Q4_0:*": {"BR": 8, "NB": 32, "num_warps": 4, "SPLIT": 1},
    "gemv_q8:Q8_0:*": {"BR": 8, "NB": 32, "num_warps": 4, "SPLIT": 1},
    "gemv_q8:Q4_0:S": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},
    "gemv_q8:Q8_0:S": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},
}
OLD_MOE_DEFAULT = {
    "moe_gate_up:*:*": {"BR": 8, "NB": 8, "num_warps": 4},
    "moe_gate_up:Q6_K:*": {"BR": 4, "NB": 2, "num_warps": 4},
    "moe_gate_up:Q4_0:*": {"BR": 8, "NB": 8, "num_warps": 4},
    "moe_gate_up:Q8_0:*": {"BR": 4, "NB": 16, "num_warps": 4},
    "moe_down:*:*": {"BR": 8, "NB": 4, "num_warps": 4, "KSPLIT": 8},
    "moe_down:Q6_K:*": {"BR": 8, "NB": 1, "num_warps": 4, "KSPLIT": 8},
    "moe_down:Q4_0:*": {"BR": 8, "NB": 8, "num_warps": 4, "KSPLIT": 4},
    "moe_down:Q8_0:*": {"BR": 8, "NB": 8, "num_warps": 4, "KSPLIT": 1},
    "moe_q8_gate_up:*:*": {"BR": 8, "NB": 4, "num_warps": 4},
    "moe_q8_gate_up:Q4_0:*": {"BR": 8, "NB": 16, "num_warps": 4},
    "moe_q8_gate_up:Q8_0:*": {"BR": 8, "NB": 16, "num_warps": 4},
    "moe_q8_down:*:*": {"BR": 16, "NB": 4, "num_warps": 4, "KSPLIT": 2},
    "moe_q8_down:Q4_0:*": {"BR": 8, "NB": 32, "num_warps": 4, "KSPLIT": 2},
    "moe_q8_down:Q8_0:*": {"BR": 8, "NB": 32, "num_warps": 4, "KSPLIT": 2},
    "moe_q4k_gate_up:*:*": {"BR": 8, "num_warps": 2, "TILE": "halves"},
    "moe_q4k_down:*:*": {"BR": 4, "num_warps": 1, "PF": 0, "TILE": "halves"},
    "grouped:*:*": {"BR": 32, "NB": 1, "BT": 16, "num_warps": 4},
    "grouped:Q4_0:*": {"BR": 32, "NB": 2, "BT": 16, "num_warps": 4},
    "grouped:Q8_0:*": {"BR": 32, "NB": 1, "BT": 16, "num_warps": 4},
    # added with the bf16 prompt kernels (launch/README.md, "grouped_bf16"): new entries, no old one changed
    "grouped_bf16:*:*": {"BR": 128, "NB": 1, "BT": 64, "num_warps": 8},
    "grouped_bf16:Q6_K:*": {"BR": 64, "NB": 1, "BT": 64, "num_warps": 8},
    "grouped_bf16:Q4_0:*": {"BR": 128, "NB": 2, "BT": 64, "num_warps": 8},
    "grouped_bf16:Q8_0:*": {"BR": 128, "NB": 2, "BT": 64, "num_warps": 8},
}
OLD_BY_TRITON = {
    (3, 7): {
        "moe_q4k_gate_up:*:*": {"BR": 16, "num_warps": 4, "TILE": "rows"},
        "moe_q4k_down:*:*": {"BR": 8, "num_warps": 2, "PF": 0, "TILE": "halves"},
    },
    (3, 8): {
        "moe_q4k_gate_up:*:*": {"BR": 16, "num_warps": 4, "TILE": "rows"},
        "moe_q4k_down:*:*": {"BR": 8, "num_warps": 4, "PF": 0, "TILE": "rows"},
        "gemv_q4k:*:M": {"BR": 8, "num_warps": 4, "PF": 1, "TILE": "halves"},
    },
    (3, 9): {
        "moe_q4k_gate_up:*:*": {"BR": 16, "num_warps": 4, "TILE": "rows"},
        "moe_q4k_down:*:*": {"BR": 16, "num_warps": 4, "PF": 0, "TILE": "rows"},
    },
}
OLD_H100 = {
    "gemv:Q4_0:M": {"BR": 4, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv:Q4_0:S": {"BR": 2, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv:Q4_K:M": {"BR": 8, "NB": 8, "SPLIT": 1, "num_warps": 4},
    "gemv:Q4_K:S": {"BR": 2, "NB": 8, "SPLIT": 1, "num_warps": 4},
    "gemv:Q5_K:M": {"BR": 8, "NB": 8, "SPLIT": 1, "num_warps": 4},
    "gemv:Q5_K:S": {"BR": 2, "NB": 8, "SPLIT": 1, "num_warps": 4},
    "gemv:Q6_K:M": {"BR": 4, "NB": 2, "SPLIT": 1, "num_warps": 4},
    "gemv:Q6_K:S": {"BR": 2, "NB": 8, "SPLIT": 1, "num_warps": 4},
    "gemv:Q8_0:M": {"BR": 4, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv:Q8_0:S": {"BR": 2, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv_q8:Q4_0:L": {"BR": 8, "NB": 16, "SPLIT": 1, "num_warps": 4},
    "gemv_q8:Q4_0:M": {"BR": 8, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv_q8:Q4_0:S": {"BR": 2, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv_q8:Q8_0:L": {"BR": 8, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv_q8:Q8_0:M": {"BR": 8, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "gemv_q8:Q8_0:S": {"BR": 2, "NB": 32, "SPLIT": 1, "num_warps": 4},
    "moe_down:Q4_0:M": {"BR": 8, "KSPLIT": 4, "NB": 8, "num_warps": 4},
    "moe_down:Q4_K:M": {"BR": 8, "KSPLIT": 8, "NB": 4, "num_warps": 4},
    "moe_down:Q5_K:M": {"BR": 8, "KSPLIT": 8, "NB": 4, "num_warps": 4},
    "moe_down:Q6_K:M": {"BR": 8, "KSPLIT": 8, "NB": 1, "num_warps": 4},
    "moe_down:Q8_0:M": {"BR": 8, "KSPLIT": 1, "NB": 8, "num_warps": 4},
    "moe_gate_up:Q4_0:L": {"BR": 8, "NB": 8, "num_warps": 4},
    "moe_gate_up:Q4_K:L": {"BR": 8, "NB": 8, "num_warps": 4},
    "moe_gate_up:Q5_K:L": {"BR": 8, "NB": 8, "num_warps": 4},
    "moe_gate_up:Q6_K:L": {"BR": 4, "NB": 2, "num_warps": 4},
    "moe_gate_up:Q8_0:L": {"BR": 4, "NB": 16, "num_warps": 4},
}
# The H200's table (2026-11-27): the prompt kernel's winners for Q4_K from labs/prefill_tc.py --sweep on an H200.
H200 = {
    "grouped_bf16:Q4_K:M": {"BR": 128, "BT": 64, "NB": 1, "num_warps": 4},
    "grouped_bf16:Q4_K:S": {"BR": 128, "BT": 32, "NB": 1, "num_warps": 8},
}
OLD_LAUNCH = {
    "default": {**OLD_GEMV_DEFAULT, **OLD_MOE_DEFAULT},
    "NVIDIA H100 80GB HBM3": OLD_H100,
    "NVIDIA H200": H200,
}
OLD_CLASSES = ((1024, "S"), (4096, "M"), (1 << 62, "L"))


def old_launch(kernel: str, qtype: QType, out_rows: int, device_name: str, version: tuple[int, int]) -> dict:
    """triton_gemv.launch as it was (with triton_moe imported), for the installed Triton ``version``."""
    cls = next(name for limit, name in OLD_CLASSES if out_rows <= limit)
    name = QType(qtype).name
    keys = (f"{kernel}:{name}:{cls}", f"{kernel}:{name}:*", f"{kernel}:*:{cls}", f"{kernel}:*:*")
    tv = max((k for k in OLD_BY_TRITON if k <= version), default=None)
    for table in (OLD_LAUNCH.get(device_name, {}), OLD_BY_TRITON[tv] if tv else {}, OLD_LAUNCH["default"]):
        for k in keys:
            if k in table:
                return dict(table[k])
    raise KeyError(f"no launch settings for {kernel}")


KERNELS = sorted({k.split(":")[0] for t in (*OLD_LAUNCH.values(), *OLD_BY_TRITON.values()) for k in t})
QTYPES = (QType.Q4_0, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q5_0, QType.F32)
ROWS = (1, 512, 1024, 1025, 4096, 4097, 6144, 1 << 20)  # every shape class and its edges
DEVICES = ("", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "Some Other GPU")
VERSIONS = ((0, 0), (3, 4), (3, 6), (3, 7), (3, 8), (3, 9), (3, 10), (4, 0))


def _plain(table) -> dict:
    return {k: dict(v) for k, v in table.items()}


def test_the_json_tables_are_the_old_dicts():
    names = ["gemv", "gemv_q4k", "gemv_q8", "grouped", "grouped_bf16", "moe_down", "moe_gate_up", "moe_q4k_down",
             "moe_q4k_gate_up", "moe_q8_down", "moe_q8_gate_up"]  # fmt: skip
    assert names == KERNELS
    assert _plain(ks.DEFAULT) == OLD_LAUNCH["default"]
    assert {k: _plain(v) for k, v in ks.BY_TRITON.items()} == OLD_BY_TRITON
    assert {k: _plain(v) for k, v in ks.BY_DEVICE.items()} == {"NVIDIA_H100_80GB_HBM3": OLD_H100, "NVIDIA_H200": H200}
    # integers stay integers (a float 4.0 would change a constexpr's specialisation)
    for table in (ks.DEFAULT, *ks.BY_TRITON.values(), *ks.BY_DEVICE.values()):
        for settings in table.values():
            assert all(type(v) in (int, str) for v in settings.values()), settings


def test_every_launch_the_code_resolved_resolves_the_same(monkeypatch):
    plain = EngineOptions()
    n = 0
    for version in VERSIONS:
        monkeypatch.setattr(ks, "triton_version", lambda v=version: v)
        for device, kernel, qtype, rows in itertools.product(DEVICES, KERNELS, QTYPES, ROWS):
            want = old_launch(kernel, qtype, rows, device, version)
            got = ks.launch(kernel, qtype, rows, device, plain)
            assert got == want and [type(v) for v in got.values()] == [type(v) for v in want.values()], (
                version, device, kernel, qtype, rows, got, want)  # fmt: skip
            n += 1
    assert n == len(VERSIONS) * len(DEVICES) * len(KERNELS) * len(QTYPES) * len(ROWS)
    with pytest.raises(KeyError, match="no launch settings for nothing"):
        ks.launch("nothing", QType.Q4_K, 1, "", plain)


def test_the_tables_are_read_only_and_launch_hands_out_copies():
    with pytest.raises(TypeError):
        ks.DEFAULT["gemv:*:*"] = {}
    with pytest.raises(TypeError):
        ks.DEFAULT["gemv:*:*"]["BR"] = 1
    with pytest.raises(TypeError):
        ks.BY_TRITON[(3, 9)]["x:*:*"] = {}
    got = ks.launch("gemv", QType.Q4_K, 1, "", EngineOptions())
    got["BR"] = 999
    assert ks.launch("gemv", QType.Q4_K, 1, "", EngineOptions())["BR"] != 999


def test_importing_the_moe_kernels_changes_no_launch_setting():
    """triton_moe used to add its entries to triton_gemv.LAUNCH at import; nothing is mutated any more."""
    import importlib

    before = _plain(ks.DEFAULT)
    from engine.runtime import triton_moe

    importlib.reload(triton_moe)
    assert _plain(ks.DEFAULT) == before


def test_which_kernels_launch():
    q4k = {"gate": (0, QType.Q4_K, 768, 2048), "up": (1 << 20, QType.Q4_K, 768, 2048),
           "down": (2 << 20, QType.Q4_K, 2048, 768)}  # fmt: skip
    q6k_down = dict(q4k, down=(2 << 20, QType.Q6_K, 2048, 768))
    q8 = {r: (o, QType.Q8_0, R, n) for r, (o, _, R, n) in q4k.items()}
    assert ks.moe_kernels(q4k, "q8") == ("moe_q4k_gate_up", "moe_q4k_down")
    assert ks.moe_kernels(q6k_down, "q8") == ("moe_q4k_gate_up", "moe_down")  # h in float into the f32 down
    assert ks.moe_kernels(q8, "q8") == ("moe_q8_gate_up", "moe_q8_down")
    odd = {r: (o, q, 48 if r != "down" else R, n if r != "down" else 48) for r, (o, q, R, n) in q8.items()}
    assert ks.moe_kernels(odd, "q8") == ("moe_gate_up", "moe_down")  # F not a multiple of 32
    assert ks.moe_kernels(q4k, "f32") == ("moe_gate_up", "moe_down")
    assert ks.matmul_kernel(QType.Q4_K, 2048, 1, "q8") == "gemv_q4k"
    assert ks.matmul_kernel(QType.Q4_K, 2048, 2, "q8") == "gemv_q8"
    assert ks.matmul_kernel(QType.Q6_K, 2048, 1, "q8") == "gemv_q8"
    assert ks.matmul_kernel(QType.Q4_K, 2048, 1, "f32") == "gemv"
    assert ks.decode_kernels(ks.TRITON_MAX_T) and not ks.decode_kernels(ks.TRITON_MAX_T + 1)


def test_kernel_family_follows_the_options():
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    interp = EngineOptions(triton_interpret=True)
    ref = EngineOptions(device_kernels="reference")
    if ks.available():
        assert ks.fused(cuda, QType.Q4_K, EngineOptions()) and ks.step_kernels(cuda, EngineOptions())
        assert ks.fused(cpu, QType.Q4_K, interp) and ks.step_kernels(cpu, interp)
    assert not ks.fused(cpu, QType.Q4_K, EngineOptions()) and not ks.step_kernels(cpu, EngineOptions())
    assert not ks.fused(cuda, QType.Q4_K, ref) and not ks.step_kernels(cuda, ref)
    assert not ks.fused(cuda, QType.F16, EngineOptions())  # no Triton kernel for it: the torch reference
    assert (
        ks.compiled(cuda, EngineOptions()) and not ks.compiled(cuda, interp) and not ks.compiled(cpu, EngineOptions())
    )
    assert ks.act_mode(cuda, None, EngineOptions()) == "f32" and ks.act_mode(cuda, "q8", EngineOptions()) == "q8"
    assert ks.act_mode(cpu, None, EngineOptions(device_act="q8")) == "q8"
    # prompts: bfloat16 tensor cores on a compiled CUDA device, float32 in the interpreter, unless the knob says
    assert ks.prefill_precision(cuda, EngineOptions()) == "bf16" and ks.prefill_precision(cuda, interp) == "f32"
    assert ks.prefill_precision(cpu, EngineOptions()) == "f32"
    assert ks.prefill_precision(cuda, EngineOptions(prefill_precision="f32")) == "f32"
    assert ks.prefill_precision(cpu, EngineOptions(triton_interpret=True, prefill_precision="bf16")) == "bf16"
    with pytest.raises(ValueError, match="step mode"):
        ks.graph_act(cuda, True, "sometimes", EngineOptions())
