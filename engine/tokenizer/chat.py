"""Chat templates: the model's own ``tokenizer.chat_template`` rendered with jinja2, as transformers does.

The template runs in an ``ImmutableSandboxedEnvironment`` (``trim_blocks``, ``lstrip_blocks``,
loop controls) with the usual globals: ``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII text and takes ``indent`` (as transformers'), ``bos_token``, ``eos_token``,
``messages``, ``tools``, ``add_generation_prompt``, plus any keyword the caller passes (Qwen3's
``enable_thinking``). A file without a template gets ChatML, and says so (:attr:`from_file`).
A template that does not compile or fails while rendering raises :class:`ChatTemplateError`
when it is used; loading the model still succeeds.

As llama.cpp's ``common_chat_templates_apply`` does, a rendered prompt loses a leading BOS text
when the tokenizer adds BOS itself (and a trailing EOS text when it adds EOS), so encoding the
prompt does not double them.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
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


class _TemplateRaised(Exception):
    """``raise_exception(msg)`` inside a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, tojson=_tojson)
    return env


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
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            self._template = None
            self.error = f"the chat template does not compile (line {e.lineno}: {e.message})"
            log.warning("%s", self.error)

    @classmethod
    def from_gguf(cls, gf, tokenizer=None) -> ChatTemplate:
        """The file's ``tokenizer.chat_template``, or ChatML (with a warning) when it has none.

        ``tokenizer`` supplies ``bos_token``/``eos_token`` text and whether it adds BOS/EOS
        itself; without one the texts are "" and nothing is stripped.
        """
        source = gf.metadata.get(keys.CHAT_TEMPLATE)
        opts = {}
        if tokenizer is not None:
            opts = {
                "bos_token": tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
                "eos_token": tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
                "strip_bos": tokenizer.add_bos,
                "strip_eos": tokenizer.vocab.add_eos,
            }
        if not isinstance(source, str) or not source.strip():
            log.warning("%s has no chat template; using ChatML", getattr(gf, "path", "the model"))
            return cls(CHATML, from_file=False, **opts)
        return cls(source, from_file=True, **opts)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **extra
    ) -> str:
        """The prompt for ``messages`` (dicts with ``role`` and ``content``, as transformers takes them).

        ``extra`` keywords become template variables (``enable_thinking=False`` for Qwen3).
        Raises :class:`ChatTemplateError` naming what went wrong.
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
        try:
            out = self._template.render(**context)
        except _TemplateRaised as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        if self.strip_bos and self.bos_token and out.startswith(self.bos_token):
            out = out[len(self.bos_token) :]
        if self.strip_eos and self.eos_token and out.endswith(self.eos_token):
            out = out[: -len(self.eos_token)]
        return out
