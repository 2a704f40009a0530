"""``sharpi plan -m FILE``: where a model's layers, KV cache and experts go on a given device.

    sharpi plan -m model.gguf --vram 12GiB -c 32768 --kv-type q8_0 [-g -1] [--moe auto] [--json]

Prints the placement (per-layer map, device bytes, expert budget, expert mode and why, predicted
tok/s per mode) or, with ``--json``, the form tools and the GUI read. ``--bench`` times the
planner instead (a VRAM slider swept end to end).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from engine import config
from engine.errors import UsageError
from engine.plan import (
    KV_TYPES,
    MOE_CHOICES,
    DeviceProfile,
    ModelSpec,
    Placement,
    PlanRequest,
    default_ctx,
    format_size,
    parse_size,
    plan,
    resolve_kv_type,
    resolve_moe,
)
from engine.plan.profile import DEFAULT_VRAM, describe_profile, profile_source

_GBPS = (("cpu_gbps", "cpu_expert_gbps"), ("h2d_gbps", "h2d_gbps"), ("device_gbps", "device_gbps"))


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan layers, KV cache and experts for a VRAM budget",
        description="Place a model's layers, KV cache and routed experts on a device of the given VRAM budget, "
        "and predict decode speed for each expert mode. Needs no GPU.",
    )
    p.add_argument("-m", "--model", required=True, help="path to a .gguf file (a geometry-only file works)")
    p.add_argument(
        "--vram", type=_size, default=DEFAULT_VRAM, help="device memory budget, e.g. 12GiB, 8000MB (default 12GiB)"
    )
    p.add_argument(
        "-c",
        "--ctx",
        "--ctx-size",
        dest="ctx",
        type=int,
        default=0,
        help="context length in tokens (default: the model's training context, at most 4096, as sharpi run)",
    )
    p.add_argument(
        "--kv-type", choices=KV_TYPES, default=None, help="KV cache dtype (default: $SHARPI_KV_DTYPE, else bf16)"
    )
    p.add_argument(
        "-g",
        "-ngl",
        "--n-gpu-layers",
        dest="n_gpu_layers",
        type=int,
        default=-1,
        help="layers on the device (-1 = auto)",
    )
    p.add_argument("--moe", choices=MOE_CHOICES, default="auto", help="where routed experts of device layers run")
    p.add_argument(
        "--cpu-moe", action="store_true", help="routed experts on the CPU (overrides auto and $SHARPI_CPU_MOE)"
    )
    p.add_argument("--n-cpu-moe", type=_count, default=0, help="keep the experts of the first N layers on the CPU")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--layers", action="store_true", help="print every layer, not ranges")
    g = p.add_argument_group("device profile (defaults are documented guesses; pass measured values)")
    g.add_argument("--profile", metavar="FILE", help="JSON device profile (DeviceProfile.to_dict form)")
    g.add_argument(
        "--calibrated",
        choices=("cuda", "cpu"),
        default=None,
        help="start from this machine's cached calibration of that device (sharpi bench calibrate)",
    )
    g.add_argument("--reserve", type=_size, default=None, help="device memory never available to tensors")
    g.add_argument("--scratch", type=_size, default=None, help="activation scratch (default: estimated)")
    g.add_argument("--cpu-gbps", type=_positive, default=None, help="host GB/s computing experts")
    g.add_argument("--h2d-gbps", type=_positive, default=None, help="host-to-device copy GB/s")
    g.add_argument("--device-gbps", type=_positive, default=None, help="device memory GB/s")
    g.add_argument("--skew", type=float, default=None, help="expert popularity Zipf exponent (hit-rate model)")
    g.add_argument(
        "--routes",
        metavar="FILE|synthetic",
        default=None,
        help="the cache's hit rate against capacity from routing: a recorded trace (--record-routes FILE) or "
        "'synthetic' (Qwen3-30B-A3B's published statistics), replayed with the default policy; default: the "
        "user's routing history of the model's geometry ($SHARPI_ROUTES_DIR), else $SHARPI_HIT_CURVE (zipf)",
    )
    p.add_argument("--bench", action="store_true", help="time the planner over a swept VRAM budget and exit")
    p.set_defaults(func=run)
    # Let "--vram -1GiB" reach _size (and its clear message) instead of argparse taking "-1GiB"
    # for an option: widen the parser's negative-number pattern to numbers with a unit.
    if hasattr(p, "_negative_number_matcher"):
        p._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d*\.?\d+\s*[A-Za-z]+$")


def _calibrated(device: str, model: str) -> dict:
    """The cached calibration of ``device`` on this machine, for ``model``'s experts, as a dict."""
    from engine.bench import calibrate as cal
    from engine.gguf import open_gguf

    with open_gguf(model) as gf:
        shape = cal.ExpertShape.from_gguf(gf) or cal.DEFAULT_SHAPE
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--calibrated cuda: no CUDA device is available here")
    prof = cal.load_cached(device, shape, partial=True)
    if prof is None:
        raise UsageError(
            f"--calibrated {device}: nothing cached for this machine "
            f"(run: sharpi bench calibrate --device {device} -m {model})"
        )
    return prof.to_dict()  # CPU experts stay a default (unmarked) if this shape was never measured


