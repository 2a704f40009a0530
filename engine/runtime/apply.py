"""Apply a planner ``Placement`` to a loaded model: one runtime for every combination.

Layers [0, G) get their trunk on the device (raw bytes as priced), layers [G, L) stay on the host
path; routed experts of device layers run per the mode — ``cpu`` (host kernels over the memory
map), ``cache`` (device slot pool + SLRU + CPU on a miss) or ``resident`` (the pool filled and
pinned) — except layers below ``n_cpu_moe``, whose experts stay on the host (and, where the placement
priced staging slots, stream to the device for long prompts: ``expert_stream``). Every device byte goes
through a :class:`DeviceArena` charged by the planner's kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import config
from engine.config import EngineOptions
from engine.experts import CpuExperts
from engine.kv_cache import KVCache
from engine.models.base import HOST, DecoderModel
from engine.models.layers import route
from engine.plan.placement import Placement
from engine.plan.sizing import HOST_KV_TYPE, expert_slot_layout, layer_slot_layout
from engine.plan.spec import ModelSpec
from engine.runtime import graph_decode
from engine.runtime.device import DeviceArena, DeviceWeights, embedding_rows
from engine.runtime.expert_cache import CachedExperts
from engine.runtime.expert_pool import Progress
from engine.runtime.expert_stream import StreamedExperts


@dataclass
class Applied:
    """What applying a placement built: the arena, the KV cache and the expert cache (if any)."""

    placement: Placement
    device: torch.device
    arena: DeviceArena | None
    cache: KVCache
    experts: CachedExperts | None
    graph: str = ""  # one-token steps wholly on the device: "CUDA graphs", "static, not captured" or ""
    options: EngineOptions | None = None  # the engine options it was applied with (None: config.current())
    stream: StreamedExperts | None = None  # long prompts' host experts computed on the device (if any)

    def describe(self) -> str:
        p = self.placement
        dev = "the simulated device (CPU)" if self.device.type == "cpu" else str(self.device)
        where = f"{p.n_gpu_layers}/{p.n_layer} layers on {dev}" if p.n_gpu_layers else "all layers on the CPU"
        step = f", one-token steps: {self.graph}" if self.graph else ""
        st = self.stream
        stream = f", prompts of ≥ {st.min_tokens} tokens stream host experts to the device" if st else ""
        policy = f", cache policy {self.experts.slots.name}" if self.experts and p.moe_mode == "cache" else ""
        mirror = self.experts.mirror if self.experts is not None else None
        if mirror is not None:
            policy += f" (its experts' host copy: {mirror.nbytes / 2**30:.1f} GiB of page-locked RAM)"
        return f"{where}, KV {p.kv_type}, experts {p.moe_mode} ({p.moe_reason}){policy}{stream}{step}"


def apply_placement(
    model: DecoderModel,
    spec: ModelSpec,
    placement: Placement,
    device: torch.device | str,
    upload: str = "async",
    options: EngineOptions | None = None,
    progress: Progress | None = None,
) -> Applied:
    """Reconfigure ``model`` for ``placement`` on ``device`` and return a fresh KV cache. ``options``: the
    engine options the device pieces follow (kernel choice, CUDA graphs, prompt uploads; default
    ``config.current()``); ``progress``: told of the slow part, the experts' page-locked host copy, layer by
    layer (``expert_pool.Progress``).

    Raises :class:`~engine.errors.DeviceMemoryError` when the device cannot hold it; the model is
    then left in an unspecified state and the caller re-applies the previous placement.
    """
    device = torch.device(device)
    a, p = model.args, placement
    L, G = a.n_layer, p.n_gpu_layers
    w = model.w
    model.decode_graph = None  # free the old graphs (and their hold on the old KV cache) first
    if G == 0:
        release_device(model)
        return Applied(p, device, None, model.new_cache(p.ctx, p.kv_type), None, options=options)
    host_experts = CpuExperts(model.expert_stacks(), q8_act=w.q8_act) if a.is_moe else None

    arena = DeviceArena(device, p.budget_bytes)
    arena.charge("reserve", p.device.reserve)  # driver/context slack and activations: priced, not
    arena.charge("scratch", p.device.scratch)  # allocated as tensors (torch's allocator holds them)
    trunk = DeviceWeights(w, arena, "trunk", options)
    layer_w = [trunk if i < G else w for i in range(L)]
    devices = [device if i < G else HOST for i in range(L)]
    backends = {i: host_experts for i in range(L)} if host_experts else {}
    cached = None
    cache_layers = {i for i in range(min(G, L)) if spec.layers[i].is_moe and i >= p.n_cpu_moe}
    if p.moe_mode in ("cache", "resident") and cache_layers and p.expert_slots_allocated:
        cached = CachedExperts(
            model.expert_stacks(),
            cache_layers,
            arena,
            expert_slot_layout(spec),
            p.expert_slots_allocated,
            q8_act=w.q8_act,
            upload=upload,
            options=options,
            layer_layouts={i: layer_slot_layout(spec, i) for i in cache_layers} if p.moe_mode == "resident" else None,
            mirror=model.host_mirror,
            progress=progress,
        )
        backends.update({i: cached for i in cache_layers})
    elif model.host_mirror is not None:  # no cache now: the previous placement's host copy goes
        model.host_mirror.close()
    model.host_mirror = cached.mirror if cached is not None else None
    # Device layers whose experts stay on the host: long prompts copy them to the staging slots priced.
    stream, min_tokens = None, (options if options is not None else config.current()).prompt_stream_min
    host_layers = {i for i in range(min(G, L)) if spec.layers[i].is_moe and backends.get(i) is host_experts}
    if p.stream_slots and min_tokens and host_layers:
        stream = StreamedExperts(
            host_experts,
            host_layers,
            arena,
            expert_slot_layout(spec),
            p.stream_slots,
            min_tokens,
            q8_act=w.q8_act,
            options=options,
        )
        backends.update({i: stream for i in host_layers})
    kv_layers = {i: (device if i < G else HOST) for i in range(L)}
    kv_types = {i: (p.kv_type if i < G else HOST_KV_TYPE) for i in range(L)}
    # The cache of a device layer (its K/V, or a linear-attention layer's fixed-size state) is charged as "kv".
    cache = model.make_cache(kv_layers, p.ctx, kv_types, charge=lambda i, n: arena.charge("kv", n) if i < G else None)
    model.profiler.clear_resident()
    globals_w = DeviceWeights(w, arena, "globals", options)
    model.configure(layer_w, devices, backends, globals_w if G >= L else w, rope_weights=globals_w)
    if cached is not None and p.moe_mode == "resident":
        cached.preload(pin=True)
    if cached is not None and p.moe_mode == "cache" and cached.prefetch_max > 0:
        order = sorted(cache_layers)
        cached.set_predictors({i: (n, _pre_gate(model, n)) for i, n in zip(order, order[1:])})
    model.device_embed = embedding_rows  # a prompt's embeddings made where its first layer runs
    # Everything of a decode step on the device: one-token steps replay a CUDA graph.
    model.decode_graph = g = graph_decode.for_placement(model, p, device, options)
    graph = "" if g is None else g.describe()
    return Applied(p, device, arena, cache, cached, graph, options, stream)


def release_device(model: DecoderModel) -> None:
    """Every layer of ``model`` back on the host path (host weights, routed experts over the memory map) and its
    decode graphs dropped: the model then holds nothing of a device placement but the experts' page-locked host
    copy (``model.host_mirror``), which the next cache or resident placement reuses."""
    model.decode_graph = None
    L, w = model.args.n_layer, model.w
    host = CpuExperts(model.expert_stacks(), q8_act=w.q8_act) if model.args.is_moe else None
    model.configure([w] * L, [HOST] * L, {i: host for i in range(L)} if host else {}, w)
    model.profiler.clear_resident()


def _pre_gate(model: DecoderModel, n: int):
    """Layer ``n``'s router and routing applied to the input of the MoE layer before it (pre-gating)."""

    def routing(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = model.layers[n].moe
        return route(moe.router(x), moe.routing)

    return routing
