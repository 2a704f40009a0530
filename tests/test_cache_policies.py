"""Expert-cache policies (engine.runtime.cache_policies) on scripted traces — exact hits and misses — Belady's
optimum against a brute-force search, and the synthetic generator against the published Qwen3-30B-A3B curve."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import numpy as np
import pytest

from engine.routes.synthetic import PUBLISHED_LRU, QWEN3_30B_A3B, reuse_stats
from engine.runtime.cache_policies import POLICIES, Belady, next_use, replay


def hits(policy, trace, n_slots, n_expert=8, **kw) -> list[bool]:
    return replay(policy, np.array(trace), n_slots, n_expert, **kw).ravel().tolist()


F, T = False, True


def test_lru():
    assert hits("lru", [[0], [1], [0], [2], [1], [0]], 2) == [F, F, T, F, F, F]
    # two experts a token: [2, 0] refreshes 0; [1, 3] evicts 2, the least recent
    assert hits("lru", [[0, 1], [2, 0], [1, 3], [0, 2]], 3) == [F, F, F, T, T, F, T, F]
    # fewer slots than a token's experts: the token's last ones stay
    assert hits("lru", [[0, 1], [1, 0]], 1) == [F, F, T, F]
    assert hits("lru", [[0], [0]], 0) == [F, F]


def test_slru_is_the_runtimes_and_protects_a_reused_expert():
    trace = [[0], [0], [1], [2], [3], [4], [0], [1]]
    assert hits("slru", trace, 4) == [F, T, F, F, F, F, T, F]  # 0 was promoted: a scan of 1..4 does not evict it
    assert hits("lru", trace, 4) == [F, T, F, F, F, F, F, F]
    from engine.runtime.slru import SegmentedLRU

    assert isinstance(POLICIES["slru"](4, 8).cache, SegmentedLRU)


def test_decayed_lfu_bypasses_a_weaker_newcomer_and_hysteresis_delays_a_swap():
    # 0 used twice outscores 1 used once: 1 runs without a slot, 0 stays (LRU would have swapped)
    assert hits("dlfu", [[0], [0], [1], [0]], 1, margin=0.0) == [F, T, F, T]
    assert hits("lru", [[0], [0], [1], [0]], 1) == [F, T, F, F]
    # 0 used once long enough ago loses its slot to 1 ...
    assert hits("dlfu", [[0], [1], [1], [1]], 1, margin=0.0) == [F, F, T, T]
    # ... one token later with a hysteresis margin of 0.5
    assert hits("dlfu", [[0], [1], [1], [1]], 1, margin=0.5) == [F, F, F, T]
    # a token's own experts are never evicted for each other
    assert hits("dlfu", [[0, 1], [0, 1]], 2) == [F, F, T, T]


def test_admission_control_keeps_the_frequent_expert():
    assert hits("admit", [[0], [0], [1], [1], [1]], 1) == [F, T, F, F, T]  # 1 is admitted once it outcounts 0
    assert hits("lru", [[0], [0], [1], [1], [1]], 1) == [F, T, F, T, T]
    assert hits("admit", [[0], [1], [2]], 3) == [F, F, F]  # free slots admit anything


def test_belady_scripted():
    # 2 slots: after [0,1,2] keep 0 and 1 (used next), drop 2 (used last)
    assert hits("belady", [[0], [1], [2], [0], [1], [2]], 2) == [F, F, F, T, T, F]
    assert next_use(np.array([[0, 1], [1, 2], [0, 3]])).tolist() == [[2, 1], [3, 3], [3, 3]]
    with pytest.raises(TypeError, match="offline"):
        Belady(2, 4).step(np.array([0]))


def brute_force(ids: np.ndarray, n_slots: int) -> int:
    """The most hits any cache of ``n_slots`` can get: after each token, any subset of what it held and the
    token's experts (admit, evict or bypass, all choices searched)."""
    n_tok = len(ids)

    @functools.cache
    def best(t: int, cache: frozenset) -> int:
        if t == n_tok:
            return 0
        row = set(ids[t].tolist())
        got = len(row & cache)
        pool = sorted(cache | row)
        options = (frozenset(c) for n in range(min(n_slots, len(pool)) + 1) for c in itertools.combinations(pool, n))
        return got + max(best(t + 1, c) for c in options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_a_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    E, k, Tn = 6, int(rng.integers(1, 3)), 7
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(Tn)])
    for n_slots in range(0, 4):
        got = int(replay("belady", ids, n_slots, E).sum())
        assert got == brute_force(ids, n_slots), (ids.tolist(), n_slots)
        for name in ("lru", "slru", "dlfu", "admit"):  # no online policy beats it
            assert replay(name, ids, n_slots, E).sum() <= got


