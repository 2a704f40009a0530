"""Routing kinds (engine.models.layers.ROUTERS) against numpy references, and through the ops that route."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.experts import StepPlan
from engine.models.host import HostOps
from engine.models.layers import Routing, route
from engine.models.ops import TorchOps
from engine.runtime.step_ops import DeviceStepOps


def sigmoid_bias_reference(logits: np.ndarray, k: int, renormalise: bool, bias: np.ndarray):
    """numpy: sigmoid scores, the k largest of scores + bias chosen, weighted by the unbiased scores."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))  # [T, E]
    ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, ids, axis=-1)
    if renormalise:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


@pytest.mark.parametrize("renormalise", [True, False])
def test_sigmoid_routing_with_a_selection_bias(renormalise):
    rng = np.random.default_rng(0)
    T, E, k = 7, 64, 8
    logits = rng.standard_normal((T, E), dtype=np.float32) * 2
    bias = rng.standard_normal(E, dtype=np.float32)  # large enough to change the choice
    r = Routing(k=k, renormalise=renormalise, kind="sigmoid", bias=torch.from_numpy(bias))
    want_ids, want_w = sigmoid_bias_reference(logits, k, renormalise, bias)
    assert not np.array_equal(want_ids, sigmoid_bias_reference(logits, k, renormalise, 0 * bias)[0])
    ids, w = route(torch.from_numpy(logits), r)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-6, atol=1e-7)
    # The ops every placement routes with serve it (no fast path names this kind: they fall back to it).
    moe = SimpleNamespace(
        i=0, routing=r, experts=SimpleNamespace(step_plan=lambda i: StepPlan(device=True, host=False))
    )
    got_torch = TorchOps(0, None, None, None).route(moe, torch.from_numpy(logits))
    got_host = HostOps(0, None, None, None).route(moe, logits)
    record = torch.zeros((1, k), dtype=torch.int64)  # a decode graph's route record, one token
    step = DeviceStepOps(*[None] * 7, routes={0: record}, consts={}, fused=True)
    got_step = step.route(moe, torch.from_numpy(logits[:1]))
    np.testing.assert_array_equal(record.numpy(), want_ids[:1])
    for got in (got_torch, got_host, got_step):
        n = len(got.ids)  # the device step routes one token
        np.testing.assert_array_equal(np.asarray(got.ids), want_ids[:n])
        np.testing.assert_allclose(np.asarray(got.weights), want_w[:n], rtol=1e-6, atol=1e-7)
