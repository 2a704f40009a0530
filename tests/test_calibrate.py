"""Device calibration (engine.bench.calibrate) on the simulated device, its cache file, the fit of the
fixed costs, and how Session and the CLI choose a profile."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.api import LoadOptions, Session
from engine.bench import calibrate as cal
from engine.cli.main import main
from engine.config import EngineOptions
from engine.plan import DeviceProfile, ModelSpec, PlanRequest, predict
from engine.plan.profile import OVERHEAD_FIELDS
from tests.conftest import set_engine_env
from tests.test_plan_sizing import _q4k_except_vectors, _qwen3_args

TINY = cal.ExpertShape("Q4_K", "Q4_K", "Q6_K", 256, 256, 4)  # quick to build and time


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """A private calibration cache dir and a small CPU-expert working set for the whole module."""
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("calibration")
    set_engine_env(mp, {"SHARPI_CALIBRATION_DIR": str(d), "SHARPI_NO_CALIBRATE": None})
    mp.setattr(cal, "CPU_WORKING_SET", 32 << 20)
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def measured(cache_env):
    return cal.calibrate("cpu", TINY, use_cache=False)


def test_calibration_measures_every_speed_field(measured):
    c = measured
    p = c.profile
    assert set(p.measured) == {"cpu_expert_gbps", *cal.COMMON_FIELDS}  # no bus read on the simulated device
    assert p.bus_read_gbps == DeviceProfile().bus_read_gbps and "bus_read" not in c.details
    assert p.name == cal.SIMULATED and not c.cached
    assert p.cpu_expert_gbps > 0 and p.h2d_gbps > 0 and p.device_gbps > 0 and p.sync_us >= 0
    # Tiny probes still take real time per step: the fit must explain a host step with host costs.
    assert p.token_us + 2 * p.host_layer_us > 0
    runs = c.details["fixed_cost_runs"]
    assert len(runs) == 9 and all(r["ms"] > 0 for r in runs)
    host = {r["label"]: r["ms"] for r in runs if r["label"].endswith(" host")}
    assert host["qwen3moex6 host"] > host["qwen3moex2 host"]  # more layers, more time
    miss = next(r for r in runs if "4-slot" in r["label"])
    assert miss["hit_rate"] is not None and miss["hit_rate"] < 0.5  # 4 slots for 8 experts a token


def test_cache_file_is_reused_and_keyed(measured, cache_env, monkeypatch):
    c = measured
    key = cal.machine_key("cpu")
    assert set(key) == {"version", "device", "cpu", "threads", "code"} and key["version"] == cal.VERSION
    assert key["code"] == cal.code_fingerprint() and len(key["code"]) == 12
    path = cal.cache_path(key)
    assert path.parent == cache_env and str(path) == c.path and path.is_file()
    data = json.loads(path.read_text())
    assert data["key"] == key and TINY.key in data["cpu_expert_gbps"]
    for probe in ("measure_cpu_experts", "measure_h2d", "measure_device_gemv", "measure_sync", "measure_fixed_costs"):
        monkeypatch.setattr(cal, probe, lambda *a, _p=probe, **k: pytest.fail(f"{_p} ran: the cache was not used"))
    again = cal.calibrate("cpu", TINY)
    assert again.cached and again.profile == c.profile and again.seconds == 0.0
    assert cal.load_cached("cpu", TINY) == c.profile
    # Another thread count is another machine key, hence another file: nothing cached for it.
    other = dict(key, threads=key["threads"] + 1)
    assert cal.cache_path(other) != path and cal._read(other) is None
    # A file whose stored key does not match (edited, or another machine's) is ignored.
    path.write_text(json.dumps(dict(data, key=other)))
    assert cal.load_cached("cpu", TINY) is None
    path.write_text(json.dumps(data))


def test_a_measured_bus_read_rate_is_read_back_as_measured(measured):
    """A cache file holding ``bus_read_gbps`` (what a CUDA calibration adds) gives it to the profile, marked
    measured; without it the default stands, unmarked."""
    data = {"key": {"device": "GPU"}, "profile": {f: getattr(measured.profile, f) for f in cal.COMMON_FIELDS},
            "cpu_expert_gbps": {TINY.key: 30.0}}  # fmt: skip
    plain = cal._profile_from(data, TINY)
    assert "bus_read_gbps" not in plain.measured and plain.bus_read_gbps == DeviceProfile().bus_read_gbps
    data["profile"]["bus_read_gbps"] = 27.5
    bus = cal._profile_from(data, TINY)
    assert bus.bus_read_gbps == 27.5 and "bus_read_gbps" in bus.measured and bus.cpu_expert_gbps == 30.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_bus_read_rate_is_measured_on_cuda():
    """The fused decode kernels reading half their experts from page-locked host memory take longer than reading
    them all from the device pool, and the rate that difference gives is a bus's (well under the device's)."""
    r = cal.measure_bus_read("cuda", TINY, layers=8)
    assert r["host_ms"] > r["device_ms"] > 0 and r["expert_bytes"] > 0
    assert 1.0 < r["gbps"] < 200.0, r


def test_new_expert_shape_measures_only_the_cpu_experts(measured, monkeypatch):
    c = measured
    calls = []
    monkeypatch.setattr(cal, "measure_fixed_costs", lambda *a, **k: calls.append(a) or pytest.fail("re-measured"))
    other = replace(TINY, used=2)
    d = cal.calibrate("cpu", other)
    assert not d.cached and calls == []
    assert {f: getattr(d.profile, f) for f in cal.COMMON_FIELDS} == {
        f: getattr(c.profile, f) for f in cal.COMMON_FIELDS
    }
    assert cal.load_cached("cpu", TINY) == c.profile  # the first shape is still there


def test_fit_recovers_known_fixed_costs():
    """Runs generated by the cost model's own counts with known fixed costs fit back exactly."""
    spec = ModelSpec.from_args(_qwen3_args(n_layer=6), _q4k_except_vectors)
    truth = dict(
        token_us=400.0,
        host_layer_us=120.0,
        device_layer_us=700.0,
        cpu_experts_layer_us=350.0,
        cache_layer_us=900.0,
        miss_us=40.0,
        graph_layer_us=60.0,
    )
    prof = DeviceProfile(sync_us=15.0, **truth)
    counts, secs, syncs = [], [], []
    for n, mode, slots, h, graphs in [
        (0, "cpu", 0, None, False),
        (6, "cpu", 0, None, False),
        (6, "resident", 48, None, False),
        (6, "resident", 48, None, True),  # the same placement as a CUDA-graph step
        (6, "cache", 4, 0.1, False),
    ]:
        for L in (2, 6):
            sp = ModelSpec.from_args(_qwen3_args(n_layer=L), _q4k_except_vectors) if L != 6 else spec
            nn = min(n, L)
            p = predict(
                sp, prof, mode=mode, n_gpu_layers=nn, kv_type="f32", position=8, expert_slots=slots,
                observed_hit_rate=h, graphs=graphs,
            )  # fmt: skip
            fixed_and_sync = p.seconds_by_link["fixed"] + p.seconds_by_link["sync"]
            counts.append(p.overhead_counts)
            secs.append(fixed_and_sync)
            syncs.append(p.seconds_by_link["sync"])
    # The dense probe: device layers with no experts (what separates device_layer_us from the rest).
    counts.append({"token_us": 1.0, "device_layer_us": 6.0})
    syncs.append(2 * 15e-6)
    secs.append(syncs[-1] + (400 + 6 * 700) * 1e-6)
    fields, rel, fitted = cal.fit_fixed_costs(counts, secs, syncs)
    assert rel < 1e-9
    for f in OVERHEAD_FIELDS:
        assert fields[f] == pytest.approx(truth[f], rel=1e-6)
    assert fitted == pytest.approx(secs)


