"""Plain data that crosses from the bridge to the views: frozen records and numpy arrays only.

Nothing here imports Qt or the engine, so views can depend on it freely and tests can build
records by hand. The bridge (:mod:`sharpi_gui.bridge`) is the only place that turns engine
objects into these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Expert modes and KV types as the planner spells them (design.md's placement vocabulary).
MOE_AUTO = "auto"
MOE_MODES = ("cpu", "cache", "resident")
MOE_CHOICES = (MOE_AUTO, *MOE_MODES)
KV_TYPES = ("f32", "bf16", "q8_0")
# The expert cache's slot policies and the default (engine.config.CACHE_POLICIES / DEFAULT_CACHE_POLICY; tests hold
# them equal): which experts the GPU cache keeps.
CACHE_POLICIES = ("lru", "slru", "dlfu")
DEFAULT_CACHE_POLICY = "dlfu"
CACHE_POLICY_LABELS = {
    "lru": "LRU",
    "slru": "segmented LRU",
    "dlfu": "decayed frequency (default)",
}
CACHE_POLICY_TIPS = {
    "lru": "keeps the most recently used experts; every miss is uploaded",
    "slru": "LRU that protects experts used twice from a scan of one-offs",
    "dlfu": "keeps experts by recent and long-run use; a miss that would push out a busier expert runs on the "
    "CPU instead of being uploaded (the best of the three on routing traces)",
}

# Kinds of failure a view may show differently (dialog titles, inline notes).
ERR_BAD_FILE = "bad-file"  # not a usable GGUF
ERR_UNSUPPORTED = "unsupported"  # a GGUF of an architecture or type we do not run
ERR_CONTEXT = "context"  # the prompt or the conversation does not fit the context
ERR_OUT_OF_MEMORY = "out-of-memory"  # the device could not hold the placement
ERR_NO_MODEL = "no-model"  # nothing loaded yet
ERR_TEMPLATE = "template"  # the model's chat template failed (the app offers ChatML instead)
ERR_ENGINE = "engine"  # any other SharpIError
ERR_INTERNAL = "internal"  # a bug: an exception the engine did not mean to raise
ERR_CANNOT_RUN = "cannot-run"  # refused before loading: no weights, or more than RAM + GPU memory
ERR_CANCELLED = "cancelled"  # the user cancelled the load

PREPARING = "Preparing CPU kernels, first run only"  # load progress while the model's kernels compile
CALIBRATING = "Measuring this CPU for speed predictions, first run only"  # the background CPU calibration


@dataclass(frozen=True)
class Failure:
    """An error to show: ``kind`` is one of the ERR_* values, ``message`` says what and what to do."""

    kind: str
    title: str
    message: str


@dataclass(frozen=True)
class ModelCard:
    """What the model card shows about a loaded model."""

    path: str
    name: str
    architecture: str
    n_parameters: int
    n_layer: int
    n_expert: int  # routed experts per MoE layer (0 for a dense model)
    n_expert_used: int  # experts per token
    file_size: int
    quant_mix: tuple[tuple[str, int], ...]  # (ggml type, bytes), largest first
    trunk_bytes: int
    expert_bytes: int
    has_chat_template: bool
    vocab_size: int
    n_ctx_train: int
    n_ctx: int  # context the session was loaded with
    kv_type: str
    tokenizer: str
    notes: str = ""  # the model's own card (markdown) when one ships beside the file


@dataclass(frozen=True)
class GenStats:
    """Speed and context figures of one generation event (see engine.generate.events)."""

    n_prompt: int = 0
    n_generated: int = 0
    n_ctx_used: int = 0
    n_ctx: int = 0
    ttft_s: float = 0.0
    prompt_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    finish_reason: str | None = None
    message: str = ""
    decode_hit_rate: float | None = None  # the expert cache's, over the same tokens (None: no cache)
    mtp_acceptance: float | None = None  # MTP drafts the model accepted over those drafted (None: no drafts)


@dataclass(frozen=True)
class LibraryEntry:
    """A GGUF file found on this machine with the planner's verdict on it (engine.library)."""

    path: str
    name: str
    architecture: str = ""
    file_size: int = 0
    quant: str = ""
    n_ctx_train: int = 0
    runnable: bool = False
    verdict: str = ""  # a few words: why not, or how it would be placed
    detail: str = ""  # the verdict in full
    predicted_tok_s: float | None = None
    speeds: str = ""  # where the prediction's speeds come from
    calibrated: bool = False  # measured on this machine (else the speed is labelled uncalibrated)


