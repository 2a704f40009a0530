"""Reasoning kept apart from the answer: a streaming splitter over the generated text.

Two formats, as models write them:

- ``think`` (Qwen3, Qwen3.5, QwQ, DeepSeek-R1 distills): ``<think> reasoning </think> answer``. The markers are
  special tokens in those vocabularies (rendered as their text by the detokenizer) or plain text; either way
  they are found in the text. A template whose generation prompt ends inside ``<think>`` (QwQ, the thinking
  Qwen3 2507 files) starts the reply in the reasoning: :func:`start_state` reads the prompt's end.
- ``harmony`` (gpt-oss): messages ``<|start|>assistant<|channel|>analysis<|message|> … <|end|>`` and
  ``<|start|>assistant<|channel|>final<|message|> … <|return|>``. The ``analysis`` channel is reasoning; every
  other channel (``final``, ``commentary``) is answer. ``<|return|>`` and ``<|call|>`` end the turn (they are
  end-of-generation tokens of a harmony vocabulary; written as text they end it here). A message whose header
  names a recipient (``…<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{…}<|call|>``,
  or ``to=`` before the channel) is a tool call: its body is neither reasoning nor answer but the call's
  arguments, given as :attr:`Split.calls` (name without the ``functions.`` namespace, the body as written).

Rules that keep hostile streams safe (:class:`ReasoningSplitter`): a marker may arrive split over any number of
pieces (a suffix that could still become one is held back, as :class:`~engine.generate.loop.StopMatcher` holds
stop strings); only the first ``<think>`` before any answer text opens the reasoning, and the first
``</think>`` closes it — any other marker is text of the part it occurs in (nested or duplicated markers are
never dropped); whitespace right after an opening or closing marker is dropped. A harmony header longer than
:data:`MAX_HEADER` characters or holding a line break is not a header: it is answer text. At the end of the
stream (:meth:`~ReasoningSplitter.flush`) what is held goes to the part it was in; an unterminated reasoning
stays reasoning. Nothing but markers and that whitespace is ever left out.

``only_calls`` (harmony, a model whose reasoning is not to be kept apart but whose tool calls are read): the
call messages (header and body) are taken out as :attr:`Split.calls`; every other text, markers and whitespace
included, is answer as written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

THINK = "think"
HARMONY = "harmony"
FORMATS = (THINK, HARMONY)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_END, H_RETURN, H_CALL = "<|end|>", "<|return|>", "<|call|>"
H_TURN_ENDS = (H_RETURN, H_CALL)
HARMONY_TOKENS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_RETURN, H_CALL)
ANALYSIS = "analysis"
MAX_HEADER = 256  # characters of a harmony header at most (``assistant<|channel|>commentary to=… <|constrain|>json``)

# parts of a reply
REASONING, ANSWER, CALLS = "reasoning", "answer", "calls"


@dataclass(frozen=True)
class Split:
    """What one piece of text adds: ``reasoning`` and ``answer`` text; ``ended``: the turn is over (harmony's
    ``<|return|>``/``<|call|>`` written as text; what follows it is dropped); ``calls``: the tool calls whose
    message ended here, (name, arguments text)."""

    reasoning: str = ""
    answer: str = ""
    ended: bool = False
    calls: tuple[tuple[str, str], ...] = ()


def detect_format(arch: str | None, template: str | None, has_token: Callable[[str], bool]) -> str | None:
    """The reasoning format of a model: ``harmony`` for gpt-oss (its architecture, or a vocabulary or template
    with harmony's channel markers), ``think`` where the vocabulary has ``<think>`` and ``</think>`` or the chat
    template writes them; else None. ``has_token(text)``: whether the vocabulary has that entry."""
    template = template if isinstance(template, str) else ""
    if arch == "gpt-oss" or (has_token(H_CHANNEL) and has_token(H_MESSAGE)) or H_CHANNEL in template:
        return HARMONY
    if (has_token(THINK_OPEN) and has_token(THINK_CLOSE)) or THINK_CLOSE in template:
        return THINK
    return None


def start_state(fmt: str, prompt_tail: str) -> tuple[str, str]:
    """Where a reply to a prompt ending in ``prompt_tail`` starts: (state, carried text) for
    :class:`ReasoningSplitter`. ``think``: in the reasoning when the prompt ends with an open ``<think>``.
    ``harmony``: inside a message body when the prompt's last message header is complete (``…<|message|>``),
    else in a header (the prompt's ``<|start|>assistant``, or nothing yet)."""
    if fmt == THINK:
        tail = prompt_tail.rstrip()
        return ("reasoning" if tail.endswith(THINK_OPEN) else "start"), ""
    start = prompt_tail.rfind(H_START)
    msg = prompt_tail.rfind(H_MESSAGE)
    end = max(prompt_tail.rfind(m) for m in (H_END, *H_TURN_ENDS))
    if msg > max(start, end):
        return "body:" + _channel(prompt_tail[max(start, 0) : msg]), ""
    return "header", ""


def _channel(header: str) -> str:
    """The channel a harmony header names ("" when none)."""
    at = header.find(H_CHANNEL)
    if at < 0:
        return ""
    rest = header[at + len(H_CHANNEL) :]
    cut = len(rest)
    for stop in (" ", "<|", "\n"):
        i = rest.find(stop)
        if 0 <= i < cut:
            cut = i
    return rest[:cut]


def _recipient(header: str) -> str | None:
    """The tool a harmony header addresses (``to=functions.get_weather`` -> "get_weather"; another namespace's
    recipient is kept whole), None when it names none."""
    m = _TO.search(header)
    if m is None:
        return None
    name = m.group(1)
    return name[len("functions.") :] if name.startswith("functions.") and len(name) > len("functions.") else name


_TO = re.compile(r"(?:^|[\s>])to=([^\s<]+)")


def _markup(header: str) -> bool:
    """Whether held header text is harmony markup (``<|start|>assistant``, ``assistant<|channel|>…``, a part of
    one), not text a model wrote outside the format."""
    h = header.strip()
    return not h or h.startswith(("<|", "assistant<|")) or "assistant".startswith(h)


def _find(buf: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """(index, marker) of the earliest full marker in ``buf`` (longest first at one index); else (how much of
    ``buf`` is safe to emit: all but the longest suffix that begins a marker, None)."""
    best, which = -1, None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(which))):
            best, which = i, m
    if which is not None:
        return best, which
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), hold, -1):
            if buf.endswith(m[:k]):
                hold = k
                break
    return len(buf) - hold, None


