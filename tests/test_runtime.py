"""Hybrid runtime on the simulated device: every placement gives the CPU engine's logits.

``device="cpu"`` stands in for a GPU with a byte budget, so the slot pool, its slot policy, misses,
uploads, the profiler and the arena's accounting all run here; CUDA changes only the device.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import config
from engine.api import LoadOptions, Session
from engine.errors import DeviceMemoryError
from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout
from engine.synth.writer import write_model
from tests.oracle import random_tokens

ARCHS = [
    ("qwen3moe", {}),
    ("olmoe", {}),
    ("qwen2moe", {}),
    ("mixtral", {"experts": 4, "experts_used": 2}),
    ("qwen3", {}),
    # Gated DeltaNet hybrids: layers [GDN, attention, GDN] (the recurrent state on the device beside K/V)
    ("qwen35moe", {"full_attn_interval": 2}),
    ("qwen35", {"full_attn_interval": 2}),
    ("qwen3next", {"full_attn_interval": 2}),
    # a dense layer, then two MoE layers (biased sigmoid routing, scaled, a shared expert) and a NextN block
    ("glm4moe", {"expert_scale": 2.5}),
    # sliding, global, sliding layers; sinks, YaRN, biased experts with the clamped SwiGLU (torch references on
    # the device, the numba kernels' gather path on the host)
    ("gpt-oss", {}),
]
CTX = 64
# The simulated device everywhere; the real GPU where there is one (CI has none).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("runtime")
    out = {}
    for name, geo in ARCHS:
        arch = "llama" if name == "mixtral" else name
        out[name] = write_model(d / f"{name}.gguf", arch, seed=3, layers=3, **geo).path
    return out


def _session(path, device="cpu"):
    # Prompts on float32 operands (SHARPI_PREFILL_PRECISION=f32): the path held to the CPU engine's logits
    # at 1e-5. CUDA's default, bfloat16 operands, is held to its references in tests/triton/test_prefill.py
    # and to the CPU engine within its rounding in tests/triton/test_moe.py.
    engine = replace(config.current(), prefill_precision="f32")
    return Session.load(str(path), LoadOptions(n_ctx=CTX, device=device, engine=engine))


def _run(session, tokens):
    """Prefill logits of all positions, then token-by-token decode logits, from empty caches."""
    return session.logits(tokens, batch=True), session.logits(tokens, batch=False)


def _profile_for(session, *, n_gpu_layers: int, slots: int) -> DeviceProfile:
    """A budget that affords exactly ``n_gpu_layers`` layers and ``slots`` expert slots (or staging slots)."""
    spec = session.spec
    need = device_bytes(spec, n_gpu_layers=n_gpu_layers, ctx=CTX, kv_type="f32", reserve=0).total
    stride = expert_slot_layout(spec).stride if spec.n_expert else 0
    return DeviceProfile(vram_bytes=need + slots * stride, reserve_bytes=0)


def _moe_layers(session) -> list[int]:
    """The layers with routed experts (GLM-4.5's leading layers are dense)."""
    return [layer.index for layer in session.spec.layers if layer.is_moe]


def _cases(session):
    L = session.args.n_layer
    moe = _moe_layers(session)
    needed = len(moe) * session.args.n_expert
    first = moe[0] + 1 if moe else 1  # n_cpu_moe keeping the first MoE layer's experts on the CPU
    cases = [("cpu", dict(n_gpu_layers=L, moe="cpu"), L, 0)]
    if session.args.is_moe:
        for frac in (0.1, 0.5, 1.0):
            cases.append((f"cache{int(frac * 100)}", dict(n_gpu_layers=L, moe="cache"), L, max(1, int(needed * frac))))
        cases.append(("resident", dict(n_gpu_layers=L, moe="resident"), L, needed))
        cases.append(("n_cpu_moe", dict(n_gpu_layers=L, moe="cache", n_cpu_moe=first), L, needed))
        # Host experts of device layers streamed to the device for a long prompt: room for two halves of a
        # layer's experts after the mode's pool (all layers' experts on the host; the first one's, beside a
        # resident pool; a split's device layers).
        E = session.args.n_expert
        cases.append(("stream", dict(n_gpu_layers=L, moe="cpu"), L, 2 * E))
        cases.append(("stream_n_cpu_moe", dict(n_gpu_layers=L, moe="resident", n_cpu_moe=first), L, needed - E + 2 * E))
        cases.append(("stream_split", dict(n_gpu_layers=L - 1, moe="cpu"), L - 1, 2 * E))
    cases += [(f"split{g}", dict(n_gpu_layers=g, moe="cpu"), g, 0) for g in (1, L - 1)]
    return cases


# The streamed cases run with a threshold the 20-token prompt passes (decode's single tokens stay on the CPU).
STREAM_MIN = 16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [a[0] for a in ARCHS])
def test_every_placement_matches_the_cpu_engine(paths, name, device):
    tokens = random_tokens(20, 1024, seed=1)
    with _session(paths[name], device) as s:
        ref_prefill, ref_decode = _run(s, tokens)
        # A GPU's Gated DeltaNet prompt sums its chunked recurrence in another order than the CPU's (measured on an
        # H200: up to 1.25e-5): the F32 standard's 1e-4 there, 1e-5 everywhere else.
        tol = 1e-4 if device == "cuda" and any(getattr(s.args, "recurrent", ())) else 1e-5
        for label, req, g, slots in _cases(s):
            placement = s.plan(PlanRequest(ctx=CTX, kv_type="f32", **req), _profile_for(s, n_gpu_layers=g, slots=slots))
            assert placement.n_gpu_layers == g, (label, placement.layer_reason)
            if req["moe"] != "cpu" and s.args.is_moe:
                assert placement.moe_mode == req["moe"], (label, placement.moe_reason)
            streamed = label.startswith("stream")
            s.apply(placement, replace(s.engine_options, prompt_stream_min=STREAM_MIN) if streamed else None)
            prefill, decode = _run(s, tokens)
            st = s.applied.stream
            if streamed:  # the prompt's host experts really ran on the device: every streamed layer, once
                host_layers = sum(i < min(g, req.get("n_cpu_moe", g)) for i in _moe_layers(s))
                assert placement.stream_slots > 0, (label, placement.notes)
                assert st.streamed_layers == host_layers and st.streamed_bytes > 0, label
            else:
                assert st is None or st.streamed_layers == 0, label
            assert np.abs(prefill - ref_prefill).max() <= tol, (label, np.abs(prefill - ref_prefill).max())
            assert np.abs(decode - ref_decode).max() <= tol, (label, np.abs(decode - ref_decode).max())
            # What the runtime allocated is what the planner priced, kind by kind.
            priced = placement.device.to_dict()
            priced.pop("total")
            assert dict(s.applied.arena.by_kind) == {
                k: v for k, v in priced.items() if v or k in s.applied.arena.by_kind
            }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "weight_type", ["MXFP4", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S"]
)
def test_every_placement_of_reference_only_types_matches_the_cpu_engine(tmp_path, device, weight_type):
    """Weight types without a Triton kernel (gpt-oss's MXFP4, Q3_K, Q2_K, IQ4_NL, IQ4_XS, the IQ2/IQ3 grid types;
    every matrix here): the device runs
    them through the torch reference dequantizer, the CPU through the numba kernels — exact-float
    activations on both, the same logits on every placement."""
    m = write_model(tmp_path / "m.gguf", "qwen3moe", seed=3, layers=3, weight_type=weight_type)
    assert not m.fallbacks  # every matrix of the type (rows of 256)
    path = m.path
    tokens = random_tokens(20, 1024, seed=2)
    engine = replace(config.current(), prefill_precision="f32")
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device=device, engine=engine, q8_act=False)) as s:
        ref_prefill, ref_decode = _run(s, tokens)
        scale = max(1.0, float(np.abs(ref_decode).max()))
        for label, req, g, slots in _cases(s):
            placement = s.plan(PlanRequest(ctx=CTX, kv_type="f32", **req), _profile_for(s, n_gpu_layers=g, slots=slots))
            streamed = label.startswith("stream")
            s.apply(placement, replace(s.engine_options, prompt_stream_min=STREAM_MIN) if streamed else None)
            prefill, decode = _run(s, tokens)
            assert np.abs(prefill - ref_prefill).max() <= 1e-5 * scale, (label, np.abs(prefill - ref_prefill).max())
            assert np.abs(decode - ref_decode).max() <= 1e-5 * scale, (label, np.abs(decode - ref_decode).max())