@dataclass(frozen=True)
class PlanSettings:
    """What the placement dock asks for: the two sliders and the selectors."""

    vram_bytes: int
    ctx: int
    kv_type: str = "bf16"  # the engine's default (engine.kv_layout.DEFAULT_KV_TYPE; tests hold them equal)
    moe: str = MOE_AUTO
    n_gpu_layers: int = -1


@dataclass(frozen=True)
class PlacementLimits:
    """Ranges of the placement controls for the loaded model and detected device."""

    device_name: str
    device_vram_bytes: int  # what the device (or the simulated profile) offers
    vram_max_bytes: int  # slider maximum (the device, or less when the whole model needs less)
    vram_step_bytes: int
    ctx_values: tuple[int, ...]  # allowed context sizes, ascending
    n_layer: int
    is_moe: bool
    current: PlanSettings  # where the controls start: the settings in force, or a proposal
    applied: PlanSettings | None = None  # the settings in force (None = everything on the CPU)
    in_force: str = ""  # one line on where the model runs now (the status bar shows it)
    has_gpu: bool = True  # False: no CUDA device; the model runs on the CPU and nothing else is offered
    n_ctx_train: int = 0  # the context the model was trained for (the context slider's top)
    measured_tok_s: float = 0.0  # decode tok/s the warm-up measured at load (0: not measured)
    cache_policy: str = DEFAULT_CACHE_POLICY  # the expert cache's policy in force (the experts dock's selector)
    routing_history: bool = True  # "use my routing history": the cache's hit-rate curve from the user's traces
    whatif: PlacementLimits | None = None  # without a GPU: the controls for planning a hypothetical one


@dataclass(frozen=True)
class LayerCell:
    """One layer of a plan: where its trunk and its routed experts live."""

    index: int
    device: str  # "gpu" | "cpu"
    experts: str  # "cpu" | "cache" | "resident" | "none"
    trunk_bytes: int
    kv_bytes: int


# Device-memory segments in drawing order: (key, legend label).
SEGMENTS = (
    ("reserve", "reserve"),
    ("scratch", "scratch"),
    ("trunk", "trunk layers"),
    ("kv", "KV cache"),
    ("globals", "output"),
    ("experts", "expert cache"),
    ("stream", "prompt staging"),
)


def segment_label(key: str, label: str, moe_mode: str) -> str:
    """A device segment's legend label: the expert pool is a cache or the resident experts."""
    return "resident experts" if key == "experts" and moe_mode == "resident" else label


@dataclass(frozen=True)
class PlanPreview:
    """A placement as the layout view draws it, or the reason there is none (``error``)."""

    settings: PlanSettings
    error: str = ""
    budget_bytes: int = 0
    segments: tuple[tuple[str, int], ...] = ()  # (SEGMENTS key, bytes) of the device allocation
    expert_cache_budget_bytes: int = 0  # left for experts after everything else
    free_bytes: int = 0  # budget - allocated
    layers: tuple[LayerCell, ...] = ()
    n_layer: int = 0
    n_gpu_layers: int = 0
    layer_reason: str = ""
    moe_mode: str = ""
    moe_reason: str = ""
    predicted_tok_s: tuple[tuple[str, float | None], ...] = ()  # (mode, tok/s or None = impossible)
    resident_split: int = 0  # the resident prediction keeps the experts of layers 0..this-1 on the CPU
    predicted_hit_rate: float | None = None
    # Where the speeds behind predicted_tok_s come from: "measured" (calibrated on this machine),
    # "partly measured" or "defaults" (documented guesses); speeds_device names the machine.
    speeds_source: str = "defaults"
    speeds_device: str = ""
    # Where the cache's predicted hit rates come from: "your routing history: 2 traces, 1,536 tokens", "synthetic
    # Qwen3-30B-A3B routing", "the Zipf popularity guess (no routing history of this model)", or "" (not said).
    hit_curve_source: str = ""
    expert_slots: int = 0
    expert_slots_needed: int = 0
    kv_bytes: int = 0
    host_kv_bytes: int = 0
    recommended_ctx: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def allocated_bytes(self) -> int:
        return sum(b for _, b in self.segments)


