"""The expert profiler: always on, cheap, and read by the GUI through plain-data snapshots.

Per (layer, expert): routed calls, device-cache hits, misses, uploaded bytes, decayed heat and
residency. Per forward pass ("token step"): latency, hit rate and upload MB/s, and for a decoded token
the interval to the next one as the generation loop saw it, kept in a ring of the last ``history`` steps.

The decode window (``engine.generate.events.DecodeWindow``) is the one source of the decode speed and hit rate people see:
the generation loop marks each sampled token (:meth:`ExpertProfiler.decode_started`, :meth:`decode_token`)
and reports the window's figures in its events (the status bar); a snapshot carries the same window and
the per-token intervals it sums (the experts dock's plot). tok/s = tokens after the first ÷ the time from
the first to the last; hit rate = the cache's hits ÷ lookups between them. Recording is a few numpy adds per MoE layer; a snapshot copies a few
small arrays. Export writes JSON (everything) and CSV (one row per layer × expert).
"""

from __future__ import annotations

import csv
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.generate.events import DecodeClock, DecodeWindow

HEAT_DECAY = 0.98  # per token: heat halves after ~34 tokens without a call


@dataclass(frozen=True)
class ProfilerSnapshot:
    """A copy of the profiler's state. Arrays [L, E] are indexed by layer, then expert."""

    n_layer: int
    n_expert: int
    calls: np.ndarray  # int64 [L, E]: (token, expert) routings
    hits: np.ndarray  # int64 [L, E]: served from the device expert cache
    misses: np.ndarray  # int64 [L, E]: not on the device, computed on the CPU
    uploaded_bytes: np.ndarray  # int64 [L, E]: bytes copied host→device
    heat: np.ndarray  # float64 [L, E]: calls decayed by HEAT_DECAY per token
    resident: np.ndarray  # bool [L, E]: on the device now
    step_latency_s: np.ndarray  # float64 [N]: wall time of the last N forward passes
    step_tokens: np.ndarray  # int64 [N]: tokens in each of those passes
    step_hit_rate: np.ndarray  # float64 [N]: hits / (hits + misses) in each pass (nan: no cache)
    step_upload_mb_s: np.ndarray  # float64 [N]: MB uploaded / latency in each pass
    tokens_total: int  # tokens through the model since the last reset
    # float64 [N]: for a one-token pass of a generation, the time from the token it was fed to the next one
    # sampled (the pass, sampling, and whatever the loop's consumer did); nan elsewhere. 1 / it is the
    # decode speed token by token; the window's tok/s is their count over their sum.
    step_interval_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    decode: DecodeWindow = field(default_factory=DecodeWindow)  # the latest generation's decode window
    # Predictive prefetch (engine.runtime.expert_cache, EngineOptions.cache_prefetch); zeros when it is off.
    prefetched: np.ndarray | None = None  # int64 [L, E]: uploads made on a prediction, not a miss
    prefetch_hits: np.ndarray | None = None  # int64 [L, E]: hits on a prefetched expert (its first use)
    # int64 [L, 3]: per layer, over the decode steps it was predicted in: experts predicted, experts it then
    # chose, and both (recall = both / chose, precision = both / predicted)
    prediction: np.ndarray | None = None

    @property
    def hit_rate(self) -> float:
        h, m = int(self.hits.sum()), int(self.misses.sum())
        return h / (h + m) if h + m else float("nan")

    def prefetch_recall(self) -> np.ndarray:
        """float64 [L]: per layer, the share of its chosen experts the prediction named (nan: not predicted)."""
        return _ratio(self.prediction, 2, 1, self.n_layer)

    def prefetch_precision(self) -> np.ndarray:
        """float64 [L]: per layer, the share of the predicted experts it then chose (nan: not predicted)."""
        return _ratio(self.prediction, 2, 0, self.n_layer)

    def to_dict(self) -> dict[str, Any]:
        def arr(a: np.ndarray) -> list:
            return np.where(np.isnan(a), None, a).tolist() if a.dtype.kind == "f" else a.tolist()

        return {
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "tokens_total": self.tokens_total,
            "hit_rate": None if np.isnan(self.hit_rate) else self.hit_rate,
            "calls": arr(self.calls),
            "hits": arr(self.hits),
            "misses": arr(self.misses),
            "uploaded_bytes": arr(self.uploaded_bytes),
            "heat": arr(self.heat),
            "resident": arr(self.resident),
            "decode": {
                "tokens": self.decode.tokens,
                "seconds": self.decode.seconds,
                "tok_s": self.decode.tok_s,
                "hit_rate": self.decode.hit_rate,
                "hits": self.decode.hits,
                "misses": self.decode.misses,
            },
            "prefetch": {
                "uploads": int(self.prefetched.sum()) if self.prefetched is not None else 0,
                "hits": int(self.prefetch_hits.sum()) if self.prefetch_hits is not None else 0,
                "recall": arr(self.prefetch_recall()),
                "precision": arr(self.prefetch_precision()),
                "prefetched": arr(self.prefetched) if self.prefetched is not None else None,
                "prefetch_hits": arr(self.prefetch_hits) if self.prefetch_hits is not None else None,
            },
            "steps": {
                "latency_s": arr(self.step_latency_s),
                "interval_s": arr(self.step_interval_s),
                "tokens": arr(self.step_tokens),
                "hit_rate": arr(self.step_hit_rate),
                "upload_mb_s": arr(self.step_upload_mb_s),
            },
        }