def test_nonneg_lstsq_refits_without_negative_columns():
    rng = np.random.default_rng(0)
    A = rng.uniform(0, 1, (12, 3))
    assert cal._nonneg_lstsq(A, A @ [1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0, 3.0])
    x = cal._nonneg_lstsq(A, A @ [1.0, -2.0, 3.0])
    assert (x >= 0).all() and x[1] == 0
    sol, *_ = np.linalg.lstsq(A[:, [0, 2]], A @ [1.0, -2.0, 3.0], rcond=None)
    assert x[[0, 2]] == pytest.approx(sol)


def test_random_blocks_kernel_ready():
    for q in ("Q4_K", "Q6_K", "Q8_0", "F32"):
        w = cal._stack(q, 3, 8, 256, np.random.default_rng(0))
        assert w.shape == (3, 8, 256) and np.isfinite(w.scales).all()


def test_disabled_by_environment():
    env = EngineOptions.from_env
    assert cal.calibration_disabled(env({"SHARPI_NO_CALIBRATE": "1"}))
    assert not cal.calibration_disabled(env({"SHARPI_NO_CALIBRATE": "0"})) and not cal.calibration_disabled(env({}))


# -- Session: which profile plans ------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_path(synth_model):
    return synth_model("qwen3moe", "F32", layers=2, experts=4).path


