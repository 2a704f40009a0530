"""Dialogs: errors, confirmations, renaming, sampling settings, shortcuts, about.

Every dialog is built as an object and shown with ``exec()``, so tests can patch ``exec`` and
inspect the dialog instead of blocking on it.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QInputDialog,
    QLabel,
    QMessageBox,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui import data as D

_TITLES = {
    D.ERR_BAD_FILE: "Not a usable model file",
    D.ERR_UNSUPPORTED: "Unsupported model",
    D.ERR_CONTEXT: "Context full",
    D.ERR_OUT_OF_MEMORY: "Out of memory",
    D.ERR_NO_MODEL: "No model loaded",
    D.ERR_TEMPLATE: "Chat template failed",
    D.ERR_ENGINE: "SharpI",
    D.ERR_INTERNAL: "Unexpected error",
}


def error_box(parent: QWidget | None, failure: D.Failure) -> QMessageBox:
    box = QMessageBox(parent)
    box.setIcon(QMessageBox.Icon.Critical if failure.kind == D.ERR_INTERNAL else QMessageBox.Icon.Warning)
    box.setWindowTitle(_TITLES.get(failure.kind, "SharpI"))
    box.setText(failure.title)
    box.setInformativeText(failure.message)
    box.setStandardButtons(QMessageBox.StandardButton.Ok)
    box.setObjectName(f"error-{failure.kind}")
    return box


def show_error(parent: QWidget | None, failure: D.Failure) -> None:
    error_box(parent, failure).exec()


def confirm(parent: QWidget | None, title: str, text: str) -> bool:
    box = QMessageBox(QMessageBox.Icon.Question, title, text, parent=parent)
    box.setStandardButtons(QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No)
    box.setDefaultButton(QMessageBox.StandardButton.No)
    return box.exec() == QMessageBox.StandardButton.Yes


def rename_dialog(parent: QWidget | None, title: str, label: str, text: str) -> QInputDialog:
    dlg = QInputDialog(parent)
    dlg.setWindowTitle(title)
    dlg.setLabelText(label)
    dlg.setTextValue(text)
    return dlg


def ask_text(parent: QWidget | None, title: str, label: str, text: str) -> str:
    dlg = rename_dialog(parent, title, label, text)
    return dlg.textValue() if dlg.exec() == QDialog.DialogCode.Accepted else ""


class SamplingDialog(QDialog):
    """Sampling settings; ``values()`` returns only what differs from ``defaults``."""

    def __init__(self, current: dict, defaults: dict, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Sampling settings")
        self.defaults = dict(defaults)
        v = {**defaults, **current}
        form = QFormLayout()

        def dspin(lo, hi, step, dec, value, tip):
            w = QDoubleSpinBox()
            w.setRange(lo, hi)
            w.setSingleStep(step)
            w.setDecimals(dec)
            w.setValue(float(value))
            w.setToolTip(tip)
            return w

        def ispin(lo, hi, value, tip, special=""):
            w = QSpinBox()
            w.setRange(lo, hi)
            w.setValue(int(value))
            w.setToolTip(tip)
            if special:
                w.setSpecialValueText(special)
            return w

        self.temperature = dspin(0, 5, 0.05, 2, v["temperature"], "0 = greedy (always the most likely token)")
        self.top_k = ispin(0, 1000, v["top_k"], "keep the k most likely tokens", "off")
        self.top_p = dspin(0, 1, 0.01, 2, v["top_p"], "keep the smallest set with this much probability (1 = off)")
        self.min_p = dspin(0, 1, 0.01, 2, v["min_p"], "drop tokens below this fraction of the top token (0 = off)")
        self.repeat_penalty = dspin(0.5, 3, 0.05, 2, v["repeat_penalty"], "1 = off")
        self.max_tokens = ispin(1, 1 << 20, v["max_tokens"], "longest reply in tokens")
        self.random_seed = QCheckBox("random")
        self.seed = ispin(0, 2**31 - 1, v["seed"] or 0, "fixed seed: the same prompt gives the same reply")
        self.random_seed.setChecked(v["seed"] is None)
        self.seed.setEnabled(v["seed"] is not None)
        self.random_seed.toggled.connect(lambda on: self.seed.setEnabled(not on))
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-k", self.top_k)
        form.addRow("Top-p", self.top_p)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repeat penalty", self.repeat_penalty)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        form.addRow("", self.random_seed)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok
            | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.RestoreDefaults
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self._restore)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(buttons)

    def _restore(self) -> None:
        d = self.defaults
        self.temperature.setValue(d["temperature"])
        self.top_k.setValue(d["top_k"])
        self.top_p.setValue(d["top_p"])
        self.min_p.setValue(d["min_p"])
        self.repeat_penalty.setValue(d["repeat_penalty"])
        self.max_tokens.setValue(d["max_tokens"])
        self.random_seed.setChecked(d["seed"] is None)

    def values(self) -> dict:
        out = {
            "temperature": round(self.temperature.value(), 4),
            "top_k": self.top_k.value(),
            "top_p": round(self.top_p.value(), 4),
            "min_p": round(self.min_p.value(), 4),
            "repeat_penalty": round(self.repeat_penalty.value(), 4),
            "max_tokens": self.max_tokens.value(),
            "seed": None if self.random_seed.isChecked() else self.seed.value(),
        }
        return {k: x for k, x in out.items() if x != self.defaults.get(k)}


SHORTCUTS = (
    ("Enter", "send the message"),
    ("Shift+Enter", "new line in the message"),
    ("Esc", "stop generating"),
    ("Ctrl+R", "regenerate the last reply"),
    ("Ctrl+N", "new conversation"),
    ("F2", "rename the conversation"),
    ("Ctrl+L", "focus the message box"),
    ("Ctrl+O", "open a model"),
    ("Ctrl+Shift+O", "model library: the GGUF files here, with the planner's verdict on each"),
    ("Ctrl+Shift+E", "export the conversation (Markdown or JSON)"),
    ("Ctrl+Shift+R", "connect to a server (a remote OpenAI-compatible endpoint)"),
    ("Ctrl+I", "model card"),
    ("Ctrl+E", "export profiler stats"),
    ("Ctrl+Shift+S", "sampling settings"),
    ("Ctrl+1 / Ctrl+2 / Ctrl+3", "show or hide the placement / experts / local server dock"),
    ("Ctrl+Q", "quit"),
)


class ShortcutsDialog(QDialog):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Keyboard shortcuts")
        form = QFormLayout(self)
        for keys, what in SHORTCUTS:
            k = QLabel(f"<b>{keys}</b>")
            form.addRow(k, QLabel(what))
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)


def about_box(parent: QWidget | None) -> QMessageBox:
    box = QMessageBox(parent)
    box.setWindowTitle("About SharpI")
    box.setText("<b>SharpI</b>")
    box.setInformativeText(
        "Runs Mixture-of-Experts GGUF models on a small GPU plus plenty of RAM, and shows where "
        "every layer and expert lives."
    )
    return box