class ExpertProfiler:
    """Counters for one model. Thread-safe for one writer (the engine) and many readers."""

    def __init__(self, n_layer: int, n_expert: int, history: int = 512):
        self.n_layer, self.n_expert, self.history = n_layer, n_expert, history
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        L, E = self.n_layer, max(self.n_expert, 1)
        with self._lock:
            self.calls = np.zeros((L, E), np.int64)
            self.hits = np.zeros((L, E), np.int64)
            self.misses = np.zeros((L, E), np.int64)
            self.uploaded = np.zeros((L, E), np.int64)
            self.heat = np.zeros((L, E), np.float64)
            self.resident = np.zeros((L, E), bool)
            self._steps = np.full((self.history, 5), np.nan)  # latency, tokens, hit rate, MB/s, interval
            self.prefetched = np.zeros((L, E), np.int64)
            self.prefetch_hits = np.zeros((L, E), np.int64)
            self.prediction = np.zeros((L, 3), np.int64)
            self._n_steps = 0
            self.tokens_total = 0
            self._t0 = None
            self._mark = (0, 0, 0)
            self._clock = DecodeClock(lambda: (int(self.hits.sum()), int(self.misses.sum())))
            self._decode_last = 0.0
            self._decode_step = -1  # the ring's count when the latest token was sampled

    # -- recording (engine thread) --------------------------------------------------------------
    def record_route(self, layer: int, ids: np.ndarray) -> None:
        """ids int [T, K]: the experts each token of the pass was routed to."""
        counts = np.bincount(np.asarray(ids).reshape(-1), minlength=self.calls.shape[1])
        with self._lock:
            self.calls[layer] += counts
            self.heat[layer] += counts

    def record_routes(self, layers: np.ndarray, ids: np.ndarray, hits: bool = False) -> None:
        """One token's routes in many layers at once (the decode graph's record, flushed per step):
        ids int [len(layers), K] are the experts layer ``layers[j]`` chose; ``hits``: every one was
        served from the device pool (resident), counted as a hit as well as a call."""
        flat = (np.asarray(layers, np.int64)[:, None] * self.calls.shape[1] + np.asarray(ids, np.int64)).reshape(-1)
        counts = np.bincount(flat, minlength=self.calls.size).reshape(self.calls.shape)
        with self._lock:
            self.calls += counts
            self.heat += counts
            if hits:
                self.hits += counts

    def record_cache(self, layer: int, hit_ids: np.ndarray, miss_ids: np.ndarray, uploaded: dict[int, int]) -> None:
        """Experts served from the device (hit) or not (miss) in this pass, and bytes uploaded per expert."""
        with self._lock:
            np.add.at(self.hits[layer], np.asarray(hit_ids, np.int64), 1)
            np.add.at(self.misses[layer], np.asarray(miss_ids, np.int64), 1)
            for e, b in uploaded.items():
                self.uploaded[layer, e] += b

    def record_prefetch(self, layer: int, uploaded: np.ndarray = (), hits: np.ndarray = ()) -> None:
        """Experts of ``layer`` uploaded on a prediction, and hits on experts a prediction brought in."""
        with self._lock:
            np.add.at(self.prefetched[layer], np.asarray(uploaded, np.int64), 1)
            np.add.at(self.prefetch_hits[layer], np.asarray(hits, np.int64), 1)

    def record_prediction(self, layer: int, predicted: int, chosen: int, both: int) -> None:
        """One step's prediction of ``layer``'s experts against what it chose (counts)."""
        with self._lock:
            self.prediction[layer] += (predicted, chosen, both)

    def set_resident(self, layer: int, experts: np.ndarray, value: bool = True) -> None:
        with self._lock:
            self.resident[layer, np.asarray(experts, np.int64)] = value

    def clear_resident(self) -> None:
        with self._lock:
            self.resident[:] = False

    def begin_step(self) -> None:
        self._t0 = time.perf_counter()
        with self._lock:
            self._mark = (int(self.hits.sum()), int(self.misses.sum()), int(self.uploaded.sum()))

    def end_step(self, n_tokens: int) -> None:
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        self._t0 = None
        with self._lock:
            h0, m0, u0 = self._mark
            h, m, u = int(self.hits.sum()) - h0, int(self.misses.sum()) - m0, int(self.uploaded.sum()) - u0
            self.heat *= HEAT_DECAY**n_tokens
            self.tokens_total += n_tokens
            row = (dt, n_tokens, h / (h + m) if h + m else np.nan, u / 1e6 / dt if dt > 0 else 0.0, np.nan)
            self._steps[self._n_steps % self.history] = row
            self._n_steps += 1

    def decode_started(self, now: float) -> DecodeWindow:
        """The generation loop sampled a reply's first token at ``now`` (perf_counter): a new window."""
        with self._lock:
            self._decode_last = now
            self._decode_step = self._n_steps
            return self._clock.start(now)

    def decode_token(self, now: float) -> DecodeWindow:
        """The loop sampled the next token at ``now``: the window grows by one token, and the one-token
        pass since the previous token gets the interval between the two."""
        with self._lock:
            if self._n_steps == self._decode_step + 1:  # exactly the pass this interval contains
                row = self._steps[(self._n_steps - 1) % self.history]
                if row[1] == 1:
                    row[4] = now - self._decode_last
            self._decode_last = now
            self._decode_step = self._n_steps
            return self._clock.tick(now)

    # -- reading (any thread) ---------------------------------------------------------------------
    def snapshot(self) -> ProfilerSnapshot:
        with self._lock:
            n = min(self._n_steps, self.history)
            order = (np.arange(self._n_steps - n, self._n_steps) % self.history) if n else np.arange(0)
            steps = self._steps[order]
            return ProfilerSnapshot(
                n_layer=self.n_layer,
                n_expert=self.n_expert,
                calls=self.calls.copy(),
                hits=self.hits.copy(),
                misses=self.misses.copy(),
                uploaded_bytes=self.uploaded.copy(),
                heat=self.heat.copy(),
                resident=self.resident.copy(),
                step_latency_s=steps[:, 0].copy(),
                step_tokens=steps[:, 1].astype(np.int64),
                step_hit_rate=steps[:, 2].copy(),
                step_upload_mb_s=steps[:, 3].copy(),
                tokens_total=self.tokens_total,
                step_interval_s=steps[:, 4].copy(),
                decode=self._clock.window,
                prefetched=self.prefetched.copy(),
                prefetch_hits=self.prefetch_hits.copy(),
                prediction=self.prediction.copy(),
            )


