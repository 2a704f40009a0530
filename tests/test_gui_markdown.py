"""Replies render as Markdown without eating Python's dunder names (``__import__()``, ``__globals__``)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QUrl  # noqa: E402
from PySide6.QtGui import QGuiApplication  # noqa: E402

from sharpi_gui.markdown import code_blocks, to_html  # noqa: E402
from sharpi_gui.theme import LIGHT  # noqa: E402
from sharpi_gui.views.transcript import MessageWidget  # noqa: E402

REPLY = (
    "Call __import__() to import by name; a function's __globals__ is its module's namespace.\n\n"
    "In a span: `__import__('os')`. **Bold** and *italic* still work, snake_case_names too.\n\n"
    "```python\nprint(__name__)\n```\n"
)


def test_dunder_names_are_text_not_emphasis():
    html = to_html("__import__() and __globals__ and x.__dict__")
    assert "<strong>" not in html and "<em>" not in html
    assert "__import__()" in html and "__globals__" in html and "x.__dict__" in html
    assert "<strong>bold</strong>" in to_html("**bold**") and "<em>it</em>" in to_html("_it_")
    assert "&lt;b&gt;" in to_html("<b>raw html</b>")  # shown as text, never interpreted


def test_reply_bubble_shows_python_names_literally(qtbot):
    w = MessageWidget("assistant", REPLY, {}, LIGHT)
    qtbot.addWidget(w)
    text = w.body.toPlainText()
    for name in ("__import__()", "__globals__", "__import__('os')", "print(__name__)", "snake_case_names"):
        assert name in text, name
    assert "**" not in text  # the real emphasis is rendered, not shown as markup
    doc = w.body.document()
    bold = [b.text() for b in _fragments(doc) if b.charFormat().fontWeight() >= 700]
    assert "Bold" in bold and not any("import" in b for b in bold)


def test_code_blocks_are_highlighted_and_each_has_a_copy_link(qtbot):
    text = REPLY + "\n```bash\necho __x__ | grep x\n```\n\n```nosuchlanguage\na = 1\n```\n"
    html = to_html(text)
    assert code_blocks(text) == ["print(__name__)\n", "echo __x__ | grep x\n", "a = 1\n"]
    for n in range(3):
        assert f'href="copy-code:{n}">Copy code</a>' in html
    assert '<span style="color: #008000">print</span>' in html  # Pygments' inline colours, Python's builtin
    assert "language-bash" in html and "language-text" in html  # an unknown language is plain text
    w = MessageWidget("assistant", text, {}, LIGHT)
    qtbot.addWidget(w)
    colours = {f.charFormat().foreground().color().name() for f in _fragments(w.body.document()) if "print" in f.text()}
    assert "#008000" in colours  # the bubble shows the colours, not only the HTML
    w.body.anchorClicked.emit(QUrl("copy-code:1"))
    assert QGuiApplication.clipboard().text() == "echo __x__ | grep x\n"
    w.body.anchorClicked.emit(QUrl("copy-code:0"))
    assert QGuiApplication.clipboard().text() == "print(__name__)\n"
    assert "Copy code" in w.body.toPlainText()


def _fragments(doc):
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            yield it.fragment()
            it += 1
        block = block.next()