def _profile(args: argparse.Namespace) -> DeviceProfile:
    base: dict = {}
    if getattr(args, "calibrated", None):
        if args.profile:
            raise UsageError("give --profile or --calibrated, not both")
        base = _calibrated(args.calibrated, args.model)
    if args.profile:
        try:
            with open(args.profile, encoding="utf-8") as f:
                base = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read device profile {args.profile!r}: {e}") from None
        if not isinstance(base, dict):
            raise UsageError(f"device profile {args.profile!r} must be a JSON object")
    base["vram_bytes"] = args.vram
    measured = set(base.get("measured", ()))
    for flag, name in (("reserve", "reserve_bytes"), ("scratch", "scratch_bytes"), ("skew", "expert_skew")):
        v = getattr(args, flag)
        if v is not None:
            base[name] = v
    for flag, name in _GBPS:
        v = getattr(args, flag)
        if v is not None:
            base[name] = v
            measured.add(name)
    base["measured"] = sorted(measured)
    if getattr(args, "routes", None):
        from engine.runtime.hit_curves import hit_curve

        if args.routes == "synthetic":
            from engine.runtime.hit_curves import planner_curve

            curve = planner_curve(0, 0, use_history=False, fallback="synthetic")  # cached on disk
            base["hit_curve"], base["hit_curve_source"] = [list(p) for p in curve.points], curve.detail
        else:
            from engine.routes import load_trace

            trace = load_trace(args.routes)
            base["hit_curve"] = [list(p) for p in hit_curve(trace)]
            base["hit_curve_source"] = f"routing trace {args.routes}"
    return DeviceProfile.from_dict(base)


def run(args: argparse.Namespace) -> int:
    from engine.gguf import open_gguf

    profile = _profile(args)
    opts = config.current()
    mode, source = resolve_moe(args.moe, args.cpu_moe, opts.cpu_moe)
    with open_gguf(args.model) as gf:
        spec = ModelSpec.from_gguf(gf)
    if spec.is_moe and not profile.hit_curve and args.skew is None:
        # as a session plans `auto`: the user's routing history of this geometry, else SHARPI_HIT_CURVE's
        from dataclasses import replace

        from engine.runtime.hit_curves import planner_curve

        curve = planner_curve(spec.n_expert, spec.n_expert_used, options=opts)
        profile = replace(profile, hit_curve=curve.points, hit_curve_source=curve.detail)
    request = PlanRequest(
        ctx=args.ctx or default_ctx(spec.n_ctx_train),
        kv_type=resolve_kv_type(args.kv_type, opts.kv_type),
        n_gpu_layers=args.n_gpu_layers,
        moe=mode,
        moe_source=source,
        n_cpu_moe=args.n_cpu_moe,
        cuda_graphs=opts.cuda_graph != "off",
        prompt_stream=opts.prompt_stream_min > 0,
    )
    if args.bench:
        from engine.bench.plan import bench_plan

        r = bench_plan(spec, profile, request)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(
                f"plan(): {r['n_layer']} layers, {r['calls']} calls over a swept budget: median {r['median_ms']:.3f} ms, "
                f"p95 {r['p95_ms']:.3f} ms, max {r['max_ms']:.3f} ms; with to_dict {r['median_ms_with_json']:.3f} ms"
            )
        return 0
    placement = plan(spec, profile, request)
    if args.json:
        print(placement.to_json())
    else:
        print_summary(placement, every_layer=args.layers, out=sys.stdout)
    return 0


# -- the readable summary --------------------------------------------------------------------------

_MAP_CHAR = {("gpu", "cache"): "C", ("gpu", "resident"): "R", ("gpu", "cpu"): "G", ("gpu", "none"): "G"}


def layer_map(p: Placement) -> str:
    """One character per layer: C = device layer with cached experts, R = resident experts,
    G = device layer whose experts run on the CPU (or a dense device layer), . = CPU layer."""
    return "".join(_MAP_CHAR.get((lay.device, lay.experts), ".") for lay in p.layers)


def _ranges(p: Placement) -> list[tuple[int, int, str, str]]:
    out: list[tuple[int, int, str, str]] = []
    for lay in p.layers:
        if out and out[-1][2:] == (lay.device, lay.experts) and out[-1][1] == lay.index - 1:
            out[-1] = (out[-1][0], lay.index, lay.device, lay.experts)
        else:
            out.append((lay.index, lay.index, lay.device, lay.experts))
    return out


