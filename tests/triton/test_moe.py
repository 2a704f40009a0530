"""Fused MoE Triton kernels (engine.runtime.triton_moe) vs their torch references, and the expert cache
served through them vs the CPU engine: in Triton's interpreter small shapes, compiled on CUDA
Qwen3-30B-A3B expert shapes. The whole-model cache test is CUDA-only: a model's worth of kernels takes
the interpreter minutes."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import config
from engine.config import EngineOptions
from engine.quant import QType
from engine.runtime import references as refs
from engine.runtime import triton_moe as tm
from engine.runtime.references import dequantize
from tests.triton import BIG, CUDA_ONLY, DEVICE, INTERPRET
from tests.triton_data import blocks, expert_pool, routing_case

Q = QType
if not BIG:
    CASES = [
        ((Q.Q4_K, Q.Q4_K, Q.Q6_K), 256, 512),
        ((Q.Q8_0, Q.Q4_0, Q.Q5_K), 256, 96),
        ((Q.Q4_0, Q.Q8_0, Q.Q8_0), 96, 64),
        ((Q.Q2_K, Q.Q3_K, Q.IQ4_XS), 256, 256),
        ((Q.MXFP4, Q.IQ4_NL, Q.Q5_0), 96, 64),
    ]
    E, K, TOKENS = 5, 2, (1, 3)
    ONE_MATRIX = ((Q.Q4_K, 40, 512), (Q.Q8_0, 33, 96))
else:
    CASES = [((q, q, q), 768, 2048) for q in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)]
    CASES += [((Q.Q2_K, Q.Q3_K, Q.IQ4_XS), 768, 2048), ((Q.MXFP4, Q.IQ4_NL, Q.Q5_0), 768, 2048)]
    CASES.append(((Q.Q4_K, Q.Q4_K, Q.Q6_K), 768, 2048))
    E, K, TOKENS = 16, 8, (1, 4, 40)
    ONE_MATRIX = ((Q.Q4_K, 4096, 2048), (Q.Q6_K, 2048, 4096))
TOL = 1e-5 if DEVICE == "cpu" else 1e-4  # tf32x3 on CUDA

# The interpreter runs programs one by one: fewer, larger tiles keep it quick.
INTERPRETER_LAUNCH = {"moe_gate_up:*:*": {"BR": 16, "NB": 4, "num_warps": 4}}


def _case_id(case) -> str:
    types, F, D = case
    return "-".join(t.name for t in types) + f"-F{F}-D{D}"


@pytest.mark.parametrize("T", TOKENS, ids=[f"T{t}" for t in TOKENS])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_moe_kernels_match_the_reference(case, T, device, launch_table):
    """moe_decode (exact float) up to TRITON_MAX_T tokens and moe_prefill on float32 operands (the bf16
    ones: test_prefill.py) against moe_decode_reference, with a slot missing (skipped) when T > 1."""
    log = launch_table(INTERPRETER_LAUNCH) if INTERPRET else None
    types, F, D = case
    rng = np.random.default_rng((1, *map(int, types), F, D, T))
    pool, stride, roles = expert_pool(types, F, D, E, device, rng)
    slot_off, x, w = routing_case(T, K, E, D, stride, device, rng)
    ref = refs.moe_decode_reference(pool, slot_off, x, w, roles)
    errs = []
    decode = lambda *a: tm.moe_decode(*a, act="f32")  # noqa: E731 — the q8 kernels: test_q8.py
    with config.overriding(prefill_precision="f32"):  # SHARPI_PREFILL_PRECISION=f32
        for fn in (decode, tm.moe_prefill) if T <= 8 else (tm.moe_prefill,):
            y = fn(pool, slot_off, x, w, roles)
            errs.append(((y - ref).norm() / ref.norm()).item())
    assert max(errs) < TOL, ([t.name for t in types], F, D, T, errs)
    if log is not None:
        assert log.kernels() == {"moe_gate_up"}


@pytest.mark.parametrize("T", [24])
def test_the_kernels_read_offsets_below_the_pools_base(device, T):
    """An offset is read wherever it points, below the base too (a host copy's: the cache's misses over the bus),
    and only −1 is skipped: the kernels given the pool from its middle slot, with more distinct experts than
    that view has slots, equal the reference over the whole pool."""
    types, F, D = CASES[0]
    rng = np.random.default_rng((3, T))
    pool, stride, roles = expert_pool(types, F, D, E, device, rng)
    slot_off, x, w = routing_case(T, K, E, D, stride, device, rng)
    ref = refs.moe_decode_reference(pool, slot_off, x, w, roles)
    half = E // 2
    rel = torch.where(slot_off != -1, slot_off - half * stride, -1)
    assert (rel < -1).any()
    decode = lambda *a: tm.moe_decode(*a, act="f32")  # noqa: E731
    with config.overriding(prefill_precision="f32"):
        for fn in (decode, tm.moe_prefill) if T <= 8 else (tm.moe_prefill,):
            kw = {"n_experts": E} if fn is tm.moe_prefill else {}
            y = fn(pool[half:], rel, x, w, roles, **kw)
            assert ((y - ref).norm() / ref.norm()).item() < TOL, fn


@pytest.mark.parametrize(("q", "R", "n"), ONE_MATRIX, ids=[f"{q.name}-{R}x{n}" for q, R, n in ONE_MATRIX])
def test_one_matrix_tiles_match_the_reference(q, R, n, device):
    """The tiled one-matrix path (a trunk matrix with more than TRITON_MAX_T tokens), float32 operands."""
    rng = np.random.default_rng((2, int(q), R, n))
    raw = blocks(q, R, n, device, rng)
    X = torch.from_numpy(rng.standard_normal((37, n)).astype(np.float32)).to(device)
    ref = (X.double() @ dequantize(raw, q, n).double().T).float()
    y = tm.one_matrix(raw, X, q, R, n, options=EngineOptions.from_env().with_env({"SHARPI_PREFILL_PRECISION": "f32"}))
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < TOL, (q.name, "one_matrix", err)


@pytest.mark.cuda
@CUDA_ONLY
@pytest.mark.parametrize(("act", "prefill", "tol"), [("f32", "f32", 1e-3), ("q8", "bf16", 3e-2)])
def test_expert_cache_through_fused_kernels_on_cuda(tmp_path, monkeypatch, act, prefill, tol):
    """f32: the exact-float kernels (prompts on float32 operands, SHARPI_PREFILL_PRECISION=f32) against the
    exact-float CPU engine; q8 (EngineOptions.device_act, i.e. SHARPI_DEVICE_ACT=q8): the decode kernels
    round activations to 8 bits (~1 % relative per product), the prompt kernels x, weights and h to
    bfloat16 (the default on CUDA; 2⁻⁹ relative per operand), so a looser bound."""
    from engine.api import LoadOptions, Session
    from engine.runtime import kernel_select as ks
    from engine.synth.writer import write_model
    from tests.oracle import random_tokens

    acts = []
    moe_act = ks.moe_act
    monkeypatch.setattr(ks, "moe_act", lambda *a, **k: acts.append(moe_act(*a, **k)) or acts[-1])
    CTX = 64
    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=4, layers=2, weight_type="Q4_K",
                       type_overrides={"*ffn_down*": "Q6_K"}).path  # fmt: skip
    tokens = random_tokens(9, 1024, seed=8)  # 9 > TRITON_MAX_T: prefill takes the grouped kernels
    dec = tokens[:3]  # decode steps
    # SHARPI_DEVICE_ACT=act for the process (what the session's options and any options=None default see)
    with (
        config.overriding(device_act=act, prefill_precision=prefill),
        Session.load(str(path), LoadOptions(n_ctx=CTX, device="cuda", q8_act=False)) as s,
    ):
        ref_dec, ref_pre = s.logits(dec, batch=False), s.logits(tokens)
        for moe in _half_cache_then_resident(s, CTX):
            assert s.applied.options.device_act == act and s.applied.options.prefill_precision == prefill
            cached = s.applied.experts
            assert cached is not None and all(cached._fused.values()), "the fused kernels must serve these layers"
            for batch, ref, toks in ((False, ref_dec, dec), (True, ref_pre, tokens)):
                got = s.logits(toks, batch=batch)
                err = np.abs(got - ref).max() / np.abs(ref).max()
                assert err <= tol, (moe, "prefill" if batch else "decode", err)
    assert set(acts) == {act}, acts  # the routed experts decoded on the options' activation rounding


@pytest.mark.cuda
@CUDA_ONLY
def test_streamed_prompt_through_the_grouped_kernel_on_cuda(tmp_path):
    """Experts on the CPU (--moe cpu, and the first layer beside a resident pool): a 40-token prompt (≥ the
    default 32) copies its layers' experts to the staging slots and runs the grouped prefill kernel there,
    through the side-stream copies; exact-float kernels (float32 prompt operands: SHARPI_PREFILL_PRECISION=f32)
    against the exact-float CPU engine. CUDA's default bfloat16 operands are held to their references in
    tests/triton/test_prefill.py."""
    from engine.api import LoadOptions, Session
    from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout
    from engine.synth.writer import write_model
    from tests.oracle import random_tokens

    CTX = 64
    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=4, layers=3, weight_type="Q4_K",
                       type_overrides={"*ffn_down*": "Q6_K"}).path  # fmt: skip
    tokens = random_tokens(40, 1024, seed=8)
    engine = replace(config.current(), prefill_precision="f32")
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cuda", q8_act=False, engine=engine)) as s:
        ref = s.logits(tokens)
        L, E = s.args.n_layer, s.args.n_expert
        need = device_bytes(s.spec, n_gpu_layers=L, ctx=CTX, kv_type="f32", reserve=0).total
        stride = expert_slot_layout(s.spec).stride
        for moe, n_cpu_moe, slots in (("cpu", 0, 2 * E), ("resident", 1, (L - 1) * E + 2 * E)):
            prof = DeviceProfile(vram_bytes=need + slots * stride, reserve_bytes=0)
            s.apply(s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe=moe, n_cpu_moe=n_cpu_moe), prof))
            st = s.applied.stream
            assert st is not None and all(st.compute.fused.values()), "the fused kernels must serve these layers"
            got = s.logits(tokens)
            assert st.streamed_layers == (L if moe == "cpu" else 1)
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= 1e-3, (moe, err)
            assert set(st.last_pass_seconds()) == {"copy", "compute"}


def test_streamed_experts_in_small_halves_through_the_fused_kernels(tmp_path, device):
    """The streaming backend's chunks through the fused kernels (interpreter and CUDA): halves of two slots, so
    each layer's routed experts run two at a time (the other pairs' offsets −1), the next layer's experts 0
    and 1 copied ahead; T > TRITON_MAX_T takes the grouped prefill kernel. Each layer equals the CPU backend."""
    from engine.api import LoadOptions, Session
    from engine.experts import CpuExperts
    from engine.plan import expert_slot_layout
    from engine.runtime.device import DeviceArena
    from engine.runtime.expert_stream import StreamedExperts
    from engine.synth.writer import write_model

    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=4, layers=2, weight_type="Q4_K",
                       type_overrides={"*ffn_down*": "Q6_K"}).path  # fmt: skip
    with Session.load(str(path), LoadOptions(n_ctx=64, device=device, q8_act=False)) as s:
        a = s.args
        L, E, K, D, T = a.n_layer, a.n_expert, a.n_expert_used, a.n_embd, 10
        host = CpuExperts(s.model.expert_stacks(), q8_act=False)
        st = StreamedExperts(
            host, set(range(L)), DeviceArena(device, None), expert_slot_layout(s.spec), 4, T, q8_act=False
        )
        assert all(st.compute.fused.values())
        rng = np.random.default_rng(12)
        for layer in range(L):
            x = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32))
            ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64))
            w = torch.from_numpy(rng.random((T, K)).astype(np.float32))
            got = st.forward(layer, x.to(device), ids.to(device), w.to(device)).cpu()
            ref = host.forward(layer, x, ids, w)
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < TOL, (layer, err)
        assert st.streamed_layers == L


def test_resident_prompt_stays_on_the_device_and_records_its_routes(tmp_path, device, monkeypatch):
    """A prompt through resident experts (interpreter and CUDA): the grouped kernel over the pinned slot table,
    with no route copied to the host inside the pass (``CachedExperts._serve``, the host-routed path, never
    runs); the routes reach the profiler when the pass ends, every pair a hit; the logits are the CPU
    engine's."""
    from engine.api import LoadOptions, Session
    from engine.config import current
    from engine.plan import DeviceProfile, PlanRequest
    from engine.runtime.expert_cache import CachedExperts
    from engine.synth.writer import write_model
    from tests.oracle import random_tokens

    def no_host_routing(*a, **k):
        raise AssertionError("a resident layer routed through the host")

    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=5, layers=2, weight_type="Q4_K").path
    engine = replace(current(), prefill_precision="f32")
    tokens = random_tokens(12, 1024, seed=3)  # > TRITON_MAX_T: the grouped prefill kernel
    with Session.load(str(path), LoadOptions(n_ctx=32, device=device, q8_act=False, engine=engine)) as s:
        ref = s.logits(tokens)
        L, K = s.args.n_layer, s.args.n_expert_used
        s.apply(s.plan(PlanRequest(ctx=32, n_gpu_layers=L, moe="resident"), DeviceProfile(vram_bytes=1 << 30)))
        monkeypatch.setattr(CachedExperts, "_serve", no_host_routing)
        s.reset_stats()
        got = s.logits(tokens)
        st = s.stats()
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))
        assert st.calls.sum(1).tolist() == [len(tokens) * K] * L
        assert st.hits.sum() == len(tokens) * K * L and st.misses.sum() == 0


