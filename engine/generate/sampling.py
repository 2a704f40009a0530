"""Token sampling: penalties → top-k → top-p → min-p → temperature → draw (llama.cpp's default chain).

:meth:`Sampler.__call__` never sorts the whole vocabulary: the head of the order it needs (the top-k,
or without top-k a head that holds what top-p / min-p keep) comes from :func:`head_order` in O(V) — on a
151936-token vocabulary 0.31 ms against 13 ms for the full ``argsort`` the chain is written with
(``sharpi bench sampler``; docs/benchmarks.md). :meth:`Sampler.reference`
is that chain with the full sort, kept as the specification; the tests hold the two to the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import njit

NUMBA_MAX_K = 1024  # head sizes the one-pass selection serves (larger: numpy's partition)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature <= 0`` is greedy (argmax)."""

    temperature: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off; divides positive logits of recent tokens
    presence_penalty: float = 0.0  # subtracted once from every recent token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence
    repeat_last_n: int = 64  # window of recent tokens the penalties look at
    seed: int | None = None  # None = random
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (not included in output)

    def __post_init__(self):
        """The one place sampling settings are checked, for the CLI, the app and the API alike: values a
        peer treats as "off" are clamped as llama.cpp does (temperature < 0 → greedy, top_k < 0 → off,
        top_p > 1 → off, a negative seed → random); anything else out of range is a UsageError naming
        the parameter."""
        from engine.errors import UsageError

        def number(name: str, lo: float | None = None, hi: float | None = None, *, open_lo: bool = False):
            v = getattr(self, name)
            try:  # float() of a whole number past float's range overflows: not finite either
                finite = isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v))
            except OverflowError:
                finite = False
            if isinstance(v, bool) or not finite:
                raise UsageError(f"sampling parameter {name} must be a finite number, got {v!r}")
            if lo is not None and (v < lo or (open_lo and v == lo)):
                raise UsageError(f"sampling parameter {name} must be {'>' if open_lo else '≥'} {lo}, got {v!r}")
            if hi is not None and v > hi:
                raise UsageError(f"sampling parameter {name} must be ≤ {hi}, got {v!r}")
            return float(v)

        def whole(name: str, lo: int):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise UsageError(f"sampling parameter {name} must be a whole number, got {v!r}")
            if v < lo:
                raise UsageError(f"sampling parameter {name} must be ≥ {lo}, got {v!r}")
            return int(v)

        fix = {
            "temperature": max(0.0, number("temperature")),
            "top_p": min(1.0, number("top_p", 0.0)),
            "min_p": number("min_p", 0.0, 1.0),
            "repeat_penalty": number("repeat_penalty", 0.0, open_lo=True),
            "presence_penalty": number("presence_penalty"),
            "frequency_penalty": number("frequency_penalty"),
            "top_k": max(0, whole("top_k", -(1 << 62))),
            "repeat_last_n": whole("repeat_last_n", 0),
            "max_tokens": whole("max_tokens", 1),
        }
        if self.seed is not None:
            fix["seed"] = None if whole("seed", -(1 << 62)) < 0 else int(self.seed)
        if isinstance(self.stop, str) or not all(isinstance(x, str) for x in self.stop):
            raise UsageError(f"sampling parameter stop must be a list of strings, got {self.stop!r}")
        fix["stop"] = tuple(self.stop)
        for name, value in fix.items():
            object.__setattr__(self, name, value)

    @classmethod
    def greedy(cls, max_tokens: int = 256, **kw) -> SamplingParams:
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=max_tokens, **kw)


@njit(cache=True, nogil=True)
def _kth_largest(vals: np.ndarray, k: int) -> np.float32:
    """The k-th largest of ``vals`` float32 (NaN never counts; -inf where fewer than k values count): a
    k-slot min-heap over one pass."""
    heap = np.full(k, -np.inf, dtype=np.float32)
    for v in vals:
        if v > heap[0]:  # replace the smallest of the k largest so far, sift down
            heap[0] = v
            i = 0
            while True:
                c = 2 * i + 1
                if c >= k:
                    break
                if c + 1 < k and heap[c + 1] < heap[c]:
                    c += 1
                if heap[c] < heap[i]:
                    heap[i], heap[c] = heap[c], heap[i]
                    i = c
                else:
                    break
    return heap[0]


