"""The static decode step's fused kernels (engine.runtime.step_kernels, step_attention) against their torch
references: routing, attention, the q/k rope with the K/V write, the residual add with the RMS norm (and
their q8 copies). In Triton's interpreter on the CPU; compiled on CUDA (marked ``cuda`` there), with the
attention's 32768-position context too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.layers import attention_static, rope_tables, rope_theta
from engine.runtime import references as refs
from engine.runtime import step_attention as sa
from engine.runtime import step_kernels as sk
from engine.runtime import triton_q8 as t8
from tests.triton import BIG, DEVICE

pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _randn(rng: np.random.Generator, device: str, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device)


@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize(("E", "k"), [(8, 2), (60, 4), (128, 8)], ids=["E8-k2", "E60-k4", "E128-k8"])
def test_fused_route_kernel_matches_torch(E, k, renorm, device):
    """step_kernels.route against route_softmax_topk + the slot lookup (references.route_reference)."""
    rng = np.random.default_rng((0, E, k, int(renorm)))
    table = torch.from_numpy(rng.permutation(E).astype(np.int64) * 4096).to(device)
    for _ in range(3):
        logits = torch.from_numpy(rng.standard_normal((1, E)).astype(np.float32) * 3).to(device)
        ids_a, ids_b = (torch.full((1, k), -1, dtype=torch.int64, device=device) for _ in range(2))
        w_a, off_a = sk.route(logits, k, renorm, table, ids_a)
        w_b, off_b = refs.route_reference(logits, k, renorm, table, ids_b)
        assert torch.equal(ids_a, ids_b) and torch.equal(off_a, off_b), (E, k, ids_a, ids_b)
        assert torch.allclose(w_a, w_b, rtol=1e-5, atol=1e-7), (E, k, w_a, w_b)


# (H, Hkv, hd, n_ctx, static length, position, cache dtype): one chunk and several, a chunk wholly past
# the token, GQA groups of 8 / 1 / 4 / 16, bf16 caches, position 0 and the last position of the context;
# compiled, a 32768-position context too
ATTEND_CASES = [
    (8, 2, 64, 64, 16, 5, torch.float32),
    (8, 1, 32, 300, 128, 100, torch.float32),
    (4, 4, 64, 300, 300, 299, torch.bfloat16),
    (8, 2, 64, 64, 64, 0, torch.float32),
    (32, 2, 128, 4096, 2048, 1500, torch.bfloat16),
] + ([(32, 4, 128, 32768, 32768, 20000, torch.float32)] if BIG else [])


def _attend_id(case) -> str:
    H, Hkv, hd, n_ctx, L, pos, dt = case
    return f"H{H}-Hkv{Hkv}-hd{hd}-ctx{n_ctx}-L{L}-pos{pos}-{str(dt).removeprefix('torch.')}"


@pytest.mark.parametrize("case", ATTEND_CASES, ids=[_attend_id(c) for c in ATTEND_CASES])
def test_fused_attention_matches_torch(case, device):
    """step_attention.attend (one launch, or chunks and a merge) against layers.attention_static — GQA
    shapes, f32 and bf16 caches, positions past the token never read (NaN there) — and its q8 copy bit
    for bit triton_q8.quantize_act of its output."""
    H, Hkv, hd, n_ctx, L, pos, dt = case
    g = torch.Generator().manual_seed(ATTEND_CASES.index(case))
    q = torch.randn(1, H, hd, generator=g).to(device)
    kc = torch.randn(n_ctx, Hkv * hd, generator=g).to(dt).to(device)
    vc = torch.randn(n_ctx, Hkv * hd, generator=g).to(dt).to(device)
    kc[pos + 1 :] = float("nan")  # never read: later positions may hold anything
    p = torch.tensor([pos], device=device)
    o, xq = sa.attend(q, kc, vc, p, L, H, Hkv, hd, q8=True)
    assert torch.equal(sa.attend(q, kc, vc, p, L, H, Hkv, hd), o)
    bias = torch.zeros(L, device=device).masked_fill(torch.arange(L, device=device) > pos, float("-inf"))
    K, V = (c[:L].float().nan_to_num(0.0).reshape(L, Hkv, hd) for c in (kc, vc))
    ref = attention_static(q, K, V, bias)
    err = ((o - ref).norm() / ref.norm()).item()
    assert err < 2e-6, (H, Hkv, hd, L, pos, dt, err)
    bad = [int((a != b).sum()) for a, b in zip(xq, t8.quantize_act(o))]  # XQ, XD, XS entries that differ
    assert bad == [0, 0, 0], (H, Hkv, hd, L, pos, dt, bad)


# (H, Hkv, hd, rope dim, NEOX, head norms, cache dtype)
ROPE_CASES = [
    (8, 2, 64, 64, True, True, torch.float32),
    (4, 4, 80, 32, False, False, torch.bfloat16),
    (6, 2, 32, 32, False, True, torch.bfloat16),
    (2, 1, 128, 96, True, False, torch.float32),
]


def _rope_id(case) -> str:
    H, Hkv, hd, rd, neox, norm, kv = case
    rot = "neox" if neox else "pairs"
    return f"H{H}-Hkv{Hkv}-hd{hd}-rd{rd}-{rot}-{'norm' if norm else 'nonorm'}-{str(kv).removeprefix('torch.')}"


@pytest.mark.parametrize("case", ROPE_CASES, ids=[_rope_id(c) for c in ROPE_CASES])
def test_fused_qk_rope_kv_kernel_matches_torch(case, device):
    """step_kernels.qk_rope_kv against the static step's torch ops (references.qk_rope_kv_reference): head
    norms or none, NEOX or pair rotation, partial rope, f32 and bf16 caches (written at the position only)."""
    H, Hkv, hd, rd, neox, norm, kv = case
    rng = np.random.default_rng((1, ROPE_CASES.index(case)))
    theta = torch.from_numpy(rope_theta(np.arange(20), rd, 10000.0)).to(device)
    C, S, perm = rope_tables(torch.cos(theta), torch.sin(theta), hd, neox)
    pos = torch.tensor([13], dtype=torch.int64, device=device)
    q, k, v = _randn(rng, device, 1, H * hd), _randn(rng, device, 1, Hkv * hd), _randn(rng, device, 1, Hkv * hd)
    qn, kn = (_randn(rng, device, hd), _randn(rng, device, hd)) if norm else (None, None)
    caches = [torch.zeros(20, Hkv * hd, dtype=kv, device=device) for _ in range(4)]
    args = (1e-6, C[13:14], S[13:14], perm, pos)
    qa = sk.qk_rope_kv(q, k, v, qn, kn, *args, caches[0], caches[1], H, Hkv, hd)
    qb = refs.qk_rope_kv_reference(q, k, v, qn, kn, *args, caches[2], caches[3], H, Hkv, hd)
    assert torch.allclose(qa, qb, rtol=1e-5, atol=1e-5), (H, hd, (qa - qb).abs().max())
    assert torch.equal(caches[1], caches[3]), "v"
    err = (caches[0].float() - caches[2].float()).abs().max().item()
    assert err <= (1e-5 if kv == torch.float32 else 2e-2), ("k", err)
    assert caches[0][:13].abs().sum() == 0 and caches[0][14:].abs().sum() == 0


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "none"])
@pytest.mark.parametrize("D", [100, 256, 2048])
def test_fused_add_norm_kernel_matches_torch(D, residual, device):
    """step_kernels.add_rms_norm against references.add_rms_norm_reference; where D % 32 == 0 its q8 copy
    too: bit for bit quantize_act of the kernel's own h, and the reference's specification of it."""
    rng = np.random.default_rng((2, D, int(residual)))
    x, y, w = _randn(rng, device, 1, D), _randn(rng, device, 1, D), _randn(rng, device, D)
    yy = y if residual else None
    (xa, ha), (xb, hb) = sk.add_rms_norm(x, yy, w, 1e-6), refs.add_rms_norm_reference(x, yy, w, 1e-6)
    assert torch.equal(xa, xb) and torch.allclose(ha, hb, rtol=1e-5, atol=1e-6), (D, (ha - hb).abs().max())
    if D % 32 == 0:
        xq, hq, q8 = sk.add_rms_norm(x, yy, w, 1e-6, q8=True)
        assert torch.equal(xq, xa) and torch.equal(hq, ha)
        assert all(torch.equal(a, b) for a, b in zip(q8, t8.quantize_act(ha))), D
        q, d, s = refs.quantize_act_reference(ha)
        assert torch.equal(t8.unpack_words(q8[0]), q) and torch.equal(q8[1], d) and torch.equal(q8[2], s), D
        spec, (q, d, s) = refs.add_rms_norm_reference(x, yy, w, 1e-6, q8=True)[2], refs.quantize_act_reference(hb)
        assert torch.equal(t8.unpack_words(spec[0]), q) and torch.equal(spec[1], d) and torch.equal(spec[2], s), D


# (Hk, dk, Hv, dv, conv K, grouping): one key head for two value heads tiled and interleaved, heads not a
# power of two wide, a conv of 3, equal head counts; compiled, Qwen3.6-35B-A3B's and Qwen3-Next-80B's layers
GDN_CASES = [
    (2, 16, 4, 16, 4, "tile"),
    (2, 16, 4, 32, 4, "interleave"),
    (3, 24, 3, 40, 3, "tile"),
    (1, 32, 2, 16, 4, "interleave"),
] + ([(16, 128, 32, 128, 4, "tile"), (16, 128, 32, 128, 4, "interleave")] if BIG else [])


@pytest.mark.parametrize("case", GDN_CASES, ids=["-".join(map(str, c)) for c in GDN_CASES])
def test_fused_delta_net_step_matches_torch(case, device):
    """step_kernels.delta_net_step and gated_norm against the reference layer's one-token torch ops, four tokens
    in a row from a random state: the outputs and both states (the conv window, the delta-rule state) after
    each token."""
    Hk, dk, Hv, dv, K, grouping = case
    rng = np.random.default_rng((Hk, dk, Hv, dv, K))
    C = 2 * Hk * dk + Hv * dv
    conv_w, dt_bias = _randn(rng, device, C, K) * 0.5, _randn(rng, device, Hv)
    A = -torch.exp(_randn(rng, device, Hv))  # ssm_a = −exp(A_log): a decay
    norm = 1 + 0.1 * _randn(rng, device, dv)
    states = [(_randn(rng, device, K - 1, C), _randn(rng, device, Hv, dv, dk) * 0.1) for _ in range(2)]
    states[1] = (states[0][0].clone(), states[0][1].clone())
    for t in range(4):
        qkv, z = _randn(rng, device, 1, C), _randn(rng, device, 1, Hv * dv)
        b, a = _randn(rng, device, 1, Hv), _randn(rng, device, 1, Hv) * (8 if t == 3 else 1)  # softplus' linear side
        args = (conv_w, dt_bias, A, Hk, dk, Hv, dv, grouping, 1e-6)
        o_k = sk.delta_net_step(qkv, b, a, *states[0], *args)
        o_r = refs.delta_net_step_reference(qkv, b, a, *states[1], *args)
        torch.testing.assert_close(o_k, o_r, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states[0][0], states[1][0], rtol=0, atol=0)  # the window: copies, bit for bit
        torch.testing.assert_close(states[0][1], states[1][1], rtol=1e-4, atol=1e-5)
        y_k = sk.gated_norm(o_k, z, norm, Hv, dv, 1e-6)
        y_r = refs.gated_norm_reference(o_r, z, norm, Hv, dv, 1e-6)
        torch.testing.assert_close(y_k, y_r, rtol=1e-4, atol=1e-5)
