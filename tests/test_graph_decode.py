"""The one-token decode step wholly on the device (engine.runtime.graph_decode).

On the CPU simulated device ``SHARPI_CUDA_GRAPH=eager`` (``EngineOptions.cuda_graph``) runs the graph's static step without
capturing it: the same math a CUDA graph replays (K/V written at a device position, attention over
a power-of-two bucket, routing and slot lookup on the device). It must give the existing eager
path's logits, routes and profiler counts. The CUDA tests (skipped without a GPU) replay real
graphs against the eager path over a bucket boundary, with the Triton kernels and with F32. The fused
step kernels and the static step with them (Triton's interpreter): tests/triton/test_step_kernels.py and
test_static_step.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.api import LoadOptions, Session
from engine.errors import ModelError, UsageError
from engine.kv_cache import KVCache
from engine.models.layers import apply_rope, apply_rope_table, attention, attention_static, rope_tables, rope_theta
from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout
from engine.runtime import graph_decode
from engine.runtime.graph_decode import GraphDecode
from engine.synth.writer import write_model
from tests.oracle import random_tokens
from tests.placement import ARCHS, CTX, whole

N_TOKENS = 20  # positions 0..19: buckets 16 and 32
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("graph")
    return {name: write_model(d / f"{name}.gguf", arch, seed=3, layers=2, **geo).path for name, arch, geo in ARCHS}


def _decode(s: Session, tokens) -> tuple[np.ndarray, list, dict]:
    """Token-by-token logits from an empty cache, the last token's routes, the profiler's counts."""
    s.reset_stats()
    logits = s.logits(tokens, batch=False)
    routes = [layer.ffn.last_ids.clone() for layer in s.model.layers if hasattr(layer.ffn, "last_ids")]
    st = s.stats()
    return logits, routes, {"calls": st.calls, "hits": st.hits, "misses": st.misses}


def _graphs(s: Session, mode: str | None):
    """The session's engine options with ``SHARPI_CUDA_GRAPH=mode`` (None: the default)."""
    return s.engine_options.with_env({"SHARPI_CUDA_GRAPH": mode})


