"""The engine's one narrow API: what the CLI, the tests and the desktop app call.

Only plain data crosses it (dataclasses, numpy arrays, strings). A :class:`Session` is used from
one worker thread at a time; :meth:`Session.cancel` may be called from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine import config
from engine.config import EngineOptions
from engine.errors import DeviceMemoryError, UsageError
from engine.generate import CacheState, GenerationEvent, SamplingParams, generate
from engine.gguf import open_gguf
from engine.modelinfo import ModelInfo, describe
from engine.plan import DeviceProfile, ModelSpec, Placement, PlanRequest, default_ctx, plan, resolve_kv_type
from engine.profiler import ProfilerSnapshot
from engine.profiler import export as export_profile
from engine.runtime.apply import Applied, apply_placement
from engine.runtime.device import cuda_reserve

Progress = Callable[[int, int, str], None]  # (done, total, what)

AUTO_CTX = 0  # LoadOptions.n_ctx: the model's own default context, engine.plan.default_ctx(n_ctx_train)


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = 4096  # context size in tokens; AUTO_CTX (0) = default_ctx(the model's training context)
    kv_type: str | None = None  # f32 | bf16 | q8_0; None = engine.kv_type ($SHARPI_KV_DTYPE) or f32
    q8_act: bool = True  # quantize activations like llama.cpp before quantized dot products
    device: str | None = None  # "cuda" | "cpu" (the simulated device); None = cuda if available
    placement: PlanRequest | None = None  # None = everything on the CPU
    vram_budget: int | None = None  # device bytes the planner may use; None = the detected VRAM
    # The machine's speeds for the planner (bandwidths, fixed costs); None = the documented defaults.
    # On CUDA the CLI and the app pass this machine's calibration (engine.bench.calibrate.speed_profile).
    device_profile: DeviceProfile | None = None
    # The engine's knobs (kernel choice, CUDA graphs, calibration, ...: engine.config); default: the
    # process environment's, read once (engine.config.current()).
    engine: EngineOptions = field(default_factory=config.current)


def clean_text(text) -> str:
    """Text from a user, a paste or a request as the tokenizer can take it: a str, with lone UTF-16
    surrogates (which a clipboard or a JSON body can carry, and no UTF-8 can encode) replaced by U+FFFD."""
    if not isinstance(text, str):
        raise UsageError(f"text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def clean_messages(messages: list[dict]) -> list[dict]:
    """Chat messages with every string content through :func:`clean_text` (other fields as given)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise UsageError("messages must be a list of {'role': ..., 'content': ...} objects")
    return [{**m, "content": clean_text(m["content"])} if isinstance(m.get("content"), str) else m for m in messages]


