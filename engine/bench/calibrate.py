"""Calibration: the planner's DeviceProfile speeds measured on this machine, with the engine's own
code paths and small synthetic work, in a few seconds.

Measured (each marked in ``DeviceProfile.measured``):

* ``cpu_expert_gbps`` — one decode token's routed experts through ``engine.ops.moe_ffn`` (the
  numba kernels, the current thread count) for the model's expert types and shape, cycling through
  a working set of four times the last-level cache (:func:`cpu_working_set`) so the bytes come from DRAM, as they do
  for a real model.
* ``h2d_gbps`` — an expert-sized upload as the expert cache does it: host copy into pinned memory,
  then a non-blocking copy to the device (the simulated device: the cache's plain tensor copy).
* ``device_gbps`` — ``DeviceLinear`` (the fused Triton GEMV on CUDA, the torch reference on the
  simulated device) on a small and a large matrix of the trunk's type: bytes over the time slope.
* ``sync_us`` — a tiny device op followed by a copy of its result to the host.
* ``bus_read_gbps`` (CUDA) — the fused decode kernels reading half of each call's experts from page-locked host
  memory over the bus, as the expert cache's misses are read (:func:`measure_bus_read`).
* the fixed costs (``OVERHEAD_FIELDS``) — decode steps of tiny synthetic models (a 2- and a
  6-layer qwen3moe, a 6-layer dense qwen3) placed host-only, on the device with CPU experts,
  resident, and with a 4-slot cache that misses (on CUDA the all-device probes run as CUDA graphs,
  which prices ``graph_layer_us``; the dense probe runs once more with graphs off, which
  separates ``device_layer_us``); each step's time minus its priced crossings
  (``sync_us``), fitted by non-negative least squares against ``Prediction.overhead_counts``. The
  probes are tiny, so their time is Python, launches, round trips and bookkeeping: the per-layer
  work a large model does besides moving its bytes.

Results are cached as JSON under the user cache dir (``platformdirs``; ``EngineOptions.calibration_dir``,
``$SHARPI_CALIBRATION_DIR``, overrides), keyed by device name, CPU model, numba thread count, :data:`VERSION` and a hash of the
engine code being timed (:func:`code_fingerprint`: new kernels are measured again), so the next run
reuses them; CPU expert rates are kept per expert shape in the same file. No Qt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine import config
from engine.config import EngineOptions
from engine.plan.profile import OVERHEAD_FIELDS, DeviceProfile
from engine.quant.formats import QType, block_format

log = logging.getLogger(__name__)

VERSION = 4  # bump when what is measured, or how, changes: old files are then ignored
MiB = 1 << 20
SIMULATED = "simulated device (CPU)"
COMMON_FIELDS = ("h2d_gbps", "device_gbps", "sync_us", *OVERHEAD_FIELDS)
OPTIONAL_FIELDS = ("bus_read_gbps",)  # measured where the device has it (CUDA), else the default stands

Progress = Callable[[str], None]


def _opts(options: EngineOptions | None) -> EngineOptions:
    return config.current() if options is None else options


def calibration_disabled(options: EngineOptions | None = None) -> bool:
    """``EngineOptions.calibrate`` False (``SHARPI_NO_CALIBRATE=1``): never measure, never read the cache."""
    return not _opts(options).calibrate


# -- what is measured for ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertShape:
    """A model's routed experts as the CPU kernels see them: types of gate/up/down, hidden size
    ``hidden`` (D), expert width ``ff`` (F) and experts per token ``used`` (K)."""

    gate: str = "Q4_K"
    up: str = "Q4_K"
    down: str = "Q6_K"
    hidden: int = 2048
    ff: int = 768
    used: int = 8

    @property
    def key(self) -> str:
        return f"{self.gate}/{self.up}/{self.down} {self.hidden}x{self.ff} k{self.used}"

    @property
    def expert_bytes(self) -> int:
        D, F = self.hidden, self.ff
        b = lambda t, rows, n: rows * block_format(QType[t]).row_bytes(n)  # noqa: E731
        return b(self.gate, F, D) + b(self.up, F, D) + b(self.down, D, F)

    @classmethod
    def from_gguf(cls, gf) -> ExpertShape | None:
        """The most common (gate, up, down) types over the MoE layers of an open GGUF file (Q4_K_M
        mixes Q4_K and Q6_K down projections); None for a dense model."""
        from engine.models import read_args

        a = read_args(gf)
        if not a.is_moe:
            return None
        seen: dict[tuple[str, str, str], int] = {}
        for i in range(a.n_layer):
            try:
                t = tuple(gf.tensor(f"blk.{i}.ffn_{r}_exps.weight").qtype.name for r in ("gate", "up", "down"))
            except Exception:  # a layer without routed experts
                continue
            seen[t] = seen.get(t, 0) + 1
        if not seen:
            return None
        g, u, d = max(seen, key=seen.get)
        return cls(g, u, d, a.n_embd, a.n_ff_exp, a.n_expert_used)


DEFAULT_SHAPE = ExpertShape()  # Qwen3-30B-A3B Q4_K_M


def device_name(device) -> str:
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else SIMULATED


# The code whose speed the fixed costs measure: a change to any of it re-measures.
_TIMED_CODE = ("runtime", "kernels", "models", "generate", "experts.py", "ops.py", "kv_cache.py")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A short hash of the engine sources the measured speeds depend on (kernels, runtime, model
    code, the decode loop): a calibration made with other code is not reused."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for name in _TIMED_CODE:
        p = root / name
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(f.relative_to(root).as_posix().encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:12]


def machine_key(device) -> dict[str, Any]:
    """What a calibration is valid for: device name, CPU model, numba threads, VERSION and the
    engine code it timed."""
    import numba

    from engine.bench.kernels import machine_info

    return {
        "version": VERSION,
        "device": device_name(device),
        "cpu": machine_info()["cpu"],
        "threads": int(numba.get_num_threads()),
        "code": code_fingerprint(),
    }


# -- the cache file ----------------------------------------------------------------------------------
def cache_dir(options: EngineOptions | None = None) -> Path:
    """``EngineOptions.calibration_dir`` if set, else the user cache dir's ``calibration``."""
    d = _opts(options).calibration_dir
    if d is not None:
        return Path(d)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("sharpi")) / "calibration"


