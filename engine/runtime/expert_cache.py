"""Routed experts served from a device slot pool: the ``cache`` and ``resident`` backends.

The pool is one uint8 tensor ``[n_slots, stride]``; a slot holds one expert's raw quantized
gate | up | down bytes at the role offsets of ``engine.plan.sizing.expert_slot_layout`` (the
planner prices exactly this). A segmented LRU maps (layer, expert) to slots. On a miss the expert
is computed on the CPU now, from the memory map, and queued for upload so the next token finds it
on the device (``upload="async"``, bounded by ``max_uploads``); ``upload="sync"`` loads it first
and computes on the device. ``resident`` is the same pool filled with every expert and pinned.
"""

from __future__ import annotations

import numpy as np
import torch

from engine import ops
from engine.experts import ExpertBackend, ExpertStacks
from engine.models.layers import silu_mul
from engine.plan.sizing import SlotLayout
from engine.runtime.device import DeviceArena, raw_bytes
from engine.runtime.slru import SegmentedLRU
from engine.runtime.tdequant import dequantize

ROLES = ("gate", "up", "down")


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
    ):
        if upload not in ("async", "sync"):
            raise ValueError(upload)
        self.stacks, self.layers, self.layout = stacks, set(layers), layout
        self.device = arena.device
        self.q8_act, self.upload_policy, self.max_uploads = q8_act, upload, max_uploads
        self.pool = arena.empty("experts", (n_slots, layout.stride), torch.uint8)
        self.slru = SegmentedLRU(n_slots)
        self.queue: list[tuple[int, int]] = []  # (layer, expert) to upload at the end of the step
        self._expert_bytes = {
            (i, r): raw_bytes(getattr(s, r)).reshape(s.gate.n_experts, -1) for i, s in stacks.items() for r in ROLES
        }
        self.uploaded_bytes = 0
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- slots ----------------------------------------------------------------------------------
    def _upload(self, layer: int, e: int, working: set) -> bool:
        got = self.slru.admit((layer, e), working)
        if got is None:
            return False  # every slot holds an expert this token needs, or a pinned one
        slot, evicted = got
        if evicted is not None and self.profiler is not None:
            self.profiler.set_resident(evicted[0], [evicted[1]], False)
        n = 0
        for r in ROLES:
            src = torch.from_numpy(np.array(self._expert_bytes[(layer, r)][e]))  # staging copy of the mapped bytes
            off = self.layout.role_offset[r]
            if self._copy_stream is not None:
                with torch.cuda.stream(self._copy_stream):
                    self.pool[slot, off : off + src.numel()].copy_(src.pin_memory(), non_blocking=True)
            else:
                self.pool[slot, off : off + src.numel()].copy_(src)
            n += src.numel()
        self.uploaded_bytes += n
        if self.profiler is not None:
            self.profiler.record_cache(layer, [], [], {e: n})
            self.profiler.set_resident(layer, [e], True)
        return True

    def preload(self, pin: bool) -> None:
        """Fill the pool with every expert of every layer (resident mode), optionally pinned."""
        for i in sorted(self.layers):
            for e in range(self.stacks[i].gate.n_experts):
                if not self._upload(i, e, set()):
                    raise RuntimeError("resident experts need a slot per expert")
                if pin:
                    self.slru.pin((i, e))
        self.sync()

    def sync(self) -> None:
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)

    def _expert_on_device(self, layer: int, e: int, slot: int, X: torch.Tensor) -> torch.Tensor:
        """X [n, D] on the device -> [n, D]: down(silu(gate·x) ⊙ up·x) from the slot's bytes."""
        s = self.stacks[layer]
        mats = []
        for r in ROLES:
            w = getattr(s, r)
            nb = self._expert_bytes[(layer, r)].shape[1]
            off = self.layout.role_offset[r]
            raw = self.pool[slot, off : off + nb].view(w.rows, -1)
            mats.append(dequantize(raw, w.qtype, w.n))
        g, u, d = mats
        return silu_mul(X @ g.T, X @ u.T) @ d.T

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
            loaded = [e for e in miss if self._upload(layer, e, working)]
            self.sync()
            hit_set, miss = set(hit) | set(loaded), [e for e in miss if e not in loaded]
        else:
            hit_set = set(hit)
        if self.profiler is not None:
            self.profiler.record_cache(
                layer,
                [e for e in ids_h.reshape(-1) if e in set(hit)],
                [e for e in ids_h.reshape(-1) if e not in set(hit)],
                {},
            )
        out = torch.zeros(T, K, x.shape[1], dtype=torch.float32, device=x.device)  # per (token, slot)
        for e in hit_set:
            t, k = np.nonzero(ids_h == e)
            ti, ki = torch.from_numpy(t).to(x.device), torch.from_numpy(k).to(x.device)
            out[ti, ki] = self._expert_on_device(layer, e, self.slru.slot((layer, e)), x[ti])
        if miss:
            out[...] += self._host_outputs(layer, x, ids_h, set(miss)).to(x.device)
            self.queue.extend((layer, e) for e in miss)
        y = torch.zeros_like(x)
        w = weights.to(x.device)
        for k in range(K):  # reduce in top-k order, as the host path does
            y = y + w[:, k : k + 1] * out[:, k]
        return y

    def _host_outputs(self, layer: int, x: torch.Tensor, ids_h: np.ndarray, miss: set) -> torch.Tensor:
        """[T, K, D] with the missed (token, slot) outputs computed by the CPU kernels, 0 elsewhere."""
        s = self.stacks[layer]
        X = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        T, K = ids_h.shape
        out = np.zeros((T, K, X.shape[1]), np.float32)
        for t in range(T):
            for k in range(K):
                if ids_h[t, k] in miss:
                    one = np.array([[ids_h[t, k]]], np.int64)
                    out[t, k] = ops.moe_ffn(
                        s.gate, s.up, s.down, X[t : t + 1], one, np.ones((1, 1), np.float32), q8_act=self.q8_act
                    )[0]
        return torch.from_numpy(out)

    def end_step(self) -> None:
        """Upload this step's misses (bounded), oldest first; the rest are dropped."""
        queue, self.queue = self.queue[: self.max_uploads], []
        for layer, e in queue:
            if (layer, e) not in self.slru:
                self._upload(layer, e, set())
        self.sync()
