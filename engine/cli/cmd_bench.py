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
    p = sub.add_parser(
        "bench",
        help="benchmarks: -m FILE (model tok/s), kernels (CPU GEMV GB/s against memory bandwidth)",
        description="sharpi bench -m FILE [...]: prompt and decode tok/s of a model; "
        "sharpi bench kernels: CPU GEMV throughput.",
    )
    from engine.cli.common import add_mtp_arg, add_placement_args, add_route_args

    p.add_argument("-m", "--model", help="GGUF model to benchmark")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen", type=int, default=32, help="generated tokens (default 32)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs; medians are reported (default 3)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-type", choices=("f32", "bf16", "q8_0"), default=None, help="KV cache dtype (default: bf16)")
    p.add_argument("--exact-float", action="store_true", help="exact dequantized weights, no activation rounding")
    p.add_argument("--vs-llama-cpp", action="store_true", help="also run llama.cpp (CPU) on the file and print ratios")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--compare-modes",
        action="store_true",
        help="benchmark every expert mode that fits (cpu, cache, resident) on the same placement, "
        "with the planner's prediction beside each, and say whether the auto choice was the fastest",
    )
    add_placement_args(p)
    add_route_args(p)
    add_mtp_arg(p)
    p.set_defaults(func=run_model)
    what = p.add_subparsers(dest="bench_what", metavar="WHAT")
    k = what.add_parser("kernels", help="GEMV GB/s per weight type on routed-expert and trunk workloads")
    k.add_argument("--json", action="store_true", help="print machine-readable JSON")
    k.add_argument("-t", "--threads", type=int, default=0, help="numba threads (default: all cores)")
    k.add_argument("--types", default="", help="comma-separated weight types (default: all), e.g. Q4_K,Q8_0")
    k.add_argument("--variant", choices=("q8", "exact", "both"), default="both", help="activation handling to time")
    k.add_argument("--reps", type=int, default=40, help="timed repetitions per workload (median reported)")
    k.set_defaults(func=run_kernels)
    dk = what.add_parser("device-kernels", help="quantized Triton kernels' GB/s on the GPU vs its bandwidth and torch")
    dk.add_argument("--json", action="store_true", help="print machine-readable JSON")
    dk.add_argument("--types", default="", help="comma-separated weight types (default: all), e.g. Q4_K,Q6_K")
    dk.add_argument("--workloads", default="moe,q,o,kv", help="comma-separated: moe (routed experts), q, o, kv")
    dk.add_argument("--tune", action="store_true", help="sweep launch settings; print the best per kernel/type/shape")
    dk.set_defaults(func=run_device_kernels)
    sm = what.add_parser("sampler", help="host ms a token spends sampling, against a full-sort sampler")
    sm.add_argument("--json", action="store_true", help="print machine-readable JSON")
    sm.add_argument("--reps", type=int, default=20, help="timed draws per row (mean reported)")
    sm.set_defaults(func=run_sampler)
    ca = what.add_parser(
        "cache",
        help="expert-cache policies replayed on a routing trace, against Belady's optimum",
        description="Replay every expert-cache policy on a routing trace (--trace FILE, recorded with "
        "--record-routes, or --synthetic: Qwen3-30B-A3B's published routing statistics) at each capacity "
        "(a fraction of each layer's experts on the device): hit rates, their fraction of Belady's offline "
        "optimum, and whether caching pays against CPU experts (the planner's cost terms).",
    )
    src = ca.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="a routing trace (.npz, engine.routes)")
    src.add_argument("--synthetic", action="store_true", help="the synthetic Qwen3-30B-A3B trace")
    ca.add_argument(
        "--capacity", default="0.05,0.2,0.4,0.6", help="comma-separated fractions (default 0.05,0.2,0.4,0.6)"
    )
    ca.add_argument("--policies", default="", help="comma-separated policies (default: all)")
    ca.add_argument("--layers", type=int, default=0, help="replay only the first N layers of the trace")
    ca.add_argument("--seed", type=int, default=0, help="--synthetic: the generator's seed")
    ca.add_argument("--save-trace", metavar="FILE", default=None, help="--synthetic: also write the trace")
    ca.add_argument(
        "--profile", metavar="FILE.json", default=None, help="a DeviceProfile (sharpi bench calibrate --json)"
    )
    ca.add_argument("--expert-bytes", type=int, default=None, help="one routed expert's bytes (default: the trace's, "
                    "else Qwen3-30B-A3B's in Q4_K)")  # fmt: skip
    ca.add_argument("--json", action="store_true", help="print machine-readable JSON")
    ca.add_argument("--plot", metavar="FILE.svg", default=None, help="hit rate against capacity per policy (SVG)")
    ca.set_defaults(func=run_cache)
    cal = what.add_parser(
        "calibrate",
        help="measure the planner's device profile (bandwidths, fixed costs) on this machine; cached",
        description="Measure what the planner's cost model needs on this machine with the engine's own code "
        "paths (a few seconds) and cache it; `--moe auto` on CUDA uses the cached profile. "
        "--json prints the DeviceProfile form `sharpi plan --profile FILE` reads.",
    )
    cal.add_argument(
        "--device",
        choices=("cuda", "cpu", "host"),
        default=None,
        help="cuda; host = the CPU alone, as a machine without a GPU runs (the app measures this on its first "
        "launch without a GPU; the model library and placement dock predict with it); cpu = the simulated device",
    )
    cal.add_argument(
        "-m", "--model", default=None, help="GGUF whose expert types/shape to measure (default: 30B-A3B Q4_K_M)"
    )
    cal.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    cal.add_argument("--force", action="store_true", help="measure again even if a cached profile exists")
    cal.add_argument("--json", action="store_true", help="print the profile as JSON (DeviceProfile.to_dict)")
    cal.set_defaults(func=run_calibrate)


