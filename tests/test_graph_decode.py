"""The one-token decode step wholly on the device (engine.runtime.graph_decode).

On the CPU simulated device ``SHARPI_CUDA_GRAPH=eager`` runs the graph's static step without
capturing it: the same math a CUDA graph replays (K/V written at a device position, attention over
a power-of-two bucket, routing and slot lookup on the device). It must give the existing eager
path's logits, routes and profiler counts. The CUDA tests (skipped without a GPU) replay real
graphs against the eager path over a bucket boundary, with the Triton kernels and with F32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.api import LoadOptions, Session
from engine.errors import UsageError
from engine.models.layers import apply_rope, apply_rope_table, attention, attention_static, rope_tables, rope_theta
from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout
from engine.runtime import graph_decode
from engine.runtime.graph_decode import GraphDecode
from engine.synth.writer import write_model
from tests.oracle import random_tokens

ARCHS = [
    ("qwen3moe", "qwen3moe", {}),
    ("olmoe", "olmoe", {}),
    ("qwen2moe", "qwen2moe", {}),
    ("mixtral", "llama", {"experts": 4, "experts_used": 2}),
    ("llama", "llama", {}),
    ("qwen3", "qwen3", {}),
]
CTX = 64
N_TOKENS = 20  # positions 0..19: buckets 16 and 32
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("graph")
    return {name: write_model(d / f"{name}.gguf", arch, seed=3, layers=2, **geo).path for name, arch, geo in ARCHS}


def _whole(s: Session, kv_type: str = "f32", ctx: int = CTX):
    """Every layer, the KV cache and (MoE) every expert on the device: the graph's placement."""
    spec, L = s.spec, s.args.n_layer
    need = device_bytes(spec, n_gpu_layers=L, ctx=ctx, kv_type=kv_type, reserve=0).total
    slots = L * s.args.n_expert if s.args.is_moe else 0
    stride = expert_slot_layout(spec).stride if spec.n_expert else 0
    prof = DeviceProfile(vram_bytes=need + slots * stride, reserve_bytes=0)
    p = s.plan(PlanRequest(ctx=ctx, kv_type=kv_type, n_gpu_layers=L, moe="resident" if s.args.is_moe else "cpu"), prof)
    assert p.n_gpu_layers == L and p.moe_mode in ("resident", "none"), (p.layer_reason, p.moe_reason)
    return p


def _decode(s: Session, tokens) -> tuple[np.ndarray, list, dict]:
    """Token-by-token logits from an empty cache, the last token's routes, the profiler's counts."""
    s.reset_stats()
    logits = s.logits(tokens, batch=False)
    routes = [layer.ffn.last_ids.clone() for layer in s.model.layers if hasattr(layer.ffn, "last_ids")]
    st = s.stats()
    return logits, routes, {"calls": st.calls, "hits": st.hits, "misses": st.misses}


def _both(s: Session, placement, monkeypatch, tokens, mode: str = "eager", ref: str = "0"):
    """(reference, graph path) decodes of ``tokens`` under ``placement``: the reference is the
    eager path (``ref="0"``) or the static step uncaptured (``ref="eager"``)."""
    monkeypatch.setenv(graph_decode.ENV_CUDA_GRAPH, ref)
    s.apply(placement)
    assert (s.model.decode_graph is None) == (ref == "0")
    eager = _decode(s, tokens)
    monkeypatch.setenv(graph_decode.ENV_CUDA_GRAPH, mode)
    s.apply(placement)
    g = s.model.decode_graph
    assert isinstance(g, GraphDecode)
    static = _decode(s, tokens)
    assert g.steps == len(tokens)  # every token went through the static step
    return eager, static, g


def _same_routes_and_counts(eager, static):
    assert [r.tolist() for r in eager[1]] == [r.tolist() for r in static[1]]
    for k in ("calls", "hits", "misses"):
        assert (eager[2][k] == static[2][k]).all(), k