def cache_path(key: dict[str, Any], options: EngineOptions | None = None) -> Path:
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(options) / f"v{VERSION}-{h}.json"


def _read(key: dict[str, Any], options: EngineOptions | None = None) -> dict | None:
    p = cache_path(key, options)
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("key") != key:
        return None
    return d


def _write(key: dict[str, Any], data: dict, options: EngineOptions | None = None) -> Path:
    p = cache_path(key, options)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({**data, "key": key}, indent=2), encoding="utf-8")
    tmp.replace(p)
    return p


def _profile_from(data: dict, shape: ExpertShape, partial: bool = False) -> DeviceProfile | None:
    """The profile a cache file gives for ``shape``: None without that shape's CPU expert rate,
    unless ``partial`` (then that rate keeps its default and is not marked measured)."""
    rate = data.get("cpu_expert_gbps", {}).get(shape.key)
    common = data.get("profile", {})
    if set(COMMON_FIELDS) - set(common) or (rate is None and not partial):
        return None
    fields = COMMON_FIELDS + tuple(f for f in OPTIONAL_FIELDS if f in common)
    vals = {f: float(common[f]) for f in fields}
    measured = fields if rate is None else ("cpu_expert_gbps", *fields)
    if rate is not None:
        vals["cpu_expert_gbps"] = float(rate)
    return DeviceProfile(measured=tuple(measured), name=data["key"]["device"], **vals)


def load_cached(
    device, shape: ExpertShape = DEFAULT_SHAPE, *, partial: bool = False, options: EngineOptions | None = None
) -> DeviceProfile | None:
    """The cached calibration for ``device`` on this machine and thread count, or None. With
    ``partial``, a file measured for other expert shapes still gives its device figures. ``options``:
    where the cache lives (``calibration_dir``; default ``config.current()``)."""
    data = _read(machine_key(device), options)
    return _profile_from(data, shape, partial) if data else None