@contextlib.contextmanager
def _bus_cache(tmp_path, device: str, **kw):
    """A two-layer Q4_K/Q6_K qwen3moe session on ``device`` -> (session, its CPU expert backend, a 3-slot expert
    cache over every layer whose misses go over the bus, on exact-float decode and float32 prompt products)."""
    from engine.api import LoadOptions, Session
    from engine.experts import CpuExperts
    from engine.plan import expert_slot_layout
    from engine.runtime.device import DeviceArena
    from engine.runtime.expert_cache import CachedExperts
    from engine.synth.writer import write_model

    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=4, layers=2, weight_type="Q4_K",
                       type_overrides={"*ffn_down*": "Q6_K"}).path  # fmt: skip
    with Session.load(str(path), LoadOptions(n_ctx=32, device=device, q8_act=False)) as s:
        stacks = s.model.expert_stacks()
        opts = replace(config.current(), cache_misses="bus", device_act="f32", cache_upload="inline",
                       prefill_precision="f32")  # fmt: skip
        c = CachedExperts(stacks, set(range(s.args.n_layer)), DeviceArena(device, None), expert_slot_layout(s.spec),
                          3, q8_act=False, options=opts, **kw)  # fmt: skip
        yield s, CpuExperts(stacks, q8_act=False), c


