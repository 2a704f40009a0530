"""Segmented LRU over a fixed set of device slots, keyed by (layer, expert).

Probationary (25 % of the slots) takes new entries; a second hit promotes an entry to the
protected segment (75 %); when that overflows, its least recently used entry is demoted back to
the probationary MRU end. A victim is the least recently used probationary entry (falling back
to the protected segment) that is neither pinned nor in the current token's working set — an
expert a token is about to use is never evicted under it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

PROBATION_SHARE = 0.25


class SegmentedLRU:
    """The ``slru`` slot policy (``engine.runtime.slot_policies``: the same interface)."""

    name = "slru"

    def __init__(self, n_slots: int):
        if n_slots < 0:
            raise ValueError("n_slots must be >= 0")
        self.n_slots = n_slots
        self.protected_cap = n_slots - max(1, round(n_slots * PROBATION_SHARE)) if n_slots > 1 else 0
        self.probation: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, LRU first
        self.protected: OrderedDict[Hashable, int] = OrderedDict()
        self.pinned: set[Hashable] = set()
        self.free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def slot(self, key: Hashable) -> int | None:
        """The slot of ``key`` without touching recency (None if absent)."""
        return self.probation.get(key, self.protected.get(key))

    def keys(self) -> list[Hashable]:
        return list(self.probation) + list(self.protected)

    def observe(self, layer: int, ids) -> None:
        """A layer pass's experts: recency is kept by :meth:`hit` and :meth:`admit` alone."""

    def hit(self, key: Hashable) -> int | None:
        """Record a use of ``key``: its slot, promoted/refreshed; None on a miss (nothing changes)."""
        if key in self.protected:
            self.protected.move_to_end(key)
            return self.protected[key]
        if key in self.probation:
            slot = self.probation.pop(key)
            if self.protected_cap == 0:
                self.probation[key] = slot  # no protected segment: plain LRU
                return slot
            self.protected[key] = slot
            while len(self.protected) > self.protected_cap:
                k, s = self.protected.popitem(last=False)
                self.probation[k] = s  # demote to the probationary MRU end
            return slot
        return None

    def admit(self, key: Hashable, working_set: Iterable[Hashable] = ()) -> tuple[int, Hashable | None] | None:
        """Give ``key`` a slot: (slot, evicted key or None), or None if every entry is protected
        by the working set or a pin. ``key`` must not be cached already."""
        if key in self:
            raise KeyError(f"{key!r} is already cached")
        if self.free:
            slot = self.free.pop()
            self.probation[key] = slot
            return slot, None
        keep = set(working_set) | self.pinned
        for segment in (self.probation, self.protected):
            for victim in segment:
                if victim not in keep:
                    slot = segment.pop(victim)
                    self.probation[key] = slot
                    self.evictions += 1
                    return slot, victim
        return None

    def pin(self, key: Hashable) -> None:
        """Never evict ``key`` (it need not be cached yet)."""
        self.pinned.add(key)

    def unpin(self, key: Hashable) -> None:
        self.pinned.discard(key)
