"""The model library: GGUF files found in the usual download folders (and the user's own), each with
the planner's verdict on this machine before anything loads — runs or not and why, how it would be
placed, the predicted decode speed. Open loads the chosen file."""

from __future__ import annotations

import os

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui import data as D

COLUMNS = ("Model", "Architecture", "Size", "Quant", "Trained context", "Verdict on this machine", "Predicted decode")


class LibraryDialog(QDialog):
    """Scans when shown; ``openRequested(path)`` when the user opens a runnable file."""

    openRequested = Signal(str)

    def __init__(self, bridge, settings, parent: QWidget | None = None, loaded: D.ModelCard | None = None):
        super().__init__(parent)
        self.setObjectName("library")
        self.setWindowTitle("Model library")
        self.resize(1100, 520)
        self.bridge, self.settings = bridge, settings
        self.loaded, self.measured_tok_s = loaded, 0.0
        self.entries: list[D.LibraryEntry] = []
        self.folders_label = QLabel()
        self.folders_label.setWordWrap(True)
        self.folders_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.add_button = QPushButton("Add folder…")
        self.rescan_button = QPushButton("Rescan")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(5, QHeaderView.ResizeMode.Stretch)
        self.status = QLabel()
        self.open_button = QPushButton("Open")
        self.open_button.setDefault(True)
        self.open_button.setEnabled(False)
        close = QPushButton("Close")

        top = QHBoxLayout()
        top.addWidget(self.folders_label, 1)
        top.addWidget(self.add_button)
        top.addWidget(self.rescan_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.status, 1)
        bottom.addWidget(self.open_button)
        bottom.addWidget(close)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.table, 1)
        lay.addLayout(bottom)

        self.add_button.clicked.connect(self.add_folder)
        self.rescan_button.clicked.connect(self.rescan)
        self.open_button.clicked.connect(self.open_selected)
        close.clicked.connect(self.reject)
        self.table.itemSelectionChanged.connect(self._render_buttons)
        self.table.cellDoubleClicked.connect(lambda _r, _c: self.open_selected())
        bridge.libraryEntry.connect(self._on_entry)
        bridge.libraryDone.connect(self._on_done)
        self.finished.connect(self._disconnect)

    def _disconnect(self, *_):
        for signal, slot in ((self.bridge.libraryEntry, self._on_entry), (self.bridge.libraryDone, self._on_done)):
            try:
                signal.disconnect(slot)
            except (RuntimeError, TypeError):  # already disconnected
                pass

    def folders(self) -> list[str]:
        out = []
        for f in [*self.bridge.library_folders(), *self.settings.library_folders]:
            if f not in out:
                out.append(f)
        return out

    # -- intents --------------------------------------------------------------------------------------
    def rescan(self) -> None:
        self.entries = []
        self.table.setRowCount(0)
        folders = self.folders()
        self.folders_label.setText(
            "Folders: " + ("; ".join(folders) if folders else "none of the usual download folders exist here")
        )
        self.status.setText("Scanning…" if folders else "Add a folder that holds GGUF files.")
        self.rescan_button.setEnabled(False)
        if folders:
            self.bridge.scan_library(folders)
        else:
            self.rescan_button.setEnabled(True)

    def add_folder(self) -> None:
        dlg = QFileDialog(self, "Add a folder of GGUF models")
        dlg.setFileMode(QFileDialog.FileMode.Directory)
        dlg.setOption(QFileDialog.Option.ShowDirsOnly, True)
        if dlg.exec() == QDialog.DialogCode.Accepted and dlg.selectedFiles():
            self.settings.library_folders = [*self.settings.library_folders, dlg.selectedFiles()[0]]
            self.rescan()

    def selected(self) -> D.LibraryEntry | None:
        rows = self.table.selectionModel().selectedRows()
        return self.entries[rows[0].row()] if rows else None

    def open_selected(self) -> None:
        e = self.selected()
        if e is not None and e.runnable:
            self.openRequested.emit(e.path)
            self.accept()

    # -- rendering ------------------------------------------------------------------------------------
    def _on_entry(self, e: D.LibraryEntry) -> None:
        self.entries.append(e)
        row = self.table.rowCount()
        self.table.insertRow(row)
        if e.predicted_tok_s is None:
            speed = "—"
        elif (
            self.loaded is not None
            and os.path.realpath(e.path) == os.path.realpath(self.loaded.path)
            and self.measured_tok_s
        ):
            speed = f"{self.measured_tok_s:,.1f} tok/s (measured)"
        else:
            speed = f"≈ {e.predicted_tok_s:,.1f} tok/s" + ("" if e.calibrated else " (uncalibrated)")
        cells = (
            e.name,
            e.architecture,
            D.human_bytes(e.file_size) if e.file_size else "",
            e.quant,
            f"{e.n_ctx_train:,}" if e.n_ctx_train else "",
            e.verdict,
            speed,
        )
        for col, text in enumerate(cells):
            item = QTableWidgetItem(text)
            item.setToolTip(e.path if col == 0 else (e.detail if col == 5 else (e.speeds if col == 6 else text)))
            if not e.runnable:
                item.setForeground(QColor("#8c8c8c"))
            self.table.setItem(row, col, item)
        self.status.setText(f"Scanning… {len(self.entries)} files")

    def _on_done(self, n: int) -> None:
        runnable = sum(e.runnable for e in self.entries)
        self.status.setText(
            f"{n} GGUF files, {runnable} can run here. Speeds marked uncalibrated use the planner's default "
            "speeds (this CPU is measured once, in the background); hover a verdict for the whole reason."
        )
        self.rescan_button.setEnabled(True)

    def _render_buttons(self) -> None:
        e = self.selected()
        self.open_button.setEnabled(e is not None and e.runnable)
