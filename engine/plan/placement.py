"""The planner's output: a Placement (layer ranges, device bytes, expert budget and mode, predicted
tok/s) and its per-layer LayerPlacement rows, with the JSON form ``sharpi plan --json`` prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.plan.costmodel import Prediction
from engine.plan.profile import DeviceProfile
from engine.plan.sizing import HOST_KV_TYPE, DeviceBytes


@dataclass(frozen=True)
class LayerPlacement:
    """One layer: where its trunk and its routed experts live, and its bytes.

    device: "gpu" | "cpu". experts: "cpu" | "cache" | "resident" | "none" (dense layer).
    components: trunk bytes by component. kv_bytes: this layer's K+V at kv_type.
    routed_bytes: all its routed experts (they stay in the host memory map in every mode).
    """

    index: int
    device: str
    experts: str
    trunk_bytes: int
    components: dict[str, int]
    kv_bytes: int
    kv_type: str
    routed_bytes: int


@dataclass(frozen=True)
class Placement:
    """The plan: layer ranges, device bytes, expert budget, expert mode and why, predictions."""

    model: str
    arch: str
    n_layer: int
    n_gpu_layers: int
    layer_reason: str
    ctx: int
    kv_type: str
    kv_bytes: int  # device-resident KV
    host_kv_bytes: int
    budget_bytes: int
    device: DeviceBytes
    host_bytes: int
    expert_cache_budget_bytes: int  # device bytes left after trunk, KV, output, reserve, scratch
    expert_slot_bytes: int  # stride of one slot
    expert_slot_role_bytes: dict[str, int]
    expert_slots: int  # slots the budget affords (capped at expert_slots_needed)
    expert_slots_needed: int  # every expert of the device layers past n_cpu_moe
    expert_slots_allocated: int  # slots of the chosen mode's pool (0 for cpu)
    routed_expert_bytes: int
    n_cpu_moe: int
    moe_mode: str
    moe_reason: str
    moe_source: str
    position: int
    predictions: dict[str, Prediction | None]
    recommended_ctx: int | None
    layers: tuple[LayerPlacement, ...]
    notes: tuple[str, ...] = ()
    profile: DeviceProfile = field(default_factory=DeviceProfile)
    resident_split: int | None = None  # the split the resident prediction places (None: no device layer's experts fit)
    asked_n_cpu_moe: int = 0  # the request's n_cpu_moe (a resident split may keep more layers' experts on the CPU)
    stream_slots: int = 0  # prompt-streaming staging slots (device.stream bytes); 0: long prompts stay on the CPU
    request: Any = None  # the engine.plan.PlanRequest it answers (a re-plan asks it again with other speeds)

    @property
    def gpu_layers(self) -> tuple[int, int]:
        """[start, stop) of the device-resident layers."""
        return (0, self.n_gpu_layers)

    @property
    def cpu_layers(self) -> tuple[int, int]:
        return (self.n_gpu_layers, self.n_layer)

    @property
    def expert_capacity(self) -> float:
        """Affordable slots ÷ needed slots: the sibling's auto-rule ratio."""
        return self.expert_slots / self.expert_slots_needed if self.expert_slots_needed else 0.0

    @property
    def predicted_tok_s(self) -> dict[str, float | None]:
        return {m: (None if p is None else _finite(p.tok_s)) for m, p in self.predictions.items()}

    @property
    def device_total_bytes(self) -> int:
        return self.device.total

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the form ``sharpi plan --json`` prints and the GUI reads)."""
        chosen = self.predictions.get(self.moe_mode)
        return {
            "model": self.model,
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_gpu_layers": self.n_gpu_layers,
            "gpu_layers": list(self.gpu_layers),
            "cpu_layers": list(self.cpu_layers),
            "layer_reason": self.layer_reason,
            "ctx": self.ctx,
            "recommended_ctx": self.recommended_ctx,
            "kv_type": self.kv_type,
            "kv_bytes": self.kv_bytes,
            "host_kv_bytes": self.host_kv_bytes,
            "host_kv_type": HOST_KV_TYPE,
            "budget_bytes": self.budget_bytes,
            "device_bytes": self.device.to_dict(),
            "device_total_bytes": self.device.total,
            "free_bytes": self.budget_bytes - self.device.total,
            "host_bytes": self.host_bytes,
            "expert_cache_budget_bytes": self.expert_cache_budget_bytes,
            "expert_slot_bytes": self.expert_slot_bytes,
            "expert_slot_role_bytes": dict(self.expert_slot_role_bytes),
            "expert_slots": self.expert_slots,
            "expert_slots_needed": self.expert_slots_needed,
            "expert_slots_allocated": self.expert_slots_allocated,
            "expert_capacity": self.expert_capacity,
            "routed_expert_bytes": self.routed_expert_bytes,
            "n_cpu_moe": self.n_cpu_moe,
            "stream_slots": self.stream_slots,
            "moe_mode": self.moe_mode,
            "moe_reason": self.moe_reason,
            "moe_source": self.moe_source,
            "predicted_tok_s": self.predicted_tok_s,
            "predicted_hit_rate": None if chosen is None else chosen.hit_rate,
            "prediction_position": self.position,
            "predictions": {
                m: None
                if p is None
                else {
                    "tok_s": _finite(p.tok_s),
                    "seconds": p.seconds,
                    "hit_rate": p.hit_rate,
                    "bytes_by_link": dict(p.bytes_by_link),
                    "seconds_by_link": dict(p.seconds_by_link),
                    "overhead_counts": dict(p.overhead_counts),
                }
                for m, p in self.predictions.items()
            },
            "profile": self.profile.to_dict(),
            "notes": list(self.notes),
            "layers": [
                {
                    "index": lay.index,
                    "device": lay.device,
                    "experts": lay.experts,
                    "trunk_bytes": lay.trunk_bytes,
                    "components": dict(lay.components),
                    "kv_bytes": lay.kv_bytes,
                    "kv_type": lay.kv_type,
                    "routed_bytes": lay.routed_bytes,
                }
                for lay in self.layers
            ],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _finite(x: float) -> float | None:
    return x if x == x and x not in (float("inf"), float("-inf")) else None
