"""Where a placement's device memory goes, phase by phase, against the budget it was planned for.

For each configuration (in a fresh child process, so each has its own CUDA context), prints at each phase
the process's memory as nvidia-smi counts it (``--query-compute-apps``), torch's allocated / reserved bytes
(current and peak), and the arena's charges by kind: after CUDA init, after the first Triton launch, after
apply, after a 512-token prompt, after the first decode token (graph captures) and after GEN tokens.

  PYTHONPATH=. python3 labs/vram_budget.py F.gguf [BUDGET:MODE[:N_CPU_MOE] ...]
  e.g. PYTHONPATH=. python3 labs/vram_budget.py /tmp/F.gguf 12GiB:cache 12GiB:resident:19 8GiB:cache
"""

import json
import os
import subprocess
import sys
import threading
import time

PROMPT, GEN, CTX = 512, 64, 4096


def smi_mib(pid: int) -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    for line in out.splitlines():
        p, m = (x.strip() for x in line.split(","))
        if int(p) == pid:
            return int(m)
    return 0


def child(path: str, cfg: str) -> None:
    from engine import config

    config.apply_process_settings()  # before CUDA starts: the allocator settings the CLI and the app use
    import numpy as np
    import torch

    from engine.api import LoadOptions, Session
    from engine.generate.sampling import SamplingParams
    from engine.plan import DeviceProfile, PlanRequest
    from engine.plan.units import parse_size

    parts = cfg.split(":")
    budget, mode = parse_size(parts[0]), parts[1]
    ncm = int(parts[2]) if len(parts) > 2 else 0
    pid = os.getpid()
    peak = {"mib": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak["mib"] = max(peak["mib"], smi_mib(pid))
            time.sleep(0.1)

    rows = []

    def phase(name, s=None):
        torch.cuda.synchronize()
        a = s.applied.arena if s is not None and s.applied is not None else None
        rows.append(
            {
                "phase": name,
                "smi_mib": smi_mib(pid),
                "smi_peak_mib": peak["mib"],
                "alloc_mib": torch.cuda.memory_allocated() >> 20,
                "max_alloc_mib": torch.cuda.max_memory_allocated() >> 20,
                "reserved_mib": torch.cuda.memory_reserved() >> 20,
                "max_reserved_mib": torch.cuda.max_memory_reserved() >> 20,
                "arena_mib": {k: v >> 20 for k, v in a.by_kind.items()} if a else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    threading.Thread(target=sample, daemon=True).start()
    phase("cuda init")
    req = PlanRequest(ctx=CTX, kv_type="f32", moe=mode, n_cpu_moe=ncm)
    with Session.load(path, LoadOptions(n_ctx=CTX, device="cuda", placement=req, vram_budget=budget)) as s:
        p = s.applied.placement
        print(
            f"# {cfg}: planned device {p.device.to_dict()} budget {p.budget_bytes >> 20} MiB; "
            f"{s.applied.describe()}",
            flush=True,
        )
        phase("applied", s)
        ids = [int(t) for t in np.random.default_rng(0).integers(8, s.args.n_vocab - 8, PROMPT)]
        for _ in s.generate(prompt_ids=ids, params=SamplingParams.greedy(max_tokens=1)):
            pass
        phase("prompt + 1 token", s)
        s.reset()
        for _ in s.generate(prompt_ids=ids, params=SamplingParams.greedy(max_tokens=GEN)):
            pass
        phase(f"prompt + {GEN} tokens", s)
        time.sleep(0.3)
        stop.set()
        print(
            f"# {cfg}: nvidia-smi peak {peak['mib']} MiB vs budget {budget >> 20} MiB "
            f"({'OVER' if peak['mib'] > budget >> 20 else 'within'} by {abs(peak['mib'] - (budget >> 20))} MiB)",
            flush=True,
        )


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    path, cfgs = sys.argv[1], sys.argv[2:] or ["12GiB:cache"]
    for cfg in cfgs:
        print(f"=== {cfg}", flush=True)
        subprocess.run([sys.executable, __file__, "--child", path, cfg], check=False)


if __name__ == "__main__":
    main()
