"""Planner benchmark: how long ``plan()`` takes as a dragging VRAM slider calls it.

Used by ``sharpi plan --bench``; ``bench_plan`` returns plain data so a ``sharpi bench plan``
command can print or record it too.
"""

from __future__ import annotations

import statistics
import time

from engine.plan import DeviceProfile, ModelSpec, PlanRequest, plan


def bench_plan(
    spec: ModelSpec, profile: DeviceProfile, request: PlanRequest, *, rounds: int = 20, budgets: int = 50
) -> dict:
    """Time ``plan`` over ``rounds`` sweeps of ``budgets`` VRAM budgets from 1/budgets of the
    profile's budget up to all of it (a slider dragged end to end), and ``plan`` + ``to_dict``.

    Returns {"n_layer", "calls", "median_ms", "p95_ms", "max_ms", "median_ms_with_json"}.
    """
    sweep = [profile.with_budget(profile.vram_bytes * (k + 1) // budgets) for k in range(budgets)]
    plain: list[float] = []
    with_json: list[float] = []
    plan(spec, profile, request)  # warm caches (hit-rate table) as a running app would have them
    for _ in range(rounds):
        for prof in sweep:
            t0 = time.perf_counter()
            p = plan(spec, prof, request)
            t1 = time.perf_counter()
            p.to_dict()
            t2 = time.perf_counter()
            plain.append((t1 - t0) * 1e3)
            with_json.append((t2 - t0) * 1e3)
    plain.sort()
    return {
        "n_layer": spec.n_layer,
        "calls": len(plain),
        "median_ms": statistics.median(plain),
        "p95_ms": plain[int(0.95 * (len(plain) - 1))],
        "max_ms": plain[-1],
        "median_ms_with_json": statistics.median(with_json),
    }