@njit(cache=True, nogil=True)
def _at_least(key: np.ndarray, thr: np.float32, idx: np.ndarray) -> np.ndarray:
    """The entries of ``idx`` (ascending) whose key is >= thr."""
    n = 0
    for i in idx:
        n += key[i] >= thr
    out = np.empty(n, dtype=np.int64)
    j = 0
    for i in idx:
        if key[i] >= thr:
            out[j] = i
            j += 1
    return out


@njit(cache=True, nogil=True)
def _scan_at_least_kth(key: np.ndarray, k: int) -> np.ndarray:
    """Indices i (ascending) with key[i] >= the k-th largest of key (NaN never counts): the heap over every
    entry, then a scan. Fewer than k entries back: NaN among the k largest (the caller sorts instead)."""
    return _at_least(key, _kth_largest(key, k), np.arange(len(key)))


@njit(cache=True, nogil=True)
def _chunks_at_least_kth(key: np.ndarray, k: int, maxima: np.ndarray, size: int) -> np.ndarray:
    """:func:`_scan_at_least_kth` given the maxima of key's chunks of ``size`` (the last chunk takes the
    remainder; no NaN among them): the k-th largest maximum bounds the k-th largest entry from below (k
    chunks each hold an entry at least that large), so only chunks reaching the bound are read."""
    V, n_ch = len(key), len(maxima)
    t0 = _kth_largest(maxima, k)
    cand = np.empty(V, dtype=np.int64)  # only its first n entries are written
    n = 0
    for c in range(n_ch):
        if maxima[c] < t0:
            continue
        hi = V if c == n_ch - 1 else (c + 1) * size
        for i in range(c * size, hi):
            if key[i] >= t0:
                cand[n] = i
                n += 1
    vals = np.empty(n, dtype=np.float32)
    for j in range(n):
        vals[j] = key[cand[j]]
    return _at_least(key, _kth_largest(vals, k), cand[:n])


CHUNKS_PER_K = 8  # chunks a head of k reads the maxima of (the bound's candidates: about k + a few)


def _at_least_kth(key: np.ndarray, k: int) -> np.ndarray:
    """Indices i (ascending) with key[i] >= the k-th largest of key (float32; NaN never counts). Fewer than k
    entries back: NaN among the k largest (the caller sorts instead). The chunks' maxima come from NumPy's
    vectorised max (one pass over the vocabulary); then only the few chunks that can hold the k largest are
    read (:func:`_chunks_at_least_kth`); a key with NaN takes the plain scan (:func:`_scan_at_least_kth`)."""
    V = len(key)
    size = V // (CHUNKS_PER_K * k)
    if size < 16:
        return _scan_at_least_kth(key, k)
    n_ch = V // size
    maxima = key[: n_ch * size].reshape(n_ch, size).max(1)
    if n_ch * size < V:
        maxima[-1] = max(maxima[-1], key[n_ch * size :].max())
    if np.isnan(maxima).any():
        return _scan_at_least_kth(key, k)
    return _chunks_at_least_kth(key, k, maxima, size)


