"""plan(): a pure function from (ModelSpec, DeviceProfile, PlanRequest) to a Placement.

No GPU, no allocation, no environment reads (``resolve_moe`` / ``resolve_kv_type`` turn flags and
the environment's options, ``engine.config.EngineOptions``, into a request first), so a dragging
slider can call it on every movement.

Steps: (1) the device layer prefix — the most layers whose trunk + KV + output + reserve + scratch
fit (``-g -1``), or exactly ``-g N``; (2) the expert-cache budget — what is left, in bytes and in
fixed-stride slots; (3) the decode cost of each expert mode (``costmodel.predict``); (4) the mode:
the override if one was given, else the fastest prediction (a cache must beat CPU experts by
:data:`AUTO_CACHE_MARGIN`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ENV_CPU_MOE
from engine.kv_layout import resolve_kv_type  # re-exported by engine.plan
from engine.plan.costmodel import CACHE, CPU, MODES, RESIDENT, Prediction, predict
from engine.plan.placement import LayerPlacement, Placement
from engine.plan.profile import DeviceProfile
from engine.plan.sizing import (
    HOST_KV_TYPE,
    KV_TYPES,
    STREAM_MIN_CHUNK,
    STREAM_SPLIT_CHUNK,
    DeviceBytes,
    PlanError,
    cache_bytes,
    check_kv_geometry,
    check_kv_type,
    device_bytes,
    expert_slot_layout,
    host_bytes,
    layer_cache_bytes,
    resident_expert_bytes,
    stream_slots,
)
from engine.plan.spec import ModelSpec
from engine.plan.units import format_size

AUTO = "auto"
NONE = "none"  # dense model: no routed experts
MOE_CHOICES: tuple[str, ...] = (AUTO, *MODES)
# A cache must be predicted this much faster than CPU experts to be chosen automatically: CPU
# experts need no warm-up and do not depend on the prompt's routing, the cache does.
AUTO_CACHE_MARGIN = 1.10
CTX_STEP = 256  # recommended contexts are multiples of this


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for.

    ctx: context length (tokens) the KV cache holds. kv_type: f32 | bf16 | q8_0; None: the default
    (``DEFAULT_KV_TYPE``; ``Session.plan``: the session's).
    n_gpu_layers: -1 = as many as fit, N = layers 0..N-1 on the device (N > n_layer = all).
    moe: auto | cpu | cache | resident; moe_source names what set a non-auto value (shown in the
    reason; an environment override falls back quietly when impossible, a flag is an error).
    n_cpu_moe: routed experts of layers 0..N-1 stay on the host whatever the mode.
    position: decode position the tok/s prediction is for (None = ctx // 2).
    cuda_graphs: whether one-token steps run as CUDA graphs where every layer is on the device (the
    runtime's default; False when ``EngineOptions.cuda_graph`` is "off" — ``Session.plan`` fills it in
    from its options when None); None plans with graphs.
    prompt_stream: whether long prompts stream the host experts of device layers to the device
    (``EngineOptions.prompt_stream_min`` > 0; ``Session.plan`` fills it in when None); None plans with it.
    bus_misses: whether the expert cache's decode misses are computed on the device over the bus
    (``EngineOptions.cache_misses``, ``expert_pool.misses_over_bus``; ``Session.plan`` fills it in when None);
    None plans them on the CPU.
    """

    ctx: int = 4096
    kv_type: str | None = None
    n_gpu_layers: int = -1
    moe: str = AUTO
    moe_source: str = ""
    n_cpu_moe: int = 0
    position: int | None = None
    cuda_graphs: bool | None = None
    prompt_stream: bool | None = None
    bus_misses: bool | None = None


