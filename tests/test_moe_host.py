"""The host node's experts (engine.kernels.moe_host): called through its C address on a descriptor of raw
pointers, it gives exactly the fused per-token kernel's result (engine.kernels.moe.moe_ffn), for every
fused weight type; expert ids outside the layer give zeros and a status instead of reading past a stack."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.experts import ExpertStacks
from engine.kernels import moe_host, moe_host_node
from engine.kernels.moe import moe_ffn
from engine.kernels.prepare import prepare_weight
from engine.kernels.testing import random_weight
from engine.quant.formats import QType

E, F, D, K = 8, 256, 512, 4


def _stacks(gt: QType, dt: QType, rng) -> ExpertStacks:
    g, u = (prepare_weight(gt, random_weight(gt, (E, F, D), rng)) for _ in range(2))
    return ExpertStacks(g, u, prepare_weight(dt, random_weight(dt, (E, D, F), rng)))


def _node():
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p)(moe_host_node.node_address())


@pytest.mark.parametrize(
    ("gt", "dt"),
    [
        (QType.Q4_K, QType.Q6_K),
        (QType.Q4_K, QType.Q4_K),
        (QType.Q5_K, QType.Q8_0),
        (QType.Q8_0, QType.Q4_0),
        (QType.Q5_0, QType.Q5_K),
    ],
)
def test_host_node_equals_the_fused_token_kernel(gt, dt):
    rng = np.random.default_rng(int(gt) * 100 + int(dt))
    st = _stacks(gt, dt, rng)
    assert moe_host.applies(st, q8_act=True) and not moe_host.applies(st, q8_act=False)
    h = rng.standard_normal((1, D), dtype=np.float32)
    w = rng.random(K, dtype=np.float32)
    ids = np.array([5, 0, 7, 2], np.int64)
    y = np.full(D, np.nan, np.float32)
    d = moe_host.descriptor(st, h, w, ids, y)
    _node()(d.ctypes.data)
    assert d[moe_host.STATUS] == 0
    assert np.array_equal(y, moe_ffn(st.gate, st.up, st.down, h[0], ids, w, q8_act=True))
    ids[:] = [1, 1, 6, 3]  # the descriptor reads the hand-over arrays afresh each call
    _node()(d.ctypes.data)
    assert np.array_equal(y, moe_ffn(st.gate, st.up, st.down, h[0], ids, w, q8_act=True))


@pytest.mark.parametrize("bad", [E, -1, 1 << 40])
def test_ids_outside_the_layer_give_zeros_and_a_status(bad):
    st = _stacks(QType.Q4_K, QType.Q6_K, np.random.default_rng(1))
    y = np.ones(D, np.float32)
    ids = np.array([0, 1, bad, 2], np.int64)
    d = moe_host.descriptor(st, np.ones((1, D), np.float32), np.ones(K, np.float32), ids, y)
    _node()(d.ctypes.data)
    assert d[moe_host.STATUS] == 1 and not y.any()


def test_descriptor_refuses_arrays_that_do_not_fit():
    st = _stacks(QType.Q4_K, QType.Q6_K, np.random.default_rng(2))
    ok = dict(
        h=np.ones(D, np.float32), weights=np.ones(K, np.float32), ids=np.zeros(K, np.int64), y=np.ones(D, np.float32)
    )
    for key, bad in [("h", np.ones(D - 1, np.float32)), ("ids", np.zeros(K, np.int32)), ("y", np.ones(2 * D, np.float32)[::2]),
                     ("weights", np.ones(K + 1, np.float32))]:  # fmt: skip
        with pytest.raises(ValueError):
            moe_host.descriptor(st, **{**ok, key: bad})
    mixed = ExpertStacks(
        st.gate, prepare_weight(QType.Q8_0, random_weight(QType.Q8_0, (E, F, D), np.random.default_rng(3))), st.down
    )
    assert not moe_host.applies(mixed, q8_act=True)  # gate and up of different types: the fused kernel takes one
