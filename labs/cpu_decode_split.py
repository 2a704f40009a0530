"""Where one CPU decode token's time goes: the whole step (``model.forward`` of one token after a
prompt), then its pieces run alone over all layers with the step's arguments — the fused layer call
(``decode_moe_layer``) and, inside it, the norm and quantization, q/k/v, attention, the output
projection, the router and routing, the experts' gate/up and down — then the output norm and
vocabulary matrix. Medians of REPS passes; each piece runs over every layer in turn (and the
experts on other experts each pass) so that weights stream from DRAM as they do in a step.

  PYTHONPATH=. python3 labs/cpu_decode_split.py /tmp/bench_qwen3moe_q4k.gguf [--prompt 512] [--reps 30] [--cpu-time]

``--cpu-time`` times the calling thread's CPU time instead of the wall clock: with
``NUMBA_NUM_THREADS=1`` it is the work of each piece, steadier than wall time on a shared machine.
The whole step minus the layer calls and the output is Python, embedding, rope and bookkeeping.
"""

import argparse
import statistics
import time

import numpy as np
import torch

from engine.api import LoadOptions, Session
from engine.kernels import floats
from engine.kernels.host_layers import attention_rows, decode_moe_layer, gemv_q8, qkv_q8, rms_norm_host, route_rows
from engine.kernels.moe_fused import moe_down_q8, moe_gate_up_q8, quantize_for
from engine.models.layers import rms_norm, rope_theta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter

    def med(f):
        ts = []
        for _ in range(args.reps):
            t0 = clock()
            f()
            ts.append(clock() - t0)
        return statistics.median(ts)

    with Session.load(args.model, LoadOptions(n_ctx=args.prompt + 16 + args.reps)) as s:
        m, cache, a = s.model, s.cache, s.args
        rng = np.random.default_rng(0)
        m.forward(rng.integers(100, 1000, args.prompt).tolist(), 0, cache, all_logits=False)
        pos, tok = args.prompt, 5

        def step():
            nonlocal pos
            m.forward([tok], pos, cache, all_logits=False)
            pos += 1

        for _ in range(3):
            step()
        whole = med(step)
        P = pos
        x = m.embed(np.array([tok])).numpy()[0].copy()
        theta = torch.from_numpy(rope_theta(np.array([P]), a.rope_dim, a.rope_base, a.rope_scale))
        c, sn = torch.cos(theta).numpy(), torch.sin(theta).numpy()
        E, K = a.n_expert, a.n_expert_used
        st = []
        for li, layer in enumerate(m.layers):
            f = layer.fused
            if f is None:
                raise SystemExit(f"layer {li} has no fused host step: this lab times that path only")
            Kc, Vc = cache.k[li].q.numpy(), cache.v[li].q.numpy()
            h = rms_norm_host(x, f.head[0], f.head[2]).reshape(1, -1)
            q8 = quantize_for(f.qkv[0], h)
            q = qkv_q8(*f.qkv[:9], *q8)[0].reshape(1, -1)
            o = attention_rows(q, Kc, Vc, P, *f.shape[1:])
            ah = quantize_for(f.experts[0], h)
            ids, w = route_rows(rng.standard_normal((1, E)).astype(np.float32), K, True)
            F = f.experts[1].shape[0] // E
            hq = moe_gate_up_q8(*f.experts[:5], ids[0], *ah, F, f.experts[5])[1:]
            full = (x, *f.head, *f.qkv, *f.attn, c, sn, *f.shape, Kc, Vc, P, *f.out, *f.route, *f.experts)
            st.append(dict(f=f, full=full, h=h, q8=q8, q=q, Kc=Kc, Vc=Vc, ao=quantize_for(f.out[0], o), ah=ah, w=w,
                           F=F, hq=hq, lg=np.empty((E, 1), np.float32)))  # fmt: skip
        picks = [np.sort(rng.choice(E, K, replace=False)).astype(np.int64) for _ in range(64)]
        n = [0]

        def other_experts():
            n[0] += 1
            return picks[n[0] % len(picks)]

        rows, zeros = np.arange(E), np.zeros(E, np.int64)
        xt = m.embed(np.array([tok]))
        parts = {
            "layer calls": lambda: [decode_moe_layer(*d["full"]) for d in st],
            "norm + quantize": lambda: [
                quantize_for(d["f"].qkv[0], rms_norm_host(x, d["f"].head[0], d["f"].head[2]).reshape(1, -1))
                for d in st
            ],
            "q/k/v": lambda: [qkv_q8(*d["f"].qkv[:9], *d["q8"]) for d in st],
            "attention": lambda: [attention_rows(d["q"], d["Kc"], d["Vc"], P, *d["f"].shape[1:]) for d in st],
            "output projection": lambda: [gemv_q8(*d["f"].out, *d["ao"]) for d in st],
            "router": lambda: [floats.gemv_f32(d["f"].route[0], rows, zeros, d["h"], d["lg"]) for d in st],
            "routing": lambda: [route_rows(d["lg"].reshape(1, E), K, True) for d in st],
            "experts gate/up": lambda: [
                moe_gate_up_q8(*d["f"].experts[:5], other_experts(), *d["ah"], d["F"], d["f"].experts[5]) for d in st
            ],
            "experts down": lambda: [
                moe_down_q8(*d["f"].experts[5:], other_experts(), d["w"][0], *d["hq"], x.shape[0]) for d in st
            ],
            "output norm + matrix": lambda: m.output(rms_norm(xt, m.out_norm, a.rms_eps)),
        }
        t = {k: med(f) for k, f in parts.items()}
        unit = "thread CPU" if args.cpu_time else "wall"
        print(f"one decode token at position {P}, {len(st)} layers, {unit} ms (median of {args.reps}):")
        print(f"  {'whole step':22s} {whole * 1e3:7.2f}  {1 / whole:6.1f} tok/s")
        for k, v in t.items():
            print(f"  {k:22s} {v * 1e3:7.2f}  {v / whole:6.1%}")
        inner = sum(v for k, v in t.items() if k not in ("layer calls", "output norm + matrix"))
        print(f"  {'pieces inside layers':22s} {inner * 1e3:7.2f}  (layer calls - this: the calls' own cost)")
        rest = whole - t["layer calls"] - t["output norm + matrix"]
        print(f"  {'rest of the step':22s} {rest * 1e3:7.2f}  {rest / whole:6.1%} (Python, embedding, rope, bookkeeping)")


if __name__ == "__main__":
    main()