class Session:
    """A loaded model with its tokenizer, chat template and KV cache."""

    def __init__(self, path: str, options: LoadOptions, progress: Progress | None = None):
        from engine.models import build_model
        from engine.tokenizer import load_tokenizer
        from engine.tokenizer.chat import ChatTemplate

        if options.n_ctx != AUTO_CTX and options.n_ctx < 8:
            raise UsageError(f"context size {options.n_ctx} is too small (at least 8)")
        self.options = options
        self.engine_options = options.engine  # handed to the planner's request and every apply
        config.apply_process_settings()
        report = progress or (lambda d, t, w: None)
        report(0, 4, "reading header")
        self.gf = open_gguf(path)
        try:
            self.info: ModelInfo = describe(self.gf)
            report(1, 4, "building model")
            self.model = build_model(self.gf, q8_act=options.q8_act)
            self.args = self.model.args
            report(2, 4, "loading tokenizer")
            self.tokenizer = load_tokenizer(self.gf)
            self.chat_template = ChatTemplate.from_gguf(self.gf, self.tokenizer)
            report(3, 4, "placing the model")
            self.kv_type = resolve_kv_type(options.kv_type, options.engine.kv_type)
            self.n_ctx = options.n_ctx if options.n_ctx != AUTO_CTX else default_ctx(self.args.n_ctx_train)
            self.device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            self._spec: ModelSpec | None = None
            self._speeds: DeviceProfile | None = options.device_profile
            self._cuda_reserve: int | None = None
            self.applied: Applied | None = None
            self.cache = self.model.new_cache(self.n_ctx, self.kv_type)
            if options.placement is not None:
                req = replace(options.placement, ctx=self.n_ctx, kv_type=self.kv_type)
                self.apply(self.plan(req, self.device_profile(options.vram_budget)))
        except BaseException:
            self.gf.close()
            raise
        self.state = CacheState()
        self._cancel = threading.Event()
        report(4, 4, "ready")

    @classmethod
    def load(cls, path: str, options: LoadOptions | None = None, progress: Progress | None = None) -> Session:
        return cls(path, options or LoadOptions(), progress)

    # -- text ---------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return self.tokenizer.encode(clean_text(text), add_bos=add_bos, parse_special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(clean_messages(messages), add_generation_prompt=add_generation_prompt)

    def check_ids(self, ids) -> list[int]:
        """``ids`` as a list of token ids, each a whole number in [0, vocabulary size); else a UsageError
        naming the first offender."""
        V, out = self.args.n_vocab, []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < V:
                raise UsageError(f"token {i} is {t!r}: token ids are whole numbers from 0 to {V - 1}")
            out.append(int(t))
        return out

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        params: SamplingParams | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream a completion of ``prompt`` (raw text), ``messages`` (chat) or ``prompt_ids``."""
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise UsageError("give exactly one of prompt, messages or prompt_ids")
        if messages is not None:
            text = self.render_chat(messages)
            ids = self.tokenizer.encode(text, add_bos=None, parse_special=True)
        elif prompt is not None:
            ids = self.tokenizer.encode(clean_text(prompt), add_bos=None, parse_special=True)
        else:
            ids = self.check_ids(prompt_ids)
        self._cancel.clear()
        return generate(
            self.model, self.tokenizer, self.cache, self.state, ids, params or SamplingParams(), self._cancel
        )

    def fit_messages(self, messages: list[dict], max_tokens: int) -> tuple[list[dict], int]:
        """``messages`` with the oldest turns dropped until the rendered prompt leaves room for a reply
        of ``max_tokens`` tokens, at most half the context; returns (messages kept, how many were
        dropped). The CLI's chat and the app call it before each reply, so a conversation never
        outgrows the context: its oldest turns leave it instead. System messages and
        the last message always stay; turns go oldest first, a user message with the replies that
        follow it. If even that does not fit, everything droppable is dropped (generation then says
        the prompt is too long)."""
        messages = clean_messages(messages)
        budget = self.n_ctx - min(max(0, int(max_tokens)), self.n_ctx // 2)

        def n_tokens(ms: list[dict]) -> int:
            return len(self.tokenizer.encode(self.render_chat(ms), add_bos=None, parse_special=True))

        kept = list(messages)
        while n_tokens(kept) > budget:
            body = [i for i, m in enumerate(kept[:-1]) if m.get("role") != "system"]
            if not body:
                break
            first = body[0]
            end = first + 1  # the turn: this message and the non-user, non-system ones after it
            while end < len(kept) - 1 and kept[end].get("role") not in ("user", "system"):
                end += 1
            del kept[first:end]
        return kept, len(messages) - len(kept)

    def cancel(self) -> None:
        """Stop the generation in progress after the current token (any thread)."""
        self._cancel.set()

    def reset(self) -> None:
        """Forget the cached conversation (the next generation recomputes its whole prompt)."""
        self.state = CacheState()

    # -- placement ------------------------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        if self._spec is None:
            self._spec = ModelSpec.from_gguf(self.gf)
        return self._spec

    @property
    def placement(self) -> Placement | None:
        """The placement in force (None: everything on the CPU, as loaded)."""
        return self.applied.placement if self.applied else None

    def device_profile(self, vram_budget: int | None = None) -> DeviceProfile:
        """The device to plan for: its memory (the GPU's when CUDA is used, else 12 GiB unless a
        budget is given) and its speeds — the profile given (``LoadOptions.device_profile``,
        :meth:`set_device_profile`: on CUDA, the CLI and the app pass this machine's calibration,
        ``engine.bench.calibrate.speed_profile``), else the documented defaults. No measuring here."""
        if vram_budget is None and self.device.type == "cuda":
            vram_budget = torch.cuda.mem_get_info(self.device)[1]
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "simulated device (CPU)"
        base = self._speeds or DeviceProfile()
        vram = vram_budget if vram_budget is not None else DeviceProfile().vram_bytes
        if self.device.type == "cuda" and "reserve_bytes" not in base.measured:
            # what the driver will count beyond the planned tensors, measured once before the first placement
            if self._cuda_reserve is None:
                self._cuda_reserve = cuda_reserve(self.device)
            base = replace(base, reserve_bytes=self._cuda_reserve, measured=(*base.measured, "reserve_bytes"))
        return replace(base, vram_bytes=vram, name=base.name or name)

    def set_device_profile(self, profile: DeviceProfile | None) -> None:
        """Use ``profile``'s speeds for later plans (None: back to the defaults)."""
        self._speeds = profile

    def plan(self, request: PlanRequest, profile: DeviceProfile | None = None) -> Placement:
        """The planner's placement for this model (pure and fast: no allocation, no measuring).
        A request's ``cuda_graphs`` and ``prompt_stream`` left None follow the session's options (``cuda_graph``,
        ``prompt_stream_min``)."""
        if request.cuda_graphs is None:
            request = replace(request, cuda_graphs=self.engine_options.cuda_graph != "off")
        if request.prompt_stream is None:
            request = replace(request, prompt_stream=self.engine_options.prompt_stream_min > 0)
        return plan(self.spec, profile or self.device_profile(), request)

    def apply(self, placement: Placement, engine: EngineOptions | None = None) -> None:
        """Re-place the loaded model (the file is not re-read) and start a fresh KV cache. ``engine``: the
        engine options this placement runs with (default: the session's, ``LoadOptions.engine``; e.g.
        calibration applies a probe with CUDA graphs off); they stay with it until the next apply.

        If the device runs out of memory, the previous placement is restored and the error says so.
        """
        previous = self.applied
        engine = engine if engine is not None else self.engine_options
        try:
            self.applied = apply_placement(self.model, self.spec, placement, self.device, options=engine)
        except DeviceMemoryError as e:
            self._restore(previous)
            raise DeviceMemoryError(f"{e}; the previous placement stays in force") from None
        self.cache = self.applied.cache
        self.n_ctx = placement.ctx
        self.kv_type = placement.kv_type
        self.state = CacheState()

    def _restore(self, previous: Applied | None) -> None:
        self.applied = None
        if previous is not None:
            self.applied = apply_placement(
                self.model, self.spec, previous.placement, self.device, options=previous.options
            )
            self.cache = self.applied.cache
        else:
            cpu_only = plan(
                self.spec, replace(DeviceProfile(), vram_bytes=0), PlanRequest(ctx=self.n_ctx, kv_type=self.kv_type)
            )
            self.applied = None
            apply_placement(self.model, self.spec, cpu_only, self.device, options=self.engine_options)
            self.cache = self.model.new_cache(self.n_ctx, self.kv_type)
        self.state = CacheState()

    # -- profiler -----------------------------------------------------------------------------
    def stats(self) -> ProfilerSnapshot:
        """A copy of the expert profiler's counters (cheap; any thread)."""
        return self.model.profiler.snapshot()

    def export_stats(self, prefix: str) -> tuple[str, str]:
        """Write the profiler snapshot to ``PREFIX.json`` and ``PREFIX.csv``; returns both paths."""
        j, c = export_profile(self.stats(), prefix)
        return str(j), str(c)

    def reset_stats(self) -> None:
        self.model.profiler.reset()

    # -- tests and tools ----------------------------------------------------------------------
    def logits(self, token_ids: list[int], batch: bool = True) -> np.ndarray:
        """float32 [T, V] logits for every position, from an empty cache (prefill or token by token)."""
        token_ids = self.check_ids(token_ids)
        if len(token_ids) > self.n_ctx:
            raise UsageError(f"{len(token_ids)} tokens do not fit the context of {self.n_ctx}")
        self.reset()
        if batch:
            out = self.model.forward(token_ids, 0, self.cache).numpy()
        else:
            out = np.concatenate([self.model.forward([t], i, self.cache).numpy() for i, t in enumerate(token_ids)])
        return out

    def close(self) -> None:
        self.gf.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
