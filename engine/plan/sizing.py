"""The one sizing function: what a placement allocates on the device, byte for byte.

The planner prices placements with :func:`device_bytes`; the runtime allocates through the same
functions (KV rows, expert-slot stride, scratch estimate), and a test pins the two together, so
they cannot drift. Accounting rules (see ``docs/planner.md``):

- a device-resident layer holds its trunk tensors (attention q/k/v/o, norms, biases, router,
  shared expert and its gate, dense FFN) and its cache (:func:`layer_cache_bytes`): K and V,
  ``2 × ctx × kv_row_bytes`` (a sliding-window layer: ``2 × kv_rows(ctx, window) × kv_row_bytes``, its window and
  a slack in a ring), or a linear-attention layer's fixed-size recurrent state, whatever the context;
  routed experts (``ffn_*_exps``) are never part of a layer: they live in the expert-slot pool;
- the expert-slot pool of a cache is ``slots × stride``; a slot holds one expert's gate, up and down
  matrices, each role sized for the largest over all layers and aligned to :data:`SLOT_ALIGN` (a slot
  serves any layer); resident experts never move, so each layer's are packed at that layer's own
  stride (:func:`layer_slot_layout`, :func:`resident_expert_bytes`) — a file that mixes types across
  layers (Q4_K_M's Q6_K ``ffn_down`` in some layers) wastes no bytes on the largest;
- ``token_embd`` stays on the host (only the looked-up rows are used; one row is uploaded per
  token); the output norm and output matrix (``token_embd`` when tied) are on the device when the
  last layer is; ``rope_freqs`` is on the device when any layer is;
- the prompt-streaming staging pool (``engine.runtime.expert_stream``) is ``stream_slots × stride``,
  two halves laid out like the slot pool, for device layers whose experts stay on the host;
- a device with no layer holds nothing: reserve and scratch are charged only when it is used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.errors import PlanError
from engine.kv_layout import (  # noqa: F401  (re-exported: the planner's sizing vocabulary)
    HOST_KV_TYPE,
    KV_TYPES,
    check_kv_geometry,
    check_kv_type,
    kv_layer_bytes,
    kv_row_bytes,
    kv_rows,
)
from engine.models.layers import ATTN_SCORE_BYTES, DELTA_CHUNK
from engine.plan.spec import ROLES, ModelSpec

SLOT_ALIGN = 256  # bytes; each role's matrix in a slot starts on this boundary
DEFAULT_UBATCH = 512  # tokens per prefill micro-batch the scratch estimate covers
# Prompt streaming's smallest useful half (experts copied and computed at a time): below it the per-chunk
# launches and host syncs outweigh the copy (a 512-token prompt's layer would be 16 chunks or more).
STREAM_MIN_CHUNK = 8
# Experts per half of the staging a resident split keeps free for long prompts (when prompt streaming is on):
# the split's CPU layers stream through it in chunks of this many experts, copies overlapped with compute.
STREAM_SPLIT_CHUNK = 16


@dataclass(frozen=True)
class SlotLayout:
    """Where each role of an expert sits inside a fixed-stride device slot.

    role_offset / role_bytes: {role: byte offset / capacity}; stride: bytes per slot.
    """

    role_offset: dict[str, int]
    role_bytes: dict[str, int]
    stride: int


def _align(n: int, a: int = SLOT_ALIGN) -> int:
    return -(-n // a) * a


def _slot_layout(role_bytes: dict[str, int]) -> SlotLayout:
    """Roles of one expert, each aligned to SLOT_ALIGN, in ROLES order (roles of 0 bytes left out)."""
    off, offsets, sizes = 0, {}, {}
    for r in ROLES:
        b = role_bytes.get(r, 0)
        if b:
            offsets[r], sizes[r] = off, b
            off += _align(b)
    return SlotLayout(offsets, sizes, off)


def expert_slot_layout(spec: ModelSpec) -> SlotLayout:
    """Slot geometry: per role the largest one-expert matrix over layers, aligned, in ROLES order."""
    return _slot_layout(spec.expert_role_max)


def layer_slot_layout(spec: ModelSpec, layer: int) -> SlotLayout:
    """One layer's own slot geometry: its roles' bytes, aligned, in ROLES order (a resident layer's
    experts sit at this stride; :func:`expert_slot_layout` is the largest over layers)."""
    return _slot_layout(spec.layers[layer].expert_role_bytes)


def resident_expert_bytes(spec: ModelSpec, layers) -> int:
    """Device bytes of every routed expert of ``layers`` held resident: per layer ``n_expert`` experts
    at the layer's own stride (:func:`layer_slot_layout`)."""
    return sum(spec.layers[i].n_expert * layer_slot_layout(spec, i).stride for i in layers if spec.layers[i].is_moe)