def test_the_synthetic_generator_reproduces_the_published_lru_curve():
    gen = replace(QWEN3_30B_A3B, n_layers=12)
    trace = gen.generate(seed=3)
    for capacity, published in PUBLISHED_LRU.items():
        n = round(capacity * trace.n_expert)
        lru = np.mean([replay("lru", trace.layer(j), n, trace.n_expert).mean() for j in range(trace.n_layers)])
        assert abs(lru - published) <= 0.03, (capacity, lru, published)
    s = reuse_stats(trace)
    assert abs(s["prev"] - 0.45) <= 0.05 and abs(s["within_8"] - 0.80) <= 0.05, s
    # popularity skewed but broad: most of the experts carry 90 % of the routes
    counts = np.sort(np.bincount(trace.layer(0).ravel(), minlength=128))[::-1]
    assert 50 <= np.searchsorted(np.cumsum(counts) / counts.sum(), 0.9) + 1 <= 80
    assert trace.phase[0] == 0 and trace.phase[-1] == 1 and trace.meta["source"] == "synthetic"
    np.testing.assert_array_equal(gen.generate(seed=3).ids, trace.ids)  # a seed is a trace


def test_uploads_count_admitted_misses_only():
    lru = POLICIES["lru"](1, 4)
    lru.run(np.array([[0], [0], [1], [0]]))
    assert lru.uploads == 3
    dlfu = POLICIES["dlfu"](1, 4, margin=0.0)
    dlfu.run(np.array([[0], [0], [1], [0]]))
    assert dlfu.uploads == 1  # 1 was bypassed
    b = Belady(2, 4)
    b.run(np.array([[0], [1], [2], [0], [1], [2]]))
    assert b.uploads == 2  # 0 and 1; 2 is never worth a slot


@pytest.fixture(scope="module")
def synthetic():
    return replace(QWEN3_30B_A3B, n_layers=3).generate(seed=5)


def test_bench_cache_report(synthetic):
    from engine.bench import cache
    from engine.plan import DeviceProfile

    r = cache.run(synthetic, (0.05, 0.2, 0.4, 0.6))
    assert r["capacities"] == [0.05, 0.2, 0.4, 0.6] and r["default"] == "dlfu"
    assert set(r["policies"]) == {"lru", "slru", "dlfu", "admit", "belady"}
    assert set(r["declines"]) == {"0.05", "0.2", "0.4", "0.6"}
    b = r["policies"]["belady"]
    for name, rates in r["policies"].items():
        assert all(0 <= x <= y + 1e-12 for x, y in zip(rates, b)), name  # nothing beats the optimum
        assert rates == sorted(rates), name  # more slots, more hits
    d, lru = r["policies"]["dlfu"], r["policies"]["lru"]
    assert all(x >= y for x, y in zip(d, lru))
    assert [f >= 0.9 for f in r["fraction_of_belady"]["dlfu"][2:]] == [True, True]
    # at 5 % the cache misses too often to beat CPU experts with the default profile: it declines
    assert r["declines"] == {"0.05": True, "0.2": False, "0.4": False, "0.6": False}
    # a CPU far faster than the link: the cache never pays; a crawling one: it always does
    fast = cache.run(synthetic, (0.05, 0.6), ["dlfu"], profile=DeviceProfile(cpu_expert_gbps=1000.0))
    slow = cache.run(synthetic, (0.05, 0.6), ["dlfu"], profile=DeviceProfile(cpu_expert_gbps=0.5))
    assert set(fast["declines"].values()) == {True} and set(slow["declines"].values()) == {False}
    assert "fraction_of_belady" in r and fast["fraction_of_belady"] == {}


