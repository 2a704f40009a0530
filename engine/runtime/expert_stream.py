"""Host-placed experts of device layers, streamed to the device for long prompts.

A device layer whose routed experts stay on the host (``--moe cpu``, the first ``n_cpu_moe`` layers) runs a
batch of T ≥ ``EngineOptions.prompt_stream_min`` tokens on the device, as llama.cpp does above 32 tokens:
the raw quantized bytes of the experts the batch routes to are copied into a staging pool laid out like
the expert cache's slots (``engine.plan.sizing.expert_slot_layout``; priced by the planner as
``DeviceBytes.stream``) and computed there by the pool kernels of :mod:`engine.runtime.pool_compute` (the
grouped prefill kernel ``triton_moe.moe_prefill``, or the torch reference where the fused kernels do not
serve the types). Shorter batches — decode — run on the CPU backend this wraps, unchanged.

Overlap. The staging pool is two halves of C slots (C = the layer's expert count when the budget allows,
``sizing.stream_slots``). While one half computes on the device, the other fills: memory map → a small
pinned ring (:data:`PIECE` × :data:`RING` slots, filled by several threads) → the device on a side stream.
Layer i+1's routing exists only after layer i's output, so while layer i computes, layer i+1's first C
experts — every one of them when C = E — are copied speculatively; its forward computes those it routes to
and copies any others after. Why copy them all: a 512-token prompt routes 4,096 pairs over 128 experts,
so a given expert goes unused with probability (1 − 8/128)^512 ≈ e^−33 — the routed set *is* the layer —
and its ≈ 128 × 3 MB ≈ 390 MB take 8–16 ms at 25–50 GB/s pinned (≈ 39 ms pageable), several times the
layer's compute on the device; waiting for the routing would put that copy after every layer's compute
instead of under the previous one's. At 32 tokens ≈ (15/16)^32 ≈ 13 % of the experts go unused: that much
of the copy is wasted, still cheaper than serialising it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from engine.config import EngineOptions
from engine.experts import CpuExperts, ExpertBackend, ExpertStacks, StepPlan
from engine.plan.sizing import SlotLayout
from engine.profiler import ExpertProfiler
from engine.runtime.device import DeviceArena, raw_bytes
from engine.runtime.expert_pool import ROLES
from engine.runtime.pool_compute import PoolCompute

PIECE = 8  # experts per pinned staging piece (CUDA): host copies of one piece overlap the DMA of the last
RING = 4  # pinned pieces: PIECE × RING × stride bytes of pinned host memory (≈ 94 MiB for Qwen3-30B Q4_K_M)

_COPIERS: ThreadPoolExecutor | None = None


def copy_many(jobs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """dst[:] = src for each (dst, src) pair of byte arrays, on up to 8 threads (numpy drops the GIL while
    copying; one thread reads page-cache bytes at a fraction of the memory's bandwidth). ``host_copy`` of
    ``engine.runtime.expert_pool`` splits one large copy; this spreads many ~1 MB ones (an expert's roles)."""
    global _COPIERS
    threads = min(8, os.cpu_count() or 1)
    if len(jobs) <= 1 or threads <= 1:
        for dst, src in jobs:
            dst[:] = src
        return
    if _COPIERS is None:
        _COPIERS = ThreadPoolExecutor(threads, thread_name_prefix="sharpi-stream")
    for f in [_COPIERS.submit(np.copyto, dst, src) for dst, src in jobs]:
        f.result()


class StagingPool:
    """The staging slots on the device, as :class:`~engine.runtime.pool_compute.PoolCompute` reads a pool:
    ``pool`` uint8 [n_slots, stride], ``layout``, ``slot_off_h`` / ``slot_off_dev`` (each slot's byte offset,
    int64 [n_slots] on the host / the device), ``expert_bytes`` {(layer, role): uint8 [E, bytes] views of the
    memory map}, ``device``."""

    def __init__(self, stacks: dict[int, ExpertStacks], arena: DeviceArena, layout: SlotLayout, n_slots: int):
        self.device = arena.device
        self.layout = layout
        self.pool = arena.empty("stream", (n_slots, layout.stride), torch.uint8)
        self.slot_off_h = np.arange(n_slots, dtype=np.int64) * layout.stride
        self.slot_off_dev = torch.from_numpy(self.slot_off_h).to(self.device)
        self.expert_bytes = {
            (i, r): raw_bytes(getattr(s, r)).reshape(s.gate.n_experts, -1) for i, s in stacks.items() for r in ROLES
        }

    def layout_of(self, layer: int) -> SlotLayout:
        """Every layer's experts sit at the one slot layout."""
        return self.layout

    def rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The bytes of the experts in ``slots`` (int64 [P] on the device) -> uint8 [P, stride]."""
        return self.pool.index_select(0, slots)


class _Chunk:
    """Experts of one layer copied into one half of the staging pool (slots base, base + 1, …)."""

    __slots__ = ("layer", "experts", "base", "half", "ready")

    def __init__(self, layer: int, experts: np.ndarray, base: int, half: int):
        self.layer, self.experts, self.base, self.half = layer, experts, base, half
        self.ready: torch.cuda.Event | None = None  # recorded on the side stream after the last copy


class StreamedExperts(ExpertBackend):
    """``host``'s experts for ``layers`` (device layers), computed on the device for batches of at least
    ``min_tokens`` tokens from ``n_slots`` staging slots on ``arena`` (two halves), else by ``host``."""

    def __init__(
        self,
        host: CpuExperts,
        layers: set[int],
        arena: DeviceArena,
        layout: SlotLayout,
        n_slots: int,
        min_tokens: int,
        *,
        q8_act: bool = True,
        options: EngineOptions | None = None,
    ):
        if n_slots < 2 or n_slots % 2:
            raise ValueError(f"the staging pool has two halves: {n_slots} slots")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be ≥ 1, got {min_tokens}")
        self.host, self.min_tokens = host, min_tokens
        order = sorted(layers)
        self.stacks = {i: host.stacks[i] for i in order}
        self._next_of = dict(zip(order, order[1:]))  # the streamed layer a forward pass runs next
        self.device = arena.device
        self.half = n_slots // 2
        self.staging = StagingPool(self.stacks, arena, layout, n_slots)
        self.compute = PoolCompute(self.staging, self.stacks, q8_act, options)
        self._stage = self.staging.pool.numpy() if self.device.type == "cpu" else None
        cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._pinned = torch.empty((RING, PIECE, layout.stride), dtype=torch.uint8, pin_memory=True) if cuda else None
        self._ring_free: list[torch.cuda.Event | None] = [None] * RING  # the DMA that last read each piece
        self._ring_next = 0
        self._half_free: list[torch.cuda.Event | None] = [None, None]  # the compute that last read each half
        self._next_half = 0
        self._pending: _Chunk | None = None  # the next layer's experts, copied while this one computes
        self._profiler: ExpertProfiler | None = None
        # Counters: bytes copied to the staging pool, layer passes computed from it, seconds of host copies.
        self.streamed_bytes = 0
        self.streamed_layers = 0
        self.host_copy_s = 0.0
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # this pass (CUDA)
        self._last_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def profiler(self) -> ExpertProfiler | None:
        return self._profiler

    @profiler.setter
    def profiler(self, p: ExpertProfiler | None) -> None:
        self._profiler = self.host.profiler = p

    # -- eager: T tokens --------------------------------------------------------------------------------
    def forward(self, layer, x, ids, weights):
        if x.shape[0] < self.min_tokens or layer not in self.stacks:
            self._pending = None
            return self.host.forward(layer, x, ids, weights)
        ids_h = ids.cpu().numpy()  # routing decides what is copied: an explicit host boundary
        if self.profiler is not None:
            self.profiler.record_route(layer, ids_h)
        used = np.unique(ids_h)  # experts with ≥ 1 of the batch's tokens, ascending
        pend, self._pending = self._pending, None
        queue: list[tuple[_Chunk, np.ndarray]] = []
        if pend is not None and pend.layer == layer:
            queue.append((pend, np.intersect1d(pend.experts, used)))
            used = np.setdiff1d(used, pend.experts)
        todo = [used[i : i + self.half] for i in range(0, len(used), self.half)]
        if not queue:
            queue.append((self._issue(layer, todo[0]), todo.pop(0)))
        y = torch.zeros_like(x)
        while queue:
            chunk, part = queue.pop(0)
            if len(part):
                y = y + self._compute(chunk, part, x, ids_h, weights)
            # The next copy goes in while this chunk computes: the rest of this layer, else the next layer.
            if todo:
                queue.append((self._issue(layer, todo[0]), todo.pop(0)))
            elif not queue and layer in self._next_of:
                nxt = self._next_of[layer]
                self._pending = self._issue(nxt, np.arange(min(self.half, self.stacks[nxt].gate.n_experts)))
        self.streamed_layers += 1
        return y

    def _issue(self, layer: int, experts: np.ndarray) -> _Chunk:
        """Start copying ``experts`` (int64 [n ≤ half]) of ``layer`` into the next half; returns at once on
        CUDA once the host copies are in pinned memory (the DMAs run on the side stream)."""
        h = self._next_half
        self._next_half ^= 1
        chunk = _Chunk(layer, experts, h * self.half, h)
        role_off = self.staging.layout.role_offset
        src = {r: self.staging.expert_bytes[(layer, r)] for r in ROLES}
        t0 = time.perf_counter()
        if self._side is None:  # the simulated device: straight into the staging slots
            copy_many(
                [
                    (self._stage[chunk.base + k, role_off[r] : role_off[r] + src[r].shape[1]], src[r][e])
                    for k, e in enumerate(experts)
                    for r in ROLES
                ]
            )
        else:
            start = torch.cuda.Event(enable_timing=True)
            pinned = self._pinned.numpy()
            for p0 in range(0, len(experts), PIECE):
                part = experts[p0 : p0 + PIECE]
                r_i = self._ring_next
                self._ring_next = (r_i + 1) % RING
                if self._ring_free[r_i] is not None:
                    self._ring_free[r_i].synchronize()  # its last DMA has read it
                copy_many(
                    [
                        (pinned[r_i, k, role_off[r] : role_off[r] + src[r].shape[1]], src[r][e])
                        for k, e in enumerate(part)
                        for r in ROLES
                    ]
                )
                with torch.cuda.stream(self._side):
                    if p0 == 0:
                        if self._half_free[h] is not None:
                            self._side.wait_event(self._half_free[h])  # the half's last compute is done
                        start.record(self._side)
                    dst = self.staging.pool[chunk.base + p0 : chunk.base + p0 + len(part)]
                    dst.copy_(self._pinned[r_i, : len(part)], non_blocking=True)
                    self._ring_free[r_i] = torch.cuda.Event()
                    self._ring_free[r_i].record(self._side)
            chunk.ready = torch.cuda.Event(enable_timing=True)
            chunk.ready.record(self._side)
            self._events.append(("copy", start, chunk.ready))
        self.host_copy_s += time.perf_counter() - t0
        self.streamed_bytes += len(experts) * sum(src[r].shape[1] for r in ROLES)
        return chunk

    def _compute(self, chunk: _Chunk, part: np.ndarray, x, ids_h: np.ndarray, weights) -> torch.Tensor:
        """Σ over the pairs routed to ``part`` (experts of ``chunk``, in its slots) of weight · expert(x): [T, D]."""
        layer, stride = chunk.layer, self.staging.layout.stride
        cur = None
        if chunk.ready is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(chunk.ready)
            start = torch.cuda.Event(enable_timing=True)
            start.record(cur)
        slot = np.full(self.stacks[layer].gate.n_experts, -1, dtype=np.int64)  # expert -> staging slot
        slot[chunk.experts] = chunk.base + np.arange(len(chunk.experts))
        w = weights.to(x.device)
        if self.compute.fused[layer]:
            sel = np.full_like(slot, -1)
            sel[part] = slot[part] * stride  # byte offsets; −1: a pair served by another chunk
            y = self.compute.fused_pairs(layer, torch.from_numpy(sel[ids_h]).to(self.device), x, w)
        else:  # the torch reference: each expert once over its tokens
            y = torch.zeros_like(x)
            for e in part:
                t, k = np.nonzero(ids_h == e)
                ti, ki = torch.from_numpy(t).to(x.device), torch.from_numpy(k).to(x.device)
                out = self.compute.expert_rows(layer, int(slot[e]), x[ti], int(e))
                y.index_add_(0, ti, out * w[ti, ki][:, None])
        if cur is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(cur)
            self._half_free[chunk.half] = end
            self._events.append(("compute", start, end))
        return y

    # -- a one-token step: the CPU backend's ----------------------------------------------------------------
    def step_plan(self, layer: int) -> StepPlan:
        return self.host.step_plan(layer)

    def device_part(self, layer, x, ids, weights, xq=None, slot_off=None):
        return self.host.device_part(layer, x, ids, weights, xq, slot_off)

    def host_part(self, layer, X, ids, weights):
        return self.host.host_part(layer, X, ids, weights)

    def end_step(self) -> None:
        self._pending = None  # a prefetch no layer of this pass asked for (the next pass starts cold)
        if self._events:
            self._last_events, self._events = self._events, []
        self.host.end_step()

    def last_pass_seconds(self) -> dict[str, float]:
        """Device time of the last streamed forward pass (CUDA; waits for it): {"copy": Σ over chunks of
        first DMA start → last DMA end on the side stream, "compute": Σ of the chunks' kernels}. Empty on
        the simulated device."""
        out = {"copy": 0.0, "compute": 0.0}
        if not self._last_events:
            return {}
        self._last_events[-1][2].synchronize()
        for kind, a, b in self._last_events:
            b.synchronize()
            out[kind] += a.elapsed_time(b) / 1e3
        return out
