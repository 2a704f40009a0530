"""DeviceProfile: the machine as the planner sees it — VRAM, reserve, scratch, link bandwidths
and the fixed costs of a decode step.

Bandwidths are *effective* rates (bytes a kernel or copy actually moves per second, not the
datasheet peak). Fixed costs (``*_us``) are the time a step spends regardless of bytes: Python,
kernel launches, host round trips, cache bookkeeping. Unmeasured fields take the documented
defaults below; a profile built from measurements (:mod:`engine.bench.calibrate`) lists the
measured fields in ``measured`` so the UI can say which numbers are guesses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine.plan.sizing import PlanError

MiB = 1 << 20
GiB = 1 << 30

# Defaults when nothing is measured (see docs/planner.md for where they come from).
DEFAULT_VRAM = 12 * GiB  # the target card class
DEFAULT_RESERVE = 512 * MiB  # CUDA context, cuBLAS workspace, allocator slack
DEFAULT_CPU_EXPERT_GBPS = 20.0  # host reading quantized weights while computing (DDR4/DDR5 desktop)
DEFAULT_H2D_GBPS = 22.0  # PCIe 4.0 x16, expert-sized copies
# The fused kernels reading a missed expert from page-locked host memory over the bus (cache_misses "bus"): about
# half the bus's copy rate — 24–28 GB/s against 55 for pinned copies on an H200 box's PCIe 5 link
# (labs/zero_copy_misses.py, 2026-11-28); a PCIe 4 desktop gets about half of that.
DEFAULT_BUS_READ_GBPS = 13.0
DEFAULT_DEVICE_GBPS = 400.0  # GDDR6X mid-range card, effective
DEFAULT_SYNC_US = 10.0  # one host↔device round trip (launch + synchronise + small copy)
# Fixed costs, microseconds: `sharpi bench calibrate` on an H100 box (16 cores; two calibrations, rounded
# means; 2026-11-22, f30374a; docs/benchmarks-gpu.md), with the segmented CUDA-graph step. With that
# box's measured links (CPU experts 59.4 GB/s, host→device 9.49, device 202, sync 23 µs) they predict
# the Qwen3-30B-A3B geometry at 12 GiB within 15 % of its measured 34.0 (cpu) and 26.0 (cache) tok/s.
# A calibrated profile replaces them.
DEFAULT_TOKEN_US = 250.0  # per token: embedding, sampling, logits to the host, the loop's Python
DEFAULT_HOST_LAYER_US = 250.0  # per host layer: numba/torch work on the CPU besides its bytes
DEFAULT_DEVICE_LAYER_US = 1900.0  # per device layer run eagerly (graphs off, or a layer split): Python, launches
DEFAULT_CPU_EXPERTS_LAYER_US = 135.0  # per device layer whose experts run on the host: the round trip
DEFAULT_CACHE_LAYER_US = 20.0  # per device layer served by the cache outside a graph: routing to the host, lookups
DEFAULT_MISS_US = 150.0  # per missed expert: host call, slot admission, staging an upload
# Per device layer when the step runs as CUDA-graph replays (every layer's trunk on the device;
# engine.runtime.graph_decode): no Python; launch gaps and ramp-up of the layer's kernels.
DEFAULT_GRAPH_LAYER_US = 20.0
# Zipf exponent of expert popularity used by the hit-rate model. 0.8 in the static hottest-n
# formula reproduces an LRU cache (Che approximation) on a Zipf(1.0) stream, which is what the
# published hit-rate anchors fit; see costmodel.hit_rate.
DEFAULT_SKEW = 0.8

_GBPS_FIELDS = ("cpu_expert_gbps", "h2d_gbps", "bus_read_gbps", "device_gbps")
# Fixed-cost fields, in the order of docs/planner.md; the cost model counts one event of each per
# token (Prediction.overhead_counts) and charges count × field µs.
OVERHEAD_FIELDS: tuple[str, ...] = (
    "token_us",
    "host_layer_us",
    "device_layer_us",
    "cpu_experts_layer_us",
    "cache_layer_us",
    "miss_us",
    "graph_layer_us",
)


@dataclass(frozen=True)
class DeviceProfile:
    """One device plus its host, for planning.

    vram_bytes: total device memory SharpI may use (the "VRAM budget" slider).
    reserve_bytes: part of it never available to tensors (context, workspaces, slack).
    scratch_bytes: activation scratch; ``None`` = estimate from the model and context
        (:func:`engine.plan.sizing.scratch_estimate`).
    cpu_expert_gbps: host GB/s (1e9 B/s) for routed experts computed on the CPU (``engine.ops.moe_ffn``
        at the model's expert shape: a tiny shape's per-expert call costs are in this rate).
    cpu_trunk_gbps: host GB/s for the other bytes a host layer reads (attention and shared matrices, the
        output matrix, K/V rows); None: ``cpu_expert_gbps`` (what a profile without it has always meant).
    h2d_gbps: host→device copy GB/s (expert uploads on cache misses).
    bus_read_gbps: GB/s at which the device's kernels read page-locked host memory (the expert cache's misses
        computed on the device over the bus, ``EngineOptions.cache_misses``).
    device_gbps: device memory GB/s (trunk, KV and cached experts read per token).
    sync_us: cost of one host↔device crossing in microseconds.
    token_us: fixed cost of one decode step (embedding, sampling, logits copy, loop Python).
    host_layer_us: fixed cost of one host layer (torch ops on the CPU, kernel dispatch).
    device_layer_us: fixed cost of one device layer's trunk (Python, kernel launches).
    cpu_experts_layer_us: extra cost of a device layer whose experts run on the host (hidden and
        routing to the host, the host call, the result back), beyond bytes and ``2 · sync_us``;
        a cache layer pays it when at least one of its experts misses.
    cache_layer_us: extra cost of a device layer served by the slot pool (routing to the host,
        slot lookups, launches), hit or miss.
    miss_us: extra cost of one missed expert (host call, slot admission, staging its upload).
    graph_layer_us: fixed cost of one device layer when the decode step runs as CUDA-graph replays
        (every layer's trunk on the device); replaces device_layer_us, and cache_layer_us for
        layers whose experts are resident (inside the graph).
    expert_skew: Zipf exponent of expert popularity (0 = uniform) for the cache hit-rate model.
    hit_curve: the cache's hit rate against capacity measured on routing traces — (capacity, hit rate) pairs,
        capacities ascending in (0, 1) (``engine.bench.cache.hit_curve``: the default policy replayed on the
        user's recorded traces or the synthetic one: ``engine.runtime.hit_curves.planner_curve``); when given it
        replaces the Zipf model; empty: Zipf.
    hit_curve_source: where ``hit_curve`` came from, in words for people (e.g. "your routing history: 2
        traces, 1,536 tokens", "synthetic Qwen3-30B-A3B routing", or with no curve "the Zipf popularity guess
        (...)"); empty: not said.
    measured: names of the fields above that were measured rather than defaulted.
    """

    vram_bytes: int = DEFAULT_VRAM
    reserve_bytes: int = DEFAULT_RESERVE
    scratch_bytes: int | None = None
    cpu_expert_gbps: float = DEFAULT_CPU_EXPERT_GBPS
    cpu_trunk_gbps: float | None = None
    h2d_gbps: float = DEFAULT_H2D_GBPS
    bus_read_gbps: float = DEFAULT_BUS_READ_GBPS
    device_gbps: float = DEFAULT_DEVICE_GBPS
    sync_us: float = DEFAULT_SYNC_US
    token_us: float = DEFAULT_TOKEN_US
    host_layer_us: float = DEFAULT_HOST_LAYER_US
    device_layer_us: float = DEFAULT_DEVICE_LAYER_US
    cpu_experts_layer_us: float = DEFAULT_CPU_EXPERTS_LAYER_US
    cache_layer_us: float = DEFAULT_CACHE_LAYER_US
    miss_us: float = DEFAULT_MISS_US
    graph_layer_us: float = DEFAULT_GRAPH_LAYER_US
    expert_skew: float = DEFAULT_SKEW
    hit_curve: tuple[tuple[float, float], ...] = ()
    hit_curve_source: str = ""
    measured: tuple[str, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("vram_bytes", "reserve_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"profile {f} must be a non-negative integer, got {v!r}")
        if self.scratch_bytes is not None and (not isinstance(self.scratch_bytes, int) or self.scratch_bytes < 0):
            raise PlanError(f"profile scratch_bytes must be a non-negative integer or None, got {self.scratch_bytes!r}")
        t = self.cpu_trunk_gbps
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise PlanError(f"profile cpu_trunk_gbps must be a positive number or None, got {t!r}")
        for f in _GBPS_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise PlanError(f"profile {f} must be a positive number, got {v!r}")
        for f in ("sync_us", *OVERHEAD_FIELDS):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6:
                raise PlanError(f"profile {f} must be in [0, 1e6) µs, got {v!r}")
        if not 0 <= self.expert_skew <= 4:
            raise PlanError(f"profile expert_skew must be in [0, 4], got {self.expert_skew!r}")
        caps = [c for c, _ in self.hit_curve]
        if any(
            not (isinstance(c, (int, float)) and isinstance(h, (int, float)) and 0 < c < 1 and 0 <= h <= 1)
            for c, h in self.hit_curve
        ) or caps != sorted(set(caps)):
            raise PlanError("profile hit_curve must be (capacity, hit rate) pairs, capacities ascending in (0, 1)")
        known = {f.name for f in fields(self)}
        bad = [m for m in self.measured if m not in known]
        if bad:
            raise PlanError(f"profile measured names unknown fields {bad}")

    @property
    def trunk_gbps(self) -> float:
        """GB/s of a host layer's bytes besides its routed experts."""
        return self.cpu_trunk_gbps if self.cpu_trunk_gbps is not None else self.cpu_expert_gbps

    @property
    def is_measured(self) -> bool:
        """Whether any field came from a measurement (a calibrated profile)."""
        return bool(self.measured)

    def without_overheads(self) -> DeviceProfile:
        """The same profile with every fixed cost at 0: bytes and crossings only."""
        kept = tuple(m for m in self.measured if m not in OVERHEAD_FIELDS)
        return replace(self, measured=kept, **{f: 0.0 for f in OVERHEAD_FIELDS})

    def with_budget(self, vram_bytes: int) -> DeviceProfile:
        """The same machine with another VRAM budget (what the slider changes)."""
        return replace(self, vram_bytes=vram_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["measured"] = list(self.measured)
        d["hit_curve"] = [list(p) for p in self.hit_curve]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceProfile:
        """Inverse of :meth:`to_dict`; unknown keys are a :class:`PlanError` (typos must not pass)."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"unknown device profile keys {sorted(unknown)} (known: {sorted(known)})")
        kw = dict(d)
        if "measured" in kw:
            kw["measured"] = tuple(kw["measured"])
        if "hit_curve" in kw:
            try:
                kw["hit_curve"] = tuple((c, h) for c, h in kw["hit_curve"])
            except (TypeError, ValueError):
                raise PlanError("profile hit_curve must be a list of [capacity, hit rate] pairs") from None
        return cls(**kw)


_LABELS: dict[str, tuple[str, str]] = {
    "cpu_expert_gbps": ("CPU experts", "GB/s"),
    "cpu_trunk_gbps": ("CPU trunk", "GB/s"),
    "h2d_gbps": ("host→device", "GB/s"),
    "bus_read_gbps": ("bus read", "GB/s"),
    "device_gbps": ("device", "GB/s"),
    "sync_us": ("sync", "µs"),
    "expert_skew": ("skew", ""),
    "token_us": ("token", "µs"),
    "host_layer_us": ("host layer", "µs"),
    "device_layer_us": ("device layer", "µs"),
    "cpu_experts_layer_us": ("CPU-expert round trip", "µs"),
    "cache_layer_us": ("cache layer", "µs"),
    "miss_us": ("miss", "µs"),
    "graph_layer_us": ("graph layer", "µs"),
}


def describe_profile(profile: DeviceProfile) -> list[str]:
    """Two lines for people: bandwidths, then fixed costs; a measured value is marked ``*``."""

    def item(f: str) -> str:
        label, unit = _LABELS[f]
        v = getattr(profile, f)
        num = f"{v:.3g}" if f in (*_GBPS_FIELDS, "cpu_trunk_gbps", "expert_skew") else f"{v:.0f}"
        return f"{label} {num}{' ' + unit if unit else ''}{'*' if f in profile.measured else ''}"

    trunk = ("cpu_trunk_gbps",) if profile.cpu_trunk_gbps is not None else ()
    first = ", ".join(item(f) for f in (*_GBPS_FIELDS[:1], *trunk, *_GBPS_FIELDS[1:], "sync_us", "expert_skew"))
    second = "fixed costs: " + ", ".join(item(f) for f in OVERHEAD_FIELDS)
    return [first, second]


# What a placement with every layer on the CPU costs by (engine.plan.costmodel): a calibration of the
# CPU alone (``engine.bench.calibrate_host.calibrate_host``) measures exactly these.
CPU_FIELDS: tuple[str, ...] = ("cpu_expert_gbps", "cpu_trunk_gbps", "token_us", "host_layer_us")


def profile_source(profile: DeviceProfile, cpu_only: bool = False) -> str:
    """``measured`` (every speed field measured), ``partly measured`` or ``defaults``; with ``cpu_only``
    (a placement without a device) only the fields such a placement costs by count (:data:`CPU_FIELDS`)."""
    speed = set(CPU_FIELDS) if cpu_only else {*_GBPS_FIELDS, "sync_us", *OVERHEAD_FIELDS}
    got = speed & set(profile.measured)
    if not got:
        return "defaults"
    return "measured" if got == speed else "partly measured"