def test_bus_misses_are_read_from_the_host_copy(tmp_path, device):
    """``cache_misses="bus"`` (interpreter and CUDA): the cache's device half computes every pair — the pool's hits
    and, from the experts' host copy (``HostMirror``, page-locked on CUDA), its misses — equal to the CPU backend,
    with the pool empty, then holding some of the experts; the routes taken after the step queue the misses."""
    with _bus_cache(tmp_path, device) as (s, host, c):
        a = s.args
        L, E, K, D = a.n_layer, a.n_expert, a.n_expert_used, a.n_embd
        assert c.mirror is not None and all(c.step_plan(i).bus and not c.step_plan(i).host for i in range(L))
        rng = np.random.default_rng(3)
        for layer in range(L):
            ids = torch.from_numpy(rng.permutation(E)[:K][None].astype(np.int64))
            if layer == 1:  # two of the token's experts in the pool: hits beside the misses
                for e in ids[0, :2].tolist():
                    assert c.pool.upload(layer, e, set())
                c.pool.sync()
                c.pool.refresh_table()
            x = torch.from_numpy(rng.standard_normal((1, D)).astype(np.float32))
            w = torch.from_numpy(rng.random((1, K)).astype(np.float32))
            got = c.device_part(layer, x.to(device), ids.to(device), w.to(device)).cpu()
            ref = host.forward(layer, x, ids, w)
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < TOL * 10, (layer, err)
            c.routed(np.array([layer]), ids.numpy())
            assert len(c.queue) == (K if layer == 0 else 2 * K - 2)
        c.mirror.close()


