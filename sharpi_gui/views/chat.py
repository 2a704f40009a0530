"""The chat: the conversation list, the system prompt, the transcript and the input box.

Renders a :class:`~sharpi_gui.chat_model.ChatModel` and forwards the user's intents to it.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui.theme import LIGHT, Theme
from sharpi_gui.views import dialogs
from sharpi_gui.views.transcript import TranscriptView

NO_MODEL_HINT = (
    "No model is loaded.\n\nOpen a GGUF model with File → Open (Ctrl+O), or pick one from File → Recent Models."
)
EMPTY_HINT = "Type a message below and press Enter to send (Shift+Enter for a new line)."


class PromptEdit(QPlainTextEdit):
    """The input box: Enter sends, Shift+Enter inserts a new line."""

    submitted = Signal()

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            e.modifiers() & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.AltModifier)
        ):
            self.submitted.emit()
            return
        super().keyPressEvent(e)


class ConversationList(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 8, 4, 8)
        title = QLabel("Conversations")
        title.setStyleSheet("font-weight: 600;")
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations")
        self.search.setClearButtonEnabled(True)
        self.list = QListWidget()
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        row = QHBoxLayout()
        self.new_button = QPushButton("New")
        self.rename_button = QPushButton("Rename")
        self.delete_button = QPushButton("Delete")
        for b in (self.new_button, self.rename_button, self.delete_button):
            row.addWidget(b)
        lay.addWidget(title)
        lay.addWidget(self.search)
        lay.addWidget(self.list, 1)
        lay.addLayout(row)


class ChatView(QWidget):
    def __init__(self, model, theme: Theme = LIGHT, parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.has_model = False
        split = QSplitter(Qt.Orientation.Horizontal, self)
        self.conversations = ConversationList()
        split.addWidget(self.conversations)

        right = QWidget()
        rlay = QVBoxLayout(right)
        rlay.setContentsMargins(4, 8, 8, 8)
        self.system_toggle = QToolButton()
        self.system_toggle.setText("System prompt")
        self.system_toggle.setCheckable(True)
        self.system_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.system_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("Instructions the model sees before the conversation (optional)")
        self.system_edit.setMaximumHeight(90)
        self.system_edit.setVisible(False)
        self.preset_box = QComboBox()  # the loaded model's presets: system prompt + sampling
        self.preset_box.setToolTip("Presets of this model: a system prompt and sampling settings")
        self.preset_box.setMinimumContentsLength(16)
        self.save_preset_button = QToolButton()
        self.save_preset_button.setText("Save preset…")
        self.save_preset_button.setToolTip(
            "Save this conversation's system prompt and the sampling settings for this model"
        )
        self._system_timer = QTimer(self)
        self._system_timer.setSingleShot(True)
        self._system_timer.setInterval(400)
        self.transcript = TranscriptView(theme)
        self.status_line = QLabel()  # what the engine is doing before the chat can be used (loading, kernels)
        self.status_line.setObjectName("status-line")
        self.status_line.setWordWrap(True)
        self.status_line.setVisible(False)
        self.input = PromptEdit()
        self.input.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line)")
        self.input.setMaximumHeight(110)
        buttons = QVBoxLayout()
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.regen_button = QPushButton("Regenerate")
        self.cancel_edit_button = QPushButton("Cancel edit")
        self.cancel_edit_button.setVisible(False)
        self.editing: int | None = None  # the question being edited (Send resends it as a new branch)
        for b in (self.send_button, self.stop_button, self.regen_button, self.cancel_edit_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        inrow = QHBoxLayout()
        inrow.addWidget(self.input, 1)
        inrow.addLayout(buttons)
        top = QHBoxLayout()
        top.addWidget(self.system_toggle)
        top.addStretch(1)
        top.addWidget(QLabel("Preset:"))
        top.addWidget(self.preset_box)
        top.addWidget(self.save_preset_button)
        rlay.addLayout(top)
        rlay.addWidget(self.system_edit)
        rlay.addWidget(self.transcript, 1)
        rlay.addWidget(self.status_line)
        rlay.addLayout(inrow)
        split.addWidget(right)
        split.setStretchFactor(0, 0)
        split.setStretchFactor(1, 1)
        split.setSizes([220, 800])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(split)

        # intents -> model
        c = self.conversations
        c.new_button.clicked.connect(model.new_conversation)
        c.rename_button.clicked.connect(self.rename_current)
        c.delete_button.clicked.connect(self.delete_current)
        c.list.currentItemChanged.connect(self._on_pick)
        c.list.customContextMenuRequested.connect(self._context_menu)
        c.search.textChanged.connect(lambda _t: self._render_list())
        self.transcript.branchRequested.connect(model.switch_branch)
        self.transcript.editRequested.connect(self.edit_message)
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        self.preset_box.activated.connect(self._on_preset)
        self.save_preset_button.clicked.connect(self.save_preset)
        model.presetsChanged.connect(self._render_presets)
        self.input.submitted.connect(self.send)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(model.stop)
        self.regen_button.clicked.connect(model.regenerate)
        self.system_toggle.toggled.connect(self._toggle_system)
        self.system_edit.textChanged.connect(self._system_timer.start)
        self._system_timer.timeout.connect(self._commit_system)

        # model -> rendering
        model.conversationsChanged.connect(self._render_list)
        model.currentChanged.connect(self._render_current)
        model.messageAdded.connect(
            lambda m: self.transcript.add_message(m.role, m.content, m.meta, m.id, model.branch(m.id), m.reasoning)
        )
        model.streamStarted.connect(self.transcript.begin_stream)
        model.streamText.connect(self._on_stream)
        model.streamReasoning.connect(self._on_reasoning)
        model.streamEnded.connect(self._on_stream_end)
        model.notice.connect(lambda f: self.transcript.add_notice(f"**{f.title}.** {f.message}"))
        model.info.connect(self.transcript.add_info)
        model.busyChanged.connect(lambda _b: self._render_buttons())
        self._render_list()
        self._render_current()
        self._render_presets()
        self.restyle(theme)

    # -- intents --------------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText()
        if self.editing is not None:
            if self.model.edit_and_resend(self.editing, text):
                self.input.clear()
                self.cancel_edit()
        elif self.model.send(text):
            self.input.clear()

    def edit_message(self, mid: int) -> None:
        """Put question ``mid`` in the input box; Send resends it as a new branch (the old one is kept)."""
        msg = next((m for m in self.model.messages if m.id == mid), None)
        if msg is None or msg.role != "user":
            return
        self.editing = mid
        self.input.setPlainText(msg.content)
        self.input.setFocus()
        self.send_button.setText("Resend")
        self.cancel_edit_button.setVisible(True)

    def cancel_edit(self) -> None:
        self.editing = None
        self.send_button.setText("Send")
        self.cancel_edit_button.setVisible(False)

    def save_preset(self) -> None:
        if not self.model.model_name:
            return
        name = dialogs.ask_text(self, "Save preset", f"Preset name for {self.model.model_name}:", "")
        preset = self.model.save_preset(name) if name else None
        if preset is not None:
            self.preset_box.setCurrentIndex(self.preset_box.findText(preset.name))

    def _on_preset(self, index: int) -> None:
        preset = self.preset_box.itemData(index)
        if preset is not None:
            self.model.apply_preset(preset)

    def rename_current(self) -> None:
        conv = self.model.current
        if conv is None:
            return
        title = dialogs.ask_text(self, "Rename conversation", "Title:", conv.title)
        if title:
            self.model.rename(conv.id, title)

    def delete_current(self) -> None:
        conv = self.model.current
        if conv is not None and dialogs.confirm(
            self, "Delete conversation", f"Delete “{conv.title}” and its messages?"
        ):
            self.model.delete(conv.id)

    def focus_input(self) -> None:
        self.input.setFocus()

    def show_system_prompt(self) -> None:
        self.system_toggle.setChecked(True)
        self.system_edit.setFocus()

    def _on_pick(self, item: QListWidgetItem | None, _prev=None) -> None:
        if item is not None:
            cid = item.data(Qt.ItemDataRole.UserRole)
            if self.model.current is None or self.model.current.id != cid:
                self.model.select(cid)

    def _context_menu(self, pos) -> None:
        if self.conversations.list.itemAt(pos) is None:
            return
        menu = QMenu(self)
        menu.addAction("Rename…", self.rename_current)
        menu.addAction("Delete", self.delete_current)
        menu.popup(self.conversations.list.viewport().mapToGlobal(pos))

    def _toggle_system(self, on: bool) -> None:
        self.system_edit.setVisible(on)
        self.system_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)

    def _commit_system(self) -> None:
        text = self.system_edit.toPlainText()
        cur = self.model.current
        if (cur.system_prompt if cur else "") != text:
            self.model.set_system_prompt(text)

    # -- rendering ------------------------------------------------------------------------------------
    def set_has_model(self, loaded: bool) -> None:
        self.has_model = loaded
        self._render_placeholder()
        self._render_buttons()

    def set_status_line(self, text: str) -> None:
        """Say what the engine is doing before the chat can be used (empty: nothing): in the middle of
        an empty transcript, else on a line above the message box."""
        self.status_line.setText(text)
        self._render_placeholder()

    def _render_status_line(self) -> None:
        self.status_line.setVisible(bool(self.status_line.text()) and bool(self.transcript.bubbles))

    def _render_placeholder(self) -> None:
        status = self.status_line.text()
        self.transcript.set_placeholder(status or (EMPTY_HINT if self.has_model else NO_MODEL_HINT))
        self._render_status_line()

    def _render_list(self) -> None:
        lst = self.conversations.list
        lst.blockSignals(True)
        lst.clear()
        current = self.model.current.id if self.model.current else None
        query = self.conversations.search.text().strip()
        if query:  # the conversations that match, each with the first matching line
            rows = [(h.conversation_id, h.title, h.snippet * (h.snippet != h.title)) for h in self.model.search(query)]
        else:
            rows = [(c.id, c.title, "") for c in self.model.conversations]
        for cid, title, snippet in rows:
            item = QListWidgetItem(f"{title}\n{snippet}" if snippet else title)
            item.setData(Qt.ItemDataRole.UserRole, cid)
            item.setToolTip(snippet or title)
            lst.addItem(item)
            if cid == current:
                lst.setCurrentItem(item)
        lst.blockSignals(False)

    def _render_presets(self) -> None:
        box = self.preset_box
        box.blockSignals(True)
        box.clear()
        presets = self.model.presets()
        box.addItem("(none)" if presets or self.model.model_name else "(no model)", None)
        for p in presets:
            box.addItem(p.name, p)
        box.blockSignals(False)
        box.setEnabled(bool(presets))
        self.save_preset_button.setEnabled(bool(self.model.model_name))

    def _render_current(self) -> None:
        m = self.model
        if self.editing is not None and all(x.id != self.editing for x in m.messages):
            self.cancel_edit()
        self.transcript.set_messages(m.messages, {x.id: m.branch(x.id) for x in m.messages})
        if m.streaming_here:
            self.transcript.begin_stream()
            if m.reasoning:
                self.transcript.update_reasoning(m.reasoning)
            self.transcript.update_stream(m.stream)
        self.system_edit.blockSignals(True)
        self.system_edit.setPlainText(m.current.system_prompt if m.current else "")
        self.system_edit.blockSignals(False)
        self._render_list()
        self._render_placeholder()
        self._render_buttons()

    def _render_buttons(self) -> None:
        busy = self.model.busy
        self.send_button.setEnabled(not busy and self.has_model)
        self.stop_button.setEnabled(busy)
        self.regen_button.setEnabled(not busy and self.has_model and bool(self.model.messages))
        has_conv = self.model.current is not None
        self.conversations.rename_button.setEnabled(has_conv)
        self.conversations.delete_button.setEnabled(has_conv)

    def _on_stream(self, text: str) -> None:
        if self.model.streaming_here:
            self.transcript.update_stream(text)

    def _on_reasoning(self, text: str) -> None:
        if self.model.streaming_here:
            self.transcript.update_reasoning(text)

    def _on_stream_end(self, message) -> None:
        here = message is None or (self.model.current is not None and message.conversation_id == self.model.current.id)
        if here:
            self.transcript.end_stream(message, None if message is None else self.model.branch(message.id))
        self._render_buttons()

    def restyle(self, theme: Theme) -> None:
        self.transcript.restyle(theme)
        self.status_line.setStyleSheet(
            f"QLabel#status-line {{ background: {theme.panel}; color: {theme.foreground};"
            " border-radius: 6px; padding: 6px 10px; }"
        )
