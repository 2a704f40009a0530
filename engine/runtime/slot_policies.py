"""The runtime expert cache's slot policies: which (layer, expert) holds which of the pool's slots.

One interface (:class:`SlotPolicy`), the one :class:`engine.runtime.expert_pool.ExpertPool` calls, chosen by
name (``EngineOptions.cache_policy``, ``--cache-policy``; :func:`make_slots`):

=========  ===================================================================================================
``lru``    least recently used (:class:`SlotLRU`)
``slru``   segmented LRU (:class:`engine.runtime.slru.SegmentedLRU`)
``dlfu``   decayed-frequency residency with anti-thrash hysteresis (:class:`SlotDecayedLFU`): may refuse a
           slot (the expert then runs on the CPU), so a small cache does not thrash
=========  ===================================================================================================

The pool tells a policy each layer pass's experts first (:meth:`SlotPolicy.observe`), then each hit
(:meth:`SlotPolicy.hit`), then asks for a slot for each miss it wants to upload (:meth:`SlotPolicy.admit`:
``(slot, evicted key or None)``, or None — nothing evicted, the expert stays on the CPU). A working set
(the pass's own experts) and pinned keys are never evicted. Policies change where experts are computed,
never what they compute. The trace replay (``engine.runtime.cache_policies``) drives the same classes one
token at a time, so ``sharpi bench cache`` measures the policy the runtime runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

import numpy as np

from engine.runtime.slru import SegmentedLRU

Key = tuple[int, int]  # (layer, expert)


class SlotPolicy:
    """Slot bookkeeping shared by the policies: free slots (slot 0 first), key -> slot, pins, evictions.
    A subclass picks the victim (:meth:`_victim`) and keeps its own order or scores."""

    name = ""

    def __init__(self, n_slots: int):
        if n_slots < 0:
            raise ValueError("n_slots must be >= 0")
        self.n_slots = n_slots
        self.where: dict[Hashable, int] = {}
        self.pinned: set[Hashable] = set()
        self.free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.where

    def __len__(self) -> int:
        return len(self.where)

    def slot(self, key: Hashable) -> int | None:
        """The slot of ``key`` without touching its standing (None if absent)."""
        return self.where.get(key)

    def keys(self) -> list[Hashable]:
        return list(self.where)

    def observe(self, layer: int, ids: np.ndarray) -> None:
        """One pass of ``layer``: ``ids`` int [T, k], each token's experts (before its hits and admits)."""

    def hit(self, key: Hashable) -> int | None:
        """Record a use of a resident ``key``: its slot; None on a miss (nothing changes)."""
        return self.where.get(key)

    def admit(self, key: Hashable, working_set: Iterable[Hashable] = ()) -> tuple[int, Hashable | None] | None:
        """Give ``key`` a slot: (slot, evicted key or None), or None when the policy keeps what it holds (every
        candidate is in ``working_set`` or pinned, or — :class:`SlotDecayedLFU` — none is worth less)."""
        if key in self.where:
            raise KeyError(f"{key!r} is already cached")
        if self.free:
            slot = self.free.pop()
            self._insert(key, slot)
            return slot, None
        victim = self._victim(key, set(working_set) | self.pinned)
        if victim is None:
            return None
        slot = self.where.pop(victim)
        self._removed(victim)
        self.evictions += 1
        self._insert(key, slot)
        return slot, victim

    def pin(self, key: Hashable) -> None:
        """Never evict ``key`` (it need not be cached yet)."""
        self.pinned.add(key)

    def unpin(self, key: Hashable) -> None:
        self.pinned.discard(key)

    def _insert(self, key: Hashable, slot: int) -> None:
        self.where[key] = slot

    def _removed(self, key: Hashable) -> None:
        pass

    def _victim(self, key: Hashable, keep: set) -> Hashable | None:
        raise NotImplementedError


class SlotLRU(SlotPolicy):
    """The least recently used key outside the working set and the pins goes."""

    name = "lru"

    def __init__(self, n_slots: int):
        super().__init__(n_slots)
        self.order: OrderedDict[Hashable, None] = OrderedDict()  # least recent first

    def hit(self, key):
        if key in self.where:
            self.order.move_to_end(key)
        return self.where.get(key)

    def _insert(self, key, slot):
        super()._insert(key, slot)
        self.order[key] = None

    def _removed(self, key):
        del self.order[key]

    def _victim(self, key, keep):
        return next((k for k in self.order if k not in keep), None)


