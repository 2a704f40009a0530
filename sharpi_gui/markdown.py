"""Markdown to the HTML a QTextBrowser shows, with Python names kept as written.

CommonMark (markdown-it-py, the maintained port of markdown-it) reads ``__import__()`` as a bold
"import" and ``__globals__`` as a bold "globals"; a Python assistant writes such names constantly.
One inline rule, run before emphasis, takes a dunder name (``__name__``: two underscores, a Python
identifier, two underscores, at the start of a word) as plain text. Everything else is CommonMark
with tables and strikethrough; raw HTML in the text is shown as text, never interpreted.

Code blocks are syntax-highlighted by Pygments (inline colours, which a QTextBrowser shows; the fence's
language; Python, the assistant's usual language, when the fence names none) and each has a
"Copy code" link above it: ``copy-code:N`` for the N-th block, whose text :func:`code_blocks` gives.

    to_html("Call `__import__()` or __import__('os')")  # both keep their underscores
"""

from __future__ import annotations

import html
import re

from markdown_it import MarkdownIt
from markdown_it.rules_inline import StateInline
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer, TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

COPY_SCHEME = "copy-code"  # the links above code blocks: copy-code:N copies code_blocks(text)[N]
_FORMATTER = HtmlFormatter(nowrap=True, noclasses=True, style="default")

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


def _lexer(info: str):
    """The fence's language; Python when it names none; plain text when Pygments does not know it."""
    if not info.strip():
        return PythonLexer()
    try:
        return get_lexer_by_name(info.strip().split(maxsplit=1)[0])
    except ClassNotFound:
        return TextLexer()


def _fence(_renderer, tokens, idx, _options, _env) -> str:
    """A code block: its "Copy code" link, then the code highlighted in inline colours."""
    token = tokens[idx]
    n = sum(1 for t in tokens[:idx] if t.type in ("fence", "code_block"))
    lexer = PythonLexer() if token.type == "code_block" else _lexer(token.info)
    code = highlight(token.content, lexer, _FORMATTER)
    return (
        f'<p class="copy-code"><a href="{COPY_SCHEME}:{n}">Copy code</a></p>'
        f'<pre><code class="language-{html.escape(lexer.aliases[0] if lexer.aliases else "text")}">'
        f"{code}</code></pre>\n"
    )


def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
    md.enable(["table", "strikethrough"])
    md.inline.ruler.before("emphasis", "python_name", _python_name)
    md.add_render_rule("fence", _fence)
    md.add_render_rule("code_block", _fence)
    return md


_MD = _parser()


def to_html(text: str) -> str:
    """``text`` (Markdown) as HTML for a QTextBrowser."""
    return _MD.render(text)


def code_blocks(text: str) -> list[str]:
    """The code blocks of ``text`` (Markdown), as written, in the order :func:`to_html` numbers them."""
    return [t.content for t in _MD.parse(text) if t.type in ("fence", "code_block")]
