"""engine.bench.device_kernels: the bytes each workload's launches read, and the settings the tuner sweeps.
(The read floor's kernel itself: tests/triton/test_read_floor.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")


def test_launch_bytes_cover_each_workload():
    from engine.bench import device_kernels as dk
    from engine.quant.formats import QType, block_format

    for q in (QType.Q4_K, QType.Q6_K, QType.Q8_0):
        assert sum(dk.launch_bytes(q, "moe")) == dk._moe_bytes(q)
        assert len(dk.launch_bytes(q, "qkv")) == 3
        assert dk.launch_bytes(q, "q") == [4096 * block_format(q).row_bytes(2048)]


def test_the_tuner_sweeps_the_kernels_each_type_runs():
    """`bench device-kernels --tune` times, per type, the settings of the kernels q8 mode runs at one
    token (Q4_K: triton_q4k_gemv and triton_q4k_moe; others: the general q8 kernels), with the same
    knobs as the default launch table's entry for that key, and at the shape class the workloads use."""
    from engine.bench import device_kernels as dk
    from engine.quant.formats import QType
    from engine.runtime import kernel_select as ks
    from engine.runtime import triton_gemv as tg

    rows = {"gemv_q4k": (4096, 512), "gemv_q8": (4096, 512, 4096 + 1024), "moe_q4k_gate_up": (dk.F * dk.KE,),
            "moe_q8_gate_up": (dk.F * dk.KE,), "moe_q4k_down": (dk.D,), "moe_q8_down": (dk.D,)}  # fmt: skip
    for q in tg.SUPPORTED:
        keys = [k for k, _ in dk._tune_targets(QType(q))]
        kernels = {k.split(":")[0] for k in keys}
        assert kernels == ({"gemv_q4k", "moe_q4k_gate_up", "moe_q4k_down"} if q == QType.Q4_K else
                           {"gemv_q8", "moe_q8_gate_up", "moe_q8_down"}), (q, kernels)  # fmt: skip
        for key in keys:
            kernel, _, cls = key.split(":")
            assert cls in {ks.shape_class(r) for r in rows[kernel]}, key
            default = ks.launch(kernel, QType(q), next(r for r in rows[kernel] if ks.shape_class(r) == cls))
            cands = dk._candidates(kernel, QType(q), cls)
            assert cands and all(set(c) == set(default) for c in cands), (key, default, cands[0])