def _span(start: int, stop: int) -> str:
    return "none" if stop <= start else str(start) if stop == start + 1 else f"{start}-{stop - 1}"


def _tok(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def print_summary(p: Placement, *, every_layer: bool = False, out=None) -> None:
    out = out or sys.stdout  # looked up at call time: tests and callers may swap sys.stdout
    w = lambda s="": print(s, file=out)
    prof = p.profile
    scratch_src = "estimated" if prof.scratch_bytes is None else "given"
    w(f"model     {p.model or '?'} ({p.arch}, {p.n_layer} layers)")
    w(
        f"profile   VRAM {format_size(p.budget_bytes)}; reserve {format_size(prof.reserve_bytes)}; "
        f"scratch {format_size(p.device.scratch)} ({scratch_src})"
    )
    for line in describe_profile(prof):
        w(f"          {line}")
    w(f"          ({profile_source(prof)}{'; * = measured' if prof.measured else ''})")
    if prof.hit_curve or prof.hit_curve_source:
        w(f"          cache hit rates from {prof.hit_curve_source or 'a given curve'}")
    w(
        f"request   ctx {p.ctx}, KV {p.kv_type}"
        + (f"; experts of layers 0-{p.n_cpu_moe - 1} on the CPU" if p.n_cpu_moe else "")
    )
    w()
    gpu, cpu = _span(*p.gpu_layers), _span(*p.cpu_layers)
    w(f"layers    GPU {gpu}, CPU {cpu}: {p.layer_reason}")
    w(f"map       {layer_map(p)}")
    w("          (C cached experts, R resident experts, G experts on CPU / dense, . CPU layer)")
    w(f"  {'layers':<9}{'trunk':<7}{'experts':<10}{'trunk bytes':>13}{'KV':>20}{'routed (host)':>16}")
    rows = [(lay.index, lay.index, lay.device, lay.experts) for lay in p.layers] if every_layer else _ranges(p)
    for a, b, dev, exp in rows:
        sel = p.layers[a : b + 1]
        span = f"{a}" if a == b else f"{a}-{b}"
        kv = f"{format_size(sum(x.kv_bytes for x in sel))} {sel[0].kv_type}"
        w(
            f"  {span:<9}{dev:<7}{exp:<10}{format_size(sum(x.trunk_bytes for x in sel)):>13}{kv:>20}"
            f"{format_size(sum(x.routed_bytes for x in sel)):>16}"
        )
    w()
    d = p.device
    w(
        f"device    trunk {format_size(d.trunk)} + KV {format_size(d.kv)} + output {format_size(d.globals)} + "
        f"scratch {format_size(d.scratch)} + reserve {format_size(d.reserve)} + experts {format_size(d.experts)}"
        + (f" + prompt staging {format_size(d.stream)}" if d.stream else "")
    )
    w(
        f"          = {format_size(d.total)} of {format_size(p.budget_bytes)} ({format_size(p.budget_bytes - d.total)} free)"
    )
    if p.expert_slots_needed or p.routed_expert_bytes:
        roles = ", ".join(f"{r} {format_size(b)}" for r, b in p.expert_slot_role_bytes.items())
        w(
            f"experts   budget {format_size(p.expert_cache_budget_bytes)} = {p.expert_slots} slots of "
            f"{format_size(p.expert_slot_bytes)} ({roles}); {p.expert_slots_needed} experts on device layers "
            f"({p.expert_capacity:.0%} fit); all routed experts {format_size(p.routed_expert_bytes)}"
        )
    w(f"mode      {p.moe_mode}: {p.moe_reason}")
    preds = p.predictions
    parts = []
    for m, x in preds.items():
        hit = f" (hit {x.hit_rate:.0%})" if x is not None and x.hit_rate is not None else ""
        parts.append(f"{m} {_tok(None if x is None else x.tok_s)}{hit}")
    w(f"tok/s     {' | '.join(parts)}   (decode at position {p.position})")
    rec = "none (the trunk does not fit)" if p.recommended_ctx is None else str(p.recommended_ctx)
    w(f"context   recommended {rec} (largest with every layer on the device, KV {p.kv_type})")
    w(f"host      {format_size(p.host_bytes)} of RAM when warm (experts through the memory map)")
    from engine.plan.ram import available_ram

    avail = available_ram()
    if avail is not None and p.host_bytes > avail:
        w(
            f"warning   more than the {format_size(avail)} of RAM available: loading keeps the weights "
            "memory-mapped (page cache, slower), or refuses with what would fit"
        )
    for note in p.notes:
        w(f"note      {note}")
