"""Routed experts served from a device slot pool: the ``cache`` and ``resident`` backends.

Which experts run where: an expert in the pool (:mod:`engine.runtime.expert_pool`) is a hit and runs on
the device (:mod:`engine.runtime.pool_compute`); a miss is computed on the CPU now, from the memory map,
and queued for upload so a later token finds it on the device (``upload="async"``, bounded by
``max_uploads``; on CUDA copied behind the decode: ``ExpertPool.upload_later``); ``upload="sync"`` loads it
first and computes on the device. A prompt is different: an
expert missed by at least :func:`prompt_upload_threshold` of its tokens is uploaded before the layer runs
and computed on the device with the hits (copying 2–3 MB beats the CPU's work for that many tokens;
llama.cpp likewise moves a large batch's experts to the GPU); its rarer misses run on the CPU, grouped by
expert (where the misses go over the bus, below, a prompt reads them there instead). ``resident`` is the same pool
filled with every expert and pinned.

**Predictive prefetch** (``EngineOptions.cache_prefetch`` = N > 0, decode steps): after a cached layer has
served its experts (its hits on the device, its misses on the CPU), the next cached layer's router is applied
to this layer's normed input (pre-gating: the residual stream changes little from one layer to the next),
and up to N of the next layer's predicted experts not in the pool are uploaded now, the strongest predicted
first, never evicting an expert this token uses in this layer or is predicted to use in the next. The
uploads are copied on the copy stream and land before the next layer computes; they are skipped while a
step's demand uploads are still in flight behind the decode (a prefetch never delays a demand miss's upload),
and a step's demand uploads go up after the layers (``end_step``), when the step's prefetches have landed.
Every expert computes the same bytes on either side, so prefetch moves work, never changes the result.
The profiler counts each prediction against the layer's actual choice (recall, precision) and the hits on
prefetched experts.

In a one-token step (a decode CUDA graph) the device half computes the hits — every expert, where the
pool is pinned — with the slots looked up on the device, and the host half the misses after the replay;
the pool changes only between steps (``end_step``), so the table the graph reads stays true.

**Misses over the bus** (``EngineOptions.cache_misses`` "bus"): every cached layer's experts are also copied
into page-locked host memory at the pool's slot layout (``expert_pool.HostMirror``), and the device half
computes a miss itself, the fused kernels reading its bytes from that copy over PCIe — so a decode step has no
host half and runs as one graph. Its routes are taken after the step (:meth:`CachedExperts.routed`): counted,
and the misses uploaded as the host half would have queued them. A prompt on such a layer is one call of the grouped
kernels too (:meth:`CachedExperts._bus_pass`): its misses are read over the bus where they are, not uploaded into
the pool nor computed on the CPU, so the pass neither waits on copies nor evicts the decode's experts; its
well-used misses are queued for upload once it ends. Uploads then copy from that page-locked copy
(``ExpertPool.mirror_rows``): one DMA an expert, no host copy out of the memory map into a staging ring.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine import config, ops
from engine.config import EngineOptions
from engine.experts import ExpertBackend, ExpertStacks, StepPlan
from engine.plan.sizing import SlotLayout
from engine.profiler import ExpertProfiler
from engine.runtime import triton_q4k_moe
from engine.runtime.device import DeviceArena
from engine.runtime.expert_pool import ExpertPool, HostMirror, Progress, host_copy
from engine.runtime.pool_compute import PoolCompute

__all__ = ["PROMPT_UPLOAD_MIN", "CachedExperts", "host_copy", "prompt_upload_threshold"]

# A prompt's missed expert with this many of its tokens is uploaded, not run on the CPU. Lower thresholds upload
# more than the cache keeps: a pass's layers evict each other's experts (docs/lab-notebook.md, "Prompt uploads").
PROMPT_UPLOAD_MIN = 16


def prompt_upload_threshold(options: EngineOptions | None = None) -> int:
    """Tokens of a prompt a missed expert needs to be uploaded and run on the device
    (``EngineOptions.prompt_upload_min``: ``SHARPI_PROMPT_UPLOAD_MIN``, 0: never; default :data:`PROMPT_UPLOAD_MIN`)."""
    n = (options if options is not None else config.current()).prompt_upload_min
    return PROMPT_UPLOAD_MIN if n is None else n


class CachedExperts(ExpertBackend):
    """Device expert cache over ``layers``; misses computed on the host from ``stacks``."""

    def __init__(
        self,
        stacks: dict[int, ExpertStacks],
        layers: set[int],
        arena: DeviceArena,
        layout: SlotLayout,
        n_slots: int,
        *,
        q8_act: bool = True,
        upload: str = "async",
        max_uploads: int = 64,
        prompt_upload_min: int | None = None,
        options: EngineOptions | None = None,
        layer_layouts: dict[int, SlotLayout] | None = None,
        mirror: HostMirror | None = None,
        progress: Progress | None = None,
    ):
        """layer_layouts: resident experts packed at each layer's own stride (``ExpertPool``); then
        ``n_slots`` covers every expert of ``layers`` and :meth:`preload` pins them. mirror: the experts' host copy
        an earlier placement of this model made (reused where it serves, else closed: ``HostMirror.build``); progress:
        told of each layer of a new host copy (``expert_pool.Progress``)."""
        if upload not in ("async", "sync"):
            raise ValueError(upload)
        self.stacks, self.layers = stacks, set(layers)
        self.device = arena.device
        self.q8_act, self.upload_policy, self.max_uploads = q8_act, upload, max_uploads
        self.options = options if options is not None else config.current()  # kernel choice (kernel_select)
        self.prompt_upload_min = (
            prompt_upload_threshold(self.options) if prompt_upload_min is None else prompt_upload_min
        )
        background = {"background": True, "inline": False}.get(self.options.cache_upload)  # None: on CUDA
        self.pool = ExpertPool(
            stacks, layers, arena, layout, n_slots, max_uploads, layer_layouts, background, self.options.cache_policy
        )
        self.compute = PoolCompute(self.pool, stacks, q8_act, self.options)
        self.slots = self.pool.slots  # the slot policy (engine.runtime.slot_policies)
        self._fused = self.compute.fused  # layer -> the fused Triton kernels serve its three roles
        self._expert_bytes = self.pool.expert_bytes  # (layer, role) -> uint8 [E, row bytes] views of the map
        self.queue: list[tuple[int, int]] = []  # (layer, expert) to upload at the end of the step
        self._profiler: ExpertProfiler | None = None
        self.prefetch_max = self.options.cache_prefetch  # experts a layer and decode step (0: no prefetch)
        # layer -> (the next cached layer, its routing of this layer's normed input: ids, weights [T, K])
        self._predictors: dict[int, tuple[int, Callable]] = {}
        self._predicted: dict[int, np.ndarray] = {}  # layer -> this step's predicted experts, strongest first
        self._prefetched: set[tuple[int, int]] = set()  # brought in by a prediction, not used since
        self.prefetch_skipped = 0  # prefetches not made: demand uploads were in flight
        # Routes of this pass still being copied out: (layer, ids, over the bus?) of resident and bus passes.
        self._late_routes: list[tuple[int, torch.Tensor, bool]] = []
        # The misses computed on the device over the bus (EngineOptions.cache_misses "bus"): the experts' host copy.
        self.mirror: HostMirror | None = None
        self._mirror_off: torch.Tensor | None = None  # int64 [layers, E]: each expert's offset in the copy
        if self.options.cache_misses != "cpu" and layer_layouts is None and upload == "async":
            fused = [i for i in sorted(layers) if self._fused[i]]
            self.mirror = HostMirror.build(self.pool, fused, self.options.cache_misses, mirror, progress)
        elif mirror is not None:
            mirror.close()
        if self.mirror is not None:
            self._mirror_off = self.mirror.offsets(self.pool)
            self.pool.mirror_rows = self.mirror.rows()  # uploads copy from it: one DMA an expert, no staging

    def set_predictors(self, predictors: dict[int, tuple[int, Callable]]) -> None:
        """For predictive prefetch: {cached layer: (next cached layer, routing)}, where ``routing(x)`` maps this
        layer's normed input [T, D] to the next layer's router's choice (ids int64, weights [T, K])."""
        self._predictors = dict(predictors)

    @property
    def profiler(self) -> ExpertProfiler | None:
        return self._profiler

    @profiler.setter
    def profiler(self, p: ExpertProfiler | None) -> None:
        self._profiler = self.pool.profiler = p

    @property
    def uploaded_bytes(self) -> int:
        return self.pool.uploaded_bytes

    def preload(self, pin: bool) -> None:
        """Fill the pool with every expert of every layer (resident mode), optionally pinned."""
        self.pool.preload(pin)

    # -- eager: T tokens ----------------------------------------------------------------------------------
    def forward(self, layer, x, ids, weights):
        table = self.pool.pinned_offsets.get(layer)
        if table is not None and self._fused[layer] and ids.device == x.device:
            # Resident: every expert is on the device for good, so nothing here waits for the routes on the
            # host; they are copied out behind the layer and recorded once the pass ends (end_step).
            if self.profiler is not None:
                self._late_routes.append((layer, ids.to("cpu", non_blocking=True), False))
            return self.compute.fused_pairs(layer, table[ids], x, weights.to(x.device))
        if self._bus(layer) and ids.device == x.device:
            return self._bus_pass(layer, x, ids, weights)
        ids_h = ids.cpu().numpy()  # routing decides what runs where: an explicit host boundary
        if self.profiler is not None:
            self.profiler.record_route(layer, ids_h)
        return self._serve(layer, x, ids_h, weights)

    def _bus_pass(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A pass of many tokens where the misses go over the bus (:meth:`_bus`): every pair in one call of the
        fused kernels, a hit read from its slot, a miss from the host copy. Nothing is uploaded inside the pass (a
        prompt's layers would evict each other's experts, and each upload waits) and nothing waits for the routes:
        they are copied out behind the layer and accounted once the pass ends (:meth:`_record_late_routes`), the
        misses with at least :func:`prompt_upload_threshold` of the pass's tokens then queued for upload."""
        self.pool.drain()  # uploads behind the decode land first: the table stays fixed for the pass
        self._late_routes.append((layer, ids.to("cpu", non_blocking=True), True))
        return self.compute.fused_pairs(layer, self._pair_offsets(layer, ids), x, weights.to(x.device))

    def _pair_offsets(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """int64 like ``ids`` (on the device, no host sync): each pair's byte offset from the pool's base — its slot
        for a hit; for a miss its host copy's where the misses go over the bus (:meth:`_bus`), else −1 (skipped)."""
        slots = self.pool.slots_dev[layer].index_select(0, ids.reshape(-1)).reshape(ids.shape)
        miss = -1
        if self._bus(layer):
            miss = self._mirror_off[layer].index_select(0, ids.reshape(-1)).reshape(ids.shape)
        return torch.where(slots >= 0, self.pool.slot_off_dev[slots.clamp(min=0)], miss)

    def _serve(self, layer: int, x: torch.Tensor, ids_h: np.ndarray, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` after the route is recorded: hits (and a prompt's well-used misses, uploaded now)
        on the device, the other misses on the CPU and queued for upload; ``sync`` uploads every miss first."""
        T, K = ids_h.shape
        if T > 1 or self.upload_policy == "sync":
            self.pool.drain()  # uploads behind the decode land first: a prompt may upload and evict
        experts = np.unique(ids_h)
        working = {(layer, int(e)) for e in experts}
        self.slots.observe(layer, ids_h)
        hit, miss = [], []
        for e in experts:  # in the table: a hit (an expert still being copied in is a miss)
            if self.pool.slots_h[layer, e] >= 0:
                self.slots.hit((layer, int(e)))
                hit.append(int(e))
            else:
                miss.append(int(e))
        if self.upload_policy == "sync":
            eager = miss
        elif T > 1 and self.prompt_upload_min > 0:  # a prompt: experts with enough of its tokens go up now
            counts = np.bincount(ids_h.reshape(-1))
            eager = [e for e in miss if counts[e] >= self.prompt_upload_min]
        else:
            eager = []
        if self._predicted or self._prefetched:
            self._score_prefetch(layer, experts, hit)
        loaded = [e for e in eager if self.pool.upload(layer, e, working)]
        self._prefetched.difference_update((layer, e) for e in loaded)
        if loaded:
            self.pool.sync()
        hit_set, miss = set(hit) | set(loaded), [e for e in miss if e not in loaded]
        if self.profiler is not None:
            flat = ids_h.reshape(-1)
            was_hit = np.isin(flat, np.asarray(hit, np.int64))
            self.profiler.record_cache(layer, flat[was_hit], flat[~was_hit], {})
        y = self._device_outputs(layer, x, ids_h, weights, hit_set)
        if miss:
            y = y + self._host_outputs(layer, x, ids_h, weights, set(miss)).to(x.device)
            self.queue.extend((layer, e) for e in miss)
        if T == 1 and self.prefetch_max > 0 and layer in self._predictors and self.upload_policy == "async":
            self._prefetch(layer, x, working)
        return y

    def _score_prefetch(self, layer: int, experts: np.ndarray, hit: list[int]) -> None:
        """This pass's experts of ``layer`` against the prediction made for it, and its hits on prefetched ones."""
        pred = self._predicted.pop(layer, None)
        if pred is not None and self.profiler is not None:
            self.profiler.record_prediction(layer, len(pred), len(experts), len(np.intersect1d(pred, experts)))
        used = [e for e in hit if (layer, e) in self._prefetched]
        self._prefetched.difference_update((layer, e) for e in used)
        if used and self.profiler is not None:
            self.profiler.record_prefetch(layer, hits=used)

    def _prefetch(self, layer: int, x: torch.Tensor, working: set) -> None:
        """Predict the next cached layer's experts from ``x`` (this layer's normed input) and upload up to
        ``prefetch_max`` of those not in the pool, strongest first (see the module docstring)."""
        nxt, routing = self._predictors[layer]
        ids, w = routing(x)
        ids_h, w_h = ids.cpu().numpy().reshape(-1), w.float().cpu().numpy().reshape(-1)
        pred = ids_h[np.argsort(-w_h, kind="stable")]
        self._predicted[nxt] = pred
        self.pool.publish()  # demand uploads that have landed enter the table
        if self.pool.in_flight:  # demand uploads still copying behind the decode: they keep the link
            self.prefetch_skipped += 1
            return
        keep = working | {(nxt, int(e)) for e in pred}
        todo = [int(e) for e in pred if self.pool.slots_h[nxt, e] < 0][: self.prefetch_max]
        done = [e for e in todo if self.pool.upload(nxt, e, keep)]
        if done:
            self.pool.sync()
            self.pool.refresh_table()
            self._prefetched.update((nxt, e) for e in done)
            if self.profiler is not None:
                self.profiler.record_prefetch(nxt, uploaded=done)

    def _device_outputs(self, layer, x, ids_h, weights, hit_set: set) -> torch.Tensor:
        """Σ over the (token, slot) pairs served from the pool of weight · expert output: [T, D]."""
        T, K = ids_h.shape
        y = torch.zeros_like(x)
        if not hit_set:
            return y
        w = weights.to(x.device)
        if self._fused[layer]:
            # Fused Triton kernels read each pair's slot bytes in place: decode in two launches
            # (gate·up·SiLU, then down weighted over the k experts), prefill grouped by expert.
            slot_of = np.full(int(ids_h.max()) + 1, -1, dtype=np.int64)  # expert -> byte offset of its slot
            for e in hit_set:
                slot_of[e] = self.pool.offset(layer, e)
            slot_off = torch.from_numpy(slot_of[ids_h]).to(self.device)  # −1: not served here
            return self.compute.fused_pairs(layer, slot_off, x, w)
        t_idx, k_idx = np.nonzero(np.isin(ids_h, list(hit_set)))  # pairs, token-major
        if len(t_idx) <= 64:
            # Decode, reference: gather the pairs' slots and run one batched matmul per role.
            slots = torch.tensor([self.slots.slot((layer, int(ids_h[t, k]))) for t, k in zip(t_idx, k_idx)])
            experts = torch.from_numpy(ids_h[t_idx, k_idx].astype(np.int64)).to(self.device)
            xp = x[torch.from_numpy(t_idx).to(x.device)]
            out = self.compute.pair_outputs(layer, slots.to(self.device), xp, experts)
            wp = w[torch.from_numpy(t_idx).to(x.device), torch.from_numpy(k_idx).to(x.device)]  # [P]
            return y.index_add_(0, torch.from_numpy(t_idx).to(x.device), out * wp[:, None])
        for e in sorted(hit_set):  # prefill: each expert once over all its tokens
            t, k = np.nonzero(ids_h == e)
            ti, ki = torch.from_numpy(t).to(x.device), torch.from_numpy(k).to(x.device)
            out = self.compute.expert_rows(layer, self.slots.slot((layer, e)), x[ti], int(e))
            y.index_add_(0, ti, out * w[ti, ki][:, None])
        return y

    def _host_outputs(self, layer: int, x: torch.Tensor, ids_h: np.ndarray, weights, miss: set) -> torch.Tensor:
        """[T, D]: each token's missed experts, weighted, computed by the CPU kernels from the map in one
        call (a prompt's: grouped by expert, the hits left out)."""
        s = self.stacks[layer]
        X = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        W = np.ascontiguousarray(weights.detach().cpu().numpy(), dtype=np.float32)
        ids = np.ascontiguousarray(ids_h, dtype=np.int64)
        skip = ~np.isin(ids, np.fromiter(miss, np.int64, len(miss)))
        return torch.from_numpy(ops.moe_ffn(s.gate, s.up, s.down, X, ids, W, q8_act=self.q8_act, skip=skip, glu=s.glu))

    # -- a one-token step: the device half (hits; all where pinned), the host half (misses) ---------------
    def step_plan(self, layer: int) -> StepPlan:
        table = self.pool.pinned_offsets.get(layer)
        if table is not None:  # resident: every expert in the pool, for good
            return StepPlan(
                device=True, host=False, q8=self._q8(layer), slot_table=table if self._fused[layer] else None
            )
        if self._bus(layer):  # every expert inside the step: hits from the pool, misses over the bus
            return StepPlan(device=True, host=False, q8=self._q8(layer), bus=True)
        if self.upload_policy == "async":  # hits inside the step, misses after it, uploaded after the token
            return StepPlan(device=True, host=True, q8=self._q8(layer))
        return StepPlan(device=False, host=True)  # sync: a miss changes the pool at once, so all on the host side

    def _bus(self, layer: int) -> bool:
        """Whether a one-token step computes ``layer``'s misses on the device, from the host copy over the bus."""
        return self.mirror is not None and self._fused[layer] and layer in self.mirror.layers

    def _q8(self, layer: int) -> bool:
        """Whether the device half of ``layer`` runs the lean Q4_K kernels on q8 activations now (inside a
        decode graph's capture) and so can take x already in triton_q8's format from the norm before it."""
        if not self._fused[layer]:
            return False
        return self.compute.decode_act(layer) == "q8" and triton_q4k_moe.applies_gate_up(self.compute.roles(layer))

    def device_part(self, layer, x, ids, weights, xq=None, slot_off=None):
        """Pinned (resident): every expert, slots from the pinned table (or ``slot_off``, looked up by the
        routing kernel); else the hits, slots from the device table (−1: a miss, contributes 0) — and, where the
        misses go over the bus (:meth:`_bus`), the misses too, read from the host copy."""
        table = self.pool.pinned_offsets.get(layer)
        if table is not None:
            if self._fused[layer]:
                if slot_off is None:
                    slot_off = table[ids]  # [1, K] byte offsets, looked up on the device
                return self.compute.fused_pairs(layer, slot_off, x, weights, xq)
            return self.compute.weighted_slots(layer, self.pool.slots_dev[layer][ids[0]], x, weights, ids[0])
        if self._fused[layer]:
            return self.compute.fused_pairs(layer, self._pair_offsets(layer, ids), x, weights, xq)
        slots = self.pool.slots_dev[layer].index_select(0, ids.reshape(-1)).reshape(ids.shape)  # [1, K], -1: absent
        return self.compute.weighted_slots(layer, slots[0], x, weights, ids[0])

    def host_part(self, layer, X, ids, weights):
        """The misses of one token (the device half took the hits): computed by the CPU kernels, counted,
        and queued for upload after the token; the hits' recency refreshed — as :meth:`forward` does."""
        if self.upload_policy == "sync":  # the device half did nothing: upload the misses, run all here
            x = torch.from_numpy(X).to(self.device)
            return self._serve(layer, x, ids, torch.from_numpy(weights).to(self.device)).cpu().numpy()
        in_pool = self._account(layer, ids)
        if in_pool.all():
            return None
        ids = ids[0]
        s, ks = self.stacks[layer], np.flatnonzero(~in_pool)
        I = np.ascontiguousarray(ids[ks][None])
        W = np.ascontiguousarray(weights[:, ks])
        return ops.moe_ffn(s.gate, s.up, s.down, X, I, W, q8_act=self.q8_act, glu=s.glu)

    def _account(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """One token's routes ``ids`` [1, K] of ``layer`` against the pool: observed by the slot policy, the hits'
        recency refreshed, hits and misses counted, the misses queued for upload after the token -> in the pool
        bool [K]."""
        self.slots.observe(layer, ids)
        ids = ids[0]
        in_pool = self.pool.slots_h[layer, ids] >= 0  # one token's K experts are distinct
        if self.profiler is not None:
            self.profiler.record_cache(layer, ids[in_pool], ids[~in_pool], {})
        for e in np.sort(ids[in_pool]):  # recency in :meth:`forward`'s order
            self.slots.hit((layer, int(e)))
        self.queue.extend((layer, int(e)) for e in np.sort(ids[~in_pool]))
        return in_pool

    def routed(self, layers: np.ndarray, routes: np.ndarray) -> None:
        """A decode step's routes [n, K] of ``layers`` whose experts all ran inside it (:meth:`_bus`), taken after the
        step as :meth:`host_part` takes a cut layer's: the same accounting, nothing left to compute."""
        for j, i in enumerate(layers):
            self._account(int(i), routes[j : j + 1])

    def settle(self) -> None:
        self.pool.drain()

    def _record_late_routes(self) -> None:
        """The routes of this pass's resident layers and bus passes (one wait for the last copy, at the pass's
        end), recorded as :meth:`forward` records a cache's. Resident: every pair a hit, to the profiler. Bus
        (:meth:`_bus_pass`; the table did not change during the pass): observed by the slot policy, the hits'
        recency refreshed, hits and misses counted, and the misses with at least ``prompt_upload_min`` of the
        pass's tokens queued for upload, the most used first."""
        late, self._late_routes = self._late_routes, []
        if not late or (self.profiler is None and not any(bus for _, _, bus in late)):
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for layer, ids, bus in late:
            ids_h = ids.numpy()
            flat = ids_h.reshape(-1)
            if not bus:
                if self.profiler is not None:
                    self.profiler.record_route(layer, ids_h)
                    self.profiler.record_cache(layer, flat, flat[:0], {})
                continue
            self.slots.observe(layer, ids_h)
            in_pool = self.pool.slots_h[layer, flat] >= 0
            if self.profiler is not None:
                self.profiler.record_route(layer, ids_h)
                self.profiler.record_cache(layer, flat[in_pool], flat[~in_pool], {})
            for e in np.unique(flat[in_pool]):
                self.slots.hit((layer, int(e)))
            if self.prompt_upload_min > 0:
                counts = np.bincount(flat[~in_pool], minlength=self.pool.slots_h.shape[1])
                hot = np.flatnonzero(counts >= self.prompt_upload_min)
                self.queue.extend((layer, int(e)) for e in hot[np.argsort(-counts[hot], kind="stable")])

    def end_step(self) -> None:
        """Upload this step's misses (bounded), oldest first; the rest are dropped. On CUDA they are copied
        behind the next steps and enter the table once landed (``ExpertPool.upload_later``)."""
        self._record_late_routes()
        queue, self.queue = self.queue[: self.max_uploads], []
        self._prefetched.difference_update(queue)
        self._predicted.clear()  # a prediction is for the layer's next pass in this step only
        self.pool.upload_later(queue)