def test_simulated_device_uses_defaults_even_with_a_cache_file(moe_path, measured):
    """A simulated-device calibration is cached (measured above) but never used unasked."""
    assert cal.load_cached("cpu", TINY) is not None
    with Session.load(str(moe_path), LoadOptions(n_ctx=64, device="cpu")) as s:
        assert cal.speed_profile(s.device, s.gf, measure=True) is None
        p = s.device_profile(1 << 30)
        assert p.measured == () and p.token_us == DeviceProfile().token_us and p.vram_bytes == 1 << 30


def test_injected_profile_drives_the_auto_choice(moe_path, engine_env):
    # eager steps: the device layers' cost is the same in every mode
    engine_env({"SHARPI_CPU_MOE": None, "SHARPI_CUDA_GRAPH": "0"})
    cheap_cache = DeviceProfile(cache_layer_us=0.0, miss_us=0.0, cpu_experts_layer_us=50_000.0, name="test")
    dear_cache = replace(cheap_cache, cache_layer_us=50_000.0, cpu_experts_layer_us=0.0)
    modes = {}
    for label, prof in (("cheap", cheap_cache), ("dear", dear_cache)):
        opts = LoadOptions(n_ctx=64, device="cpu", placement=PlanRequest(), vram_budget=1 << 30, device_profile=prof)
        with Session.load(str(moe_path), opts) as s:
            p = s.placement
            assert p.profile.cache_layer_us == prof.cache_layer_us and p.profile.vram_bytes == 1 << 30
            modes[label] = p.moe_mode
            # set_device_profile switches later plans; None goes back to the defaults here.
            s.set_device_profile(None)
            assert s.plan(PlanRequest(ctx=64)).profile.cache_layer_us == DeviceProfile().cache_layer_us
    assert modes == {"cheap": "resident", "dear": "cpu"}


class _FakeCal:
    """Stands in for engine.bench.calibrate's cache and measurement (a CUDA device is not here)."""

    def __init__(self, cached=None, fail=False):
        self.cached, self.fail, self.runs = cached, fail, 0

    def load_cached(self, device, shape, partial=False, options=None):
        return self.cached

    def calibrate(self, device, shape, **kw):
        self.runs += 1
        if self.fail:
            raise RuntimeError("no GPU today")
        self.cached = DeviceProfile(token_us=123.0, measured=("token_us",), name="fake GPU")  # written to the cache
        return SimpleNamespace(profile=self.cached)

    def calibrate_in_child(self, model_path, options):
        self.calibrate("cuda", None)


