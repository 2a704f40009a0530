"""engine.bench.read_floor: the pure-read kernel behind the bench's read floor reads every word of its
buffer exactly once (the XOR of each program's words), tail included, in Triton's interpreter."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = r"""
import numpy as np, torch
from engine.bench import read_floor as rf

gen = np.random.default_rng(3)
for nwords in (rf.PER, 3 * rf.PER - 77):  # whole programs, and a ragged tail
    w = torch.from_numpy(gen.integers(-2**31, 2**31 - 1, nwords, dtype=np.int64).astype(np.int32))
    grid = -(-nwords // rf.PER)
    y = torch.zeros(grid, dtype=torch.int32)
    rf._read_kernel[(grid,)](w, w.view(torch.uint8), y, nwords, 0, 0, STEPS=rf.STEPS, NT=rf.NT, PDL=0)
    pad = np.zeros(grid * rf.PER, dtype=np.int32)
    pad[:nwords] = w.numpy()
    want = np.bitwise_xor.reduce(pad.reshape(grid, rf.PER), axis=1)
    assert np.array_equal(y.numpy(), want), (y, want)
print("ok")
"""


def test_read_kernel_reads_every_word_once():
    from tests.triton_data import run_script

    env = dict(os.environ, TRITON_INTERPRET="1")
    assert run_script(SCRIPT, [], env).strip().endswith("ok")


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