def head_order(x: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` of ``np.argsort(-x, kind="stable")`` (the k largest of x, larger first, equal
    values by index) without sorting all of x: the k-th largest float32 key bounds a candidate set that
    holds them (rounding to float32 keeps order, so anything under that bound has k larger values),
    and only the candidates are sorted exactly. NaN logits (a broken model) take the full sort."""
    V = len(x)
    if k >= V:
        return np.argsort(-x, kind="stable")
    key = x.astype(np.float32, copy=False)
    if k <= NUMBA_MAX_K:
        cand = _at_least_kth(key, k)
    else:
        cand = np.flatnonzero(key >= key[np.argpartition(-key, k - 1)[:k]].min())
    if len(cand) < k:  # NaN among the largest
        return np.argsort(-x, kind="stable")[:k]
    return cand[np.lexsort((cand, -x[cand]))][:k]


class Sampler:
    HEAD = 256  # the first head tried without top-k (grown ×8 until it holds what the chain keeps)

    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def penalises(self, history: list[int] | None) -> bool:
        """Whether :meth:`apply_penalties` changes anything for ``history``."""
        p = self.p
        return bool(history) and (p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.p
        if not self.penalises(history):
            return logits
        recent = np.asarray(history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history, dtype=np.int64)
        ids, counts = np.unique(recent, return_counts=True)
        out = logits.copy()
        v = out[ids]
        with np.errstate(over="ignore"):  # finite settings can still overflow (a penalty of -1e308, ...):
            if p.repeat_penalty != 1.0:
                v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
            v = v - counts * p.frequency_penalty - p.presence_penalty
        # kept within float32's range (the head search orders float32 keys): +inf, or inf - inf = NaN, would
        # make every probability NaN
        big = float(np.finfo(np.float32).max)
        out[ids] = np.clip(np.where(np.isnan(v), -big, v), -big, big)
        return out

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        """logits float32 [V] -> token id: :meth:`reference`'s draw, without sorting the vocabulary."""
        p = self.p
        x = np.asarray(logits)
        if x.dtype != np.float32 or self.penalises(history):
            x = self.apply_penalties(np.asarray(logits, dtype=np.float64), history or [])
        # else float32 as given: its order is float64's (exact widening), and the head's values are widened
        # before any arithmetic (_softmax_head), so no copy of the vocabulary is made
        if p.temperature <= 0:
            return int(np.argmax(x))
        V = len(x)
        if p.top_k > 0:
            order, z, probs = self._top_p(*self._softmax_head(x, head_order(x, p.top_k)))
        else:
            x = np.asarray(x, dtype=np.float64)
            # no top-k: probabilities over the whole vocabulary, over a sorted head grown (×8) until it
            # holds every token the chain can keep — the top-p cut falls inside it, or its last token is
            # already under the min-p bar — or is the whole vocabulary. (The total is summed in index
            # order, the reference sums in sorted order: a cut can differ only where a running sum lands
            # within rounding of top_p.)
            top = float(x.max())
            total = np.exp(x - top).sum()
            m = self.HEAD if p.top_p < 1.0 or p.min_p > 0.0 else V  # nothing cuts: the whole order
            while True:
                order = head_order(x, min(m, V))
                z = x[order]
                probs = np.exp(z - z[0]) / total
                done = m >= V
                if p.top_p < 1.0:
                    c = np.cumsum(probs)
                    if c[-1] >= p.top_p:
                        keep = int(np.searchsorted(c, p.top_p) + 1)
                        order, z, probs = order[:keep], z[:keep], probs[:keep]
                        done = True
                if done or (p.min_p > 0.0 and probs[-1] < p.min_p * probs[0]):
                    break
                m = m * 8 if m * 8 < V // 4 else V  # a head past a quarter: the full sort is cheaper
        return self._finish(order, z, probs)

    @staticmethod
    def _softmax_head(x, order):
        """(order, its logits z as float64, their softmax over the head)."""
        z = x[order].astype(np.float64)
        probs = np.exp(z - z[0])
        return order, z, probs / probs.sum()

    def _top_p(self, order, z, probs):
        """The head cut where its running probability reaches top_p (unchanged at top_p = 1)."""
        if self.p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), self.p.top_p) + 1)
            order, z, probs = order[:keep], z[:keep], probs[:keep]
        return order, z, probs

    def _finish(self, order, z, probs) -> int:
        """min-p, temperature and the draw over the head that top-k / top-p left."""
        p = self.p
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, z = order[keep], z[keep]
        probs = np.exp((z - z.max()) / p.temperature)  # shifted first: a tiny temperature cannot overflow
        probs /= probs.sum()
        return int(order[self.rng.choice(len(order), p=probs)])

    def distribution(self, logits: np.ndarray, history: list[int] | None = None) -> np.ndarray:
        """The probabilities float64 [V] :meth:`reference` draws from (penalties, top-k, top-p, min-p,
        temperature; greedy: all on the argmax): what speculative sampling compares draft and trunk by."""
        p = self.p
        x = self.apply_penalties(np.asarray(logits, dtype=np.float64), history or [])
        out = np.zeros(len(x), np.float64)
        if p.temperature <= 0:
            out[int(np.argmax(x))] = 1.0
            return out
        order = np.argsort(-x, kind="stable")
        if p.top_k > 0:
            order = order[: p.top_k]
        order, z, probs = self._top_p(*self._softmax_head(x, order))
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, z = order[keep], z[keep]
        q = np.exp((z - z.max()) / p.temperature)
        out[order] = q / q.sum()
        return out

    def reference(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        """The chain as written, over a full stable sort of the vocabulary (the specification)."""
        p = self.p
        x = self.apply_penalties(np.asarray(logits, dtype=np.float64), history or [])
        if p.temperature <= 0:
            return int(np.argmax(x))
        order = np.argsort(-x, kind="stable")
        if p.top_k > 0:
            order = order[: p.top_k]
        return self._finish(*self._top_p(*self._softmax_head(x, order)))