class ReasoningSplitter:
    """Splits a reply's text, fed piece by piece, into reasoning and answer (see the module docstring).

    ``fmt``: :data:`THINK` or :data:`HARMONY`; ``state``: where the reply starts (:func:`start_state`);
    ``only_calls``: harmony's tool calls taken out, the rest answer as written."""

    def __init__(self, fmt: str, state: str | None = None, only_calls: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"unknown reasoning format {fmt!r} (known: {', '.join(FORMATS)})")
        if only_calls and fmt != HARMONY:
            raise ValueError("only_calls reads harmony's tool calls: the format must be harmony")
        self.fmt = fmt
        self.only_calls = only_calls
        self.state = state or ("start" if fmt == THINK else "header")
        self.buf = ""
        self.strip = self.state == "reasoning"  # drop whitespace at the start of the next part
        self.ended = False
        self.answer_started = False
        self._call: tuple[str, list[str]] | None = None  # the tool call being written: (name, body pieces)

    # -- the stream ------------------------------------------------------------------------------------
    def feed(self, text: str) -> Split:
        if self.ended:
            return Split(ended=True)
        self.buf += text
        out = {REASONING: [], ANSWER: [], CALLS: []}
        if self.fmt == THINK:
            self._think(out)
        else:
            self._harmony(out)
        return Split("".join(out[REASONING]), "".join(out[ANSWER]), self.ended, tuple(out[CALLS]))

    def flush(self) -> Split:
        """The end of the reply: what is held back goes to the part it was in (a tool call being written ends
        with it: a harmony vocabulary's ``<|call|>`` is an end-of-generation token, never fed as text)."""
        held, self.buf = self.buf, ""
        if self._call is not None:
            out = {CALLS: []}
            self._call[1].append(held)
            self._end_call(out)
            return Split(ended=self.ended, calls=tuple(out[CALLS]))
        if self.ended or not held:
            return Split(ended=self.ended)
        part = self._part()
        if self.state == "header":  # a partial header is markup; text that never became one is answer
            part = None if _markup(held) and not self.only_calls else ANSWER
        if part is None:
            return Split()
        if self.strip:
            held = held.lstrip()
        return Split(held, "") if part == REASONING else Split("", held)

    # -- think ------------------------------------------------------------------------------------------
    def _think(self, out) -> None:
        while self.buf:
            if self.state == "start":
                lead = self.buf.lstrip()
                if lead.startswith(THINK_OPEN):
                    self.buf = lead[len(THINK_OPEN) :]
                    self.state, self.strip = "reasoning", True
                    continue
                if not lead or THINK_OPEN.startswith(lead):
                    return  # whitespace, or the start of a marker: wait for more
                self.state = "answer"
                continue
            if self.state == "reasoning":
                i, m = _find(self.buf, (THINK_CLOSE,))
                self._emit(out, REASONING, self.buf[:i])
                if m is None:
                    self.buf = self.buf[i:]
                    return
                self.buf = self.buf[i + len(m) :]
                self.state, self.strip = "answer", True
                continue
            self._emit(out, ANSWER, self.buf)  # answer: the rest is answer, markers included
            self.buf = ""

    # -- harmony ----------------------------------------------------------------------------------------
    def _harmony(self, out) -> None:
        while self.buf and not self.ended:
            if self.state == "header":
                i, m = _find(self.buf, (H_MESSAGE, *H_TURN_ENDS))
                header = self.buf[:i] if m is not None else self.buf
                if m in H_TURN_ENDS:  # the turn ended without a message
                    if not _markup(header) or self.only_calls:
                        self._emit(out, ANSWER, header)
                    self.buf, self.ended = "", True
                    return
                if m is None:
                    if len(self.buf) > MAX_HEADER or "\n" in self.buf:  # not a header: answer text
                        self.state = "body:"
                        continue
                    return
                self.buf = self.buf[i + len(m) :]
                to = _recipient(header)
                if to is not None:  # a tool call: the body is its arguments
                    self._call = (to, [])
                elif self.only_calls:
                    self._emit(out, ANSWER, header + m)
                self.state, self.strip = "body:" + _channel(header), not self.only_calls
                continue
            part = self._part()
            i, m = _find(self.buf, (H_END, H_START, *H_TURN_ENDS))
            if self._call is not None:
                self._call[1].append(self.buf[:i])
            else:
                self._emit(out, part, self.buf[:i])
            if m is None:
                self.buf = self.buf[i:]
                return
            if self._call is not None:
                self._end_call(out)
            elif self.only_calls and m == H_END:
                self._emit(out, ANSWER, m)
            self.buf = self.buf[i:] if m == H_START else self.buf[i + len(m) :]
            if m in H_TURN_ENDS:
                self.buf, self.ended = "", True
                return
            self.state = "header"

    # -- helpers ----------------------------------------------------------------------------------------
    def _end_call(self, out) -> None:
        name, body = self._call
        self._call, self.strip = None, False
        out[CALLS].append((name, "".join(body).strip()))

    def _part(self) -> str | None:
        if self.state in ("start", "answer"):
            return ANSWER
        if self.state == "reasoning":
            return REASONING
        if self.state.startswith("body:"):
            return REASONING if self.state == "body:" + ANALYSIS and not self.only_calls else ANSWER
        return None  # a harmony header

    def _emit(self, out, part: str, text: str) -> None:
        if self.strip:
            text = text.lstrip()
            if not text:
                return
            self.strip = False
        if text:
            out[part].append(text)


def template_messages(messages: list[dict], fmt: str | None) -> list[dict]:
    """Chat messages as the model's template takes an earlier reply's reasoning: its ``reasoning_content``
    (the name Qwen3's template, llama.cpp's server and DeepSeek's API use) also as ``thinking`` for a harmony
    template (gpt-oss's name for it). The template decides what to keep: Qwen3's drops the reasoning of every
    reply before the last user message, gpt-oss's the analysis of every earlier turn, a template that knows
    neither name drops it all."""
    if fmt != HARMONY:
        return messages
    return [
        {**m, "thinking": m["reasoning_content"]}
        if m.get("role") == "assistant" and isinstance(m.get("reasoning_content"), str) and "thinking" not in m
        else m
        for m in messages
    ]


def model_format(option: str, detected: str | None) -> str | None:
    """The format a session uses: ``option`` (EngineOptions.reasoning) ``auto`` → ``detected`` (the model's own,
    :func:`detect_format`), ``off`` → None, a format's name → that format."""
    if option == "off":
        return None
    if option == "auto":
        return detected
    if option not in FORMATS:
        raise ValueError(f"unknown reasoning mode {option!r}")
    return option