def test_bench_cache_command(tmp_path, capsys):
    import json

    from engine.cli.main import main
    from engine.routes import save_trace

    path = save_trace(replace(QWEN3_30B_A3B, n_layers=2).generate(prompt=16, decode=48, turns=1), tmp_path / "t")
    svg = tmp_path / "plot.svg"
    assert main(["bench", "cache", "--trace", str(path), "--capacity", "0.2,0.6", "--json", "--plot", str(svg)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacities"] == [0.2, 0.6] and len(out["policies"]["belady"]) == 2
    assert svg.read_text().startswith("<svg") and "dlfu (default)" in svg.read_text()
    assert main(["bench", "cache", "--trace", str(path), "--layers", "1", "--capacity", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["layers"] == 1
    assert main(["bench", "cache", "--synthetic", "--layers", "1", "--capacity", "0.5", "--policies", "lru"]) == 0
    assert "lru" in capsys.readouterr().out
    assert main(["bench", "cache", "--synthetic", "--capacity", "2"]) == 2
    assert main(["bench", "cache", "--synthetic", "--policies", "fifo"]) == 2
    assert main(["bench", "cache", "--synthetic", "--plot", "x.png"]) == 2
    (tmp_path / "bad.npz").write_text("x")
    assert main(["bench", "cache", "--trace", str(tmp_path / "bad.npz")]) == 2
    assert "not a .npz routing trace" in capsys.readouterr().err


# -- the planner's hit-rate model from routing (DeviceProfile.hit_curve) ---------------------------------------
def test_curve_hit_rate_interpolates_and_never_falls():
    from engine.plan.costmodel import curve_hit_rate

    curve = ((0.2, 0.8), (0.4, 0.7), (0.6, 0.95))
    got = [round(curve_hit_rate(c, curve), 6) for c in (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1, 1.5)]
    assert got == [0.0, 0.4, 0.8, 0.8, 0.8, 0.875, 0.95, 0.975, 1.0, 1.0]


def test_profile_hit_curve_round_trip_and_checks():
    from engine.errors import PlanError
    from engine.plan import DeviceProfile

    p = DeviceProfile(hit_curve=((0.2, 0.7), (0.5, 0.9)))
    assert DeviceProfile.from_dict(p.to_dict()) == p
    for bad in (((0.5, 0.9), (0.2, 0.7)), ((0.0, 0.5),), ((0.3, 1.5),), ((0.3, 0.5), (0.3, 0.6))):
        with pytest.raises(PlanError, match="hit_curve"):
            DeviceProfile(hit_curve=bad)
    with pytest.raises(PlanError, match="pairs"):
        DeviceProfile.from_dict({"hit_curve": [[0.1, 0.2, 0.3]]})


def test_the_planner_prices_the_cache_with_the_routing_curve(synth_model, tmp_path, capsys, engine_env):
    import json

    from engine.cli.main import main
    from engine.plan.costmodel import curve_hit_rate
    from engine.routes import save_trace
    from engine.runtime.hit_curves import hit_curve

    trace = replace(QWEN3_30B_A3B, n_layers=2).generate(prompt=32, decode=96, turns=1)
    curve = hit_curve(trace)
    assert [c for c, _ in curve] == [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert [h for _, h in curve] == sorted(h for _, h in curve)
    path = save_trace(trace, tmp_path / "t")
    model = str(synth_model("qwen3moe", "Q8_0", vocab=1024).path)
    base = [
        "plan",
        "-m",
        model,
        "--vram",
        "4MiB",
        "--reserve",
        "0",
        "--scratch",
        "1MiB",
        "-c",
        "256",
        "--moe",
        "cache",
        "--json",
    ]
    plans = []
    for extra in (["--skew", "1"], ["--routes", str(path)], []):
        assert main(base + extra) == 0
        plans.append(json.loads(capsys.readouterr().out))
    zipf, routed, default = plans
    cap = routed["expert_capacity"]
    assert 0 < cap < 1 and routed["profile"]["hit_curve"] == [list(p) for p in curve]
    assert routed["profile"]["hit_curve_source"] == f"routing trace {path}"
    assert routed["predicted_hit_rate"] == pytest.approx(curve_hit_rate(cap, curve))
    assert zipf["profile"]["hit_curve"] == [] and zipf["predicted_hit_rate"] != routed["predicted_hit_rate"]
    # no routing history here (the suite's own empty SHARPI_ROUTES_DIR) and 8 experts a layer: SHARPI_HIT_CURVE's
    # default (the synthetic curve) is for fine-grained MoEs, so the Zipf guess, said so
    assert default["profile"]["hit_curve_source"].startswith("the Zipf popularity guess (no routing history; fewer")
    assert default["profile"]["hit_curve"] == [] and default["predicted_hit_rate"] != routed["predicted_hit_rate"]
    assert main(base[:-1]) == 0
    assert "cache hit rates from the Zipf popularity guess" in capsys.readouterr().out
    fine = str(synth_model("qwen3moe", "Q8_0", vocab=512, experts=64, experts_used=8, layers=1).path)
    assert main([*base[:2], fine, *base[3:]]) == 0
    synthetic = json.loads(capsys.readouterr().out)
    assert synthetic["profile"]["hit_curve_source"] == "synthetic Qwen3-30B-A3B routing"
    assert synthetic["profile"]["hit_curve"]
    engine_env({"SHARPI_HIT_CURVE": "zipf"})
    assert main([*base[:2], fine, *base[3:]]) == 0
    z = json.loads(capsys.readouterr().out)
    assert z["profile"]["hit_curve_source"].startswith("the Zipf popularity guess (no routing history of")
    assert z["profile"]["hit_curve"] == [] and z["predicted_hit_rate"] < synthetic["predicted_hit_rate"]
