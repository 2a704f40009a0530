"""The expert cache's device memory: one slot pool, the SLRU that assigns its slots, the expert → slot
table, and the uploads that fill it.

The pool is one uint8 tensor ``[n_slots, stride]``; a slot holds one expert's raw quantized gate | up |
down bytes at the role offsets of ``engine.plan.sizing.expert_slot_layout`` (the planner prices exactly
this). A segmented LRU maps (layer, expert) to slots. Uploads copy an expert's bytes from the memory map
through a pinned staging row on a side CUDA stream (on the CPU simulated device: directly); the table
(host copy, and a device copy refreshed between steps) says where each expert is, -1 where it is not.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from engine.experts import ExpertStacks
from engine.plan.sizing import SlotLayout
from engine.profiler import ExpertProfiler
from engine.runtime.device import DeviceArena, raw_bytes
from engine.runtime.slru import SegmentedLRU

ROLES = ("gate", "up", "down")

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


class ExpertPool:
    """Slots for the experts of ``layers`` on ``arena``'s device, filled from ``stacks``' mapped bytes."""

    def __init__(
        self,
        stacks: dict[int, ExpertStacks],
        layers: set[int],
        arena: DeviceArena,
        layout: SlotLayout,
        n_slots: int,
        max_uploads: int,
    ):
        self.stacks, self.layers, self.layout, self.max_uploads = stacks, set(layers), layout, max_uploads
        self.device = arena.device
        self.profiler: ExpertProfiler | None = None
        self.pool = arena.empty("experts", (n_slots, layout.stride), torch.uint8)
        self.slru = SegmentedLRU(n_slots)
        self.expert_bytes = {
            (i, r): raw_bytes(getattr(s, r)).reshape(s.gate.n_experts, -1) for i, s in stacks.items() for r in ROLES
        }
        self.uploaded_bytes = 0
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: torch.Tensor | None = None  # pinned [max_uploads, stride] on CUDA
        self._staged = 0  # staging rows in use since the last drain
        self._copies_done: torch.cuda.Event | None = None
        # Expert -> slot of every cached layer (-1: not in the pool), kept with the SLRU by upload; a decode
        # graph reads the device copy, refreshed between tokens (refresh_table) after the uploads it points at.
        n_exp = max((stacks[i].gate.n_experts for i in self.layers), default=0)
        rows = max(self.layers, default=-1) + 1
        pin = self.device.type == "cuda"
        self._slots_pin = torch.full((rows, n_exp), -1, dtype=torch.int64, pin_memory=pin)
        self.slots_h = self._slots_pin.numpy()  # int64 [layers, E] host copy
        self.slots_dev = torch.full((rows, n_exp), -1, dtype=torch.int64, device=self.device)
        self._table_dirty = False
        # layer -> int64 [E] byte offset of each expert's slot, for layers whose every expert is pinned
        # (resident: no miss, no eviction, so the table stays true for every later step).
        self.pinned_offsets: dict[int, torch.Tensor] = {}

    def upload(self, layer: int, e: int, working: set) -> bool:
        """Give expert e of ``layer`` a slot and copy its bytes in (never evicting ``working``'s experts or a
        pin); False when no slot can be had."""
        got = self.slru.admit((layer, e), working)
        if got is None:
            return False  # every slot holds an expert this token needs, or a pinned one
        slot, evicted = got
        self.slots_h[layer, e] = slot
        if evicted is not None:
            self.slots_h[evicted] = -1
        self._table_dirty = True
        if evicted is not None and self.profiler is not None:
            self.profiler.set_resident(evicted[0], [evicted[1]], False)
        n = 0
        stage = self._stage_row()
        for r in ROLES:
            src = self.expert_bytes[(layer, r)][e]  # uint8 view of the memory map
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
        """Fill the pool with every expert of every layer (resident mode), optionally pinned — then every
        layer's slots are fixed, and :attr:`pinned_offsets` holds them."""
        for i in sorted(self.layers):
            for e in range(self.stacks[i].gate.n_experts):
                if not self.upload(i, e, set()):
                    raise RuntimeError("resident experts need a slot per expert")
                if pin:
                    self.slru.pin((i, e))
        self.sync()
        self.refresh_table()
        if pin:
            self.pinned_offsets = {
                i: self.slots_dev[i, : self.stacks[i].gate.n_experts] * self.layout.stride for i in sorted(self.layers)
            }

    def refresh_table(self) -> None:
        """Copy the expert -> slot table to the device when uploads changed it, on the current stream
        (after :meth:`sync`: ordered after the uploads it points at; before the next token's graphs)."""
        if self._table_dirty:
            self.slots_dev.copy_(self._slots_pin, non_blocking=True)
            self._table_dirty = False

    def sync(self) -> None:
        """Order later device work after the queued uploads (does not block the host)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self._copies_done = torch.cuda.Event()
            self._copies_done.record(self._copy_stream)
            self._staged = 0
