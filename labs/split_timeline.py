"""Where a decode token goes on the default 12 GiB placement of a CUDA box (``auto``: the resident split, the
first N layers' routed experts on the CPU between CUDA-graph segments): the whole step, the GPU alone (the
bucket's segments replayed back to back), each segment replayed and waited for (launch + GPU + wake-up),
the CPU experts of the cut layers alone (through the backend's ``host_part``, and the fused kernels called
directly) at several numba thread counts, and the bare costs of a stream wait; then cProfile of a few steps.
What the step takes beyond "segments waited for + host experts" is Python between them.

  PYTHONPATH=. python3 labs/split_timeline.py F [--vram 12] [--moe auto] [--steps 48] [--replay T.npz]
      [--threads 16,15,14]

``--replay`` routes every MoE layer by a trace (``sharpi bench cache --synthetic --save-trace T.npz``), as
``sharpi bench --replay-routes`` does; the step's expert hits, misses and uploaded bytes are then counted from the
profiler. ``--threads`` times whole steps at each numba thread count (a background upload thread may take a
core from the experts' parallel loops).
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import time

import numba
import numpy as np
import torch

from engine.api import LoadOptions, Session
from engine.kernels.moe import moe_ffn
from engine.plan import PlanRequest


def med_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--vram", type=float, default=12)
    ap.add_argument("--moe", default="auto")
    ap.add_argument("--n-cpu-moe", type=int, default=0)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--replay", default=None)
    ap.add_argument("--threads", default="")
    args = ap.parse_args()
    try:
        lc = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)", "L3 cache", "CPU(s)")
        print("\n".join(x for x in lc.splitlines() if x.split(":")[0].strip() in keep), flush=True)
    except OSError:
        pass
    print(f"numba threads {numba.get_num_threads()}, layer {numba.config.THREADING_LAYER}", flush=True)
    n_ctx = 4096
    rng = np.random.default_rng(0)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with Session.load(args.model, LoadOptions(n_ctx=n_ctx, device="cuda" if cuda else "cpu")) as s:
        p = s.plan(PlanRequest(ctx=n_ctx, moe=args.moe, n_cpu_moe=args.n_cpu_moe),
                   s.device_profile(int(args.vram * (1 << 30))))  # fmt: skip
        s.apply(p)
        print("placement:", p.moe_mode, "resident split", p.resident_split, "n_cpu_moe", p.n_cpu_moe, flush=True)
        if args.replay:
            from engine.routes.trace import load_trace

            s.replay_routes(load_trace(args.replay))
            print(f"routes replayed from {args.replay}", flush=True)
        V = s.args.n_vocab
        toks = rng.integers(0, V, args.prompt).tolist()
        s.reset()
        t = time.perf_counter()
        s.model.forward(toks, 0, s.cache, all_logits=False)
        sync()
        print(f"prompt {args.prompt}: {args.prompt / (time.perf_counter() - t):.1f} tok/s (first, with warm-up)")
        pos = args.prompt
        step_ms = []
        for _ in range(args.steps):
            t = time.perf_counter()
            s.model.forward([int(rng.integers(0, V))], pos, s.cache)
            step_ms.append((time.perf_counter() - t) * 1e3)
            pos += 1
        whole = statistics.median(step_ms[4:])
        print(f"whole step: median {whole:.2f} ms ({1e3 / whole:.1f} tok/s), min {min(step_ms[4:]):.2f}", flush=True)
        snap0 = s.stats()
        n_cnt = 32
        for _ in range(n_cnt):
            s.model.forward([int(rng.integers(0, V))], pos, s.cache)
            pos += 1
        s.model.settle()
        snap1 = s.stats()
        hits, miss = (snap1.hits - snap0.hits).sum(), (snap1.misses - snap0.misses).sum()
        up = float((snap1.uploaded_bytes - snap0.uploaded_bytes).sum())
        if hits + miss:
            print(f"a step's experts: {hits / n_cnt:.1f} hits, {miss / n_cnt:.1f} misses ({hits / (hits + miss):.1%} hits), "
                  f"{up / n_cnt / 1e6:.1f} MB uploaded", flush=True)  # fmt: skip
        for th in [int(t) for t in args.threads.split(",") if t]:
            numba.set_num_threads(th)
            ts = []
            for _ in range(28):
                t = time.perf_counter()
                s.model.forward([int(rng.integers(0, V))], pos, s.cache)
                ts.append((time.perf_counter() - t) * 1e3)
                pos += 1
            print(f"numba threads {th}: step median {statistics.median(ts[4:]):.2f} ms", flush=True)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        g = s.model.decode_graph
        if g is None:
            print("no decode graph on this placement")
            return
        L = max((k for k, v in g.graphs.items() if len(v) == len(g.segments)), default=None)
        cuts = [seg.moe for seg in g.segments[:-1]]
        print(f"{len(g.segments)} segments a token (bucket {L}); cut layers {cuts[:3]}..{cuts[-3:] if cuts else ''}; "
              f"kinds {sorted(set(g.cuts))}", flush=True)  # fmt: skip

        if cuda and L is not None:  # captured graphs: replays to time
            def gpu_only():
                g.replay(L)
                torch.cuda.synchronize()

            def seg_waited():
                for gr in g.graphs[L]:
                    gr.replay()
                    torch.cuda.synchronize()

            stream = torch.cuda.current_stream()

            def seg_stream_waited():
                for gr in g.graphs[L]:
                    gr.replay()
                    stream.synchronize()

            ev = torch.cuda.Event()

            def seg_spin():
                for gr in g.graphs[L]:
                    gr.replay()
                    ev.record(stream)
                    while not ev.query():
                        pass

            t_gpu = med_ms(gpu_only, 30)
            t_seg = med_ms(seg_waited, 30)
            t_segs = med_ms(seg_stream_waited, 30)
            t_spin = med_ms(seg_spin, 30)
            print(f"GPU alone (segments back to back): {t_gpu:.2f} ms; each waited for (device sync): {t_seg:.2f} ms; "
                  f"(stream sync) {t_segs:.2f}; (event spin) {t_spin:.2f}  -> per cut {(t_segs - t_gpu) / max(len(cuts), 1) * 1e3:.0f} us "
                  f"beyond the GPU time", flush=True)  # fmt: skip
            x = torch.zeros(1, device="cuda")
            t_sync = med_ms(lambda: stream.synchronize(), 200) * 1e3
            t_k = med_ms(lambda: (x.add_(1), stream.synchronize()), 200) * 1e3
            print(f"empty stream sync {t_sync:.1f} us; one tiny kernel + sync {t_k:.1f} us", flush=True)
        if not cuts:
            return
        D, K, E = s.args.n_embd, max(s.args.n_expert_used, 1), s.args.n_expert
        h = rng.standard_normal((1, D), dtype=np.float32)
        w = np.full((1, K), 1.0 / K, np.float32)
        idss = [np.sort(rng.choice(E, K, replace=False)).astype(np.int64)[None] for _ in range(64)]
        it = iter(range(10**9))

        def host_all():
            j = next(it)
            for n, i in enumerate(cuts):
                s.model.experts_of(i).host_part(i, h, idss[(j + n) % 64], w)

        def kernels_all():
            j = next(it)
            for n, i in enumerate(cuts):
                st = host_stacks[i]
                moe_ffn(st.gate, st.up, st.down, h[0], idss[(j + n) % 64][0], w[0], q8_act=True)

        host_stacks = {}
        for i in cuts:
            b = s.model.experts_of(i)
            b = getattr(b, "host", b)  # a streaming wrapper's one-token work is its host backend's
            if hasattr(b, "host_stacks"):  # the expert cache's host half computes misses only: no stacks to time
                host_stacks[i] = b.host_stacks(i)
        in_step = []
        for i in cuts:  # time the host half inside real steps (an instance attribute shadows the method)
            b = s.model.experts_of(i)
            if "host_part" in vars(b):
                continue

            def timed(layer, X, ids, weights, _f=b.host_part):
                t0 = time.perf_counter()
                try:
                    return _f(layer, X, ids, weights)
                finally:
                    in_step.append(time.perf_counter() - t0)

            b.host_part = timed
        step2 = []
        for _ in range(24):
            t = time.perf_counter()
            s.model.forward([int(rng.integers(0, V))], pos, s.cache)
            step2.append((time.perf_counter() - t) * 1e3)
            pos += 1
        if len(in_step) != 24 * len(cuts):  # the cache calls its host half only for layers with misses
            print(f"in real steps: step median {statistics.median(step2):.2f} ms; host halves {sum(in_step) / 24 * 1e3:.2f} "
                  f"ms a step over {len(in_step) / 24:.1f} calls", flush=True)  # fmt: skip
        else:
            per = np.asarray(in_step).reshape(24, len(cuts)) * 1e3
            print(f"in real steps: step median {statistics.median(step2):.2f} ms; host halves {np.median(per.sum(1)):.2f} ms "
                  f"a step; per layer median {np.median(per) * 1e3:.0f} us, first cut {np.median(per[:, 0]) * 1e3:.0f} us, "
                  f"by layer (us): {' '.join(f'{v * 1e3:.0f}' for v in np.median(per, 0))}", flush=True)  # fmt: skip
        for b in {id(x): x for x in (s.model.experts_of(i) for i in cuts)}.values():
            vars(b).pop("host_part", None)
        from engine.generate.sampling import SamplingParams

        s.reset()
        gen = [e for e in s.generate(prompt_ids=toks, params=SamplingParams.greedy(max_tokens=64))][-1]
        print(f"generate (greedy, as sharpi bench): prompt {gen.prompt_tok_s:.1f} tok/s, decode {gen.decode_tok_s:.2f} tok/s",
              flush=True)  # fmt: skip
        pos = len(s.state.tokens)  # the cache now ends there (a recurrent layer's state takes positions in order)
        full = numba.get_num_threads()
        for th in sorted({full, max(1, full * 3 // 4), max(1, full // 2)}, reverse=True) if host_stacks else ():
            numba.set_num_threads(th)
            t_h = med_ms(host_all, 20)
            t_kk = med_ms(kernels_all, 20)
            st = host_stacks[cuts[0]]
            nb = K * (st.gate.nbytes + st.up.nbytes + st.down.nbytes) / E * len(cuts)
            print(f"threads {th}: host experts of {len(cuts)} layers {t_h:.2f} ms ({t_h / len(cuts) * 1e3:.0f} us a layer, "
                  f"{nb / t_h / 1e6:.1f} GB/s); fused kernels called directly {t_kk:.2f} ms", flush=True)  # fmt: skip
        numba.set_num_threads(full)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(16):
            s.model.forward([int(rng.integers(0, V))], pos, s.cache)
            pos += 1
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
        print("cProfile, 16 steps, by own time:\n" + "\n".join(out.getvalue().splitlines()[:40]), flush=True)
    print("env NUMBA_NUM_THREADS", os.environ.get("NUMBA_NUM_THREADS"))


if __name__ == "__main__":
    main()
