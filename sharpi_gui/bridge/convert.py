"""The engine's objects as the app's plain data (``sharpi_gui.data``): what a load publishes, model cards,
placement limits and previews, stats frames, failures. Part of the bridge, the one place the app meets the
engine; the worker and :class:`~sharpi_gui.bridge.EngineBridge` call these on the engine or UI thread."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.api import Session
from engine.bench.calibrate import speed_profile
from engine.bench.calibrate_host import cached_cpu_profile
from engine.errors import (
    ChatTemplateError,
    DeviceMemoryError,
    GGUFError,
    HostMemoryError,
    SharpIError,
    UnsupportedArchitectureError,
    UnsupportedQuantTypeError,
    UsageError,
)
from engine.plan import DeviceProfile, ModelSpec, PlanError, PlanRequest
from engine.plan import plan as plan_placement
from engine.plan.profile import profile_source
from engine.remote import RemoteSession
from sharpi_gui import data as D

MiB = 1 << 20
# Context sizes offered by the slider: powers of two and the 1.5x steps between them.
CTX_LADDER = tuple(sorted({2**k for k in range(8, 21)} | {3 * 2**k for k in range(7, 20)}))
# The VRAM slider ends this far above what the whole model needs (when the device has more).
VRAM_HEADROOM = 1.25


@dataclass(frozen=True)
class Loaded:
    """What the worker publishes after a load; read by the bridge on the UI thread."""

    session: Session
    spec: ModelSpec
    profile: DeviceProfile
    card: D.ModelCard
    limits: D.PlacementLimits


@dataclass(frozen=True)
class Remote:
    """A remote OpenAI-compatible endpoint in place of a loaded model: the chat streams from it; the
    placement, the experts' statistics and the local server do not apply."""

    session: RemoteSession
    info: D.RemoteInfo


# -- conversions: engine objects -> plain records ----------------------------------------------------


def failure(e: BaseException, title: str) -> D.Failure:
    if isinstance(e, (UnsupportedArchitectureError, UnsupportedQuantTypeError)):
        return D.Failure(D.ERR_UNSUPPORTED, title, f"This model is not supported.\n\n{e}")
    if isinstance(e, GGUFError):
        return D.Failure(D.ERR_BAD_FILE, title, f"This file is not a usable GGUF model.\n\n{e}")
    if isinstance(e, (DeviceMemoryError, HostMemoryError, MemoryError)) or "out of memory" in str(e).lower():
        return D.Failure(D.ERR_OUT_OF_MEMORY, title, f"Out of memory.\n\n{e}")
    if isinstance(e, UsageError) and "context" in str(e):
        return D.Failure(D.ERR_CONTEXT, title, str(e))
    if isinstance(e, ChatTemplateError):
        return D.Failure(D.ERR_TEMPLATE, title, f"{e}.\n\nThe model's own chat template cannot be used for this chat.")
    if isinstance(e, SharpIError):
        return D.Failure(D.ERR_ENGINE, title, str(e))
    if isinstance(e, OSError):
        return D.Failure(D.ERR_BAD_FILE, title, f"The file cannot be read.\n\n{e}")
    detail = "".join(traceback.format_exception_only(type(e), e)).strip()
    return D.Failure(D.ERR_INTERNAL, title, f"Unexpected error (a bug in SharpI):\n\n{detail}")


def gen_stats(ev) -> D.GenStats:
    return D.GenStats(
        n_prompt=ev.n_prompt,
        n_generated=ev.n_generated,
        n_ctx_used=ev.n_ctx_used,
        n_ctx=ev.n_ctx,
        ttft_s=ev.ttft_s,
        prompt_tok_s=ev.prompt_tok_s,
        decode_tok_s=ev.decode_tok_s,
        finish_reason=ev.finish_reason,
        message=ev.message,
        decode_hit_rate=ev.decode_hit_rate,
        mtp_acceptance=ev.mtp_acceptance,
    )


def card(session: Session, spec: ModelSpec) -> D.ModelCard:
    info = session.info
    hp = info.hparams
    mix = tuple(sorted(info.bytes_by_type.items(), key=lambda kv: -kv[1]))
    return D.ModelCard(
        path=str(info.path),
        name=info.name or Path(info.path).stem,
        architecture=info.architecture,
        n_parameters=info.n_parameters,
        n_layer=spec.n_layer,
        n_expert=int(hp.get("n_expert", 0) or 0),
        n_expert_used=int(hp.get("n_expert_used", 0) or 0),
        file_size=info.file_size,
        quant_mix=mix,
        trunk_bytes=info.trunk_bytes,
        expert_bytes=info.expert_bytes,
        has_chat_template=info.has_chat_template,
        vocab_size=info.vocab_size,
        n_ctx_train=spec.n_ctx_train,
        n_ctx=session.n_ctx,
        kv_type=session.kv_type,
        tokenizer=f"{info.tokenizer_model} ({info.tokenizer_pre})" if info.tokenizer_pre else info.tokenizer_model,
        notes=notes(Path(info.path)),
    )