@pytest.mark.parametrize("T", [24])
def test_a_pass_of_many_tokens_reads_its_misses_over_the_bus(tmp_path, device, monkeypatch, T):
    """``cache_misses="bus"``, a pass of T tokens (the grouped prefill kernel, with more distinct experts than the
    pool has slots; a few tokens take the decode kernels, whose bus reads the test above holds): every pair in one
    device call, hits from the pool, misses from the host copy (offsets outside the pool) — equal to the CPU
    backend; no upload and no CPU expert inside the pass; once it ends, the routes are counted and only the misses
    with at least ``prompt_upload_min`` of its tokens queued, the most used first."""
    from engine.profiler import ExpertProfiler

    def no_cpu(*a, **k):
        raise AssertionError("a bus pass computed experts on the CPU or uploaded inside the pass")

    with _bus_cache(tmp_path, device, prompt_upload_min=3) as (s, host, c):
        a = s.args
        L, E, K, D = a.n_layer, a.n_expert, a.n_expert_used, a.n_embd
        c.profiler = ExpertProfiler(L, E)
        rng = np.random.default_rng(5)
        layer = 1
        for e in (0, 1):  # two experts in the pool: hits beside the misses
            assert c.pool.upload(layer, e, set())
        c.pool.sync()
        c.pool.refresh_table()
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
        x = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32))
        w = torch.from_numpy(rng.random((T, K)).astype(np.float32))
        monkeypatch.setattr(c, "_host_outputs", no_cpu)
        monkeypatch.setattr(c.pool, "upload", no_cpu)
        got = c.forward(layer, x.to(device), torch.from_numpy(ids).to(device), w.to(device)).cpu()
        ref = host.forward(layer, x, torch.from_numpy(ids), w)
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < TOL * 10, err
        assert c.queue == [] and c.profiler.hits.sum() == 0  # accounted when the pass ends
        monkeypatch.undo()
        c._record_late_routes()
        flat = ids.reshape(-1)
        in_pool = np.isin(flat, [0, 1])
        assert c.profiler.hits[layer].sum() == in_pool.sum() and c.profiler.misses[layer].sum() == (~in_pool).sum()
        counts = np.bincount(flat[~in_pool], minlength=E)
        want = sorted(np.flatnonzero(counts >= 3).tolist(), key=lambda e: -counts[e])
        assert [e for _, e in c.queue] == want and all(i == layer for i, _ in c.queue)
        c.mirror.close()


