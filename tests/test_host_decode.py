"""The numba host decode steps (engine.models.layers *_host) against their torch twins."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.api import LoadOptions, Session
from engine.models.layers import (
    apply_rope,
    attention,
    attention_host,
    qk_norm_rope_host,
    rms_norm,
    rms_norm_host,
    rope_theta,
    route_host,
    route_softmax_topk,
)
from engine.synth.writer import write_model
from tests.oracle import random_tokens


def _rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_host(weighted):
    x = _rng().standard_normal(384, dtype=np.float32) * 3
    w = _rng(1).standard_normal(384, dtype=np.float32) if weighted else None
    want = rms_norm(torch.from_numpy(x), None if w is None else torch.from_numpy(w), 1e-6).numpy()
    got = rms_norm_host(x, np.zeros(0, np.float32) if w is None else w, 1e-6)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [None, "head", "proj"])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_qk_norm_rope_host(qk_norm, neox, rope_dim):
    H, Hkv, hd, eps = 4, 2, 64, 1e-6
    r = _rng(2)
    q, k = r.standard_normal(H * hd, dtype=np.float32), r.standard_normal(Hkv * hd, dtype=np.float32)
    n = {"head": (hd, hd), "proj": (H * hd, Hkv * hd)}.get(qk_norm, (0, 0))
    qn, kn = r.standard_normal(n[0], dtype=np.float32), r.standard_normal(n[1], dtype=np.float32)
    theta = torch.from_numpy(rope_theta(np.array([37]), rope_dim, 1e6))
    cos, sin = torch.cos(theta), torch.sin(theta)  # [1, rope_dim/2]
    tq, tk = torch.from_numpy(q.copy())[None], torch.from_numpy(k.copy())[None]
    if qk_norm == "proj":
        tq, tk = rms_norm(tq, torch.from_numpy(qn), eps), rms_norm(tk, torch.from_numpy(kn), eps)
    tq, tk = tq.reshape(1, H, hd), tk.reshape(1, Hkv, hd)
    if qk_norm == "head":
        tq, tk = rms_norm(tq, torch.from_numpy(qn), eps), rms_norm(tk, torch.from_numpy(kn), eps)
    want_q = apply_rope(tq, cos, sin, neox).reshape(-1).numpy()
    want_k = apply_rope(tk, cos, sin, neox).reshape(-1).numpy()
    mode = {None: 0, "head": 1, "proj": 2}[qk_norm]
    qk_norm_rope_host(q, k, qn, kn, mode, eps, cos.numpy()[0], sin.numpy()[0], neox, H, Hkv, hd)
    np.testing.assert_allclose(q, want_q, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(k, want_k, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("H,Hkv,P", [(4, 2, 1), (8, 2, 37), (4, 4, 130)])
def test_attention_host(H, Hkv, P):
    hd = 64
    r = _rng(3)
    q = r.standard_normal(H * hd, dtype=np.float32)
    K = r.standard_normal((P + 5, Hkv * hd), dtype=np.float32)  # the cache holds more rows than P
    V = r.standard_normal((P + 5, Hkv * hd), dtype=np.float32)
    want = attention(
        torch.from_numpy(q).reshape(1, H, hd),
        torch.from_numpy(K[:P]).reshape(P, Hkv, hd),
        torch.from_numpy(V[:P]).reshape(P, Hkv, hd),
        P - 1,
    ).numpy()[0]
    np.testing.assert_allclose(attention_host(q, K, V, P, H, Hkv, hd), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renorm", [True, False])
def test_route_host(renorm):
    for seed in range(5):
        logits = _rng(seed).standard_normal(64, dtype=np.float32) * 3
        ids, w = route_host(logits, 8, renorm)
        tids, tw = route_softmax_topk(torch.from_numpy(logits)[None], 8, renorm)
        np.testing.assert_array_equal(ids, tids.numpy()[0])
        np.testing.assert_allclose(w, tw.numpy()[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "qwen2moe", "llama"])
def test_host_decode_matches_torch_layers(tmp_path, arch):
    """Token-by-token logits with the numba host steps equal those of the torch layers (F32)."""
    geo = {"experts": 4, "experts_used": 2} if arch == "llama" else {}
    path = write_model(tmp_path / f"{arch}.gguf", arch, seed=5, layers=2, **geo).path
    tokens = random_tokens(12, 1024, seed=2)
    with Session.load(str(path), LoadOptions(n_ctx=32, device="cpu")) as s:
        assert all(layer.host for layer in s.model.layers)
        fast = s.logits(tokens, batch=False)
        for layer in s.model.layers:
            layer.host = False
        slow = s.logits(tokens, batch=False)
    assert np.abs(fast - slow).max() <= 1e-5 * max(1.0, np.abs(slow).max())


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_fused_host_step_is_bit_identical(tmp_path, arch):
    """The one-call host step (engine.models.host) equals the step-by-step host path exactly,
    on a quantized file mixing types the way Q4_K_M files do."""
    path = write_model(
        tmp_path / f"{arch}.gguf", arch, seed=6, layers=2, weight_type="Q4_K",
        type_overrides={"*attn_v*": "Q8_0", "*ffn_down_exps*": "Q6_K", "*attn_output*": "Q5_0"},
    ).path  # fmt: skip
    tokens = random_tokens(10, 1024, seed=3)
    with Session.load(str(path), LoadOptions(n_ctx=32, device="cpu")) as s:
        assert all(layer.fused is not None for layer in s.model.layers)
        fused = s.logits(tokens, batch=False)
        routes = [layer.ffn.last_ids.clone() for layer in s.model.layers]
        calls = s.stats().calls.copy()
        for layer in s.model.layers:
            layer.fused = None
        s.reset_stats()
        stepwise = s.logits(tokens, batch=False)
        assert [torch.equal(r, layer.ffn.last_ids) for r, layer in zip(routes, s.model.layers)] == [True] * 2
        np.testing.assert_array_equal(s.stats().calls, calls)  # the profiler saw the same routes
    assert np.array_equal(fused, stepwise)
