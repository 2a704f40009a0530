"""The expert cache's hit rate against capacity, as the planner prices ``cache`` with it
(``DeviceProfile.hit_curve``): a cache policy replayed on routing traces.

:func:`planner_curve` takes the default policy's curve from the user's routing history
(:mod:`engine.routes.history`) — its traces of the model's geometry (experts a layer, experts a token), when there
are any and the user lets it ("use my routing history") — else what ``EngineOptions.hit_curve`` names: the
synthetic Qwen3-30B-A3B trace's curve (:mod:`engine.routes.synthetic`; the default) or the planner's Zipf popularity
guess (no curve). Why the synthetic curve is the default: docs/planner.md, *Hit rate*. A curve takes seconds to
replay, so each is cached on disk (``hit-curves`` beside the calibrations), keyed by the trace file (its size and
modification time), the policy and its knobs; the default policy's synthetic curve is recorded here
(:data:`SYNTHETIC_CURVE`), so a first plan does not replay it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine import config
from engine.config import EngineOptions
from engine.errors import TraceError
from engine.routes import RouteTrace, load_trace
from engine.routes.history import history_traces
from engine.routes.synthetic import QWEN3_30B_A3B
from engine.runtime.cache_policies import DEFAULT_POLICY, make
from engine.runtime.slot_policies import SLOT_POLICIES

log = logging.getLogger(__name__)

SOURCE_HISTORY, SOURCE_SYNTHETIC, SOURCE_ZIPF, SOURCE_SESSION = "history", "synthetic", "zipf", "session"
SYNTHETIC_DETAIL = "synthetic Qwen3-30B-A3B routing"
ZIPF_DETAIL = "the Zipf popularity guess (no routing history of this model)"
# The synthetic trace is of a fine-grained MoE (128 experts, 8 a token); a model with fewer experts a layer (Mixtral's
# 8, gpt-oss-20b's 32) routes more evenly over them, and its capacity fractions do not map onto that curve: those
# keep the Zipf guess.
SYNTHETIC_MIN_EXPERTS = 64
FEW_EXPERTS_DETAIL = "the Zipf popularity guess (no routing history; fewer experts a layer than the synthetic trace's)"
CURVE_CAPACITIES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CURVE_LAYERS = 8  # layers of a trace replayed for a curve
CURVE_VERSION = 1  # bump when the replay changes what a cached curve would hold
# The default policy's curve on the synthetic trace (SYNTHETIC, seed 0, CURVE_CAPACITIES), as a replay gives it in
# ~7 s (tests/test_route_history.py replays it and compares).
SYNTHETIC_CURVE = (
    (0.05, 0.3545), (0.1, 0.5782), (0.2, 0.7827), (0.3, 0.864), (0.4, 0.9106),
    (0.5, 0.9405), (0.6, 0.9605), (0.7, 0.9743), (0.8, 0.9838), (0.9, 0.9901),
)  # fmt: skip


@dataclass(frozen=True)
class CurveChoice:
    """A hit-rate curve and where it came from (plain data: the app shows ``detail``)."""

    points: tuple[tuple[float, float], ...]  # (capacity, hit rate), capacities ascending
    source: str  # SOURCE_HISTORY | SOURCE_SESSION | SOURCE_SYNTHETIC | SOURCE_ZIPF (then no points)
    detail: str  # e.g. "your routing history: 2 traces, 1,536 tokens"
    traces: int = 0  # history traces used
    tokens: int = 0  # their tokens


def hit_curve(
    trace: RouteTrace, capacities=CURVE_CAPACITIES, layers: int = CURVE_LAYERS, policy: str = DEFAULT_POLICY
) -> tuple[tuple[float, float], ...]:
    """``policy``'s hit rate (default: the default policy's) at each capacity on the first ``layers`` layers of
    ``trace`` (0: all)."""
    L = trace.n_layers if layers <= 0 else min(layers, trace.n_layers)
    out = []
    for c in capacities:
        n_slots = max(0, round(c * trace.n_expert))
        hits = sum(int(make(policy, n_slots, trace.n_expert).run(trace.layer(j)).sum()) for j in range(L))
        out.append((float(c), round(hits / (trace.n_tokens * L * trace.k), 4)))
    return tuple(out)


def planner_curve(
    n_expert: int,
    k: int,
    *,
    use_history: bool = True,
    options: EngineOptions | None = None,
    policy: str | None = None,
    fallback: str | None = None,
) -> CurveChoice:
    """The hit-rate curve for a model with ``n_expert`` experts a layer and ``k`` a token: from the history's
    traces of that geometry (their curves averaged, weighted by tokens) when ``use_history`` and there are
    any, else ``fallback`` (default ``EngineOptions.hit_curve``): "synthetic" (the synthetic trace's curve, for a
    model of at least SYNTHETIC_MIN_EXPERTS experts a layer; else the Zipf model) or "zipf" (no points: the
    planner's Zipf model). A trace that cannot be read is skipped (and logged)."""
    policy = policy or DEFAULT_POLICY
    fallback = fallback or (options or config.current()).hit_curve
    if use_history:
        curves, tokens = [], []
        for path in history_traces(options):
            got = _trace_curve(path, policy, options, n_expert, k)
            if got is not None:
                curves.append(got[0])
                tokens.append(got[1])
        if curves:
            total = sum(tokens)
            caps = [c for c, _ in curves[0]]
            points = tuple(
                (c, round(sum(cv[i][1] * t for cv, t in zip(curves, tokens)) / total, 4)) for i, c in enumerate(caps)
            )
            n = len(curves)
            detail = f"your routing history: {n} trace{'s' * (n != 1)}, {total:,} tokens"
            return CurveChoice(points, SOURCE_HISTORY, detail, n, total)
    if fallback == SOURCE_SYNTHETIC and n_expert >= SYNTHETIC_MIN_EXPERTS:
        return CurveChoice(_synthetic_curve(policy, options), SOURCE_SYNTHETIC, SYNTHETIC_DETAIL)
    return CurveChoice((), SOURCE_ZIPF, ZIPF_DETAIL if fallback != SOURCE_SYNTHETIC else FEW_EXPERTS_DETAIL)


SESSION_CAPACITIES = (0.1, 0.3, 0.5, 0.7, 0.9)  # a session's curve: these and the placement's own capacity
SESSION_LAYERS = 4


def session_curve(trace: RouteTrace, policy: str | None = None, capacity: float | None = None) -> CurveChoice:
    """The curve of ``policy`` (default: the default policy) replayed on a session's own routes: at
    SESSION_CAPACITIES and at ``capacity`` (the placement's, where the re-plan reads it exactly), on the first
    SESSION_LAYERS MoE layers of ``trace``. It is replayed while the user waits for a reply, so it is coarser than a
    history curve: 512 tokens of the Qwen3.6 geometry's shape (256 experts, 8 a token) took 2.3 s on 2 busy cores,
    against 7.4 s at the 10 capacities and 8 layers of a history curve."""
    caps = set(SESSION_CAPACITIES)
    if capacity is not None and 0.0 < capacity < 1.0:
        caps.add(round(float(capacity), 4))
    points = hit_curve(trace, tuple(sorted(caps)), SESSION_LAYERS, policy or DEFAULT_POLICY)
    n = trace.n_tokens
    return CurveChoice(points, SOURCE_SESSION, f"this session's routing: {n:,} prompt tokens", 0, n)


def _policy_key(policy: str) -> dict:
    cls = SLOT_POLICIES.get(policy)
    knobs = {k: getattr(cls, k.upper()) for k in getattr(cls, "KNOBS", ())}
    return {"policy": policy, "knobs": knobs, "version": CURVE_VERSION, "layers": CURVE_LAYERS}


SYNTHETIC = replace(QWEN3_30B_A3B, n_layers=CURVE_LAYERS)  # the generator of the trace a synthetic curve replays


def _synthetic_curve(policy: str, options: EngineOptions | None) -> tuple[tuple[float, float], ...]:
    if policy == DEFAULT_POLICY:
        return SYNTHETIC_CURVE
    key = {**_policy_key(policy), "synthetic": asdict(SYNTHETIC), "seed": 0, "capacities": list(CURVE_CAPACITIES)}
    cached = _load(key, options)
    if cached is not None:
        return cached
    return _store(key, hit_curve(SYNTHETIC.generate(seed=0), policy=policy), options)


def _trace_curve(path: Path, policy: str, options, n_expert: int, k: int):
    """(curve, tokens) of one history trace of this geometry, else None."""
    try:
        st = path.stat()
        key = {**_policy_key(policy), "trace": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        key["capacities"] = list(CURVE_CAPACITIES)
        cached = _load(key, options, with_meta=True)
        if cached is not None:
            curve, meta = cached
        else:
            trace = load_trace(path)
            meta = {"n_expert": trace.n_expert, "k": trace.k, "tokens": trace.n_tokens}
            fits = trace.n_expert == n_expert and trace.k == k and trace.n_tokens
            curve = _store(key, hit_curve(trace, policy=policy) if fits else (), options, meta)
    except (OSError, TraceError, ValueError, KeyError) as e:
        log.warning("routing history: %s skipped (%s)", path, e)
        return None
    if meta["n_expert"] != n_expert or meta["k"] != k or not meta["tokens"]:
        return None
    return curve, int(meta["tokens"])


def _cache_file(key: dict, options) -> Path:
    """Beside the calibrations (engine.bench.calibrate.cache_dir): ``calibration_dir``, else the user cache dir."""
    d = (options or config.current()).calibration_dir
    if d is None:
        from platformdirs import user_cache_dir

        d = Path(user_cache_dir("sharpi")) / "calibration"
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(d) / "hit-curves" / f"{h}.json"


def _load(key: dict, options, with_meta: bool = False):
    try:
        got = json.loads(_cache_file(key, options).read_text())
        curve = tuple((float(c), float(h)) for c, h in got["points"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (curve, got.get("meta", {})) if with_meta else curve


def _store(key: dict, curve, options, meta: dict | None = None):
    path = _cache_file(key, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "points": [list(p) for p in curve], "meta": meta or {}}))
    except OSError:
        pass  # a read-only cache: the curve is replayed again next time
    return curve