def resolve_moe(moe: str = AUTO, cpu_moe: bool = False, env_cpu_moe: bool | None = None) -> tuple[str, str]:
    """(mode, source) from ``--moe``, ``--cpu-moe`` and ``SHARPI_CPU_MOE`` (``env_cpu_moe``:
    ``EngineOptions.cpu_moe``).

    Precedence: an explicit ``--moe`` mode or ``--cpu-moe`` (they must agree), then the
    environment (``1`` → cpu, ``0`` → cache), then auto. Raises :class:`PlanError` for a conflict
    or an unknown value.
    """
    if moe not in MOE_CHOICES:
        raise PlanError(f"unknown expert mode {moe!r} (choose one of: {', '.join(MOE_CHOICES)})")
    if cpu_moe:
        if moe not in (AUTO, CPU):
            raise PlanError(f"--cpu-moe contradicts --moe {moe}")
        return CPU, "--cpu-moe"
    if moe != AUTO:
        return moe, "--moe"
    if env_cpu_moe is None:
        return AUTO, ""
    return (CPU, f"{ENV_CPU_MOE}=1") if env_cpu_moe else (CACHE, f"{ENV_CPU_MOE}=0")


def _check_request(req: PlanRequest) -> None:
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(req.ctx) or req.ctx <= 0:
        raise PlanError(f"context length must be a positive integer, got {req.ctx!r}")
    if req.kv_type is not None and req.kv_type not in KV_TYPES:
        check_kv_type(req.kv_type)
    if not is_int(req.n_gpu_layers) or req.n_gpu_layers < -1:
        raise PlanError(f"n_gpu_layers must be -1 (auto) or a layer count >= 0, got {req.n_gpu_layers!r}")
    if req.moe not in MOE_CHOICES:
        raise PlanError(f"unknown expert mode {req.moe!r} (choose one of: {', '.join(MOE_CHOICES)})")
    if not is_int(req.n_cpu_moe) or req.n_cpu_moe < 0:
        raise PlanError(f"n_cpu_moe must be a layer count >= 0, got {req.n_cpu_moe!r}")
    if req.position is not None and (not is_int(req.position) or req.position < 0):
        raise PlanError(f"prediction position must be >= 0, got {req.position!r}")