@pytest.mark.parametrize(
    "cached,disabled,run,fail,want_token,want_runs",
    [
        (DeviceProfile(token_us=7.0, measured=("token_us",)), False, True, False, 7.0, 0),  # the cache wins
        (None, False, True, False, 123.0, 1),  # nothing cached: measure once
        (None, False, False, False, DeviceProfile().token_us, 0),  # not an auto choice: no measuring
        (None, True, True, False, DeviceProfile().token_us, 0),  # SHARPI_NO_CALIBRATE=1
        (None, False, True, True, DeviceProfile().token_us, 1),  # measuring failed: defaults, no error
    ],
)
def test_cuda_profile_policy(moe_path, monkeypatch, engine_env, cached, disabled, run, fail, want_token, want_runs):
    """speed_profile: what the CLI and the app hand a CUDA session (a Session never measures)."""
    from engine.gguf import open_gguf

    fake = _FakeCal(cached, fail)
    monkeypatch.setattr(cal, "_FAILED", set())
    monkeypatch.setattr(cal, "load_cached", fake.load_cached)
    monkeypatch.setattr(cal, "calibrate", fake.calibrate)
    monkeypatch.setattr(cal, "_calibrate_in_child", fake.calibrate_in_child)
    opts = engine_env({"SHARPI_NO_CALIBRATE": "1" if disabled else None})
    with open_gguf(moe_path) as gf:
        assert cal.speed_profile("cpu", gf, measure=True, options=opts) is None  # no CUDA: the defaults
        prof = cal.speed_profile("cuda", gf, measure=run, options=opts) or DeviceProfile()
        assert prof.token_us == want_token and fake.runs == want_runs
        cal.speed_profile("cuda", gf, measure=run, options=opts)  # cached (or failed) once: never measured twice
        assert fake.runs == want_runs


def test_calibration_runs_in_a_child_process(monkeypatch, tmp_path):
    """The probes of a calibration take device memory in their own process (a user's VRAM budget never carries
    them): `sharpi bench calibrate` for the model, with this process's thread count and calibration directory."""
    import subprocess

    import numba

    from engine.config import EngineOptions

    seen = {}

    def run(cmd, **kw):
        seen.update(cmd=cmd, env=kw["env"])
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    cal._calibrate_in_child("/models/m.gguf", EngineOptions(calibration_dir=tmp_path))
    cmd = seen["cmd"]
    assert cmd[1:6] == ["-m", "engine.cli.main", "bench", "calibrate", "--device"] and "/models/m.gguf" in cmd
    assert cmd[cmd.index("--threads") + 1] == str(numba.get_num_threads())
    assert seen["env"]["SHARPI_CALIBRATION_DIR"] == str(tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=1, stderr="no GPU"))
    with pytest.raises(RuntimeError, match="no GPU"):
        cal._calibrate_in_child("/models/m.gguf", None)


def test_a_session_never_measures(moe_path, monkeypatch):
    """Loading and planning (auto included) use the profile given, else the defaults: no probe runs."""
    for probe in ("calibrate", "load_cached", "measure_cpu_experts"):
        monkeypatch.setattr(cal, probe, lambda *a, _p=probe, **k: pytest.fail(f"{_p} ran inside Session"))
    req = PlanRequest(ctx=64, moe="auto")
    with Session.load(str(moe_path), LoadOptions(n_ctx=64, device="cpu", placement=req)) as s:
        assert s.plan(req).profile.token_us == DeviceProfile().token_us


