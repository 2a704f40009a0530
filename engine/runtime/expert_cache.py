"""Routed experts served from a device slot pool: the ``cache`` and ``resident`` backends.

The pool is one uint8 tensor ``[n_slots, stride]``; a slot holds one expert's raw quantized
gate | up | down bytes at the role offsets of ``engine.plan.sizing.expert_slot_layout`` (the
planner prices exactly this). A segmented LRU maps (layer, expert) to slots. On a miss the expert
is computed on the CPU now, from the memory map, and queued for upload so the next token finds it
on the device (``upload="async"``, bounded by ``max_uploads``); ``upload="sync"`` loads it first
and computes on the device. A prompt is different: an expert missed by at least
:func:`prompt_upload_threshold` of its tokens is uploaded before the layer runs and computed on the
device with the hits (copying 2–3 MB beats the CPU's work for that many tokens; llama.cpp likewise
moves a large batch's experts to the GPU); its rarer misses run on the CPU, grouped by expert.
``resident`` is the same pool filled with every expert and pinned.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from engine import config, ops
from engine.config import EngineOptions
from engine.experts import ExpertBackend, ExpertStacks
from engine.models.layers import silu_mul
from engine.plan.sizing import SlotLayout
from engine.runtime import kernel_select as ks
from engine.runtime import step_kernels, triton_moe, triton_q4k_moe
from engine.runtime.device import TRITON_MAX_T, DeviceArena, fused_kernels, raw_bytes
from engine.runtime.references import dequantize
from engine.runtime.slru import SegmentedLRU

ROLES = ("gate", "up", "down")
# A prompt's missed expert with this many of its tokens is uploaded, not run on the CPU. Lower thresholds upload
# more than the cache keeps: a pass's layers evict each other's experts (docs/lab-notebook.md, "Prompt uploads").
PROMPT_UPLOAD_MIN = 16


_COPIERS: ThreadPoolExecutor | None = None


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for 1-D byte arrays; a large copy in ≥ 1 MiB slices on up to 8 threads (numpy
    drops the GIL while copying): one thread copies page-cache bytes at a fraction of the memory's
    bandwidth, and a prompt uploads whole layers of experts through here."""
    global _COPIERS
    n = src.size
    k = min(8, os.cpu_count() or 1, n >> 20)
    if k <= 1:
        dst[:] = src
        return
    if _COPIERS is None:
        _COPIERS = ThreadPoolExecutor(8, thread_name_prefix="sharpi-upload")
    step = -(-n // k)
    for f in [_COPIERS.submit(np.copyto, dst[i : i + step], src[i : i + step]) for i in range(0, n, step)]:
        f.result()


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
    ):
        if upload not in ("async", "sync"):
            raise ValueError(upload)
        self.stacks, self.layers, self.layout = stacks, set(layers), layout
        self.device = arena.device
        self.q8_act, self.upload_policy, self.max_uploads = q8_act, upload, max_uploads
        self.options = options if options is not None else config.current()  # kernel choice (kernel_select)
        self.prompt_upload_min = (
            prompt_upload_threshold(self.options) if prompt_upload_min is None else prompt_upload_min
        )
        self.pool = arena.empty("experts", (n_slots, layout.stride), torch.uint8)
        self.slru = SegmentedLRU(n_slots)
        self.queue: list[tuple[int, int]] = []  # (layer, expert) to upload at the end of the step
        self._expert_bytes = {
            (i, r): raw_bytes(getattr(s, r)).reshape(s.gate.n_experts, -1) for i, s in stacks.items() for r in ROLES
        }
        self.uploaded_bytes = 0
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: torch.Tensor | None = None  # pinned [max_uploads, stride] on CUDA
        self._staged = 0  # staging rows in use since the last drain
        self._copies_done: torch.cuda.Event | None = None
        # Layers whose three roles the fused Triton GEMV can read in place.
        self._slot_off: dict[int, torch.Tensor] = {}  # layer -> int64 [E] byte offset of each expert (pin_static)
        self._fused = {
            i: all(fused_kernels(self.device, getattr(s, r).qtype, self.options) for r in ROLES)
            for i, s in stacks.items()
        }
        # Expert -> slot of every cached layer (-1: not in the pool), kept with the SLRU by _upload; the
        # decode graph gathers a token's slots from the device copy (hits_static), refreshed between
        # tokens (refresh_table) after the uploads it points at.
        n_exp = max((stacks[i].gate.n_experts for i in self.layers), default=0)
        rows = max(self.layers, default=-1) + 1
        pin = self.device.type == "cuda"
        self._slots_pin = torch.full((rows, n_exp), -1, dtype=torch.int64, pin_memory=pin)
        self._slots_h = self._slots_pin.numpy()
        self._slots_dev = torch.full((rows, n_exp), -1, dtype=torch.int64, device=self.device)
        self._table_dirty = False

    # -- slots ----------------------------------------------------------------------------------
    def _upload(self, layer: int, e: int, working: set) -> bool:
        got = self.slru.admit((layer, e), working)
        if got is None:
            return False  # every slot holds an expert this token needs, or a pinned one
        slot, evicted = got
        self._slots_h[layer, e] = slot
        if evicted is not None:
            self._slots_h[evicted] = -1
        self._table_dirty = True
        if evicted is not None and self.profiler is not None:
            self.profiler.set_resident(evicted[0], [evicted[1]], False)
        n = 0
        stage = self._stage_row()
        for r in ROLES:
            src = self._expert_bytes[(layer, r)][e]  # uint8 view of the memory map
            off = self.layout.role_offset[r]
            if stage is None:
                self.pool[slot, off : off + src.size].copy_(torch.from_numpy(np.array(src)))
            else:
                host_copy(stage[off : off + src.size].numpy(), src)  # into pinned memory
            n += src.size
        if stage is not None:
            with torch.cuda.stream(self._copy_stream):
                self.pool[slot].copy_(stage, non_blocking=True)
        self.uploaded_bytes += n
        if self.profiler is not None:
            self.profiler.record_cache(layer, [], [], {e: n})
            self.profiler.set_resident(layer, [e], True)
        return True

    def _stage_row(self) -> torch.Tensor | None:
        """A pinned staging row for one upload (CUDA only); waits for the previous batch first."""
        if self._copy_stream is None:
            return None
        if self._staging is None:
            self._staging = torch.empty((self.max_uploads, self.layout.stride), dtype=torch.uint8, pin_memory=True)
        if self._staged == self.max_uploads:  # all rows in flight: let them land, then reuse
            self._copy_stream.synchronize()
            self._staged = 0
        if self._staged == 0 and self._copies_done is not None:
            self._copies_done.synchronize()
        row = self._staging[self._staged]
        self._staged += 1
        return row

    def preload(self, pin: bool) -> None:
        """Fill the pool with every expert of every layer (resident mode), optionally pinned."""
        for i in sorted(self.layers):
            for e in range(self.stacks[i].gate.n_experts):
                if not self._upload(i, e, set()):
                    raise RuntimeError("resident experts need a slot per expert")
                if pin:
                    self.slru.pin((i, e))
        self.sync()
        self.refresh_table()

    def refresh_table(self) -> None:
        """Copy the expert -> slot table to the device when uploads changed it, on the current stream
        (after :meth:`sync`: ordered after the uploads it points at; before the next token's graphs)."""
        if self._table_dirty:
            self._slots_dev.copy_(self._slots_pin, non_blocking=True)
            self._table_dirty = False

    def sync(self) -> None:
        """Order later device work after the queued uploads (does not block the host)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self._copies_done = torch.cuda.Event()
            self._copies_done.record(self._copy_stream)
            self._staged = 0

    # -- the backend call -------------------------------------------------------------------------
    def forward(self, layer, x, ids, weights):
        T, K = ids.shape
        ids_h = ids.cpu().numpy()  # routing decides what runs where: an explicit host boundary
        if self.profiler is not None:
            self.profiler.record_route(layer, ids_h)
        experts = np.unique(ids_h)
        working = {(layer, int(e)) for e in experts}
        hit, miss = [], []
        for e in experts:
            (hit if self.slru.hit((layer, int(e))) is not None else miss).append(int(e))
        if self.upload_policy == "sync":
            eager = miss
        elif T > 1 and self.prompt_upload_min > 0:  # a prompt: experts with enough of its tokens go up now
            counts = np.bincount(ids_h.reshape(-1))
            eager = [e for e in miss if counts[e] >= self.prompt_upload_min]
        else:
            eager = []
        loaded = [e for e in eager if self._upload(layer, e, working)]
        if loaded:
            self.sync()
        hit_set, miss = set(hit) | set(loaded), [e for e in miss if e not in loaded]
        if self.profiler is not None:
            flat = ids_h.reshape(-1)
            was_hit = np.isin(flat, np.asarray(hit, np.int64))
            self.profiler.record_cache(layer, flat[was_hit], flat[~was_hit], {})
        y = self._device_outputs(layer, x, ids_h, weights, hit_set)
        if miss:
            y = y + self._host_outputs(layer, x, ids_h, weights, set(miss)).to(x.device)
            self.queue.extend((layer, e) for e in miss)
        return y

    # -- the device-only step (CUDA graphs) ------------------------------------------------------
    def pin_static(self) -> bool:
        """Prepare :meth:`forward_static`: each layer's row of the device expert → slot table as byte
        offsets. Only when every expert of every layer is in the pool and pinned (resident mode: no
        miss, no eviction, so the table stays true); returns whether that holds."""
        self.refresh_table()
        offsets = {}
        for i in sorted(self.layers):
            E = self.stacks[i].gate.n_experts
            if (self._slots_h[i, :E] < 0).any() or not self.slru.pinned.issuperset((i, e) for e in range(E)):
                self._slot_off = {}
                return False
            offsets[i] = self._slots_dev[i, :E] * self.layout.stride
        self._slot_off = offsets
        return True

    def route_static(self, layer: int, logits: torch.Tensor, k: int, renormalise: bool, ids_out: torch.Tensor):
        """Routing of one token in one fused kernel (``step_kernels.route``) where the layer's experts
        run in the fused MoE kernels: logits float32 [1, E] -> (weights float32 [1, k], slot byte
        offsets int64 [1, k]), the ids written into ``ids_out`` [1, k]; None where it does not apply
        (the caller routes in torch)."""
        if not self._fused[layer] or layer not in self._slot_off or not ks.step_kernels(self.device, self.options):
            return None
        return step_kernels.route(logits, k, renormalise, self._slot_off[layer], ids_out)

    def static_q8(self, layer: int) -> bool:
        """Whether :meth:`forward_static` of ``layer`` would run the lean Q4_K kernels on q8 activations
        now (``kernel_select.moe_act``; inside a decode graph's capture) and so can take x already in
        triton_q8's format from the norm kernel before it (``MoE.wants_q8_input``)."""
        if not self._fused[layer]:
            return False
        roles = self._roles(layer)
        act = ks.moe_act(self.device, self.q8_act, roles, options=self.options)
        return act == "q8" and triton_q4k_moe.applies_gate_up(roles)

    def forward_static(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        slot_off: torch.Tensor | None = None,
        xq: tuple | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` for one token with ``ids`` staying on the device: x float32 [1, D], ids
        int64 [1, K], weights float32 [1, K] -> [1, D]. Slots come from the device table of
        :meth:`pin_static` (resident pool), so there is no host sync and no bookkeeping: a CUDA
        graph can capture it. The caller records the routes (the profiler's hits are its calls).
        slot_off int64 [1, K]: the pairs' slot byte offsets when the caller looked them up already.
        xq: x in triton_q8's format (:meth:`static_q8`), or None."""
        if self._fused[layer]:
            if slot_off is None:
                slot_off = self._slot_off[layer][ids]  # [1, K] byte offsets, looked up on the device
            roles = self._roles(layer)
            act = ks.moe_act(self.device, self.q8_act, roles, options=self.options)
            y = triton_moe.moe_decode(self.pool, slot_off, x.float(), weights.float(), roles, act, xq, self.options)
            return y.to(x.dtype)
        return self._weighted_pairs(layer, self._slots_dev[layer][ids[0]], x, weights)

    def _weighted_pairs(self, layer: int, slots: torch.Tensor, x: torch.Tensor, weights: torch.Tensor):
        """Reference kernels, on the device without a host sync: Σ_k weights[0, k] · the output of the
        expert in slot ``slots[k]`` (int64 [K]; −1: not in the pool, contributes 0) for x [1, D] -> [1, D]."""
        out = self._pair_outputs(layer, slots.clamp(min=0), x.expand(slots.shape[0], -1))  # [K, D]
        out = torch.where((slots >= 0)[:, None], out * weights[0][:, None], 0.0)  # slot 0 may hold anything
        return out.sum(0, keepdim=True)

    # -- a decode graph over a cache that misses: hits inside the graph, misses on the host ---------
    def graph_hits(self, layer: int) -> bool:
        """Whether a decode graph can compute ``layer``'s hits itself (:meth:`hits_static`) and leave
        only the misses to the host (:meth:`host_misses`): misses computed on the CPU and uploaded
        after the token (``upload="async"``), so the pool does not change inside a step."""
        return self.upload_policy == "async" and layer in self.layers

    def hits_static(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, xq=None):
        """Σ over the token's experts in the pool of weight · expert output, with ids staying on the
        device (graph-capturable): x float32 [1, D], ids int64 [1, K], weights float32 [1, K] -> [1, D];
        pairs not in the pool contribute 0 (the host adds them: :meth:`host_misses`)."""
        slots = self._slots_dev[layer].index_select(0, ids.reshape(-1)).reshape(ids.shape)  # [1, K], -1: absent
        if self._fused[layer]:
            off = torch.where(slots >= 0, slots * self.layout.stride, -1)  # the fused kernels skip -1
            return self.forward_static(layer, x, ids, weights, slot_off=off, xq=xq)
        return self._weighted_pairs(layer, slots[0], x, weights)

    def host_misses(self, layer: int, X: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
        """The host half of a graph step's cache layer: X float32 [1, D], ids int64 [K], weights float32
        [1, K] (host copies) -> the missed experts' weighted sum [1, D] from the CPU kernels, or None
        when every expert hit. Records calls, hits and misses, refreshes the hits' recency and queues
        the misses for upload after the token — as :meth:`forward` does."""
        in_pool = self._slots_h[layer, ids] >= 0  # one token's K experts are distinct
        if self.profiler is not None:
            self.profiler.record_route(layer, ids[None])
            self.profiler.record_cache(layer, ids[in_pool], ids[~in_pool], {})
        for e in np.sort(ids[in_pool]):  # recency in :meth:`forward`'s order
            self.slru.hit((layer, int(e)))
        if in_pool.all():
            return None
        self.queue.extend((layer, int(e)) for e in np.sort(ids[~in_pool]))
        s, ks = self.stacks[layer], np.flatnonzero(~in_pool)
        I = np.ascontiguousarray(ids[ks][None])
        return ops.moe_ffn(s.gate, s.up, s.down, X, I, np.ascontiguousarray(weights[:, ks]), q8_act=self.q8_act)

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
                slot_of[e] = self.slru.slot((layer, e)) * self.layout.stride
            slot_off = torch.from_numpy(slot_of[ids_h]).to(self.device)  # −1: not served here
            roles = self._roles(layer)
            if T <= TRITON_MAX_T:
                act = ks.moe_act(self.device, self.q8_act, roles, options=self.options)
                y = triton_moe.moe_decode(self.pool, slot_off, x.float(), w.float(), roles, act, options=self.options)
            else:
                y = triton_moe.moe_prefill(self.pool, slot_off, x.float(), w.float(), roles, self.options)
            return y.to(x.dtype)
        t_idx, k_idx = np.nonzero(np.isin(ids_h, list(hit_set)))  # pairs, token-major
        if len(t_idx) <= 64:
            # Decode, reference: gather the pairs' slots and run one batched matmul per role.
            slots = torch.tensor([self.slru.slot((layer, int(ids_h[t, k]))) for t, k in zip(t_idx, k_idx)])
            out = self._pair_outputs(layer, slots.to(self.device), x[torch.from_numpy(t_idx).to(x.device)])  # [P, D]
            wp = w[torch.from_numpy(t_idx).to(x.device), torch.from_numpy(k_idx).to(x.device)]
            return y.index_add_(0, torch.from_numpy(t_idx).to(x.device), out * wp[:, None])
        for e in sorted(hit_set):  # prefill: each expert once over all its tokens
            t, k = np.nonzero(ids_h == e)
            ti, ki = torch.from_numpy(t).to(x.device), torch.from_numpy(k).to(x.device)
            g, u, d = self._slot_matrices(layer, torch.tensor([self.slru.slot((layer, e))], device=self.device))
            out = silu_mul(x[ti] @ g[0].T, x[ti] @ u[0].T) @ d[0].T
            y.index_add_(0, ti, out * w[ti, ki][:, None])
        return y

    def _pair_outputs(self, layer: int, slots: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
        """Reference kernels: down(SiLU(gate·x) · up·x) of each pair's slot, unweighted.
        slots int64 [P] (on the device), xp [P, D] each pair's token -> [P, D]."""
        g, u, d = self._slot_matrices(layer, slots)  # [P, F, D], [P, F, D], [P, D, F]
        xc = xp[:, :, None]  # [P, D, 1]
        return torch.bmm(d, silu_mul(torch.bmm(g, xc), torch.bmm(u, xc)))[:, :, 0]

    def _roles(self, layer: int) -> dict:
        """{role: (byte offset in a slot, qtype, rows, n)} for the fused kernels."""
        s = self.stacks[layer]
        return {
            r: (self.layout.role_offset[r], getattr(s, r).qtype, getattr(s, r).rows, getattr(s, r).n) for r in ROLES
        }

    def _slot_matrices(self, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
        """Dequantized gate, up [P, F, D] and down [P, D, F] of the experts in ``slots``."""
        s = self.stacks[layer]
        raw = self.pool.index_select(0, slots)  # [P, stride]
        mats = []
        for r in ROLES:
            w = getattr(s, r)
            nb = self._expert_bytes[(layer, r)].shape[1]
            off = self.layout.role_offset[r]
            m = dequantize(raw[:, off : off + nb].reshape(len(slots) * w.rows, -1), w.qtype, w.n)
            mats.append(m.reshape(len(slots), w.rows, w.n))
        return mats

    def _host_outputs(self, layer: int, x: torch.Tensor, ids_h: np.ndarray, weights, miss: set) -> torch.Tensor:
        """[T, D]: each token's missed experts, weighted, computed by the CPU kernels from the map in one
        call (a prompt's: grouped by expert, the hits left out)."""
        s = self.stacks[layer]
        X = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        W = np.ascontiguousarray(weights.detach().cpu().numpy(), dtype=np.float32)
        ids = np.ascontiguousarray(ids_h, dtype=np.int64)
        skip = ~np.isin(ids, np.fromiter(miss, np.int64, len(miss)))
        return torch.from_numpy(ops.moe_ffn(s.gate, s.up, s.down, X, ids, W, q8_act=self.q8_act, skip=skip))

    def end_step(self) -> None:
        """Upload this step's misses (bounded), oldest first; the rest are dropped."""
        queue, self.queue = self.queue[: self.max_uploads], []
        for layer, e in queue:
            if (layer, e) not in self.slru:
                self._upload(layer, e, set())
        self.sync()
        self.refresh_table()
