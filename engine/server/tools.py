"""Tool calls in generated text, parsed back into OpenAI ``tool_calls`` (Qwen3's / Hermes' format; gpt-oss's
harmony calls are found by the reasoning splitter, engine.generate.reasoning, and arrive as
``GenerationEvent.calls``).

Qwen3's chat template asks the model to answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallParser` reads streamed text, passes through what is plain content, holds back what
may be the start of ``<tool_call>``, and yields each complete call as a :class:`ParsedCall`. A block
whose body is not a JSON object with a string ``name`` stays content (the client sees what the
model wrote rather than nothing).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def parse_call(body: str) -> ParsedCall | None:
    """The call a ``<tool_call>`` block's body holds, or None if it is not one."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return new_call(obj["name"], args_text)


def new_call(name: str, arguments: str) -> ParsedCall:
    """A call with a fresh id (``arguments``: JSON text as the model wrote it; a harmony model's come whole)."""
    return ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments)


class ToolCallParser:
    """Streamed text -> content pieces and parsed calls. ``feed`` then, at the end, ``flush``."""

    def __init__(self):
        self._buf = ""
        self._inside = False
        self.calls: list[ParsedCall] = []

    def add(self, name: str, arguments: str) -> ParsedCall:
        """A call found outside the text (a harmony model's, from the reasoning splitter), kept with the parsed ones."""
        call = new_call(name, arguments)
        self.calls.append(call)
        return call

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._buf += text
        out: list[str | ParsedCall] = []
        while True:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i < 0:
                    hold = _partial_suffix(self._buf, OPEN)
                    safe = self._buf[: len(self._buf) - hold]
                    if safe:
                        out.append(safe)
                    self._buf = self._buf[len(safe) :]
                    return out
                if i:
                    out.append(self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(CLOSE) :]
                self._inside = False
                call = parse_call(body.strip())
                if call is None:
                    out.append(OPEN + body + CLOSE)
                else:
                    self.calls.append(call)
                    out.append(call)

    def flush(self) -> list[str | ParsedCall]:
        """What is left when generation ends: an unclosed block is parsed if its body is complete JSON."""
        rest, inside = self._buf, self._inside
        self._buf, self._inside = "", False
        if not rest and not inside:
            return []
        if inside:
            call = parse_call(rest.strip())
            if call is not None:
                self.calls.append(call)
                return [call]
            return [OPEN + rest]
        return [rest]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_content(text: str) -> tuple[str, list[ParsedCall]]:
    """Whole generated text -> (content without the call blocks, the calls)."""
    p = ToolCallParser()
    pieces = p.feed(text) + p.flush()
    content = "".join(x for x in pieces if isinstance(x, str))
    return content, p.calls
