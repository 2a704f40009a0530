"""``sharpi bench cache``: every expert-cache policy (engine.runtime.cache_policies) replayed on a routing trace at
several capacities, against Belady's offline optimum, with whether the cache pays at all.

A capacity is a fraction of each layer's experts held on the device (``round(capacity · n_expert)`` slots a
layer, each layer its own policy instance). A hit rate counts every routed expert of every token and layer.

**Whether the cache pays** (``declines``): per token and layer the expert work is priced with the planner's
cost-model terms (docs/planner.md, *Cost model*) from a :class:`~engine.plan.DeviceProfile`, for the trace's
own hits, misses and uploads under the default policy —

    cpu   = k·e / cpu_expert_gbps + 2·sync_us + cpu_experts_layer_us
    cache = hits·e / device_gbps + misses·e / cpu_expert_gbps + uploads·e / h2d_gbps + misses·miss_us
            + cache_layer_us + [any miss]·(2·sync_us + cpu_experts_layer_us)

(``e`` one expert's bytes) — and the cache declines where it costs more than running the experts on the CPU.
``expert_ms`` reports both, summed over the trace's layers, per token: the experts' share of a decode step,
not a whole model's tok/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from engine.plan import DeviceProfile
from engine.routes import RouteTrace
from engine.runtime.cache_policies import DEFAULT_POLICY, POLICIES, make

CAPACITIES = (0.05, 0.2, 0.4, 0.6)
# One routed expert of Qwen3-30B-A3B in Q4_K (gate, up and down: 3 x 768 x 2048 weights at 4.5 bits).
QWEN3_30B_A3B_EXPERT_BYTES = 3 * 884_736


def run(
    trace: RouteTrace,
    capacities: Sequence[float] = CAPACITIES,
    policies: Sequence[str] = tuple(POLICIES),
    profile: DeviceProfile | None = None,
    expert_bytes: int | None = None,
) -> dict:
    """The report ``sharpi bench cache --json`` prints (see the module docstring); the default policy is always
    among ``policies`` (it decides ``declines``)."""
    profile = profile or DeviceProfile()
    policies = list(policies) + [DEFAULT_POLICY] * (DEFAULT_POLICY not in policies)
    e = expert_bytes or trace.meta.get("expert_bytes") or QWEN3_30B_A3B_EXPERT_BYTES
    E, k, L = trace.n_expert, trace.k, trace.n_layers
    rates: dict[str, list[float]] = {p: [] for p in policies}
    cpu_us = k * e / (profile.cpu_expert_gbps * 1e3) + 2 * profile.sync_us + profile.cpu_experts_layer_us
    expert_ms: dict[str, list[float]] = {"cpu": [], "cache": []}
    declines: dict[str, bool] = {}
    for c in capacities:
        n_slots = max(0, round(c * E))
        for p in policies:
            hits = uploads = 0
            cost_us = 0.0
            for j in range(L):
                pol = make(p, n_slots, E)
                mask = pol.run(trace.layer(j))
                hits += int(mask.sum())
                uploads += pol.uploads
                if p == DEFAULT_POLICY:
                    cost_us += _cache_us(mask, pol.uploads, e, profile)
            rates[p].append(hits / trace.ids.size)
            if p == DEFAULT_POLICY:
                cache_ms = cost_us / trace.n_tokens / 1e3
                expert_ms["cache"].append(round(cache_ms, 4))
                expert_ms["cpu"].append(round(cpu_us * L / 1e3, 4))
                declines[_key(c)] = cache_ms >= cpu_us * L / 1e3
    belady = rates.get("belady")
    return {
        "capacities": list(capacities),
        "policies": rates,
        "fraction_of_belady": {
            p: [r / b if b else math.nan for r, b in zip(v, belady)] for p, v in rates.items() if belady
        },
        "default": DEFAULT_POLICY,
        "declines": declines,
        "expert_ms": expert_ms,
        "expert_bytes": int(e),
        "trace": {
            "model": trace.meta.get("model", ""),
            "source": trace.meta.get("source", ""),
            "tokens": trace.n_tokens,
            "layers": L,
            "k": k,
            "n_expert": E,
        },
    }


def _cache_us(hits: np.ndarray, uploads: int, e: int, p: DeviceProfile) -> float:
    """The cache mode's expert cost (µs) over one layer's whole trace (see the module docstring)."""
    n_hit = int(hits.sum())
    n_miss = hits.size - n_hit
    any_miss = int((~hits).any(axis=1).sum())
    bytes_us = (
        n_hit * e / (p.device_gbps * 1e3) + n_miss * e / (p.cpu_expert_gbps * 1e3) + uploads * e / (p.h2d_gbps * 1e3)
    )
    return (
        bytes_us
        + n_miss * p.miss_us
        + len(hits) * p.cache_layer_us
        + any_miss * (2 * p.sync_us + p.cpu_experts_layer_us)
    )


def _key(c: float) -> str:
    return f"{c:g}"


def format_table(report: dict) -> str:
    caps = report["capacities"]
    t = report["trace"]
    lines = [
        f"trace      {t['model'] or '?'} ({t['source'] or '?'}): {t['tokens']} tokens x {t['layers']} layers, "
        f"top-{t['k']} of {t['n_expert']}",
        "hit rate (fraction of Belady's)",
        f"{'capacity':10s}" + "".join(f"{c:>16.0%}" for c in caps),
    ]
    frac = report["fraction_of_belady"]
    for p, v in report["policies"].items():
        mark = " *" if p == report["default"] else ""
        cells = "".join(
            f"{r:>8.1%} ({frac[p][i]:.1%})" if p in frac and p != "belady" else f"{r:>16.1%}" for i, r in enumerate(v)
        )
        lines.append(f"{p + mark:10s}{cells}")
    ms = report["expert_ms"]
    lines.append(f"{'experts ms/token, ' + report['default']:s}")
    lines.append(f"{'  cache':10s}" + "".join(f"{x:>16.2f}" for x in ms["cache"]))
    lines.append(f"{'  cpu':10s}" + "".join(f"{x:>16.2f}" for x in ms["cpu"]))
    lines.append(
        f"{'declines':10s}" + "".join(f"{('yes' if report['declines'][_key(c)] else 'no'):>16s}" for c in caps)
    )
    lines.append(f"* the default policy; expert bytes {report['expert_bytes']:,}")
    return "\n".join(lines)


def write_svg(report: dict, path: str) -> None:
    """Hit rate against capacity, one line per policy, as SVG (no plotting library is a dependency)."""
    W, H, m = 640, 400, 60
    caps = report["capacities"]
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]

    def xy(c: float, r: float) -> tuple[float, float]:
        return m + c * (W - 2 * m), H - m - r * (H - 2 * m)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<line x1="{m}" y1="{H - m}" x2="{W - m}" y2="{H - m}" stroke="black"/>',
        f'<line x1="{m}" y1="{m}" x2="{m}" y2="{H - m}" stroke="black"/>',
        f'<text x="{W / 2}" y="{H - 20}" text-anchor="middle">capacity (fraction of each layer\'s experts)</text>',
        f'<text x="16" y="{H / 2}" transform="rotate(-90 16 {H / 2})" text-anchor="middle">hit rate</text>',
    ]
    for i in range(6):
        v = i / 5
        x, y = xy(v, 0)
        out.append(f'<text x="{x}" y="{H - m + 16}" text-anchor="middle">{v:.0%}</text>')
        x, y = xy(0, v)
        out.append(f'<text x="{m - 6}" y="{y + 4}" text-anchor="end">{v:.0%}</text>')
        out.append(f'<line x1="{m}" y1="{y}" x2="{W - m}" y2="{y}" stroke="#ddd"/>')
    for n, (p, rates) in enumerate(report["policies"].items()):
        col = colors[n % len(colors)]
        pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in (xy(c, r) for c, r in zip(caps, rates)))
        dash = ' stroke-dasharray="6 4"' if p == "belady" else ""
        out.append(f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="2"{dash}/>')
        label = p + (" (default)" if p == report["default"] else "")
        out.append(f'<text x="{m + 10}" y="{m + 14 + 16 * n}" fill="{col}">{label}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