def _ratio(counts: np.ndarray | None, num: int, den: int, n_layer: int) -> np.ndarray:
    if counts is None:
        return np.full(n_layer, np.nan)
    d = counts[:, den].astype(np.float64)
    return np.divide(counts[:, num], d, out=np.full(len(d), np.nan), where=d > 0)


def export(snapshot: ProfilerSnapshot, prefix: str | Path) -> tuple[Path, Path]:
    """Write ``PREFIX.json`` (the whole snapshot) and ``PREFIX.csv`` (layer, expert rows)."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    jpath, cpath = prefix.with_suffix(".json"), prefix.with_suffix(".csv")
    jpath.write_text(json.dumps(snapshot.to_dict()))
    with cpath.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "expert", "calls", "hits", "misses", "uploaded_bytes", "heat", "resident"])
        for layer in range(snapshot.n_layer):
            for e in range(snapshot.calls.shape[1]):
                w.writerow(
                    [
                        layer,
                        e,
                        int(snapshot.calls[layer, e]),
                        int(snapshot.hits[layer, e]),
                        int(snapshot.misses[layer, e]),
                        int(snapshot.uploaded_bytes[layer, e]),
                        f"{snapshot.heat[layer, e]:.6g}",
                        int(snapshot.resident[layer, e]),
                    ]
                )
    return jpath, cpath
