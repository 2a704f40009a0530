# ruff: noqa: B023, E702, E401  (lab script: lambdas run inside the loop iteration that made them)
"""PDL on/off × exact-float/q8 kernels for the given types and workloads (CUDA-graph medians, the
bench's own workloads). Run: PYTHONPATH=. python3 packaging/gpu_labs/pdl_bench.py Q4_K,Q6_K moe,q,o,kv"""

import os
import sys

from engine.bench import device_kernels as dk
from engine.quant.formats import QType

types = [QType[t] for t in sys.argv[1].split(",")]
wls = sys.argv[2].split(",")
bw = dk.measure_bandwidth()
print(f"bw {bw:.0f} GB/s", flush=True)
for q in types:
    for wl in wls:
        row = []
        for pdl in ("0", "1"):
            os.environ["SHARPI_PDL"] = pdl
            for act in ("f32", "q8"):
                try:
                    v = dk.moe_workload(q, False, act) if wl == "moe" else dk.trunk_workload(q, wl, False, act)
                    row.append(f"pdl{pdl} {act} {v['graph_us']:6.2f}us {v['bytes'] / v['graph_us'] / 1e3 / bw:4.0%}")
                except Exception as e:
                    row.append(f"pdl{pdl} {act} ERR {type(e).__name__} {str(e)[:200]}")
        print(f"{q.name:5} {wl:4} | " + " | ".join(row), flush=True)
