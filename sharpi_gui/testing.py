"""Helpers for the GUI tests (pytest-qt): windows over a temporary data directory and settings
file, a model loader that waits for the worker, and dialogs that record instead of blocking."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QSettings
from PySide6.QtWidgets import QDialog, QFileDialog, QInputDialog, QMessageBox

TEST_ORGANIZATION = "SharpI-tests"  # never the user's "SharpI"
TEST_APPLICATION = "sharpi-gui-tests"
# Upper bounds for a wait, not speed targets: a wait returns as soon as its signal arrives. A cold
# numba cache compiles kernels on the first load, which takes minutes on a busy 2-core machine.
LOAD_TIMEOUT_MS = 300_000
GEN_TIMEOUT_MS = 300_000


def isolate_application() -> None:
    """Give the test QApplication names that no real install uses."""
    QCoreApplication.setOrganizationName(TEST_ORGANIZATION)
    QCoreApplication.setApplicationName(TEST_APPLICATION)


def settings_file(directory: Path) -> QSettings:
    return QSettings(str(Path(directory) / "settings.ini"), QSettings.Format.IniFormat)


def memory_keyring():
    """A keyring backend that keeps its entries in a dict (``.entries``): what the tests store keys in, so
    they never touch the user's keyring. A real keyring backend as far as ``keyring`` and KeyStore care."""
    from keyring.backend import KeyringBackend
    from keyring.errors import PasswordDeleteError

    class MemoryKeyring(KeyringBackend):
        priority = 1
        name = "memory (tests)"

        def __init__(self):
            super().__init__()
            self.entries: dict[tuple[str, str], str] = {}

        def get_password(self, service, username):
            return self.entries.get((service, username))

        def set_password(self, service, username, password):
            self.entries[(service, username)] = password

        def delete_password(self, service, username):
            if self.entries.pop((service, username), None) is None:
                raise PasswordDeleteError(username)

    return MemoryKeyring()


def make_window(
    qtbot, directory: Path, show: bool = True, simulate_device: bool = True, keys=None, calibrate_cpu: bool = False
):
    """A MainWindow storing conversations and settings under ``directory``; closed by qtbot.
    ``simulate_device``: without a GPU the placement controls work on the engine's simulated device
    (what the device-placement tests need); False: the app as a user without a GPU sees it. ``keys``: a
    KeyStore (default: one over :func:`memory_keyring`, never the user's keyring). ``calibrate_cpu``: run the
    background CPU calibration as the app does (off: tests that do not test it never spawn it)."""
    from sharpi_gui.app import create_window
    from sharpi_gui.keys import KeyStore

    isolate_application()
    keys = keys if keys is not None else KeyStore(memory_keyring())
    window = create_window(
        str(Path(directory) / "data"),
        settings_file(directory),
        simulate_device=simulate_device,
        keys=keys,
        calibrate_cpu=calibrate_cpu,
    )
    qtbot.addWidget(window, before_close_func=lambda w: w.ctx.close())
    if show:
        window.show()
        qtbot.waitExposed(window)
    return window


def load(qtbot, window, path, timeout: int = LOAD_TIMEOUT_MS):
    """Open ``path`` in ``window`` and wait until it is loaded; returns (card, limits)."""
    with qtbot.waitSignal(window.bridge.loaded, timeout=timeout) as blocker:
        assert window.open_model(str(path))
    return blocker.args


def session_of(window):
    """The engine Session behind a window (tests compare what the views show with it)."""
    return window.bridge._worker.current.session


@dataclass
class DialogRecorder:
    """Patched ``exec`` of message boxes, input dialogs, file dialogs and plain dialogs."""

    shown: list = field(default_factory=list)  # the dialog objects, in order
    answers: dict = field(default_factory=dict)  # class name -> value exec returns
    files: list[str] = field(default_factory=list)  # what the next file dialogs "select"
    texts: list[str] = field(default_factory=list)  # what the next input dialogs "type"

    def errors(self) -> list[QMessageBox]:
        return [d for d in self.shown if isinstance(d, QMessageBox) and d.objectName().startswith("error-")]


def patch_dialogs(monkeypatch) -> DialogRecorder:
    rec = DialogRecorder()

    def fake_exec(self):
        rec.shown.append(self)
        if isinstance(self, QInputDialog) and rec.texts:
            self.setTextValue(rec.texts.pop(0))
            return QDialog.DialogCode.Accepted
        if isinstance(self, QFileDialog):
            if not rec.files:
                return QDialog.DialogCode.Rejected
            chosen = rec.files.pop(0)
            self.selectedFiles = lambda: [chosen]
            return QDialog.DialogCode.Accepted
        return rec.answers.get(type(self).__name__, 0)

    for cls in (QMessageBox, QInputDialog, QFileDialog, QDialog):
        monkeypatch.setattr(cls, "exec", fake_exec)
    return rec
