"""Synthetic routing traces with a real model's routing statistics, for models whose weights are not here.

Each layer draws a token's k distinct experts without replacement (Gumbel top-k) from a mixture of

- **the previous token's experts** (weight ``reuse_prev``): short-range reuse, the strongest effect in real routing;
- **the experts of tokens 2..``window`` back** (``reuse_window``, spread over their uses);
- **the layer's popularity** (the rest): log-normal per expert (σ ``sigma``), times a **topic** factor that drifts
  (an AR(1) walk in log space, correlation ``drift`` a token, its own σ ``topic_sigma``).

Prompt tokens reuse less than decoded ones (``prompt_reuse`` scales both reuse weights). :data:`QWEN3_30B_A3B`
is fitted so that a per-layer LRU replay reproduces the published Qwen3-30B-A3B curve (``PUBLISHED_LRU``,
from the imp project's routing study: ≈74 % hits with ~19 % of a layer's experts resident, ≈89 % at ~38 %,
≈96 % at ~64 %); ``tests/test_cache_policies.py`` holds it to ±3 points.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.routes.trace import PHASE_DECODE, PHASE_PROMPT, RouteTrace

# Capacity (fraction of a layer's experts) -> LRU hit rate, Qwen3-30B-A3B, published.
PUBLISHED_LRU = {0.19: 0.74, 0.38: 0.89, 0.64: 0.96}


@dataclass(frozen=True)
class SyntheticRouting:
    model: str = "synthetic"
    n_expert: int = 128
    k: int = 8
    n_layers: int = 48
    sigma: float = 1.5  # log-normal popularity per layer
    reuse_prev: float = 0.26
    reuse_window: float = 0.21
    window: int = 8
    topic_sigma: float = 0.8
    drift: float = 0.98  # AR(1) correlation of the topic a token
    prompt_reuse: float = 0.8
    temperature: float = 1.0  # of the routing weights over the chosen experts' scores

    def generate(self, prompt: int = 256, decode: int = 768, turns: int = 2, seed: int = 0) -> RouteTrace:
        """``turns`` × (``prompt`` prompt tokens, then ``decode`` decoded ones): a :class:`RouteTrace`."""
        rng = np.random.default_rng(seed)
        L, E, k, W = self.n_layers, self.n_expert, self.k, self.window
        phase = np.tile(np.r_[np.full(prompt, PHASE_PROMPT), np.full(decode, PHASE_DECODE)], turns).astype(np.uint8)
        T = len(phase)
        base = rng.normal(0.0, self.sigma, (L, E))
        topic = rng.normal(0.0, self.topic_sigma, (L, E))
        s = np.sqrt(1.0 - self.drift**2)
        ids = np.empty((T, L, k), np.int32)
        weights = np.empty((T, L, k), np.float32)
        recent = np.zeros((W, L, E))  # recent[i]: which experts token t-1-i used
        rows = np.arange(L)[:, None]
        for t in range(T):
            topic = self.drift * topic + s * rng.normal(0.0, self.topic_sigma, (L, E))
            pop = np.exp(base + topic)
            pop /= pop.sum(axis=1, keepdims=True)
            scale = self.prompt_reuse if phase[t] == PHASE_PROMPT else 1.0
            a, b = self.reuse_prev * scale, self.reuse_window * scale
            if t == 0:
                a = b = 0.0
            prev = recent[0] / k
            win = recent[1:].sum(axis=0)
            n_win = win.sum(axis=1, keepdims=True)
            win = np.divide(win, n_win, out=np.zeros_like(win), where=n_win > 0)
            if t < 2:
                b = 0.0
            mass = a * prev + b * win + (1.0 - a - b) * pop
            score = np.log(mass) + rng.gumbel(size=(L, E))
            top = np.argpartition(-score, k - 1, axis=1)[:, :k]
            order = np.argsort(-score[rows, top], axis=1)
            top = top[rows, order]  # the router's order: strongest first
            ids[t] = top
            z = score[rows, top] / self.temperature
            z = np.exp(z - z.max(axis=1, keepdims=True))
            weights[t] = z / z.sum(axis=1, keepdims=True)
            recent = np.roll(recent, 1, axis=0)
            recent[0] = 0.0
            recent[0][rows, top] = 1.0
        meta = {
            "model": self.model,
            "n_expert": E,
            "k": k,
            "layers": list(range(L)),
            "source": "synthetic",
            "generator": {**asdict(self), "prompt": prompt, "decode": decode, "turns": turns, "seed": seed},
        }
        return RouteTrace(ids, weights, phase, meta).validate("synthetic trace")


def reuse_stats(trace: RouteTrace, window: int = 8) -> dict[str, float]:
    """The share of a token's experts also used by the previous token, and by any of the ``window`` before."""
    ids = trace.ids
    T, L, k = ids.shape
    used = np.zeros((T, L, trace.n_expert), bool)
    np.put_along_axis(used, ids.astype(np.int64), True, axis=2)
    prev = np.take_along_axis(used[:-1], ids[1:].astype(np.int64), axis=2).mean()
    within = np.zeros((T - window, L, k), bool)
    for d in range(1, window + 1):
        within |= np.take_along_axis(used[window - d : T - d], ids[window:].astype(np.int64), axis=2)
    return {"prev": float(prev), f"within_{window}": float(within.mean())}


QWEN3_30B_A3B = SyntheticRouting(model="qwen3-30b-a3b", n_expert=128, k=8, n_layers=48)
