"""The numba host twins (engine.models.host) against the torch layers, and the fused decode step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.api import LoadOptions, Session
from engine.kernels.host_layers import store_kv_rows
from engine.models.host import attention_rows, host_kv, qk_norm_rope_rows, rms_norm_rows, route_rows
from engine.models.layers import apply_rope, attention, rms_norm, rope_theta, route_softmax_topk
from engine.synth.writer import write_model
from tests.oracle import random_tokens


def _rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_rows(weighted):
    x = _rng().standard_normal((3, 384), dtype=np.float32) * 3
    w = _rng(1).standard_normal(384, dtype=np.float32) if weighted else None
    want = rms_norm(torch.from_numpy(x), None if w is None else torch.from_numpy(w), 1e-6).numpy()
    got = rms_norm_rows(x, np.zeros(0, np.float32) if w is None else w, 1e-6)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [None, "head", "proj"])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_qk_norm_rope_rows(qk_norm, neox, rope_dim):
    T, H, Hkv, hd, eps = 3, 4, 2, 64, 1e-6
    r = _rng(2)
    q, k = r.standard_normal((T, H * hd), dtype=np.float32), r.standard_normal((T, Hkv * hd), dtype=np.float32)
    n = {"head": (hd, hd), "proj": (H * hd, Hkv * hd)}.get(qk_norm, (0, 0))
    qn, kn = r.standard_normal(n[0], dtype=np.float32), r.standard_normal(n[1], dtype=np.float32)
    theta = torch.from_numpy(rope_theta(np.array([37, 38, 90]), rope_dim, 1e6))
    cos, sin = torch.cos(theta), torch.sin(theta)  # [T, rope_dim/2]
    tq, tk = torch.from_numpy(q.copy()), torch.from_numpy(k.copy())
    if qk_norm == "proj":
        tq, tk = rms_norm(tq, torch.from_numpy(qn), eps), rms_norm(tk, torch.from_numpy(kn), eps)
    tq, tk = tq.reshape(T, H, hd), tk.reshape(T, Hkv, hd)
    if qk_norm == "head":
        tq, tk = rms_norm(tq, torch.from_numpy(qn), eps), rms_norm(tk, torch.from_numpy(kn), eps)
    want_q = apply_rope(tq, cos, sin, neox).reshape(T, -1).numpy()
    want_k = apply_rope(tk, cos, sin, neox).reshape(T, -1).numpy()
    mode = {None: 0, "head": 1, "proj": 2}[qk_norm]
    qk_norm_rope_rows(q, k, qn, kn, mode, eps, cos.numpy(), sin.numpy(), neox, H, Hkv, hd)
    np.testing.assert_allclose(q, want_q, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(k, want_k, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "H,Hkv,start,T,hd",
    [
        (4, 2, 0, 1, 64),
        (8, 2, 36, 1, 64),
        (4, 4, 129, 1, 64),
        (8, 2, 0, 9, 64),
        (4, 1, 5, 6, 64),
        (6, 2, 3, 5, 48),
        (2, 2, 7, 3, 112),
        (8, 2, 600, 1, 64),  # one token over 601 positions: three ranges merged
        (2, 2, 300, 1, 112),
    ],
)
def test_attention_rows(H, Hkv, start, T, hd):
    P = start + T
    r = _rng(3)
    q = r.standard_normal((T, H * hd), dtype=np.float32)
    K = r.standard_normal((P + 5, Hkv * hd), dtype=np.float32)  # the cache holds more rows than P
    V = r.standard_normal((P + 5, Hkv * hd), dtype=np.float32)
    want = attention(
        torch.from_numpy(q).reshape(T, H, hd),
        torch.from_numpy(K[:P]).reshape(P, Hkv, hd),
        torch.from_numpy(V[:P]).reshape(P, Hkv, hd),
        start,
    ).numpy()
    np.testing.assert_allclose(attention_rows(q, K, V, start, H, Hkv, hd), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start,T", [(36, 1), (600, 1), (0, 9), (5, 6)])
def test_attention_rows_reads_a_bf16_cache(start, T):
    """A bf16 cache (its bit patterns as uint16) gives the float32 kernel's result on the same values widened:
    bit for bit, one kernel compiled per cache dtype."""
    H, Hkv, hd, P = 8, 2, 64, start + T
    r = _rng(5)
    q = r.standard_normal((T, H * hd), dtype=np.float32)
    K, V = (torch.from_numpy(r.standard_normal((P + 3, Hkv * hd), dtype=np.float32)).bfloat16() for _ in range(2))
    bits = [t.view(torch.int16).numpy().view(np.uint16) for t in (K, V)]
    wide = [t.float().numpy() for t in (K, V)]
    got = attention_rows(q, bits[0], bits[1], start, H, Hkv, hd)
    assert np.array_equal(got, attention_rows(q, wide[0], wide[1], start, H, Hkv, hd))


def test_kv_rows_store_as_torch_rounds():
    """store_kv_rows writes float32 rows into a bf16 cache exactly as torch's conversion does (nearest even,
    ties and subnormals included), and into a float32 cache unchanged."""
    r = _rng(6)
    X = (r.standard_normal((5, 256)) * np.exp(r.uniform(-40, 40, (5, 256)))).astype(np.float32)
    X[0, :6] = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x00008000, 0x7F7FFFFF, 0x80018000], np.uint32).view(
        np.float32
    )
    C = np.zeros((9, 256), np.uint16)
    store_kv_rows(C, 3, X)
    want = torch.from_numpy(X).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(C[3:8], want) and not C[:3].any() and not C[8:].any()
    F = np.zeros((9, 256), np.float32)
    store_kv_rows(F, 2, X)
    assert np.array_equal(F[2:7], X)


@pytest.mark.parametrize("renorm", [True, False])
def test_route_rows(renorm):
    logits = _rng(4).standard_normal((5, 64), dtype=np.float32) * 3
    ids, w = route_rows(logits, 8, renorm)
    tids, tw = route_softmax_topk(torch.from_numpy(logits), 8, renorm)
    np.testing.assert_array_equal(ids, tids.numpy())
    np.testing.assert_allclose(w, tw.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "qwen2moe", "llama"])
def test_host_path_matches_torch_layers(tmp_path, arch):
    """Prefill and token-by-token logits through the numba host twins equal those of the torch
    layers (F32 weights: no activation rounding to amplify float noise)."""
    geo = {"experts": 4, "experts_used": 2} if arch == "llama" else {}
    path = write_model(tmp_path / f"{arch}.gguf", arch, seed=5, layers=2, **geo).path
    tokens = random_tokens(12, 1024, seed=2)
    with Session.load(str(path), LoadOptions(n_ctx=32, device="cpu")) as s:
        assert all(layer.host for layer in s.model.layers)
        fast = s.logits(tokens, batch=True), s.logits(tokens, batch=False)
        for layer in s.model.layers:
            layer.host = False
        slow = s.logits(tokens, batch=True), s.logits(tokens, batch=False)
    for f, w in zip(fast, slow):
        assert np.abs(f - w).max() <= 1e-5 * max(1.0, np.abs(w).max())


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_host_path_with_a_bf16_cache_matches_torch_layers(tmp_path, arch):
    """With a bf16 KV cache the host kernels write and read the cache in place (the fused step for the MoE); the
    torch layers convert through the cache's own write and read: the same logits, prefill and decode."""
    geo = {"experts": 4, "experts_used": 2} if arch == "llama" else {}
    path = write_model(tmp_path / f"{arch}.gguf", arch, seed=5, layers=2, **geo).path
    tokens = random_tokens(12, 1024, seed=2)
    with Session.load(str(path), LoadOptions(n_ctx=32, device="cpu", kv_type="bf16")) as s:
        assert s.cache.storage_dtype() == torch.bfloat16
        assert host_kv(s.cache, 0, 0, 1)[0].dtype == np.uint16
        fast = s.logits(tokens, batch=True), s.logits(tokens, batch=False)
        for layer in s.model.layers:
            layer.host = False
            layer.fused = None
        slow = s.logits(tokens, batch=True), s.logits(tokens, batch=False)
    for f, w in zip(fast, slow):
        assert np.abs(f - w).max() <= 1e-5 * max(1.0, np.abs(w).max())