@pytest.mark.parametrize("name", [a[0] for a in ARCHS])
def test_static_step_matches_the_eager_path(paths, name, monkeypatch):
    tokens = random_tokens(N_TOKENS, 1024, seed=1)
    with Session.load(str(paths[name]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        ref = s.logits(tokens, batch=False)  # the CPU engine
        eager, static, _ = _both(s, _whole(s), monkeypatch, tokens)
        assert np.abs(eager[0] - ref).max() <= 1e-5
        assert np.abs(static[0] - eager[0]).max() <= 1e-5, np.abs(static[0] - eager[0]).max()
        _same_routes_and_counts(eager, static)
        if s.args.is_moe:  # resident: every routed expert is a call and a hit, never a miss
            st = static[2]
            assert int(st["calls"].sum()) == N_TOKENS * s.args.n_layer * s.args.n_expert_used
            assert (st["hits"] == st["calls"]).all() and st["misses"].sum() == 0


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_static_step_with_rounded_kv(paths, name, kv_type, monkeypatch):
    tokens = random_tokens(N_TOKENS, 1024, seed=2)
    with Session.load(str(paths[name]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        eager, static, g = _both(s, _whole(s, kv_type), monkeypatch, tokens)
        assert g.cache.storage_dtype() == {"bf16": torch.bfloat16, "q8_0": torch.int8}[kv_type]
        assert np.abs(static[0] - eager[0]).max() <= 1e-5
        _same_routes_and_counts(eager, static)


def test_context_full_and_dispatch(paths, monkeypatch):
    monkeypatch.setenv(graph_decode.ENV_CUDA_GRAPH, "eager")
    with Session.load(str(paths["qwen3moe"]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        whole = _whole(s)
        s.apply(whole)
        g = s.model.decode_graph
        assert g is not None
        # A full context raises before the step runs.
        with pytest.raises(UsageError, match="context full"):
            s.model.forward([5], CTX, s.cache)
        assert g.steps == 0
        # The last position still decodes (bucket capped at the context).
        s.model.forward([5], CTX - 1, s.cache)
        assert g.steps == 1 and graph_decode.bucket(CTX - 1, CTX) == CTX
        # Prefill stays eager.
        s.model.forward([1, 2, 3], 0, s.cache)
        assert g.steps == 1
        # Re-applying drops the graph decoder; placements it does not serve get none.
        s.apply(whole)
        assert s.model.decode_graph is not None and s.model.decode_graph is not g
        L = s.args.n_layer
        for req in (dict(n_gpu_layers=L, moe="cache"), dict(n_gpu_layers=L, moe="cpu"), dict(n_gpu_layers=L - 1)):
            s.apply(s.plan(PlanRequest(ctx=CTX, **req), DeviceProfile(vram_bytes=1 << 30, reserve_bytes=0)))
            assert s.model.decode_graph is None, req
        monkeypatch.setenv(graph_decode.ENV_CUDA_GRAPH, "0")
        s.apply(whole)
        assert s.model.decode_graph is None
        monkeypatch.delenv(graph_decode.ENV_CUDA_GRAPH)
        s.apply(whole)
        assert s.model.decode_graph is None  # the default captures on CUDA only


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_rope_tables_rotate_exactly_as_apply_rope(neox, rope_dim):
    hd, P = 64, 40
    theta = torch.from_numpy(rope_theta(np.arange(P), rope_dim, 10000.0))  # [P, rope_dim/2]
    cos, sin = torch.cos(theta), torch.sin(theta)
    C, S, perm = rope_tables(cos, sin, hd, neox)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((P, 6, hd), dtype=np.float32))
    assert torch.equal(apply_rope_table(x, C, S, perm), apply_rope(x, cos, sin, neox))


def test_attention_static_masks_past_the_position():
    rng = np.random.default_rng(1)
    H, Hkv, hd, L = 8, 2, 16, 32
    q = torch.from_numpy(rng.standard_normal((1, H, hd), dtype=np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((L, Hkv, hd), dtype=np.float32)) for _ in range(2))
    for pos in (0, 7, L - 1):
        bias = torch.zeros(L).masked_fill(torch.arange(L) > pos, float("-inf"))
        want = attention(q, k[: pos + 1], v[: pos + 1], pos)
        assert torch.allclose(attention_static(q, k, v, bias), want, rtol=0, atol=1e-6)


def test_buckets():
    assert graph_decode.buckets(64) == [16, 32, 64]
    assert graph_decode.buckets(100) == [16, 32, 64, 100]
    assert graph_decode.buckets(8) == [8]
    for n in (8, 17, 64, 100, 4096):
        for pos in range(n):
            L = graph_decode.bucket(pos, n)
            assert pos < L <= n and L in graph_decode.buckets(n)
            assert L in (n, graph_decode.MIN_BUCKET) or pos >= L // 2


# -- CUDA: real graphs ------------------------------------------------------------------------------
@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize(("weights", "act"), [("F32", "f32"), ("Q4_K", "f32"), ("Q4_K", "q8")])
def test_graph_replay_matches_eager_decode(tmp_path, weights, act, monkeypatch):
    """Graph replays over 24 positions (buckets 16 and 32) against the eager path with the exact-float
    Triton kernels; with q8 activations (rounding flips on tiny differences) against the same static
    step run uncaptured, which must agree to float noise."""
    monkeypatch.setenv("SHARPI_DEVICE_ACT", act)
    geo = dict(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, experts_used=2, expert_ff=256)
    over = {"*ffn_down*": "Q6_K"} if weights != "F32" else None
    path = write_model(tmp_path / "m.gguf", "qwen3moe", seed=4, weight_type=weights, type_overrides=over, **geo).path
    tokens = random_tokens(24, 1024, seed=8)  # positions 0..23: buckets 16 and 32
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cuda", q8_act=False)) as s:
        ref = "0" if act == "f32" else "eager"
        eager, graph, g = _both(s, _whole(s), monkeypatch, tokens, mode="1", ref=ref)
        assert g.capture and g.replays == len(tokens) and sorted(g.graphs) == [16, 32, 64]
        scale = max(1.0, float(np.abs(eager[0]).max()))
        tol = 1e-4 if ref == "0" else 1e-5
        assert np.abs(graph[0] - eager[0]).max() <= tol * scale, np.abs(graph[0] - eager[0]).max()
        _same_routes_and_counts(eager, graph)
        # Replays are deterministic: the same tokens give the same logits again.
        again = _decode(s, tokens)
        assert np.abs(again[0] - graph[0]).max() <= 1e-6 * scale
