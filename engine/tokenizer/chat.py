"""Chat templates: the model's own ``tokenizer.chat_template`` rendered with jinja2, as transformers does.

The template runs in an ``ImmutableSandboxedEnvironment`` (``trim_blocks``, ``lstrip_blocks``,
loop controls) with the usual globals: ``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII text and takes ``indent`` (as transformers'), ``bos_token``, ``eos_token``,
``messages``, ``tools``, ``add_generation_prompt``, plus any keyword the caller passes (Qwen3's
``enable_thinking``). A file without a template gets ChatML, and says so (:attr:`from_file`).
A template that does not compile or fails while rendering raises :class:`ChatTemplateError`
when it is used; loading the model still succeeds.

A template is code from the file, so rendering runs under limits (:class:`RenderLimits`: 2 s and 1 MiB of
output by default): a check compiled into the start of every block of the template (each loop iteration,
macro call and branch) stops a render that overruns its time or whose ``cancel`` event is set (so even a
loop that calls nothing stops); operations that could build a huge value in one C call (``'x' * 10**9``, ``[1] * 10**9``,
``10 ** 10**9``, ``tojson(indent=10**8)``, ``center``/``indent``/``replace`` blowing a string up) are
refused before they run; the output is streamed and cut at the size limit. Every failure — a sandbox
violation, a compile error, memory, recursion, overflow, the limits — is a :class:`ChatTemplateError`
with a short reason.

As llama.cpp's ``common_chat_templates_apply`` does, a rendered prompt loses a leading BOS text
when the tokenizer adds BOS itself (and a trailing EOS text when it adds EOS), so encoding the
prompt does not double them.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ChatTemplateError
from engine.gguf import keys

log = logging.getLogger(__name__)

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Gemma's turn format, for a Gemma file without a template: a system message goes before the first user turn's
# text, the assistant speaks as "model" (Google's Gemma 3 template without its image handling).
GEMMA_TURNS = (
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = ns.system + message['content'] + '\n\n' %}"
    "{%- else %}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- if message['role'] == 'user' %}{{- ns.system }}{%- set ns.system = '' %}{%- endif %}"
    "{{- message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
# The format that stands in for a missing template, per architecture (ChatML for the others).
DEFAULT_TEMPLATES = {"gemma3": GEMMA_TURNS}


USER_TEXT_ROLES = ("user", "system", "tool")  # whose content is text, never control tokens


def _align(marked: str, flags: list[bool], plain: str) -> list[bool] | None:
    """Each character of ``plain`` -> the flag of the character of ``marked`` it matches (greedy, left to
    right); None when ``plain`` is not a subsequence of ``marked``."""
    out, i = [], 0
    for c in plain:
        while i < len(marked) and marked[i] != c:
            i += 1
        if i == len(marked):
            return None
        out.append(flags[i])
        i += 1
    return out


def _runs(mask: list[bool]) -> tuple[tuple[int, int], ...]:
    """The (start, end) ranges where ``mask`` is True."""
    spans, begin = [], None
    for i, m in enumerate(mask):
        if m and begin is None:
            begin = i
        elif not m and begin is not None:
            spans.append((begin, i))
            begin = None
    if begin is not None:
        spans.append((begin, len(mask)))
    return tuple(spans)


class _TemplateRaised(Exception):
    """``raise_exception(msg)`` inside a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class RenderLimits:
    """What one render may take: ``seconds`` of wall time, ``max_chars`` of output (and of any one string
    or list it builds)."""

    seconds: float = 2.0
    max_chars: int = 1 << 20


class _Interrupted(BaseException):
    """Raised in the template's code by :class:`_Guard` (a BaseException: no ``except Exception`` in
    jinja2's runtime swallows it)."""


class _OverLimit(SecurityError):
    """A render refused for what it would build (over :attr:`RenderLimits.max_chars`, a huge number)."""


_limits = threading.local()  # .guard: the _Guard of the render running on this thread (None between renders)
_DEFAULT_MAX = RenderLimits().max_chars