@pytest.mark.parametrize("device", DEVICES)
def test_cache_counts_hits_misses_uploads_and_residency(paths, device):
    with _session(paths["qwen3moe"], device) as s:
        L, E = s.args.n_layer, s.args.n_expert
        s.apply(s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe="cache"), _profile_for(s, n_gpu_layers=L, slots=L * E)))
        s.reset_stats()
        tokens = random_tokens(12, 1024, seed=2)
        s.logits(tokens, batch=False)
        s.applied.experts.pool.drain()  # CUDA: the last steps' uploads, copied behind the decode, land
        st = s.stats()
        calls = int(st.calls.sum())
        assert calls == 12 * L * s.args.n_expert_used
        assert int(st.hits.sum()) + int(st.misses.sum()) == calls
        assert st.hits.sum() > 0 and st.misses.sum() > 0
        # every miss was uploaded once (the pool holds every expert), and is resident now
        missed = st.misses > 0
        stride_bytes = s.applied.experts._expert_bytes
        per_expert = sum(stride_bytes[(0, r)].shape[1] for r in ("gate", "up", "down"))
        assert (st.uploaded_bytes[missed] == per_expert).all() and (st.uploaded_bytes[~missed] == 0).all()
        assert (st.resident == missed).all()
        assert 0 < st.hit_rate < 1


