"""Which q8 (dp4a) kernels run where (engine.runtime.kernel_select): the activation rounding of routed
experts and trunk matrices, the launch tables by Triton version, the bench report's naming of them. The
kernels themselves against their references: tests/triton/test_q8.py (Triton's interpreter, or CUDA)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_moe_act_follows_the_models_activation_rounding(monkeypatch):
    """Routed experts decode on q8 activations on a compiled CUDA device inside a graph capture when the
    model rounds its activations like llama.cpp (q8_act) and the lean Q4_K gate/up kernel applies; exact
    float otherwise; $SHARPI_DEVICE_ACT overrides."""
    torch = pytest.importorskip("torch")
    from engine.config import EngineOptions
    from engine.quant.formats import QType
    from engine.runtime import kernel_select as ks

    plain = EngineOptions()  # neither SHARPI_DEVICE_ACT nor TRITON_INTERPRET
    q4k = {
        "gate": (0, QType.Q4_K, 768, 2048),
        "up": (884736, QType.Q4_K, 768, 2048),
        "down": (1769472, QType.Q4_K, 2048, 768),
    }
    q6k_down = dict(q4k, down=(1769472, QType.Q6_K, 2048, 768))  # a Q4_K_M layer with more bits
    q6k = {r: (o, QType.Q6_K, R, n) for r, (o, _, R, n) in q4k.items()}
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    EAGER, CAPTURED = ks.EAGER, ks.CAPTURED

    def act(device, q8_act, roles, step=None, options=plain):
        return ks.moe_act(device, q8_act, roles, step, options)

    assert act(cuda, True, q4k, EAGER) == "f32"  # eager launches
    assert act(cuda, True, q4k, CAPTURED) == "q8"
    assert act(cuda, True, q6k_down, CAPTURED) == "q8"  # lean gate/up, exact-float down
    assert act(cuda, False, q4k, CAPTURED) == "f32"  # --exact-float
    assert act(cuda, True, q6k, CAPTURED) == "f32"  # the general q8 kernels are not faster
    assert act(cpu, True, q4k, CAPTURED) == "f32"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # by default, torch is asked
    assert act(cuda, True, q4k) == "q8"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert act(cuda, True, q4k) == "f32"
    assert act(cuda, True, q4k, CAPTURED, EngineOptions.from_env({"TRITON_INTERPRET": "1"})) == "f32"
    assert act(cuda, False, q6k, options=EngineOptions.from_env({"SHARPI_DEVICE_ACT": "q8"})) == "q8"


def test_trunk_act_and_the_small_matrix_rule(monkeypatch):
    """Trunk matrices multiply one token on q8 activations (triton_q4k_gemv) on a compiled CUDA device
    inside a graph capture when the model rounds like llama.cpp and the matrix is Q4_K; exact float
    otherwise, and for a matrix under MIN_BYTES_OWN_QUANT that would quantize x itself (its own launch
    costs more than q8 saves); $SHARPI_DEVICE_ACT overrides. DeviceLinear reports its bytes exactly
    when it is not handed x̂."""
    import numpy as np

    torch = pytest.importorskip("torch")
    from engine.bench.calibrate import random_blocks
    from engine.config import EngineOptions
    from engine.kernels.prepare import prepare_weight
    from engine.quant.formats import QType
    from engine.runtime import device as dv
    from engine.runtime import kernel_select as ks
    from engine.runtime import triton_gemv as tg
    from engine.runtime import triton_q4k_gemv as qg

    plain, forced = EngineOptions(), EngineOptions.from_env({"SHARPI_DEVICE_ACT": "q8"})
    CAPTURED = ks.CAPTURED
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    small, big = qg.MIN_BYTES_OWN_QUANT - 1, qg.MIN_BYTES_OWN_QUANT

    def act(device, q8_act, qtype, n, step=None, own_quant_bytes=None, options=plain):
        return ks.trunk_act(device, q8_act, qtype, n, step, own_quant_bytes, options)

    assert act(cuda, True, QType.Q4_K, 2048, CAPTURED) == "q8"
    assert act(cuda, True, QType.Q4_K, 2048, CAPTURED, own_quant_bytes=big) == "q8"
    assert act(cuda, True, QType.Q4_K, 2048, CAPTURED, own_quant_bytes=small) == "f32"
    assert act(cuda, True, QType.Q4_K, 2048, ks.EAGER) == "f32"  # eager launches
    assert act(cuda, False, QType.Q4_K, 2048, CAPTURED) == "f32"  # --exact-float
    assert act(cuda, True, QType.Q6_K, 2048, CAPTURED) == "f32"
    assert act(cuda, True, QType.Q4_K, 2048 + 32, CAPTURED) == "f32"  # n not whole blocks
    assert act(cpu, True, QType.Q4_K, 2048, CAPTURED) == "f32"
    assert act(cpu, False, QType.Q6_K, 2048, options=forced) == "q8"
    assert act(cpu, False, QType.Q4_K, 2048, own_quant_bytes=small, options=forced) == "q8"  # forced
    seen = []
    monkeypatch.setattr(ks, "trunk_act", lambda *a, own_quant_bytes=None, **k: seen.append(own_quant_bytes) or "f32")
    monkeypatch.setattr(tg, "matmul", lambda raw, x, q, r, n, cfg=None, act=None, xq=None, options=None: x[:, :r])
    rng = np.random.default_rng(0)
    lin = dv.DeviceLinear(prepare_weight(QType.Q4_K, random_blocks(QType.Q4_K, 64, 256, rng)),
                          dv.DeviceArena(cpu, 1 << 30), "trunk", options=EngineOptions(triton_interpret=True))  # fmt: skip
    x = torch.zeros(1, 256)
    lin(x)
    lin(x, (x, x, x))
    assert seen == [lin.raw.numel(), None]


def test_launch_settings_follow_the_installed_triton(monkeypatch):
    """The Triton-version tables (launch/triton=X.Y.json): the newest not newer than the installed Triton
    applies, none before 3.7; a GPU's own table still comes first and the default fills what the version
    table leaves out; SHARPI_TRITON_TABLE picks another version's (or none)."""
    from engine.config import EngineOptions
    from engine.errors import UsageError
    from engine.quant.formats import QType
    from engine.runtime import kernel_select as ks

    assert ks.triton_table((3, 6)) == {}
    assert ks.triton_table((3, 7)) is ks.BY_TRITON[(3, 7)]
    assert ks.triton_table((3, 10)) is ks.BY_TRITON[max(ks.BY_TRITON)]
    assert ks.triton_table((4, 0)) is ks.BY_TRITON[max(ks.BY_TRITON)]
    plain = EngineOptions()
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 6))
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, options=plain)["TILE"] == "halves"
    v38 = EngineOptions.from_env({"SHARPI_TRITON_TABLE": "3.8"})  # another version's settings, on purpose
    assert ks.triton_table(options=v38) is ks.BY_TRITON[(3, 8)]
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 9))
    assert ks.triton_table(options=EngineOptions.from_env({"SHARPI_TRITON_TABLE": "none"})) == {}
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, options=plain)["TILE"] == "rows"
    assert ks.launch("gemv_q4k", QType.Q4_K, 4096, options=plain) == ks.DEFAULT["gemv_q4k:*:M"]  # 3.9 keeps it
    assert ks.launch("gemv_q4k", QType.Q4_K, 512, options=plain) == ks.DEFAULT["gemv_q4k:*:*"]  # no S entry
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 8))
    assert ks.launch("gemv_q4k", QType.Q4_K, 4096, options=plain) == ks.BY_TRITON[(3, 8)]["gemv_q4k:*:M"]
    assert ks.triton_table_version(options=plain) == (3, 8)
    with pytest.raises(UsageError, match="SHARPI_TRITON_TABLE"):
        EngineOptions.from_env({"SHARPI_TRITON_TABLE": "three"})
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 9))
    # a GPU's own table (device=Some_GPU.json) first; SHARPI_LAUNCH_TABLE's before it
    monkeypatch.setattr(ks, "BY_DEVICE", {"Some_GPU": {"moe_q4k_gate_up:*:*": {"BR": 4, "num_warps": 1}}})
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, "Some GPU", plain) == {"BR": 4, "num_warps": 1}
    mine = EngineOptions(launch_table={"moe_q4k_gate_up:*:*": {"BR": 2, "num_warps": 1}})
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, "Some GPU", mine) == {"BR": 2, "num_warps": 1}


def test_device_kernels_report_names_the_triton_and_its_table():
    pytest.importorskip("torch")
    from engine.bench import device_kernels as dk

    rep = {"device": "GPU", "bandwidth_gb_s": 3000.0, "types": {}}
    lines = dk.report_lines({**rep, "triton": "3.9.0", "triton_table": (3, 9)})
    assert any("Triton 3.9.0" in ln and "launch/triton=3.9.json" in ln for ln in lines)
    lines = dk.report_lines({**rep, "triton": "3.6.0", "triton_table": None})
    assert any("Triton 3.6.0" in ln and "triton=" not in ln for ln in lines)
