"""Grouped-by-expert routed experts: bit-identical to the per-token path, and the CSR bucketing."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels.grouped import bucket_by_expert, bucket_by_expert_ref, grouped_moe_ffn, grouped_moe_ffn_ref
from engine.kernels.moe import moe_ffn
from engine.kernels.prepare import prepare_weight
from engine.kernels.testing import random_weight
from engine.quant.formats import QType

E, F, D = 6, 256, 512


@pytest.fixture(autouse=True)
def _q8_kernels(monkeypatch):
    """These tests pin the integer grouped kernels; large prompts may take the bf16 units instead
    (engine.kernels.bf16, tested in test_bf16_prefill)."""
    from engine.kernels import bf16

    monkeypatch.setattr(bf16, "MODE", bf16.OFF)


FUSED = [
    QType.Q8_0,
    QType.Q4_0,
    QType.Q5_0,
    QType.Q2_K,
    QType.Q3_K,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
    QType.MXFP4,
    QType.IQ4_NL,
    QType.IQ4_XS,
    QType.IQ2_XXS,
    QType.IQ2_XS,
    QType.IQ2_S,
    QType.IQ3_XXS,
    QType.IQ3_S,
]


def _stacks(gate_type: QType, down_type: QType, seed: int = 0):
    rng = np.random.default_rng(seed)
    gate = prepare_weight(gate_type, random_weight(gate_type, (E, F, D), rng))
    up = prepare_weight(gate_type, random_weight(gate_type, (E, F, D), rng))
    down = prepare_weight(down_type, random_weight(down_type, (E, D, F), rng))
    return gate, up, down


def _routing(T: int, K: int, seed: int):
    """Random distinct top-k ids per token (skewed, so some experts get 1-3 tokens, some none)."""
    rng = np.random.default_rng(seed)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    ids = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(T)]).astype(np.int64)
    w = rng.random((T, K), dtype=np.float32)
    w /= w.sum(axis=1, keepdims=True)
    X = rng.standard_normal((T, D), dtype=np.float32)
    return X, ids, w


def _per_token(gate, up, down, X, ids, w, q8_act=True):
    return np.stack([moe_ffn(gate, up, down, X[t], ids[t], w[t], q8_act=q8_act) for t in range(len(X))])


@pytest.mark.parametrize("T,K", [(1, 1), (7, 2), (13, 3), (40, 4)])
def test_bucketing_matches_stable_sort(T, K):
    _, ids, _ = _routing(T, K, seed=T)
    got = bucket_by_expert(ids, E)
    want = bucket_by_expert_ref(ids, E)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    flat = ids.reshape(-1)
    for e in range(E):  # every pair of expert e lands in its bucket, in token order
        assert (flat[got[1][got[0][e] : got[0][e + 1]]] == e).all()


@pytest.mark.parametrize("qtype", FUSED, ids=lambda q: q.name)
def test_grouped_is_bit_identical_to_per_token(qtype):
    gate, up, down = _stacks(qtype, qtype, seed=int(qtype))
    for T, K, seed in [(13, 3, 1), (9, 4, 2), (2, 2, 3), (70, 4, 4)]:  # 70: prompt-sized groups
        X, ids, w = _routing(T, K, seed)
        got = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True)
        want = _per_token(gate, up, down, X, ids, w)
        assert np.array_equal(got, want), f"{qtype.name} T={T}: max |Δ| {np.abs(got - want).max()}"


@pytest.mark.parametrize("gate_type,down_type", [(QType.Q4_K, QType.Q6_K), (QType.Q4_0, QType.Q8_0)])
def test_grouped_mixed_types_bit_identical(gate_type, down_type):
    gate, up, down = _stacks(gate_type, down_type, seed=5)
    X, ids, w = _routing(11, 3, seed=7)
    got = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True)
    assert np.array_equal(got, _per_token(gate, up, down, X, ids, w))


@pytest.mark.parametrize("qtype,q8_act", [(QType.Q4_K, False), (QType.F32, True), (QType.F16, True)])
def test_grouped_gather_path_matches_per_token(qtype, q8_act):
    """Types and modes without a fused kernel take the per-expert gather path."""
    gate, up, down = _stacks(qtype, qtype, seed=3)
    X, ids, w = _routing(10, 3, seed=4)
    got = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=q8_act)
    want = _per_token(gate, up, down, X, ids, w, q8_act=q8_act)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0])
def test_grouped_matches_numpy_reference(qtype):
    gate, up, down = _stacks(qtype, qtype, seed=9)
    X, ids, w = _routing(6, 2, seed=10)
    got = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True)
    want = grouped_moe_ffn_ref(gate, up, down, X, ids, w, q8_act=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _per_token_kept(gate, up, down, X, ids, w, skip, q8_act=True):
    """The per-token kernel over each token's pairs not in ``skip`` (0 where none is left)."""
    out = np.zeros((len(X), down.rows), np.float32)
    for t in range(len(X)):
        keep = ~skip[t]
        if keep.any():
            out[t] = moe_ffn(gate, up, down, X[t], ids[t][keep], w[t][keep], q8_act=q8_act)
    return out