@pytest.mark.parametrize("device", DEVICES)
def test_small_cache_evicts_and_stays_correct(paths, device):
    tokens = random_tokens(16, 1024, seed=5)
    with _session(paths["qwen3moe"], device) as s:
        ref = s.logits(tokens, batch=False)
        L = s.args.n_layer
        s.apply(s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe="cache"), _profile_for(s, n_gpu_layers=L, slots=3)))
        assert np.abs(s.logits(tokens, batch=False) - ref).max() <= 1e-5
        s.applied.experts.pool.drain()  # CUDA: the last steps' uploads, copied behind the decode, land
        assert s.applied.experts.slots.evictions > 0
        assert int(s.stats().resident.sum()) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threshold", [0, 1, 3])
def test_prompt_uploads_its_experts_and_stays_correct(paths, device, threshold, monkeypatch, engine_env):
    """A prompt's missed experts with ≥ SHARPI_PROMPT_UPLOAD_MIN of its tokens are uploaded before the
    layer runs and computed on the device; the rest run on the CPU (0: all of them); same logits."""
    from engine.config import EngineOptions
    from engine.errors import UsageError
    from engine.runtime.expert_cache import CachedExperts, prompt_upload_threshold

    engine_env({"SHARPI_PROMPT_UPLOAD_MIN": str(threshold)})
    host_pairs = []
    real = CachedExperts._host_outputs

    def spy(self, layer, x, ids_h, weights, miss):
        host_pairs.append(int(np.isin(ids_h, list(miss)).sum()))
        return real(self, layer, x, ids_h, weights, miss)

    monkeypatch.setattr(CachedExperts, "_host_outputs", spy)
    tokens = random_tokens(20, 1024, seed=9)
    with _session(paths["qwen3moe"], device) as s:
        ref = s.logits(tokens, batch=True)
        L, E, K = s.args.n_layer, s.args.n_expert, s.args.n_expert_used
        s.apply(s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe="cache"), _profile_for(s, n_gpu_layers=L, slots=L * E)))
        assert s.applied.experts.prompt_upload_min == threshold
        s.reset_stats()
        got = s.logits(tokens, batch=True)
        assert np.abs(got - ref).max() <= 1e-5
        routes = s.stats()
        if threshold == 0:  # every pair of the cold prompt on the CPU
            assert sum(host_pairs) == len(tokens) * L * K
        elif threshold == 1:  # every expert uploaded before its layer ran: nothing on the CPU
            assert sum(host_pairs) == 0 and int(routes.resident.sum()) == int((routes.calls > 0).sum())
        else:  # experts with 1–2 of the prompt's tokens on the CPU, the others on the device
            rare = int(((routes.calls > 0) & (routes.calls < threshold)).sum())
            assert rare > 0 and 0 < sum(host_pairs) < len(tokens) * L * K
    assert prompt_upload_threshold() == threshold
    assert prompt_upload_threshold(EngineOptions()) == 16  # unset: expert_cache.PROMPT_UPLOAD_MIN
    for bad in ("many", "-1"):
        with pytest.raises(UsageError, match="SHARPI_PROMPT_UPLOAD_MIN"):
            EngineOptions.from_env({"SHARPI_PROMPT_UPLOAD_MIN": bad})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["lru", "slru", "dlfu"])