@dataclass(frozen=True, eq=False)
class StatsFrame:
    """One profiler snapshot, ready to draw. Arrays [L, E] are indexed by layer, then expert.

    heat: float64 [L, E] decayed access heat. residency: float64 [L, E] 1.0 where the expert is
    on the device. hit_ratio: float64 [L, E] hits / (hits + misses), 0 where never looked up.
    calls: int64 [L, E]. Series float64 [N] over the last N forward passes: tok_s (1 ÷ the interval from
    a decoded token to the next, as the generation loop saw it; nan for prompt chunks), hit_rate (nan where no
    cache was consulted), upload_mb_s. decode_tok_s / decode_hit_rate / decode_tokens: the latest reply's
    decode window (engine.profiler.DecodeWindow) — the figures the status bar shows.
    """

    n_layer: int
    n_expert: int
    heat: np.ndarray
    residency: np.ndarray
    hit_ratio: np.ndarray
    calls: np.ndarray
    tok_s: np.ndarray
    hit_rate: np.ndarray
    upload_mb_s: np.ndarray
    tokens_total: int
    has_cache: bool  # any hit or miss recorded (False in CPU-only mode)
    decode_tok_s: float = 0.0
    decode_hit_rate: float | None = None
    decode_tokens: int = 0
    # The cache's hits split by how the expert got there: a miss's upload (demand) or a prediction (prefetch,
    # SHARPI_CACHE_PREFETCH); recall: the share of the predicted layers' experts the prediction named (nan: none).
    demand_hits: int = 0
    prefetch_hits: int = 0
    prefetch_recall: float = float("nan")

    @classmethod
    def empty(cls, n_layer: int = 1, n_expert: int = 1) -> StatsFrame:
        z = np.zeros((n_layer, n_expert))
        e = np.zeros(0)
        return cls(n_layer, n_expert, z, z, z, z.astype(np.int64), e, e, e, 0, False)


@dataclass(frozen=True)
class Message:
    """One chat message as stored."""

    id: int
    conversation_id: int
    role: str  # "user" | "assistant"
    content: str
    created: float  # seconds since the epoch
    meta: dict = field(default_factory=dict)  # speed figures, finish reason
    parent_id: int | None = None  # the message this one answers or follows (None: the first of a branch)
    reasoning: str = ""  # a reply's reasoning, kept apart from its answer (engine.generate.reasoning)


@dataclass(frozen=True)
class Branch:
    """Where a message sits among its alternatives: the ``index``-th (0-based) of ``count`` messages
    with the same parent (regenerated replies, edited questions), and their ids in order."""

    index: int
    count: int
    sibling_ids: tuple[int, ...]


@dataclass(frozen=True)
class SearchHit:
    """A conversation that matches a search: its id and title, and a snippet of the first matching
    message ("" when only the title matches)."""

    conversation_id: int
    title: str
    snippet: str
    message_id: int | None = None


@dataclass(frozen=True)
class Preset:
    """A system prompt and sampling settings saved for one model (``model``: the model's name)."""

    id: int
    model: str
    name: str
    system_prompt: str
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    created: float
    updated: float


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (powers of 1024, as the planner prints them)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: int) -> str:
    """4068864 -> '4.07 M' (parameters)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


@dataclass(frozen=True)
class ServerStatus:
    """The local server (the OpenAI-compatible API over the loaded model)."""

    running: bool
    url: str = ""  # the base URL clients use, e.g. http://127.0.0.1:8080/v1
    host: str = ""
    port: int = 0
    model_id: str = ""  # what clients put in "model"
    n_requests: int = 0  # generation requests answered since it started
    queued: int = 0  # requests waiting for the model now
    api_key: bool = False  # a key is required
    error: str = ""  # why it could not start


@dataclass(frozen=True)
class ServerRequest:
    """One answered API request, for the request log."""

    at: float  # seconds since the epoch, when it ended
    route: str
    status: int  # HTTP status
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tok_s: float = 0.0  # decode speed
    duration_s: float = 0.0
    finish_reason: str = ""


@dataclass(frozen=True)
class RemoteInfo:
    """A remote OpenAI-compatible endpoint the chat talks to in place of a local model."""

    base_url: str  # e.g. http://gpu-box:8000/v1
    model: str  # the model id the chat asks for
    models: tuple[str, ...] = ()  # every model the endpoint lists
