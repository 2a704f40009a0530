"""The engine's environment, read in one place into a frozen :class:`EngineOptions`.

Every ``SHARPI_*`` variable the engine honours (and ``TRITON_INTERPRET``) is parsed here, once, by
:meth:`EngineOptions.from_env`; a malformed value raises :class:`~engine.errors.UsageError` naming
the variable. No other engine module reads ``os.environ`` (the CLI's argument defaults aside) and
none writes it: the one process setting the engine makes, ``GOMP_SPINCOUNT``, is written by
:func:`apply_process_settings`, which the entry points call (``sharpi``'s ``main`` and
``Session``, i.e. the CLI, the desktop app and API users).

How the options travel:

- Explicitly, where a caller can hand them on: ``LoadOptions.engine`` → ``Session`` →
  ``apply_placement`` → the runtime objects (``DeviceWeights``/``DeviceLinear``, ``CachedExperts``,
  ``graph_decode.for_placement``) → the kernel wrappers' ``options=`` argument →
  :mod:`engine.runtime.kernel_select`, which turns them into kernels, activation rounding and
  launch settings. The planner stays pure: it is handed what it needs as plain request fields
  (``PlanRequest.cuda_graphs``; ``resolve_moe``/``resolve_kv_type`` take the option values).
- From :func:`current`, the snapshot of the process environment taken on first use, where
  threading an argument through would be absurd: choices made once at import (``engine.ops``'s
  numba-or-reference switch, ``engine.kernels.simd``'s VNNI codegen, ``engine.kernels.bf16``'s
  prompt path — numba compiles against them), and the launch plumbing inside the Triton wrappers
  (``triton_qblocks``: programmatic dependent launch and its prefetch, whether Triton compiles or
  interprets). It is also every ``options=None`` default, e.g. ``LoadOptions()``'s.

Tests pass options explicitly where an API takes them. Where a test must change the process-wide
snapshot (the CLI, import-time choices in a child interpreter) it uses the ``engine_env`` fixture
of ``tests/conftest.py`` (which monkeypatches :func:`current`'s snapshot) or, in a child
interpreter, sets the variables before importing the engine. Tools that need a scoped change
(the kernel bench: PDL off, candidate launch settings) use :func:`overriding`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType

from engine.errors import UsageError

# The variables, by field of EngineOptions (the app's two, SHARPI_DATA_DIR and SHARPI_ENGINE_NICE, too:
# sharpi_gui.bridge reads them here and hands them to the app).
ENV = MappingProxyType(
    {
        "host_kernels": "SHARPI_KERNELS",
        "bf16_prefill": "SHARPI_BF16",
        "vnni": "SHARPI_NO_VNNI",
        "device_kernels": "SHARPI_DEVICE_KERNELS",
        "device_act": "SHARPI_DEVICE_ACT",
        "prefill_precision": "SHARPI_PREFILL_PRECISION",
        "pdl": "SHARPI_PDL",
        "pdl_prefetch": "SHARPI_PDL_PREFETCH",
        "triton_table": "SHARPI_TRITON_TABLE",
        "launch_table": "SHARPI_LAUNCH_TABLE",
        "triton_interpret": "TRITON_INTERPRET",
        "cuda_graph": "SHARPI_CUDA_GRAPH",
        "prompt_upload_min": "SHARPI_PROMPT_UPLOAD_MIN",
        "cache_upload": "SHARPI_CACHE_UPLOAD",
        "cache_prefetch": "SHARPI_CACHE_PREFETCH",
        "cache_policy": "SHARPI_CACHE_POLICY",
        "cache_misses": "SHARPI_CACHE_MISSES",
        "prompt_stream_min": "SHARPI_PROMPT_STREAM_MIN",
        "state_checkpoints": "SHARPI_STATE_CHECKPOINTS",
        "mtp": "SHARPI_MTP",
        "kv_type": "SHARPI_KV_DTYPE",
        "weights": "SHARPI_WEIGHTS",
        "cpu_moe": "SHARPI_CPU_MOE",
        "host_threads": "SHARPI_HOST_THREADS",
        "calibrate": "SHARPI_NO_CALIBRATE",
        "calibration_dir": "SHARPI_CALIBRATION_DIR",
        "demo_model": "SHARPI_DEMO_MODEL",
        "reasoning": "SHARPI_REASONING",
        "data_dir": "SHARPI_DATA_DIR",
        "routes_dir": "SHARPI_ROUTES_DIR",
        "hit_curve": "SHARPI_HIT_CURVE",
        "replan_tokens": "SHARPI_REPLAN_TOKENS",
        "engine_nice": "SHARPI_ENGINE_NICE",
    }
)
ENV_CPU_MOE = ENV["cpu_moe"]  # named in plan reasons ("set by SHARPI_CPU_MOE=1")

KV_TYPES = ("f32", "bf16", "q8_0")  # engine.plan.sizing.KV_TYPES (tests/test_config.py holds them equal)
KV_ALIASES = MappingProxyType({"fp32": "f32", "float32": "f32", "q8": "q8_0"})
CUDA_GRAPH_MODES = ("graph", "eager", "off")
CACHE_UPLOADS = ("background", "inline")
# The expert cache's slot policies (engine.runtime.slot_policies.SLOT_POLICIES; tests/test_config.py holds them
# equal) and the default, the policy `sharpi bench cache` calls default.
CACHE_POLICIES = ("lru", "slru", "dlfu")
CACHE_MISSES = ("auto", "cpu", "bus")  # EngineOptions.cache_misses
HIT_CURVES = ("zipf", "synthetic")  # EngineOptions.hit_curve
DEFAULT_CACHE_POLICY = "dlfu"
MTP_AUTO_DRAFTS = 2  # EngineOptions.mtp None (auto): drafts per step where the file has an MTP head
ACT_MODES = ("q8", "f32")
WEIGHT_MODES = ("auto", "copy", "mmap")  # EngineOptions.weights
PREFILL_PRECISIONS = ("bf16", "f32")
REASONING_MODES = ("auto", "off", "think", "harmony")  # EngineOptions.reasoning (engine.generate.reasoning.FORMATS)

# numba's OpenMP workers (libgomp) spin ~300,000 pause loops (~15 ms) after each parallel loop
# before they sleep. A decode step runs ~100 short loops; when another process wants a core, the
# spinning worker steals it from the thread doing the serial steps and each loop then waits for a
# descheduled thread (measured, qwen3moe bench file, 2 cores, one busy process beside us: 383 ms
# per token). 10,000 spins (~0.5 ms) still bridge the gaps between a step's loops (quiet machine:
# 36.9 -> 37.7 ms per token) and leave contention at 101 ms. libgomp reads it when numba starts
# its pool (the first parallel call), so apply_process_settings must run before that.
# On a machine with MANY_CPUS or more and an NVIDIA GPU the workers keep libgomp's own 300,000: a
# CUDA decode with routed experts on the CPU gives each layer's loops a gap of a graph segment
# (~80 µs), in which 10,000 spins let the workers sleep, to be woken for every layer (measured,
# H200 box, 16 cores, `sharpi bench --moe cpu` of the 30B-geometry file, interleaved A/B in one
# job: 32.2 -> 34.4 tok/s decode; docs/benchmarks.md, "`--moe cpu` by pieces"). A CUDA placement
# leaves cores free (engine.runtime.threads), so the spinning workers do not take the driver's.
GOMP_SPINCOUNT = "10000"
GOMP_SPINCOUNT_GPU = "300000"
MANY_CPUS = 8


def gomp_spincount(cpus: int, nvidia_gpu: bool) -> str:
    """The ``GOMP_SPINCOUNT`` the engine sets where it may use ``cpus`` CPUs, with or without an NVIDIA GPU."""
    return GOMP_SPINCOUNT_GPU if nvidia_gpu and cpus >= MANY_CPUS else GOMP_SPINCOUNT


def _nvidia_gpu() -> bool:
    """Whether the machine shows an NVIDIA GPU (a device node; nothing is initialised)."""
    try:
        return any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev"))
    except OSError:
        return False


_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's knobs (each field's variable in :data:`ENV`). Defaults are what an empty
    environment gives; ``EngineOptions()`` is a valid, documented configuration."""

    # -- host (CPU) kernels ------------------------------------------------------------------------
    # SHARPI_KERNELS: "numba" (the default) or "reference" — engine.ops routes matmul / moe_ffn to
    # the numpy reference models (slow; the specification). Read once, at engine.ops's import.
    host_kernels: str = "numba"
    # SHARPI_BF16: auto | 0 | 1 | fpmath | bf16. How long prompts' products use the CPU's bf16 units
    # (engine.kernels.bf16.detect_mode): auto (unset) by what oneDNN does on this CPU, 0 never (the
    # q8 kernels), 1 even without native bf16 units, fpmath / bf16 that mode. Read at first use.
    bf16_prefill: str = "auto"
    # SHARPI_NO_VNNI: 1 turns the VNNI dot steps of engine.kernels.simd off (tests hold the two
    # paths together); unset/0 = use them where the CPU has them. Read once, at import.
    vnni: bool = True

    # -- device kernels (engine.runtime.kernel_select) ------------------------------------------------
    # SHARPI_DEVICE_KERNELS: "triton" (the default: the Triton kernels where Triton and the device
    # allow) or "reference" — the torch dequantize-then-matmul references everywhere.
    device_kernels: str = "triton"
    # SHARPI_DEVICE_ACT: "q8" or "f32" forces the activation rounding of every device launch (q8:
    # integer kernels on activations rounded like llama.cpp; f32: exact float); None (unset) =
    # kernel_select's choice (q8 only for the lean Q4_K kernels inside a CUDA-graph step).
    device_act: str | None = None
    # SHARPI_PREFILL_PRECISION: the operands of the tiled prompt kernels (more than TRITON_MAX_T tokens:
    # trunk matrices and routed experts) — "bf16" (x and the dequantized weights rounded to bfloat16,
    # tensor-core MMA, float32 accumulation) or "f32" (float32 operands, tf32x3 on CUDA: the
    # reference-equivalent path); None (unset) = kernel_select.prefill_precision's choice (bf16 on a
    # compiled CUDA device, f32 in Triton's interpreter).
    prefill_precision: str | None = None
    # SHARPI_PDL: 0 turns programmatic dependent launch off inside CUDA graphs (default on where the
    # GPU has it, compute capability ≥ 9).
    pdl: bool = True
    # SHARPI_PDL_PREFETCH: 0 keeps PDL but drops the L2 prefetch before each kernel's wait.
    pdl_prefetch: bool = True
    # SHARPI_TRITON_TABLE: which Triton version's launch table applies — "3.9" (major.minor; the
    # newest table not newer than it), "none" (the default table alone; stored as (0, 0)); None
    # (unset) = the installed Triton's.
    triton_table: tuple[int, int] | None = None
    # SHARPI_LAUNCH_TABLE: path of a JSON object {"<kernel>:<qtype>:<class>": {settings}} consulted
    # before every packaged table (engine/runtime/launch/README.md), on every device — to try
    # settings without editing the package; loaded when the options are built. None: none.
    launch_table: Mapping[str, Mapping[str, int | str]] | None = None
    # TRITON_INTERPRET: 1 = Triton runs on the CPU through its interpreter (tests: "the simulated
    # device" then runs the Triton kernels). Triton itself reads it when kernels are decorated.
    triton_interpret: bool = False

    # -- runtime ----------------------------------------------------------------------------------------
    # SHARPI_CUDA_GRAPH: "graph" (default; also 1/on/true/yes) — one-token steps with every layer on
    # a CUDA device replay captured CUDA graphs; "eager" — the same static step, not captured, on any
    # device (the simulated device in tests); "off" (also 0/false/no) — the eager path.
    cuda_graph: str = "graph"
    # SHARPI_PROMPT_UPLOAD_MIN: tokens of a prompt a missed cached expert needs to be uploaded and run
    # on the device (whole number ≥ 0; 0: never); None (unset) = expert_cache.PROMPT_UPLOAD_MIN (16).
    prompt_upload_min: int | None = None
    # SHARPI_CACHE_UPLOAD: how a decode step's expert-cache misses are uploaded: "background" — copied by a
    # worker thread behind the next steps, in the table once landed — or "inline" — copied between steps,
    # the next step waiting for them; None (unset) = background on CUDA, inline on the simulated device.
    cache_upload: str | None = None
    # SHARPI_CACHE_PREFETCH: predictive prefetch in the expert cache (``cache`` mode) — while a cached MoE layer
    # runs a decode step, the next cached layer's router applied to this layer's normed input (pre-gating)
    # predicts the next layer's experts, and up to this many of its predicted misses a layer and step are
    # uploaded (the strongest predicted first) behind this step's demand misses (engine.runtime.expert_cache).
    # It changes where experts are computed, never the result. While on, decode runs without CUDA graphs (the
    # table a graph reads changes only between steps). Whole number ≥ 0; 0 (default): off — measured on an H200
    # at 12 GiB, 2 a layer decoded 9.5 tok/s against 97 without (the graphs' loss outweighs its hits;
    # docs/benchmarks.md), so it stays off until it runs inside the graphs.
    cache_prefetch: int = 0
    # SHARPI_CACHE_POLICY (--cache-policy): which expert the cache (``cache`` mode) evicts for a miss, and whether
    # it admits the miss at all (engine.runtime.slot_policies): "lru", "slru" (segmented LRU) or "dlfu" (the
    # default: decayed-frequency residency with hysteresis, which keeps a frequently used expert over a one-off
    # and leaves a miss on the CPU rather than thrash; the best of the three on routing traces, docs/benchmarks.md).
    # It changes where experts are computed, never the result.
    cache_policy: str = DEFAULT_CACHE_POLICY
    # SHARPI_CACHE_MISSES: where a decode step computes the expert cache's misses (``cache`` mode, CUDA graphs):
    # "bus" — on the GPU, the fused kernels reading the missed expert's bytes from a page-locked host copy of every
    # cached layer's experts over PCIe (zero-copy), so the step is one graph with no host round trip
    # (``engine.runtime.expert_pool.HostMirror``; it costs host memory the size of those experts) — or "cpu" — the
    # CPU kernels between graph segments (each cached layer cuts the step). "auto" (default): bus on a CUDA device
    # whose available host memory holds the copy, else cpu. Measured on an H200 at 12 GiB under a realistic routing
    # trace: 86.8 tok/s over the bus against 66.6 with CPU misses (docs/benchmarks.md). It changes where experts are
    # computed, never the result.
    cache_misses: str = "auto"
    # SHARPI_PROMPT_STREAM_MIN: tokens from which a batch copies the host-placed experts of a device layer
    # (--moe cpu, the first n_cpu_moe layers) to the device and computes them there, as llama.cpp does
    # above 32 (engine.runtime.expert_stream; whole number ≥ 0; 0: never, and the planner reserves no
    # staging slots for it).
    prompt_stream_min: int = 32
    # SHARPI_STATE_CHECKPOINTS: how many snapshots of a Gated DeltaNet model's recurrent states a session keeps
    # (host memory, one at the end of every turn, the newest kept; each the size of the states, tens of MiB for
    # Qwen3.6-35B-A3B): regenerate and edit-and-resend restart from one instead of from the first token
    # (engine.generate.loop.CacheState; whole number ≥ 0, 0: none).
    state_checkpoints: int = 4
    # SHARPI_MTP (--mtp): tokens the MTP head drafts per step for speculative decoding, verified by one pass of
    # the model (engine.generate.speculative; whole number ≥ 0; 0: off); None or "auto" (default): 2 where
    # the file has an MTP head (Qwen3.5/3.6, Qwen3-Next) and the placement keeps every layer on the CPU, else off
    # (on a CUDA placement a step with drafts runs without the decode graph: not yet measured against it). The
    # output does not change (greedy) or keeps its distribution (sampled); only the speed does.
    mtp: int | None = None
    # SHARPI_KV_DTYPE: the KV cache dtype when neither --kv-type nor LoadOptions.kv_type says:
    # f32 | bf16 | q8_0 (aliases fp32, float32, q8); None (unset) = engine.kv_layout.DEFAULT_KV_TYPE (bf16).
    kv_type: str | None = None
    # SHARPI_WEIGHTS: how host matrices are held (--weights / --mmap): "copy" — copied out of the memory map
    # into anonymous memory (the faster reads, engine.models.weights); "mmap" — left in the map, page-cache
    # backed (no copy: a model larger than free RAM runs, slower, as llama.cpp's mmap); "auto" (default) —
    # copy when the loader's estimate fits the RAM available, else mmap (engine.api.memory_plan).
    weights: str = "auto"
    # SHARPI_CPU_MOE: 1 = routed experts on the CPU, 0 = in a GPU cache, unless --moe/--cpu-moe say
    # otherwise (an environment choice falls back quietly when impossible); None (unset) = auto.
    cpu_moe: bool | None = None
    # SHARPI_HOST_THREADS (-t/--threads): the threads numba's parallel loops (CPU experts, host layers) run with
    # during a generation (whole number ≥ 1); None (unset) = engine.runtime.threads.host_threads's rule: every
    # core on the CPU, every core less cores // 8 on a CUDA placement (measured faster: the upload worker and
    # the driver's threads keep their cores).
    host_threads: int | None = None

    # -- calibration (engine.bench.calibrate) -----------------------------------------------------------
    # SHARPI_NO_CALIBRATE: 1 = never measure the device, never read the calibration cache (the
    # planner's documented defaults). Stored as calibrate = not that.
    calibrate: bool = True
    # SHARPI_CALIBRATION_DIR: where calibrations are cached; None = the user cache dir.
    calibration_dir: Path | None = None

    # -- files ------------------------------------------------------------------------------------------
    # SHARPI_DEMO_MODEL: the demo GGUF `sharpi run` and the app use without -m (engine.demo).
    demo_model: Path | None = None
    # SHARPI_ROUTES_DIR: the user's routing history — recorded routing traces (.npz) the planner's expert-cache
    # hit-rate curve is taken from (engine.routes.history); None = the user data directory's "routes".
    routes_dir: Path | None = None
    # SHARPI_HIT_CURVE: how the planner prices the expert cache's hit rate when the user's routing history has no
    # trace of the model's geometry (or is not to be used): "synthetic" (the default: the default policy's curve on
    # the synthetic Qwen3-30B-A3B trace, engine.runtime.hit_curves, for models of ≥ 64 experts a layer) or "zipf" (the Zipf popularity guess, well below
    # what a real model's routing gives the cache: 84 % against the trace's measured 94.9 % at 12 GiB on the 30B
    # geometry, which kept `auto` on the resident split at 69.8 tok/s where the cache decoded 86.8; docs/planner.md).
    hit_curve: str = "synthetic"
    # SHARPI_REPLAN_TOKENS: an `auto` placement that priced the expert cache with a curve not of this model's
    # routing (the synthetic one, or the Zipf guess) is planned again once the session's prompts have routed this many
    # tokens, with the hit-rate curve of the cache policy replayed on those routes, and re-applied between turns when
    # the choice changes (engine.api.Session; docs/planner.md, *Re-planning on the model's own routing*); 0: never.
    replan_tokens: int = 256

    # -- generation -------------------------------------------------------------------------------------
    # SHARPI_REASONING: how a reply's reasoning is kept apart from its answer (engine.generate.reasoning):
    # "auto" (default) — the format the model's architecture, vocabulary and chat template say (gpt-oss's
    # harmony channels, Qwen3/QwQ's <think> … </think>; none for other models); "off" — no separation (the
    # reasoning stays in the answer text, as the model wrote it); "think" or "harmony" — that format, whatever
    # the model says.
    reasoning: str = "auto"

    # -- the desktop app (read by sharpi_gui's bridge and handed to the app) ---------------------------
    # SHARPI_DATA_DIR: where the app keeps conversations; None = the platform's user data directory.
    data_dir: Path | None = None
    # SHARPI_ENGINE_NICE: how much nicer than the UI thread the app's engine threads run (Linux), 0 = off.
    engine_nice: int = 4

    def __post_init__(self):
        _check(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineOptions:
        """The options ``environ`` (default: ``os.environ``) asks for; unset or empty variables keep
        the defaults. Raises :class:`UsageError` naming the variable for a malformed value."""
        env = os.environ if environ is None else environ
        got = {}
        for name, var in ENV.items():
            raw = env.get(var, "").strip()
            if raw:
                got[name] = _PARSE[name](var, raw)
        return cls(**got)

    def with_env(self, changes: Mapping[str, str | None]) -> EngineOptions:
        """These options with the variables in ``changes`` parsed over them (None or "": the default)."""
        out = replace(self)
        for var, raw in changes.items():
            name = _FIELD_OF.get(var)
            if name is None:
                raise UsageError(f"{var} is not an engine variable (known: {', '.join(ENV.values())})")
            value = (raw or "").strip()
            out = replace(out, **{name: _PARSE[name](var, value) if value else _DEFAULTS[name]})
        return out


_FIELD_OF = {var: name for name, var in ENV.items()}


def _bad(var: str, raw: str, want: str) -> UsageError:
    return UsageError(f"{var}={raw!r}: expected {want}")


def _flag(var: str, raw: str) -> bool:
    v = raw.lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _bad(var, raw, "1 or 0 (on/off, true/false, yes/no)")


def _choice(choices: tuple[str, ...], aliases: Mapping[str, str] | None = None):
    def parse(var: str, raw: str) -> str:
        v = raw.lower()
        v = (aliases or {}).get(v, v)
        if v not in choices:
            raise _bad(var, raw, "one of " + ", ".join(choices))
        return v

    return parse


def _cuda_graph(var: str, raw: str) -> str:
    v = raw.lower()
    if v in _FALSE:
        return "off"
    if v in _TRUE:
        return "graph"
    return _choice(CUDA_GRAPH_MODES)(var, raw)


def _triton_table(var: str, raw: str) -> tuple[int, int]:
    if raw.lower() == "none":
        return (0, 0)
    try:
        major, minor = (int(p) for p in raw.split(".")[:2])
    except ValueError:
        raise _bad(var, raw, "a Triton version such as 3.9, or none") from None
    return (major, minor)


def _launch_table(var: str, raw: str) -> Mapping:
    path = Path(raw).expanduser()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _bad(var, raw, f"a readable JSON launch table ({e})") from None
    return _freeze_table(var, table)


def _freeze_table(var: str, table) -> Mapping:
    """A launch table {key: {setting: int | str}} as read-only mappings; checked."""
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise UsageError(f"{var}: a launch table is a JSON object of objects, keyed '<kernel>:<qtype>:<class>'")
    for key, settings in table.items():
        if key.count(":") != 2 or not all(isinstance(v, (int, str)) for v in settings.values()):
            raise UsageError(f"{var}: entry {key!r} is not '<kernel>:<qtype>:<class>': {{setting: number or name}}")
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in table.items()})


