"""Options shared by the commands that load a model."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from engine import config
from engine.api import AUTO_CTX, LoadOptions, Session
from engine.errors import UsageError
from engine.generate import SamplingParams
from engine.plan import AUTO, DeviceProfile
from engine.plan.sizing import KV_TYPES

# llama.cpp's default cache type, accepted as its spelling: the KV cache keeps it as bf16 (the same two
# bytes a value; there is no IEEE half KV cache here), and says so.
KV_ALIASES = {"f16": "bf16"}
CLI_KV_TYPES = (*KV_TYPES, *KV_ALIASES)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF model file (default: the bundled demo model)")
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=AUTO_CTX,
        help="context size in tokens (default: the model's training context, at most 4096, as in the app)",
    )
    p.add_argument(
        "--kv-type",
        choices=CLI_KV_TYPES,
        default=None,
        help="KV cache dtype (default $SHARPI_KV_DTYPE or bf16; f16 is kept as bf16, the same size)",
    )
    # llama.cpp's spellings (one type for K and V here); without them "-ctk q8_0" would read as "-c tk"
    p.add_argument(
        "-ctk", "--cache-type-k", dest="cache_type_k", choices=CLI_KV_TYPES, default=None, help="as --kv-type"
    )
    p.add_argument(
        "-ctv", "--cache-type-v", dest="cache_type_v", choices=CLI_KV_TYPES, default=None, help="as --kv-type"
    )
    p.add_argument(
        "--weights",
        choices=("auto", "copy", "mmap"),
        default=None,
        help="host matrices copied into RAM (faster) or left memory-mapped, page-cache backed (a model larger "
        "than free RAM runs, slower); auto: copy when it fits (default $SHARPI_WEIGHTS or auto)",
    )
    p.add_argument("--mmap", dest="weights", action="store_const", const="mmap", help="as --weights mmap")
    p.add_argument("--ram", type=_size, default=None, help="RAM the loader may use, e.g. 16GiB (default: available)")
    p.add_argument(
        "--exact-float",
        action="store_true",
        help="multiply by exactly dequantized weights instead of quantizing activations like llama.cpp",
    )


def add_mtp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mtp",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding: the model's MTP head drafts K tokens a step, one pass verifies them "
        "(default $SHARPI_MTP, else 2 where the file has an MTP head; 0 = off)",
    )


def add_placement_args(p: argparse.ArgumentParser) -> None:
    from engine.plan import MOE_CHOICES

    g = p.add_argument_group("placement (a GPU, or with --device cpu the simulated device)")
    g.add_argument(
        "-g",
        "-ngl",
        "--n-gpu-layers",
        dest="n_gpu_layers",
        type=int,
        default=None,
        help="trunk layers on the device: -1 = as many as fit (default with CUDA), 0 = CPU only (default without)",
    )
    g.add_argument("--vram", type=_size, default=None, help="device memory budget, e.g. 12GiB (default: the GPU's)")
    g.add_argument("--moe", choices=MOE_CHOICES, default="auto", help="where routed experts of device layers run")
    g.add_argument("--cpu-moe", action="store_true", help="routed experts on the CPU (as SHARPI_CPU_MOE=1)")
    g.add_argument("--n-cpu-moe", type=int, default=0, help="keep the experts of the first N layers on the CPU")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cuda, or cpu = the simulated device")
    g.add_argument(
        "--cache-policy",
        choices=config.CACHE_POLICIES,
        default=None,
        help="which experts the GPU expert cache (--moe cache) keeps: lru, slru or dlfu (decayed frequency with "
        "hysteresis; misses it will not keep run on the CPU); default $SHARPI_CACHE_POLICY or "
        f"{config.DEFAULT_CACHE_POLICY}. Changes where experts run, never the output",
    )
    g.add_argument(
        "--expert-stats", metavar="FILE", default=None, help="write expert profiler stats (FILE.json, FILE.csv)"
    )


def add_route_args(p: argparse.ArgumentParser, replay: bool = True) -> None:
    """``--record-routes`` (run, bench, serve) and ``--replay-routes`` (run and bench; not ``replay``: serve,
    whose answers must be the model's own)."""
    g = p.add_argument_group("routing traces")
    g.add_argument(
        "--record-routes",
        metavar="FILE",
        default=None,
        help="record every MoE layer's routes of everything run into FILE (.npz routing trace, engine.routes); "
        "tokens then run layer by layer (no decode graph): the same output, slower",
    )
    if not replay:
        return
    g.add_argument(
        "--replay-routes",
        metavar="FILE",
        default=None,
        help="benchmarks only: every MoE layer's top-k follows this routing trace (.npz; e.g. sharpi bench cache "
        "--synthetic --save-trace FILE) instead of the router, to measure speed under another model's routing",
    )


def _size(text: str) -> int:
    from engine.errors import UsageError
    from engine.plan import parse_size

    try:
        return parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def placement_request(a: argparse.Namespace):
    """The PlanRequest the flags ask for, or None for the plain CPU engine."""
    import torch

    from engine.plan import PlanRequest, resolve_moe

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    g = a.n_gpu_layers
    if g is None:
        g = -1 if device == "cuda" or a.vram is not None else 0
    if g == 0:
        return None
    mode, source = resolve_moe(a.moe, a.cpu_moe, config.current().cpu_moe)
    return PlanRequest(ctx=a.ctx_size, n_gpu_layers=g, moe=mode, moe_source=source, n_cpu_moe=a.n_cpu_moe)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    p.add_argument("-n", "--n-predict", type=int, default=d.max_tokens, help="tokens to generate")
    p.add_argument("--temp", type=float, default=d.temperature, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--min-p", type=float, default=d.min_p)
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=a.temp,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        repeat_penalty=a.repeat_penalty,
        presence_penalty=a.presence_penalty,
        seed=a.seed,
        max_tokens=a.n_predict,
        stop=tuple(a.stop),
    )


def _speeds(model: str, device: str | None, req) -> DeviceProfile | None:
    """This machine's calibrated speeds for a placement on CUDA (measured now, once per machine,
    when the request chooses the expert mode automatically), else None (the planner's defaults)."""
    import torch

    from engine.bench.calibrate import speed_profile
    from engine.gguf import open_gguf

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if req is None or device != "cuda":
        return None
    if req.moe == AUTO:
        print("sharpi: measuring the device (once per machine)", file=sys.stderr)
    with open_gguf(model) as gf:
        return speed_profile(device, gf, measure=req.moe == AUTO)


def kv_type_from_args(a: argparse.Namespace) -> str | None:
    """The one KV type --kv-type, -ctk and -ctv ask for (they must agree: K and V share a type here);
    f16 is read as bf16, with a note on stderr."""
    given = [t for t in (a.kv_type, getattr(a, "cache_type_k", None), getattr(a, "cache_type_v", None)) if t]
    for t in dict.fromkeys(given):
        if t in KV_ALIASES:
            print(f"sharpi: KV cache type {t} is kept as {KV_ALIASES[t]} (the same size)", file=sys.stderr)
    asked = {KV_ALIASES.get(t, t) for t in given}
    if len(asked) > 1:
        raise UsageError(f"K and V share one cache type here; asked for {', '.join(sorted(asked))}")
    return asked.pop() if asked else None


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """llama.cpp's -t (run, logits, serve; the generation's thread takes it from ``EngineOptions.host_threads``)."""
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")


def set_threads(threads: int | None) -> None:
    """Run the CPU kernels (numba, torch) of this thread on ``threads`` threads (None: all cores)."""
    if threads is None:
        return
    import numba
    import torch

    most = numba.config.NUMBA_NUM_THREADS
    if not 1 <= threads <= most:
        raise UsageError(f"-t/--threads {threads}: give 1 to {most} (the CPU threads numba was started with)")
    numba.set_num_threads(threads)
    torch.set_num_threads(threads)


def load_session(a: argparse.Namespace, refuse_unrunnable: bool = False) -> Session:
    """The session the flags ask for. ``refuse_unrunnable``: a file that cannot run here (no weights,
    more than RAM + GPU memory: engine.preflight) is a UsageError saying why, before anything loads."""
    if a.model is None:
        from engine.demo import demo_model_path

        try:
            a.model = str(demo_model_path())
        except FileNotFoundError as e:
            raise UsageError(f"no -m/--model given and {e}") from None
    if refuse_unrunnable:
        from engine.preflight import refusal

        reason = refusal(a.model)
        if reason:
            raise UsageError(reason)
    tty = sys.stderr.isatty() and not getattr(a, "quiet", False)

    def progress(done: int, total: int, what: str) -> None:
        if tty:
            end = "\n" if done == total else ""
            # \x1b[K clears what a longer line (a step's own count, e.g. the host copy's layers) left behind
            bar = f"[{'#' * done}{'.' * (total - done)}]"
            print(f"\rloading {a.model}: {bar} {what:<24}\x1b[K", end=end, file=sys.stderr)

    a.kv_type = kv_type_from_args(a)
    set_threads(getattr(a, "threads", None))
    req = placement_request(a) if hasattr(a, "n_gpu_layers") else None
    device = getattr(a, "device", None)
    opts = LoadOptions(
        n_ctx=a.ctx_size,
        kv_type=a.kv_type,
        q8_act=not a.exact_float,
        device=device,
        placement=req,
        vram_budget=getattr(a, "vram", None),
        device_profile=_speeds(a.model, device, req),
        ram_budget=getattr(a, "ram", None),
    )
    if getattr(a, "weights", None):
        opts = replace(opts, engine=replace(opts.engine, weights=a.weights))
    if getattr(a, "cache_policy", None):
        opts = replace(opts, engine=replace(opts.engine, cache_policy=a.cache_policy))
    if getattr(a, "threads", None):
        opts = replace(opts, engine=replace(opts.engine, host_threads=a.threads))
    if getattr(a, "mtp", None) is not None:
        opts = replace(opts, engine=replace(opts.engine, mtp=a.mtp))  # checked: a UsageError below 0
    session = Session.load(a.model, opts, progress)
    if not getattr(a, "quiet", False):
        where = session.applied.describe() if session.applied else f"all layers on the CPU, KV {session.kv_type}"
        if not session.memory.copy_weights:
            where += ", weights memory-mapped" + (f" ({session.memory.note})" if session.memory.note else "")
        print(
            f"sharpi: {session.info.architecture}, {session.args.n_layer} layers, ctx {session.n_ctx}: {where}",
            file=sys.stderr,
        )
    return session


def start_route_recording(a: argparse.Namespace, session):
    """The session's route recorder if ``--record-routes`` asks for one (else None); with ``--replay-routes``,
    the routing follows that trace from now on."""
    record, replay = getattr(a, "record_routes", None), getattr(a, "replay_routes", None)
    if record and replay:
        raise UsageError("--record-routes and --replay-routes: one at a time")
    if replay:
        from engine.routes import load_trace

        session.replay_routes(load_trace(replay))
        print(f"sharpi: routing replayed from {replay}: the output is not the model's own", file=sys.stderr)
    return session.record_routes() if record else None


def save_route_recording(a: argparse.Namespace, recorder) -> None:
    if recorder is None:
        return
    from engine.routes import save_trace

    if recorder.n_tokens == 0:
        print("sharpi: no routes to record (a dense model, or nothing ran)", file=sys.stderr)
        return
    path = save_trace(recorder.trace(), a.record_routes)
    print(f"routes: {path} ({recorder.n_tokens} tokens)", file=sys.stderr)


def export_expert_stats(a: argparse.Namespace, session) -> None:
    if getattr(a, "expert_stats", None):
        j, c = session.export_stats(a.expert_stats)
        print(f"expert stats: {j}, {c}", file=sys.stderr)
