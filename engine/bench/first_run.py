"""A new user's first minutes, measured: kernel preparation and the first answers' time to first token,
on a fresh numba cache (a first run) and again on the cache it left (a restart), with and without
the warm-up on load (engine.warmup).

    python -m engine.bench.first_run [-m MODEL] [--questions 10] [--modes none,warmup] [--json]

Each run is a fresh interpreter with ``NUMBA_CACHE_DIR`` set to a new temporary directory (and the
kernel counts' file beside it), so "first run" means what it does on a machine that never ran the
engine. A run loads the model (the demo by default, at its default context), warms it up or not,
then asks the demo's questions one by one with the chat's default sampling (seeded), each in a
fresh conversation. Numbers: seconds from interpreter start to the model loaded, to the chat ready
(after the warm-up), and per question the time to first token and the decode speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from engine import config

QUESTIONS = (
    "Explain the for statement",
    "What is a decorator?",
    "Explain the with statement",
    "What is a generator?",
    "Explain the if statement",
    "What is a lambda?",
    "Explain the try statement",
    "What is a class?",
    "Explain the while statement",
    "What is a module?",
)


def _child(model: str | None, mode: str, n_questions: int) -> dict:
    t0 = time.perf_counter()
    import torch

    from engine.api import AUTO_CTX, LoadOptions, Session
    from engine.demo import demo_model_path
    from engine.generate import SamplingParams
    from engine.plan import PlanRequest
    from engine.warmup import warm_up

    # As the app and `sharpi run` place it: on the GPU when there is one (as many layers as fit, the
    # expert mode the planner picks), else everything on the CPU.
    gpu = PlanRequest(n_gpu_layers=-1) if torch.cuda.is_available() else None
    s = Session.load(model or str(demo_model_path()), LoadOptions(n_ctx=AUTO_CTX, placement=gpu))
    where = s.applied.describe() if s.applied else "all layers on the CPU"
    out: dict = {"mode": mode, "placement": where, "loaded_s": round(time.perf_counter() - t0, 2)}
    if mode == "warmup":
        stamps: list[float] = []  # a kernel's compilation begins, ends, the next begins, ... (never nested)
        w = warm_up(s, lambda k, n, estimated: stamps.append(time.perf_counter()))
        out["warmup_s"], out["kernels_compiled"] = round(w.seconds, 2), w.compiled
        times = [round(b - a, 1) for a, b in zip(stamps[::2], stamps[1::2])]
        out["kernel_compile_s"] = [[k, t] for k, t in zip(w.kernels, times)]  # each compilation, in order
    out["ready_s"] = round(time.perf_counter() - t0, 2)
    answers = []
    for i, q in enumerate(QUESTIONS[:n_questions]):
        params = SamplingParams(max_tokens=64, seed=i)
        last = list(s.generate(messages=[{"role": "user", "content": q}], params=params))[-1]
        answers.append(
            {
                "ttft_ms": round(last.ttft_s * 1000, 1),
                "decode_tok_s": round(last.decode_tok_s, 1),
                "n_generated": last.n_generated,
                "done_s": round(time.perf_counter() - t0, 2),  # since the interpreter started
            }
        )
        s.reset()
    out["answers"] = answers
    return out


def _run(model: str | None, mode: str, n: int, cache: str) -> dict:
    env = config.child_environ({"NUMBA_CACHE_DIR": cache, "SHARPI_CALIBRATION_DIR": os.path.join(cache, "calibration")})
    cmd = [sys.executable, "-m", "engine.bench.first_run", "--child", mode, "--questions", str(n)]
    if model:
        cmd += ["-m", model]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.first_run", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the bundled demo model)")
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--modes", default="none,warmup", help="comma-separated: none (no warm-up), warmup")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.model, a.child, a.questions)))
        return 0
    results = []
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="sharpi-first-run-") as cache:
            for run in ("first run", "restart"):
                r = _run(a.model, mode, a.questions, cache)
                r["run"] = run
                results.append(r)
                if not a.json:
                    ttft = [x["ttft_ms"] for x in r["answers"]]
                    print(
                        f"{mode:<7} {run:<9} loaded {r['loaded_s']:7.2f} s  ready {r['ready_s']:7.2f} s"
                        f"  kernels compiled {r.get('kernels_compiled', '-')!s:>3}"
                        f"  1st answer done {r['answers'][0]['done_s']:7.2f} s"
                        f"  TTFT 1st {ttft[0]:9.1f} ms  2nd {ttft[1] if len(ttft) > 1 else 0:7.1f} ms"
                        f"  10th {ttft[-1]:7.1f} ms  decode 1st {r['answers'][0]['decode_tok_s']:6.1f} tok/s",
                        flush=True,
                    )
                    if r.get("kernel_compile_s"):
                        print("        kernels: " + ", ".join(f"{k} {t} s" for k, t in r["kernel_compile_s"]))
    if a.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