@pytest.mark.parametrize(
    "arch,v_type,o_type",
    [
        ("qwen3moe", "Q6_K", "Q5_0"),  # q/k/v in one loop
        ("olmoe", "Q8_0", "Q5_0"),  # v apart (Q8_0 activations)
        ("qwen3moe", "Q3_K", "Q3_K"),  # Q3_K rows in the q/k/v loop and the o GEMV
        ("qwen3moe", "Q2_K", "Q2_K"),  # Q2_K likewise
        ("qwen3moe", "Q6_K", "MXFP4"),  # an MXFP4 o GEMV
        ("qwen3moe", "IQ4_XS", "IQ4_NL"),  # IQ4_XS rows in the q/k/v loop (Q8_K), an IQ4_NL o GEMV
        ("olmoe", "IQ4_NL", "IQ4_XS"),  # an IQ4_NL v apart (Q8_0 activations), an IQ4_XS o GEMV
        ("qwen3moe", "IQ3_XXS", "IQ2_XXS"),  # IQ grid rows in the q/k/v loop (Q8_K), an IQ2_XXS o GEMV
        ("olmoe", "IQ3_S", "IQ2_S"),  # likewise (olmoe: v in the loop too), an IQ2_S o GEMV
    ],
)
@pytest.mark.parametrize("kv_type", ["f32", "bf16"])
def test_fused_host_step_is_bit_identical(tmp_path, arch, v_type, o_type, kv_type):
    """The one-call host step (engine.models.host) equals the step-by-step host path exactly,
    on a quantized file mixing types the way Q4_K_M files do, with either host cache dtype."""
    path = write_model(
        tmp_path / f"{arch}.gguf", arch, seed=6, layers=2, weight_type="Q4_K",
        type_overrides={"*attn_v*": v_type, "*ffn_down_exps*": "Q6_K", "*attn_output*": o_type},
    ).path  # fmt: skip
    tokens = random_tokens(10, 1024, seed=3)
    with Session.load(str(path), LoadOptions(n_ctx=32, device="cpu", kv_type=kv_type)) as s:
        assert all(layer.fused is not None for layer in s.model.layers)
        assert all(host_kv(s.cache, i, 0, 1) is not None for i in range(2))
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