def _both(s: Session, placement, tokens, mode: str = "eager", ref: str = "0"):
    """(reference, graph path) decodes of ``tokens`` under ``placement``: the reference is the
    eager path (``ref="0"``) or the static step uncaptured (``ref="eager"``)."""
    s.apply(placement, _graphs(s, ref))
    assert (s.model.decode_graph is None) == (ref == "0")
    eager = _decode(s, tokens)
    s.apply(placement, _graphs(s, mode))
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
def test_static_step_matches_the_eager_path(paths, name):
    tokens = random_tokens(N_TOKENS, 1024, seed=1)
    with Session.load(str(paths[name]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        ref = s.logits(tokens, batch=False)  # the CPU engine
        eager, static, _ = _both(s, whole(s), tokens)
        assert np.abs(eager[0] - ref).max() <= 1e-5
        assert np.abs(static[0] - eager[0]).max() <= 1e-5, np.abs(static[0] - eager[0]).max()
        _same_routes_and_counts(eager, static)
        if s.args.is_moe:  # resident: every routed expert is a call and a hit, never a miss
            st = static[2]
            assert int(st["calls"].sum()) == N_TOKENS * s.args.n_layer * s.args.n_expert_used
            assert (st["hits"] == st["calls"]).all() and st["misses"].sum() == 0


def test_a_sliding_windows_ring_in_the_static_step(tmp_path):
    """gpt-oss's sliding-window layers keep a ring of their window and a slack (``KVCache.rings``): the static step
    writes K/V at row pos mod rows and masks the ring's rows by the positions they hold, so past the ring's first
    wrap it still gives the eager path's (and the CPU engine's) logits, sinks and all."""
    path = write_model(tmp_path / "o.gguf", "gpt-oss", seed=4, layers=2, sliding_window=6).path
    n_ctx = 300
    tokens = random_tokens(280, 1024, seed=6)  # the ring holds 6 + 256 rows: positions 262.. wrap it
    with Session.load(str(path), LoadOptions(n_ctx=n_ctx, device="cpu")) as s:
        ref = s.logits(tokens, batch=False)
        eager, static, g = _both(s, whole(s, ctx=n_ctx), tokens)
        assert s.cache.rings and all(rows < n_ctx for _, rows in s.cache.rings.values())
        assert g.steps == len(tokens)
        assert np.abs(eager[0] - ref).max() <= 1e-5
        assert np.abs(static[0] - eager[0]).max() <= 1e-5, np.abs(static[0] - eager[0]).max()


@pytest.mark.parametrize(("arch", "embd"), [("qwen3moe", "Q4_K"), ("qwen3", "Q6_K"), ("llama", "F16")])
def test_static_step_decodes_a_quantized_token_embd(tmp_path, arch, embd):
    """The step embeds its token on the device from the stored row (any type token_embd has): the eager
    path's logits, and their sum (the finiteness test's input) made in the step."""
    path = write_model(tmp_path / "m.gguf", arch, seed=5, layers=2, type_overrides={"token_embd.weight": embd}).path
    tokens = random_tokens(N_TOKENS, 1024, seed=2)
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        assert s.model.embed.ref.qtype.name == embd
        eager, static, g = _both(s, whole(s), tokens)
        assert np.abs(static[0] - eager[0]).max() <= 1e-5
        assert g.last_total == pytest.approx(float(static[0][-1].sum(dtype=np.float64)), rel=1e-5, abs=1e-3)


def test_a_nan_in_the_static_step_is_a_model_error(tmp_path):
    """The step's logits sum (made on the device) carries a NaN into the model's finiteness test."""
    from tests.test_nonfinite import _damage

    path = write_model(tmp_path / "m.gguf", "qwen3", seed=5, layers=2).path
    bad = _damage(path, "bad.gguf", "output.weight", float("nan"), tmp_path)
    with Session.load(bad, LoadOptions(n_ctx=CTX, device="cpu")) as s:
        s.apply(whole(s), _graphs(s, "eager"))
        assert s.model.decode_graph is not None
        with pytest.raises(ModelError, match="computed NaN or infinity"):
            s.logits([1, 2], batch=False)
        assert s.model.decode_graph.steps == 1 and np.isnan(s.model.decode_graph.last_total)


def _off_graph(s: Session, moe: str, n_cpu_moe: int = 0):
    """Every layer's trunk and the KV cache on the device, routed experts ``moe`` (cpu | cache with
    room for about half the experts | resident) with the first ``n_cpu_moe`` layers' on the CPU."""
    spec, L = s.spec, s.args.n_layer
    need = device_bytes(spec, n_gpu_layers=L, ctx=CTX, kv_type="f32", reserve=0).total
    slots = {"cpu": 0, "cache": L * s.args.n_expert // 2, "resident": L * s.args.n_expert}[moe]
    prof = DeviceProfile(vram_bytes=need + slots * expert_slot_layout(spec).stride, reserve_bytes=0)
    p = s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe=moe, n_cpu_moe=n_cpu_moe, prompt_stream=False), prof)
    assert p.n_gpu_layers == L and p.moe_mode == moe and p.n_cpu_moe == n_cpu_moe, (p.layer_reason, p.moe_reason)
    return p


@pytest.mark.parametrize(("moe", "n_cpu_moe"), [("cpu", 0), ("cache", 0), ("resident", 1)])
@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "qwen2moe", "mixtral", "qwen35moe", "gpt-oss"])
def test_step_with_experts_off_the_graph_matches_the_eager_path(paths, name, moe, n_cpu_moe):
    """Routed experts outside the graph (on the CPU, or in the expert cache with misses on the CPU)
    cut the static step into segments at those MoE layers: the trunk runs in the segments, the
    experts through their backend between them. Same logits, routes and profiler counts (hits and
    misses too) as the eager path; the shared expert (qwen2moe) rides on the residual."""
    tokens = random_tokens(N_TOKENS, 1024, seed=3)
    with Session.load(str(paths[name]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        ref = s.logits(tokens, batch=False)  # the plain CPU engine
        p = _off_graph(s, moe, n_cpu_moe)
        eager, static, g = _both(s, p, tokens)
        assert np.abs(static[0] - ref).max() <= 1e-5, np.abs(static[0] - ref).max()
        L = s.args.n_layer
        host = L if moe != "resident" else n_cpu_moe
        assert [seg.moe for seg in g.segments] == [*range(host), None]
        assert g.cuts == ["cache" if moe == "cache" else "cpu"] * host  # the pool's hits run inside the graph
        assert list(g.moe_layers) == list(range(host, L))  # the resident pool's layers stay inside
        assert np.abs(static[0] - eager[0]).max() <= 1e-5, np.abs(static[0] - eager[0]).max()
        _same_routes_and_counts(eager, static)
        if moe == "cache":
            assert static[2]["misses"].sum() > 0 and static[2]["hits"].sum() > 0


@pytest.mark.parametrize("name", ["qwen2moe", "qwen35moe"])
def test_a_capture_that_fails_mid_step_falls_back_to_the_same_logits(paths, monkeypatch, name):
    """A capture runs its segment once eagerly (the warm-up) before recording it, and a replay runs it
    again: a segment must never write what it reads, so running it twice changes nothing — K/V rows are
    written again; a Gated DeltaNet state, updated in place, has the warm-up's update undone
    (``GraphDecode._state_kept``, as ``_capture`` does). And when a capture fails in the middle of a step, the
    step goes on eagerly from that segment. Graphs stood in for by re-running the segment (no GPU here);
    qwen2moe's and qwen35moe's shared experts ride on the residual."""
    tokens = random_tokens(N_TOKENS, 1024, seed=5)
    with Session.load(str(paths[name]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        p = _off_graph(s, "cpu")
        eager, *_ = _both(s, p, tokens)
        s.apply(p, _graphs(s, "eager"))  # the static step, here made to "capture"
        g = s.model.decode_graph
        g.capture, seen = True, []

        class Replay:
            def __init__(self, length, seg):
                self.length, self.seg = length, seg

            def replay(self):
                g._segment(self.length, self.seg)

        def capture(length, seg):
            seen.append((length, seg))
            with g._state_kept(None):
                g._segment(length, seg)  # the warm-up
            if (length, seg) == (32, 1):
                raise RuntimeError("operation not permitted when stream is capturing")
            g.graphs.setdefault(length, []).append(Replay(length, seg))

        monkeypatch.setattr(g, "_capture", capture)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        static = _decode(s, tokens)
        L = s.args.n_layer
        assert seen == [(16, j) for j in range(L + 1)] + [(32, 0), (32, 1)]  # then no more captures
        assert not g.capture and g.graphs == {} and g.steps == N_TOKENS
        assert np.abs(static[0] - eager[0]).max() <= 1e-5, np.abs(static[0] - eager[0]).max()
        _same_routes_and_counts(eager, static)


def _stored_kv(s: Session) -> list[torch.Tensor]:
    """The applied cache's stored K and V rows of every layer (float32 view of the storage)."""
    c = s.applied.cache
    return [st.q[:N_TOKENS].float().clone() for i in range(s.args.n_layer) for st in (c.k[i], c.v[i])]


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_static_step_with_rounded_kv(paths, name, kv_type):
    """With a rounded KV cache the two paths store the same values, except where float32 order puts
    a value on a rounding edge and it rounds the other way (one storage step; which values do depends
    on the processor's float32 kernels). Logits agree to float32 order while the stored caches are
    equal, and to 1e-4 of the logits' scale where a few values rounded apart (one bf16 step in two stored
    values moved a qwen2moe file's logits, ~4 in size, by 1.4e-4). Float32 order is relative: 1e-5 of the logits' scale
    (on an Intel AMX machine a qwen3moe file's q8_0 caches stayed equal and its logits, ~3 in size, moved by 2.9e-5)."""
    tokens = random_tokens(N_TOKENS, 1024, seed=2)
    with Session.load(str(paths[name]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        eager, static, g = _both(s, whole(s, kv_type), tokens)
        kv_static = _stored_kv(s)
        s.apply(whole(s, kv_type), _graphs(s, "0"))
        _decode(s, tokens)
        kv_eager = _stored_kv(s)
        assert g.cache.storage_dtype() == {"bf16": torch.bfloat16, "q8_0": torch.int8}[kv_type]
        apart = sum(int((a != b).sum()) for a, b in zip(kv_eager, kv_static))
        assert apart <= 0.005 * sum(a.numel() for a in kv_eager), apart
        for a, b in zip(kv_eager, kv_static):  # each one storage step at most
            if kv_type == "q8_0":
                assert (a - b).abs().max() <= 1
            else:
                step = torch.maximum(a.abs(), b.abs()) * 2.0**-7
                assert ((a - b).abs() <= step).all()
        scale = max(1.0, float(np.abs(eager[0]).max()))
        assert np.abs(static[0] - eager[0]).max() <= (1e-5 if apart == 0 else 1e-4) * scale
        _same_routes_and_counts(eager, static)


def test_context_full_and_dispatch(paths, engine_env):
    engine_env({"SHARPI_CUDA_GRAPH": "eager"})
    with Session.load(str(paths["qwen3moe"]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        placement = whole(s)
        s.apply(placement)
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
        # Re-applying drops the graph decoder; a trunk not wholly on the device gets none; experts off
        # the graph (cpu, cache) cut the step at every MoE layer.
        s.apply(placement)
        assert s.model.decode_graph is not None and s.model.decode_graph is not g
        assert len(s.model.decode_graph.segments) == 1
        L = s.args.n_layer
        for req, n_seg in ((dict(n_gpu_layers=L, moe="cache"), L + 1), (dict(n_gpu_layers=L, moe="cpu"), L + 1),
                           (dict(n_gpu_layers=L - 1), None)):  # fmt: skip
            s.apply(s.plan(PlanRequest(ctx=CTX, **req), DeviceProfile(vram_bytes=1 << 30, reserve_bytes=0)))
            g = s.model.decode_graph
            assert (g is None) if n_seg is None else len(g.segments) == n_seg, req
        s.apply(placement, _graphs(s, "0"))
        assert s.model.decode_graph is None
        s.apply(placement, _graphs(s, None))
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
def test_graph_replay_matches_eager_decode(tmp_path, weights, act, engine_env):
    """Graph replays over 24 positions (buckets 16 and 32) against the eager path with the exact-float
    Triton kernels; with q8 activations (rounding flips on tiny differences) against the same static
    step run uncaptured, which must agree to float noise."""
    engine_env({"SHARPI_DEVICE_ACT": act})
    geo = dict(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, experts_used=2, expert_ff=256)
    over = {"*ffn_down*": "Q6_K"} if weights != "F32" else None
    path = write_model(tmp_path / "m.gguf", "qwen3moe", seed=4, weight_type=weights, type_overrides=over, **geo).path
    tokens = random_tokens(24, 1024, seed=8)  # positions 0..23: buckets 16 and 32
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cuda", q8_act=False)) as s:
        ref = "0" if act == "f32" else "eager"
        eager, graph, g = _both(s, whole(s), tokens, mode="1", ref=ref)
        assert g.capture and g.replays == len(tokens) and sorted(g.graphs) == [16, 32]  # as positions need them
        assert all(len(v) == 1 for v in g.graphs.values())  # one segment: everything on the device
        scale = max(1.0, float(np.abs(eager[0]).max()))
        tol = 1e-4 if ref == "0" else 1e-5
        assert np.abs(graph[0] - eager[0]).max() <= tol * scale, np.abs(graph[0] - eager[0]).max()
        _same_routes_and_counts(eager, graph)
        # Replays are deterministic: the same tokens give the same logits again.
        again = _decode(s, tokens)
        assert np.abs(again[0] - graph[0]).max() <= 1e-6 * scale


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("moe", ["cpu", "cache"])
def test_segment_replays_with_experts_on_the_host_match_eager_decode(tmp_path, moe, engine_env):
    """The 12 GiB-card placements on a real GPU: the trunk between two MoE layers as one graph replay,
    the routed experts on the CPU between replays, or the expert cache's hits inside the replays (the
    fused kernels skipping the misses) and its misses on the CPU between them — against the eager path
    over two buckets, with the Triton kernels; routes and cache counts equal."""
    engine_env({"SHARPI_DEVICE_ACT": "f32", "SHARPI_CACHE_UPLOAD": "inline"})  # counts compared: uploads between steps
    geo = dict(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, experts_used=2, expert_ff=256)
    path = write_model(tmp_path / "m.gguf", "qwen3moe", seed=4, weight_type="Q4_K", type_overrides={"*ffn_down*": "Q6_K"},
                       **geo).path  # fmt: skip
    tokens = random_tokens(24, 1024, seed=8)
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cuda", q8_act=False)) as s:
        eager, graph, g = _both(s, _off_graph(s, moe), tokens, mode="1")
        L = s.args.n_layer
        assert g.capture and g.replays == len(tokens) and sorted(g.graphs) == [16, 32]
        assert all(len(v) == L + 1 for v in g.graphs.values())  # a segment per MoE layer, and the output's
        assert g.cuts == [moe] * L
        scale = max(1.0, float(np.abs(eager[0]).max()))
        assert np.abs(graph[0] - eager[0]).max() <= 1e-4 * scale, np.abs(graph[0] - eager[0]).max()
        _same_routes_and_counts(eager, graph)


def test_bench_bound_is_device_memory_only_when_everything_is_on_cuda():
    """`sharpi bench` compares decode with the device's bandwidth only when every layer and every
    routed expert sit on a CUDA device; otherwise with the host's read bandwidth."""
    from types import SimpleNamespace as NS

    from engine.bench.model import _wholly_on_cuda

    def s(dev, n, mode, L=4, n_cpu_moe=0):
        return NS(device=torch.device(dev), placement=NS(n_gpu_layers=n, n_layer=L, moe_mode=mode, n_cpu_moe=n_cpu_moe))

    assert _wholly_on_cuda(s("cuda", 4, "resident")) and _wholly_on_cuda(s("cuda", 4, "none"))
    assert not _wholly_on_cuda(s("cuda", 4, "resident", n_cpu_moe=2))  # a split: the first layers' experts on the host
    assert not _wholly_on_cuda(s("cuda", 3, "resident")) and not _wholly_on_cuda(s("cuda", 4, "cache"))
    assert not _wholly_on_cuda(s("cpu", 4, "resident")) and not _wholly_on_cuda(NS(device=None, placement=None))


def test_bench_bound_of_a_hybrid_placement_splits_host_and_device_bytes(paths):
    """With the trunk on a CUDA device and the experts elsewhere, `sharpi bench` bounds decode by the bytes
    each memory serves, one after the other: the CPU experts' (or the cache's misses') from host memory,
    the trunk's (and the cache's hits') from device memory — not every byte at the host's bandwidth
    (which printed "145 % of the bound" for a cache that hit 97 %)."""
    from types import SimpleNamespace as NS

    from engine.bench.model import _split_bytes, hybrid_bound_tok_s

    with Session.load(str(paths["qwen3moe"]), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        cuda = torch.device("cuda")

        def split(moe, hit=None):
            p = _off_graph(s, moe)
            return _split_bytes(NS(placement=p, device=cuda, spec=s.spec), hit)

        cpu, cache_all, cache_none = split("cpu"), split("cache", 1.0), split("cache", 0.0)
        experts = sum(lay.expert_bytes for lay in s.spec.layers) * s.args.n_expert_used
        assert cpu["host"] - cache_all["host"] == pytest.approx(experts)  # the experts move to the device
        assert cache_all["device"] - cpu["device"] == pytest.approx(experts)
        assert cache_none == pytest.approx(cpu)
        assert _split_bytes(NS(placement=_off_graph(s, "cpu"), device=torch.device("cpu"), spec=s.spec), None) is None
        assert hybrid_bound_tok_s({"host": 2e9, "device": 3e9}, 100, 3000) == pytest.approx(1 / 0.021)


def test_the_warm_up_before_a_capture_launches_what_the_capture_records(monkeypatch, engine_env):
    """GraphDecode warms a bucket up eagerly before capturing it; that warm-up must run under
    triton_qblocks.graph_warmup, so it picks the kernel variants the capture records (PDL, q8
    activations) and nothing is compiled while the stream captures. Checked with torch's CUDA stream
    and graph calls stubbed out (no GPU), by what the step body sees in each phase."""
    import contextlib

    from engine.quant.formats import QType
    from engine.runtime import kernel_select as ks
    from engine.runtime import triton_qblocks as qb

    engine_env({"SHARPI_DEVICE_ACT": None, "TRITON_INTERPRET": None})
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    monkeypatch.setattr(qb, "_gdc_compiled", lambda: True)
    monkeypatch.setattr(qb, "pdl_supported", lambda index=None: True)

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        capturing["now"] = True
        yield
        capturing["now"] = False

    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    cuda = torch.device("cuda", 0)
    q4k = {r: (o, QType.Q4_K, R, n) for r, o, R, n in (("gate", 0, 768, 2048), ("up", 884736, 768, 2048),
                                                         ("down", 1769472, 2048, 768))}  # fmt: skip
    seen = []

    class Stub:
        device, _pool, _side, graphs, _cut_backends = cuda, None, None, {}, []
        cache = KVCache({}, 16, 32)  # no recurrent states to keep
        _state_kept = GraphDecode._state_kept

        def _segment(self, length, s):
            seen.append((qb.pdl(cuda), ks.moe_act(cuda, True, q4k), capturing["now"]))

    GraphDecode._capture(Stub(), 16)
    assert seen == [(1, "q8", False), (1, "q8", True)]  # the warm-up (not capturing) launches as the capture
    assert (qb.pdl(cuda), ks.moe_act(cuda, True, q4k)) == (0, "f32")  # plain eager launches after it


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
@pytest.mark.parametrize("moe", ["resident", "cpu"])
def test_graph_replays_carry_the_gdn_state(tmp_path, arch, moe, engine_env):
    """Gated DeltaNet layers in captured graphs: each replay updates the recurrent state in place, and a
    bucket's capture undoes its warm-up's update (else its first token would advance the state twice) —
    the eager path's logits over two buckets, experts resident in the graph or on the CPU between replays."""
    engine_env({"SHARPI_DEVICE_ACT": "f32"})
    path = write_model(tmp_path / "m.gguf", arch, seed=4, layers=4, full_attn_interval=2).path  # GDN, attention x2
    tokens = random_tokens(24, 1024, seed=8)
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cuda", q8_act=False)) as s:
        p = whole(s) if moe == "resident" else _off_graph(s, "cpu")
        eager, graph, g = _both(s, p, tokens, mode="1")
        assert g.capture and g.replays == len(tokens) and sorted(g.graphs) == [16, 32]
        scale = max(1.0, float(np.abs(eager[0]).max()))
        assert np.abs(graph[0] - eager[0]).max() <= 1e-4 * scale, np.abs(graph[0] - eager[0]).max()
        _same_routes_and_counts(eager, graph)
