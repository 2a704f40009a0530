"""Chatting through a remote OpenAI-compatible endpoint: the "Connect to server" dialog (base URL, API key,
a model from the endpoint's list) and the note the placement and experts docks show in its place."""

from __future__ import annotations

import html
from urllib.parse import urlsplit

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui import data as D
from sharpi_gui.keys import KeyStore, remote_entry

URL_HINT = "http://127.0.0.1:8080/v1"


def normalized_url(text: str) -> str:
    """What the user typed, trimmed; a bare ``http://host:port`` gets the ``/v1`` OpenAI clients expect."""
    url = text.strip().rstrip("/")
    if url.startswith(("http://", "https://")) and urlsplit(url).path in ("", "/"):
        url += "/v1"
    return url


class ConnectDialog(QDialog):
    """Asks for an endpoint; lists its models (through ``bridge.list_remote_models``, off the UI thread)
    and offers Connect once the list came back. ``url()``, ``api_key()``, ``model()`` give the answer.
    ``keys``: where the endpoint's key is remembered (:class:`~sharpi_gui.keys.KeyStore`); the field starts
    with the key stored for ``url``, and takes the one stored for a URL typed later when it is left empty."""

    def __init__(self, bridge, url: str = "", parent: QWidget | None = None, keys: KeyStore | None = None):
        super().__init__(parent)
        self.setObjectName("connect-dialog")
        self.setWindowTitle("Connect to a server")
        self.setMinimumWidth(560)
        self.bridge = bridge
        self.keys = keys if keys is not None else KeyStore()
        self._ticket = 0
        intro = QLabel(
            "Chat with a model served elsewhere — vLLM, SGLang, llama-server or another <tt>sharpi serve</tt> — "
            "through its OpenAI-compatible API. The conversation stays here; placement and expert statistics do "
            "not apply to a remote model."
        )
        intro.setWordWrap(True)
        self.url_edit = QLineEdit(url)
        self.url_edit.setPlaceholderText(URL_HINT)
        self.key_edit = QLineEdit()
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("none")
        self.key_edit.setText(self.keys.get(remote_entry(self.url())) if self.url() else "")
        self.key_note = QLabel(self.keys.note)
        self.key_note.setObjectName("key-note")
        self.key_note.setWordWrap(True)
        self.key_note.setStyleSheet("font-size: 11px;")
        self.models = QComboBox()
        self.models.setMinimumContentsLength(24)
        self.list_button = QPushButton("List models")
        self.list_button.setToolTip("Ask the endpoint which models it serves (GET /models)")
        self.state = QLabel("List the endpoint's models, then pick one.")
        self.state.setWordWrap(True)
        self.state.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout()
        row.addWidget(self.models, 1)
        row.addWidget(self.list_button)
        form = QFormLayout()
        form.addRow("Base URL", self.url_edit)
        form.addRow("API key", self.key_edit)
        form.addRow("", self.key_note)
        form.addRow("Model", row)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.connect_button = self.buttons.addButton("Connect", QDialogButtonBox.ButtonRole.AcceptRole)
        self.connect_button.setEnabled(False)
        lay = QVBoxLayout(self)
        lay.addWidget(intro)
        lay.addLayout(form)
        lay.addWidget(self.state)
        lay.addWidget(self.buttons)

        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.list_button.clicked.connect(self.list_models)
        self.url_edit.returnPressed.connect(self.list_models)
        self.url_edit.editingFinished.connect(self._stored_key)
        self.url_edit.textEdited.connect(self._forget_models)
        self.key_edit.textEdited.connect(self._forget_models)
        bridge.remoteModels.connect(self._on_models)

    def _stored_key(self) -> None:
        """A URL typed into an empty key field brings its stored key, if any."""
        if not self.key_edit.text() and self.url():
            key = self.keys.get(remote_entry(self.url()))
            if key:
                self.key_edit.setText(key)
                self._forget_models()

    def remember_key(self) -> bool:
        """Store the key given for :meth:`url` ("" forgets it); True if it went to the OS keyring."""
        return self.keys.put(remote_entry(self.url()), self.api_key())

    def url(self) -> str:
        return normalized_url(self.url_edit.text())

    def api_key(self) -> str:
        return self.key_edit.text().strip()

    def model(self) -> str:
        return self.models.currentText()

    def list_models(self) -> None:
        url = self.url()
        if not url.startswith(("http://", "https://")):
            self.state.setText(f"The base URL starts with http:// or https:// (e.g. {URL_HINT}).")
            return
        self._forget_models()
        self.list_button.setEnabled(False)
        self.state.setText(f"Asking {html.escape(url)} for its models…")
        self._ticket = self.bridge.list_remote_models(url, self.api_key())

    def _forget_models(self, *_args) -> None:
        """The URL or key changed: the list shown belongs to another endpoint."""
        self._ticket = 0
        self.models.clear()
        self.connect_button.setEnabled(False)
        self.list_button.setEnabled(True)

    def _on_models(self, ticket: int, models, error: str) -> None:
        if ticket != self._ticket:  # an older request, or the fields changed since
            return
        self.list_button.setEnabled(True)
        if models is None:
            self.state.setText(error)
            return
        self.models.addItems(list(models))
        self.connect_button.setEnabled(True)
        self.connect_button.setDefault(True)
        self.state.setText(f"{len(models)} model{'s' if len(models) != 1 else ''} served at {self.url()}.")


def remote_note(heading: str, back: str, info: D.RemoteInfo, decode_tok_s: float = 0.0) -> str:
    """The rich text a dock shows in place of its controls while the chat streams from ``info``."""
    others = [m for m in info.models if m != info.model]
    speed = f"{decode_tok_s:.1f} tok/s (measured here)" if decode_tok_s > 0 else "— (no reply yet)"
    rows = [("Endpoint", f"<tt>{html.escape(info.base_url)}</tt>"), ("Model", f"<b>{html.escape(info.model)}</b>")]
    if others:
        rows.append(("Also served", html.escape(", ".join(others))))
    rows.append(("Last reply", speed))
    cells = "".join(f"<tr><td style='padding-right:12px'>{k}</td><td>{v}</td></tr>" for k, v in rows)
    return (
        f"<p><b>{html.escape(heading)}</b></p><table>{cells}</table>"
        f"<p>The endpoint's server decides where the model runs. {html.escape(back)}</p>"
    )


class RemoteNote(QLabel):
    """A dock's stand-in while a remote model is connected: ``heading`` says what does not apply, ``back``
    how to have it again."""

    def __init__(self, heading: str, back: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.heading, self.back = heading, back
        self.setObjectName("remote-note")
        self.setWordWrap(True)
        self.setTextFormat(Qt.TextFormat.RichText)
        self.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.setContentsMargins(12, 10, 12, 10)

    def show_info(self, info: D.RemoteInfo, decode_tok_s: float = 0.0) -> None:
        self.setText(remote_note(self.heading, self.back, info, decode_tok_s))
