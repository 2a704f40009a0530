"""``sharpi bench -m FILE``: prompt and decode tok/s of a model under a placement.

Loads the model, warms up, then ``repeat`` times: prefill ``prompt`` random tokens from an empty
cache and decode ``gen`` tokens greedily. Reports medians, the weight bytes a decode token reads
(trunk + the active experts + output) and the GB/s that implies, that as a fraction of this
machine's measured read bandwidth, the resident memory while decoding (against the file size),
the expert-cache hit rate and upload GB/s from the profiler, and (``--vs-llama-cpp``) llama.cpp's
figures on the same file, its runs alternating with ours in the same process, with the ratios.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np

from engine import config
from engine.generate import SamplingParams

log = logging.getLogger(__name__)

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

    from engine.synth.encode import parse_qtype, plan_types
    from engine.synth.fill import fill_random_blocks
    from engine.synth.geometry import write_sparse
    from engine.synth.specs import make_spec, tensor_layout
    from engine.synth.tokenizer import build_vocab

    arch, geometry = BENCH_GEOMETRIES[name]
    spec = make_spec(arch, **geometry)
    plans = plan_types(tensor_layout(spec), weight_type)
    path = Path(path)
    vocab = build_vocab("bpe", spec.vocab, None)
    write_sparse(path, spec, plans, vocab, f"benchmark {name}", parse_qtype(weight_type))
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


def rss_bytes() -> dict[str, int]:
    """This process's resident memory now: {'rss', 'anon', 'file'} in bytes (Linux /proc; else {})."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                name = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}.get(key)
                if name:
                    out[name] = int(val.split()[0]) * 1024
    except OSError:
        pass
    return out


class _Ours:
    """One timed run of the engine: prefill ``ids`` from an empty cache, decode ``gen`` greedily."""

    def __init__(self, session, ids: list[int], gen: int):
        self.session, self.ids, self.gen = session, ids, gen

    def run(self, ids: list[int] | None = None, gen: int | None = None) -> tuple[float, float]:
        s = self.session
        s.reset()
        s.reset_stats()
        params = SamplingParams.greedy(max_tokens=gen or self.gen)
        *_, last = s.generate(prompt_ids=ids or self.ids, params=params)
        self.last = last
        self.rss = rss_bytes()  # right after the last decode step: what decoding keeps resident
        return last.prompt_tok_s, last.decode_tok_s