@pytest.mark.parametrize("graph", ["off", "eager"])
def test_every_cache_policy_moves_experts_never_the_logits(paths, device, policy, graph):
    """Each slot policy (EngineOptions.cache_policy) on a small and a half-size cache, prompt and token by token,
    eager and in the static one-token step: the CPU engine's logits; the policies differ in which experts they
    keep (so in where the experts ran), and dlfu refuses some misses a slot (they stay on the CPU)."""
    tokens = random_tokens(20, 1024, seed=4)
    with _session(paths["qwen3moe"], device) as s:
        ref_prefill, ref_decode = _run(s, tokens)
        L, E = s.args.n_layer, s.args.n_expert
        for slots in (max(3, L * E // 10), L * E // 2):
            placement = s.plan(PlanRequest(ctx=CTX, kv_type="f32", n_gpu_layers=L, moe="cache"),
                               _profile_for(s, n_gpu_layers=L, slots=slots))  # fmt: skip
            s.apply(placement, replace(s.engine_options, cache_policy=policy, cuda_graph=graph))
            assert s.applied.experts.slots.name == policy
            s.reset_stats()
            prefill, decode = _run(s, tokens)
            assert np.abs(prefill - ref_prefill).max() <= 1e-5, (slots, np.abs(prefill - ref_prefill).max())
            assert np.abs(decode - ref_decode).max() <= 1e-5, (slots, np.abs(decode - ref_decode).max())
            st = s.stats()
            # A tenth of the experts must miss (and LRU may hit nothing there: on CUDA three slots against a token's
            # four experts thrash); half of them must hit (and may hold all that this run asks for)
            counts = (slots, st.hits.sum(), st.misses.sum())
            assert (st.misses.sum() if slots < L * E // 2 else st.hits.sum()) > 0, counts
            pool = s.applied.experts.pool
            pool.drain()
            _table_agrees_with_the_policy(pool)
            assert len(pool.slots) <= slots


def test_cache_policies_differ_in_where_experts_run(paths):
    """The same decode on a small cache: dlfu refuses misses a slot (fewer uploads than misses) where LRU
    admits every one, so their hits differ — and their logits do not."""
    tokens = random_tokens(24, 1024, seed=6)
    got = {}
    with _session(paths["qwen3moe"]) as s:
        L, E = s.args.n_layer, s.args.n_expert
        placement = s.plan(PlanRequest(ctx=CTX, kv_type="f32", n_gpu_layers=L, moe="cache"),
                           _profile_for(s, n_gpu_layers=L, slots=L * E // 4))  # fmt: skip
        for policy in ("lru", "dlfu"):
            s.apply(placement, replace(s.engine_options, cache_policy=policy, cuda_graph="off"))
            s.reset_stats()
            logits = s.logits(tokens, batch=False)
            st = s.stats()
            stride = sum(s.applied.experts._expert_bytes[(0, r)].shape[1] for r in ("gate", "up", "down"))
            got[policy] = (logits, int(st.hits.sum()), int(st.misses.sum()), int(st.uploaded_bytes.sum()) // stride)
    (lru_logits, lru_hits, lru_miss, lru_up), (d_logits, d_hits, d_miss, d_up) = got["lru"], got["dlfu"]
    assert np.abs(lru_logits - d_logits).max() <= 1e-5  # the same sums, over other device/CPU splits
    assert lru_up == lru_miss  # LRU uploads every miss
    assert d_up < d_miss  # dlfu leaves some on the CPU
    assert lru_hits != d_hits


def _table_agrees_with_the_policy(pool) -> None:
    """Every expert the table points at holds that slot in the slot policy, and every cached expert is in the table."""
    table = {(int(i), int(e)): int(pool.slots_h[i, e]) for i, e in zip(*np.nonzero(pool.slots_h >= 0))}
    cached = pool.slots.keys()  # (layer, expert) of every slot in use
    assert table == {key: pool.slots.slot(key) for key in cached}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [3, None])
def test_background_uploads_enter_the_table_once_landed(paths, device, slots):
    """Uploads behind the decode (ExpertPool.upload_later, CUDA's default; forced here on the simulated device):
    a step's misses get slots between steps but stay misses — computed on the CPU, logits unchanged — until
    their copies have landed and ``publish`` puts them in the table; a small cache evicts pending experts too."""
    tokens = random_tokens(16, 1024, seed=5)
    with _session(paths["qwen3moe"], device) as s:
        ref = s.logits(tokens, batch=False)
        L, E = s.args.n_layer, s.args.n_expert
        n = slots or L * E
        placement = s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe="cache"), _profile_for(s, n_gpu_layers=L, slots=n))
        s.apply(placement, replace(s.engine_options, cache_upload="background"))
        pool = s.applied.experts.pool
        assert pool.background
        s.reset()
        s.model.forward([tokens[0]], 0, s.cache)  # one step: its misses admitted and being copied, not in the table
        cached = pool.slots.keys()
        pending = [key for key in cached if pool.slots_h[key] < 0]
        assert pending and len(pool.slots) == len(pending)
        s.model.settle()  # what a re-placement and closing the session do: the copies land, in the table
        _table_agrees_with_the_policy(pool)
        s.reset_stats()
        got = s.logits(tokens, batch=False)
        assert np.abs(got - ref).max() <= 1e-5
        pool.drain()
        _table_agrees_with_the_policy(pool)
        missed = {(int(i), int(e)) for i, e in zip(*np.nonzero(s.stats().misses > 0))}
        if slots:
            assert pool.slots.evictions > 0 and len(pool.slots) == slots
        else:  # room for all: every expert missed is in the table now, none dropped
            assert pool.background_dropped == 0 and missed <= set(pool.slots.keys())
        s.reset()
        s.model.forward([tokens[1]], 0, s.cache)  # copies in flight as the session closes: they end first


def test_host_copy_in_slices_equals_the_source():
    """Uploads' host copy: large copies go in ≥ 1 MiB slices on threads, small ones in one; the bytes match."""
    from engine.runtime.expert_cache import host_copy

    rng = np.random.default_rng(4)
    for n in (1000, (1 << 20) + 7, 5 * (1 << 20) + 3):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, np.uint8)
        host_copy(dst, src)
        assert np.array_equal(dst, src), n


def test_apply_out_of_memory_keeps_the_previous_placement(paths):
    tokens = random_tokens(10, 1024, seed=7)
    with _session(paths["qwen3moe"]) as s:
        L = s.args.n_layer
        good = s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe="cpu"), _profile_for(s, n_gpu_layers=L, slots=0))
        s.apply(good)
        ref = s.logits(tokens)
        bad = replace(good, budget_bytes=good.device.total // 2)  # a device smaller than the plan
        with pytest.raises(DeviceMemoryError, match="previous placement stays"):
            s.apply(bad)
        assert s.placement is good
        assert np.abs(s.logits(tokens) - ref).max() == 0
        events = list(
            s.generate(prompt_ids=tokens, params=__import__("engine.generate", fromlist=["x"]).SamplingParams.greedy(3))
        )
        assert events[-1].done


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_model_on_the_device_matches_exact_float_cpu(tmp_path, device):
    """Q4_K/Q6_K trunk and experts computed from raw bytes on the device (fused Triton GEMV on a
    GPU, the torch reference here) agree with the CPU engine's exact-float kernels."""
    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=4, layers=2, weight_type="Q4_K",
                       type_overrides={"*ffn_down*": "Q6_K"}).path  # fmt: skip
    tokens = random_tokens(12, 1024, seed=8)
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device=device, q8_act=False)) as s:
        ref = s.logits(tokens, batch=False)
        L, E = s.args.n_layer, s.args.n_expert
        for moe in ("cache", "resident"):
            s.apply(s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe=moe), _profile_for(s, n_gpu_layers=L, slots=L * E)))
            got = s.logits(tokens, batch=False)
            assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), (moe, np.abs(got - ref).max())