@pytest.mark.cuda
@CUDA_ONLY
def test_cache_misses_read_over_the_bus_inside_the_step(tmp_path, monkeypatch):
    """``cache_misses="bus"`` on CUDA: a decode step computes the expert cache's misses on the device, the fused
    kernels reading them from the experts' page-locked host copy — every MoE layer inside one captured graph
    segment, no host half (``host_part`` never runs) — and gives the CPU engine's logits; the misses are still
    counted, and uploaded after their step. (A whole session is minutes in the interpreter: the test above holds
    the device half there.)"""
    device = DEVICE
    from engine.api import LoadOptions, Session
    from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout
    from engine.runtime.expert_cache import CachedExperts
    from engine.synth.writer import write_model
    from tests.oracle import random_tokens

    def no_host_half(*a, **k):
        raise AssertionError("a bus layer ran a host half")

    CTX = 32
    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=4, layers=2, weight_type="Q4_K",
                       type_overrides={"*ffn_down*": "Q6_K"}).path  # fmt: skip
    tokens = random_tokens(10, 1024, seed=8)
    with (
        config.overriding(device_act="f32", cache_misses="bus", cache_upload="inline", prefill_precision="f32"),
        Session.load(str(path), LoadOptions(n_ctx=CTX, device=device, q8_act=False)) as s,
    ):
        ref = s.logits(tokens, batch=False)
        ref_prompt = s.logits(tokens, batch=True)
        L = s.args.n_layer
        need = device_bytes(s.spec, n_gpu_layers=L, ctx=CTX, kv_type="f32", reserve=0).total
        prof = DeviceProfile(vram_bytes=need + 3 * expert_slot_layout(s.spec).stride, reserve_bytes=0)
        s.apply(s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe="cache"), prof))
        cached = s.applied.experts
        assert isinstance(cached, CachedExperts) and cached.mirror is not None
        assert all(cached.step_plan(i).bus and not cached.step_plan(i).host for i in range(L))
        monkeypatch.setattr(CachedExperts, "host_part", no_host_half)
        s.reset_stats()
        got = s.logits(tokens, batch=False)
        g = s.model.decode_graph
        assert g is not None and len(g.segments) == 1 and g.steps == len(tokens)
        assert "over the bus" in g.describe() and "page-locked RAM" in s.applied.describe()
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= TOL * 10, err
        st = s.stats()
        assert st.misses.sum() > 0 and st.hits.sum() > 0, (st.hits.sum(), st.misses.sum())
        assert st.hits.sum() + st.misses.sum() == st.calls.sum()
        assert cached.uploaded_bytes > 0
        # A prompt: one device call a layer, its misses read over the bus too; no CPU experts.
        monkeypatch.setattr(CachedExperts, "_host_outputs", no_host_half)
        got = s.logits(tokens, batch=True)
        err = np.abs(got - ref_prompt).max() / np.abs(ref_prompt).max()
        assert err <= TOL * 10, err