def scratch_estimate(spec: ModelSpec, ctx: int, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """Device scratch for one layer's forward over a micro-batch of ``n_ubatch`` tokens, f32.

    Per token: residual and normed hidden (2·D), q and the attention output (2·Hq·hd), k and v
    (2·kv_dim), router logits (E), the widest FFN path's temporaries — routed: per expert used, gate,
    up and their product (3·F_exp) and the expert's output and its weighted copy (2·D); dense:
    3·F_dense + 2·D; plus the attention scores of one block of queries (scores, masked scores and
    probabilities, each at most ``ATTN_SCORE_BYTES``, or all heads × micro-batch × context if
    smaller) and one row of logits (V). A Gated DeltaNet layer (where the model has them) needs, per
    token, its conv input, window and output (3·C), the gate z, q and k over the value heads, v, o and
    the normed o (≈ 6·inner), and per value head its chunked delta rule's four [chunk × chunk] matrices
    per chunk (``layers.gated_delta_chunked``); the larger of the two mixers is counted. A runtime that
    needs more must grow this formula, not work around it.
    """
    D, K = spec.n_embd, spec.n_expert_used
    ffn = max(K * (3 * spec.n_ff_exp + 2 * D), 3 * spec.n_ff_dense + 2 * D)
    per_token = 2 * D + 2 * spec.q_dim + 2 * spec.kv_dim + spec.n_expert + ffn
    scores = min(ATTN_SCORE_BYTES, 4 * spec.n_head * n_ubatch * ctx)
    gdn = 0
    if spec.ssm_heads:
        chunks = -(-n_ubatch // DELTA_CHUNK) * DELTA_CHUNK
        gdn = (
            4 * n_ubatch * (3 * spec.ssm_conv_dim + 6 * spec.ssm_inner) + 4 * 4 * spec.ssm_heads * chunks * DELTA_CHUNK
        )
    return 4 * (n_ubatch * per_token + spec.n_vocab) + max(3 * scores, gdn)


def layer_cache_bytes(spec: ModelSpec, layer: int, kv_type: str, ctx: int) -> int:
    """Layer ``layer``'s cache: its K and V at ``ctx`` positions in ``kv_type`` — a sliding-window layer's at the
    positions of its ring (``kv_rows``: its window and a slack), whatever the context — or (a Gated DeltaNet layer)
    its recurrent state, float32 and the same at every context."""
    lay = spec.layers[layer]
    return kv_layer_bytes(kv_type, spec.kv_dim, kv_rows(ctx, lay.kv_window)) if lay.has_kv else lay.state_bytes


def cache_bytes(spec: ModelSpec, layers, kv_type: str, ctx: int) -> int:
    """:func:`layer_cache_bytes` summed over ``layers``."""
    return sum(layer_cache_bytes(spec, i, kv_type, ctx) for i in layers)


def global_device_bytes(spec: ModelSpec, n_gpu_layers: int) -> int:
    """Model-level tensors on the device for a prefix of ``n_gpu_layers`` layers."""
    if n_gpu_layers <= 0:
        return 0
    b = spec.rope_freqs_bytes
    if n_gpu_layers >= spec.n_layer:
        b += spec.output_norm_bytes + spec.output_bytes
    return b


@dataclass(frozen=True)
class DeviceBytes:
    """Device allocation of a placement, by kind. ``total`` is what must fit the VRAM budget."""

    reserve: int  # driver context, library workspaces, allocator slack (from the profile)
    scratch: int  # activations (see scratch_estimate)
    trunk: int  # trunk tensors of the device-resident layers
    kv: int  # caches of the device-resident layers: K and V, or a linear-attention layer's state
    globals: int  # output norm + output matrix (if the last layer is resident), rope factors
    experts: int  # expert pool: cache slots × stride, or resident layers' experts at their own strides
    stream: int = 0  # prompt-streaming staging slots × stride (host experts of device layers, long prompts)

    @property
    def total(self) -> int:
        return self.reserve + self.scratch + self.trunk + self.kv + self.globals + self.experts + self.stream

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def device_bytes(
    spec: ModelSpec,
    *,
    n_gpu_layers: int,
    ctx: int,
    kv_type: str,
    expert_slots: int = 0,
    reserve: int = 0,
    scratch: int | None = None,
    expert_bytes: int | None = None,
    stream_slots: int = 0,
) -> DeviceBytes:
    """Bytes the runtime allocates on the device for this placement.

    n_gpu_layers: layers 0..n-1 on the device (clamped to the model); 0 allocates nothing.
    scratch: bytes of activation scratch, ``None`` for :func:`scratch_estimate` at ``ctx``.
    expert_bytes: the expert pool's bytes when they are not ``expert_slots × stride`` (resident
    experts: :func:`resident_expert_bytes`).
    stream_slots: slots of the prompt-streaming staging pool (:func:`stream_slots`).
    Raises :class:`PlanError` for an unknown KV type or a q8_0 cache of an incompatible width.
    """
    n = max(0, min(n_gpu_layers, spec.n_layer))
    if n == 0:
        if expert_slots or expert_bytes or stream_slots:
            raise PlanError("an expert cache needs at least one device-resident layer")
        return DeviceBytes(0, 0, 0, 0, 0, 0)
    return DeviceBytes(
        reserve=reserve,
        scratch=scratch_estimate(spec, ctx) if scratch is None else scratch,
        trunk=spec.trunk_prefix[n],
        kv=cache_bytes(spec, range(n), kv_type, ctx),
        globals=global_device_bytes(spec, n),
        experts=expert_slots * expert_slot_layout(spec).stride if expert_bytes is None else expert_bytes,
        stream=stream_slots * expert_slot_layout(spec).stride,
    )


def stream_slots(n_expert: int, room: int, stride: int) -> int:
    """Slots of the prompt-streaming staging pool that ``room`` device bytes afford: two halves of up to
    ``n_expert`` slots (a whole layer's experts per half: one layer computes while the next copies), fewer
    when the room is short, 0 when not even two halves of ``min(n_expert, STREAM_MIN_CHUNK)`` fit."""
    if n_expert <= 0 or stride <= 0:
        return 0
    half = min(n_expert, room // (2 * stride))
    return 2 * half if half >= min(n_expert, STREAM_MIN_CHUNK) else 0


def host_bytes(spec: ModelSpec, *, n_gpu_layers: int, ctx: int) -> int:
    """Host memory the model needs when warm: embeddings, host layers' trunk and f32 KV, the
    output if it stays on the host, and every routed expert (read from the memory map)."""
    n = max(0, min(n_gpu_layers, spec.n_layer))
    b = spec.token_embd_bytes + spec.trunk_bytes - spec.trunk_prefix[n] + spec.routed_bytes
    b += cache_bytes(spec, range(n, spec.n_layer), HOST_KV_TYPE, ctx)
    if n < spec.n_layer:
        b += spec.output_norm_bytes + (0 if spec.tied_output else spec.output_bytes)
    if n == 0:
        b += spec.rope_freqs_bytes
    return b


@dataclass(frozen=True)
class HostLoad:
    """What loading a model for the CPU allocates in RAM, by kind (bytes): host matrices copied out of the
    memory map (0 when they stay mapped: page cache, which the kernel can drop and re-read), the KV cache,
    and one prompt chunk's scratch."""

    weights: int
    kv: int
    scratch: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch


def host_load(
    spec: ModelSpec, *, ctx: int, kv_type: str, copy_weights: bool, experts: bool = True, n_ubatch: int = 512
) -> HostLoad:
    """The loader's allocation for ``spec`` at ``ctx`` (every layer on the host, as a load starts):
    ``copy_weights`` — the trunk, the output matrix and (``experts``: they run on the CPU) the routed
    experts are copied (engine.models.weights' resident copies; the embeddings always stay mapped)."""
    weights = 0
    if copy_weights:
        weights = spec.trunk_bytes + spec.output_bytes
        weights += spec.routed_bytes if experts else 0
    kv = cache_bytes(spec, range(spec.n_layer), kv_type, ctx)
    return HostLoad(weights, kv, scratch_estimate(spec, ctx, n_ubatch))
