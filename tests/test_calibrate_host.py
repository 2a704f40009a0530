"""The CPU alone calibrated (engine.bench.calibrate_host.calibrate_host): what a machine without a GPU predicts
with — the routed experts' and the trunk's rates at the model's shapes, the fixed costs of a token and a
host layer fitted from probes with their bytes taken off — cached, cancellable, and run in a child process
the app can stop; and the cost model's CPU-only formula held to a measured profile."""

from __future__ import annotations

import threading

import pytest

from engine.bench import calibrate as cal
from engine.bench import calibrate_host as hc
from engine.gguf import open_gguf
from engine.library import judge
from engine.plan import DeviceProfile, ModelSpec, predict
from engine.plan.profile import CPU_FIELDS, profile_source
from tests.conftest import set_engine_env


@pytest.fixture
def demo():
    from engine.demo import demo_model_path

    return str(demo_model_path())


@pytest.fixture
def cal_dir(tmp_path, monkeypatch):
    set_engine_env(monkeypatch, {"SHARPI_CALIBRATION_DIR": str(tmp_path / "cal"), "SHARPI_NO_CALIBRATE": None})
    monkeypatch.setattr(cal, "CPU_WORKING_SET", 16 << 20)  # quick: the rates' values are not what is tested
    monkeypatch.setattr(hc, "HOST_PROBE_LAYERS", (1, 3))
    return tmp_path / "cal"


def test_fit_recovers_the_fixed_costs():
    layers = [1, 2, 4, 8]
    priced = [1e-4 * n for n in layers]  # the probes' bytes at their rates
    secs = [p + (180.0 + 45.0 * n) * 1e-6 for p, n in zip(priced, layers)]
    token, layer, rel = hc.fit_host_costs(layers, secs, priced)
    assert token == pytest.approx(180.0, rel=1e-6) and layer == pytest.approx(45.0, rel=1e-6) and rel < 1e-9
    # costs are never negative, even where the bytes priced more than the step took; the error then says so
    # (it is of whole steps: 3e-4 priced against 2.5e-4 taken is 20 % or more, not the 0 % of a clamped residual)
    token, layer, rel = hc.fit_host_costs([1, 2], [2e-4, 2.5e-4], [1e-4, 3e-4])
    assert token >= 0 and layer >= 0 and rel >= 0.2 / 2**0.5


# Measured on the 2-core Zen 4 box with `sharpi bench calibrate --device host -m resources/models/...demo`
# on 2026-11-27 (2 threads); the formula below must give what predict() gives for this profile.
MEASURED = DeviceProfile(
    cpu_expert_gbps=5.16,
    cpu_trunk_gbps=3.66,
    token_us=153.0,
    host_layer_us=40.0,
    measured=("cpu_expert_gbps", "cpu_trunk_gbps", "token_us", "host_layer_us"),
)


def test_cpu_prediction_is_the_formula_over_a_measured_profile(demo):
    with open_gguf(demo) as gf:
        spec = ModelSpec.from_gguf(gf)
    pos = 100
    p = predict(spec, MEASURED, mode="cpu", n_gpu_layers=0, kv_type="f32", position=pos)
    K = spec.n_expert_used
    experts = sum(K * lay.expert_bytes for lay in spec.layers if lay.is_moe)
    kv = sum(2 * pos * 4 * spec.kv_dim for lay in spec.layers if lay.has_kv)  # host K/V rows are f32
    trunk = spec.trunk_bytes + kv + spec.output_norm_bytes + spec.output_bytes + spec.token_embd_bytes / spec.n_vocab
    by_hand = (
        MEASURED.token_us * 1e-6
        + spec.n_layer * MEASURED.host_layer_us * 1e-6
        + experts / (MEASURED.cpu_expert_gbps * 1e9)
        + trunk / (MEASURED.cpu_trunk_gbps * 1e9)
    )
    assert p.seconds == pytest.approx(by_hand, rel=1e-9)
    assert profile_source(MEASURED, cpu_only=True) == "measured" and profile_source(MEASURED) == "partly measured"
    # Without a trunk rate the trunk reads at the experts' rate (what every profile before it meant).
    q = predict(spec, DeviceProfile(cpu_expert_gbps=5.16), mode="cpu", n_gpu_layers=0, kv_type="f32", position=pos)
    assert q.seconds_by_link["cpu"] == pytest.approx((experts + trunk) / 5.16e9, rel=1e-9)


def test_host_calibration_is_measured_once_and_feeds_the_library(cal_dir, demo):
    assert hc.host_calibration_needed(demo) and hc.cached_cpu_profile(demo) is None
    before = judge(demo, ram=64 << 30, vram=0, cpu_profile=hc.cached_cpu_profile)
    assert not before.calibrated and before.speeds.startswith("uncalibrated")
    seen: list[str] = []
    c = hc.calibrate_host(demo, progress=seen.append)
    assert not c.cached and len(seen) == 3 + len(hc.HOST_PROBE_LAYERS)
    assert set(c.profile.measured) == set(CPU_FIELDS)
    assert profile_source(c.profile, cpu_only=True) == "measured"
    # the fit clamps both fixed costs at 0, and on a busy machine either the token's or the layer's can take it all
    p = c.profile
    assert p.cpu_trunk_gbps > 0 and min(p.token_us, p.host_layer_us) >= 0 and p.token_us + p.host_layer_us > 0
    # a restart finds it cached: nothing is measured again
    assert not hc.host_calibration_needed(demo)
    again = hc.calibrate_host(demo, progress=seen.append)
    assert again.cached and len(seen) == 3 + len(hc.HOST_PROBE_LAYERS) and again.profile == c.profile
    after = judge(demo, ram=64 << 30, vram=0, cpu_profile=hc.cached_cpu_profile)
    assert after.calibrated and after.speeds == "measured speeds" and after.predicted_tok_s != before.predicted_tok_s


def test_a_cancelled_calibration_caches_nothing(cal_dir, demo):
    with pytest.raises(hc.CalibrationCancelled):
        hc.calibrate_host(demo, stop=lambda: True)
    assert hc.host_calibration_needed(demo) and not list(cal_dir.glob("*.json"))


def test_the_child_process_job_reports_progress_and_stops_on_cancel(cal_dir, demo):
    from engine import config

    opts = config.current()
    steps: list[tuple[int, int, str]] = []
    ended = threading.Event()
    result: list = []

    def done(ok, secs, msg):
        result.append((ok, msg))
        ended.set()

    job = hc.HostCalibrationJob(demo, lambda k, n, w: steps.append((k, n, w)), done, threads=1, options=opts)
    assert job.command()[-4:] == ["-m", demo, "--threads", "1"]
    job.start()
    assert job.running
    job.cancel()
    assert ended.wait(30) and result == [(False, "cancelled")] and not job.running
    assert hc.host_calibration_needed(demo, opts)
