"""The engine's one narrow API: what the CLI, the tests and the desktop app call.

Only plain data crosses it (dataclasses, numpy arrays, strings). A :class:`Session` is used from
one worker thread at a time; :meth:`Session.cancel` may be called from any thread.
"""

from __future__ import annotations

import errno
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from engine import config
from engine.config import EngineOptions
from engine.errors import DeviceMemoryError, HostMemoryError, UsageError
from engine.generate import CacheState, GenerationEvent, SamplingParams, TokenConstraint, generate
from engine.generate.events import FINISH_CANCELLED
from engine.generate.reasoning import HARMONY, detect_format, model_format, template_messages
from engine.generate.speculative import DraftJudge
from engine.gguf import open_gguf
from engine.modelinfo import ModelInfo, describe
from engine.models import check_model_file
from engine.plan import (
    DeviceProfile,
    ModelSpec,
    Placement,
    PlanRequest,
    default_ctx,
    expert_slot_layout,
    plan,
    resolve_kv_type,
)
from engine.plan.ram import available_ram
from engine.plan.sizing import HostLoad, host_load
from engine.profiler import ProfilerSnapshot
from engine.profiler import export as export_profile
from engine.routes import RouteRecorder, RouteTrace
from engine.routes.replay import RouteReplayer
from engine.routes.sample import RoutingSample
from engine.runtime.apply import Applied, apply_placement, release_device
from engine.runtime.device import cuda_reserve
from engine.runtime.expert_pool import mirror_bytes, misses_over_bus
from engine.runtime.replan import Replan, eligible, replan
from engine.runtime.threads import host_threads, use_host_threads
from engine.tokenizer.chat import RenderCancelled

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]  # (done, total, what)

AUTO_CTX = 0  # LoadOptions.n_ctx: the model's own default context, engine.plan.default_ctx(n_ctx_train)


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = 4096  # context size in tokens; AUTO_CTX (0) = default_ctx(the model's training context)
    kv_type: str | None = None  # f32 | bf16 | q8_0; None = engine.kv_type ($SHARPI_KV_DTYPE) or DEFAULT_KV_TYPE
    q8_act: bool = True  # quantize activations like llama.cpp before quantized dot products
    device: str | None = None  # "cuda" | "cpu" (the simulated device); None = cuda if available
    placement: PlanRequest | None = None  # None = everything on the CPU
    vram_budget: int | None = None  # device bytes the planner may use; None = the detected VRAM
    # The machine's speeds for the planner (bandwidths, fixed costs); None = the documented defaults.
    # On CUDA the CLI and the app pass this machine's calibration (engine.bench.calibrate.speed_profile).
    device_profile: DeviceProfile | None = None
    # The engine's knobs (kernel choice, CUDA graphs, calibration, ...: engine.config); default: the
    # process environment's, read once (engine.config.current()). engine.weights: copy | mmap | auto.
    engine: EngineOptions = field(default_factory=config.current)
    # RAM the loader may allocate (host weight copies, KV, scratch); None = what the system reports available
    # (MemAvailable, within a cgroup's limit). Checked before anything is copied (memory_plan).
    ram_budget: int | None = None
    # "Use my routing history": the planner prices the expert cache with the hit-rate curve of the user's recorded
    # routing traces (engine.routes.history) when there are any of this model's geometry; False (or none):
    # EngineOptions.hit_curve (the Zipf guess, or the synthetic curve). A device_profile's own hit_curve overrides.
    routing_history: bool = True