def _whole(var: str, raw: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        raise _bad(var, raw, "a whole number of tokens") from None
    if n < 0:
        raise _bad(var, raw, "a number ≥ 0")
    return n


def _at_least_one(var: str, n: int, raw: str) -> int:
    if n < 1:
        raise _bad(var, raw, "a number ≥ 1")
    return n


def _cpu_moe(var: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise UsageError(f"{var} must be 0 or 1, got {raw!r}")
    return raw == "1"


_PARSE = {
    "host_kernels": _choice(("numba", "reference")),
    "bf16_prefill": _choice(("auto", "0", "1", "fpmath", "bf16")),
    "vnni": lambda var, raw: not _flag(var, raw),  # the variable says "no VNNI"
    "device_kernels": _choice(("triton", "reference")),
    "device_act": _choice(ACT_MODES),
    "prefill_precision": _choice(PREFILL_PRECISIONS),
    "pdl": _flag,
    "pdl_prefetch": _flag,
    "triton_table": _triton_table,
    "launch_table": _launch_table,
    "triton_interpret": _flag,
    "cuda_graph": _cuda_graph,
    "prompt_upload_min": _whole,
    "cache_upload": _choice(CACHE_UPLOADS),
    "cache_prefetch": _whole,
    "cache_policy": _choice(CACHE_POLICIES),
    "cache_misses": _choice(CACHE_MISSES),
    "prompt_stream_min": _whole,
    "state_checkpoints": _whole,
    "mtp": lambda var, raw: None if raw.strip().lower() == "auto" else _whole(var, raw),
    "kv_type": _choice(KV_TYPES, KV_ALIASES),
    "weights": _choice(WEIGHT_MODES),
    "cpu_moe": _cpu_moe,
    "host_threads": lambda var, raw: _at_least_one(var, _whole(var, raw), raw),
    "calibrate": lambda var, raw: not _flag(var, raw),  # the variable says "no calibration"
    "calibration_dir": lambda var, raw: Path(raw).expanduser(),
    "demo_model": lambda var, raw: Path(raw).expanduser(),
    "reasoning": _choice(REASONING_MODES),
    "data_dir": lambda var, raw: Path(raw).expanduser(),
    "routes_dir": lambda var, raw: Path(raw).expanduser(),
    "hit_curve": _choice(HIT_CURVES),
    "replan_tokens": _whole,
    "engine_nice": _whole,
}
_DEFAULTS = {f.name: f.default for f in fields(EngineOptions)}
assert set(_PARSE) == set(ENV) == set(_DEFAULTS)


def _check(o: EngineOptions) -> None:
    """Fields given directly (not through from_env) obey the same rules."""
    choices = {
        "host_kernels": ("numba", "reference"),
        "device_kernels": ("triton", "reference"),
        "cuda_graph": CUDA_GRAPH_MODES,
        "weights": WEIGHT_MODES,
        "cache_policy": CACHE_POLICIES,
        "cache_misses": CACHE_MISSES,
        "hit_curve": HIT_CURVES,
        "reasoning": REASONING_MODES,
    }
    for name, allowed in choices.items():
        if getattr(o, name) not in allowed:
            raise UsageError(f"EngineOptions.{name}={getattr(o, name)!r}: expected one of {', '.join(allowed)}")
    if o.cache_upload not in (None, *CACHE_UPLOADS):
        raise UsageError(f"EngineOptions.cache_upload={o.cache_upload!r}: expected None, background or inline")
    if o.device_act not in (None, *ACT_MODES):
        raise UsageError(f"EngineOptions.device_act={o.device_act!r}: expected None, q8 or f32")
    if o.prefill_precision not in (None, *PREFILL_PRECISIONS):
        raise UsageError(f"EngineOptions.prefill_precision={o.prefill_precision!r}: expected None, bf16 or f32")
    if o.kv_type not in (None, *KV_TYPES):
        raise UsageError(f"EngineOptions.kv_type={o.kv_type!r}: expected None or one of {', '.join(KV_TYPES)}")
    if o.prompt_upload_min is not None and (not isinstance(o.prompt_upload_min, int) or o.prompt_upload_min < 0):
        raise UsageError(f"EngineOptions.prompt_upload_min={o.prompt_upload_min!r}: expected None or a number ≥ 0")
    if not isinstance(o.cache_prefetch, int) or o.cache_prefetch < 0:
        raise UsageError(f"EngineOptions.cache_prefetch={o.cache_prefetch!r}: expected a number ≥ 0")
    if not isinstance(o.prompt_stream_min, int) or o.prompt_stream_min < 0:
        raise UsageError(f"EngineOptions.prompt_stream_min={o.prompt_stream_min!r}: expected a number ≥ 0")
    if o.host_threads is not None and (not isinstance(o.host_threads, int) or o.host_threads < 1):
        raise UsageError(f"EngineOptions.host_threads={o.host_threads!r}: expected None or a number ≥ 1")
    if isinstance(o.replan_tokens, bool) or not isinstance(o.replan_tokens, int) or o.replan_tokens < 0:
        raise UsageError(f"EngineOptions.replan_tokens={o.replan_tokens!r}: expected a number ≥ 0")
    if not isinstance(o.state_checkpoints, int) or o.state_checkpoints < 0:
        raise UsageError(f"EngineOptions.state_checkpoints={o.state_checkpoints!r}: expected a number ≥ 0")
    if o.mtp is not None and (not isinstance(o.mtp, int) or isinstance(o.mtp, bool) or o.mtp < 0):
        raise UsageError(f"EngineOptions.mtp={o.mtp!r}: expected None (auto) or a number ≥ 0")
    if o.launch_table is not None and not isinstance(o.launch_table, MappingProxyType):
        object.__setattr__(o, "launch_table", _freeze_table("EngineOptions.launch_table", dict(o.launch_table)))


# -- the process snapshot ------------------------------------------------------------------------------
_current: EngineOptions | None = None


def current() -> EngineOptions:
    """The options of this process: ``EngineOptions.from_env()`` taken on first use and kept (a
    variable changed later is not seen; see the module docstring for who reads this)."""
    global _current
    if _current is None:
        _current = EngineOptions.from_env()
    return _current


@contextlib.contextmanager
def overriding(**changes) -> Iterator[EngineOptions]:
    """Inside the block :func:`current` returns itself with ``changes`` (field names) applied; restored
    after. For single-threaded tools (the kernel bench's PDL-off runs and launch-settings sweep)."""
    global _current
    before = current()
    _current = replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before


# torch's CUDA allocator maps memory in 2 MiB pages into growing segments instead of one cudaMalloc per
# size class: hundreds of weight uploads and a prompt's temporaries leave no rounded-up segments behind
# (measured 2026-11-27 on an H200: 263 MiB of reserved-but-unallocated bytes after a 12 GiB placement's
# uploads without it), so what the driver counts stays close to the planner's bytes.
CUDA_ALLOC_CONF = "expandable_segments:True"


def child_environ(changes: Mapping[str, str]) -> dict[str, str]:
    """The environment for a child process of the engine's (e.g. the calibration): this process's, with
    ``changes`` (variables of :data:`ENV`) set."""
    env = dict(os.environ)
    env.update(changes)
    return env


def process_settings() -> dict[str, str | None]:
    """The process settings :func:`apply_process_settings` manages, as they are now (a benchmark report's record)."""
    return {name: os.environ.get(name) for name in ("GOMP_SPINCOUNT", "PYTORCH_CUDA_ALLOC_CONF")}


def apply_process_settings() -> None:
    """Process settings the engine wants before its first parallel call and its first CUDA allocation:
    ``GOMP_SPINCOUNT`` (:func:`gomp_spincount` of the machine's cores, as ``engine.runtime.threads`` counts them, and GPU)
    and ``PYTORCH_CUDA_ALLOC_CONF`` (see :data:`CUDA_ALLOC_CONF`), unless the user set them. Called by
    the entry points; idempotent."""
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = gomp_spincount(os.cpu_count() or 1, _nvidia_gpu())
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
