"""FusedTorchOps (the eager device layers' ops: fewer, larger launches) against TorchOps, the reference, op by op
and through whole layers: equal up to float32 rounding, on the CPU and, where there is one, on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.kv_cache import KVCache
from engine.models.layers import attention, attention_fused, rope_theta
from engine.models.ops import FusedTorchOps, TorchOps

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]
H, HKV, HD = 8, 2, 32


def _t(rng, *shape, device="cpu"):
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(device)


def _close(a, b, tol=2e-5):
    err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
    assert err <= tol, err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("start", "T", "window", "scale"), [(0, 9, 0, None), (5, 7, 0, None), (0, 12, 4, None),
                                                           (3, 1, 0, 0.3), (6, 6, 3, 0.2)])  # fmt: skip
def test_attention_fused_equals_attention(device, start, T, window, scale):
    rng = np.random.default_rng(start * 31 + T)
    P = start + T
    q, k, v = _t(rng, T, H, HD, device=device), _t(rng, P, HKV, HD, device=device), _t(rng, P, HKV, HD, device=device)
    _close(attention_fused(q, k, v, start, window, scale), attention(q, k, v, start, window, scale))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_over_a_window_span_equals_the_full_keys(device):
    """A sliding-window layer's ring gives only the positions its queries see (``k_start`` on): the same output
    as the full keys, through the reference and the SDPA path."""
    rng = np.random.default_rng(4)
    start, T, window = 9, 5, 4
    P, p0 = start + T, start - window + 1
    q, k, v = _t(rng, T, H, HD, device=device), _t(rng, P, HKV, HD, device=device), _t(rng, P, HKV, HD, device=device)
    full = attention(q, k, v, start, window)
    _close(attention(q, k[p0:], v[p0:], start, window, k_start=p0), full)
    _close(attention_fused(q, k[p0:], v[p0:], start, window, k_start=p0), full)


def test_attention_fused_falls_back_for_a_long_context(monkeypatch):
    """Past the priced scratch the widened K/V copies are not made: the row-blocked reference serves."""
    import engine.models.layers as layers

    calls = []
    real = layers.attention
    monkeypatch.setattr(layers, "attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(layers, "ATTN_SCORE_BYTES", 1024)
    rng = np.random.default_rng(0)
    q, k, v = _t(rng, 4, H, HD), _t(rng, 40, HKV, HD), _t(rng, 40, HKV, HD)
    _close(attention_fused(q, k, v, 36), real(q, k, v, 36))
    assert calls == [1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("neox", "rope_dim", "head_norm"), [(True, HD, True), (False, HD, False), (True, 16, True)])
def test_fused_ops_equal_the_reference(device, neox, rope_dim, head_norm):
    """add_norm, rms_norm, rope_store (K/V written alike) and attend of both ops on the same inputs."""
    rng = np.random.default_rng(7)
    T, start, D = 6, 4, 64
    a = SimpleNamespace(n_head=H, n_head_kv=HKV, head_dim=HD, rms_eps=1e-6, rope_neox=neox)
    attn = SimpleNamespace(a=a, i=0, window=0, scale=None, sinks=None)
    theta = torch.from_numpy(rope_theta(np.arange(start, start + T), rope_dim, 10000.0)).to(device)
    cos, sin = torch.cos(theta), torch.sin(theta)
    caches = [KVCache({0: torch.device(device)}, 16, HKV * HD) for _ in range(2)]
    past = _t(rng, start, HKV * HD, device=device), _t(rng, start, HKV * HD, device=device)
    ops = []
    for c, kind in zip(caches, (TorchOps, FusedTorchOps)):
        c.write(0, 0, *past)
        ops.append(kind(start, c, cos, sin))
    ref, fast = ops
    x, y, w = _t(rng, T, D, device=device), _t(rng, T, D, device=device), _t(rng, D, device=device)
    for got, want in zip(fast.add_norm(x, y, w, 1e-6)[:2], ref.add_norm(x, y, w, 1e-6)[:2]):
        _close(got, want)
    _close(fast.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    q, k, v = (
        _t(rng, T, H * HD, device=device),
        _t(rng, T, HKV * HD, device=device),
        _t(rng, T, HKV * HD, device=device),
    )
    norms = (_t(rng, HD, device=device), _t(rng, HD, device=device)) if head_norm else None
    qf, qr = fast.rope_store(attn, q, k, v, norms), ref.rope_store(attn, q, k, v, norms)
    _close(qf, qr)
    for got, want in zip(caches[1].read(0, start + T), caches[0].read(0, start + T)):
        _close(got, want)
    _close(fast.attend(attn, qr)[0], ref.attend(attn, qr)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_rows_on_the_device_equal_the_hosts(device):
    """A prompt's embeddings made on the device (``embedding_rows``: raw rows up, decoded there) are the host's
    exactly, for every weight type a token_embd can have."""
    from engine.gguf.reader import TensorRef
    from engine.models.weights import Embedding
    from engine.quant import WEIGHT_TYPES, quantize
    from engine.runtime.device import embedding_rows

    rng = np.random.default_rng(7)
    ids = np.array([5, 0, 63, 5, 17, 40, 2])
    for qt in WEIGHT_TYPES:
        x = (rng.standard_normal((64, 256)) * 2).astype(np.float32)
        data = np.ascontiguousarray(quantize(x, qt))
        ref = TensorRef("token_embd.weight", qt, (64, 256), data.nbytes, 0, data)
        got = embedding_rows(ref, ids, torch.device(device))
        assert got.device.type == device and got.dtype == torch.float32
        assert torch.equal(got.cpu(), Embedding(ref)(ids)), qt.name
