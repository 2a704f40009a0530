"""``sharpi bench <what>``: benchmarks. ``sharpi bench kernels [--json]`` times the CPU GEMV kernels.

Sub-subcommands live side by side under ``bench`` (a model benchmark, ``sharpi bench -m FILE``,
is planned beside ``kernels``).
"""

from __future__ import annotations

import argparse
import json
import os

from engine.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (kernels: CPU GEMV GB/s against memory bandwidth)")
    what = p.add_subparsers(dest="bench_what", metavar="WHAT")
    what.required = True
    k = what.add_parser("kernels", help="GEMV GB/s per weight type on routed-expert and trunk workloads")
    k.add_argument("--json", action="store_true", help="print machine-readable JSON")
    k.add_argument("--threads", type=int, default=0, help="numba threads (default: all cores)")
    k.add_argument("--types", default="", help="comma-separated weight types (default: all), e.g. Q4_K,Q8_0")
    k.add_argument("--variant", choices=("q8", "exact", "both"), default="both", help="activation handling to time")
    k.add_argument("--reps", type=int, default=40, help="timed repetitions per workload (median reported)")
    k.set_defaults(func=run_kernels)


def run_kernels(args: argparse.Namespace) -> int:
    import numba

    from engine.bench import kernels as bench
    from engine.quant.formats import WEIGHT_TYPES, QType

    threads = args.threads or os.cpu_count() or 1
    if threads > numba.config.NUMBA_NUM_THREADS:
        raise UsageError(f"--threads {threads}: numba allows at most {numba.config.NUMBA_NUM_THREADS}")
    numba.set_num_threads(threads)
    names = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    try:
        types = [QType[n] for n in names] or list(WEIGHT_TYPES)
    except KeyError as e:
        raise UsageError(f"unknown weight type {e}; choose from {', '.join(t.name for t in WEIGHT_TYPES)}") from None
    variants = {"q8": (True,), "exact": (False,), "both": (True, False)}[args.variant]
    report = bench.run(types, variants, reps=args.reps)
    if args.json:
        print(json.dumps(report, indent=2, default=float))
    else:
        print(bench.format_table(report))
    return 0