def test_cli_bench_calibrate_json_is_a_plan_profile(measured, moe_path, capsys, tmp_path):
    assert main(["bench", "calibrate", "--device", "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert main(["bench", "calibrate", "--device", "cpu"]) == 0  # cached now: prints, measures nothing
    text = capsys.readouterr().out
    assert "(cached;" in text and "fixed costs: token" in text and "*" in text and "cache      " in text
    prof = DeviceProfile.from_dict(d)
    assert "token_us" in prof.measured and prof.name == cal.SIMULATED
    f = tmp_path / "prof.json"
    f.write_text(json.dumps(d))
    assert main(["plan", "-m", str(moe_path), "--profile", str(f), "--vram", "1GiB", "-c", "64"]) == 0
    out = capsys.readouterr().out
    assert "token " in out and "*" in out and "measured" in out
    # The same profile straight from the cache: sharpi plan --calibrated cpu.
    assert main(["plan", "-m", str(moe_path), "--calibrated", "cpu", "--vram", "1GiB", "-c", "64", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["profile"]
    assert got["token_us"] == prof.token_us and "token_us" in got["measured"]
    assert "cpu_expert_gbps" not in got["measured"]  # the F32 model's experts were never measured
    assert got["cpu_expert_gbps"] == DeviceProfile().cpu_expert_gbps


# -- the bench's validation hook -------------------------------------------------------------------
def test_bench_compare_modes_reports_predictions_and_the_verdict(moe_path, capsys, engine_env):
    engine_env({"SHARPI_CPU_MOE": None})
    args = ["bench", "-m", str(moe_path), "--device", "cpu", "--vram", "1GiB", "--prompt", "4", "--gen", "4"]
    assert main([*args, "--repeat", "1", "--compare-modes", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    modes = {r["mode"]: r for r in c["modes"]}
    assert set(modes) == {"cpu", "cache", "resident"}  # 1 GiB holds every expert of the tiny model
    for r in modes.values():
        assert r["decode_tok_s"] > 0 and r["predicted_tok_s"] > 0
        assert r["mode"] in r["placement"]  # each ran on its own placement
    assert modes["cache"]["predicted_at_measured_hit_rate"] > 0 and modes["cpu"]["hit_rate"] is None
    best = max(modes.values(), key=lambda r: r["decode_tok_s"])["mode"]
    assert c["fastest"] == best and c["auto_was_fastest"] == (c["auto"] == best)
    assert c["auto_loss"] == pytest.approx(1 - modes[c["auto"]]["decode_tok_s"] / modes[best]["decode_tok_s"])
    assert c["profile_source"] == "defaults"  # the simulated device plans with the defaults
    assert main([*args, "--repeat", "1", "--compare-modes"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "measured" in out and f"chose {c['auto']}" in out


def test_bench_report_carries_the_prediction(moe_path):
    from engine.bench.model import bench_session, prediction_report

    opts = LoadOptions(n_ctx=32, device="cpu", placement=PlanRequest(moe="cache"), vram_budget=1 << 30)
    with Session.load(str(moe_path), opts) as s:
        r = bench_session(s, 4, 4, 1, bandwidth=False)
        pr = prediction_report(s, r)
    assert set(pr["predicted_tok_s"]) == {"cpu", "cache", "resident"} and pr["prediction_position"] == 6
    assert pr["predicted_decode_tok_s"] == pr["predicted_tok_s"]["cache"]
    assert pr["prediction_error"] == pytest.approx(pr["predicted_decode_tok_s"] / r["decode_tok_s"] - 1)
    assert pr["predicted_at_measured_hit_rate"] > 0


def test_bench_prints_the_hybrid_bound_and_survives_a_full_device(moe_path, capsys, monkeypatch):
    """`sharpi bench` on a hybrid CUDA placement (the device is stood in for: the simulated device's
    placement, called CUDA for the byte split, and a stub for the device's copy bandwidth) bounds decode
    by the host's bytes at the host's bandwidth plus the device's at the device's; when the device has
    no room to measure, it keeps the host-only bound."""
    from types import SimpleNamespace as NS

    import torch

    import engine.bench.device_kernels as dk
    from engine.bench import model

    real = model._split_bytes
    monkeypatch.setattr(
        model,
        "_split_bytes",
        lambda s, hit: real(NS(placement=s.placement, device=torch.device("cuda"), spec=s.spec), hit),
    )
    asked = []

    def probe(nbytes=1 << 30):
        asked.append(nbytes)
        return 3000.0

    monkeypatch.setattr(dk, "measure_bandwidth", probe)
    args = ["bench", "-m", str(moe_path), "--device", "cpu", "--vram", "1GiB", "--moe", "cache", "--prompt", "4",
            "--gen", "4", "--repeat", "1"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    split = r["bytes_by_memory"]
    assert r["bandwidth_of"] == "host+device" and r["device_bandwidth_gb_s"] == 3000.0 and split["device"] > 0
    bound = model.hybrid_bound_tok_s(split, r["read_bandwidth_gb_s"], 3000.0)
    assert r["decode_bound_tok_s"] == pytest.approx(bound)
    assert r["decode_bw_fraction"] == pytest.approx(r["decode_tok_s"] / bound)
    assert main(args) == 0
    assert "MB from host memory" in capsys.readouterr().out
    # Wholly on the device, uncalibrated: the device's bound, from a probe small enough for the budget's
    # allowances (a 1 GiB pair once put 1.8 GiB on nvidia-smi's peak after the timed runs).
    monkeypatch.setattr(model, "_wholly_on_cuda", lambda s: True)
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bandwidth_of"] == "device" and r["read_bandwidth_gb_s"] == 3000.0
    assert asked and max(asked) <= 1 << 26
    monkeypatch.setattr(model, "_wholly_on_cuda", lambda s: False)

    def full(nbytes=1 << 30):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(dk, "measure_bandwidth", full)
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bandwidth_of"] == "host" and r["decode_bound_tok_s"] == pytest.approx(
        r["read_bandwidth_gb_s"] * 1e9 / r["bytes_per_token"]
    )


def test_bench_takes_a_calibrated_device_bandwidth_without_a_probe(monkeypatch):
    """A placement whose profile measured the device's bandwidth gives the bench its bound with no probe buffer
    on the device (nvidia-smi's peak stays the run's own)."""
    from types import SimpleNamespace as NS

    import engine.bench.device_kernels as dk
    from engine.bench import model
    from engine.plan import DeviceProfile

    def no_probe(nbytes=1 << 30):
        raise AssertionError("a probe buffer on the device")

    monkeypatch.setattr(dk, "measure_bandwidth", no_probe)
    prof = DeviceProfile(device_gbps=3566.0, measured=("device_gbps",))
    assert model._device_read_gbps(NS(placement=NS(profile=prof))) == 3566.0


def test_cpu_probes_read_past_the_last_level_cache(monkeypatch):
    """The CPU probes' working set is 4x the last-level cache (a 256 MiB set on a 300 MiB L3 measured the cache),
    at least 256 MiB, at most a quarter of the available RAM; a size the tests set wins."""
    from engine.plan import ram

    MiB = 1 << 20
    monkeypatch.setattr(cal, "CPU_WORKING_SET", None)
    monkeypatch.setattr(ram, "available_ram", lambda: 64 << 30)
    monkeypatch.setattr(cal, "last_level_cache_bytes", lambda: 300 * MiB)
    assert cal.cpu_working_set() == 1200 * MiB
    monkeypatch.setattr(ram, "available_ram", lambda: 2 << 30)
    assert cal.cpu_working_set() == 512 * MiB
    monkeypatch.setattr(cal, "last_level_cache_bytes", lambda: 8 * MiB)
    assert cal.cpu_working_set() == 256 * MiB
    monkeypatch.setattr(cal, "CPU_WORKING_SET", 16 * MiB)
    assert cal.cpu_working_set() == 16 * MiB


def test_last_level_cache_is_read_from_the_machine():
    import os

    if not os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        pytest.skip("no /sys cache description on this machine")
    llc = cal.last_level_cache_bytes()
    assert 256 << 10 <= llc <= 64 << 30
