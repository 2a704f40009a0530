"""What the planner predicts for a file under a device profile a GPU run calibrated, as the profile's fields and the
hit-rate curve vary: re-plans without the GPU (a bench JSON's ``profile`` holds the box's calibration).

  PYTHONPATH=. python3 labs/replan_profile.py F ROW.out [--ctx 576] [--cpu-gbps 66,50,46]

ROW.out: ``sharpi bench ... --json`` output of a run on the box (``packaging/gpu_sidebyside`` keeps it per row).
Prints, for each CPU-expert rate, with and without misses over the bus, with the Zipf guess and the synthetic curve
(``engine.runtime.hit_curves.SYNTHETIC_CURVE``): the mode ``auto`` picks, the split, and the predicted decode tok/s
of each mode.
"""

import argparse
import json
from dataclasses import replace

from engine.gguf import open_gguf
from engine.plan import DeviceProfile, ModelSpec, PlanRequest, plan
from engine.runtime.hit_curves import SYNTHETIC_CURVE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("bench_json")
    ap.add_argument("--ctx", type=int, default=576)
    ap.add_argument("--cpu-gbps", default="")
    args = ap.parse_args()
    prof = DeviceProfile.from_dict(json.load(open(args.bench_json))["profile"])
    with open_gguf(args.model) as gf:
        spec = ModelSpec.from_gguf(gf)
    print({k: round(getattr(prof, k), 2) for k in ("cpu_expert_gbps", "h2d_gbps", "bus_read_gbps", "sync_us")})
    rates = [float(x) for x in args.cpu_gbps.split(",") if x] or [prof.cpu_expert_gbps]
    for gb in rates:
        for bus in (False, True):
            for name, curve in (("zipf", ()), ("synthetic", SYNTHETIC_CURVE)):
                p = plan(
                    spec,
                    replace(prof, hit_curve=curve, cpu_expert_gbps=gb),
                    PlanRequest(ctx=args.ctx, kv_type="bf16", cuda_graphs=True, prompt_stream=True, bus_misses=bus),
                )
                tok = {k: round(v, 1) if v else v for k, v in p.predicted_tok_s.items()}
                print(f"cpu {gb:5.1f} GB/s  bus {bus!s:5}  curve {name:9}  auto {p.moe_mode:8} split {p.n_cpu_moe}  {tok}")


if __name__ == "__main__":
    main()
