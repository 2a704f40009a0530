"""The tier planner: a pure function from a model's footprint and a device to a placement.

    spec = ModelSpec.from_gguf(gf)                    # plain data from the GGUF header
    placement = plan(spec, DeviceProfile(vram_bytes=parse_size("12GiB")), PlanRequest(ctx=32768))

The runtime sizes its allocations through :mod:`engine.plan.sizing`, the same functions the
planner prices with. See ``docs/planner.md``.
"""

from engine.plan.costmodel import MODES, Prediction, fit_skew, hit_rate, predict
from engine.plan.placement import LayerPlacement, Placement
from engine.plan.planner import (
    AUTO,
    MOE_CHOICES,
    PlanRequest,
    plan,
    resolve_kv_type,
    resolve_moe,
)
from engine.plan.profile import DeviceProfile
from engine.plan.sizing import KV_TYPES, DeviceBytes, PlanError, device_bytes, expert_slot_layout, kv_layer_bytes
from engine.plan.spec import DEFAULT_CTX_MAX, LayerSpec, ModelSpec, default_ctx
from engine.plan.units import format_size, parse_size

__all__ = [
    "DEFAULT_CTX_MAX",
    "default_ctx",
    "AUTO",
    "KV_TYPES",
    "MODES",
    "MOE_CHOICES",
    "DeviceBytes",
    "DeviceProfile",
    "LayerPlacement",
    "LayerSpec",
    "ModelSpec",
    "Placement",
    "PlanError",
    "PlanRequest",
    "Prediction",
    "device_bytes",
    "expert_slot_layout",
    "fit_skew",
    "format_size",
    "hit_rate",
    "kv_layer_bytes",
    "parse_size",
    "plan",
    "predict",
    "resolve_kv_type",
    "resolve_moe",
]
