"""Decode cost model: seconds per token = Σ over links (bytes moved ÷ bandwidth) + crossings
+ fixed costs.

For one decoded token at context position ``p`` (docs/planner.md states it in full):

    t = B_dev / device_gbps + B_cpu / cpu_expert_gbps + B_trunk / cpu_trunk_gbps + B_h2d / h2d_gbps
        + n_sync · sync_us + Σ_f count_f · f          (f over the profile's OVERHEAD_FIELDS, in µs)

    B_dev = trunk of device layers + their K/V rows (2·p·row bytes each) + device output
            + experts served from the device (resident: K·e per layer; cache: h·K·e)
    B_trunk = trunk of host layers + their f32 K/V rows + host output + one embedding row
              (at cpu_trunk_gbps; a profile without that rate reads them at cpu_expert_gbps)
    B_cpu = experts computed on the host (host layers, first n_cpu_moe layers, mode cpu: K·e;
            cache: the misses, (1−h)·K·e)
    B_h2d = cache misses uploaded into the slot pool, (1−h)·K·e
    n_sync = 2 (embedding row in, logits/hidden out, when any layer is on the device)
           + 2 per device layer whose experts run on the host (always, or on a miss:
             1 − h^K is the chance that at least one of its K experts misses; always in a
             graph step, which hands every cache layer's row and routes over to the host)

    count(token_us) = 1; count(host_layer_us) = L − n; count(device_layer_us) = n
    count(cpu_experts_layer_us) = device MoE layers whose experts run on the host
                                  + Σ cache layers (1 − h^K)      (a miss makes the same round trip)
    count(cache_layer_us) = device MoE layers served by the slot pool (cache or resident)
    count(miss_us) = Σ cache layers K·(1 − h)                     (experts missed per token)

    With ``graphs`` (CUDA-graph steps: every layer's trunk on the device), count(graph_layer_us) = n
    replaces device_layer_us, and resident layers (inside the graph) count no cache_layer_us;
    experts off the graph keep their round trips (the step is cut into a replay per such layer).

``e`` is the layer's one-expert bytes, ``K`` the experts used per token, ``h`` the hit rate of
:func:`hit_rate` at the pool's capacity fraction. Everything is charged serially (no overlap of
uploads with host compute), so the prediction is a floor on tok/s for a given set of bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from engine.plan.profile import OVERHEAD_FIELDS, DeviceProfile
from engine.plan.sizing import HOST_KV_TYPE, kv_row_bytes
from engine.plan.spec import ModelSpec

CPU, CACHE, RESIDENT = "cpu", "cache", "resident"
MODES: tuple[str, ...] = (CPU, CACHE, RESIDENT)


def graph_step(spec: ModelSpec, mode: str, n_gpu_layers: int, n_cpu_moe: int = 0) -> bool:
    """Whether a decode step of this placement runs as CUDA-graph replays (engine.runtime.graph_decode):
    every layer's trunk on the device. Routed experts resident in the pool run inside the graph; any
    others cut the step into one replay per such MoE layer, their round trips priced as before
    (``cpu_experts_layer_us``, ``cache_layer_us``, syncs)."""
    return spec.n_layer > 0 and n_gpu_layers >= spec.n_layer


@lru_cache(maxsize=64)
def _zipf_cumulative(n_expert: int, skew: float) -> tuple[float, ...]:
    """Cumulative popularity of the hottest j experts, j = 0..E, under Zipf(skew)."""
    w = [1.0 / (r**skew) for r in range(1, n_expert + 1)]
    total = sum(w)
    acc, out = 0.0, [0.0]
    for x in w:
        acc += x / total
        out.append(acc)
    out[-1] = 1.0
    return tuple(out)


def hit_rate(capacity: float, n_expert: int, skew: float) -> float:
    """Expected cache hit rate when ``capacity`` (0..1) of a layer's ``n_expert`` experts fit.

    The cache is modelled as holding the hottest ``capacity · E`` experts of a Zipf(``skew``)
    popularity (``skew = 0``: uniform, hit rate = capacity); a fractional expert counts in
    proportion. Monotone in capacity and in skew, 0 at capacity 0 and 1 at capacity 1.
    """
    if n_expert <= 0 or capacity <= 0:
        return 0.0
    if capacity >= 1:
        return 1.0
    cum = _zipf_cumulative(n_expert, round(float(skew), 6))
    x = capacity * n_expert
    j = int(x)
    return cum[j] + (x - j) * (cum[j + 1] - cum[j])


def curve_hit_rate(capacity: float, curve: tuple[tuple[float, float], ...]) -> float:
    """The hit rate at ``capacity`` on a measured curve (``DeviceProfile.hit_curve``), linear between its points
    and (0, 0), (1, 1) — nothing cached hits nothing, every expert cached hits all — and never decreasing."""
    if capacity <= 0:
        return 0.0
    if capacity >= 1:
        return 1.0
    pts = [(0.0, 0.0), *curve, (1.0, 1.0)]
    top = 0.0
    for (c0, h0), (c1, h1) in zip(pts, pts[1:]):
        h0, h1 = max(top, h0), max(top, h0, h1)
        if capacity <= c1:
            return h0 + (h1 - h0) * (capacity - c0) / (c1 - c0)
        top = h1
    return 1.0


def fit_skew(capacity: float, observed_hit_rate: float, n_expert: int) -> float:
    """The skew at which :func:`hit_rate` gives ``observed_hit_rate`` (e.g. from the profiler).

    Returns a value in [0, 4]; a hit rate at or below ``capacity`` (no skew visible) gives 0.
    """
    lo, hi = 0.0, 4.0
    if observed_hit_rate <= hit_rate(capacity, n_expert, lo):
        return lo
    if observed_hit_rate >= hit_rate(capacity, n_expert, hi):
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        if hit_rate(capacity, n_expert, mid) < observed_hit_rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Prediction:
    """Predicted decode cost of one token in one expert mode.

    bytes_by_link / seconds_by_link: {"device", "cpu", "h2d"} bytes and seconds per token
    ("sync" and "fixed" seconds too). hit_rate: the cache's predicted hit rate (None outside mode
    cache). overhead_counts: events per token of each fixed cost, by profile field name (the
    "fixed" seconds are Σ count · field µs; calibration fits the fields from these counts).
    """

    mode: str
    seconds: float
    hit_rate: float | None
    bytes_by_link: dict[str, float] = field(default_factory=dict)
    seconds_by_link: dict[str, float] = field(default_factory=dict)
    overhead_counts: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds if self.seconds > 0 else float("inf")


def predict(
    spec: ModelSpec,
    profile: DeviceProfile,
    *,
    mode: str,
    n_gpu_layers: int,
    kv_type: str,
    position: int,
    expert_slots: int = 0,
    n_cpu_moe: int = 0,
    observed_hit_rate: float | None = None,
    graphs: bool = True,
    bus_misses: bool = False,
) -> Prediction:
    """Cost of decoding one token at ``position`` for the placement described by the arguments.

    mode: where the routed experts of device layers ``>= n_cpu_moe`` run: ``cpu`` (host),
    ``cache`` (a pool of ``expert_slots`` device slots, misses computed on the host and uploaded)
    or ``resident`` (all on the device). observed_hit_rate: in mode cache, this hit rate (e.g.
    the profiler's) for every cache layer instead of the Zipf model's. graphs: whether the runtime
    runs one-token steps as CUDA graphs where :func:`graph_step` holds (the default; off when
    ``EngineOptions.cuda_graph`` is "off" — the caller says so; the planner plans for a CUDA device).
    bus_misses: in mode cache with graphs, the misses are computed on the device, read from the host over the bus
    (``EngineOptions.cache_misses``): their bytes at ``bus_read_gbps``, no host half and no crossing per layer; the
    uploads they queue are copied from the page-locked host copy behind the decode (``ExpertPool.upload_later``),
    so their bytes are counted (``bytes_by_link["h2d"]``) but add no time to the step.
    """
    L = spec.n_layer
    n = max(0, min(n_gpu_layers, L))
    K = spec.n_expert_used
    pos = max(0, position)

    b_dev = float(spec.trunk_prefix[n])
    b_trunk = float(spec.trunk_bytes - spec.trunk_prefix[n])
    # Read per token: attention layers' K/V up to the position (a sliding-window layer's: its window at most),
    # linear-attention layers' fixed-size state.
    for i, lay in enumerate(spec.layers):
        row = kv_row_bytes(kv_type if i < n else HOST_KV_TYPE, spec.kv_dim)
        seen = min(pos, lay.kv_window) if lay.kv_window else pos
        read = 2 * seen * row if lay.has_kv else lay.state_bytes
        if i < n:
            b_dev += read
        else:
            b_trunk += read
    out = spec.output_norm_bytes + spec.output_bytes
    if n == L:
        b_dev += out
    else:
        b_trunk += out
    b_trunk += spec.token_embd_bytes / max(1, spec.n_vocab)
    b_cpu = 0.0
    b_h2d = 0.0
    b_bus = 0.0
    b_h2d_behind = 0.0  # uploads copied behind the decode from the page-locked host copy: off the step's time
    n_sync = 2.0 if n else 0.0
    counts = dict.fromkeys(OVERHEAD_FIELDS, 0.0)
    counts["token_us"] = 1.0
    counts["host_layer_us"] = float(L - n)
    graph = graphs and graph_step(spec, mode, n, n_cpu_moe)
    counts["graph_layer_us" if graph else "device_layer_us"] = float(n)

    # Capacity fraction of the pool over the layers it serves.
    cached = [lay for lay in spec.layers[n_cpu_moe:n] if lay.is_moe]
    needed = sum(lay.n_expert for lay in cached)
    capacity = min(1.0, expert_slots / needed) if needed else 0.0
    h_mean = None
    if mode == CACHE:
        h_by_e: dict[int, float] = {}
        h_sum = 0.0
        for lay in cached:
            if lay.n_expert not in h_by_e:
                if observed_hit_rate is not None:
                    h_by_e[lay.n_expert] = min(1.0, max(0.0, observed_hit_rate))
                elif profile.hit_curve:
                    h_by_e[lay.n_expert] = curve_hit_rate(capacity, profile.hit_curve)
                else:
                    h_by_e[lay.n_expert] = hit_rate(capacity, lay.n_expert, profile.expert_skew)
            h_sum += h_by_e[lay.n_expert]
        h_mean = h_sum / len(cached) if cached else 0.0

    for i, lay in enumerate(spec.layers):
        if not lay.is_moe:
            continue
        read = K * lay.expert_bytes  # bytes of the K experts a token uses in this layer
        if i >= n or i < n_cpu_moe or mode == CPU:
            b_cpu += read
            if i < n:
                n_sync += 2
                counts["cpu_experts_layer_us"] += 1
        elif mode == RESIDENT:
            b_dev += read
            counts["cache_layer_us"] += 0 if graph else 1
        elif bus_misses and graph:  # every expert inside the step; the misses read over the bus, then uploaded
            h = h_by_e[lay.n_expert]
            b_dev += h * read
            b_bus += (1 - h) * read
            b_h2d_behind += (1 - h) * read
            counts["miss_us"] += K * (1 - h)
        else:
            h = h_by_e[lay.n_expert]
            b_dev += h * read
            b_cpu += (1 - h) * read
            b_h2d += (1 - h) * read
            n_sync += 2 if graph else 2 * (1 - h**K)  # a graph step hands every cache layer over to the host
            counts["cache_layer_us"] += 1
            counts["cpu_experts_layer_us"] += 1 - h**K
            counts["miss_us"] += K * (1 - h)

    secs = {
        "device": b_dev / (profile.device_gbps * 1e9),
        "cpu": b_cpu / (profile.cpu_expert_gbps * 1e9) + b_trunk / (profile.trunk_gbps * 1e9),
        "h2d": b_h2d / (profile.h2d_gbps * 1e9),
        "bus": b_bus / (profile.bus_read_gbps * 1e9),
        "sync": n_sync * profile.sync_us * 1e-6,
        "fixed": sum(c * getattr(profile, f) for f, c in counts.items()) * 1e-6,
    }
    return Prediction(
        mode=mode,
        seconds=sum(secs.values()),
        hit_rate=h_mean,
        bytes_by_link={
            "device": b_dev,
            "cpu": b_cpu + b_trunk,
            "h2d": b_h2d + b_h2d_behind,
            "bus": b_bus,
            "cpu_trunk": b_trunk,
        },
        seconds_by_link=secs,
        overhead_counts=counts,
    )