@pytest.mark.parametrize("device", DEVICES)
def test_resident_experts_pack_each_layer_at_its_own_stride(tmp_path, device):
    """Q4_K_M-like files mix expert types across layers (Q6_K ffn_down in some): resident experts are packed
    at each layer's own stride, priced and allocated to the byte, and a resident split — the first layers'
    experts on the CPU, the rest resident — gives the CPU engine's logits."""
    from engine.plan.sizing import layer_slot_layout, resident_expert_bytes

    path = write_model(
        tmp_path / "mixed.gguf", "qwen3moe", seed=4, layers=3, hidden=256, expert_ff=256,
        weight_type="Q4_K", type_overrides={"blk.1.ffn_down_exps.weight": "Q6_K", "blk.2.ffn_down_exps.weight": "Q8_0"},
    ).path  # fmt: skip
    tokens = random_tokens(20, 1024, seed=6)
    # exact-float arithmetic on both paths (q8_act=False, float32 prompt operands), so quantized weights compare
    # tightly too
    engine = replace(config.current(), prefill_precision="f32")
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device=device, q8_act=False, engine=engine)) as s:
        ref_prefill, ref_decode = _run(s, tokens)
        spec, L, E = s.spec, s.args.n_layer, s.args.n_expert
        strides = [layer_slot_layout(spec, i).stride for i in range(L)]
        assert len(set(strides)) == 3 and max(strides) == expert_slot_layout(spec).stride
        base = device_bytes(spec, n_gpu_layers=L, ctx=CTX, kv_type="f32", reserve=0).total
        for split in (0, 1):
            need = resident_expert_bytes(spec, range(split, L))
            assert need < (L - split) * E * max(strides)  # packing saves bytes a fixed stride would waste
            # a budget for exactly these bytes: the planner finds this split (one fewer layer on the CPU does not fit)
            p = s.plan(
                PlanRequest(ctx=CTX, n_gpu_layers=L, moe="resident", prompt_stream=False),
                DeviceProfile(vram_bytes=base + need, reserve_bytes=0),
            )
            assert (p.moe_mode, p.n_cpu_moe, p.device.experts) == ("resident", split, need), p.moe_reason
            s.apply(p)
            assert s.applied.arena.by_kind["experts"] == need
            prefill, decode = _run(s, tokens)
            assert np.abs(prefill - ref_prefill).max() <= 1e-5, (split, np.abs(prefill - ref_prefill).max())
            assert np.abs(decode - ref_decode).max() <= 1e-5, (split, np.abs(decode - ref_decode).max())