@pytest.mark.parametrize("q8_act", [True, False])
def test_matmuls_equal_matmul(q8_act, monkeypatch):
    """ops.matmuls (shared activations, output written straight as [T, R]) equals the kernels'
    matmul for every type family, for one token and for a batch."""
    from engine.kernels import bf16

    monkeypatch.setattr(bf16, "MODE", bf16.OFF)  # the q8 kernels at every T (bf16 prefill: test_bf16_prefill)
    from engine import ops
    from engine.kernels import dispatch
    from engine.kernels.prepare import prepare_weight
    from engine.kernels.testing import random_weight
    from engine.quant.formats import QType

    r = _rng(7)
    ws = tuple(
        prepare_weight(t, random_weight(t, (40, 256), r)) for t in (QType.Q4_K, QType.Q8_0, QType.F16, QType.F32)
    )
    for T in (1, 7, 40):  # 40: activations rounded in parallel
        X = r.standard_normal((T, 256), dtype=np.float32)
        for w, y in zip(ws, ops.matmuls(ws, X, q8_act=q8_act)):
            assert np.array_equal(y, dispatch.matmul(w, X, q8_act=q8_act)), (w.qtype, T)


def test_resident_copies_equal_mapped_weights(tmp_path, monkeypatch):
    """Host matrices copied out of the memory map (engine.models.weights, resident) give the same
    logits bit for bit as the mapped bytes, and really are copies (not views of the file map)."""
    from engine.models import weights as weights_mod

    path = write_model(
        tmp_path / "r.gguf", "qwen3moe", seed=7, layers=2, weight_type="Q4_K",
        type_overrides={"*ffn_down_exps*": "Q6_K"},
    ).path  # fmt: skip
    tokens = random_tokens(9, 1024, seed=4)
    runs = {}
    for min_bytes in (1 << 62, 0):  # nothing resident, then every matrix resident
        monkeypatch.setattr(weights_mod, "RESIDENT_MIN_BYTES", min_bytes)
        with Session.load(str(path), LoadOptions(n_ctx=32, device="cpu")) as s:
            runs[min_bytes] = s.logits(tokens, batch=True), s.logits(tokens, batch=False)
            w = s.model.w
            mapped = w.gf.tensor("blk.0.ffn_up_exps.weight").data
            host = s.model.layers[0].ffn.experts.host_stacks(0).up.raw
            assert np.shares_memory(host, mapped) == (min_bytes != 0)
            q = s.model.layers[1].attn.wq.w.raw
            assert np.shares_memory(q, w.gf.tensor("blk.1.attn_q.weight").data) == (min_bytes != 0)
    for a, b in zip(runs[1 << 62], runs[0]):
        assert np.array_equal(a, b)