def _skip_mask(ids, seed):
    """Drop about half of the pairs, every pair of token 0 and none of token 1."""
    skip = np.random.default_rng(seed).random(ids.shape) < 0.5
    skip[0] = True
    skip[1] = False
    return skip


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0])
def test_grouped_skip_is_bit_identical_to_per_token_over_the_kept_pairs(qtype):
    """The expert cache's host half of a prompt: hits left out, the misses grouped by expert."""
    gate, up, down = _stacks(qtype, qtype, seed=11)
    for T, K, seed in [(9, 3, 1), (70, 4, 2)]:
        X, ids, w = _routing(T, K, seed)
        skip = _skip_mask(ids, seed)
        got = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True, skip=skip)
        assert np.array_equal(got, _per_token_kept(gate, up, down, X, ids, w, skip)), qtype.name
        assert not got[0].any()
        whole = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True)
        assert np.array_equal(got[1], whole[1])  # nothing dropped: the token's sum unchanged


def test_grouped_skip_gather_path_and_reference():
    gate, up, down = _stacks(QType.F16, QType.F16, seed=12)
    X, ids, w = _routing(10, 3, seed=5)
    skip = _skip_mask(ids, 5)
    got = grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True, skip=skip)
    want = _per_token_kept(gate, up, down, X, ids, w, skip)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    gq, uq, dq = _stacks(QType.Q4_K, QType.Q4_K, seed=13)
    ref = grouped_moe_ffn_ref(gq, uq, dq, X, ids, w, q8_act=True, skip=skip)
    got = grouped_moe_ffn(gq, uq, dq, X, ids, w, q8_act=True, skip=skip)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert not ref[0].any()
    with pytest.raises(ValueError):
        grouped_moe_ffn(gq, uq, dq, X, ids, w, q8_act=True, skip=skip[:, :2])


def test_ops_moe_ffn_skip_one_token_and_all_kept():
    """ops.moe_ffn: one token takes the fused per-token kernel over its kept pairs; an all-False mask is
    the call without one."""
    from engine import ops

    gate, up, down = _stacks(QType.Q4_K, QType.Q4_K, seed=14)
    X, ids, w = _routing(3, 3, seed=6)
    skip = np.array([[False, True, False]])
    got = ops.moe_ffn(gate, up, down, X[:1], ids[:1], w[:1], q8_act=True, skip=skip)
    assert np.array_equal(got, _per_token_kept(gate, up, down, X[:1], ids[:1], w[:1], skip))
    none = ops.moe_ffn(gate, up, down, X[:1], ids[:1], w[:1], q8_act=True, skip=np.ones((1, 3), bool))
    assert none.shape == (1, D) and not none.any()
    kept = ops.moe_ffn(gate, up, down, X, ids, w, q8_act=True, skip=np.zeros(ids.shape, bool))
    assert np.array_equal(kept, ops.moe_ffn(gate, up, down, X, ids, w, q8_act=True))


def test_grouped_rejects_bad_ids():
    gate, up, down = _stacks(QType.Q8_0, QType.Q8_0)
    X, ids, w = _routing(3, 2, seed=0)
    ids[1, 0] = E
    with pytest.raises(IndexError):
        grouped_moe_ffn(gate, up, down, X, ids, w, q8_act=True)
    with pytest.raises(ValueError):
        grouped_moe_ffn(gate, up, down, X[:, :-32], ids, w, q8_act=True)


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0])
def test_quantize_rows_equals_quantize_for(qtype):
    from engine.kernels.grouped import quantize_rows
    from engine.kernels.moe_fused import quantize_for

    X = np.random.default_rng(1).standard_normal((70, 512), dtype=np.float32)
    for got, want in zip(quantize_rows(int(qtype), X), quantize_for(int(qtype), X)):
        assert np.array_equal(got, want)
