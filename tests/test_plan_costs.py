"""The cost model's fixed costs (DeviceProfile *_us fields): sums by hand, monotonicity, the auto
choice following them, and sane figures for a tiny model."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plan import DeviceProfile, ModelSpec, PlanError, PlanRequest, plan, predict
from engine.plan.profile import OVERHEAD_FIELDS, describe_profile, profile_source
from tests.test_plan_sizing import _q4k_except_vectors, _qwen3_args

GiB = 1 << 30


@pytest.fixture(scope="module")
def q30(synth_geometry) -> ModelSpec:
    """ModelSpec of the Qwen3-30B-A3B geometry file (Q4_K_M types, no weights)."""
    from engine.gguf import open_gguf

    with open_gguf(synth_geometry("qwen3-30b-a3b").path) as gf:
        return ModelSpec.from_gguf(gf)


def _spec(n_layer: int = 1) -> ModelSpec:
    return ModelSpec.from_args(_qwen3_args(n_layer=n_layer), _q4k_except_vectors)


def _fixed(spec, prof, **kw) -> float:
    """Seconds the fixed costs add to a prediction: with them minus without them."""
    return predict(spec, prof, **kw).seconds - predict(spec, prof.without_overheads(), **kw).seconds


def test_fixed_costs_by_hand():
    """One MoE layer (K = 2 of 8 experts), every mode; the sums written out in µs."""
    spec = _spec(1)
    us = dict(token_us=1000, host_layer_us=70, device_layer_us=300, cpu_experts_layer_us=200, cache_layer_us=900)
    prof = DeviceProfile(expert_skew=0.0, miss_us=50, **us)
    common = dict(kv_type="bf16", position=10)
    assert _fixed(spec, prof, mode="cpu", n_gpu_layers=0, **common) == pytest.approx((1000 + 70) * 1e-6)
    eager = dict(common, graphs=False)  # graphs off: the Python-driven device layer
    assert _fixed(spec, prof, mode="cpu", n_gpu_layers=1, **eager) == pytest.approx((1000 + 300 + 200) * 1e-6)
    # The trunk wholly on the device: graph replays, one graph-layer cost per layer, the round trip kept.
    g = replace(prof, graph_layer_us=40)
    assert _fixed(spec, g, mode="cpu", n_gpu_layers=1, **common) == pytest.approx((1000 + 40 + 200) * 1e-6)
    res = _fixed(spec, prof, mode="resident", n_gpu_layers=1, expert_slots=8, graphs=False, **common)
    assert res == pytest.approx((1000 + 300 + 900) * 1e-6)
    # Every layer and expert on the device: a CUDA-graph step, one graph-layer cost per layer instead.
    res = _fixed(spec, replace(prof, graph_layer_us=40), mode="resident", n_gpu_layers=1, expert_slots=8, **common)
    assert res == pytest.approx((1000 + 40) * 1e-6)
    h, K = 0.25, 2  # 2 of 8 slots, uniform popularity
    cache = _fixed(spec, prof, mode="cache", n_gpu_layers=1, expert_slots=2, **eager)
    assert cache == pytest.approx((1000 + 300 + 900 + (1 - h**K) * 200 + K * (1 - h) * 50) * 1e-6)
    cache = _fixed(spec, g, mode="cache", n_gpu_layers=1, expert_slots=2, **common)  # the cache's forward stays
    assert cache == pytest.approx((1000 + 40 + 900 + (1 - h**K) * 200 + K * (1 - h) * 50) * 1e-6)
    # n_cpu_moe puts the layer's experts on the host in every mode: the round trip, no cache cost.
    assert _fixed(spec, prof, mode="cache", n_gpu_layers=1, n_cpu_moe=1, **eager) == pytest.approx(1500e-6)
    # A measured hit rate replaces the Zipf model's.
    seen = predict(spec, prof, mode="cache", n_gpu_layers=1, expert_slots=2, observed_hit_rate=0.5, **common)
    assert seen.hit_rate == 0.5 and seen.overhead_counts["miss_us"] == pytest.approx(K * 0.5)


def test_overhead_counts_reproduce_fixed_seconds():
    spec = _spec(4)
    prof = DeviceProfile()
    for mode, slots in (("cpu", 0), ("cache", 9), ("resident", 32)):
        for n in (0, 2, 4):
            p = predict(spec, prof, mode=mode, n_gpu_layers=n, kv_type="f32", position=50, expert_slots=slots)
            total = sum(c * getattr(prof, f) for f, c in p.overhead_counts.items()) * 1e-6
            assert p.seconds_by_link["fixed"] == pytest.approx(total)
            c = p.overhead_counts
            assert c["host_layer_us"] + c["device_layer_us"] + c["graph_layer_us"] == 4


@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(OVERHEAD_FIELDS),
    base=st.floats(0, 5000),
    extra=st.floats(0, 5000),
    mode=st.sampled_from(["cpu", "cache", "resident"]),
    n=st.integers(0, 4),
    n_cpu_moe=st.integers(0, 4),
    slots=st.integers(1, 32),
)
def test_property_every_fixed_cost_is_monotone(field, base, extra, mode, n, n_cpu_moe, slots):
    """Raising one fixed cost never makes any placement predicted faster, and the increase is
    exactly its count times the raise."""
    spec = _spec(4)
    lo = replace(DeviceProfile(), **{field: base})
    hi = replace(lo, **{field: base + extra})
    kw = dict(mode=mode, n_gpu_layers=n, kv_type="f32", position=100, expert_slots=slots, n_cpu_moe=n_cpu_moe)
    a, b = predict(spec, lo, **kw), predict(spec, hi, **kw)
    assert b.seconds >= a.seconds
    assert b.seconds - a.seconds == pytest.approx(a.overhead_counts[field] * extra * 1e-6, abs=1e-12)


def _modes_over(spec, base: DeviceProfile, field: str, values) -> list[str]:
    req = PlanRequest(ctx=32768, kv_type="q8_0")
    return [plan(spec, replace(base, **{field: v}), req).moe_mode for v in values]


def test_auto_choice_follows_the_fixed_costs(q30):
    """At 12 GiB a costlier cache layer flips auto from the cache to the steady option — the resident split
    (the first layers' experts on the CPU, the rest resident) — exactly once; a costlier CPU-expert round trip
    slows CPU experts (48 round trips) more than the split (one per CPU layer), and the reason quotes the
    numbers the choice was made on."""
    spec = q30
    base = DeviceProfile(vram_bytes=12 * GiB).without_overheads()
    steps = [0, 100, 200, 400, 800, 1600, 3200, 6400]
    modes = _modes_over(spec, base, "cache_layer_us", steps)
    assert modes[0] == "cache" and modes[-1] == "resident"
    assert modes == sorted(modes, key=["cache", "resident"].index)  # one flip
    req = PlanRequest(ctx=32768, kv_type="q8_0")
    plans = [plan(spec, replace(base, cache_layer_us=1600, cpu_experts_layer_us=v), req) for v in (0, 800, 6400)]
    assert all(p.moe_mode == "resident" and 0 < p.n_cpu_moe < 48 for p in plans)
    ratio = [p.predicted_tok_s["resident"] / p.predicted_tok_s["cpu"] for p in plans]
    assert ratio == sorted(ratio) and ratio[0] > 1
    p = plans[-1]
    assert f"CPU experts {p.predicted_tok_s['cpu']:.1f}" in p.moe_reason
    assert f"resident from layer {p.n_cpu_moe}" in p.moe_reason


def test_default_profile_reproduces_the_h100_measurement(q30):
    """The default fixed costs are the H100 box's calibration (f30374a, docs/benchmarks-gpu.md). With
    that box's measured links they must reproduce its 12 GiB measurement of the segmented graph step
    (`sharpi bench ... --vram 12GiB --compare-modes`): CPU experts 32.9 tok/s within 25 %; the cache, at
    the hit rate it measured (98 %: 86.0 tok/s), below it (the model charges uploads serially: a floor)
    but within a factor of two, and ranked above CPU experts as measured."""
    box = DeviceProfile(vram_bytes=12 * GiB, cpu_expert_gbps=59.4, h2d_gbps=9.49, device_gbps=202, sync_us=23)
    p = plan(q30, box, PlanRequest(ctx=96, kv_type="f32"))
    assert p.n_gpu_layers == 48 and p.predicted_tok_s["cpu"] == pytest.approx(32.9, rel=0.25)
    kw = dict(mode="cache", n_gpu_layers=48, kv_type="f32", position=48, expert_slots=p.expert_slots)
    cache = predict(q30, box, observed_hit_rate=0.98, **kw).tok_s
    assert 86.0 / 2 < cache <= 86.0 and cache > p.predicted_tok_s["cpu"]


def test_tiny_model_prediction_is_bounded_by_the_fixed_costs():
    """A tiny model's bytes take microseconds; its tok/s is bounded by the per-token and
    per-layer costs (the demo model was once predicted at 36,000 tok/s)."""
    spec = _spec(4)
    prof = DeviceProfile()
    for n in (0, 4):
        p = plan(spec, prof, PlanRequest(ctx=256, n_gpu_layers=n))
        bound = 1e6 / (prof.token_us + 4 * min(prof.host_layer_us, prof.device_layer_us, prof.graph_layer_us))
        assert all(t is None or t <= bound for t in p.predicted_tok_s.values())
    bytes_only = plan(spec, prof.without_overheads(), PlanRequest(ctx=256, n_gpu_layers=0))
    assert bytes_only.predicted_tok_s["cpu"] > 5_000  # what the fixed costs fix


def test_profile_fixed_costs_validate_and_round_trip():
    for f in OVERHEAD_FIELDS:
        with pytest.raises(PlanError, match=f):
            DeviceProfile(**{f: -1.0})
    p = DeviceProfile(token_us=1234.5, cache_layer_us=10.0, measured=("token_us", "cache_layer_us"))
    assert DeviceProfile.from_dict(p.to_dict()) == p
    old = {k: v for k, v in p.to_dict().items() if k not in OVERHEAD_FIELDS}  # a pre-overhead file
    assert DeviceProfile.from_dict(old).token_us == DeviceProfile().token_us
    z = p.without_overheads()
    assert all(getattr(z, f) == 0 for f in OVERHEAD_FIELDS) and z.measured == ()


def test_describe_profile_marks_measured_fields():
    p = DeviceProfile(cpu_expert_gbps=31.5, miss_us=42, measured=("cpu_expert_gbps", "miss_us"))
    first, second = describe_profile(p)
    assert "CPU experts 31.5 GB/s*" in first and "device 400 GB/s," in first
    assert "miss 42 µs*" in second and "token 250 µs," in second
    assert profile_source(p) == "partly measured" and profile_source(DeviceProfile()) == "defaults"


def test_graph_steps_only_where_the_runtime_captures_them():
    """graph_layer_us is charged for every device layer when every layer's trunk is on the device
    (experts resident run inside the graph; experts on the CPU or in the cache cut it into segments and
    keep their round trips), and not at all when $SHARPI_CUDA_GRAPH turns the graphs off (the caller
    says so: ``graphs=False``; ``PlanRequest.cuda_graphs``, which Session fills from its options)."""
    from engine.plan.costmodel import graph_step

    spec = _spec(4)
    prof = DeviceProfile()
    kw = dict(kv_type="f32", position=50)
    assert graph_step(spec, "resident", 4) and not graph_step(spec, "resident", 3)
    assert graph_step(spec, "cache", 4) and graph_step(spec, "cpu", 4) and graph_step(spec, "resident", 4, n_cpu_moe=1)
    p = predict(spec, prof, mode="resident", n_gpu_layers=4, expert_slots=32, **kw)
    assert p.overhead_counts["graph_layer_us"] == 4 and p.overhead_counts["device_layer_us"] == 0
    assert p.overhead_counts["cache_layer_us"] == 0
    q = predict(spec, prof, mode="resident", n_gpu_layers=3, expert_slots=32, **kw)
    assert q.overhead_counts["graph_layer_us"] == 0 and q.overhead_counts["device_layer_us"] == 3
    for mode in ("cache", "cpu"):
        q = predict(spec, prof, mode=mode, n_gpu_layers=4, expert_slots=8 if mode != "cpu" else 0, **kw)
        assert q.overhead_counts["graph_layer_us"] == 4 and q.overhead_counts["device_layer_us"] == 0
        assert q.overhead_counts["cpu_experts_layer_us"] > 0  # the round trips between segments stay
    assert q.overhead_counts["cpu_experts_layer_us"] == 4 and q.seconds > p.seconds
    off = predict(spec, prof, mode="resident", n_gpu_layers=4, expert_slots=32, graphs=False, **kw)
    assert off.overhead_counts["graph_layer_us"] == 0 and off.overhead_counts["device_layer_us"] == 4
    assert off.seconds > p.seconds  # the defaults price a graph layer below a Python-driven one
    # the planner: PlanRequest.cuda_graphs (None: with graphs, as the runtime's default)
    req = PlanRequest(ctx=64, kv_type="f32", n_gpu_layers=4, moe="resident", position=50)
    roomy = replace(prof, vram_bytes=1 << 40)
    for graphs, counted in ((None, 4), (True, 4), (False, 0)):
        got = plan(spec, roomy, replace(req, cuda_graphs=graphs)).predictions["resident"]
        assert got.overhead_counts["graph_layer_us"] == counted, graphs


def test_bus_misses_are_priced_as_bus_reads_inside_the_graph():
    """``bus_misses`` (EngineOptions.cache_misses, PlanRequest.bus_misses): a cache miss's bytes are read by the
    device over the bus at ``bus_read_gbps`` and uploaded after, with no CPU bytes, no crossing and no CPU-expert
    round trip per layer, their uploads behind the decode — only inside a graph step (graphs off: the misses stay on
    the CPU)."""
    spec = _spec(4)
    prof = DeviceProfile(expert_skew=0.0)
    kw = dict(mode="cache", n_gpu_layers=4, expert_slots=8, kv_type="f32", position=50)  # 8 of 32: h = 0.25
    cpu, bus = predict(spec, prof, **kw), predict(spec, prof, bus_misses=True, **kw)
    missed = cpu.bytes_by_link["h2d"]  # (1 - h) of the experts' bytes, uploaded in both
    assert missed > 0 and bus.bytes_by_link["bus"] == pytest.approx(missed) and bus.bytes_by_link["h2d"] == missed
    # the bus path's uploads are copied from the page-locked host copy behind the decode: no time in the step
    assert bus.seconds_by_link["h2d"] == 0 and cpu.seconds_by_link["h2d"] > 0
    assert bus.bytes_by_link["cpu"] == cpu.bytes_by_link["cpu"] - missed  # the misses' CPU bytes are gone
    assert bus.seconds_by_link["bus"] == pytest.approx(missed / (prof.bus_read_gbps * 1e9))
    assert bus.overhead_counts["cpu_experts_layer_us"] == 0 and cpu.overhead_counts["cpu_experts_layer_us"] > 0
    assert bus.overhead_counts["miss_us"] == cpu.overhead_counts["miss_us"]
    assert bus.seconds_by_link["sync"] < cpu.seconds_by_link["sync"]
    slow = predict(spec, replace(prof, bus_read_gbps=0.01), bus_misses=True, **kw)
    assert slow.seconds > bus.seconds  # priced by the bus's rate
    eager = predict(spec, prof, bus_misses=True, graphs=False, **kw)
    assert eager.bytes_by_link["bus"] == 0 and eager.seconds == predict(spec, prof, graphs=False, **kw).seconds
    assert DeviceProfile.from_dict(replace(prof, bus_read_gbps=26.0).to_dict()).bus_read_gbps == 26.0
    with pytest.raises(PlanError):
        DeviceProfile(bus_read_gbps=0)


def test_misses_go_over_the_bus_where_the_host_holds_their_copy():
    """``EngineOptions.cache_misses``: "bus" on any device, "auto" on a CUDA device, either where the available host
    memory holds the experts' copy and the margin beside it (the planner prices what the placement can make);
    "cpu" never."""
    from engine.runtime.expert_pool import HostMirror, misses_over_bus

    need, m = 16 * GiB, HostMirror.MARGIN
    assert misses_over_bus("bus", "cpu", need, need + m) and not misses_over_bus("cpu", "cuda", need, None)
    assert not misses_over_bus("bus", "cuda", need, 0)  # asked for, but no room: CPU misses, priced so
    assert misses_over_bus("auto", "cuda", need, need + m) and misses_over_bus("auto", "cuda", need, None)
    assert not misses_over_bus("auto", "cuda", need, need + m - 1)
    assert not misses_over_bus("auto", "cpu", need, 1 << 50)  # the simulated device keeps CPU misses