@pytest.mark.parametrize("device", DEVICES)
def test_streamed_experts_in_small_halves_equal_the_cpu_backend(paths, device):
    """Halves of two slots: a layer's routed experts go up two at a time, and the next layer's experts 0 and 1
    are copied while this one computes, used or not. Every layer's output is the CPU backend's; the bytes
    copied are exactly those experts'; a batch below the threshold stays on the CPU."""
    from engine.experts import CpuExperts
    from engine.runtime.device import DeviceArena
    from engine.runtime.expert_pool import ROLES
    from engine.runtime.expert_stream import StreamedExperts

    with _session(paths["qwen3moe"], device) as s:
        a = s.args
        L, E, K, D, T = a.n_layer, a.n_expert, a.n_expert_used, a.n_embd, 6
        host = CpuExperts(s.model.expert_stacks(), q8_act=s.model.w.q8_act)
        arena = DeviceArena(device, None)
        layout = expert_slot_layout(s.spec)
        st = StreamedExperts(host, set(range(L)), arena, layout, 4, T, q8_act=s.model.w.q8_act)
        assert dict(arena.by_kind) == {"stream": 4 * layout.stride}
        per_expert = sum(st.staging.expert_bytes[(0, r)].shape[1] for r in ROLES)
        rng = np.random.default_rng(11)
        copied = 0
        for layer in range(L):
            x = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32))
            ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64))
            w = torch.from_numpy(rng.random((T, K)).astype(np.float32))
            got = st.forward(layer, x.to(device), ids.to(device), w.to(device)).cpu()
            ref = host.forward(layer, x, ids, w)
            assert torch.abs(got - ref).max().item() <= 1e-5, layer
            prefetched = {0, 1} if layer > 0 else set()
            copied += len(set(ids.reshape(-1).tolist()) - prefetched) + (2 if layer < L - 1 else 0)
        assert st.streamed_layers == L and st.streamed_bytes == copied * per_expert
        st.end_step()
        short = torch.zeros((T - 1, D), device=device)
        st.forward(0, short, torch.zeros((T - 1, K), dtype=torch.int64, device=device), short[:, :K])
        assert st.streamed_layers == L and st.streamed_bytes == copied * per_expert


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_moves_experts_never_the_logits(paths, device):
    """EngineOptions.cache_prefetch: while a cached layer decodes, the next layer's router on this layer's input
    predicts its experts and the missing ones are uploaded — the logits equal prefetch off's and the CPU
    engine's; the uploads happen, are hit, and the prediction is scored per layer (recall, precision)."""
    tokens = random_tokens(16, 1024, seed=7)
    with _session(paths["qwen3moe"], device) as s:
        ref = s.logits(tokens, batch=False)
        L, E, K = s.args.n_layer, s.args.n_expert, s.args.n_expert_used
        placement = s.plan(
            PlanRequest(ctx=CTX, n_gpu_layers=L, moe="cache"), _profile_for(s, n_gpu_layers=L, slots=L * E // 2)
        )
        results = {}
        for n in (0, 4):
            s.apply(placement, replace(s.engine_options, cache_prefetch=n, cache_upload="inline"))
            assert s.applied.experts.prefetch_max == n
            s.reset_stats()
            results[n] = (s.logits(tokens, batch=False), s.stats())
        (off, st_off), (on, st) = results[0], results[4]
        assert np.abs(on - off).max() <= 1e-5 and np.abs(on - ref).max() <= 1e-5
        assert int(st_off.prefetched.sum()) == 0 and int(st_off.prediction.sum()) == 0
        assert s.applied.graph == ""  # prefetch decodes without CUDA graphs
        # every layer but the first is predicted once a step; each prediction names K experts
        assert st.prediction[0].tolist() == [0, 0, 0]
        assert (st.prediction[1:, 0] == len(tokens) * K).all() and (st.prediction[1:, 1] == len(tokens) * K).all()
        recall, precision = st.prefetch_recall(), st.prefetch_precision()
        assert np.isnan(recall[0]) and ((recall[1:] >= 0) & (recall[1:] <= 1)).all()
        np.testing.assert_array_equal(recall[1:], precision[1:])  # K predicted, K chosen
        # uploads on predictions, at most 4 a layer and step, and some of them hit before any miss of theirs
        assert 0 < int(st.prefetched.sum()) <= 4 * (L - 1) * len(tokens) and int(st.prefetched[0].sum()) == 0
        assert int(st.prefetch_hits.sum()) > 0 and (st.prefetch_hits <= st.prefetched).all()
        # a prefetched expert that hit was a hit the demand path would have missed: fewer misses than without
        assert int(st.misses.sum()) < int(st_off.misses.sum())
        d = st.to_dict()["prefetch"]
        assert d["uploads"] == int(st.prefetched.sum()) and d["recall"][0] is None
        from engine.bench.model import prefetch_report  # what `sharpi bench --json` prints

        r = prefetch_report(st)
        assert prefetch_report(st_off) is None and r["hits"] == int(st.prefetch_hits.sum())
        assert r["recall"] == pytest.approx(np.nanmean(recall[1:])) and r["recall_by_layer"][0] is None