class SlotDecayedLFU(SlotPolicy):
    """Use counts per (layer, expert), each layer on its own clock (a token of that layer), at three time scales
    and over a window:

    - ``recent`` ×``RECENT_DECAY`` a token: the last few tokens, where reuse is strongest;
    - ``window``: uses in the layer's last ``WINDOW`` tokens (reuse a few tokens back, which an exponential
      decay fast enough for the previous token forgets too soon);
    - ``freq`` ×``FREQ_DECAY`` and ``long`` ×``LONG_DECAY``: the layer's drifting popularity and its lasting one,

    scored ``recent + WINDOW_WEIGHT · window + FREQ_WEIGHT · freq + LONG_WEIGHT · long``. A miss takes a free
    slot, else the slot of the lowest-scored key outside the working set and the pins when it scores more than
    that one plus ``margin`` (hysteresis: near-ties do not swap back and forth); else it is refused and runs on
    the CPU. Tuned on seed 0 of the synthetic Qwen3-30B-A3B trace, checked on seeds 1-3 (docs/benchmarks.md,
    *Expert-cache policies*)."""

    name = "dlfu"
    RECENT_DECAY = 0.6
    WINDOW = 8
    WINDOW_WEIGHT = 0.3
    FREQ_DECAY = 0.98
    FREQ_WEIGHT = 1 / 16
    LONG_DECAY = 0.999
    LONG_WEIGHT = 1 / 256
    MARGIN = 0.05
    KNOBS = ("margin", "recent_decay", "window", "window_weight", "freq_decay", "freq_weight", "long_decay",
             "long_weight")  # fmt: skip

    def __init__(self, n_slots: int, n_layers: int, n_expert: int, **knobs: float):
        super().__init__(n_slots)
        unknown = set(knobs) - set(self.KNOBS)
        if unknown:
            raise TypeError(f"unknown dlfu knobs: {', '.join(sorted(unknown))}")
        for k in self.KNOBS:
            v = knobs.get(k)
            setattr(self, k, getattr(self, k.upper()) if v is None else v)
        self.window = int(self.window)
        shape = (n_layers, n_expert)
        self.recent, self.freq, self.long = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self.in_window = np.zeros(shape)  # uses in each layer's last `window` tokens
        self._rows: list[list[np.ndarray]] = [[] for _ in range(n_layers)]  # those tokens' experts, oldest first
        self.resident = np.zeros(shape, bool)
        self._score: np.ndarray | None = None  # until the next observe

    def observe(self, layer, ids):
        ids = np.array(ids, np.int64).reshape(len(ids), -1)  # a copy: the window keeps rows of it (a caller's
        T = len(ids)  # buffer, e.g. the static step's routes, is overwritten next step)
        if T == 0:
            return
        decays = ((self.recent, self.recent_decay), (self.freq, self.freq_decay), (self.long, self.long_decay))
        if T == 1:  # a decode step: one token
            for counts, d in decays:
                counts[layer] *= d
                counts[layer, ids[0]] += 1.0
        else:  # a prompt: token t's uses decayed by the T-1-t tokens after it
            age = np.repeat(T - 1 - np.arange(T, dtype=np.float64), ids.shape[1])
            for counts, d in decays:
                counts[layer] *= d**T
                np.add.at(counts[layer], ids.ravel(), d**age)
        rows, win = self._rows[layer], self.in_window[layer]
        if self.window <= T:  # the pass's last `window` tokens are the window
            rows[:] = list(ids[T - self.window :]) if self.window else []
            win[:] = np.bincount(ids[T - self.window :].ravel(), minlength=win.size) if self.window else 0.0
        else:
            for row in ids:
                rows.append(row)
                win[row] += 1.0
                if len(rows) > self.window:
                    win[rows.pop(0)] -= 1.0
        self._score = None

    def score(self) -> np.ndarray:
        """float [layers, E]: every key's score now."""
        if self._score is None:
            self._score = (
                self.recent
                + self.window_weight * self.in_window
                + self.freq_weight * self.freq
                + self.long_weight * self.long
            )
        return self._score

    def _insert(self, key, slot):
        super()._insert(key, slot)
        self.resident[key] = True

    def _removed(self, key):
        self.resident[key] = False

    def _victim(self, key, keep):
        s = self.score()
        masked = np.where(self.resident, s, np.inf)
        for k in keep:
            if k in self.where:
                masked[k] = np.inf
        victim = np.unravel_index(int(np.argmin(masked)), masked.shape)
        if not np.isfinite(masked[victim]) or not s[key] > masked[victim] + self.margin:
            return None
        return int(victim[0]), int(victim[1])


SLOT_POLICIES = {"lru": SlotLRU, "slru": SegmentedLRU, "dlfu": SlotDecayedLFU}
# The policy the runtime cache uses unless told otherwise: the one `sharpi bench cache` calls default
# (engine.runtime.cache_policies.DEFAULT_POLICY and engine.config.DEFAULT_CACHE_POLICY; a test holds them equal).
DEFAULT_SLOT_POLICY = "dlfu"


def make_slots(name: str, n_slots: int, n_layers: int, n_expert: int) -> SlotPolicy | SegmentedLRU:
    """The policy ``name`` over ``n_slots`` slots, for keys (layer < ``n_layers``, expert < ``n_expert``)."""
    if name not in SLOT_POLICIES:
        raise ValueError(f"unknown cache policy {name!r} (known: {', '.join(SLOT_POLICIES)})")
    if name == "dlfu":
        return SlotDecayedLFU(n_slots, n_layers, n_expert)
    return SLOT_POLICIES[name](n_slots)