@dataclass(frozen=True)
class MemoryPlan:
    """How a load holds its weights and what it allocates (:func:`memory_plan`)."""

    copy_weights: bool  # False: host matrices stay memory-mapped (page cache)
    load: HostLoad  # what the load allocates in this mode
    available: int | None  # the RAM it was compared with (None: unknown, not checked)
    note: str = ""  # why the weights stay mapped, when the mode was auto


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def memory_plan(
    spec: ModelSpec, *, ctx: int, kv_type: str, mode: str = "auto", budget: int | None = None, experts: bool = True
) -> MemoryPlan:
    """Decide how to hold the weights and check the load fits, before anything is allocated.

    ``mode``: copy | mmap | auto (copy when it fits ``budget`` — default :func:`available_ram` — else keep
    the weights mapped). A load that does not fit even so is a :class:`HostMemoryError` that gives the
    numbers and what would fit (weights mapped, a smaller context, a smaller KV type, a smaller quant)."""
    avail = budget if budget is not None else available_ram()
    copied = host_load(spec, ctx=ctx, kv_type=kv_type, copy_weights=True, experts=experts)
    mapped = host_load(spec, ctx=ctx, kv_type=kv_type, copy_weights=False, experts=experts)
    if mode == "copy" or (mode == "auto" and (avail is None or copied.total <= avail)):
        plan_ = MemoryPlan(True, copied, avail)
    else:
        note = ""
        if mode == "auto":
            note = (
                f"the weights stay memory-mapped (page cache, slower): copying them needs {_gib(copied.total)} "
                f"and {_gib(avail)} is available"
            )
        plan_ = MemoryPlan(False, mapped, avail, note)
    need = plan_.load
    if avail is None or need.total <= avail:
        return plan_
    what = "the RAM budget" if budget is not None else "available"
    parts = [f"{_gib(need.weights)} weights copied out of the file"] if need.weights else []
    parts += [f"{_gib(need.kv)} KV cache for {ctx} tokens ({kv_type})", f"{_gib(need.scratch)} scratch"]
    fits = []
    if plan_.copy_weights and mapped.total <= avail:
        fits.append(f"keeping the weights memory-mapped (--weights mmap: needs {_gib(mapped.total)})")
    copy_best = plan_.copy_weights and mapped.total >= need.total  # the hints count the cheaper mode

    def total(n: int) -> int:
        return host_load(spec, ctx=n, kv_type=kv_type, copy_weights=copy_best, experts=experts).total

    lo, hi = 0, ctx // 256  # the largest multiple of 256 tokens that fits, by bisection (scratch grows too)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(256 * mid) <= avail else (lo, mid - 1)
    if 256 <= 256 * lo < ctx:
        n = 256 * lo
        fits.append(f"a context of at most {n} tokens (-c {n})" + ("" if copy_best else " with the weights mapped"))
    if kv_type != "q8_0":
        q8 = host_load(spec, ctx=ctx, kv_type="q8_0", copy_weights=copy_best, experts=experts)
        if q8.total <= avail:
            fits.append(f"a q8_0 KV cache (--kv-type q8_0: needs {_gib(q8.total)})")
    fits.append("a smaller quantization of the model")
    raise HostMemoryError(
        f"the model does not fit in RAM: loading needs {_gib(need.total)} ({', '.join(parts)}) and {_gib(avail)} "
        f"is {what}. What would fit: {'; '.join(fits)}"
    )


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
            check_model_file(self.gf)  # the architecture's own errors before the sizes are read
            self.kv_type = resolve_kv_type(options.kv_type, options.engine.kv_type)
            self._spec: ModelSpec | None = ModelSpec.from_gguf(self.gf)
            self.n_ctx = options.n_ctx if options.n_ctx != AUTO_CTX else default_ctx(self._spec.n_ctx_train)
            self.memory = memory_plan(
                self._spec,
                ctx=self.n_ctx,
                kv_type=self.kv_type,
                mode=options.engine.weights,
                budget=options.ram_budget,
                experts=options.placement is None,
            )
            if self.memory.note:
                log.warning("%s: %s", path, self.memory.note)
            report(1, 4, "building model")
            self.model = build_model(self.gf, q8_act=options.q8_act, copy_weights=self.memory.copy_weights)
            self.args = self.model.args
            report(2, 4, "loading tokenizer")
            self.tokenizer = load_tokenizer(self.gf)
            self.chat_template = ChatTemplate.from_gguf(self.gf, self.tokenizer)
            # the format the model writes in (harmony's call messages, whatever EngineOptions.reasoning says)
            self.chat_format: str | None = detect_format(
                self.info.architecture,
                self.chat_template.source if self.chat_template.from_file else None,
                lambda text: self.tokenizer.token_id(text) is not None,
            )
            # how replies' reasoning is kept apart from their answer (None: not at all)
            self.reasoning: str | None = model_format(options.engine.reasoning, self.chat_format)
            report(3, 4, "placing the model")
            self.device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            self._speeds: DeviceProfile | None = options.device_profile
            self._use_history = options.routing_history
            self._curve = None  # engine.routes.history.CurveChoice, once planned with
            self._cuda_reserve: int | None = None
            self._sample: RoutingSample | None = None  # this session's prompt routing, for the re-plan of `auto`
            self._replanned = False
            self._unsampled = False  # inside unsampled(): no sampling, no re-plan
            self.replans: list[Replan] = []  # the re-plans of an `auto` placement on the session's routing
            self.applied: Applied | None = None
            self.cache = self.model.new_cache(self.n_ctx, self.kv_type)
            if options.placement is not None:
                req = replace(options.placement, ctx=self.n_ctx, kv_type=self.kv_type)
                self.apply(self.plan(req, self.device_profile(options.vram_budget)), progress=report)
        except (MemoryError, OSError) as e:
            self.gf.close()
            if isinstance(e, OSError) and e.errno != errno.ENOMEM:
                raise
            raise HostMemoryError(f"{path}: the system refused memory while loading ({e or 'MemoryError'})") from None
        except BaseException:
            self.gf.close()
            raise
        self.state = self._new_state()
        self._draft_judge: DraftJudge | None = None  # draft_judge's, until a placement is applied again
        self._cancel = threading.Event()
        self._active_cancel: threading.Event | None = None  # the running generation's stop event
        report(4, 4, "ready")

    @classmethod
    def load(cls, path: str, options: LoadOptions | None = None, progress: Progress | None = None) -> Session:
        return cls(path, options or LoadOptions(), progress)

    # -- text ---------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return self.tokenizer.encode(clean_text(text), add_bos=add_bos, parse_special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text of a conversation through the model's own chat template (``tools``: OpenAI-style
        function declarations, which the template writes into the prompt its own way)."""
        return self.chat_template.render(
            self._for_template(messages), add_generation_prompt=add_generation_prompt, tools=tools or None
        )

    def _for_template(self, messages: list[dict]) -> list[dict]:
        """``messages`` cleaned, with earlier replies' ``reasoning_content`` under the template's name for it
        (:func:`engine.generate.reasoning.template_messages`)."""
        return template_messages(clean_messages(messages), self.reasoning)

    def prompt_ids(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[int]:
        """The token ids :meth:`generate` would feed for ``prompt`` (raw text) or ``messages`` (chat, :meth:`chat_ids`)."""
        if (prompt is None) == (messages is None):
            raise UsageError("give exactly one of prompt or messages")
        if messages is not None:
            return self.chat_ids(messages, tools=tools, cancel=cancel)
        return self.tokenizer.encode(clean_text(prompt), add_bos=None, parse_special=True)

    def chat_ids(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        cancel: threading.Event | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The prompt ids of a chat: the template's markup parsed for control tokens, the text of user, system
        and tool messages never (``<|im_end|>`` typed by a user stays text). ``cancel`` stops the render;
        ``tools``: function declarations the template writes into the prompt its own way."""
        text, spans = self.chat_template.render_with_spans(
            self._for_template(messages), add_generation_prompt, cancel=cancel, tools=tools or None
        )
        return self.tokenizer.encode(text, add_bos=None, parse_special=True, plain_spans=spans)

    def use_chatml(self) -> None:
        """Render chats with ChatML instead of the model's own template (the explicit fallback offered when
        that template fails: a ChatTemplateError); for this session only."""
        from engine.tokenizer.chat import ChatTemplate

        self.chat_template = ChatTemplate.chatml(self.tokenizer)

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
        cancel: threading.Event | None = None,
        tools: list[dict] | None = None,
        constraint: TokenConstraint | None = None,
        reasoning: bool = True,
        calls: bool = False,
    ) -> Iterator[GenerationEvent]:
        """Stream a completion of ``prompt`` (raw text), ``messages`` (chat, with optional ``tools``) or
        ``prompt_ids``. ``constraint``: what the output must match (e.g. :mod:`engine.generate.grammar`).
        ``reasoning``: the events carry the model's reasoning apart from the answer (:attr:`reasoning`, the
        format; False: the text whole, as for a raw completion). ``calls``: tools are in play: a harmony model's
        (:attr:`chat_format`) tool calls come as the events' ``calls`` also where its reasoning is not kept
        apart, the rest of the text then answer as written.

        ``cancel``: this generation's own stop event. A caller that queues the request to a worker creates
        it with the request, so a Stop that comes before the generation starts (or while the chat template
        renders) still stops it: the stream is then one cancelled event. None: the session's event, cleared
        here and set by :meth:`cancel`."""
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise UsageError("give exactly one of prompt, messages or prompt_ids")
        if cancel is None:
            self._cancel.clear()
            cancel = self._cancel
        self._active_cancel = cancel
        try:
            if cancel.is_set():
                raise RenderCancelled("stopped before it started")
            if prompt_ids is not None:
                ids = self.check_ids(prompt_ids)
            else:
                ids = self.prompt_ids(prompt, messages=messages, tools=tools, cancel=cancel)
        except RenderCancelled as e:
            return iter([GenerationEvent("", None, 0, 0, len(self.state.tokens), self.n_ctx, 0.0, 0.0, 0.0,
                                         FINISH_CANCELLED, str(e))])  # fmt: skip
        self._between_turns()
        fmt = self.reasoning if reasoning else None
        only_calls = calls and self.chat_format == HARMONY and fmt != HARMONY
        return _on_threads(
            self.host_threads,
            generate(
                self.model,
                self.tokenizer,
                self.cache,
                self.state,
                ids,
                params or SamplingParams(),
                cancel,
                constraint,
                reasoning=HARMONY if only_calls else fmt,
                mtp=self.mtp,
                only_calls=only_calls,
                mtp_judge=self.draft_judge,
            ),
        )

    def _between_turns(self) -> None:
        """Before a generation: the re-plan of an ``auto`` placement on this session's own routing
        (``engine.runtime.replan``) once its prompts have routed ``EngineOptions.replan_tokens`` tokens — applied
        when the choice changes, so this generation recomputes its whole prompt under the new placement — else the
        routing sample armed for this generation's prompt. Nothing happens where the placement is not an ``auto``
        choice the cache's hit rate could change, or where the hit rates already come from this model's routing
        (the user's history, a profile's own curve, an earlier re-plan)."""
        from engine.runtime.hit_curves import SOURCE_HISTORY

        if self._sample is not None:
            self._sample.disarm()  # still armed only where a generation ended before its prompt ran
        target = self.engine_options.replan_tokens
        if self._replanned or self._unsampled or target <= 0 or not self.spec.is_moe:
            return
        p = self.placement
        own = (self._speeds is not None and bool(self._speeds.hit_curve)) or self.hit_curve().source == SOURCE_HISTORY
        if own or not eligible(p, self.spec):
            return
        if self._sample is None:
            self._sample = RoutingSample(self.args.n_expert, self.args.n_expert_used, model=self.info.name)
        if self._sample.n_tokens < target:
            self._sample.arm(self.model)
            return
        self.replan_now()

    @contextmanager
    def unsampled(self) -> Iterator[None]:
        """Generations inside are neither sampled for the re-plan nor re-planned before (``engine.warmup``: its
        prompts are made up, not the user's routing)."""
        paused, self._unsampled = self._unsampled, True
        try:
            yield
        finally:
            self._unsampled = paused

    def replan_now(self) -> Replan | None:
        """Plan the placement in force again with the hit-rate curve of this session's routing sampled so far, and
        apply it if the choice changed (a fresh KV cache: the next generation recomputes its prompt). Returns what
        was found (also appended to :attr:`replans`), or None where there is no sample or nothing to re-plan."""
        sample, self._sample = self._sample, None
        p = self.placement
        if sample is None:
            return None
        sample.disarm()  # called directly, between a generation's arming and its prompt
        if sample.n_tokens == 0 or not eligible(p, self.spec):
            return None
        self._replanned = True
        from engine.runtime.hit_curves import session_curve

        curve = session_curve(sample.trace(), self.engine_options.cache_policy, p.expert_capacity)
        self._curve = curve  # later plans (the app's sliders) price the cache with it too
        new, found = replan(self.spec, p, curve)
        if found.changed:
            try:
                self.apply(new)
            except DeviceMemoryError as e:
                found = replace(found, changed=False, note=f"{found.note}; not applied: {e}")
        log.info("%s", found.note)
        self.replans.append(found)
        return found

    @property
    def draft_judge(self) -> DraftJudge | None:
        """Where MTP was chosen automatically (``EngineOptions.mtp`` None, a head, a CPU placement): the judge of
        whether drafting pays on this machine, kept for the session's life (None where MTP is off or asked for)."""
        if self.engine_options.mtp is not None or self.mtp <= 0:
            return None
        if self._draft_judge is None:
            self._draft_judge = DraftJudge()
        return self._draft_judge

    def _on_cuda(self) -> bool:
        """Whether the applied placement puts layers on a CUDA device."""
        applied = self.applied
        return self.device.type == "cuda" and applied is not None and applied.placement.n_gpu_layers > 0

    @property
    def host_threads(self) -> int:
        """The threads a generation's CPU kernels run with under the applied placement
        (:func:`engine.runtime.threads.host_threads`: ``EngineOptions.host_threads``, else every core, less
        ``cores // 8`` when the placement keeps experts on a CUDA device: the cache or a resident split)."""
        import numba

        options = self.applied.options if self.applied is not None else self.engine_options
        device_experts = self._on_cuda() and self.applied.placement.moe_mode != "cpu"
        return host_threads(options, device_experts, most=numba.config.NUMBA_NUM_THREADS)

    @property
    def has_mtp(self) -> bool:
        """Whether the model file has an MTP (NextN) head that speculative decoding can draft with."""
        return getattr(self.args, "n_layer_nextn", 0) > 0 and hasattr(self.model, "mtp_head")

    @property
    def mtp(self) -> int:
        """Tokens drafted per step by the MTP head (``EngineOptions.mtp``; auto: ``config.MTP_AUTO_DRAFTS`` where
        the file has a head and the placement keeps every layer on the CPU, and each conversation turns drafting off
        where its own step times show it does not pay (``engine.generate.speculative.DraftJudge``) — on a CUDA
        placement a step with drafts runs without the decode graphs, 8× slower on the Qwen3.6-35B-A3B geometry
        (docs/benchmarks.md), so auto leaves MTP off there); 0: off."""
        if not self.has_mtp:
            return 0
        k = self.engine_options.mtp
        if k is None:
            return 0 if self._on_cuda() else config.MTP_AUTO_DRAFTS
        return k

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
        """Stop the generation in progress after the current token (any thread); a generation given its own
        ``cancel`` event is stopped through it too."""
        self._cancel.set()
        active = self._active_cancel
        if active is not None:
            active.set()

    def _new_state(self) -> CacheState:
        """An empty record of the cache, keeping ``EngineOptions.state_checkpoints`` checkpoints of recurrent states."""
        return CacheState(checkpoint_limit=self.engine_options.state_checkpoints)

    def reset(self) -> None:
        """Forget the cached conversation (the next generation recomputes its whole prompt)."""
        self.state = self._new_state()

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
        if self.spec.is_moe and not base.hit_curve:  # the routing history's curve, else the fallback's (or Zipf)
            curve = self.hit_curve()
            base = replace(base, hit_curve=curve.points, hit_curve_source=curve.detail)
        return replace(base, vram_bytes=vram, name=base.name or name)

    def hit_curve(self):
        """The expert cache's hit rate against capacity the planner prices ``cache`` with: an
        :class:`engine.routes.history.CurveChoice` (points, and whether they come from the user's routing
        history or the synthetic trace). Replayed once (seconds; cached on disk), then kept."""
        if self._curve is None:
            from engine.runtime.hit_curves import planner_curve

            spec = self.spec
            self._curve = planner_curve(
                spec.n_expert, spec.n_expert_used, use_history=self._use_history, options=self.engine_options
            )
        return self._curve

    @property
    def routing_history(self) -> bool:
        """Whether plans take the cache's hit-rate curve from the user's routing history (when it has any)."""
        return self._use_history

    @property
    def cache_policy(self) -> str:
        """The expert cache's slot policy (``EngineOptions.cache_policy``) later placements run with."""
        return self.engine_options.cache_policy

    def set_cache_policy(self, name: str) -> None:
        """Use slot policy ``name`` (engine.config.CACHE_POLICIES) for the expert cache from now on; a cache in
        force is rebuilt with it (re-applied: the pool starts empty and the KV cache fresh). Where experts run
        changes, never the output."""
        options = replace(self.engine_options, cache_policy=name)  # checked: a UsageError names the choices
        self.engine_options = options
        if self.applied is not None and self.applied.experts is not None and self.placement.moe_mode == "cache":
            self.apply(self.placement)

    def set_routing_history(self, use: bool) -> None:
        """Whether later plans take the hit-rate curve from the user's routing history ("use my routing
        history"; :class:`LoadOptions` ``routing_history``)."""
        if bool(use) != self._use_history:
            self._use_history, self._curve = bool(use), None

    def save_routes_to_history(self, recorder: RouteRecorder) -> str:
        """Write what ``recorder`` (:meth:`record_routes`) holds into the routing history; returns the file's
        path. Later curves include it (:meth:`set_routing_history` to re-read it now)."""
        from engine.routes.history import save_to_history

        path = save_to_history(recorder.trace(), self.engine_options)
        self._curve = None
        return str(path)

    def set_device_profile(self, profile: DeviceProfile | None) -> None:
        """Use ``profile``'s speeds for later plans (None: back to the defaults)."""
        self._speeds = profile

    def plan(self, request: PlanRequest, profile: DeviceProfile | None = None) -> Placement:
        """The planner's placement for this model (pure and fast: no allocation, no measuring).
        A request's ``kv_type``, ``cuda_graphs`` and ``prompt_stream`` left None follow the session's (its KV type,
        ``cuda_graph``, ``prompt_stream_min``)."""
        if request.kv_type is None:
            request = replace(request, kv_type=self.kv_type)
        if request.cuda_graphs is None:
            request = replace(request, cuda_graphs=self.engine_options.cuda_graph != "off")
        if request.prompt_stream is None:
            request = replace(request, prompt_stream=self.engine_options.prompt_stream_min > 0)
        if request.bus_misses is None:
            experts = [lay.n_expert for lay in self.spec.layers if lay.is_moe]
            need = mirror_bytes(experts, expert_slot_layout(self.spec).stride)
            bus = misses_over_bus(self.engine_options.cache_misses, self.device.type, need, available_ram())
            request = replace(request, bus_misses=bus)
        return plan(self.spec, profile or self.device_profile(), request)

    def apply(
        self, placement: Placement, engine: EngineOptions | None = None, progress: Progress | None = None
    ) -> None:
        """Re-place the loaded model (the file is not re-read) and start a fresh KV cache. ``engine``: the
        engine options this placement runs with (default: the session's, ``LoadOptions.engine``; e.g.
        calibration applies a probe with CUDA graphs off); they stay with it until the next apply. ``progress``:
        told of the slow part, the expert cache's page-locked host copy, layer by layer (it may raise to cancel).

        If the device runs out of memory, the previous placement is restored and the error says so.
        """
        previous = (self.applied.placement, self.applied.options) if self.applied is not None else None
        engine = engine if engine is not None else self.engine_options
        if previous is not None:
            self._release()
        try:
            self.applied = apply_placement(
                self.model, self.spec, placement, self.device, options=engine, progress=progress
            )
        except DeviceMemoryError as e:
            self._restore(previous)
            raise DeviceMemoryError(f"{e}; the previous placement stays in force") from None
        self.cache = self.applied.cache
        self.n_ctx = placement.ctx
        self.kv_type = placement.kv_type
        self.state = self._new_state()
        self._draft_judge = None  # another placement, other step times

    def _release(self) -> None:
        """Let go of the placement in force — device weights, expert slots, KV cache, graphs — before another is
        built, so the device never holds two: a re-plan or an apply on a nearly full card would otherwise run out
        of memory halfway (and nvidia-smi would count both). The experts' page-locked host copy stays for the next
        placement to reuse."""
        self.applied = self.cache = None
        self.state = self._new_state()
        release_device(self.model)
        self.cache = self.model.new_cache(1, self.kv_type)  # a host cache of one token until the next is made
        gc.collect()  # layers and backends refer to each other: their cycles hold device tensors until collected
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore(self, previous: tuple | None) -> None:
        self._release()  # also what the failed placement had built
        if previous is not None:
            placement, options = previous
            self.applied = apply_placement(self.model, self.spec, placement, self.device, options=options)
            self.cache = self.applied.cache
        else:
            cpu_only = plan(
                self.spec, replace(DeviceProfile(), vram_bytes=0), PlanRequest(ctx=self.n_ctx, kv_type=self.kv_type)
            )
            self.applied = None
            apply_placement(self.model, self.spec, cpu_only, self.device, options=self.engine_options)
            self.cache = self.model.new_cache(self.n_ctx, self.kv_type)
        self.state = self._new_state()

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

    def record_routes(self) -> RouteRecorder:
        """Start recording every MoE layer's routes (ids and weights, every token from now on) and return the
        recorder: ``recorder.trace()`` is the :class:`engine.routes.RouteTrace` so far, ``save_trace`` writes it.
        Recording runs each token layer by layer (no decode graph, no fused host step): the same logits, slower.
        A dense model records nothing."""
        a = self.model.args
        rec = RouteRecorder(a.n_expert, a.n_expert_used, model=self.info.name or Path(self.info.path).name)
        self.model.set_route_tap(rec)
        return rec

    def replay_routes(self, trace: RouteTrace) -> RouteReplayer:
        """From now on every MoE layer's top-k follows ``trace`` (ids and weights; token t of the run takes
        trace token t mod its length), whatever the router says: benchmarks only, it changes the output."""
        a = self.model.args
        moe = [i for i, layer in enumerate(self.model.layers) if getattr(layer, "moe", None) is not None]
        rep = RouteReplayer(trace, moe, a.n_expert, a.n_expert_used)
        self.model.set_route_tap(rep)
        return rep

    def stop_recording_routes(self) -> None:
        """Stop recording or replaying routes."""
        self.model.set_route_tap(None)

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
        self.model.settle()  # nothing may read the memory map after it closes
        self.gf.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _on_threads(n: int, events: Iterator[GenerationEvent]) -> Iterator[GenerationEvent]:
    """``events``, run with the CPU kernels on ``n`` threads in whichever thread consumes them (numba's thread
    count is the calling thread's)."""
    use_host_threads(n)
    yield from events
