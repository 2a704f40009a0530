"""``sharpi bench -m FILE``: prompt and decode tok/s of a model under a placement.

Loads the model, warms up, then ``repeat`` times: prefill ``prompt`` random tokens from an empty
cache and decode ``gen`` tokens greedily. Reports medians, the weight bytes a decode token reads
(trunk + the active experts + output) and the GB/s that implies, the expert-cache hit rate and
upload GB/s from the profiler, and (``--vs-llama-cpp``) llama.cpp's figures on the same file in
the same run with the ratios.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from engine.generate import SamplingParams


def bytes_per_token(session) -> int:
    """Weight bytes one decode token reads: trunk, K of E experts per MoE layer, the output."""
    spec = session.spec
    b = spec.trunk_bytes + spec.output_bytes + spec.output_norm_bytes
    for layer in spec.layers:
        if layer.n_expert:
            b += spec.n_expert_used * sum(layer.expert_role_bytes.values())
    return int(b)


def _one_run(session, prompt_ids: list[int], gen: int) -> tuple[float, float]:
    session.reset()
    session.reset_stats()
    events = list(session.generate(prompt_ids=prompt_ids, params=SamplingParams.greedy(max_tokens=gen)))
    last = events[-1]
    return last.prompt_tok_s, last.decode_tok_s


def bench_session(session, prompt: int, gen: int, repeat: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    V = session.args.n_vocab
    ids = [int(t) for t in rng.integers(8, V - 8, prompt)]
    _one_run(session, ids[: min(8, prompt)], 4)  # warm-up: kernel compilation, first touches
    pp, tg = [], []
    for _ in range(repeat):
        p, d = _one_run(session, ids, gen)
        pp.append(p)
        tg.append(d)
    st = session.stats()
    steps = st.step_latency_s[-(gen - 1) :] if gen > 1 else st.step_latency_s
    upload_gbps = float(st.uploaded_bytes.sum()) / 1e9 / max(float(st.step_latency_s.sum()), 1e-9)
    bpt = bytes_per_token(session)
    decode = statistics.median(tg)
    return {
        "model": session.info.path,
        "placement": session.applied.describe() if session.applied else "all layers on the CPU",
        "prompt_tokens": prompt,
        "gen_tokens": gen,
        "repeat": repeat,
        "prompt_tok_s": statistics.median(pp),
        "decode_tok_s": decode,
        "decode_tok_s_all": tg,
        "bytes_per_token": bpt,
        "decode_gb_s": bpt * decode / 1e9,
        "hit_rate": None if np.isnan(st.hit_rate) else st.hit_rate,
        "upload_gb_s": upload_gbps,
        "median_step_ms": float(np.median(steps)) * 1e3 if len(steps) else None,
    }


def bench_llama_cpp(path: str, prompt: int, gen: int, repeat: int, threads: int, seed: int = 0) -> dict | None:
    """llama.cpp's prompt and decode tok/s on the same file (None when it is not installed)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(path, n_ctx=prompt + gen + 8, n_batch=512, n_threads=threads, verbose=False)
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(8, llm.n_vocab() - 8, prompt)]
    pp, tg = [], []
    try:
        for r in range(repeat + 1):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            t1 = time.perf_counter()
            for i in range(gen):  # token values do not change the cost of a decode step
                llm.eval([ids[i % prompt]])
            t2 = time.perf_counter()
            if r:  # the first run warms up
                pp.append(prompt / (t1 - t0))
                tg.append(gen / (t2 - t1))
    finally:
        llm.close()
    return {"prompt_tok_s": statistics.median(pp), "decode_tok_s": statistics.median(tg)}
