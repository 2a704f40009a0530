"""The expert cache's device memory: one slot pool, the slot policy that assigns its slots, the expert → slot
table, and the uploads that fill it.

The pool is one flat uint8 tensor; a slot holds one expert's raw quantized gate | up | down bytes at
the role offsets of a slot layout, and the kernels address it by byte offset (:attr:`ExpertPool.slot_off_dev`).
A cache's slots all have the stride of ``engine.plan.sizing.expert_slot_layout`` (the largest expert of
any layer: a slot serves every layer); resident experts (``layer_layouts``) never move, so each layer's
are packed at its own ``layer_slot_layout`` stride, slot after slot as they are first filled
(``engine.plan.sizing.resident_expert_bytes``). The planner prices exactly these bytes. A slot policy
(``engine.runtime.slot_policies``: lru, slru or dlfu, ``EngineOptions.cache_policy``) maps (layer, expert) to
slots, and may refuse a miss a slot (it then stays a miss, computed on the CPU). Uploads copy an expert's bytes from the memory map
through a pinned staging row on a side CUDA stream (on the CPU simulated device: directly); the table
(host copy, and a device copy refreshed between steps) says where each expert is, -1 where it is not.

A decode step's misses are uploaded behind the decode (:meth:`ExpertPool.upload_later`, the default on
CUDA): the slots are assigned between steps and their old experts leave the table at once, a worker
thread copies the bytes in (memory map → pinned ring → the device, on its own stream) while the next
tokens run, and the table points at them only once they have landed (:meth:`ExpertPool.publish`, between
steps). Until then those experts are misses, computed on the CPU; nothing the device reads changes under it.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine.experts import ExpertStacks
from engine.plan.ram import available_ram
from engine.plan.sizing import SlotLayout
from engine.profiler import ExpertProfiler
from engine.runtime.device import DeviceArena, raw_bytes
from engine.runtime.slot_policies import DEFAULT_SLOT_POLICY, make_slots

log = logging.getLogger(__name__)

ROLES = ("gate", "up", "down")
Progress = Callable[[int, int, str], None]  # (done, total, what), as engine.api's
MIRROR_PROGRESS = "copying experts to page-locked RAM"  # HostMirror's progress, a layer at a time
BACKGROUND_RING = 16  # pinned staging rows of the background uploads (each reused once its copy has landed)
BACKGROUND_JOBS = 2  # steps' batches in flight at most; a step's misses beyond that are not uploaded

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
        layer_layouts: dict[int, SlotLayout] | None = None,
        background: bool | None = None,
        policy: str = DEFAULT_SLOT_POLICY,
    ):
        """layout: the cache's slot layout; layer_layouts: {layer: its own layout} for resident experts
        (``n_slots`` = every expert of ``layers``, packed; no slot is ever reused by another layer);
        background: :meth:`upload_later` copies on a worker thread (None: on CUDA; else at once, as
        :meth:`upload` does, and published at once — the simulated device's deterministic default); policy: the
        slot policy's name (``engine.runtime.slot_policies.SLOT_POLICIES``)."""
        self.stacks, self.layers, self.layout, self.max_uploads = stacks, set(layers), layout, max_uploads
        self.layer_layouts = layer_layouts
        self.device = arena.device
        self.profiler: ExpertProfiler | None = None
        if layer_layouts is None:
            nbytes = n_slots * layout.stride
            self.slot_off_h = np.arange(n_slots, dtype=np.int64) * layout.stride  # slot -> byte offset
        else:
            nbytes = sum(stacks[i].gate.n_experts * layer_layouts[i].stride for i in self.layers)
            self.slot_off_h = np.full(n_slots, -1, dtype=np.int64)  # given as each slot is first filled
        self._packed = 0  # bytes of the packed (resident) pool handed out
        self.pool = arena.empty("experts", (nbytes,), torch.uint8)
        self.slot_off_dev = torch.from_numpy(self.slot_off_h).to(self.device)
        n_exp = max((stacks[i].gate.n_experts for i in self.layers), default=0)
        self.slots = make_slots(policy, n_slots, max(self.layers, default=-1) + 1, max(n_exp, 1))
        self.expert_bytes = {
            (i, r): raw_bytes(getattr(s, r)).reshape(s.gate.n_experts, -1) for i, s in stacks.items() for r in ROLES
        }
        self.uploaded_bytes = 0
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: torch.Tensor | None = None  # pinned [max_uploads, stride] on CUDA
        self._staged = 0  # staging rows in use since the last drain
        self._copies_done: torch.cuda.Event | None = None
        # Expert -> slot of every cached layer (-1: not in the pool), kept with the slot policy by upload; a decode
        # graph reads the device copy, refreshed between tokens (refresh_table) after the uploads it points at.
        rows = max(self.layers, default=-1) + 1
        pin = self.device.type == "cuda"
        self._slots_pin = torch.full((rows, n_exp), -1, dtype=torch.int64, pin_memory=pin)
        self.slots_h = self._slots_pin.numpy()  # int64 [layers, E] host copy
        self.slots_dev = torch.full((rows, n_exp), -1, dtype=torch.int64, device=self.device)
        self._table_dirty = False
        # layer -> int64 [E] byte offset of each expert's slot, for layers whose every expert is pinned
        # (resident: no miss, no eviction, so the table stays true for every later step).
        self.pinned_offsets: dict[int, torch.Tensor] = {}
        # Background uploads: batches (admitted between steps) copied by one worker thread, oldest first.
        self.background = (self.device.type == "cuda") if background is None else background
        self._worker: ThreadPoolExecutor | None = None
        self._jobs: list[tuple[list[tuple[int, int, int]], Future]] = []  # (layer, expert, slot) batches
        self._bg_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ring: torch.Tensor | None = None  # pinned [BACKGROUND_RING, stride] (CUDA)
        self._ring_free: list[torch.cuda.Event | None] = [None] * BACKGROUND_RING
        self._ring_next = 0
        self.background_dropped = 0  # misses not uploaded because BACKGROUND_JOBS batches were in flight
        # layer -> uint8 [E, stride]: its experts' page-locked host copy at the slot layout (HostMirror.rows), which
        # uploads copy from as they stand (no staging through the memory map); None: uploads stage from the map.
        self.mirror_rows: dict[int, np.ndarray] | None = None

    def upload(self, layer: int, e: int, working: set) -> bool:
        """Give expert e of ``layer`` a slot and copy its bytes in (never evicting ``working``'s experts or a
        pin); False when no slot can be had. Background uploads still in flight land first."""
        if self._jobs:
            self.drain()
        got = self.slots.admit((layer, e), working)
        if got is None:
            return False  # every slot holds an expert this token needs, or a pinned one
        slot, evicted = got
        lay = self.layout_of(layer)
        if self.layer_layouts is not None:
            if evicted is not None or self.slot_off_h[slot] >= 0:
                raise RuntimeError("a packed (resident) expert pool never reuses a slot")
            self.slot_off_h[slot] = self._packed
            self._packed += lay.stride
            assert self._packed <= self.pool.numel(), "packed pool overflow"
        base = int(self.slot_off_h[slot])
        self.slots_h[layer, e] = slot
        if evicted is not None:
            self.slots_h[evicted] = -1
        self._table_dirty = True
        if evicted is not None and self.profiler is not None:
            self.profiler.set_resident(evicted[0], [evicted[1]], False)
        with torch.cuda.stream(self._copy_stream):  # (None, the simulated device: no stream)
            mirrored = self._from_mirror(layer, e, base)
        if mirrored:
            n = self._role_bytes(layer)
        else:
            stage = self._stage_row()
            n = self._fill(layer, e, base, None if stage is None else stage.numpy())
            if stage is not None:
                with torch.cuda.stream(self._copy_stream):
                    self.pool[base : base + lay.stride].copy_(stage[: lay.stride], non_blocking=True)
        self.uploaded_bytes += n
        if self.profiler is not None:
            self.profiler.record_cache(layer, [], [], {e: n})
            self.profiler.set_resident(layer, [e], True)
        return True

    def _from_mirror(self, layer: int, e: int, base: int) -> bool:
        """Copy expert ``e`` of ``layer`` into the pool at byte ``base`` straight from the page-locked host copy
        (:attr:`mirror_rows`: one DMA on the current stream, no staging); False where there is no copy of it."""
        rows = None if self.mirror_rows is None else self.mirror_rows.get(layer)
        if rows is None:
            return False
        stride = self.layout_of(layer).stride
        self.pool[base : base + stride].copy_(torch.from_numpy(rows[e, :stride]), non_blocking=True)
        return True

    def _role_bytes(self, layer: int) -> int:
        return sum(self.expert_bytes[(layer, r)].shape[1] for r in ROLES)

    def _fill(self, layer: int, e: int, base: int, row: np.ndarray | None) -> int:
        """Expert ``e`` of ``layer``'s role bytes from the memory map, into the pool at byte ``base`` (``row``
        None: the simulated device) or into the pinned staging ``row`` at the layout's role offsets; returns
        the bytes copied."""
        lay, n = self.layout_of(layer), 0
        for r in ROLES:
            src = self.expert_bytes[(layer, r)][e]  # uint8 view of the memory map
            off = lay.role_offset[r]
            if row is None:
                self.pool[base + off : base + off + src.size].copy_(torch.from_numpy(np.array(src)))
            else:
                host_copy(row[off : off + src.size], src)
            n += src.size
        return n

    # -- uploads behind the decode ---------------------------------------------------------------------------
    def upload_later(self, items: list[tuple[int, int]]) -> int:
        """Between steps: give each (layer, expert) of ``items`` not yet cached a slot (any expert may be
        evicted: it leaves the table now) and copy them in behind the next steps; they enter the table when
        they have landed (:meth:`publish`). Returns how many were admitted (none while
        ``BACKGROUND_JOBS`` batches are in flight). Without ``background``: :meth:`upload` each at once."""
        if not self.background:
            n = sum(self.upload(layer, e, set()) for layer, e in items if (layer, e) not in self.slots)
            self.sync()
            self.refresh_table()
            return n
        self.publish()
        todo = [(layer, e) for layer, e in dict.fromkeys(items) if (layer, e) not in self.slots]
        if not todo:
            return 0
        if len(self._jobs) >= BACKGROUND_JOBS:
            self.background_dropped += len(todo)
            return 0
        if self.layer_layouts is not None:
            raise RuntimeError("a packed (resident) expert pool is filled by preload, not behind the decode")
        batch = []
        for layer, e in todo:
            got = self.slots.admit((layer, e), ())
            if got is None:
                continue  # the policy keeps what it holds (or every slot is pinned): it stays on the CPU
            slot, evicted = got
            if evicted is not None:
                self.slots_h[evicted] = -1  # out of the table before its slot is overwritten
                self._table_dirty = True
                if self.profiler is not None:
                    self.profiler.set_resident(evicted[0], [evicted[1]], False)
            batch.append((layer, e, slot))
        self.refresh_table()
        after = None
        if self._bg_stream is not None:  # the copies start after the work queued so far (it may read evicted slots)
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="sharpi-expert-upload")
        self._jobs.append((batch, self._worker.submit(self._copy_batch, batch, after)))
        return len(batch)

    def _copy_batch(self, batch: list[tuple[int, int, int]], after: torch.cuda.Event | None):
        """Worker thread: copy ``batch``'s experts into their slots; returns the event of the last copy (CUDA)."""
        if self._bg_stream is None:  # the simulated device: straight into the pool
            for layer, e, slot in batch:
                base = int(self.slot_off_h[slot])
                if not self._from_mirror(layer, e, base):
                    self._fill(layer, e, base, None)
            return None
        with torch.cuda.stream(self._bg_stream):
            self._bg_stream.wait_event(after)
            for layer, e, slot in batch:
                if self._from_mirror(layer, e, int(self.slot_off_h[slot])):
                    continue  # page-locked already: no host copy, no ring row to wait for
                if self._ring is None:
                    self._ring = torch.empty((BACKGROUND_RING, self.layout.stride), dtype=torch.uint8, pin_memory=True)
                ring = self._ring.numpy()
                k = self._ring_next
                self._ring_next = (k + 1) % BACKGROUND_RING
                if self._ring_free[k] is not None:
                    self._ring_free[k].synchronize()  # the copy that last read this row has landed
                base, lay = int(self.slot_off_h[slot]), self.layout_of(layer)
                self._fill(layer, e, base, ring[k])
                self.pool[base : base + lay.stride].copy_(self._ring[k, : lay.stride], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._bg_stream)
                self._ring_free[k] = ev
            done = torch.cuda.Event()
            done.record(self._bg_stream)
        return done

    def publish(self, wait: bool = False) -> int:
        """Between steps: put the background uploads that have landed into the table (oldest batch first;
        ``wait``: all of them, waiting). An expert evicted again before its batch landed stays out. Returns
        how many entered."""
        n = 0
        while self._jobs:
            batch, fut = self._jobs[0]
            if not wait and not fut.done():
                break
            done = fut.result()  # a worker's exception surfaces here
            if done is not None:
                if not wait and not done.query():
                    break
                torch.cuda.current_stream(self.device).wait_event(done)
            self._jobs.pop(0)
            for layer, e, slot in batch:
                if self.slots.slot((layer, e)) != slot:
                    continue  # evicted by a later batch before it landed
                self.slots_h[layer, e] = slot
                self._table_dirty = True
                nbytes = self._role_bytes(layer)
                self.uploaded_bytes += nbytes
                if self.profiler is not None:
                    self.profiler.record_cache(layer, [], [], {e: nbytes})
                    self.profiler.set_resident(layer, [e], True)
                n += 1
        self.refresh_table()
        return n

    @property
    def in_flight(self) -> int:
        """Batches of background uploads not yet in the table."""
        return len(self._jobs)

    def drain(self) -> None:
        """Wait for every background upload and put it in the table."""
        self.publish(wait=True)

    def layout_of(self, layer: int) -> SlotLayout:
        """Where ``layer``'s roles sit in its slots: its own layout when packed, else the shared one."""
        return self.layout if self.layer_layouts is None else self.layer_layouts[layer]

    def offset(self, layer: int, e: int) -> int:
        """Byte offset of expert ``e`` of ``layer`` in the pool (it must be in the pool)."""
        return int(self.slot_off_h[self.slots.slot((layer, e))])

    def rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The bytes of ``layer``'s experts in ``slots`` (int64 [P] on the device) -> uint8 [P, stride]."""
        stride = self.layout_of(layer).stride
        idx = self.slot_off_dev.index_select(0, slots)[:, None] + torch.arange(stride, device=self.device)
        return self.pool[idx]

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
                    self.slots.pin((i, e))
        self.sync()
        if self.layer_layouts is not None:
            self.slot_off_dev.copy_(torch.from_numpy(self.slot_off_h))
        self.refresh_table()
        if pin:
            self.pinned_offsets = {
                i: self.slot_off_dev.index_select(0, self.slots_dev[i, : self.stacks[i].gate.n_experts])
                for i in sorted(self.layers)
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


def mirror_bytes(n_experts: list[int], stride: int) -> int:
    """Host bytes of :class:`HostMirror` over layers of ``n_experts`` experts each, at slot ``stride``."""
    return len(n_experts) * max(n_experts, default=0) * stride


def misses_over_bus(mode: str, device_type: str, need: int, available: int | None) -> bool:
    """Whether the expert cache computes a decode step's misses on the device over the bus
    (``EngineOptions.cache_misses``): "bus" (any device), or "auto" on a CUDA device — either only where the
    ``available`` host bytes (None: unknown) hold the copy's ``need`` with :attr:`HostMirror.MARGIN` beside it;
    never "cpu". The planner and :meth:`HostMirror.build` both ask this, so a plan never prices a copy that the
    placement then cannot make."""
    fits = available is None or need + HostMirror.MARGIN <= available
    return fits and (mode == "bus" or (mode == "auto" and device_type == "cuda"))


class HostMirror:
    """Every expert of ``layers`` in host memory at a slot layout (page-locked on CUDA), for the fused kernels to
    read where the pool lacks an expert (a cache miss computed on the device, its bytes read over the bus:
    zero-copy). :meth:`offsets` gives each expert's byte offset from a pool's base (its host address less the
    pool's), the kind of offset the kernels take for a slot.

    A re-placement of the same model reuses the copy (:meth:`build`'s ``reuse``): its bytes do not depend on the
    pool. :meth:`build` returns None where :func:`misses_over_bus` says no (the machine's available memory cannot
    hold the copy)."""

    MARGIN = 4 << 30  # host memory left free beside the copy

    def __init__(self, pool: ExpertPool, layers: list[int], progress: Progress | None = None):
        """progress(k, n, what): called after each of the n layers is copied (the copy reads the whole file's
        experts: seconds from the page cache, longer from a disk)."""
        self.layers, self.layout = sorted(layers), pool.layout
        self._sources = _sources(pool, self.layers)  # what was copied: the mapped bytes' addresses and shapes
        stacks, lay = pool.stacks, pool.layout
        self.n_exp = n_exp = max(stacks[i].gate.n_experts for i in self.layers)
        self.nbytes = mirror_bytes([stacks[i].gate.n_experts for i in self.layers], lay.stride)
        self._map = mmap.mmap(-1, self.nbytes)  # anonymous, page-aligned
        self.buf = np.frombuffer(self._map, dtype=np.uint8).reshape(len(self.layers), n_exp, lay.stride)
        n = len(self.layers)
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="sharpi-mirror") as ex:
            for j, i in enumerate(self.layers):
                jobs = []
                for r in ROLES:
                    src = pool.expert_bytes[(i, r)]  # uint8 [E, role bytes] of the memory map
                    off = lay.role_offset[r]
                    dst = self.buf[j, : src.shape[0], off : off + src.shape[1]]
                    # an expert a job: several threads read the map (one reads page-cache bytes at a fraction
                    # of the memory's bandwidth)
                    jobs += [ex.submit(np.copyto, dst[e], src[e]) for e in range(src.shape[0])]
                for f in jobs:
                    f.result()
                if progress is not None:
                    progress(j + 1, n, MIRROR_PROGRESS)
        self.device_type = pool.device.type
        if self.device_type == "cuda":
            err = torch.cuda.cudart().cudaHostRegister(self.buf.ctypes.data, self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the experts' host copy failed: {err}")
        # Unregistered (after the device's work) before the map can go: when the mirror is collected, or at close.
        self._release = weakref.finalize(self, _release_mirror, self._map, self.device_type == "cuda")

    def rows(self) -> dict[int, np.ndarray]:
        """layer -> uint8 [E, stride]: its experts at the slot layout (for :attr:`ExpertPool.mirror_rows`)."""
        return {i: self.buf[j] for j, i in enumerate(self.layers)}

    def offsets(self, pool: ExpertPool) -> torch.Tensor:
        """int64 [layers, E] on ``pool``'s device: expert e of layer i at ``offsets[i, e]`` bytes from the pool's
        base; −1 for layers not mirrored."""
        base = self.buf.ctypes.data - pool.pool.data_ptr()
        table = np.full((max(self.layers) + 1, self.n_exp), -1, dtype=np.int64)
        for j, i in enumerate(self.layers):
            table[i] = base + (j * self.n_exp + np.arange(self.n_exp, dtype=np.int64)) * self.layout.stride
        return torch.from_numpy(table).to(pool.device)

    def serves(self, pool: ExpertPool, layers: list[int]) -> bool:
        """Whether this copy holds ``layers`` of ``pool``'s experts at its layout (and is still open)."""
        return (
            self.buf is not None
            and _sources(pool, layers).items() <= self._sources.items()
            and self.layout == pool.layout
            and self.device_type == pool.device.type
            and set(layers) <= set(self.layers)
        )

    @classmethod
    def build(
        cls,
        pool: ExpertPool,
        layers: list[int],
        mode: str,
        reuse: HostMirror | None = None,
        progress: Progress | None = None,
    ) -> HostMirror | None:
        """The mirror of ``layers`` where :func:`misses_over_bus` says so for ``mode`` (``cache_misses``) and the
        host memory available, else None (a "bus" asked for that does not fit is said in the log). ``reuse``: the
        copy an earlier placement of this model made — returned where it serves, else closed first (so that two
        never hold the memory at once). ``progress``: told of each layer copied (a new copy only)."""
        if reuse is not None and layers and reuse.serves(pool, layers) and mode != "cpu":
            return reuse
        if reuse is not None:
            reuse.close()
        if not layers:
            return None
        need = mirror_bytes([pool.stacks[i].gate.n_experts for i in layers], pool.layout.stride)
        available = available_ram()
        if misses_over_bus(mode, pool.device.type, need, available):
            return cls(pool, layers, progress)
        if mode == "bus":
            log.warning(
                "expert cache: misses stay on the CPU — their host copy needs %.1f GiB, %.1f GiB available",
                need / 2**30, available / 2**30,
            )  # fmt: skip
        return None

    def close(self) -> None:
        """Unregister and free the copy (the device must no longer read it)."""
        self.buf = None
        self._release()


def _sources(pool: ExpertPool, layers) -> dict:
    """{(layer, role): (address, shape)} of the mapped expert bytes a mirror of ``layers`` copies."""
    return {
        (i, r): (pool.expert_bytes[(i, r)].ctypes.data, pool.expert_bytes[(i, r)].shape) for i in layers for r in ROLES
    }


def _release_mirror(m: mmap.mmap, registered: bool) -> None:
    if registered:
        try:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(np.frombuffer(m, dtype=np.uint8).ctypes.data)
        except RuntimeError:  # CUDA already shut down (interpreter exit): the process's memory goes with it
            return
    try:
        m.close()
    except BufferError:  # a view of it still lives: the map goes with the last one
        pass
