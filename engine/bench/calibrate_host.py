"""Calibration of the CPU alone — a machine without a GPU, as the app measures it in the background on first
launch (``sharpi bench calibrate --device host``): the CPU experts' and trunk's rates at a model's shapes and the
fixed costs of a token and a host layer, fitted from probes of 1–8 layers; cached beside the device calibrations
of :mod:`engine.bench.calibrate`, read back by :func:`cached_cpu_profile` (the model library and the placement
dock), and run in a child process by :class:`HostCalibrationJob`.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import config
from engine.bench.calibrate import (
    DEFAULT_SHAPE,
    PROBE_CTX,
    PROBE_GEOMETRY,
    Calibration,
    ExpertShape,
    Progress,
    _opts,
    _read,
    _trunk_qtype,
    _write,
    cache_path,
    calibration_disabled,
    cpu_working_set,
    decode_seconds,
    fit_fixed_costs,
    machine_key,
    measure_cpu_experts,
    random_blocks,
    write_probe,
)
from engine.config import EngineOptions
from engine.plan.profile import DeviceProfile
from engine.quant.formats import QType, block_format

log = logging.getLogger(__name__)

# -- the CPU alone: a machine without a GPU (the app runs this in the background on first launch) ---------
HOST = "CPU (no device)"  # the device name a host-only calibration is cached under
HOST_PROBE_LAYERS = (1, 2, 4, 8)  # qwen3moe probes, every layer on the CPU
HOST_STEPS = 3 + len(
    HOST_PROBE_LAYERS
)  # progress lines of a full host calibration (experts, trunk, probe shapes, probes)
PROBE_TYPES = (
    "Q4_K",
    "Q8_0",
    "Q6_K",
    "Q5_K",
    "Q4_0",
    "Q5_0",
)  # probes written in the model's trunk type if one of these


class CalibrationCancelled(Exception):
    """Raised between measurements once the caller's ``stop`` says so (nothing is written)."""


def host_key() -> dict[str, Any]:
    """What a host-only calibration is valid for: the CPU model, numba threads, VERSION and the code."""
    return {**machine_key("cpu"), "device": HOST}


@dataclass(frozen=True)
class TrunkShape:
    """A model's attention-side matrices as the CPU kernels see them: weight type and hidden size."""

    qtype: str = "Q4_K"
    hidden: int = 2048

    @property
    def key(self) -> str:
        return f"{self.qtype} {self.hidden}x{self.hidden}"

    @classmethod
    def from_gguf(cls, gf) -> TrunkShape:
        from engine.models import read_args

        return cls(_trunk_qtype(gf), int(read_args(gf).n_embd))


