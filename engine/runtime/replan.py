"""An ``auto`` placement planned again on the model's own routing.

``auto`` chooses among the expert modes from predicted tok/s, and the expert cache's prediction rests on a hit-rate
curve. Until the user has routing history of the model's geometry, that curve is the synthetic Qwen3-30B-A3B trace's
(or the Zipf guess): right for a model whose routing is as lopsided as that trace's, wrong for a flatter one — on the
Qwen3.6-35B-A3B geometry's random file the cache took 56 % of its lookups where the synthetic curve promised 94 %,
and `auto` decoded at 0.49× of llama.cpp's best split where the split it passed over ran at 0.99×
(docs/benchmarks.md). A session therefore samples its own prompts' routing (``engine.routes.sample.RoutingSample``)
and, once it holds ``EngineOptions.replan_tokens`` tokens, replays the cache policy on it and plans the same request
again with that curve (:func:`replan`); ``engine.api.Session`` applies the new placement between turns when the
choice changed. The output never changes: every placement gives the CPU path's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.plan import AUTO, Placement, plan
from engine.plan.costmodel import CACHE
from engine.plan.spec import ModelSpec
from engine.runtime.hit_curves import CurveChoice


@dataclass(frozen=True)
class Replan:
    """What a re-plan found (plain data: the app and the CLI show ``note``)."""

    tokens: int  # prompt tokens of the session's routing the curve was replayed on
    hit_rate_before: float | None  # the cache's predicted hit rate at the placement's capacity, first plan
    hit_rate: float | None  # the same on the session's own routing
    before: str  # the choice in force, in words (:func:`choice`: "the GPU expert cache", "experts on the CPU", …)
    after: str  # the re-plan's choice
    predicted_before: float | None  # tok/s of the choice in force, predicted on the session's curve
    predicted_after: float | None  # tok/s of the re-plan's choice, the same way
    changed: bool  # the choice differs: the session applies it
    note: str  # one line for people: the CLI's log, the app's tooltip
    headline: str  # the same, short enough for the app's status bar


def eligible(placement: Placement | None, spec: ModelSpec) -> bool:
    """Whether re-planning on measured routing can change ``placement``: an ``auto`` choice of expert mode with layers
    on the device, for a MoE model whose device layers' experts do not all fit (so the cache was a candidate, priced
    with a hit rate)."""
    p = placement
    return (
        p is not None
        and spec.is_moe
        and p.request is not None
        and p.request.moe == AUTO
        and p.n_gpu_layers > 0
        and p.predictions.get(CACHE) is not None
        and 0 < p.expert_slots < p.expert_slots_needed
    )


def choice(p: Placement) -> str:
    """The expert choice of ``p`` in words ("experts on the CPU", "the GPU expert cache", …), for the note and the
    app's status bar."""
    if p.moe_mode == CACHE:
        what = "the GPU expert cache"
    elif p.n_cpu_moe:
        what = f"experts resident on the GPU from layer {p.n_cpu_moe}, on the CPU before it"
    else:
        what = {"cpu": "experts on the CPU", "resident": "experts resident on the GPU"}.get(p.moe_mode, p.moe_mode)
    if p.n_gpu_layers < p.n_layer:
        what += f", {p.n_gpu_layers}/{p.n_layer} layers on the device"
    return what


def _key(p: Placement) -> tuple:
    return p.moe_mode, p.n_cpu_moe, p.n_gpu_layers


def replan(spec: ModelSpec, placement: Placement, curve: CurveChoice) -> tuple[Placement, Replan]:
    """``placement``'s request planned again with ``curve`` in its profile: (the new placement, what changed)."""
    p = placement
    profile = replace(p.profile, hit_curve=curve.points, hit_curve_source=curve.detail)
    new = plan(spec, profile, p.request)
    changed = _key(new) != _key(p)
    old_pred, new_pred = new.predictions.get(p.moe_mode), new.predictions.get(new.moe_mode)
    first = p.predictions.get(CACHE)
    again = new.predictions.get(CACHE)
    before, after = choice(p), choice(new)
    said = f"this session's routing ({curve.tokens:,} prompt tokens"
    if again is not None and again.hit_rate is not None:
        said += f", cache hit rate {again.hit_rate:.0%}"
        if first is not None and first.hit_rate is not None:
            said += f", not {first.hit_rate:.0%}"
    said += ")"
    if changed:
        note = f"Re-planned on {said}: {after}, was {before}"
    else:
        note = f"Checked the plan on {said}: {before} stays"
    if old_pred is not None and new_pred is not None:
        note += f"; predicted {new_pred.tok_s:.0f}" + (f" against {old_pred.tok_s:.0f}" if changed else "") + " tok/s"
    headline = f"Re-planned on this chat's routing: {after}" if changed else f"Plan kept: {before}"
    if again is not None and again.hit_rate is not None:
        headline += f" (the cache would hit {again.hit_rate:.0%})"
    return new, Replan(
        tokens=curve.tokens,
        hit_rate_before=first.hit_rate if first is not None else None,
        hit_rate=again.hit_rate if again is not None else None,
        before=before,
        after=after,
        predicted_before=old_pred.tok_s if old_pred is not None else None,
        predicted_after=new_pred.tok_s if new_pred is not None else None,
        changed=changed,
        note=note,
        headline=headline,
    )