def run_cache(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from engine.bench import cache
    from engine.plan import DeviceProfile
    from engine.routes import load_trace, save_trace
    from engine.routes.synthetic import QWEN3_30B_A3B
    from engine.runtime.cache_policies import POLICIES

    try:
        caps = [float(c) for c in args.capacity.split(",") if c.strip()]
    except ValueError:
        raise UsageError(f"--capacity {args.capacity!r}: comma-separated fractions, e.g. 0.05,0.2") from None
    if not caps or any(not 0 <= c <= 1 for c in caps):
        raise UsageError("--capacity takes fractions between 0 and 1")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] or list(POLICIES)
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise UsageError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    if args.plot and not args.plot.endswith(".svg"):
        raise UsageError("--plot writes SVG (no plotting library is installed for PNG): name a .svg file")
    if args.synthetic:
        gen = QWEN3_30B_A3B if args.layers <= 0 else replace(QWEN3_30B_A3B, n_layers=args.layers)
        trace = gen.generate(seed=args.seed)
        if args.save_trace:
            save_trace(trace, args.save_trace)
    else:
        trace = load_trace(args.trace)
        if args.layers > 0:
            n = args.layers
            meta = dict(trace.meta, layers=trace.meta["layers"][:n]) if "layers" in trace.meta else trace.meta
            trace = replace(trace, ids=trace.ids[:, :n], weights=trace.weights[:, :n], meta=meta).validate()
    profile = None
    if args.profile:
        try:
            with open(args.profile, encoding="utf-8") as f:
                profile = DeviceProfile.from_dict(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"--profile {args.profile}: {e}") from None
    report = cache.run(trace, caps, policies, profile=profile, expert_bytes=args.expert_bytes)
    if args.plot:
        cache.write_svg(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else cache.format_table(report))
    return 0


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


def run_sampler(args: argparse.Namespace) -> int:
    from engine.bench import sampler

    rows = sampler.run(reps=args.reps)
    print(json.dumps(rows, indent=2) if args.json else sampler.format_table(rows))
    return 0 if all(r["same_draws"] for r in rows) else 1