def _max_chars() -> int:
    g = getattr(_limits, "guard", None)
    return g.max_chars if g is not None else _DEFAULT_MAX


def _too_big(n: int, what: str) -> None:
    if n > _max_chars():
        raise _OverLimit(f"{what} of {n} items is over the template's limit of {_max_chars()}")


_SIZED = (str, list, tuple)


def _length(x) -> int | None:
    return len(x) if isinstance(x, _SIZED) else None


class _TickingCodeGenerator(CodeGenerator):
    """jinja2's code generator with ``environment.tick()`` at the start of every block."""

    def blockvisit(self, nodes, frame) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(nodes, frame)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    if indent is not None and (not isinstance(indent, (int, str)) or isinstance(indent, int) and indent > 64):
        raise _OverLimit(f"tojson indent {indent!r} is over the limit of 64")
    out = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    _too_big(len(out), "a tojson result")
    return out


def _checked_filter(f, size):
    """Filter ``f`` refused when ``size(args)`` (its result's size at most) is over the limit."""

    def run(*args, **kwargs):
        _too_big(size(*args, **kwargs), f"the result of {f.__name__}")
        return f(*args, **kwargs)

    return run


def _num(x) -> int:
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) < 1e18 else 0


# str methods whose result can be far larger than their inputs: the result's size at most
_STR_GROWTH = {
    "center": lambda s, w=0, *a: max(len(s), _num(w)),
    "ljust": lambda s, w=0, *a: max(len(s), _num(w)),
    "rjust": lambda s, w=0, *a: max(len(s), _num(w)),
    "zfill": lambda s, w=0, *a: max(len(s), _num(w)),
    "expandtabs": lambda s, t=8, *a: len(s) * max(1, _num(t)),
    "replace": lambda s, old="", new="", *a: len(s) + (len(s) + 1) * len(str(new)),
    "format": lambda s, *a, **k: len(s) + sum(len(str(x)) for x in (*a, *k.values()) if isinstance(x, str)),
}


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, refusing one-step blow-ups (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _TickingCodeGenerator

    @staticmethod
    def tick() -> None:
        g = getattr(_limits, "guard", None)
        if g is None:  # rendered outside ChatTemplate.render: no limits to keep
            return
        g.n += 1
        if not g.n & 63:
            g.check()

    def call_binop(self, context, operator, left, right):
        if operator == "+":  # the common one first: string concatenation in every template
            if isinstance(left, _SIZED) and isinstance(right, _SIZED) and len(left) + len(right) > _max_chars():
                _too_big(len(left) + len(right), "a joined string or list")
            return left + right
        if operator == "**":
            ints = isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
            if ints and right * abs(left).bit_length() > 1 << 16:
                raise _OverLimit(f"{left} ** {right} is too large a number")
        elif operator == "*":
            for a, b in ((left, right), (right, left)):
                if _length(a) is not None and isinstance(b, int):
                    _too_big(len(a) * max(0, b), "a repeated string or list")
        elif operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            _too_big(len(left) + sum(_num(a) + (_length(a) or 0) for a in args), "a %-formatted string")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in _STR_GROWTH:
            _too_big(_STR_GROWTH[__obj.__name__](owner, *args, **kwargs), f"the result of str.{__obj.__name__}")
        if getattr(__obj, "__name__", "") == "join" and isinstance(owner, str) and args:
            items = list(args[0])
            _too_big(sum(len(str(x)) for x in items) + len(owner) * len(items), "the result of str.join")
            args = (items, *args[1:])
        return super().call(__context, __obj, *args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    f = env.filters
    f["indent"] = _checked_filter(f["indent"], lambda s, width=4, *a, **k: len(str(s)) * (1 + max(0, _num(width))))
    f["center"] = _checked_filter(f["center"], lambda s, width=80: max(len(str(s)), _num(width)))
    f["replace"] = _checked_filter(
        f["replace"], lambda ev, s, old, new, *a: len(str(s)) + (len(str(s)) + 1) * len(str(new))
    )
    f["wordwrap"] = _checked_filter(f["wordwrap"], lambda ev, s, *a, **k: 2 * len(str(s)) + 2)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, tojson=_tojson)
    return env


class _Guard:
    """The limits of the render running on this thread: :meth:`_LimitedEnvironment.tick` — compiled into
    the start of every block of the template (each loop iteration, each macro call, each branch taken) —
    checks the clock and the ``cancel`` event every 64 ticks and raises :class:`_Interrupted` in the
    template's own code, so even a loop that calls nothing stops."""

    def __init__(self, limits: RenderLimits, cancel: threading.Event | None):
        self.deadline = time.monotonic() + limits.seconds
        self.max_chars = limits.max_chars
        self.cancel = cancel
        self.n = 0
        self.reason: str | None = None

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            self.reason = "cancelled"
        elif time.monotonic() > self.deadline:
            self.reason = "timeout"
        if self.reason:
            raise _Interrupted

    def __enter__(self) -> _Guard:
        _limits.guard = self
        return self

    def __exit__(self, *exc) -> None:
        _limits.guard = None


def _special_texts(tokenizer) -> dict:
    """``bos_token``/``eos_token`` texts and whether the tokenizer adds BOS/EOS itself (nothing without one)."""
    if tokenizer is None:
        return {}
    return {
        "bos_token": tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
        "eos_token": tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
        "strip_bos": tokenizer.add_bos,
        "strip_eos": tokenizer.vocab.add_eos,
    }


class ChatTemplate:
    """A compiled chat template. ``render(messages)`` -> the prompt text (specials written out)."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        from_file: bool = True,
        strip_bos: bool = False,
        strip_eos: bool = False,
    ):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.from_file = from_file  # False: the file had no template and ChatML stands in
        self.strip_bos = strip_bos  # drop a leading bos_token from the result (the tokenizer adds BOS)
        self.strip_eos = strip_eos  # drop a trailing eos_token (the tokenizer adds EOS)
        self.error: str | None = None  # why the template cannot be used (reported when rendering)
        self.limits = RenderLimits()
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            self._template = None
            self.error = f"the chat template does not compile (line {e.lineno}: {e.message})"
            log.warning("%s", self.error)
        except (RecursionError, MemoryError, ValueError, OverflowError) as e:  # a pathological source
            self._template = None
            self.error = f"the chat template does not compile ({type(e).__name__})"
            log.warning("%s", self.error)

    @classmethod
    def from_gguf(cls, gf, tokenizer=None) -> ChatTemplate:
        """The file's ``tokenizer.chat_template``, or (with a warning) when it has none its architecture's standard
        format (:data:`DEFAULT_TEMPLATES`) or ChatML.

        ``tokenizer`` supplies ``bos_token``/``eos_token`` text and whether it adds BOS/EOS
        itself; without one the texts are "" and nothing is stripped.
        """
        source = gf.metadata.get(keys.CHAT_TEMPLATE)
        opts = _special_texts(tokenizer)
        if not isinstance(source, str) or not source.strip():
            arch = getattr(gf, "architecture", None)
            fallback = DEFAULT_TEMPLATES.get(arch) if isinstance(arch, str) else None
            name = f"{arch}'s standard turn format" if fallback else "ChatML"
            log.warning("%s has no chat template; using %s", getattr(gf, "path", "the model"), name)
            return cls(fallback or CHATML, from_file=False, **opts)
        return cls(source, from_file=True, **opts)

    @classmethod
    def chatml(cls, tokenizer=None) -> ChatTemplate:
        """ChatML, chosen explicitly in place of a model's template that fails (``from_file`` False)."""
        return cls(CHATML, from_file=False, **_special_texts(tokenizer))

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        *,
        cancel: threading.Event | None = None,
        limits: RenderLimits | None = None,
        **extra,
    ) -> str:
        """The prompt for ``messages`` (dicts with ``role`` and ``content``, as transformers takes them).

        ``extra`` keywords become template variables (``enable_thinking=False`` for Qwen3). ``cancel``: an
        event that stops the render when set (:class:`RenderCancelled`); ``limits``: default
        :attr:`limits`. Raises :class:`ChatTemplateError` naming what went wrong.
        """
        if self._template is None:
            raise ChatTemplateError(self.error or "the chat template is unusable")
        context = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        out = self._render_limited(context, limits or self.limits, cancel)
        if self.strip_bos and self.bos_token and out.startswith(self.bos_token):
            out = out[len(self.bos_token) :]
        if self.strip_eos and self.eos_token and out.endswith(self.eos_token):
            out = out[: -len(self.eos_token)]
        return out

    def render_with_spans(
        self, messages: list[dict], add_generation_prompt: bool = True, **kw
    ) -> tuple[str, tuple[tuple[int, int], ...]]:
        """(:meth:`render`'s prompt, the ``(start, end)`` character ranges in it that came from the content
        of user, system and tool messages): the tokenizer parses no control tokens there
        (``Tokenizer.encode(plain_spans=...)``), so ``<|im_end|>`` typed by a user stays text.

        The template is rendered a second time with each such content between two random markers; the
        markers' places give the ranges. A template that trims or edits the content shifts text between
        them: the marked render, markers removed, is aligned with the plain one character by character
        (the plain one a subsequence of it). A template that reorders or rewrites content so that no
        alignment exists gets no ranges, with a warning."""
        plain = self.render(messages, add_generation_prompt, **kw)
        nonce = secrets.token_hex(8)
        start, end = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        marked_msgs = [
            {**m, "content": start + m["content"] + end}
            if isinstance(m, dict) and m.get("role") in USER_TEXT_ROLES and isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        try:
            marked = self.render(marked_msgs, add_generation_prompt, **kw)
        except RenderCancelled:
            raise
        except ChatTemplateError:  # it failed only on the markers (a length check, ...): no ranges
            marked = ""
        text, flags, inside, ok = [], [], False, bool(marked)
        for piece in re.split(f"({re.escape(start)}|{re.escape(end)})", marked):
            if piece in (start, end):
                ok = ok and inside == (piece == end)
                inside = piece == start
            elif piece:
                text.append(piece)
                flags.append(inside)
        ok = ok and not inside
        if ok and "".join(text) == plain:  # the template used the content as given: the pieces' offsets
            spans, at = [], 0
            for t, f in zip(text, flags):
                if f:
                    spans.append((at, at + len(t)))
                at += len(t)
            return plain, tuple(spans)
        if ok:
            mask = _align("".join(text), [f for t, f in zip(text, flags) for _ in t], plain)
            if mask is not None:
                return plain, _runs(mask)
        if any(m.get("role") in USER_TEXT_ROLES for m in messages if isinstance(m, dict)):
            log.warning("the chat template rewrites message content: control tokens in it will be parsed")
        return plain, ()

    def _render_limited(self, context: dict, limits: RenderLimits, cancel: threading.Event | None) -> str:
        """Stream the template's output under ``limits`` and ``cancel`` (see the module docstring)."""
        parts: list[str] = []
        guard = _Guard(limits, cancel)
        try:
            with guard:
                n = 0
                for chunk in self._template.generate(**context):
                    n += len(chunk)
                    if n > limits.max_chars:
                        raise _OverLimit(f"the output is over the limit of {limits.max_chars} characters")
                    parts.append(chunk)
        except _Interrupted:
            if guard.reason == "cancelled":
                raise RenderCancelled("the chat template's rendering was cancelled") from None
            raise ChatTemplateError(f"the chat template ran past its time limit ({limits.seconds:g} s)") from None
        except _TemplateRaised as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from None
        except _OverLimit as e:
            raise ChatTemplateError(f"the chat template was stopped: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        except RecursionError:
            raise ChatTemplateError("the chat template failed: it recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError("the chat template failed: it ran out of memory") from None
        except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        return "".join(parts)


class RenderCancelled(ChatTemplateError):
    """The render was stopped by its ``cancel`` event (a Stop, not a broken template)."""