def _max_prefix(fits, hi: int) -> int:
    """Largest n in [0, hi] with fits(n), for a monotone predicate with fits(0) true."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan(spec: ModelSpec, profile: DeviceProfile, request: PlanRequest) -> Placement:
    """Place ``spec`` on ``profile`` as ``request`` asks. Pure; raises :class:`PlanError` for an
    impossible or malformed request (never returns a negative byte count)."""
    _check_request(request)
    L, ctx, kv = spec.n_layer, request.ctx, resolve_kv_type(request.kv_type)
    budget = profile.vram_bytes
    notes: list[str] = []
    if request.n_gpu_layers != 0:
        check_kv_geometry(kv, spec.kv_dim)
    if ctx > spec.n_ctx_train:
        notes.append(f"context {ctx} exceeds the model's training context {spec.n_ctx_train}")

    def dev(n: int, slots: int = 0, c: int = ctx, expert_bytes: int | None = None, stream: int = 0) -> DeviceBytes:
        return device_bytes(
            spec,
            n_gpu_layers=n,
            ctx=c,
            kv_type=kv,
            expert_slots=slots,
            reserve=profile.reserve_bytes,
            scratch=profile.scratch_bytes,
            expert_bytes=expert_bytes,
            stream_slots=stream,
        )

    # (1) Device layers: a contiguous prefix.
    def fits(n: int) -> bool:
        return dev(n).total <= budget

    if request.n_gpu_layers == -1:
        n = _max_prefix(fits, L)
        layer_reason = _layer_reason(spec, profile, dev, n)
    else:
        n = min(request.n_gpu_layers, L)
        if not fits(n):
            max_fit = _max_prefix(fits, n)
            raise PlanError(
                f"-g {request.n_gpu_layers} needs {format_size(dev(n).total)} of device memory "
                f"({n} layers at context {ctx}, KV {kv}) but the budget is {format_size(budget)}; "
                f"at most {max_fit} layers fit (use -g -1, a smaller context or a narrower KV type)"
            )
        layer_reason = f"-g {request.n_gpu_layers} as requested" + (
            f" ({n} layers)" if n != request.n_gpu_layers else ""
        )

    # (2) Expert budget: what is left, in bytes and in cache slots; the resident split.
    base = dev(n)
    left = budget - base.total
    assert left >= 0, (budget, base)
    asked_cpu_moe = min(request.n_cpu_moe, L)
    layout = expert_slot_layout(spec)

    def needed_from(k: int) -> int:  # experts of the device layers k..n-1
        return sum(lay.n_expert for lay in spec.layers[k:n] if lay.is_moe)

    def resident_from(k: int) -> int:  # their bytes, resident at each layer's own stride
        return resident_expert_bytes(spec, range(k, n))

    needed = needed_from(asked_cpu_moe)
    fit = min(left // layout.stride, needed) if layout.stride and n else 0
    # The smallest split whose experts of the layers above it all fit resident (llama.cpp's
    # --n-cpu-moe N, at the best N): layers below it keep their experts on the CPU.
    # With prompt streaming on, the split leaves room for a staging of two chunks of STREAM_SPLIT_CHUNK
    # experts, through which long prompts run its CPU layers' experts on the device.
    split = None
    if spec.is_moe and n and needed:
        E = max(lay.n_expert for lay in spec.layers)
        keep = 0 if request.prompt_stream is False else 2 * min(E, STREAM_SPLIT_CHUNK) * layout.stride
        top = n - asked_cpu_moe  # layers that may hold resident experts
        j = _max_prefix(lambda j: resident_from(n - j) <= left, top)
        if j < n:  # some device layer keeps its experts on the CPU: leave the staging room
            j = _max_prefix(lambda j: resident_from(n - j) + keep <= left, top)
        split = n - j
        if needed_from(split) == 0:
            split = None

    # (3) Predictions, (4) mode.
    position = ctx // 2 if request.position is None else request.position

    def cost(mode: str, slots: int = 0, cpu_moe: int = asked_cpu_moe) -> Prediction:
        return predict(
            spec,
            profile,
            mode=mode,
            n_gpu_layers=n,
            kv_type=kv,
            position=position,
            expert_slots=slots,
            n_cpu_moe=cpu_moe,
            graphs=request.cuda_graphs is not False,
            bus_misses=bool(request.bus_misses),
        )

    if not spec.is_moe:
        preds: dict[str, Prediction | None] = {NONE: cost(CPU)}
        mode, reason, source = NONE, "dense model: no routed experts", ""
        n_cpu_moe = asked_cpu_moe
    else:
        preds = {
            CPU: cost(CPU),
            CACHE: cost(CACHE, fit) if fit else None,
            RESIDENT: cost(RESIDENT, needed_from(split), split) if split is not None else None,
        }
        mode, reason, source = _choose_mode(
            request, preds, fit, needed, n, asked_cpu_moe, split, left, layout.stride, L
        )
        n_cpu_moe = split if mode == RESIDENT else asked_cpu_moe
    allocated = {CACHE: fit, RESIDENT: needed_from(n_cpu_moe)}.get(mode, 0)
    pool_bytes = resident_from(n_cpu_moe) if mode == RESIDENT else None
    final = dev(n, allocated, expert_bytes=pool_bytes)
    n_stream = _stream_slots(spec, request, n, n_cpu_moe, mode, budget - final.total, layout.stride, notes)
    final = dev(n, allocated, expert_bytes=pool_bytes, stream=n_stream)
    assert final.total <= budget, (final, budget)

    layers = tuple(_layer_placement(spec, i, n, n_cpu_moe, mode, kv, ctx) for i in range(L))
    return Placement(
        model=spec.name,
        arch=spec.arch,
        n_layer=L,
        n_gpu_layers=n,
        layer_reason=layer_reason,
        ctx=ctx,
        kv_type=kv,
        kv_bytes=final.kv,
        host_kv_bytes=cache_bytes(spec, range(n, L), HOST_KV_TYPE, ctx),
        budget_bytes=budget,
        device=final,
        host_bytes=host_bytes(spec, n_gpu_layers=n, ctx=ctx),
        expert_cache_budget_bytes=left if n and needed else 0,
        expert_slot_bytes=layout.stride,
        expert_slot_role_bytes=dict(layout.role_bytes),
        expert_slots=fit,
        expert_slots_needed=needed,
        expert_slots_allocated=allocated,
        routed_expert_bytes=spec.routed_bytes,
        n_cpu_moe=n_cpu_moe,
        moe_mode=mode,
        moe_reason=reason,
        moe_source=source,
        position=position,
        predictions=preds,
        recommended_ctx=_recommended_ctx(spec, budget, dev, kv),
        layers=layers,
        notes=tuple(notes),
        profile=profile,
        resident_split=split,
        asked_n_cpu_moe=asked_cpu_moe,
        stream_slots=n_stream,
        request=request,
    )


def _stream_slots(
    spec: ModelSpec, req: PlanRequest, n: int, n_cpu_moe: int, mode: str, room: int, stride: int, notes: list[str]
) -> int:
    """Staging slots for long prompts to stream the host experts of device layers (``--moe cpu``, the first
    ``n_cpu_moe`` layers) to the device, from the bytes left after the chosen mode; a note either way."""
    streamed = [i for i in range(n) if spec.layers[i].is_moe and (mode == CPU or i < n_cpu_moe)]
    if not streamed or req.prompt_stream is False:
        return 0
    E = max(spec.layers[i].n_expert for i in streamed)
    got = stream_slots(E, room, stride)
    if got:
        notes.append(
            f"long prompts stream the host experts of {len(streamed)} device layers to the device through "
            f"{got} staging slots ({format_size(got * stride)}, {got // 2} experts at a time)"
        )
    else:
        notes.append(
            f"long prompts run the host experts of {len(streamed)} device layers on the CPU: streaming them to "
            f"the device needs {format_size(2 * min(E, STREAM_MIN_CHUNK) * stride)} of staging, "
            f"{format_size(room)} is left"
        )
    return got


def _layer_reason(spec: ModelSpec, profile: DeviceProfile, dev, n: int) -> str:
    L, budget = spec.n_layer, profile.vram_bytes
    if n == L:
        return f"all {L} layers fit"
    need = dev(n + 1).total
    if n > 0:
        return (
            f"{n} of {L} layers fit: layer {n} would bring the device to {format_size(need)}, "
            f"over the {format_size(budget)} budget"
        )
    one = dev(1)
    if budget < one.reserve + one.scratch:
        return (
            f"CPU only: the budget {format_size(budget)} does not cover the reserve "
            f"{format_size(one.reserve)} and scratch {format_size(one.scratch)}"
        )
    return (
        f"CPU only: the budget {format_size(budget)} is too small for one layer "
        f"(needs {format_size(need)}: reserve + scratch + layer 0 trunk and KV" + (" + output" if L == 1 else "") + ")"
    )


def _choose_mode(
    req: PlanRequest,
    preds,
    fit: int,
    needed: int,
    n: int,
    n_cpu_moe: int,
    split: int | None,
    left: int,
    stride: int,
    L: int,
):
    """(mode, reason, source) — the override if given and possible, else the fastest prediction.

    ``split``: the smallest layer count N >= ``n_cpu_moe`` whose device layers from N up hold every
    expert resident (None: no device layer's experts fit); mode ``resident`` places that split.
    """
    cpu, cache, res = preds[CPU], preds[CACHE], preds[RESIDENT]
    capacity = fit / needed if needed else 0.0

    def why_none() -> str:
        if n == 0:
            return "no layer is on the device"
        if needed == 0:
            return f"the first {n_cpu_moe} layers keep their experts on the CPU (--n-cpu-moe) and no other device layer has experts"
        return f"the {format_size(left)} left on the device is less than one {format_size(stride)} expert slot"

    def res_label() -> str:
        return "resident" if split == n_cpu_moe else f"resident from layer {split} (layers 0-{split - 1} on the CPU)"

    def cmp() -> str:
        parts = [f"CPU experts {cpu.tok_s:.1f}"]
        if cache is not None:
            parts.append(
                f"cache {cache.tok_s:.1f} ({fit} of {needed} experts = {capacity:.0%}, predicted hit rate {cache.hit_rate:.0%})"
            )
        if res is not None:
            parts.append(f"{res_label()} {res.tok_s:.1f}")
        return "predicted tok/s: " + ", ".join(parts)

    if req.moe != AUTO:
        src = req.moe_source or "--moe"
        soft = src.startswith(ENV_CPU_MOE)
        if req.moe == CPU:
            return CPU, f"CPU experts: set by {src}; {cmp()}", src
        if req.moe == CACHE:
            if cache is None:
                if soft:
                    return CPU, f"CPU experts: {src} asks for a GPU cache but {why_none()}", src
                raise PlanError(f"--moe cache is impossible: {why_none()}")
            return CACHE, f"GPU expert cache: set by {src}; {cmp()}", src
        if res is None:
            raise PlanError(f"--moe resident is impossible: {why_none()}")
        if split == n_cpu_moe:
            return RESIDENT, f"all experts resident: set by {src}; {cmp()}", src
        return (
            RESIDENT,
            f"experts resident from layer {split}: set by {src}, and the experts of layers {n_cpu_moe}-{split - 1} "
            f"do not fit in the {format_size(left)} left, so they stay on the CPU; {cmp()}",
            src,
        )

    if cache is None and res is None:
        return CPU, f"CPU experts: {why_none()}", ""
    # The fastest option that does not depend on the prompt's routing: CPU experts or a resident split.
    steady = res if res is not None and res.tok_s >= cpu.tok_s else cpu
    if cache is not None and cache.tok_s >= AUTO_CACHE_MARGIN * steady.tok_s:
        return CACHE, f"GPU expert cache is predicted fastest; {cmp()}", ""
    if steady is res:
        if split == n_cpu_moe:
            return RESIDENT, f"all {needed} experts of the device layers fit: resident; {cmp()}", ""
        return RESIDENT, f"experts resident from layer {split} is predicted fastest; {cmp()}", ""
    if cache is None:
        return CPU, f"CPU experts are predicted fastest; {cmp()}", ""
    gain = cache.tok_s / cpu.tok_s - 1
    why = "slower" if gain < 0 else f"only {gain:.0%} faster (< {AUTO_CACHE_MARGIN - 1:.0%} margin)"
    return CPU, f"CPU experts: a {capacity:.0%} GPU cache is predicted {why}; {cmp()}", ""


def _layer_placement(spec: ModelSpec, i: int, n: int, n_cpu_moe: int, mode: str, kv: str, ctx: int) -> LayerPlacement:
    lay = spec.layers[i]
    on_dev = i < n
    if not lay.is_moe:
        experts = NONE
    elif not on_dev or i < n_cpu_moe:
        experts = CPU
    else:
        experts = mode
    layer_kv = kv if on_dev else HOST_KV_TYPE
    return LayerPlacement(
        index=i,
        device="gpu" if on_dev else "cpu",
        experts=experts,
        trunk_bytes=lay.trunk_bytes,
        components=dict(lay.trunk),
        kv_bytes=layer_cache_bytes(spec, i, layer_kv, ctx),
        kv_type=layer_kv,
        routed_bytes=lay.routed_bytes,
    )


def _recommended_ctx(spec: ModelSpec, budget: int, dev, kv_type: str) -> int | None:
    """Largest context (a multiple of CTX_STEP, at most the training context) at which every layer
    fits on the device with the requested KV type; None if none does (or the KV type cannot be
    used on the device)."""
    try:
        check_kv_geometry(kv_type, spec.kv_dim)
    except PlanError:
        return None
    top = spec.n_ctx_train
    if top < CTX_STEP:
        return top if dev(spec.n_layer, c=top).total <= budget else None
    k = _max_prefix(lambda k: dev(spec.n_layer, c=k * CTX_STEP).total <= budget, top // CTX_STEP)
    return k * CTX_STEP if k else None