def run_model(args: argparse.Namespace) -> int:
    import numba
    import torch

    from engine.bench.model import bench_session, compare_modes, prediction_report
    from engine.cli.common import load_session, save_route_recording, start_route_recording

    if not args.model:
        raise UsageError("sharpi bench needs -m FILE, or a benchmark name such as 'kernels'")
    if args.prompt < 1 or args.gen < 2 or args.repeat < 1:
        raise UsageError("--prompt >= 1, --gen >= 2 and --repeat >= 1 are required")
    threads = args.threads or os.cpu_count() or 1
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(threads)
    args.ctx_size = args.prompt + args.gen + 16
    with load_session(args) as s:
        threads = s.host_threads  # -t, else the engine's rule for this placement (engine.runtime.threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        recorder = start_route_recording(args, s)
        if args.compare_modes:
            cmp = compare_modes(s, args.prompt, args.gen, args.repeat, threads=threads)
            cmp.update(model=s.info.path, threads=threads, prompt_tokens=args.prompt, gen_tokens=args.gen)
        else:
            report = bench_session(
                s, args.prompt, args.gen, args.repeat, vs_llama_cpp=args.vs_llama_cpp, threads=threads
            )
            report.update(prediction_report(s, report))
        save_route_recording(args, recorder)
    if args.compare_modes:
        print(json.dumps(cmp, indent=2, default=float) if args.json else format_comparison(cmp))
        return 0
    if args.json:
        print(json.dumps(report, indent=2, default=float))
        return 0
    print(f"model      {report['model']} ({report['file_bytes'] / 1e9:.2f} GB)")
    print(f"placement  {report['placement']}, {threads} threads")
    for note in report.get("replans", ()):
        print(f"re-plan    {note}")
    print(f"prompt     {report['prompt_tok_s']:.1f} tok/s ({args.prompt} tokens, median of {args.repeat})")
    print(
        f"decode     {report['decode_tok_s']:.2f} tok/s ({args.gen} tokens): "
        f"{report['bytes_per_token'] / 1e6:.0f} MB of weights per token = {report['decode_gb_s']:.1f} GB/s"
    )
    if report.get("bandwidth_of") == "host+device":
        split = report["bytes_by_memory"]
        print(
            f"bandwidth  {report['read_bandwidth_gb_s']:.1f} GB/s host read, {report['device_bandwidth_gb_s']:.0f} GB/s "
            f"device copy (measured): decode at {report['decode_bw_fraction']:.0%} of the bound "
            f"({report['decode_bound_tok_s']:.1f} tok/s: {split['host'] / 1e6:.0f} MB from host memory, "
            f"{split['device'] / 1e6:.0f} MB from device memory a token)"
        )
    elif "read_bandwidth_gb_s" in report:
        print(
            f"bandwidth  {report['read_bandwidth_gb_s']:.1f} GB/s measured "
            f"{'device copy' if report.get('bandwidth_of') == 'device' else 'read'}: decode at "
            f"{report['decode_bw_fraction']:.0%} of the bound ({report['decode_bound_tok_s']:.1f} tok/s)"
        )
    if report.get("rss_bytes"):
        print(
            f"memory     {report['rss_bytes'] / 1e9:.2f} GB resident while decoding = {report['rss_ratio']:.2f}x the file "
            f"(mapped {report['rss_file_bytes'] / 1e9:.2f} GB, anonymous {report['rss_anon_bytes'] / 1e9:.2f} GB)"
        )
    mtp = report.get("mtp")
    if mtp:
        print(
            f"mtp        {mtp['k']} drafts a step: {mtp['accepted']}/{mtp['drafted']} accepted ({mtp['acceptance']:.0%}) "
            f"over {mtp['passes']} verify passes; one verify pass of {mtp['k'] + 1} positions "
            f"{mtp['verify_ms']:.1f} ms = {mtp['verify_vs_step']:.2f}x a decode step ({mtp['step_ms']:.1f} ms), "
            f"a draft step {mtp['draft_ms']:.1f} ms"
        )
        if "experts_verify_ms" in mtp:
            print(
                f"mtp        routed experts of one layer for {mtp['k'] + 1} positions grouped by expert "
                f"{mtp['experts_verify_ms']:.2f} ms = {mtp['experts_verify_vs_step']:.2f}x one token's "
                f"({mtp['experts_step_ms']:.2f} ms) with independent routes, {mtp['experts_shared_vs_step']:.2f}x "
                "with shared ones"
            )
    if report["hit_rate"] is not None:
        print(f"cache      hit rate {report['hit_rate']:.1%}, uploads {report['upload_gb_s']:.2f} GB/s")
    pf = report.get("prefetch")
    if pf:
        print(
            f"prefetch   {pf['uploads']} uploads, {pf['hits']} hit; prediction recall {pf['recall']:.1%}, "
            f"precision {pf['precision']:.1%}"
        )
    if report.get("predicted_tok_s"):
        preds = " | ".join(f"{m} {_tok(v)}" for m, v in report["predicted_tok_s"].items())
        err = report.get("prediction_error")
        line = (
            f"predicted  {preds} tok/s ({report['profile_source']} profile, position {report['prediction_position']})"
        )
        if err is not None:
            line += f"; this mode {_tok(report['predicted_decode_tok_s'])} vs {report['decode_tok_s']:.2f} measured ({err:+.0%})"
        print(line)
        if report.get("predicted_at_measured_hit_rate") is not None:
            print(
                f"           at the measured hit rate the cache is predicted {_tok(report['predicted_at_measured_hit_rate'])} tok/s"
            )
    ref = report.get("llama_cpp")
    if ref:
        print(
            f"llama.cpp  prompt {ref['prompt_tok_s']:.1f} tok/s, decode {ref['decode_tok_s']:.2f} tok/s  →  "
            f"ratio prompt {report['ratio_prompt']:.2f}x, decode {report['ratio_decode']:.2f}x"
        )
    elif args.vs_llama_cpp:
        print("llama.cpp  not installed (pip install llama-cpp-python)")
    return 0