def measure_cpu_trunk(shape: TrunkShape = TrunkShape(), working_set: int | None = None, min_s: float = 0.2) -> dict:
    """GB/s of one token through ``engine.ops.matmul`` on [hidden, hidden] matrices of the trunk's type,
    a matrix the previous steps did not touch each step, over ``working_set`` bytes (default: DRAM)."""
    from engine import ops
    from engine.kernels.prepare import prepare_weight

    rng = np.random.default_rng(2)
    q, n = QType[shape.qtype], shape.hidden
    nbytes = n * block_format(q).row_bytes(n)
    count = int(min(128, max(2, (working_set or cpu_working_set()) // nbytes)))
    mats = [prepare_weight(q, random_blocks(q, n, n, rng)) for _ in range(count)]
    x = rng.standard_normal((1, n), dtype=np.float32)
    ops.matmul(mats[0], x, q8_act=True)  # compile / first touch
    times: list[float] = []
    t_end = time.perf_counter() + min_s
    i = 0
    while time.perf_counter() < t_end or len(times) < 2 * count:
        w = mats[i % count]
        t = time.perf_counter()
        ops.matmul(w, x, q8_act=True)
        times.append(time.perf_counter() - t)
        i += 1
    sec = statistics.median(times)
    return {"gbps": nbytes / sec / 1e9, "step_s": sec, "matrices": count}


def _probe_qtype(trunk: TrunkShape) -> str:
    return trunk.qtype if trunk.qtype in PROBE_TYPES else "Q4_K"


def _probe_shapes(qtype: str) -> tuple[ExpertShape, TrunkShape]:
    g = PROBE_GEOMETRY
    return ExpertShape(qtype, qtype, qtype, g["hidden"], g["expert_ff"], g["experts_used"]), TrunkShape(
        qtype, g["hidden"]
    )


def host_profile_from(data: dict, shape: ExpertShape, trunk: TrunkShape) -> DeviceProfile | None:
    """The CPU-only profile a host cache file gives for a model of ``shape`` and ``trunk``: the fixed costs
    and the two rates measured for it, each marked measured; a rate not measured for this model keeps its
    default and is not marked. None without the fixed costs."""
    fixed = data.get("profile", {})
    if {"token_us", "host_layer_us"} - set(fixed):
        return None
    vals: dict[str, Any] = {"token_us": float(fixed["token_us"]), "host_layer_us": float(fixed["host_layer_us"])}
    measured = ["token_us", "host_layer_us"]
    rate = data.get("cpu_expert_gbps", {}).get(shape.key)
    if rate is not None:
        vals["cpu_expert_gbps"] = float(rate)
        measured.append("cpu_expert_gbps")
    trate = data.get("cpu_trunk_gbps", {}).get(trunk.key)
    if trate is not None:
        vals["cpu_trunk_gbps"] = float(trate)
        measured.append("cpu_trunk_gbps")
    return DeviceProfile(measured=tuple(measured), name=HOST, **vals)


def _model_shapes(path) -> tuple[ExpertShape, TrunkShape]:
    from engine.gguf import open_gguf

    if path is None:
        return DEFAULT_SHAPE, TrunkShape()
    with open_gguf(path) as gf:
        return ExpertShape.from_gguf(gf) or DEFAULT_SHAPE, TrunkShape.from_gguf(gf)


def host_calibration_needed(path=None, options: EngineOptions | None = None) -> bool:
    """Whether :func:`calibrate_host` has something to measure for the model at ``path`` (None: the fixed
    costs alone): False when everything is cached, or calibration is off (``SHARPI_NO_CALIBRATE=1``)."""
    if calibration_disabled(options):
        return False
    data = _read(host_key(), options)
    if not data:
        return True
    try:
        shape, trunk = _model_shapes(path)
    except Exception:  # an unreadable file: nothing to measure for it
        shape, trunk = None, None
    prof = host_profile_from(data, shape or DEFAULT_SHAPE, trunk or TrunkShape())
    if prof is None:
        return True
    return shape is not None and path is not None and not {"cpu_expert_gbps", "cpu_trunk_gbps"} <= set(prof.measured)


def fit_host_costs(layers: list[int], seconds: list[float], priced_s: list[float]) -> tuple[float, float, float]:
    """(token_us, host_layer_us, rms relative error) from host-only probe steps: ``seconds − priced_s =
    token_us + layers · host_layer_us`` (µs, ≥ 0; ``priced_s`` the probes' bytes at their measured rates)."""
    counts = [{"token_us": 1.0, "host_layer_us": float(n)} for n in layers]
    fields, rel, _ = fit_fixed_costs(counts, seconds, priced_s)
    return fields["token_us"], fields["host_layer_us"], rel


def calibrate_host(
    path=None,
    *,
    use_cache: bool = True,
    progress: Progress | None = None,
    stop: Callable[[], bool] | None = None,
    options: EngineOptions | None = None,
) -> Calibration:
    """Measure (or reuse) what a placement with every layer on the CPU costs by, on this machine: the routed
    experts' and the trunk's GB/s at the shapes of the model at ``path`` (None: the default shapes), and
    the fixed costs of a token and of a host layer, fitted from qwen3moe probes of 1–8 layers (their bytes
    taken off at the rates measured for their own shapes, so the fixed costs hold no bytes). A cached
    file missing only this model's rates measures just those. ``stop()`` true between measurements raises
    :class:`CalibrationCancelled` (nothing written). Returns the model's CPU-only profile."""
    from engine.api import LoadOptions, Session
    from engine.plan import predict

    say = progress or (lambda s: None)

    def check() -> None:
        if stop is not None and stop():
            raise CalibrationCancelled

    key = host_key()
    t0 = time.perf_counter()
    shape, trunk = _model_shapes(path)
    data = (_read(key, options) if use_cache else None) or {}
    prof = host_profile_from(data, shape, trunk) if data else None
    if prof is not None and {"cpu_expert_gbps", "cpu_trunk_gbps"} <= set(prof.measured):
        return Calibration(prof, data.get("details", {}), 0.0, True, str(cache_path(key, options)))
    details = dict(data.get("details", {}))
    rates = dict(data.get("cpu_expert_gbps", {}))
    trunk_rates = dict(data.get("cpu_trunk_gbps", {}))
    fixed = dict(data.get("profile", {}))
    check()
    say(f"CPU experts {shape.key}")
    r = measure_cpu_experts(shape)
    rates[shape.key] = r["gbps"]
    details[f"cpu_experts {shape.key}"] = r
    check()
    say(f"CPU trunk {trunk.key}")
    r = measure_cpu_trunk(trunk)
    trunk_rates[trunk.key] = r["gbps"]
    details[f"cpu_trunk {trunk.key}"] = r
    if {"token_us", "host_layer_us"} - set(fixed):
        qtype = _probe_qtype(trunk)
        p_shape, p_trunk = _probe_shapes(qtype)
        check()
        say("probe shapes")
        # The probes' own rates, over their own (cache-sized) working sets: the bytes a probe step reads.
        pe = measure_cpu_experts(p_shape, working_set=1)
        pt = measure_cpu_trunk(p_trunk, working_set=1)
        speeds = DeviceProfile(vram_bytes=0, cpu_expert_gbps=pe["gbps"], cpu_trunk_gbps=pt["gbps"]).without_overheads()
        layers, secs, priced, runs = [], [], [], []
        opts = _opts(options)
        with tempfile.TemporaryDirectory(prefix="sharpi-calibrate-") as d:
            for n in HOST_PROBE_LAYERS:
                check()
                say(f"probe {n} layer{'s' if n > 1 else ''} on the CPU")
                probe = write_probe(Path(d) / f"host-{n}.gguf", "qwen3moe", n, qtype)
                with Session.load(
                    str(probe), LoadOptions(n_ctx=PROBE_CTX, kv_type="f32", device="cpu", engine=opts)
                ) as s:
                    decode_seconds(s, tokens=8, warm=4)  # first touches, compilation
                    # the quickest of five: a step slowed by another process is not this machine's cost
                    sec = min(decode_seconds(s, tokens=12, warm=2)[0] for _ in range(5))
                    spec = s.spec
                pred = predict(spec, speeds, mode="cpu", n_gpu_layers=0, kv_type="f32", position=2 + 2 + 8)
                layers.append(n)
                secs.append(sec)
                priced.append(pred.seconds)
                runs.append({"layers": n, "ms": sec * 1e3, "bytes_ms": pred.seconds * 1e3})
        token_us, layer_us, rel = fit_host_costs(layers, secs, priced)
        fixed = {"token_us": token_us, "host_layer_us": layer_us}
        for r in runs:
            r["fitted_ms"] = r["bytes_ms"] + (token_us + r["layers"] * layer_us) / 1e3
        details.update(
            {"host_probe_runs": runs, "host_fit_rms_relative": rel, "host_probe_rates": {"experts": pe, "trunk": pt}}
        )
    check()
    out = {
        "profile": fixed,
        "cpu_expert_gbps": rates,
        "cpu_trunk_gbps": trunk_rates,
        "details": details,
        "measured_at": time.time(),
    }
    written = _write(key, out, options)
    prof = host_profile_from(out, shape, trunk)
    assert prof is not None
    secs_total = time.perf_counter() - t0
    log.info("calibrated the CPU in %.1f s (%s)", secs_total, written)
    return Calibration(prof, details, secs_total, False, str(written))


def cached_cpu_profile(path, options: EngineOptions | None = None) -> DeviceProfile | None:
    """This machine's cached CPU calibration (:func:`calibrate_host`: ``sharpi bench calibrate --device host``,
    or the app's first launch) for the GGUF at ``path`` (:func:`host_profile_from`): the fixed costs of a token
    and a host layer, and the CPU experts' and trunk's rates where they were measured for this file's shapes —
    or None (none cached, calibration off, an unreadable file). Never measures (the model library's verdicts
    and the placement dock without a GPU)."""
    if calibration_disabled(options):
        return None
    data = _read(host_key(), options)
    if not data:
        return None
    try:
        shape, trunk = _model_shapes(path)
    except Exception:
        return None
    return host_profile_from(data, shape, trunk)


_PROGRESS = re.compile(r"^measuring (.*) \((\d+) of (\d+)\) \.\.\.$")


class HostCalibrationJob:
    """:func:`calibrate_host` for the model at ``model_path`` in a child process (``sharpi bench calibrate
    --device host``): its measurements never hold the caller's interpreter, and :meth:`cancel` ends it at
    once (nothing is cached then; the next start measures again). ``on_progress(k, n, what)`` and
    ``on_done(ok, seconds, message)`` are called from a reader thread. No Qt: the app's bridge wraps it.

        job = HostCalibrationJob(path, on_progress, on_done, threads=numba.get_num_threads())
        job.start(); ...; job.cancel()
    """

    def __init__(self, model_path, on_progress=None, on_done=None, *, threads: int | None = None, options=None):
        self.model_path = None if model_path is None else str(model_path)
        self.on_progress = on_progress or (lambda k, n, what: None)
        self.on_done = on_done or (lambda ok, seconds, message: None)
        self.threads = threads
        self.options = options
        self._proc: subprocess.Popen | None = None
        self._cancelled = False
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "engine.cli.main", "bench", "calibrate", "--device", "host"]
        if self.model_path:
            cmd += ["-m", self.model_path]
        if self.threads:
            cmd += ["--threads", str(int(self.threads))]
        return cmd

    def start(self) -> None:
        d = _opts(self.options).calibration_dir
        env = config.child_environ({} if d is None else {config.ENV["calibration_dir"]: str(d)})
        root = str(Path(__file__).resolve().parents[2])  # this engine, wherever the child starts
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with self._lock:
            self._cancelled = False
            self._proc = subprocess.Popen(
                self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
            )
        threading.Thread(target=self._read, args=(self._proc,), name="sharpi-calibration", daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        t0 = time.perf_counter()
        tail: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.strip()
            m = _PROGRESS.match(line)
            if m:
                self.on_progress(int(m.group(2)), int(m.group(3)), m.group(1))
            elif line:
                tail = (tail + [line])[-5:]
        proc.stderr.close()
        rc = proc.wait()
        with self._lock:
            cancelled = self._cancelled or proc is not self._proc
        if cancelled:
            self.on_done(False, time.perf_counter() - t0, "cancelled")
        elif rc == 0:
            self.on_done(True, time.perf_counter() - t0, "")
        else:
            self.on_done(False, time.perf_counter() - t0, f"exited {rc}: {' '.join(tail)[-300:]}")

    def cancel(self) -> None:
        """End the measurement now (it is not cached); ``on_done(False, ..., "cancelled")`` follows."""
        with self._lock:
            self._cancelled = True
            p = self._proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
