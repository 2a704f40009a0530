"""The transcript: one markdown bubble per message, the streaming reply re-rendered at most ~30 Hz."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QTextOption
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui import data as D
from sharpi_gui.markdown import COPY_SCHEME, code_blocks, to_html
from sharpi_gui.theme import LIGHT, Theme

STREAM_RENDER_MS = 33
ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System", "notice": "SharpI", "info": "SharpI"}


class _MarkdownText(QTextBrowser):
    """A read-only markdown view as tall as its text (the transcript scrolls, not each bubble)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenLinks(False)  # links open in the browser (anchorClicked); copy-code links copy a block
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.viewport().setAutoFillBackground(False)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self.setFixedHeight(24)

    def _fit(self, *_):
        h = int(self.document().size().height()) + 4
        if h != self.height():
            self.setFixedHeight(h)

    def resizeEvent(self, e):
        super().resizeEvent(e)
        self._fit()


THINKING = "Thinking…"  # the reasoning's toggle while it streams
REASONING = "Reasoning"  # ... once the answer has started


class MessageWidget(QFrame):
    """One message: its role, its markdown text, and (for replies) the speed figures; for a stored
    message, Copy, Edit (questions) and the arrows between its alternatives (← 1/2 →). A reply's reasoning sits
    above its answer behind a toggle: open while it streams ("Thinking…"), closed once the answer starts (unless
    the user opened or closed it meanwhile) and for a stored reply."""

    def __init__(
        self,
        role: str,
        text: str,
        meta: dict | None,
        theme: Theme,
        parent: QWidget | None = None,
        mid: int | None = None,
        reasoning: str = "",
    ):
        super().__init__(parent)
        self.role = role
        self.mid = mid
        self.setObjectName("bubble")
        self.text = text
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 8, 12, 8)
        lay.setSpacing(2)
        self.header = QLabel(ROLE_NAMES.get(role, role))
        self.header.setObjectName("role")
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        head.addWidget(self.header)
        head.addStretch(1)

        def tool(text: str, tip: str) -> QToolButton:
            b = QToolButton(self)
            b.setText(text)
            b.setToolTip(tip)
            b.setAutoRaise(True)
            head.addWidget(b)
            return b

        self.prev_button = tool("←", "The previous alternative")
        self.branch_label = QLabel()
        self.branch_label.setObjectName("meta")
        head.addWidget(self.branch_label)
        self.next_button = tool("→", "The next alternative")
        self.edit_button = tool("Edit", "Edit this question and send it again (the old branch is kept)")
        self.copy_button = tool("Copy", "Copy this message")
        self.copy_button.clicked.connect(self.copy)
        self.edit_button.setVisible(role == "user" and mid is not None)
        self.copy_button.setVisible(role in ("user", "assistant"))
        self.set_branch(None)
        self.reasoning = ""
        self.thinking = False  # the reasoning is streaming and no answer has come yet
        self._user_toggled = False
        self.reasoning_toggle = QToolButton(self)
        self.reasoning_toggle.setObjectName("reasoning-toggle")
        self.reasoning_toggle.setAutoRaise(True)
        self.reasoning_toggle.setCheckable(True)
        self.reasoning_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.reasoning_toggle.clicked.connect(self._toggled_by_user)
        self.reasoning_view = _MarkdownText(self)
        self.reasoning_view.setObjectName("reasoning")
        self.body = _MarkdownText(self)
        self.body.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.body.customContextMenuRequested.connect(self._context_menu)
        self.body.anchorClicked.connect(self._link)
        self.footer = QLabel()
        self.footer.setObjectName("meta")
        lay.addLayout(head)
        lay.addWidget(self.reasoning_toggle, 0, Qt.AlignmentFlag.AlignLeft)
        lay.addWidget(self.reasoning_view)
        lay.addWidget(self.body)
        lay.addWidget(self.footer)
        self.set_reasoning(reasoning)
        self.set_text(text)
        self.set_meta(meta or {})
        self.restyle(theme)

    def set_reasoning(self, text: str, streaming: bool = False) -> None:
        """Show ``text`` as the reply's reasoning (hidden when empty); ``streaming``: it is still coming and no
        answer has started, so it shows open under "Thinking…"."""
        self.reasoning = text.strip()
        self.thinking = streaming
        has = bool(self.reasoning) or streaming
        self.reasoning_toggle.setVisible(has)
        if has:
            self.reasoning_view.setPlainText(self.reasoning)  # the model's notes, as written
            if not self._user_toggled:
                self.reasoning_toggle.setChecked(streaming)
        self._show_reasoning()

    def _toggled_by_user(self) -> None:
        self._user_toggled = True
        self._show_reasoning()

    def _show_reasoning(self) -> None:
        open_ = (bool(self.reasoning) or self.thinking) and self.reasoning_toggle.isChecked()
        arrow = "▾" if open_ else "▸"
        self.reasoning_toggle.setText(f"{arrow} {THINKING if self.thinking else REASONING}")
        self.reasoning_toggle.setToolTip("Hide the reasoning" if open_ else "Show the model's reasoning")
        self.reasoning_view.setVisible(open_ and bool(self.reasoning))

    @property
    def reasoning_open(self) -> bool:
        return self.reasoning_view.isVisibleTo(self)

    def set_text(self, text: str) -> None:
        self.text = text
        if self.role == "user":
            self.body.setPlainText(text)  # what the user typed, exactly
        else:
            self.body.setHtml(to_html(text))  # CommonMark, Python's __names__ kept (sharpi_gui.markdown)

    def set_branch(self, branch: D.Branch | None) -> None:
        """Show "← i/n →" when the message has alternatives."""
        many = branch is not None and branch.count > 1
        for w in (self.prev_button, self.branch_label, self.next_button):
            w.setVisible(many)
        if many:
            self.branch_label.setText(f"{branch.index + 1}/{branch.count}")
            self.prev_button.setEnabled(branch.index > 0)
            self.next_button.setEnabled(branch.index < branch.count - 1)

    def copy(self) -> None:
        """The whole message to the clipboard, as written (Markdown for replies)."""
        QGuiApplication.clipboard().setText(self.text)

    def copy_code(self, n: int) -> None:
        """The reply's ``n``-th code block to the clipboard, as written."""
        blocks = code_blocks(self.text)
        if 0 <= n < len(blocks):
            QGuiApplication.clipboard().setText(blocks[n])

    def _link(self, url: QUrl) -> None:
        if url.scheme() == COPY_SCHEME:
            self.copy_code(int(url.path()) if url.path().isdigit() else -1)
        else:
            QDesktopServices.openUrl(url)

    def _context_menu(self, pos) -> None:
        menu = self.body.createStandardContextMenu()
        menu.addSeparator()
        menu.addAction("Copy message", self.copy)
        menu.exec(self.body.mapToGlobal(pos))

    def set_meta(self, meta: dict) -> None:
        parts = []
        if meta.get("n_generated"):
            parts.append(f"{meta['n_generated']} tokens")
        if meta.get("decode_tok_s"):
            parts.append(f"{meta['decode_tok_s']:.1f} tok/s")
        if meta.get("ttft_s"):
            parts.append(f"TTFT {meta['ttft_s'] * 1000:.0f} ms")
        reason = meta.get("finish_reason")
        if reason and reason not in ("eos", "stop"):
            parts.append(
                {"cancelled": "stopped", "length": "max tokens", "context": "context full"}.get(reason, reason)
            )
        self.footer.setText(" · ".join(parts))
        self.footer.setVisible(bool(parts))

    def restyle(self, theme: Theme) -> None:
        bg = theme.user_bubble if self.role == "user" else theme.panel
        fg = {"notice": theme.error, "info": theme.muted}.get(self.role, theme.foreground)
        self.setStyleSheet(
            f"QFrame#bubble {{ background: {bg}; border-radius: 10px; }}"
            f"QLabel#role {{ color: {theme.muted}; font-weight: 600; }}"
            f"QLabel#meta {{ color: {theme.muted}; font-size: 11px; }}"
            f"QTextBrowser {{ background: transparent; color: {fg}; }}"
            f"QTextBrowser#reasoning {{ color: {theme.muted}; border-left: 2px solid {theme.muted};"
            " padding-left: 6px; }"
            f"QToolButton#reasoning-toggle {{ color: {theme.muted}; font-style: italic; }}"
        )
        code_bg = theme.background
        self.body.document().setDefaultStyleSheet(
            f"pre {{ background: {code_bg}; }} code {{ background: {code_bg}; }}"
            f"th, td {{ padding: 2px 8px; }} th {{ text-align: left; }}"
            "p.copy-code { font-size: small; margin-bottom: 0px; }"
        )
        self.set_text(self.text)  # the style sheet applies to what is set after it


