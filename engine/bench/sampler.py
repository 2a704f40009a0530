"""``sharpi bench sampler``: host time a token spends choosing the next token from its logits — the
engine's sampler (:class:`engine.generate.sampling.Sampler`, no full sort) against the chain written
with a full sort of the vocabulary (:meth:`Sampler.reference`), at real vocabulary sizes, with the
default chat settings and the other shapes of the chain. Also checks both draw the same tokens.

Logits are model-like: N(0, 3²) over the vocabulary with a few tokens far above the rest (a model's
next-token distribution is peaked), fixed seed.
"""

from __future__ import annotations

import time

import numpy as np

from engine.generate.sampling import Sampler, SamplingParams

VOCABS = {"Qwen3 (151936)": 151936, "Mixtral / OLMoE (50304)": 50304, "Llama-2 (32000)": 32000}
SETTINGS = {
    "default chat (top-k 40, top-p 0.95, min-p 0.05, T 0.8)": SamplingParams(seed=0),
    "… with repeat penalty 1.1": SamplingParams(repeat_penalty=1.1, seed=0),
    "no top-k (top-p 0.95, min-p 0.05)": SamplingParams(top_k=0, seed=0),
    "no top-k, no top-p (min-p 0.05)": SamplingParams(top_k=0, top_p=1.0, seed=0),
    "greedy": SamplingParams.greedy(),
}


def model_like_logits(V: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(V) * 3.0).astype(np.float32)
    top = rng.choice(V, 8, replace=False)
    x[top] = 14.0 + 2.0 * rng.standard_normal(8).astype(np.float32)
    return x


def _ms(fn, x: np.ndarray, history: list[int], reps: int) -> float:
    fn(x, history)
    t = time.perf_counter()
    for _ in range(reps):
        fn(x, history)
    return (time.perf_counter() - t) / reps * 1e3


def run(reps: int = 20) -> list[dict]:
    rows = []
    history = list(range(64))
    for vname, V in VOCABS.items():
        x = model_like_logits(V)
        for sname, p in SETTINGS.items():
            fast, ref = Sampler(p), Sampler(p)
            same = [fast(x, history) for _ in range(reps)] == [ref.reference(x, history) for _ in range(reps)]
            fast_ms = _ms(fast, x, history, reps)
            ref_ms = _ms(ref.reference, x, history, reps)
            rows.append({"vocab": vname, "settings": sname, "fast_ms": fast_ms, "reference_ms": ref_ms,
                         "speedup": ref_ms / fast_ms, "same_draws": same})  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    out = ["| vocabulary | settings | sampler ms | full-sort reference ms | speed-up | same draws |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['vocab']} | {r['settings']} | {r['fast_ms']:.2f} | {r['reference_ms']:.2f} | "
                   f"{r['speedup']:.1f}× | {'yes' if r['same_draws'] else 'NO'} |")  # fmt: skip
    return "\n".join(out)
