"""An ``auto`` placement planned again on the session's own routing (engine.runtime.replan, engine.routes.sample),
on the simulated device: the prompt sample records exactly the model's routing and leaves before decoding; once the
prompts have routed ``replan_tokens`` tokens the session prices the cache with its own curve and, where the choice
changes, applies the new placement between turns — with the CPU path's tokens."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from engine import config
from engine.api import LoadOptions, Session
from engine.generate import SamplingParams
from engine.plan import DeviceProfile, PlanRequest
from engine.routes.sample import RoutingSample
from engine.runtime.hit_curves import SOURCE_SESSION, SYNTHETIC_CURVE
from engine.runtime.replan import choice
from engine.warmup import warm_up

# 64 experts a layer (the synthetic curve's minimum), a random router: its routing is far flatter than the trace's.
GEOM = dict(layers=4, hidden=256, experts=64, experts_used=8, expert_ff=128, vocab=512, seed=1)
CTX = 512
# Speeds under which the cache of 92 of the 256 experts wins at the synthetic curve's 89 % hits (predicted 658 tok/s
# against the CPU's 312) and loses at this model's own 45 % (223).
PROFILE = DeviceProfile(reserve_bytes=0, miss_us=120.0, cpu_expert_gbps=1.5)
BUDGET = 40 << 20


@pytest.fixture(scope="module")
def path(synth_model):
    return str(synth_model("qwen3moe", "Q8_0", **GEOM).path)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(8, 500, n)]


def _reply(s: Session, ids: list[int], n: int = 6) -> list[int]:
    *_, last = s.generate(prompt_ids=ids, params=SamplingParams.greedy(max_tokens=n))
    assert last.finish_reason == "length", last
    return list(s.state.tokens[len(ids) :])


def _auto(path: str, moe: str = "auto", profile: DeviceProfile = PROFILE, **engine) -> Session:
    options = replace(config.current(), **{"replan_tokens": 256, **engine})
    req = PlanRequest(ctx=CTX, moe=moe)
    return Session.load(
        path,
        LoadOptions(n_ctx=CTX, device="cpu", placement=req, vram_budget=BUDGET, device_profile=profile, engine=options),
    )


def test_the_sample_records_one_prompt_as_the_model_routes_it_then_leaves(path):
    with Session.load(path, LoadOptions(n_ctx=CTX)) as s:
        ids = _prompt(40, 0)
        rec = s.record_routes()
        plain = s.logits(ids)
        s.stop_recording_routes()
        want = rec.trace()
        sample = RoutingSample(s.args.n_expert, s.args.n_expert_used)
        sample.arm(s.model)
        assert s.model.route_tap is sample and sample.armed
        assert np.array_equal(s.logits(ids), plain)  # a tap that only looks
        assert s.model.route_tap is None and not sample.armed  # gone after its one pass
        got = sample.trace()
        assert got.n_tokens == 40 and np.array_equal(got.ids, want.ids) and np.array_equal(got.weights, want.weights)
        # A one-token pass is no prompt: nothing recorded, and the sample leaves all the same.
        sample.arm(s.model)
        s.reset()
        s.model.forward([ids[0]], 0, s.cache)
        assert s.model.route_tap is None and sample.n_tokens == 40
        # In front of a replayer: it records the replayed routes, and the replayer is back after.
        rep = s.replay_routes(want)
        sample.arm(s.model)
        s.logits(ids[:16])
        assert s.model.route_tap is rep
        assert np.array_equal(sample.trace().ids[40:], want.ids[:16])


def test_auto_leaves_the_cache_for_what_its_own_routing_prices_fastest(path):
    with _auto(path) as s:
        first = s.placement
        assert first.moe_mode == "cache" and first.profile.hit_curve == SYNTHETIC_CURVE
        warm_up(s)  # its made-up prompts are not sampled: the re-plan below counts the 300 tokens alone
        _reply(s, _prompt(300, 1))
        assert s.replans == [] and s.model.route_tap is None  # sampled the prompt, decoded without the tap
        ids = _prompt(200, 2)
        got = _reply(s, ids)
        assert len(s.replans) == 1
        r = s.replans[0]
        assert r.changed and r.before == "the GPU expert cache" and r.after == choice(s.placement) and r.tokens == 300
        assert s.placement.moe_mode != "cache" and s.placement.request == first.request
        assert r.hit_rate_before > 0.85 and r.hit_rate < 0.6, (r.hit_rate_before, r.hit_rate)
        assert r.predicted_after > r.predicted_before
        assert r.note.startswith("Re-planned on this session's routing (300 prompt tokens, cache hit rate ")
        assert r.headline == f"Re-planned on this chat's routing: {r.after} (the cache would hit {r.hit_rate:.0%})"
        curve = s.hit_curve()
        assert curve.source == SOURCE_SESSION and curve.tokens == 300
        assert round(first.expert_capacity, 4) in dict(curve.points)  # replayed at the placement's own capacity
        assert s.plan(first.request).profile.hit_curve == curve.points  # later plans price the cache with it
        _reply(s, _prompt(300, 3))
        assert len(s.replans) == 1 and s.model.route_tap is None  # once a session
    with Session.load(path, LoadOptions(n_ctx=CTX)) as ref:  # every layer and expert on the CPU
        assert got == _reply(ref, ids)


@pytest.mark.parametrize(
    "why",
    ["moe asked", "replan off", "the profile's own curve"],
)
def test_no_sample_and_no_replan(path, why, monkeypatch):
    """Turns past ``replan_tokens`` that do not re-plan: the mode was asked for, re-planning is off, or the hit rates
    are already measured ones (a profile's own curve; the user's routing history is the same case)."""
    if why == "moe asked":
        s = _auto(path, moe="cache", replan_tokens=64)
    elif why == "replan off":
        s = _auto(path, replan_tokens=0)
    else:
        profile = replace(PROFILE, hit_curve=SYNTHETIC_CURVE, hit_curve_source="measured elsewhere")
        s = _auto(path, profile=profile, replan_tokens=64)
    armed = []
    monkeypatch.setattr(RoutingSample, "arm", lambda self, model: armed.append(model))
    with s:
        before = s.placement
        assert before.moe_mode == "cache"
        for seed in (1, 2):
            _reply(s, _prompt(100, seed), 2)
        assert armed == [] and s.replans == [] and s.placement is before


def test_a_replan_that_keeps_the_choice_keeps_the_placement(path):
    """At a budget where the CPU experts win either way, the re-plan finds nothing to change: the placement and
    its KV cache stay (the second turn reuses the first's prompt)."""
    with _auto(path, profile=replace(PROFILE, miss_us=600.0, cpu_expert_gbps=2.0)) as s:
        first = s.placement
        assert first.moe_mode == "cpu"
        ids = _prompt(300, 1)
        _reply(s, ids)
        kept = list(s.state.tokens)
        _reply(s, kept + _prompt(8, 4))
        assert len(s.replans) == 1 and not s.replans[0].changed and s.placement is first
        assert ": experts on the CPU stays" in s.replans[0].note


def test_the_cli_chat_says_when_auto_replans(synth_model, monkeypatch, caplog, engine_env):
    """`sharpi run --chat` on the simulated device: the first question's prompt is sampled, the second question
    re-plans, and the CLI's log (INFO, on by default) says so once."""
    from engine.cli import common
    from engine.cli.main import main

    engine_env({"SHARPI_REPLAN_TOKENS": "8"})
    caplog.set_level(logging.INFO, logger="engine.api")
    monkeypatch.setattr(common, "_speeds", lambda *a: PROFILE)  # this test's speeds in place of a calibration
    lines = iter(["Name three rivers", "And three mountains", "And three lakes"])

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    path = str(synth_model("qwen3moe", "Q8_0", **dict(GEOM, vocab=1024)).path)
    assert (
        main(
            [
                "run",
                "-m",
                path,
                "--chat",
                "--device",
                "cpu",
                "--vram",
                "40MiB",
                "-c",
                str(CTX),
                "-n",
                "4",
                "--temp",
                "0",
            ]
        )
        == 0
    )
    notes = [r.getMessage() for r in caplog.records if r.name == "engine.api" and r.levelno == logging.INFO]
    assert len([n for n in notes if n.startswith("Re-planned on this session's routing (")]) == 1, notes


def test_an_apply_lets_go_of_the_placement_in_force_before_it_builds_the_next(path, monkeypatch):
    """The device never holds two placements: when the next one's arena is made, the expert slots, arena and KV cache
    of the one in force are already gone (on a nearly full card a re-plan would otherwise run out halfway)."""
    import weakref

    import engine.runtime.apply as ap

    ids = _prompt(40, 5)
    with _auto(path, moe="cpu") as fresh:
        want = fresh.logits(ids)
    with _auto(path, moe="cache") as s:
        held = [weakref.ref(x) for x in (s.applied.experts, s.applied.arena, s.cache)]
        seen = []

        class Arena(ap.DeviceArena):
            def __init__(self, *a, **k):
                seen.append([r() is None for r in held])
                super().__init__(*a, **k)

        monkeypatch.setattr(ap, "DeviceArena", Arena)
        s.apply(s.plan(replace(s.placement.request, moe="cpu"), s.placement.profile))
        assert seen == [[True, True, True]] and s.placement.moe_mode == "cpu"
        assert np.abs(s.logits(ids) - want).max() <= 1e-5  # as the same placement made at load


def test_a_generation_never_run_leaves_no_armed_sample(path):
    """A generation whose events were never consumed armed the sample and never ran its prompt; the made-up prompt of
    a later unsampled() generation (the warm-up's) must not land in it."""
    with _auto(path) as s:
        s.generate(prompt_ids=_prompt(50, 7), params=SamplingParams.greedy(max_tokens=2))  # dropped unread
        with s.unsampled():
            _reply(s, _prompt(120, 8), 2)
        _reply(s, _prompt(300, 1), 2)
        _reply(s, _prompt(20, 2), 2)
        assert len(s.replans) == 1 and s.replans[0].tokens == 300