class TranscriptView(QScrollArea):
    """The open conversation's messages; follows the bottom while the user has not scrolled up."""

    branchRequested = Signal(int, int)  # message id, step (-1: the previous alternative, 1: the next)
    editRequested = Signal(int)  # message id of a question to edit

    def __init__(self, theme: Theme = LIGHT, parent: QWidget | None = None):
        super().__init__(parent)
        self.theme = theme
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._box = QWidget()
        self._lay = QVBoxLayout(self._box)
        self._lay.setContentsMargins(16, 12, 16, 12)
        self._lay.setSpacing(10)
        self._lay.addStretch(1)
        self.setWidget(self._box)
        self.bubbles: list[MessageWidget] = []
        self.streaming: MessageWidget | None = None
        self._pending: str | None = None
        self._pending_reasoning: str | None = None
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(STREAM_RENDER_MS)
        self._render_timer.timeout.connect(self._render_stream)
        self._follow = True
        bar = self.verticalScrollBar()
        bar.rangeChanged.connect(self._on_range)
        bar.valueChanged.connect(self._on_scroll)
        self.placeholder = QLabel()
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setWordWrap(True)
        self._lay.insertWidget(0, self.placeholder)

    def set_placeholder(self, text: str) -> None:
        self.placeholder.setText(text)
        self.placeholder.setVisible(bool(text) and not self.bubbles)

    # -- content ------------------------------------------------------------------------------------
    def clear(self) -> None:
        for b in self.bubbles:
            b.setParent(None)
            b.deleteLater()
        self.bubbles, self.streaming, self._pending, self._pending_reasoning = [], None, None, None
        self._follow = True
        self.placeholder.setVisible(bool(self.placeholder.text()))

    def set_messages(self, messages: list[D.Message], branches: dict[int, D.Branch] | None = None) -> None:
        self.clear()
        for m in messages:
            self.add_message(m.role, m.content, m.meta, m.id, (branches or {}).get(m.id), m.reasoning)

    def add_message(
        self,
        role: str,
        text: str,
        meta: dict | None = None,
        mid: int | None = None,
        branch: D.Branch | None = None,
        reasoning: str = "",
    ) -> MessageWidget:
        w = MessageWidget(role, text, meta, self.theme, self._box, mid, reasoning)
        self._connect(w, branch)
        self._lay.insertWidget(self._lay.count() - 1, w)
        self.bubbles.append(w)
        self.placeholder.setVisible(False)
        return w

    def _connect(self, w: MessageWidget, branch: D.Branch | None) -> None:
        w.set_branch(branch)
        if w.mid is not None:
            mid = w.mid
            w.prev_button.clicked.connect(lambda: self.branchRequested.emit(mid, -1))
            w.next_button.clicked.connect(lambda: self.branchRequested.emit(mid, 1))
            w.edit_button.clicked.connect(lambda: self.editRequested.emit(mid))

    def add_notice(self, text: str) -> MessageWidget:
        return self.add_message("notice", text)

    def add_info(self, text: str) -> MessageWidget:
        """A note from the app (not an error), above the reply that is streaming, if any."""
        w = self.add_message("info", text)
        if self.streaming is not None:
            self._lay.removeWidget(w)
            self._lay.insertWidget(self._lay.indexOf(self.streaming), w)
            self.bubbles.remove(w)
            self.bubbles.insert(self.bubbles.index(self.streaming), w)
        return w

    def begin_stream(self) -> None:
        self.streaming = self.add_message("assistant", "")
        self.streaming.footer.setText("…")
        self.streaming.footer.setVisible(True)

    def update_stream(self, text: str) -> None:
        """Show ``text`` (the whole reply so far) in the streaming bubble, coalescing fast updates."""
        if self.streaming is None:
            return
        self._pending = text
        self._schedule()

    def update_reasoning(self, text: str) -> None:
        """Show ``text`` (the whole reasoning so far) above the streaming reply, coalescing fast updates."""
        if self.streaming is None:
            return
        self._pending_reasoning = text
        self._schedule()

    def _schedule(self) -> None:
        if not self._render_timer.isActive():
            self._render_stream()
            self._render_timer.start()

    def _render_stream(self) -> None:
        w = self.streaming
        if w is None:
            return
        if self._pending_reasoning is not None:
            w.set_reasoning(self._pending_reasoning, streaming=not (self._pending or w.text))
            self._pending_reasoning = None
        if self._pending is not None:
            if self._pending and w.thinking:  # the answer starts: the reasoning folds away
                w.set_reasoning(w.reasoning)
            w.set_text(self._pending)
            self._pending = None

    def end_stream(self, message: D.Message | None, branch: D.Branch | None = None) -> None:
        self._render_timer.stop()
        if self.streaming is None:
            return
        if message is None:
            self.bubbles.remove(self.streaming)
            self.streaming.setParent(None)
            self.streaming.deleteLater()
        else:
            self.streaming.set_reasoning(message.reasoning)
            self.streaming.set_text(message.content)
            self.streaming.set_meta(message.meta)
            self.streaming.mid = message.id
            self._connect(self.streaming, branch)
        self.streaming, self._pending, self._pending_reasoning = None, None, None

    def restyle(self, theme: Theme) -> None:
        self.theme = theme
        self.placeholder.setStyleSheet(f"color: {theme.muted}; font-size: 15px;")
        for b in self.bubbles:
            b.restyle(theme)

    # -- following the bottom -----------------------------------------------------------------------
    def _on_scroll(self, value: int) -> None:
        self._follow = value >= self.verticalScrollBar().maximum() - 4

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(hi)
