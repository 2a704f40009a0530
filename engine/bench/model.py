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

# The benchmark files of docs/benchmarks.md: all matrices Q4_K, norms and routers F32.
BENCH_GEOMETRIES: dict[str, tuple[str, dict]] = {
    # ≈2.97 GB, ≈556 MB of weights read per decoded token
    "qwen3moe-q4k": (
        "qwen3moe",
        dict(layers=16, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=64, experts_used=8,
             expert_ff=768, vocab=32768, rope_base=1e6),
    ),
    # OLMoE-1B-7B geometry (no top-k renormalisation)
    "olmoe-q4k": (
        "olmoe",
        dict(layers=16, hidden=2048, heads=16, kv_heads=16, head_dim=128, experts=64, experts_used=8,
             expert_ff=1024, vocab=50304, rms_eps=1e-5),
    ),
}  # fmt: skip


def write_bench_model(path, name: str, weight_type: str = "Q4_K", seed: int = 0):
    """Write benchmark file ``name`` (a key of :data:`BENCH_GEOMETRIES`) to ``path`` in minutes.

    The header and tensor table are the synthesizer's; the data are random well-scaled blocks
    (``engine.synth.fill``) instead of quantized random floats (~10 min for 3 GB): right for
    speed and memory work, useless for accuracy work. Returns the path.
    """
    from pathlib import Path

    from gguf import GGUFWriter

    from engine.synth.encode import parse_qtype, plan_types
    from engine.synth.fill import fill_random_blocks
    from engine.synth.metadata import write_hparams
    from engine.synth.specs import make_spec, tensor_layout
    from engine.synth.tokenizer import build_vocab, write_tokenizer

    arch, geometry = BENCH_GEOMETRIES[name]
    spec = make_spec(arch, **geometry)
    plans = plan_types(tensor_layout(spec), weight_type)
    path = Path(path)
    w = GGUFWriter(path, arch)
    write_hparams(w, spec, name=f"benchmark {name}", file_type=parse_qtype(weight_type))
    write_tokenizer(w, build_vocab("bpe", spec.vocab, None))
    end = 0
    for p in plans:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
        end += GGUFWriter.ggml_pad(p.nbytes, w.data_alignment)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    f = w.fout[0]
    f.flush()
    f.truncate(GGUFWriter.ggml_pad(f.tell(), w.data_alignment) + end)
    w.close()
    fill_random_blocks(path, seed=seed)
    return path


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