# -- measurements ----------------------------------------------------------------------------------
def random_blocks(qtype: QType, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random, well-scaled weights of ``qtype``: uint8 [rows, row_bytes] block bytes for a quantized
    type (fast: random bytes with fixed scale fields, as ``engine.synth.fill``), else the float
    array ``prepare_weight`` takes."""
    from engine.synth.fill import _FIELDS

    if qtype not in _FIELDS:  # float types: the kernels' test weights (normal values)
        from engine.kernels.testing import random_weight

        return random_weight(qtype, (rows, n), rng)
    f = block_format(qtype)
    blocks = np.frombuffer(rng.bytes(rows * f.row_bytes(n)), np.uint8).copy().reshape(-1, f.type_size)
    _FIELDS[qtype](blocks, 1.0 / np.sqrt(n))
    return blocks.reshape(rows, f.row_bytes(n))


def _stack(qtype: str, E: int, rows: int, n: int, rng):
    from engine.kernels.prepare import prepare_weight

    q = QType[qtype]
    base = min(E, 16)  # 16 random experts repeated: the bytes' values do not change the rate, and a GiB of random
    a = random_blocks(q, base * rows, n, rng).reshape(base, rows, -1)  # bytes would take seconds to draw
    return prepare_weight(q, np.ascontiguousarray(np.resize(a, (E, *a.shape[1:]))))


CPU_WORKING_SET: int | None = None  # bytes the CPU probes cycle through; None: cpu_working_set() (tests set a size)
LLC_FACTOR, MIN_WORKING_SET = 4, 256 * MiB


def last_level_cache_bytes() -> int:
    """The machine's last-level cache: the highest cache level's sizes summed over its distinct instances
    (one per socket or core complex, from /sys), else glibc's L3 size, else 0."""
    import glob

    def read(path: str) -> str:
        with open(path) as f:
            return f.read().strip()

    seen, best = {}, 0
    for d in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            level, size, shared = int(read(f"{d}/level")), read(f"{d}/size"), read(f"{d}/shared_cpu_list")
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        seen[(level, shared)] = int(size.rstrip("KMGkmg") or 0) * mult
        best = max(best, level)
    if best >= 2:
        return sum(v for (level, _), v in seen.items() if level == best)
    try:
        return max(0, int(os.sysconf("SC_LEVEL3_CACHE_SIZE")))
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_working_set() -> int:
    """Bytes the CPU probes cycle through so they read DRAM, as a model's experts do: LLC_FACTOR x the last-level
    cache, at least MIN_WORKING_SET, at most a quarter of the available RAM. A set the cache holds measures the cache:
    256 MiB on a host with 300 MiB of L3 gave 66 GB/s where the resident split's CPU experts read 46 GB/s inside the
    decode step (H200 box, 16 Xeon cores), and the planner overrated the split by a quarter."""
    if CPU_WORKING_SET is not None:
        return CPU_WORKING_SET
    from engine.plan.ram import available_ram

    want = max(MIN_WORKING_SET, LLC_FACTOR * last_level_cache_bytes())
    room = available_ram()
    return int(min(want, max(MIN_WORKING_SET, room // 4))) if room else want


def measure_cpu_experts(shape: ExpertShape = DEFAULT_SHAPE, working_set: int | None = None, min_s: float = 0.3) -> dict:
    """GB/s of one decode token's K routed experts through ``engine.ops.moe_ffn`` (current numba
    threads), K experts the previous steps did not touch each step, over ``working_set`` bytes."""
    from engine import ops

    rng = np.random.default_rng(0)
    D, F, K = shape.hidden, shape.ff, shape.used
    E = max(2 * K, (working_set or cpu_working_set()) // max(1, shape.expert_bytes))
    g, u, d = _stack(shape.gate, E, F, D, rng), _stack(shape.up, E, F, D, rng), _stack(shape.down, E, D, F, rng)
    x = rng.standard_normal((1, D), dtype=np.float32)
    w = np.full((1, K), 1.0 / K, np.float32)
    order = rng.permutation(E)

    def step(i: int) -> None:
        ids = order[(np.arange(K) + K * i) % E][None].astype(np.int64)
        ops.moe_ffn(g, u, d, x, ids, w, q8_act=True)

    step(0)  # compile / first touch
    times: list[float] = []
    t_end = time.perf_counter() + min_s
    i = 1
    while time.perf_counter() < t_end or len(times) < 2 * (E // K):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
        i += 1
    sec = statistics.median(times)
    return {"gbps": K * shape.expert_bytes / sec / 1e9, "step_s": sec, "experts": E, "steps": len(times)}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_h2d(device, nbytes: int = 3 * MiB, copies: int = 24) -> dict:
    """Expert uploads as the cache does them: host copy into a (pinned, on CUDA) staging row, then
    a copy into a device pool row; GB/s over ``copies`` distinct sources."""
    import torch

    device = torch.device(device)
    rng = np.random.default_rng(1)
    srcs = [np.frombuffer(rng.bytes(nbytes), np.uint8) for _ in range(8)]
    pool = torch.empty((8, nbytes), dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    stage = torch.empty((8, nbytes), dtype=torch.uint8, pin_memory=cuda)

    def run(k: int) -> float:
        _sync(device)
        t = time.perf_counter()
        for i in range(k):
            j = i % 8
            if cuda:
                stage[j].numpy()[:] = srcs[j]
                pool[j].copy_(stage[j], non_blocking=True)
                if j == 7:
                    _sync(device)  # the staging rows are reused
            else:
                pool[j].copy_(torch.from_numpy(np.array(srcs[j])))
        _sync(device)
        return time.perf_counter() - t

    run(8)
    sec = min(run(copies) for _ in range(3))
    return {"gbps": copies * nbytes / sec / 1e9, "bytes": nbytes}


def measure_bus_read(device, shape: ExpertShape = DEFAULT_SHAPE, layers: int = 16) -> dict:
    """GB/s at which the fused decode kernels read experts from page-locked host memory over the bus, as the
    expert cache's misses are read (``expert_pool.HostMirror``): ``layers`` one-token calls of ``shape``'s
    experts in one CUDA graph, half of each call's pairs pointing at a page-locked host copy, against the same
    calls with every pair in the device pool; the host bytes over the time they add. Distinct experts a call,
    so neither side is served from the GPU's L2. CUDA only (the bus has no meaning on the simulated device)."""
    import torch

    from engine.bench.device_kernels import slot_pool, time_in_graph
    from engine.runtime import triton_moe, triton_q4k_moe, triton_q8

    device = torch.device(device)
    D, F, K = shape.hidden, shape.ff, shape.used
    types = (QType[shape.gate], QType[shape.up], QType[shape.down])
    pool, stride, roles = slot_pool(types, layers * K, ff=F, hidden=D)  # on the current CUDA device
    host = pool.cpu().pin_memory()
    delta = host.data_ptr() - pool.data_ptr()
    x = torch.randn(1, D, device=device)
    w = torch.rand(1, K, device=device)
    xq = triton_q8.quantize_act(x) if triton_q4k_moe.applies_gate_up(roles) else None
    k_host = max(1, K // 2)

    def graph_ms(n_host: int) -> float:
        offs = []
        for i in range(layers):
            o = (torch.arange(K, device=device) + K * i) * stride
            o[:n_host] += delta
            offs.append(o.view(1, K))
        per_call_us, _ = time_in_graph(
            [lambda o=o: triton_moe.moe_decode(pool, o, x, w, roles, xq=xq) for o in offs], 15
        )
        return per_call_us * layers / 1e3

    dev_ms, host_ms = graph_ms(0), graph_ms(k_host)
    nbytes = layers * k_host * stride
    extra = host_ms - dev_ms if host_ms > dev_ms * 1.02 else host_ms  # no measurable difference: all of it
    return {"gbps": nbytes / (extra * 1e-3) / 1e9, "device_ms": dev_ms, "host_ms": host_ms, "expert_bytes": stride}


def measure_device_gemv(device, qtype: str = "Q4_K", n: int = 2048, options: EngineOptions | None = None) -> dict:
    """Device GB/s of ``DeviceLinear`` (the runtime's trunk GEMV) for ``qtype``: the slope of the
    time over a small and a large matrix (launch cost cancels), T = 1. On CUDA the large one (131,072 rows:
    ~150 MB of Q4_K at n = 2048) is several times any GPU's L2 cache and takes longer to read than a
    launch, so its bytes come from device memory, as a model's do; a 16,384-row one (19 MB) sat in an
    H200's 50 MB L2 behind the call's launch cost and measured ~250 GB/s on a ~4 TB/s card."""
    import torch

    from engine.kernels.prepare import prepare_weight
    from engine.runtime.device import DeviceArena, DeviceLinear

    device = torch.device(device)
    q = QType[qtype]
    rng = np.random.default_rng(2)
    big_rows = 131072 if device.type == "cuda" else 2048
    arena = DeviceArena(device, None)
    x = torch.randn(1, n, device=device)
    res = {}
    for rows in (256, big_rows):
        lin = DeviceLinear(prepare_weight(q, random_blocks(q, rows, n, rng)), arena, "trunk", options=options)
        reps = 30 if device.type == "cuda" else 8
        lin(x)
        _sync(device)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                lin(x)
            _sync(device)
            best = min(best, (time.perf_counter() - t) / reps)
        res[rows] = (best, rows * block_format(q).row_bytes(n))
    (t0, b0), (t1, b1) = res[256], res[big_rows]
    gbps = (b1 - b0) / (t1 - t0) / 1e9 if t1 > t0 * 1.05 else b1 / t1 / 1e9
    return {"gbps": gbps, "small_s": t0, "large_s": t1, "qtype": qtype}


def measure_sync(device, reps: int = 200) -> dict:
    """µs of one crossing: a tiny op on the device, then its result copied to the host."""
    import torch

    device = torch.device(device)
    x = torch.zeros(4, device=device)
    (x + 1).cpu()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        (x + 1).cpu()
        times.append(time.perf_counter() - t)
    return {"us": statistics.median(times) * 1e6}


# -- fixed costs: tiny synthetic models ----------------------------------------------------------------
PROBE_GEOMETRY = dict(
    hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512, ctx=256, experts=16, experts_used=8, expert_ff=256
)
PROBE_CTX = 64


def write_probe(path, arch: str, layers: int, qtype: str = "Q4_K") -> Path:
    """A tiny random-block GGUF (``qtype`` matrices) of ``arch`` with ``layers`` layers, in well under
    a second (no quantization: random blocks with fixed scale fields)."""
    from engine.synth.encode import parse_qtype, plan_types
    from engine.synth.fill import fill_random_blocks
    from engine.synth.geometry import write_sparse
    from engine.synth.specs import make_spec, tensor_layout
    from engine.synth.tokenizer import build_vocab

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every file at INFO
    geo = dict(PROBE_GEOMETRY, layers=layers)
    if arch == "qwen3":
        geo = {k: v for k, v in geo.items() if not k.startswith("expert")}
        geo["ff"] = 256
    spec = make_spec(arch, **geo)
    plans = plan_types(tensor_layout(spec), qtype)
    path = Path(path)
    name = f"calibration probe {arch} {layers}"
    write_sparse(path, spec, plans, build_vocab("bpe", spec.vocab, None), name, parse_qtype(qtype))
    fill_random_blocks(path, seed=0)
    return path


def decode_seconds(session, tokens: int = 16, warm: int = 4) -> tuple[float, float | None]:
    """(median seconds per decode step, hit rate over the timed steps or None) of ``session`` as
    placed: the generation loop's work — sample greedily, then one forward pass — from position 2."""
    from engine.generate.sampling import Sampler, SamplingParams

    model, cache = session.model, session.cache
    sampler = Sampler(SamplingParams.greedy())
    history = [1, 2]
    logits = model.forward(history, 0, cache, all_logits=False)
    times = []
    before = None
    for i in range(warm + tokens):
        if i == warm:
            before = session.stats()
        t = time.perf_counter()
        tok = sampler(logits[-1].numpy(), history)
        history.append(tok)
        logits = model.forward([tok], len(history) - 1, cache, all_logits=False)
        times.append(time.perf_counter() - t)
    after = session.stats()
    hits = int(after.hits.sum() - before.hits.sum())
    misses = int(after.misses.sum() - before.misses.sum())
    return statistics.median(times[warm:]), (hits / (hits + misses) if hits + misses else None)


@dataclass
class _Run:
    label: str
    seconds: float
    counts: dict[str, float]
    priced_s: float  # bytes and crossings, by the cost model with the measured bandwidths
    sync_s: float  # the crossings alone
    hit_rate: float | None = None


def measure_fixed_costs(
    device, speeds: DeviceProfile, progress: Progress | None = None, options: EngineOptions | None = None
) -> dict:
    """Fit the fixed costs (µs) from decode steps of tiny probe models on ``device``.

    speeds: the measured bandwidths and sync (overheads ignored), used to subtract what the cost
    model prices for the probes' bytes. options: the engine options the probes run with (default
    ``config.current()``). Returns {"fields": {name: µs}, "runs": [...]}.
    """
    import torch

    from engine.api import LoadOptions, Session
    from engine.plan import PlanRequest, predict
    from engine.plan.sizing import expert_slot_layout

    device = torch.device(device)
    opts = _opts(options)
    captures = device.type == "cuda" and opts.cuda_graph == "graph"  # where the runtime captures
    bytes_only = speeds.without_overheads()
    runs: list[_Run] = []
    say = progress or (lambda s: None)
    roomy = DeviceProfile(vram_bytes=8 << 30, reserve_bytes=0)
    pos = 2 + 4 + 8  # the middle of the timed steps

    def measure(s, label: str, mode: str, n: int, prof: DeviceProfile, graphs: bool = True) -> None:
        """One probe decode; graphs=False runs it with CUDA graphs off (what separates the
        Python-driven device layer from the graph layer when both could apply)."""
        req = PlanRequest(ctx=PROBE_CTX, kv_type="f32", n_gpu_layers=n, moe=mode, moe_source="calibration")
        p = s.plan(req, prof)
        s.apply(p, None if graphs else replace(opts, cuda_graph="off"))
        sec, h = decode_seconds(s)
        kw = dict(
            mode=p.moe_mode if p.moe_mode != "none" else "cpu",
            n_gpu_layers=p.n_gpu_layers,
            kv_type="f32",
            position=pos,
            expert_slots=p.expert_slots_allocated,
            n_cpu_moe=0,
            graphs=graphs and captures,
        )
        if kw["mode"] == "cache":
            kw["observed_hit_rate"] = h if h is not None else 0.0
        pred = predict(s.spec, bytes_only, **kw)
        runs.append(_Run(label, sec, dict(pred.overhead_counts), pred.seconds, pred.seconds_by_link["sync"], h))

    with tempfile.TemporaryDirectory(prefix="sharpi-calibrate-") as d:
        for arch, layers in (("qwen3moe", 2), ("qwen3moe", 6), ("qwen3", 6)):
            say(f"probe {arch} x{layers}")
            path = write_probe(Path(d) / f"{arch}-{layers}.gguf", arch, layers)
            probe = LoadOptions(n_ctx=PROBE_CTX, kv_type="f32", device=str(device), engine=opts)
            with Session.load(str(path), probe) as s:
                tag = f"{arch}x{layers}"
                measure(s, f"{tag} host", "auto", 0, roomy)
                if arch == "qwen3":
                    measure(s, f"{tag} device", "auto", -1, roomy)
                    if captures:
                        measure(s, f"{tag} device, no graphs", "auto", -1, roomy, graphs=False)
                    continue
                measure(s, f"{tag} device, CPU experts", "cpu", -1, roomy)
                measure(s, f"{tag} device, resident", "resident", -1, roomy)
                if layers == 6:
                    # the CPU-expert placement's bytes without a prompt staging: what a cache of 4 slots adds to
                    base = s.plan(PlanRequest(ctx=PROBE_CTX, kv_type="f32", moe="cpu", prompt_stream=False), roomy)
                    base = base.device.total
                    slots = 4  # fewer than the K = 8 experts a token uses: most lookups miss
                    tight = replace(roomy, vram_bytes=base + slots * expert_slot_layout(s.spec).stride)
                    measure(s, f"{tag} device, 4-slot cache", "cache", -1, tight)
    fields, rel, fitted = fit_fixed_costs([r.counts for r in runs], [r.seconds for r in runs], [r.sync_s for r in runs])
    return {
        "fields": fields,
        "fit_rms_relative": rel,
        "runs": [
            {"label": r.label, "ms": r.seconds * 1e3, "fitted_ms": f * 1e3, "hit_rate": r.hit_rate}
            for r, f in zip(runs, fitted)
        ],
    }


def fit_fixed_costs(
    counts: list[dict[str, float]], seconds: list[float], sync_s: list[float]
) -> tuple[dict[str, float], float, list[float]]:
    """Fixed costs (µs, ≥ 0) from runs: ``seconds − sync_s = Σ counts · fields / 1e6`` in the least
    squares sense, on relative residuals (a 1 ms host step weighs as much as a 10 ms device step).

    The probes' bytes are not subtracted: bandwidths measured on large matrices misprice tiny ones
    (cache-resident on the host, call-bound on the simulated device), and what a tiny layer costs
    beyond its crossings is its fixed cost. Returns (fields, rms relative error of the fitted seconds against
    ``seconds`` — whole steps, so a run whose ``sync_s`` alone exceeds its time counts as the miss it is, fitted
    seconds).
    """
    A = np.array([[c.get(f, 0.0) for f in OVERHEAD_FIELDS] for c in counts], dtype=np.float64)
    y = np.array([max(t - s, 1e-6) * 1e6 for t, s in zip(seconds, sync_s)])
    sol = _nonneg_lstsq(A / y[:, None], np.ones_like(y))
    fitted = [s + float(v) * 1e-6 for s, v in zip(sync_s, A @ sol)]
    rel = (np.array(fitted) - np.array(seconds)) / np.maximum(np.array(seconds), 1e-12)
    return {f: float(v) for f, v in zip(OVERHEAD_FIELDS, sol)}, float(np.sqrt(np.mean(rel**2))), fitted


def _nonneg_lstsq(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x ≥ 0: refit without the columns that came out negative (they are 0)."""
    free = np.ones(A.shape[1], bool)
    x = np.zeros(A.shape[1])
    for _ in range(A.shape[1]):
        sol, *_ = np.linalg.lstsq(A[:, free], y, rcond=None)
        x[:] = 0
        x[free] = sol
        if (sol >= 0).all():
            return x
        free[np.flatnonzero(free)[sol < 0]] = False
    return np.clip(x, 0, None)


# -- the whole calibration ---------------------------------------------------------------------------
@dataclass
class Calibration:
    """A measured profile, where it came from and how long it took."""

    profile: DeviceProfile
    details: dict = field(default_factory=dict)
    seconds: float = 0.0
    cached: bool = False
    path: str = ""


def calibrate(
    device="cuda",
    shape: ExpertShape = DEFAULT_SHAPE,
    *,
    trunk_qtype: str = "Q4_K",
    use_cache: bool = True,
    progress: Progress | None = None,
    options: EngineOptions | None = None,
) -> Calibration:
    """Measure (or, with ``use_cache``, reuse) this machine's profile for ``device`` and ``shape``.

    A cache file missing only ``shape``'s CPU expert rate measures just that. The returned profile
    has the default VRAM budget; callers set theirs (``DeviceProfile.with_budget``). ``options``: the
    engine options the measurements run with and where the cache lives (default ``config.current()``).
    """
    import torch

    device = torch.device(device)
    say = progress or (lambda s: None)
    key = machine_key(device)
    t0 = time.perf_counter()
    data = (_read(key, options) if use_cache else None) or {}
    if use_cache and data:
        prof = _profile_from(data, shape)
        if prof is not None:
            return Calibration(prof, data.get("details", {}), 0.0, True, str(cache_path(key, options)))
    details = dict(data.get("details", {}))
    rates = dict(data.get("cpu_expert_gbps", {}))
    say(f"CPU experts {shape.key}")
    cpu = measure_cpu_experts(shape)
    rates[shape.key] = cpu["gbps"]
    details[f"cpu_experts {shape.key}"] = cpu
    common = data.get("profile", {})
    if set(COMMON_FIELDS) - set(common):
        say("host→device copies")
        h2d = measure_h2d(device)
        say("device GEMV")
        gemv = measure_device_gemv(device, trunk_qtype, options=options)
        sync = measure_sync(device)
        speeds = DeviceProfile(
            cpu_expert_gbps=cpu["gbps"], h2d_gbps=h2d["gbps"], device_gbps=gemv["gbps"], sync_us=sync["us"]
        )
        fixed = measure_fixed_costs(device, speeds, say, options)
        common = {"h2d_gbps": h2d["gbps"], "device_gbps": gemv["gbps"], "sync_us": sync["us"], **fixed["fields"]}
        details.update(
            {
                "h2d": h2d,
                "device_gemv": gemv,
                "sync": sync,
                "fixed_cost_runs": fixed["runs"],
                "fit_rms_relative": fixed["fit_rms_relative"],
            }
        )
    if device.type == "cuda" and "bus_read_gbps" not in common:
        say("reads over the bus")
        bus = measure_bus_read(device, shape)
        common = {**common, "bus_read_gbps": bus["gbps"]}
        details["bus_read"] = bus
    out = {"profile": common, "cpu_expert_gbps": rates, "details": details, "measured_at": time.time()}
    path = _write(key, out, options)
    prof = _profile_from({**out, "key": key}, shape)
    assert prof is not None
    secs = time.perf_counter() - t0
    log.info("calibrated %s in %.1f s (%s)", key["device"], secs, path)
    return Calibration(prof, details, secs, False, str(path))


# -- the profile a session plans with ---------------------------------------------------------------
_FAILED: set = set()  # (device, ExpertShape) whose measurement failed in this process


def speed_profile(device, gf, *, measure: bool, options: EngineOptions | None = None) -> DeviceProfile | None:
    """This machine's calibrated speeds for ``device`` and the model in the open GGUF ``gf`` (its
    expert shape and trunk type), for ``Session``/``LoadOptions.device_profile``: the cached
    calibration; else, with ``measure`` (an ``auto`` choice is coming), measured now — a few
    seconds, once per machine; else the device figures another model's calibration left. None
    where calibration does not apply (not CUDA, or ``SHARPI_NO_CALIBRATE=1``): plan with the
    defaults. A failed measurement is logged and gives the defaults: it must never stop a load."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or calibration_disabled(options):
        return None
    shape = ExpertShape.from_gguf(gf) or DEFAULT_SHAPE
    prof = load_cached(device, shape, options=options)
    if prof is None and measure and (str(device), shape) not in _FAILED:
        try:
            _calibrate_in_child(gf.path, options)
            prof = load_cached(device, shape, options=options)
            if prof is None:
                raise RuntimeError("the calibration process left no profile for this machine")
        except Exception as e:
            log.warning("device calibration failed, using the default profile: %s", e)
            _FAILED.add((str(device), shape))  # not again in this process
            return DeviceProfile()
    return prof or load_cached(device, shape, partial=True, options=options)


def _calibrate_in_child(model_path: str, options: EngineOptions | None) -> None:
    """``sharpi bench calibrate`` for ``model_path`` in a child process with this process's numba thread count
    (part of the cache key) and calibration directory: its probe placements and buffers take device memory
    in that process and give it all back when it exits, so a user's VRAM budget never carries them (nvidia-smi
    counts a process's peak). The child writes the cache this process then reads."""

    import numba

    from engine import config

    d = _opts(options).calibration_dir
    env = config.child_environ({} if d is None else {config.ENV["calibration_dir"]: str(d)})
    cmd = [sys.executable, "-m", "engine.cli.main", "bench", "calibrate", "--device", "cuda", "-m", model_path]
    cmd += ["--threads", str(numba.get_num_threads())]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"sharpi bench calibrate exited {r.returncode}: {r.stderr.strip()[-500:]}")


def _trunk_qtype(gf) -> str:
    try:
        return gf.tensor("blk.0.attn_q.weight").qtype.name
    except Exception:
        return "Q4_K"