def notes(path: Path) -> str:
    """A model card shipped beside the file: ``<stem>.md``, else ``MODEL_CARD.md`` in its folder."""
    for card in (path.with_suffix(".md"), path.parent / "MODEL_CARD.md"):
        try:
            if card.is_file():
                return card.read_text(encoding="utf-8")[:20000]
        except OSError:
            continue
    return ""


def plan_request(s: D.PlanSettings) -> PlanRequest:
    return PlanRequest(
        ctx=s.ctx,
        kv_type=s.kv_type,
        n_gpu_layers=s.n_gpu_layers,
        moe=s.moe,
        moe_source="" if s.moe == D.MOE_AUTO else "the expert-mode selector",
    )


def preview(settings: D.PlanSettings, p) -> D.PlanPreview:
    dev = p.device
    return D.PlanPreview(
        settings=settings,
        budget_bytes=p.budget_bytes,
        segments=tuple((key, int(getattr(dev, key))) for key, _ in D.SEGMENTS),
        expert_cache_budget_bytes=p.expert_cache_budget_bytes,
        free_bytes=p.budget_bytes - dev.total,
        layers=tuple(D.LayerCell(x.index, x.device, x.experts, x.trunk_bytes, x.kv_bytes) for x in p.layers),
        n_layer=p.n_layer,
        n_gpu_layers=p.n_gpu_layers,
        layer_reason=p.layer_reason,
        moe_mode=p.moe_mode,
        moe_reason=p.moe_reason,
        predicted_tok_s=tuple(p.predicted_tok_s.items()),
        resident_split=p.resident_split or 0,
        predicted_hit_rate=p.to_dict()["predicted_hit_rate"],
        speeds_source=profile_source(p.profile, cpu_only=p.n_gpu_layers == 0),
        speeds_device=p.profile.name,
        hit_curve_source=p.profile.hit_curve_source,
        expert_slots=p.expert_slots,
        expert_slots_needed=p.expert_slots_needed,
        kv_bytes=p.kv_bytes,
        host_kv_bytes=p.host_kv_bytes,
        recommended_ctx=p.recommended_ctx,
        notes=tuple(p.notes),
    )


def stats_frame(snap) -> D.StatsFrame:
    """A :class:`ProfilerSnapshot` as the experts dock draws it (heat and residency unchanged)."""
    lookups = snap.hits + snap.misses  # [L, E]
    ratio = np.divide(snap.hits, lookups, out=np.zeros(lookups.shape), where=lookups > 0)
    gap = snap.step_interval_s  # token to token, as the generation loop (and the status bar) counts it
    tok_s = np.divide(1.0, gap, out=np.full(gap.shape, np.nan), where=np.isfinite(gap) & (gap > 0))
    pf_hits = int(snap.prefetch_hits.sum()) if snap.prefetch_hits is not None else 0
    pred = snap.prediction.sum(axis=0) if snap.prediction is not None else np.zeros(3, np.int64)
    return D.StatsFrame(
        n_layer=snap.n_layer,
        n_expert=snap.calls.shape[1],
        heat=snap.heat,
        residency=snap.resident.astype(np.float64),
        hit_ratio=ratio,
        calls=snap.calls,
        tok_s=tok_s,
        hit_rate=snap.step_hit_rate,
        upload_mb_s=snap.step_upload_mb_s,
        tokens_total=snap.tokens_total,
        has_cache=bool(lookups.any()),
        decode_tok_s=snap.decode.tok_s,
        decode_hit_rate=snap.decode.hit_rate,
        decode_tokens=snap.decode.tokens,
        demand_hits=int(snap.hits.sum()) - pf_hits,
        prefetch_hits=pf_hits,
        prefetch_recall=float(pred[2] / pred[1]) if pred[1] else float("nan"),
    )


def ladder(n_ctx_train: int, current: int) -> tuple[int, ...]:
    top = max(n_ctx_train, current)
    return tuple(sorted({v for v in CTX_LADDER if v <= top} | {n_ctx_train, current}))


