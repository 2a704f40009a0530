"""Markdown to the HTML a QTextBrowser shows, with Python names kept as written.

CommonMark (markdown-it-py, the maintained port of markdown-it) reads ``__import__()`` as a bold
"import" and ``__globals__`` as a bold "globals"; a Python assistant writes such names constantly.
One inline rule, run before emphasis, takes a dunder name (``__name__``: two underscores, a Python
identifier, two underscores, at the start of a word) as plain text. Everything else is CommonMark
with tables and strikethrough; raw HTML in the text is shown as text, never interpreted.

    to_html("Call `__import__()` or __import__('os')")  # both keep their underscores
"""

from __future__ import annotations

import re

from markdown_it import MarkdownIt
from markdown_it.rules_inline import StateInline

_DUNDER = re.compile(r"__[A-Za-z_][A-Za-z0-9_]*?__(?![A-Za-z0-9_])")
_WORD = re.compile(r"[A-Za-z0-9_]")


def _python_name(state: StateInline, silent: bool) -> bool:
    """A dunder name at ``state.pos`` becomes one text token (emphasis never sees its underscores)."""
    pos = state.pos
    if state.src[pos] != "_" or (pos > 0 and _WORD.match(state.src[pos - 1])):
        return False
    m = _DUNDER.match(state.src, pos)
    if m is None:
        return False
    if not silent:
        state.push("text", "", 0).content = m.group(0)
    state.pos = m.end()
    return True


def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
    md.enable(["table", "strikethrough"])
    md.inline.ruler.before("emphasis", "python_name", _python_name)
    return md


_MD = _parser()


def to_html(text: str) -> str:
    """``text`` (Markdown) as HTML for a QTextBrowser."""
    return _MD.render(text)
