"""Token sampling: penalties → top-k → top-p → min-p → temperature → draw (llama.cpp's default chain)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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

    @classmethod
    def greedy(cls, max_tokens: int = 256, **kw) -> SamplingParams:
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=max_tokens, **kw)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.p
        if not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return logits
        recent = np.asarray(history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history, dtype=np.int64)
        ids, counts = np.unique(recent, return_counts=True)
        out = logits.copy()
        v = out[ids]
        if p.repeat_penalty != 1.0:
            v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        out[ids] = v - counts * p.frequency_penalty - p.presence_penalty
        return out

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        """logits float32 [V] -> token id."""
        p = self.p
        x = self.apply_penalties(np.asarray(logits, dtype=np.float64), history or [])
        if p.temperature <= 0:
            return int(np.argmax(x))
        order = np.argsort(-x, kind="stable")
        if p.top_k > 0:
            order = order[: p.top_k]
        z = x[order]
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, z, probs = order[:keep], z[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, z = order[keep], z[keep]
        z = z / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        return int(order[self.rng.choice(len(order), p=probs)])