def _tok(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def format_comparison(c: dict) -> str:
    """The --compare-modes table: predicted and measured decode tok/s per mode, and the verdict."""
    lines = [
        f"model      {c['model']} ({c['threads']} threads, {c['prompt_tokens']} prompt + {c['gen_tokens']} generated tokens)",
        f"profile    {c['profile_source']}",
        f"{'mode':<10} {'predicted':>10} {'measured':>10} {'hit rate':>9} {'uploads':>10}   decode tok/s",
    ]
    for r in c["modes"]:
        hit = "—" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"
        up = "—" if r["hit_rate"] is None else f"{r['upload_gb_s']:.2f} GB/s"
        extra = ""
        if r.get("predicted_at_measured_hit_rate") is not None:
            extra = f"   (predicted at the measured hit rate: {_tok(r['predicted_at_measured_hit_rate'])})"
        lines.append(
            f"{r['mode']:<10} {_tok(r['predicted_tok_s']):>10} {r['decode_tok_s']:>10.2f} {hit:>9} {up:>10}{extra}"
        )
    verdict = (
        "the fastest"
        if c["auto_was_fastest"]
        else f"NOT the fastest ({c['fastest']} was; auto loses {c['auto_loss']:.0%})"
    )
    lines.append(f"auto       chose {c['auto']}: {verdict}")
    lines.append(f"           {c['auto_reason']}")
    return "\n".join(lines)


def run_device_kernels(args: argparse.Namespace) -> int:
    import torch

    from engine import config
    from engine.runtime import kernel_select, triton_gemv

    if not torch.cuda.is_available() or not kernel_select.available():
        raise UsageError("sharpi bench device-kernels needs a CUDA GPU and Triton")
    from engine.bench import device_kernels
    from engine.quant.formats import QType

    types = [QType[t.strip()] for t in args.types.split(",") if t.strip()] or list(triton_gemv.SUPPORTED)
    best = {}
    if args.tune:
        best = device_kernels.tune(types)
        print(json.dumps({torch.cuda.get_device_name(): best}, indent=1))
    winners = {**(config.current().launch_table or {}), **best}  # the tuned settings, for the run below
    with config.overriding(launch_table=winners):
        rep = device_kernels.run(types, [w.strip() for w in args.workloads.split(",") if w.strip()])
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    print("\n".join(device_kernels.report_lines(rep)))
    return 0


def _calibrate_host(args: argparse.Namespace) -> int:
    """``--device host``: the CPU alone (engine.bench.calibrate_host.calibrate_host). Progress lines on stderr
    ("measuring ... (k of N)") are what the app's background calibration shows."""
    import sys

    from engine.bench import calibrate_host as cal

    steps = iter(range(1, 100))

    def progress(what: str) -> None:
        print(f"measuring {what} ({next(steps)} of {cal.HOST_STEPS}) ...", file=sys.stderr, flush=True)

    c = cal.calibrate_host(args.model, use_cache=not args.force, progress=progress)
    if _print_profile(args, c, [], "only the CPU's fields apply without a device"):
        runs = c.details.get("host_probe_runs")
        if runs:
            rms = c.details["host_fit_rms_relative"]
            print(f"fit        token and host-layer costs from {len(runs)} probes, rms error {rms:.0%}:")
            for r in runs:
                print(f"           {r['layers']:>2} layers  {r['ms']:7.3f} ms/token (model {r['fitted_ms']:.3f})")
        print(f"cache      {c.path}")
    return 0


def _print_profile(args: argparse.Namespace, c, heads: list[str], note: str) -> bool:
    """A calibration's profile: JSON (then False: nothing more to print) or its text head (True)."""
    import numba

    from engine.plan.profile import describe_profile

    if args.json:
        print(json.dumps(c.profile.to_dict(), indent=2))
        return False
    how = "cached" if c.cached else f"measured in {c.seconds:.1f} s"
    print(f"device     {c.profile.name} ({how}; {numba.get_num_threads()} CPU threads)")
    for line in heads:
        print(line)
    for i, line in enumerate(describe_profile(c.profile)):
        print(("profile    " if i == 0 else "           ") + line)
    print(f"           (* = measured on this machine; {note})")
    return True


def run_calibrate(args: argparse.Namespace) -> int:
    import sys

    import numba
    import torch

    from engine.bench import calibrate as cal

    device = args.device or ("cuda" if torch.cuda.is_available() else "host")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu for the simulated device)")
    threads = args.threads or os.cpu_count() or 1
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(threads)
    if device == "host":
        return _calibrate_host(args)
    shape, trunk = cal.DEFAULT_SHAPE, "Q4_K"
    if args.model:
        from engine.gguf import open_gguf

        with open_gguf(args.model) as gf:
            shape = cal.ExpertShape.from_gguf(gf) or shape
            if "blk.0.attn_q.weight" in gf.tensors:
                trunk = gf.tensor("blk.0.attn_q.weight").qtype.name

    def progress(what: str) -> None:
        if not args.json:
            print(f"measuring {what} ...", file=sys.stderr)

    c = cal.calibrate(device, shape, trunk_qtype=trunk, use_cache=not args.force, progress=progress)
    if not _print_profile(args, c, [f"experts    {shape.key}"], "the rest are defaults"):
        return 0
    runs = c.details.get("fixed_cost_runs")
    if runs:
        print(f"fit        fixed costs from {len(runs)} probe runs, rms error {c.details['fit_rms_relative']:.0%}:")
        for r in runs:
            hit = f", hit rate {r['hit_rate']:.0%}" if r.get("hit_rate") is not None else ""
            print(f"           {r['label']:<36} {r['ms']:8.2f} ms/token (model {r['fitted_ms']:.2f}){hit}")
    print(f"cache      {c.path}")
    return 0
