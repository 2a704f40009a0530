"""From an OpenAI request to what the engine runs, and from its events back to OpenAI responses.

:func:`plan_chat` / :func:`plan_completion` check a request against the loaded model and give a
:class:`Plan`: the prompt's token ids (chat through the model's own template, ``Session.prompt_ids``),
the :class:`SamplingParams`, an optional grammar constraint (``response_format``, a forced tool
call: a ``<tool_call>`` block, or a harmony model's call message) and whether tool calls are parsed.
:class:`Answer` folds the generation events into the ``choices``, ``usage`` and ``timings`` of a response or
of its stream chunks.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine.errors import UsageError
from engine.generate import GenerationEvent, SamplingParams
from engine.generate.events import FINISH_CANCELLED, FINISH_CONTEXT, FINISH_LENGTH
from engine.generate.reasoning import H_START, HARMONY
from engine.server.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from engine.server.tools import ParsedCall, ToolCallParser


class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Plan:
    """``parse_tools``: tools are in play (``<tool_call>`` blocks in the text; a harmony model's calls come as the
    events' ``calls``, a forced one too: its constraint is split by the decode loop; so too with its reasoning
    off, ``Session.generate``'s ``calls``)."""

    ids: list[int]
    params: SamplingParams
    constraint: object | None = None
    parse_tools: bool = False


def _refuse_unsupported(req: _Sampling) -> None:
    if req.n != 1:
        raise RequestError(400, f"n={req.n} is not supported: this server generates one choice (n=1)", param="n")
    if req.logprobs:
        raise RequestError(400, "logprobs are not supported by this server", param="logprobs")


def _params(req: _Sampling, max_tokens: int | None, n_prompt: int, n_ctx: int) -> SamplingParams:
    given = {
        k: getattr(req, k)
        for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed")
        if getattr(req, k) is not None
    }
    room = max(1, n_ctx - n_prompt)
    try:
        return SamplingParams(max_tokens=min(max_tokens, room) if max_tokens else room, stop=req.stops(), **given)
    except UsageError as e:
        raise RequestError(400, str(e)) from None


def _check_context(ids: list[int], n_ctx: int) -> None:
    if len(ids) >= n_ctx:
        raise RequestError(
            400,
            f"the prompt has {len(ids)} tokens but this model's context holds {n_ctx} "
            f"(at most {n_ctx - 1} prompt tokens, leaving room for one generated token)",
            param="messages",
            code="context_length_exceeded",
        )


def plan_chat(session, req: ChatCompletionRequest) -> Plan:
    """What the engine runs for a chat request (raises :class:`RequestError`)."""
    from engine.generate import grammar

    _refuse_unsupported(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if choice == "none":
        tools = None
    if tools is None and choice not in (None, "none", "auto"):
        raise RequestError(400, "tool_choice asks for a tool call but no tools were given", param="tool_choice")
    fmt = req.response_format
    structured = fmt is not None and fmt.type != "text"
    forced = choice == "required" or (choice is not None and not isinstance(choice, str))
    if structured and forced:
        raise RequestError(400, "response_format and a forced tool_choice cannot both constrain the answer")
    messages = [m.for_template() for m in req.messages]
    try:
        ids = session.prompt_ids(messages=messages, tools=tools)
    except UsageError as e:
        raise RequestError(400, str(e), param="messages") from None
    _check_context(ids, session.n_ctx)
    params = _params(req, req.max_completion_tokens or req.max_tokens, len(ids), session.n_ctx)
    constraint = None
    try:
        if structured:
            schema = {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
            constraint = grammar.GrammarConstraint(session.tokenizer, grammar.json_schema_grammar(schema))
        elif forced:
            chosen = tools
            if not isinstance(choice, str):
                chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
                if not chosen:
                    raise RequestError(
                        400,
                        f"tool_choice names {choice.function.name!r}, which is not among tools",
                        param="tool_choice",
                    )
            # the model's own format (gpt-oss: a message to functions.NAME, split by the loop), whatever the reasoning
            harmony = session.chat_format == HARMONY
            if harmony:
                opened = session.detokenize(ids[-16:]).endswith(H_START + "assistant")
                text = grammar.harmony_call_grammar(chosen, open_message=not opened)
            else:
                text = grammar.tool_call_grammar(chosen)
            constraint = grammar.GrammarConstraint(session.tokenizer, text, split=harmony)
    except UsageError as e:
        raise RequestError(400, str(e), param="response_format" if structured else "tools") from None
    return Plan(ids, params, constraint, parse_tools=tools is not None)


def plan_completion(session, req: CompletionRequest) -> Plan:
    _refuse_unsupported(req)
    if req.echo:
        raise RequestError(400, "echo is not supported by this server", param="echo")
    if req.suffix:
        raise RequestError(400, "suffix (fill-in-the-middle) is not supported by this server", param="suffix")
    if req.best_of not in (None, 1):
        raise RequestError(400, "best_of must be 1", param="best_of")
    try:
        ids = session.prompt_ids(req.prompt_text())
    except UsageError as e:
        raise RequestError(400, str(e), param="prompt") from None
    _check_context(ids, session.n_ctx)
    return Plan(ids, _params(req, req.max_tokens or 16, len(ids), session.n_ctx))


def finish_reason(ev: GenerationEvent | None, calls: list[ParsedCall]) -> str:
    """OpenAI's finish_reason for the engine's: stop, length or tool_calls."""
    if calls:
        return "tool_calls"
    if ev is None:
        return "stop"
    if ev.finish_reason in (FINISH_LENGTH, FINISH_CONTEXT):
        return "length"
    return "stop"


@dataclass(frozen=True)
class Thought:
    """A piece of the reply's reasoning (``reasoning_content`` in a chat message and its stream deltas)."""

    text: str


@dataclass
class Answer:
    """One generation's running state: text so far, tool calls, the last event, timing."""

    kind: str  # "chat" | "completion"
    model: str
    n_prompt_tokens: int
    parse_tools: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    reasoning: str = ""
    last: GenerationEvent | None = None
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    ended_at: float | None = None

    def __post_init__(self):
        self.parser = ToolCallParser() if self.parse_tools else None
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id

    def feed(self, ev: GenerationEvent) -> list[str | ParsedCall | Thought]:
        """The event's new pieces: its reasoning, then its content (text, or parsed calls when tools are in play)."""
        self.last = ev
        self.ended_at = time.perf_counter()
        pieces: list = [Thought(ev.reasoning)] if ev.reasoning else []
        self.reasoning += ev.reasoning
        pieces += self.parser.feed(ev.text) if self.parser else ([ev.text] if ev.text else [])
        for name, arguments in ev.calls:  # a harmony model's calls (engine.generate.reasoning)
            if self.parser:
                pieces.append(self.parser.add(name, arguments))
            elif arguments:  # no tools were offered: what the model wrote stays visible, as content
                pieces.append(arguments)
        if ev.done and self.parser:
            pieces += self.parser.flush()
        for p in pieces:
            if isinstance(p, str):
                self.text += p
        return pieces

    @property
    def calls(self) -> list[ParsedCall]:
        return self.parser.calls if self.parser else []

    @property
    def cancelled(self) -> bool:
        return self.last is not None and self.last.finish_reason == FINISH_CANCELLED

    def usage(self) -> dict:
        n = self.last.n_generated if self.last else 0
        cached = self.n_prompt_tokens - (self.last.n_prompt if self.last else 0)
        return {
            "prompt_tokens": self.n_prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.n_prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": max(0, cached)},
        }

    def timings(self) -> dict:
        ev = self.last
        start = self.started_at or self.queued_at
        total_ms = ((self.ended_at or start) - self.queued_at) * 1000
        if ev is None:
            return {"queue_ms": (start - self.queued_at) * 1000, "total_ms": total_ms}
        prompt_ms = ev.n_prompt / ev.prompt_tok_s * 1000 if ev.prompt_tok_s > 0 else 0.0
        decode_ms = (ev.n_generated - 1) / ev.decode_tok_s * 1000 if ev.decode_tok_s > 0 else 0.0
        return {
            "queue_ms": (start - self.queued_at) * 1000,
            "cache_n": max(0, self.n_prompt_tokens - ev.n_prompt),
            "prompt_n": ev.n_prompt,
            "prompt_ms": prompt_ms,
            "prompt_per_second": ev.prompt_tok_s,
            "ttft_ms": ev.ttft_s * 1000,
            "predicted_n": ev.n_generated,
            "predicted_ms": decode_ms,
            "predicted_per_second": ev.decode_tok_s,
            "total_ms": total_ms,
        }

    # -- whole responses -----------------------------------------------------------------------
    def response(self) -> dict:
        reason = finish_reason(self.last, self.calls)
        if self.kind == "chat":
            msg: dict = {"role": "assistant", "content": self.text if (self.text or not self.calls) else None}
            if self.reasoning:
                msg["reasoning_content"] = self.reasoning
            if self.calls:
                msg["tool_calls"] = [c.to_openai() for c in self.calls]
            choice = {"index": 0, "message": msg, "finish_reason": reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        return self._envelope(obj, [choice], usage=self.usage(), timings=self.timings())

    # -- stream chunks -------------------------------------------------------------------------
    def _chunk(self, choices: list, **extra) -> dict:
        return self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", choices, **extra)

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        """A response object or stream chunk: id, object, created, model, fingerprint, choices, then ``extra``."""
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "sharpi",
            "choices": choices,
            **extra,
        }

    def first_chunk(self) -> dict | None:
        if self.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def piece_chunk(self, piece: str | ParsedCall | Thought) -> dict:
        if self.kind != "chat":
            text = piece.text if isinstance(piece, Thought) else piece
            return self._chunk([{"index": 0, "text": text, "finish_reason": None, "logprobs": None}])
        if isinstance(piece, Thought):
            delta = {"reasoning_content": piece.text}
        elif isinstance(piece, ParsedCall):
            delta = {"tool_calls": [piece.to_openai(index=self.calls.index(piece))]}
        else:
            delta = {"content": piece}
        return self._chunk([{"index": 0, "delta": delta, "finish_reason": None}])

    def final_chunk(self) -> dict:
        reason = finish_reason(self.last, self.calls)
        if self.kind == "chat":
            choice = {"index": 0, "delta": {}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "finish_reason": reason, "logprobs": None}
        return self._chunk([choice], usage=self.usage(), timings=self.timings())

    def usage_chunk(self) -> dict:
        return self._chunk([], usage=self.usage())
