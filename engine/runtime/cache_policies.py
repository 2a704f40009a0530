"""Expert-cache policies behind one interface, replayed on routing traces (``engine.routes``).

One policy instance serves one MoE layer's ``n_slots`` device slots over ``n_expert`` experts. A token's
experts (``ids`` int [k], distinct) arrive together: each is a **hit** if it is resident when the token
starts; the policy then updates its state — admitting missed experts (uploading them) or **bypassing**
them (they run on the CPU and are not cached). An expert the token uses is never evicted for another of
the same token while a slot outside the token is free to go (the runtime's working-set protection).

=========  ===================================================================================================
``lru``    least recently used; every miss is admitted
``slru``   the runtime's segmented LRU (:class:`engine.runtime.slru.SegmentedLRU`, used as is)
``dlfu``   the runtime's decayed-frequency residency with anti-thrash hysteresis (the seed's residency planner,
           :class:`engine.runtime.slot_policies.SlotDecayedLFU`, used as is): a score per expert, decayed a
           token, +1 a use; a miss replaces the lowest-scored resident outside the token only if its score
           beats that one's by ``margin``, else it is bypassed
``admit``  LRU eviction behind a frequency admission filter (TinyLFU's idea): a miss is admitted only if its
           decayed use count is at least the LRU victim's, else bypassed
``belady`` the offline optimum (needs the whole trace): after each token keep the ``n_slots`` experts, among
           the resident ones and the token's, whose next use comes soonest; the rest are evicted or bypassed
=========  ===================================================================================================

:func:`replay` runs a policy over one layer's trace ``[T, k]`` and returns the hit mask.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from engine.runtime.slot_policies import DEFAULT_SLOT_POLICY, SlotDecayedLFU
from engine.runtime.slru import SegmentedLRU


class CachePolicy:
    """A policy over one layer: :meth:`step` takes one token's experts, returns which were hits, and updates."""

    name = ""

    def __init__(self, n_slots: int, n_expert: int):
        if n_slots < 0 or n_expert < 1:
            raise ValueError("n_slots >= 0 and n_expert >= 1 are required")
        self.n_slots, self.n_expert = n_slots, n_expert
        self.uploads = 0  # missed experts admitted (copied to the device) so far

    def step(self, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def holds(self, e: int) -> bool:
        """Whether expert ``e`` is resident now."""
        raise NotImplementedError

    def run(self, ids: np.ndarray) -> np.ndarray:
        """bool [T, k]: which of each token's experts (``ids`` int [T, k]) were hits; counts :attr:`uploads`."""
        ids = np.asarray(ids)
        out = np.zeros(ids.shape, bool)
        for t, row in enumerate(ids):
            out[t] = self.step(row)
            self.uploads += sum(self.holds(int(e)) for e in row[~out[t]])
        return out


class LRU(CachePolicy):
    name = "lru"

    def __init__(self, n_slots: int, n_expert: int):
        super().__init__(n_slots, n_expert)
        self.order: OrderedDict[int, None] = OrderedDict()  # least recent first

    def step(self, ids):
        ids = [int(e) for e in ids]
        hits = np.array([e in self.order for e in ids])
        for e in ids:
            self.order[e] = None
            self.order.move_to_end(e)
        while len(self.order) > self.n_slots:  # the token's own experts are the most recent: they go last
            self.order.popitem(last=False)
        return hits

    def holds(self, e):
        return e in self.order


class SLRU(CachePolicy):
    name = "slru"

    def __init__(self, n_slots: int, n_expert: int):
        super().__init__(n_slots, n_expert)
        self.cache = SegmentedLRU(n_slots)

    def step(self, ids):
        ids = [int(e) for e in ids]
        hits = np.array([e in self.cache for e in ids])
        for e, hit in zip(ids, hits):
            if hit:
                self.cache.hit(e)
            else:
                self.cache.admit(e, working_set=ids)  # None: every slot is the token's own (a bypass)
        return hits

    def holds(self, e):
        return e in self.cache


class DecayedLFU(CachePolicy):
    """The runtime's ``dlfu`` (:class:`engine.runtime.slot_policies.SlotDecayedLFU`, used as is) over one layer:
    a token's misses asking for a slot strongest first, the token's experts its working set."""

    name = "dlfu"

    def __init__(self, n_slots: int, n_expert: int, **kw: float):
        super().__init__(n_slots, n_expert)
        self.slots = SlotDecayedLFU(n_slots, 1, n_expert, **kw)

    def step(self, ids):
        ids = np.asarray(ids, np.int64)
        hits = self.slots.resident[0, ids].copy()
        self.slots.observe(0, ids[None])
        score = self.slots.score()[0]
        working = [(0, int(e)) for e in ids]
        for e in sorted(ids[~hits].tolist(), key=lambda x: (-score[x], x)):  # the strongest newcomers first
            self.slots.admit((0, e), working)
        return hits

    def holds(self, e):
        return bool(self.slots.resident[0, e])


class AdmitLRU(CachePolicy):
    name = "admit"
    DECAY = 0.9

    def __init__(self, n_slots: int, n_expert: int, decay: float | None = None):
        super().__init__(n_slots, n_expert)
        self.decay = self.DECAY if decay is None else decay
        self.freq = np.zeros(n_expert)
        self.order: OrderedDict[int, None] = OrderedDict()

    def step(self, ids):
        ids = [int(e) for e in ids]
        hits = np.array([e in self.order for e in ids])
        self.freq *= self.decay
        self.freq[ids] += 1.0
        for e, hit in zip(ids, hits):
            if hit:
                self.order.move_to_end(e)
                continue
            if len(self.order) < self.n_slots:
                self.order[e] = None
                continue
            victim = next((v for v in self.order if v not in ids), None)
            if victim is not None and self.freq[e] >= self.freq[victim]:
                del self.order[victim]
                self.order[e] = None
        return hits

    def holds(self, e):
        return e in self.order


class Belady(CachePolicy):
    """Offline: :meth:`run` sees the whole layer trace (:meth:`step` has no future to look at)."""

    name = "belady"

    def step(self, ids):
        raise TypeError("Belady's optimum is offline: use run(ids) over the whole trace")

    def run(self, ids):
        ids = np.asarray(ids, np.int64)
        T = len(ids)
        nxt = next_use(ids)  # [T, k]: the token at which each access's expert is used next (T: never)
        resident: dict[int, int] = {}  # expert -> its next use
        hits = np.zeros(ids.shape, bool)
        for t in range(T):
            for j, e in enumerate(ids[t]):
                hits[t, j] = int(e) in resident
            for j, e in enumerate(ids[t]):
                resident[int(e)] = int(nxt[t, j])
            if len(resident) > self.n_slots:  # keep the soonest-needed; never-again ones go first
                keep = sorted(resident.items(), key=lambda kv: (kv[1], kv[0]))[: self.n_slots]
                resident = {e: n for e, n in keep if n < T}
            else:
                resident = {e: n for e, n in resident.items() if n < T}
            self.uploads += sum(int(e) in resident for e in ids[t][~hits[t]])
        return hits


def next_use(ids: np.ndarray) -> np.ndarray:
    """int [T, k]: for each access ``ids[t, j]``, the next token that uses that expert again (T if none)."""
    T = len(ids)
    out = np.full(ids.shape, T, np.int64)
    seen: dict[int, int] = {}
    for t in range(T - 1, -1, -1):
        for j, e in enumerate(ids[t]):
            out[t, j] = seen.get(int(e), T)
        for e in ids[t]:
            seen[int(e)] = t
    return out


POLICIES: dict[str, type[CachePolicy]] = {p.name: p for p in (LRU, SLRU, DecayedLFU, AdmitLRU, Belady)}


# The policy `sharpi bench cache` calls the default: the runtime cache's default, whose hit rates the planner's
# hit-rate curve assumes.
DEFAULT_POLICY = DEFAULT_SLOT_POLICY


def replay(policy: str | type[CachePolicy], ids: np.ndarray, n_slots: int, n_expert: int, **kw) -> np.ndarray:
    """bool [T, k]: the hits of ``policy`` (a name of :data:`POLICIES` or a class) over one layer's ``ids``."""
    return make(policy, n_slots, n_expert, **kw).run(ids)


def make(policy: str | type[CachePolicy], n_slots: int, n_expert: int, **kw) -> CachePolicy:
    cls = POLICIES[policy] if isinstance(policy, str) else policy
    return cls(n_slots, n_expert, **kw)
