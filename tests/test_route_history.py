"""The planner learns: the expert cache's hit-rate curve from the user's routing history (engine.routes.history)
when it holds traces of the model's geometry, else the synthetic curve; a session plans with it and says which."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine import config
from engine.api import LoadOptions, Session
from engine.plan import PlanRequest
from engine.routes import history, save_trace
from engine.routes.synthetic import SyntheticRouting
from engine.runtime import hit_curves as H
from engine.runtime.hit_curves import hit_curve


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    return tmp_path_factory.mktemp("cal")  # the curves' disk cache, shared: the synthetic one is replayed once


def _opts(tmp_path, cal):
    return replace(config.current(), routes_dir=tmp_path / "routes", calibration_dir=cal)


def _trace(E=8, k=2, seed=0, tokens=96):
    return SyntheticRouting(n_expert=E, k=k, n_layers=3).generate(prompt=16, decode=tokens - 16, turns=1, seed=seed)


def test_no_history_gives_the_fallback_and_the_synthetic_curve_is_cached(tmp_path, cal, monkeypatch):
    opts = _opts(tmp_path, cal)
    z = H.planner_curve(128, 8, options=replace(opts, hit_curve="zipf"))  # the planner's Zipf guess
    assert z.source == H.SOURCE_ZIPF and z.points == () and z.detail == H.ZIPF_DETAIL
    d = H.planner_curve(128, 8, options=opts)  # EngineOptions.hit_curve's default: the recorded synthetic curve
    assert d.source == H.SOURCE_SYNTHETIC and d.points == H.SYNTHETIC_CURVE and d.detail == H.SYNTHETIC_DETAIL
    few = H.planner_curve(8, 2, options=opts)  # fewer experts than the synthetic trace's model: the Zipf guess
    assert few.source == H.SOURCE_ZIPF and few.points == () and few.detail == H.FEW_EXPERTS_DETAIL
    c = H.planner_curve(64, 8, options=opts, policy="lru")  # not recorded: replayed
    assert c == H.planner_curve(128, 8, options=opts, fallback="synthetic", policy="lru")
    assert c.source == H.SOURCE_SYNTHETIC and c.traces == 0 and c.detail == H.SYNTHETIC_DETAIL
    caps = [x for x, _ in c.points]
    assert caps == sorted(caps) and all(0 < h < 1 for _, h in c.points)
    assert [h for _, h in c.points] == sorted(h for _, h in c.points)  # more room, more hits
    # the second time from the disk cache: no replay
    monkeypatch.setattr("engine.runtime.hit_curves.hit_curve", lambda *a, **k: pytest.fail("replayed again"))
    assert H.planner_curve(128, 8, options=opts, fallback="synthetic", policy="lru") == c


@pytest.mark.slow
def test_the_recorded_synthetic_curve_is_what_the_replay_gives():
    """SYNTHETIC_CURVE is the default policy's replay of the synthetic trace (a policy or trace change must
    re-record it)."""
    assert hit_curve(H.SYNTHETIC.generate(seed=0), policy=H.DEFAULT_POLICY) == H.SYNTHETIC_CURVE


def test_the_history_of_this_geometry_gives_the_curve(tmp_path, cal):
    opts = _opts(tmp_path, cal)
    d = history.history_dir(opts)
    a, b = _trace(seed=1, tokens=96), _trace(seed=2, tokens=64)
    pa = history.save_to_history(a, opts)
    pb = history.save_to_history(b, opts)
    assert pa != pb and pa.parent == d == pb.parent and history.history_traces(opts) == sorted([pa, pb])
    save_trace(_trace(E=16, k=4), d / "other-model.npz")  # another geometry: not this model's curve
    (d / "broken.npz").write_bytes(b"not a trace")  # skipped
    c = H.planner_curve(8, 2, options=opts)
    assert c.source == H.SOURCE_HISTORY and (c.traces, c.tokens) == (2, 160)
    assert c.detail == "your routing history: 2 traces, 160 tokens"
    ca, cb = hit_curve(a), hit_curve(b)  # weighted by tokens
    want = [round((ha * 96 + hb * 64) / 160, 4) for (_, ha), (_, hb) in zip(ca, cb)]
    assert [h for _, h in c.points] == pytest.approx(want, abs=1e-4)
    assert H.planner_curve(8, 2, options=opts, use_history=False).source == H.SOURCE_ZIPF  # few experts
    assert H.planner_curve(16, 4, options=opts).traces == 1  # the other model's own history
    assert H.planner_curve(128, 8, options=opts).source == H.SOURCE_SYNTHETIC  # none of that geometry: the fallback


def test_a_session_plans_with_its_users_routing_history(tmp_path, cal, synth_model):
    path = synth_model("qwen3moe", "Q8_0", vocab=1024).path
    opts = _opts(tmp_path, cal)
    with Session.load(str(path), LoadOptions(n_ctx=64, device="cpu", engine=opts)) as s:
        prof = s.device_profile(1 << 30)
        assert prof.hit_curve_source == H.FEW_EXPERTS_DETAIL and prof.hit_curve == ()  # no history yet, 8 experts
        rec = s.record_routes()
        s.logits(list(range(1, 40)), batch=False)
        s.stop_recording_routes()
        saved = s.save_routes_to_history(rec)
        assert saved.endswith(".npz") and history.history_traces(opts)
        prof = s.device_profile(1 << 30)
        assert prof.hit_curve_source == "your routing history: 1 trace, 39 tokens"
        assert prof.hit_curve == s.hit_curve().points and len(prof.hit_curve) == len(H.CURVE_CAPACITIES)
        p = s.plan(PlanRequest(ctx=64, n_gpu_layers=-1, moe="cache"), prof)
        assert p.profile.hit_curve_source.startswith("your routing history")
        s.set_routing_history(False)  # "use my routing history" unchecked
        assert s.device_profile(1 << 30).hit_curve == ()
    off = LoadOptions(n_ctx=64, device="cpu", engine=replace(opts, hit_curve="zipf"), routing_history=False)
    with Session.load(str(path), off) as s:
        assert s.hit_curve().source == H.SOURCE_ZIPF
        assert s.device_profile(1 << 30).hit_curve_source == H.ZIPF_DETAIL and s.device_profile(1 << 30).hit_curve == ()
    fine = synth_model("qwen3moe", "Q8_0", vocab=512, experts=64, experts_used=8, layers=1).path
    with Session.load(str(fine), LoadOptions(n_ctx=64, device="cpu", engine=opts, routing_history=False)) as s:
        prof = s.device_profile(1 << 30)  # a fine-grained MoE: the synthetic curve
        assert prof.hit_curve_source == H.SYNTHETIC_DETAIL and prof.hit_curve == H.SYNTHETIC_CURVE