def limits(
    session: Session,
    spec: ModelSpec,
    profile: DeviceProfile,
    requested: D.PlanSettings | None,
    measured_tok_s: float = 0.0,
    offer_device: bool = True,
) -> D.PlacementLimits:
    """:func:`placement_limits` with the session's expert-cache policy and routing-history choice."""
    got = placement_limits(session, spec, profile, requested, measured_tok_s, offer_device)
    kw = {"cache_policy": session.cache_policy, "routing_history": session.routing_history}
    return replace(got, **kw, whatif=replace(got.whatif, **kw) if got.whatif else None)


def placement_limits(
    session: Session,
    spec: ModelSpec,
    profile: DeviceProfile,
    requested: D.PlanSettings | None,
    measured_tok_s: float = 0.0,
    offer_device: bool = True,
) -> D.PlacementLimits:
    """Ranges of the placement controls; ``requested``: the settings that made the placement in
    force (None when the model runs on the CPU: the controls then propose the automatic plan).
    Without a GPU the only placement is the CPU: the controls offer its context and KV type."""
    ctx_values = ladder(spec.n_ctx_train, session.n_ctx)
    if not offer_device:
        current = D.PlanSettings(vram_bytes=0, ctx=session.n_ctx, kv_type=session.kv_type, n_gpu_layers=0)
        whatif = replace(
            placement_limits(session, spec, profile, None, measured_tok_s, offer_device=True),
            device_name="hypothetical GPU, default speeds",
            in_force="",
        )
        return D.PlacementLimits(
            device_name="",
            device_vram_bytes=0,
            vram_max_bytes=MiB,
            vram_step_bytes=MiB,
            ctx_values=ctx_values,
            n_layer=spec.n_layer,
            is_moe=spec.is_moe,
            current=current,
            applied=None,
            in_force="CPU only (no GPU found)",
            has_gpu=False,
            n_ctx_train=spec.n_ctx_train,
            measured_tok_s=measured_tok_s,
            whatif=whatif,
        )
    # The most the model can use: every layer and expert on the device at the widest settings.
    widest = PlanRequest(ctx=ctx_values[-1], kv_type="f32", moe="resident" if spec.is_moe else "auto")
    try:
        need = plan_placement(spec, profile.with_budget(1 << 50), widest).device.total
    except PlanError:
        need = profile.vram_bytes
    vram_max = min(profile.vram_bytes, int(need * VRAM_HEADROOM))
    step = max(MiB, 1 << max(0, (max(vram_max, 1) // 1024).bit_length() - 1))
    vram_max = max(step, vram_max // step * step)
    placement = session.placement
    if placement is not None and placement.n_gpu_layers > 0:
        applied = replace(
            requested or D.PlanSettings(vram_bytes=placement.budget_bytes, ctx=0),
            vram_bytes=min(placement.budget_bytes, vram_max),
            ctx=placement.ctx,
            kv_type=placement.kv_type,
        )
        current = applied
        in_force = f"{placement.n_gpu_layers}/{placement.n_layer} layers on the device · experts: {placement.moe_mode}"
    else:
        applied = None
        current = D.PlanSettings(vram_bytes=vram_max, ctx=session.n_ctx, kv_type=session.kv_type)
        in_force = "CPU only"
    return D.PlacementLimits(
        device_name=profile.name or "simulated device (default profile)",
        device_vram_bytes=profile.vram_bytes,
        vram_max_bytes=vram_max,
        vram_step_bytes=step,
        ctx_values=ctx_values,
        n_layer=spec.n_layer,
        is_moe=spec.is_moe,
        current=current,
        applied=applied,
        in_force=in_force,
        n_ctx_train=spec.n_ctx_train,
        measured_tok_s=measured_tok_s,
    )


def device_profile(session: Session) -> DeviceProfile:
    """The GPU's memory and its calibrated speeds (measured once per machine, a few seconds, on
    the first load with CUDA; cached after); without a GPU, this CPU's cached calibration for the model
    (engine.bench.calibrate_host.cached_cpu_profile, measured in the background on the first launch) with the
    default device figures; else the default budget and speeds."""
    speeds = speed_profile(session.device, session.gf, measure=True, options=session.engine_options)
    if speeds is None and session.device.type != "cuda":
        speeds = cached_cpu_profile(session.info.path, session.engine_options)
    if speeds is not None:
        session.set_device_profile(speeds)
    return session.device_profile()


def plan_for(loaded: Loaded, settings: D.PlanSettings):
    return loaded.session.plan(plan_request(settings), loaded.profile.with_budget(settings.vram_bytes))
