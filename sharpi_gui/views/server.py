"""The "Local server" dock: a switch that serves the loaded model over an OpenAI-compatible API, its
address, the base URL to copy, the request count and a live request log. Renders a ServerModel."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QDockWidget,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui import data as D

LOOPBACK = ("127.0.0.1", "localhost", "::1")
COLUMNS = ("time", "route", "status", "tokens in → out", "tok/s", "seconds")
SHOWN = 100  # log rows kept in the view


class ServerPanel(QWidget):
    def __init__(self, model, parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.switch = QCheckBox("Serve the loaded model over an OpenAI-compatible API")
        self.host = QLineEdit(model.host)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(model.port)
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("optional: clients then send Authorization: Bearer KEY")
        self.key.setText(model.api_key)
        self.key_note = QLabel(model.key_note)
        self.key_note.setObjectName("key-note")
        self.key_note.setWordWrap(True)
        self.key_note.setStyleSheet("font-size: 11px;")
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.url.setPlaceholderText("off")
        self.copy = QPushButton("Copy")
        self.copy.setToolTip("Copy the base URL (what an OpenAI client takes as base_url)")
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.count = QLabel()
        self.requests = QTreeWidget()
        self.requests.setHeaderLabels(list(COLUMNS))
        self.requests.setRootIsDecorated(False)
        self.requests.setUniformRowHeights(True)

        form = QFormLayout()
        form.addRow("Address", self.host)
        form.addRow("Port", self.port)
        form.addRow("API key", self.key)
        form.addRow("", self.key_note)
        url_row = QHBoxLayout()
        url_row.addWidget(self.url, 1)
        url_row.addWidget(self.copy)
        form.addRow("Base URL", url_row)
        lay = QVBoxLayout(self)
        lay.addWidget(self.switch)
        lay.addLayout(form)
        lay.addWidget(self.note)
        lay.addWidget(self.count)
        lay.addWidget(self.requests, 1)
        lay.setContentsMargins(8, 6, 8, 6)

        self.switch.toggled.connect(self._toggled)
        self.copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        self.host.textChanged.connect(lambda _t: self._render_note())
        model.statusChanged.connect(self.render)
        model.requestLogged.connect(self._add_row)
        self.render(model.status)

    def _toggled(self, on: bool) -> None:
        if on and not self.model.status.running:
            self.model.start(self.host.text().strip() or "127.0.0.1", self.port.value(), self.key.text().strip())
            self.key_note.setText(self.model.key_note)  # the keyring may have refused the key
        elif not on and self.model.status.running:
            self.model.stop()

    def render(self, status: D.ServerStatus) -> None:
        self.switch.blockSignals(True)
        self.switch.setChecked(status.running)
        self.switch.blockSignals(False)
        for w in (self.host, self.port, self.key):
            w.setEnabled(not status.running)
        self.url.setText(status.url if status.running else "")
        self.copy.setEnabled(status.running)
        if status.running:
            waiting = f", {status.queued} waiting" if status.queued else ""
            model = f' · model "{status.model_id}"' if status.model_id else ""
            self.count.setText(f"{status.n_requests} requests answered{waiting}{model}")
        else:
            self.count.setText("")
        self._render_note(status.error)

    def _render_note(self, error: str = "") -> None:
        if error:
            self.note.setText(error)
        elif self.host.text().strip() not in LOOPBACK:
            self.note.setText("Other machines on the network can reach this address. Set an API key.")
        else:
            self.note.setText("Only programs on this computer can reach it. The chat and the API take turns.")

    def _add_row(self, r: D.ServerRequest) -> None:
        tokens = f"{r.prompt_tokens} → {r.completion_tokens}" if r.status == 200 else ""
        cells = (
            time.strftime("%H:%M:%S", time.localtime(r.at)),
            r.route.removeprefix("/v1/").removesuffix("/completions") or r.route,
            str(r.status),
            tokens,
            f"{r.tok_s:.1f}" if r.tok_s else "",
            f"{r.duration_s:.2f}",
        )
        self.requests.insertTopLevelItem(0, QTreeWidgetItem(list(cells)))
        if self.requests.topLevelItemCount() == 1:
            for i in range(len(COLUMNS)):
                self.requests.resizeColumnToContents(i)
        while self.requests.topLevelItemCount() > SHOWN:
            self.requests.takeTopLevelItem(SHOWN)


class ServerDock(QDockWidget):
    def __init__(self, model, parent: QWidget | None = None):
        super().__init__("Local server", parent)
        self.setObjectName("server-dock")
        self.panel = ServerPanel(model)
        self.setWidget(self.panel)
        self.setAllowedAreas(Qt.DockWidgetArea.LeftDockWidgetArea | Qt.DockWidgetArea.RightDockWidgetArea)
