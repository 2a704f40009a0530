"""What the graph-decode tests (tests/test_graph_decode.py, tests/triton/test_static_step.py) share: their
synthetic models and the placement with everything on the device."""

from __future__ import annotations

from engine.api import Session
from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout

# (name, arch, geometry): the synthetic models of the graph tests (seed 3, two layers)
ARCHS = [
    ("qwen3moe", "qwen3moe", {}),
    ("olmoe", "olmoe", {}),
    ("qwen2moe", "qwen2moe", {}),
    ("mixtral", "llama", {"experts": 4, "experts_used": 2}),
    ("llama", "llama", {}),
    ("qwen3", "qwen3", {}),
    ("qwen35moe", "qwen35moe", {"full_attn_interval": 2}),  # [GDN, attention]: the state updated in place
    ("qwen3next", "qwen3next", {"full_attn_interval": 2}),
    ("gpt-oss", "gpt-oss", {"sliding_window": 8}),  # windows, sinks, YaRN, biased experts with the clamped SwiGLU
]
CTX = 64


def whole(s: Session, kv_type: str = "f32", ctx: int = CTX):
    """Every layer, the KV cache and (MoE) every expert on the device: the graph's placement."""
    spec, L = s.spec, s.args.n_layer
    need = device_bytes(spec, n_gpu_layers=L, ctx=ctx, kv_type=kv_type, reserve=0).total
    slots = L * s.args.n_expert if s.args.is_moe else 0
    stride = expert_slot_layout(spec).stride if spec.n_expert else 0
    prof = DeviceProfile(vram_bytes=need + slots * stride, reserve_bytes=0)
    p = s.plan(PlanRequest(ctx=ctx, kv_type=kv_type, n_gpu_layers=L, moe="resident" if s.args.is_moe else "cpu"), prof)
    assert p.n_gpu_layers == L and p.moe_mode in ("resident", "none"), (p.layer_reason, p.moe_reason)
    return p