@pytest.mark.cuda
def _half_cache_then_resident(s, ctx: int):
    """Apply to session ``s`` every layer on the device with half its experts in the cache, then all resident
    (budgets that afford exactly those slots, KV f32), yielding the mode after each apply."""
    from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout

    L, E = s.args.n_layer, s.args.n_expert
    need = device_bytes(s.spec, n_gpu_layers=L, ctx=ctx, kv_type="f32", reserve=0).total
    for moe, slots in (("cache", L * E // 2), ("resident", L * E)):
        prof = DeviceProfile(vram_bytes=need + slots * expert_slot_layout(s.spec).stride, reserve_bytes=0)
        s.apply(s.plan(PlanRequest(ctx=ctx, kv_type="f32", n_gpu_layers=L, moe=moe), prof))
        yield moe


@CUDA_ONLY
@pytest.mark.parametrize(
    ("experts", "down"), [("Q2_K", "Q3_K"), ("IQ4_XS", "Q5_0"), ("MXFP4", "IQ4_NL")], ids=["Q2_K", "IQ4_XS", "MXFP4"]
)
def test_expert_cache_of_the_newer_types_through_the_fused_kernels(tmp_path, experts, down):
    """Q2_K, Q3_K, Q5_0, MXFP4, IQ4_NL and IQ4_XS experts (and trunk matrices of the expert type) in the cache and
    resident on the device run the Triton kernels, not the torch references, and give the exact-float CPU
    engine's logits through a prompt (the grouped kernels) and decode steps. CUDA only, as the test above: a
    whole session is minutes in the interpreter, where test_moe_kernels_match_the_reference holds each kernel."""
    from engine.api import LoadOptions, Session
    from engine.runtime import triton_qblocks as qb
    from engine.synth.writer import write_model
    from tests.oracle import random_tokens

    assert set(qb.CUDA_CHECKED) >= {QType[experts], QType[down]}  # this test's CUDA run is what admitted them
    CTX = 48
    path = write_model(tmp_path / "q.gguf", "qwen3moe", seed=5, layers=2, weight_type=experts,
                       type_overrides={"*ffn_down_exps*": down}).path  # fmt: skip
    tokens = random_tokens(9, 1024, seed=3)  # 9 > TRITON_MAX_T: prefill takes the grouped kernels
    dec = tokens[:2]
    with (
        config.overriding(device_act="f32", prefill_precision="f32"),
        Session.load(str(path), LoadOptions(n_ctx=CTX, device=DEVICE, q8_act=False)) as s,
    ):
        ref_dec, ref_pre = s.logits(dec, batch=False), s.logits(tokens)
        for moe in _half_cache_then_resident(s, CTX):
            cached = s.applied.experts
            assert cached is not None and all(cached._fused.values()), "the fused kernels must serve these layers"
            for batch, ref, toks in ((False, ref_dec, dec), (True, ref_pre, tokens)):
                got = s.logits(toks, batch=batch)
                err = np.abs(got - ref).max() / np.abs(ref).max()
                assert err <= TOL * 10, (moe, "prefill" if batch else "decode", err)


def test_biased_clamped_experts_run_the_gemv_on_the_slots(tmp_path, monkeypatch):
    """gpt-oss's experts (biases, the clamped SwiGLU) in the cache and resident on the device: a token's pairs run
    as one Triton GEMV a role over the slots' MXFP4 bytes in place (``PoolCompute.gemv_pairs``), a prompt's experts
    as tiled products on them (``expert_rows``), not the dequantized matrices, and give the CPU engine's logits;
    with the experts on the CPU, a prompt's experts streamed to the staging slots run the same tiled products."""
    from engine.api import LoadOptions, Session
    from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout
    from engine.runtime.pool_compute import PoolCompute
    from engine.synth.writer import write_model
    from tests.oracle import random_tokens

    CTX = 48
    path = write_model(tmp_path / "o.gguf", "gpt-oss", seed=5, layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32,
                       experts=4, experts_used=2, expert_ff=64, sliding_window=8,
                       type_overrides={"*_exps.weight": "MXFP4"}).path  # fmt: skip
    calls = [0]
    gemv_pairs = PoolCompute.gemv_pairs

    def counted(self, *a):
        calls[0] += 1
        return gemv_pairs(self, *a)

    tiles = [0]
    one_matrix = tm.one_matrix

    def counted_tiles(*a, **k):
        tiles[0] += 1
        return one_matrix(*a, **k)

    monkeypatch.setattr(PoolCompute, "gemv_pairs", counted)
    monkeypatch.setattr(tm, "one_matrix", counted_tiles)
    tokens = random_tokens(4, 1024, seed=3)
    prompt = random_tokens(40, 1024, seed=4)  # 80 pairs: each expert once over its rows (expert_rows)
    with (
        config.overriding(device_act="f32", prefill_precision="f32"),
        Session.load(str(path), LoadOptions(n_ctx=CTX, device=DEVICE, q8_act=False)) as s,
    ):
        ref, ref_prompt = s.logits(tokens, batch=False), s.logits(prompt)
        for moe in _half_cache_then_resident(s, CTX):
            assert all(s.applied.experts.compute.gemv_glu.values()), moe
            before = calls[0]
            got = s.logits(tokens, batch=False)
            assert calls[0] > before, moe
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= TOL * 10, (moe, err)
            if moe == "resident":  # a prompt's experts, each once, all on the device
                before = tiles[0]
                got = s.logits(prompt)
                assert tiles[0] > before, moe
                err = np.abs(got - ref_prompt).max() / np.abs(ref_prompt).max()
                assert err <= TOL * 10, (moe, "prompt", err)
        # Experts on the CPU: the prompt's experts are copied to the staging slots (a layer's a half) and
        # multiplied there tile by tile, as resident ones are.
        L, E = s.args.n_layer, s.args.n_expert
        need = device_bytes(s.spec, n_gpu_layers=L, ctx=CTX, kv_type="f32", reserve=0).total
        prof = DeviceProfile(vram_bytes=need + 2 * E * expert_slot_layout(s.spec).stride, reserve_bytes=0)
        s.apply(s.plan(PlanRequest(ctx=CTX, kv_type="f32", n_gpu_layers=L, moe="cpu"), prof))
        st = s.applied.stream
        assert st is not None and all(st.compute.gemv_glu.values())
        before = tiles[0]
        got = s.logits(prompt)
        assert tiles[0] > before and st.streamed_layers == L
        err = np.abs(got - ref_prompt).max() / np.abs(ref_prompt).max()
        assert err <= TOL * 10, ("cpu", "prompt", err)