class _LlamaCpp:
    """The same run in llama.cpp (CPU, default settings, ``threads`` threads) on the same file."""

    def __init__(self, path: str, ids: list[int], gen: int, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(path, n_ctx=len(ids) + gen + 8, n_batch=512, n_threads=threads, verbose=False)
        self.ids, self.gen = ids, gen

    def run(self) -> tuple[float, float]:
        llm, ids = self.llm, self.ids
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for i in range(self.gen - 1):  # as ours: the first generated token comes from the prefill
            llm.eval([ids[i % len(ids)]])  # token values do not change the cost of a step
        t2 = time.perf_counter()
        return len(ids) / (t1 - t0), (self.gen - 1) / (t2 - t1)

    def close(self) -> None:
        self.llm.close()


def verify_cost(session, ids: list[int], k: int, reps: int = 7) -> dict:
    """What one speculative step costs against a plain one, medians over ``reps`` (ms): ``step_ms`` a one-token
    decode step, ``verify_ms`` one verify pass of k+1 positions (routed experts grouped by expert, every
    position's recurrent state kept) with its roll-back, ``draft_ms`` one MTP head step; ``verify_vs_step`` their
    ratio (k+1 would be no better than k+1 plain steps)."""
    from engine.generate.speculative import Speculator

    m, cache = session.model, session.cache
    session.reset()
    m.keep_hidden = True  # as while drafting: no CUDA-graph step, every hidden state kept
    try:
        m.forward(ids, 0, cache, all_logits=False)
        pos, tok = len(ids), ids[-1]
        step, verify, draft = [], [], []
        for _ in range(reps):
            cache.keep_steps = True
            t0 = time.perf_counter()
            m.forward([tok] * (k + 1), pos, cache, all_logits=True)
            cache.rollback(pos)
            verify.append(time.perf_counter() - t0)
            cache.keep_steps = False
        spec = Speculator(m.mtp_head(), k, cache.n_ctx)
        spec.observe(0, m.last_hidden[:1])
        h = m.last_hidden[:1]
        for r in range(reps):
            t0 = time.perf_counter()
            spec.head.forward(h, [tok], r, spec.cache)
            draft.append(time.perf_counter() - t0)
        for r in range(reps):
            t0 = time.perf_counter()
            m.forward([tok], pos + r, cache, all_logits=False)
            step.append(time.perf_counter() - t0)
    finally:
        m.keep_hidden = False
        cache.keep_steps = False
        session.reset()
    out = {
        "step_ms": statistics.median(step) * 1e3,
        "verify_ms": statistics.median(verify) * 1e3,
        "draft_ms": statistics.median(draft) * 1e3,
    }
    out["verify_vs_step"] = out["verify_ms"] / out["step_ms"]
    out.update(_expert_cost(m, k, reps))
    return out


def _expert_cost(m, k: int, reps: int) -> dict:
    """The routed experts of one MoE layer on the host for k+1 positions grouped by expert against one token's
    (ms, medians): the expert reads that dominate a large MoE's decode step. ``experts_verify``: independent
    random routes a row (each row reads its own K experts: the most a verify pass can read);
    ``experts_shared``: every row on the same K experts (each read once for all rows: the least). Real routes
    of consecutive tokens overlap in between. {} where the first MoE layer's experts are not on the host."""
    from engine import ops

    layers = m.moe_layers()
    backend = m.experts_of(layers[0]) if layers else None
    if backend is None or not hasattr(backend, "host_stacks"):
        return {}
    st = backend.host_stacks(layers[0])
    a = m.args
    rng = np.random.default_rng(0)
    X = rng.standard_normal((k + 1, a.n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(a.n_expert, a.n_expert_used, replace=False) for _ in range(k + 1)]).astype(np.int64)
    w = np.full((k + 1, a.n_expert_used), 1.0 / a.n_expert_used, np.float32)
    same = np.repeat(ids[:1], k + 1, axis=0)  # every position routed to the first one's experts
    one, many, shared = [], [], []
    for _ in range(reps):
        for out, rows, r in ((one, 1, ids), (many, k + 1, ids), (shared, k + 1, same)):
            t0 = time.perf_counter()
            ops.moe_ffn(st.gate, st.up, st.down, X[:rows], r[:rows], w[:rows], q8_act=backend.q8_act, glu=st.glu)
            out.append(time.perf_counter() - t0)
    e1, ek, es = (statistics.median(x) * 1e3 for x in (one, many, shared))
    return {
        "experts_step_ms": e1,
        "experts_verify_ms": ek,
        "experts_verify_vs_step": ek / e1,
        "experts_shared_ms": es,
        "experts_shared_vs_step": es / e1,
    }


def _wholly_on_cuda(session) -> bool:
    """Whether the session's placement puts every layer, and every routed expert, on a CUDA device
    (then decode reads its weights from device memory, and that is the bound to compare with)."""
    p = getattr(session, "placement", None)
    dev = getattr(session, "device", None)
    if p is None or dev is None or p.n_gpu_layers < p.n_layer or p.n_cpu_moe > 0:
        return False  # (n_cpu_moe: a split, the first layers' experts on the host)
    return dev.type == "cuda" and p.moe_mode in ("resident", "none")


def _split_bytes(session, hit_rate: float | None) -> dict | None:
    """Weight bytes a decode token reads from host and from device memory, {"host", "device"}, where
    the placement puts layers on a CUDA device but not everything (the cost model's byte accounting
    for this placement, at the measured cache hit rate); None elsewhere (CPU, the simulated device)."""
    p, dev = getattr(session, "placement", None), getattr(session, "device", None)
    if p is None or dev is None or dev.type != "cuda" or p.n_gpu_layers == 0:
        return None
    from engine.plan import predict

    mode = "cpu" if p.moe_mode == "none" else p.moe_mode
    slots = {"cache": p.expert_slots, "resident": p.expert_slots_needed}.get(mode, 0)
    b = predict(session.spec, p.profile, mode=mode, n_gpu_layers=p.n_gpu_layers, kv_type=p.kv_type, position=0,
                expert_slots=slots, n_cpu_moe=p.n_cpu_moe, observed_hit_rate=hit_rate if mode == "cache" else None,
                ).bytes_by_link  # fmt: skip
    return {"host": b["cpu"], "device": b["device"]}


def hybrid_bound_tok_s(split: dict, host_gbps: float, device_gbps: float) -> float:
    """tok/s if a token only read its weights, the host's bytes at ``host_gbps`` and then the device's at
    ``device_gbps`` (a hybrid step runs them one after the other)."""
    return 1.0 / (split["host"] / (host_gbps * 1e9) + split["device"] / (device_gbps * 1e9))


def _llama_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def prefetch_report(st) -> dict | None:
    """The expert cache's predictive prefetch over the run (``EngineOptions.cache_prefetch``), None where no
    layer was predicted: uploads, hits on them, and per layer the prediction's recall and precision."""
    if st.prediction is None or not st.prediction.any():
        return None
    p = st.prediction
    rec, prec = st.prefetch_recall(), st.prefetch_precision()
    return {
        "uploads": int(st.prefetched.sum()),
        "hits": int(st.prefetch_hits.sum()),
        "recall": float(p[:, 2].sum() / p[:, 1].sum()),
        "precision": float(p[:, 2].sum() / p[:, 0].sum()),
        "recall_by_layer": [None if np.isnan(x) else round(float(x), 4) for x in rec],
        "precision_by_layer": [None if np.isnan(x) else round(float(x), 4) for x in prec],
    }


def bench_session(
    session,
    prompt: int,
    gen: int,
    repeat: int,
    seed: int = 0,
    *,
    vs_llama_cpp: bool = False,
    threads: int = 1,
    bandwidth: bool = True,
) -> dict:
    """Median prompt and decode tok/s of ``session`` (and of llama.cpp on the same file).

    With ``vs_llama_cpp`` the two engines alternate run by run in this process (same prompt,
    same number of generated tokens), so both see the same machine state. Resident memory is
    sampled after our first timed decode, before llama.cpp is loaded. ``bandwidth`` measures this
    machine's read bandwidth (``engine.bench.kernels.measure_bandwidth``, current numba threads)
    to state the fraction of the bandwidth bound reached.
    """
    rng = np.random.default_rng(seed)
    V = session.args.n_vocab
    ids = [int(t) for t in rng.integers(8, V - 8, prompt)]
    ours = _Ours(session, ids, gen)
    # Warm-up on the timed prompt's length: every kernel the timed runs use is compiled first (a
    # prompt of > 8 tokens takes other kernels than a short one: grouped Triton prefill on CUDA,
    # the bf16 GEMMs from 32 tokens on the CPU), and first touches are paid.
    ours.run(ids, 4)
    if getattr(session.model, "decode_graph", None) is not None:
        # CUDA-graph steps: capture every attention bucket the timed runs reach (one-time, like
        # compilation; engine.runtime.graph_decode captures a bucket when a position first needs it).
        ours.run(ids[: min(8, prompt)], prompt + gen - min(8, prompt))
    pp, tg = [], []
    first = ours.run()
    pp.append(first[0])
    tg.append(first[1])
    rss = ours.rss
    ref = None
    if vs_llama_cpp and _llama_available():
        ref = _LlamaCpp(session.info.path, ids, gen, threads)
        ref.run()  # warm-up
    lpp, ltg = [], []
    try:
        for r in range(repeat):
            if r:
                p, d = ours.run()
                pp.append(p)
                tg.append(d)
            if ref is not None:
                p, d = ref.run()
                lpp.append(p)
                ltg.append(d)
    finally:
        if ref is not None:
            ref.close()
    st = session.stats()
    steps = st.step_latency_s[-(gen - 1) :] if gen > 1 else st.step_latency_s
    upload_gbps = float(st.uploaded_bytes.sum()) / 1e9 / max(float(st.step_latency_s.sum()), 1e-9)
    bpt = bytes_per_token(session)
    decode = statistics.median(tg)
    report = {
        "model": session.info.path,
        "file_bytes": session.info.file_size,
        "placement": session.applied.describe() if session.applied else "all layers on the CPU",
        # `auto` planned again on the warm-up's routing (engine.runtime.replan): the timed runs ran its choice
        "replans": [r.note for r in getattr(session, "replans", ())],
        "threads": threads,
        "gomp_spincount": config.process_settings()["GOMP_SPINCOUNT"],  # apply_process_settings' choice
        "prompt_tokens": prompt,
        "gen_tokens": gen,
        "repeat": repeat,
        "prompt_tok_s": statistics.median(pp),
        "prompt_tok_s_all": pp,
        "decode_tok_s": decode,
        "decode_tok_s_all": tg,
        "bytes_per_token": bpt,
        "decode_gb_s": bpt * decode / 1e9,
        "rss_bytes": rss.get("rss"),
        "rss_anon_bytes": rss.get("anon"),
        "rss_file_bytes": rss.get("file"),
        "hit_rate": None if np.isnan(st.hit_rate) else st.hit_rate,
        "upload_gb_s": upload_gbps,
        "median_step_ms": float(np.median(steps)) * 1e3 if len(steps) else None,
        "prefetch": prefetch_report(st),
    }
    report["rss_ratio"] = report["rss_bytes"] / report["file_bytes"] if report["rss_bytes"] else None
    report["mtp"] = None
    if session.mtp > 0:
        last = ours.last
        report["mtp"] = dict(
            k=session.mtp,
            passes=last.mtp_passes,
            drafted=last.mtp_drafted,
            accepted=last.mtp_accepted,
            acceptance=last.mtp_acceptance or 0.0,
            **verify_cost(session, ids, session.mtp),
        )
    if vs_llama_cpp:
        report["llama_cpp"] = None
        if ref is not None:
            lc = {
                "prompt_tok_s": statistics.median(lpp),
                "decode_tok_s": statistics.median(ltg),
                "prompt_tok_s_all": lpp,
                "decode_tok_s_all": ltg,
            }
            lc["decode_gb_s"] = bpt * lc["decode_tok_s"] / 1e9
            report["llama_cpp"] = lc
            report["ratio_prompt"] = report["prompt_tok_s"] / lc["prompt_tok_s"]
            report["ratio_decode"] = decode / lc["decode_tok_s"]
    if bandwidth:
        on_device = _wholly_on_cuda(session)
        split = None if on_device else _split_bytes(session, report["hit_rate"])
        dev_bw = _device_read_gbps(session) if on_device or split else None
        on_device = on_device and dev_bw is not None
        if on_device:  # every weight byte of a step is read from device memory
            bw = dev_bw
        else:
            from engine.bench.kernels import measure_bandwidth

            bw = measure_bandwidth()["best_gbs"]
        report["bandwidth_of"] = "device" if on_device else "host"
        report["read_bandwidth_gb_s"] = bw
        report["decode_bound_tok_s"] = bw * 1e9 / bpt  # every weight byte of a token read once at bw
        report["decode_bw_fraction"] = report["decode_gb_s"] / bw
        if dev_bw and split:
            report.update(bandwidth_of="host+device", device_bandwidth_gb_s=dev_bw, bytes_by_memory=split)
            report["decode_bound_tok_s"] = hybrid_bound_tok_s(split, bw, dev_bw)
            report["decode_bw_fraction"] = decode / report["decode_bound_tok_s"]
        if report.get("llama_cpp"):
            report["llama_cpp"]["decode_bw_fraction"] = report["llama_cpp"]["decode_gb_s"] / bw
    return report


def _device_read_gbps(session) -> float | None:
    """The CUDA device's read bandwidth: the calibrated figure where the placement's profile measured it (no
    probe buffer on top of the placement's budget, so nvidia-smi's peak is the run's own), else a 2 × 64 MiB
    copy given back at once (the budget's allowances hold it); None when even that does not fit."""
    import torch

    from engine.bench.device_kernels import measure_bandwidth as device_bandwidth

    prof = session.placement.profile
    if "device_gbps" in prof.measured:
        return prof.device_gbps
    try:
        bw = device_bandwidth(1 << 26)
    except RuntimeError:  # out of device memory
        log.warning("no room on the device to measure its bandwidth; the bound counts every byte at the host's")
        return None
    torch.cuda.empty_cache()
    return bw


def bench_llama_cpp(path: str, prompt: int, gen: int, repeat: int, threads: int, seed: int = 0) -> dict | None:
    """llama.cpp alone: median prompt and decode tok/s on ``path`` (None when it is not installed)."""
    if not _llama_available():
        return None
    ref = _LlamaCpp(path, [0] * prompt, gen, threads)
    rng = np.random.default_rng(seed)
    ref.ids = [int(t) for t in rng.integers(8, ref.llm.n_vocab() - 8, prompt)]
    try:
        ref.run()  # warm-up
        runs = [ref.run() for _ in range(repeat)]
    finally:
        ref.close()
    return {
        "prompt_tok_s": statistics.median(r[0] for r in runs),
        "decode_tok_s": statistics.median(r[1] for r in runs),
    }


# -- predictions next to measurements (the planner's validation hook) ----------------------------------
def predicted_at(session, placement, mode: str, position: int, observed_hit_rate: float | None = None) -> float | None:
    """The cost model's decode tok/s for ``placement``'s layers in expert ``mode`` at ``position``
    (optionally at a measured cache hit rate); None when the mode is impossible there."""
    from engine.plan import predict

    p = placement
    slots = {"cpu": 0, "cache": p.expert_slots, "resident": p.expert_slots_needed}.get(mode, 0)
    if p.predicted_tok_s.get(mode) is None:
        return None
    pred = predict(
        session.spec,
        p.profile,
        mode="cpu" if mode == "none" else mode,
        n_gpu_layers=p.n_gpu_layers,
        kv_type=p.kv_type,
        position=position,
        expert_slots=slots,
        n_cpu_moe=p.n_cpu_moe,
        observed_hit_rate=observed_hit_rate if mode == "cache" else None,
        graphs=session.engine_options.cuda_graph != "off",  # as the session's steps run
        bus_misses=getattr(getattr(session.applied, "experts", None), "mirror", None) is not None,  # as its misses run
    )
    return pred.tok_s


def prediction_report(session, report: dict) -> dict:
    """What the planner predicted for the placement just benchmarked, at the decode's mean
    position: {"profile_source", "predicted_tok_s" (every mode), "predicted_decode_tok_s" (this
    mode), "predicted_at_measured_hit_rate" (cache only), "prediction_error"}. A model on the CPU without
    a placement is predicted with this machine's cached CPU calibration (``sharpi bench calibrate --device
    host``; the defaults, said so, without one) — what the app's library and placement dock show."""
    from engine.plan.profile import profile_source

    p = session.placement
    pos = report["prompt_tokens"] + report["gen_tokens"] // 2
    if p is None:
        return _cpu_prediction(session, report, pos)
    modes = [m for m in p.predicted_tok_s]
    out = {
        "profile_source": profile_source(p.profile),
        "profile": p.profile.to_dict(),
        "prediction_position": pos,
        "predicted_tok_s": {m: predicted_at(session, p, m, pos) for m in modes},
    }
    mine = out["predicted_tok_s"].get(p.moe_mode)
    out["predicted_decode_tok_s"] = mine
    if p.moe_mode == "cache" and report.get("hit_rate") is not None:
        out["predicted_at_measured_hit_rate"] = predicted_at(session, p, "cache", pos, report["hit_rate"])
    if mine:
        out["prediction_error"] = mine / report["decode_tok_s"] - 1  # + = predicted too fast
    return out


def _cpu_prediction(session, report: dict, pos: int) -> dict:
    from engine.bench.calibrate_host import cached_cpu_profile
    from engine.plan import DeviceProfile, predict
    from engine.plan.profile import profile_source

    prof = cached_cpu_profile(session.info.path, session.engine_options) or DeviceProfile(vram_bytes=0)
    # host layers keep their cache as the engine does (engine.kv_layout.HOST_KV_TYPE: predict's own choice)
    tok_s = predict(session.spec, prof, mode="cpu", n_gpu_layers=0, kv_type="f32", position=pos).tok_s
    return {
        "profile_source": profile_source(prof, cpu_only=True),
        "profile": prof.to_dict(),
        "prediction_position": pos,
        "predicted_tok_s": {"cpu": tok_s},
        "predicted_decode_tok_s": tok_s,
        "prediction_error": tok_s / report["decode_tok_s"] - 1,
    }


def compare_modes(session, prompt: int, gen: int, repeat: int, *, threads: int = 1) -> dict:
    """Benchmark every feasible expert mode of the session's placement in turn — re-placed through
    ``Session.apply`` with the same layers, context, KV type and device profile, the file not
    re-read — and say which mode auto picks and whether it was the fastest measured.

    Returns {"auto", "auto_reason", "profile_source", "fastest", "auto_was_fastest",
    "auto_loss" (1 − auto's tok/s ÷ the fastest's), "modes": [{mode, predicted_tok_s,
    predicted_at_measured_hit_rate, decode_tok_s, prompt_tok_s, hit_rate, upload_gb_s,
    median_step_ms}]}.
    """
    from dataclasses import replace

    from engine.errors import UsageError
    from engine.plan import PlanRequest
    from engine.plan.profile import profile_source

    base = session.placement
    if base is None or base.n_gpu_layers == 0:
        raise UsageError("--compare-modes needs layers on a device (-g, --vram or --device)")
    if base.moe_mode == "none":
        raise UsageError("--compare-modes: a dense model has no routed experts to place")
    req = PlanRequest(
        ctx=base.ctx,
        kv_type=base.kv_type,
        n_gpu_layers=base.n_gpu_layers,
        n_cpu_moe=base.asked_n_cpu_moe,
        moe_source="--compare-modes",
    )
    # The profile an auto choice plans with (on CUDA: calibrated, measuring once if need be).
    from engine.bench.calibrate import speed_profile

    speeds = speed_profile(session.device, session.gf, measure=True, options=session.engine_options)
    if speeds is not None:
        session.set_device_profile(speeds)
    profile = session.device_profile(base.budget_bytes)
    auto = session.plan(replace(req, moe="auto"), profile)
    rows = []
    for mode in ("cpu", "cache", "resident"):
        if auto.predicted_tok_s.get(mode) is None:
            continue  # does not fit
        session.apply(session.plan(replace(req, moe=mode), profile))
        r = bench_session(session, prompt, gen, repeat, threads=threads, bandwidth=False)
        pr = prediction_report(session, r)
        rows.append(
            {
                "mode": mode,
                "predicted_tok_s": pr["predicted_decode_tok_s"],
                "predicted_at_measured_hit_rate": pr.get("predicted_at_measured_hit_rate"),
                "decode_tok_s": r["decode_tok_s"],
                "decode_tok_s_all": r["decode_tok_s_all"],
                "prompt_tok_s": r["prompt_tok_s"],
                "hit_rate": r["hit_rate"],
                "upload_gb_s": r["upload_gb_s"],
                "median_step_ms": r["median_step_ms"],
                "placement": r["placement"],
            }
        )
    fastest = max(rows, key=lambda x: x["decode_tok_s"])
    mine = next((x for x in rows if x["mode"] == auto.moe_mode), None)
    return {
        "auto": auto.moe_mode,
        "auto_reason": auto.moe_reason,
        "profile_source": profile_source(profile),
        "fastest": fastest["mode"],
        "auto_was_fastest": auto.moe_mode == fastest["mode"],
        "auto_loss": 1 - mine["decode_tok_s"] / fastest["decode_tok_s"] if mine else None,
        "modes": rows,
    }
