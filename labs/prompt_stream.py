"""A long prompt with the routed experts on the CPU (`--moe cpu`, and a `--n-cpu-moe` split beside a resident
pool): the device layers' host experts streamed to the GPU and computed there (SHARPI_PROMPT_STREAM_MIN, default
32) against the CPU computing them (the knob at 0), at one VRAM budget. Per configuration: one warm prompt, then
one measured prompt of other tokens (a fresh KV cache). For the streamed runs it reports the bytes copied, the
upload rate over the prompt's wall time and over the side stream's copy spans, and the shares of the prompt's
time issuing copies (memory map → pinned on the host thread, with its waits for the pinned ring), in copy
spans on the side stream and in expert kernels on the device (CUDA events,
``StreamedExperts.last_pass_seconds``). First, the link's own rates for one layer's experts: memory map →
pinned on 8 threads, pinned → device, pageable → device.

  PYTHONPATH=. python3 labs/prompt_stream.py F [--vram 12GiB] [--prompt 512] [--split 19 20 21]

F: the Qwen3-30B-A3B-geometry Q4_K_M file (`python3 -m engine.cli.main synth --geometry qwen3-30b-a3b -o F
--fill-random`). The same comparison through the product's bench (prompt tok/s only):

  python3 -m engine.cli.main bench -m F --prompt 512 --gen 8 --device cuda --vram 12GiB --moe cpu
  SHARPI_PROMPT_STREAM_MIN=0 python3 -m engine.cli.main bench -m F --prompt 512 --gen 8 --device cuda --vram 12GiB --moe cpu
"""

import argparse
import time
from dataclasses import replace

import numpy as np
import torch

from engine.api import LoadOptions, Session
from engine.generate.sampling import SamplingParams
from engine.plan import DeviceProfile, PlanRequest, format_size, parse_size
from engine.runtime.expert_pool import ROLES
from engine.runtime.expert_stream import copy_many


def link_rates(s: Session) -> None:
    """GB/s of one layer's experts: memory map -> pinned (8 threads), pinned -> device, pageable -> device."""
    w = s.model.expert_stacks()[0]
    src = [np.ascontiguousarray(getattr(w, r).raw).view(np.uint8).reshape(-1) for r in ROLES]
    n = sum(a.size for a in src)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    view, jobs, o = pinned.numpy(), [], 0
    for a in src:  # ~1 MB pieces, as the streamer copies an expert's roles
        for p in range(0, a.size, 1 << 20):
            m = min(1 << 20, a.size - p)
            jobs.append((view[o + p : o + p + m], a[p : p + m]))
        o += a.size
    rates = {}
    for label, fn in (
        ("map -> pinned (8 threads)", lambda: copy_many(jobs)),
        ("pinned -> device", lambda: dev.copy_(pinned, non_blocking=True)),
        ("pageable map -> device", lambda: [dev[: a.size].copy_(torch.from_numpy(a)) for a in src]),
    ):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        rates[label] = 3 * n / (time.perf_counter() - t) / 1e9
    got = ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items())
    print(f"one layer's experts {format_size(n)}: {got}", flush=True)


def prompt(s: Session, n: int, a: int) -> tuple[float, float]:
    """(seconds, prompt tok/s) of an n-token prompt from an empty cache, one token generated."""
    ids = [(a * i) % 5000 + 10 for i in range(n)]
    s.reset()
    torch.cuda.synchronize()
    t = time.perf_counter()
    *_, last = s.generate(prompt_ids=ids, params=SamplingParams.greedy(max_tokens=1))
    return time.perf_counter() - t, last.prompt_tok_s


def run(s: Session, req: PlanRequest, budget: int, n: int, label: str) -> None:
    for stream_min in (s.engine_options.prompt_stream_min or 32, 0):
        opts = replace(s.engine_options, prompt_stream_min=stream_min)
        p = s.plan(replace(req, prompt_stream=stream_min > 0), DeviceProfile(vram_bytes=budget))
        s.apply(p, opts)
        st = s.applied.stream
        name = f"{label}, streaming {'on (≥ %d tokens)' % stream_min if stream_min else 'off'}"
        if stream_min and st is None:
            print(f"{name}: no staging on this placement — {'; '.join(p.notes)}", flush=True)
            continue
        prompt(s, n, 7)  # warm: numba, Triton, the page cache
        b0, h0 = (st.streamed_bytes, st.host_copy_s) if st else (0, 0.0)
        secs, tok_s = prompt(s, n, 11)
        line = f"{name}: {n}-token prompt {secs:.3f} s = {tok_s:.1f} tok/s"
        if st is not None:
            nbytes, host = st.streamed_bytes - b0, st.host_copy_s - h0
            dev = st.last_pass_seconds()
            copy, comp = dev.get("copy", 0.0), dev.get("compute", 0.0)
            line += (
                f"; streamed {nbytes / 1e9:.2f} GB ({st.half} experts a half, {p.stream_slots} slots "
                f"{format_size(p.device.stream)}): {nbytes / secs / 1e9:.1f} GB/s over the prompt, "
                f"{nbytes / max(copy, 1e-9) / 1e9:.1f} GB/s over the copy spans; issuing copies (host copies, "
                f"pinned-ring waits) {host:.3f} s "
                f"({host / secs:.0%}), copy spans {copy:.3f} s ({copy / secs:.0%}), expert kernels {comp:.3f} s "
                f"({comp / secs:.0%})"
            )
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--vram", default="12GiB")
    ap.add_argument("--prompt", type=int, default=512)
    # At 12 GiB on F (f32 KV, ctx 528): 19 leaves 17 MiB (no staging), 20 gives two halves of 66, 21 of 128.
    ap.add_argument("--split", type=int, nargs="*", default=[19, 20, 21], help="--n-cpu-moe of resident splits")
    a = ap.parse_args()
    budget, n = parse_size(a.vram), a.prompt
    with Session.load(a.model, LoadOptions(n_ctx=n + 16, device="cuda")) as s:
        link_rates(s)
        L = s.args.n_layer
        run(s, PlanRequest(ctx=n + 16, kv_type="f32", n_gpu_layers=L, moe="cpu"), budget, n, "--moe cpu")
        for k in a.split:
            req = PlanRequest(ctx=n + 16, kv_type="f32", n_gpu_layers=L, moe="resident", n_cpu_moe=k)
            try:
                run(s, req, budget, n, f"--n-cpu-moe {k} --moe resident")
            except Exception as e:  # a split may not fit the budget: say so, keep the other results
                print(f"--n-cpu-moe {k} --moe resident: {e}", flush=True)


if __name__ == "__main__":
    main()
