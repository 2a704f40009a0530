"""API keys in the OS keyring (sharpi_gui.keys): with a keyring (an in-memory keyring backend, set with
``keyring.set_keyring`` or handed in) the remote endpoint's and the local server's keys are stored there
and come back in a later window; without one (keyring's fail backend, as on a headless CI machine) the
app says so and keeps the key for the run only — never in the settings file or anywhere else on disk."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import keyring  # noqa: E402
import keyring.core  # noqa: E402
import pytest  # noqa: E402
from keyring.backends import chainer, fail, null  # noqa: E402
from keyring.errors import KeyringLocked  # noqa: E402

pytest.importorskip("pytestqt")

from PySide6.QtWidgets import QDialog  # noqa: E402

from sharpi_gui.keys import LOCAL_SERVER, NO_KEYRING, SERVICE, KeyStore, remote_entry, usable  # noqa: E402
from sharpi_gui.testing import make_window, memory_keyring, patch_dialogs  # noqa: E402
from sharpi_gui.views.remote import ConnectDialog  # noqa: E402

KEY = "sk-test-7f3a9c-do-not-write-me"
URL = "http://127.0.0.1:9/v1"  # nothing listens on the discard port: connecting fails, the key is kept


@pytest.fixture
def set_keyring():
    """``keyring.set_keyring`` for one test; the process's previous backend (or none chosen yet) after."""
    before = keyring.core._keyring_backend

    def set_(backend):
        keyring.set_keyring(backend)
        return backend

    yield set_
    keyring.core._keyring_backend = before


def _files_holding(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


class _Locked(type(memory_keyring())):
    """A keyring that is there but refuses to store (a locked collection the user would not unlock)."""

    def set_password(self, service, username, password):
        raise KeyringLocked("the collection is locked")


# -- the store -------------------------------------------------------------------------------------
def test_the_store_uses_the_keyring_set_with_set_keyring(set_keyring):
    backend = set_keyring(memory_keyring())
    keys = KeyStore()  # the backend keyring picks: the one set
    assert keys.persistent and "memory (tests)" in keys.note and "never in the settings file" in keys.note
    assert keys.put(remote_entry(URL), f"  {KEY} ") and backend.entries == {(SERVICE, remote_entry(URL)): KEY}
    assert KeyStore().get(remote_entry(URL)) == KEY  # the next run reads it back
    assert KeyStore().get(LOCAL_SERVER) == ""
    assert keys.put(remote_entry(URL), "") and backend.entries == {}  # an emptied field forgets the key
    assert keys.put(LOCAL_SERVER, "") and KeyStore().get(LOCAL_SERVER) == ""  # forgetting nothing is fine


def test_without_a_keyring_the_key_lives_for_the_run_only(set_keyring):
    set_keyring(fail.Keyring())  # what keyring picks on a headless machine without a Secret Service
    keys = KeyStore()
    assert not keys.persistent and keys.note == NO_KEYRING and "no usable keyring backend" in keys.problem
    assert not keys.put(LOCAL_SERVER, KEY)  # False: kept for this run only
    assert keys.get(LOCAL_SERVER) == KEY  # ... where it is there
    assert KeyStore().get(LOCAL_SERVER) == ""  # the next run has it no more


def test_a_keyring_that_refuses_falls_back_to_memory():
    backend = _Locked()
    keys = KeyStore(backend)
    assert keys.persistent and "memory (tests)" in keys.note
    assert not keys.put(LOCAL_SERVER, KEY) and backend.entries == {}
    assert keys.note == NO_KEYRING and "refused to store a key" in keys.problem and "locked" in keys.problem
    assert keys.get(LOCAL_SERVER) == KEY


def test_which_backends_count_as_a_keyring():
    assert usable(memory_keyring())
    assert not usable(fail.Keyring()) and not usable(null.Keyring())

    class Plaintext(type(memory_keyring())):  # keyrings.alt's file backends write the key to a file
        pass

    Plaintext.__module__ = "keyrings.alt.file"
    assert not usable(Plaintext())

    class Chained(chainer.ChainerBackend):
        backends = [memory_keyring(), Plaintext()]

    assert not usable(Chained())  # one chained file backend is one too many
    Chained.backends = [memory_keyring()]
    assert usable(Chained())
    Chained.backends = []
    assert not usable(Chained())


# -- the app ---------------------------------------------------------------------------------------
def test_the_server_dock_keeps_its_key_in_the_keyring(qtbot, tmp_path):
    backend = memory_keyring()
    w = make_window(qtbot, tmp_path / "first", show=False, keys=KeyStore(backend))
    panel = w.server_dock.panel
    assert panel.key.text() == "" and "memory (tests)" in panel.key_note.text()
    panel.key.setText(KEY)
    panel.port.setValue(1)  # no model is loaded: whether or not it starts, the key is remembered
    panel.switch.setChecked(True)
    w.ctx.server.stop()
    assert backend.entries == {(SERVICE, LOCAL_SERVER): KEY}
    w.settings.sync()
    assert _files_holding(tmp_path, KEY) == []  # not in the settings file, nor anywhere under the app's dirs
    again = make_window(qtbot, tmp_path / "second", show=False, keys=KeyStore(backend))  # a later run
    assert again.server_dock.panel.key.text() == KEY


def test_the_connect_dialog_keeps_the_endpoint_key_in_the_keyring(qtbot, tmp_path, monkeypatch):
    backend = memory_keyring()
    w = make_window(qtbot, tmp_path, show=False, keys=KeyStore(backend))
    patch_dialogs(monkeypatch)  # the connection fails (nothing listens): its error dialog is recorded

    def fill(dlg):
        assert "memory (tests)" in dlg.key_note.text()
        dlg.url_edit.setText(URL)
        dlg.key_edit.setText(KEY)
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ConnectDialog, "exec", fill)
    with qtbot.waitSignal(w.bridge.loadFailed, timeout=60_000):
        w.connect_dialog()
    assert backend.entries == {(SERVICE, remote_entry(URL)): KEY}
    w.settings.sync()
    assert _files_holding(tmp_path, KEY) == []
    later = ConnectDialog(w.bridge, URL, w, KeyStore(backend))  # a later run, the URL remembered
    qtbot.addWidget(later)
    assert later.key_edit.text() == KEY
    other = ConnectDialog(w.bridge, "", w, KeyStore(backend))  # typing the URL brings its key
    qtbot.addWidget(other)
    other.url_edit.setText(URL.removesuffix("/v1"))
    other.url_edit.editingFinished.emit()
    assert other.key_edit.text() == KEY


def test_without_a_keyring_the_app_says_so_and_writes_nothing(qtbot, tmp_path, monkeypatch, set_keyring):
    set_keyring(fail.Keyring())
    w = make_window(qtbot, tmp_path, show=False, keys=KeyStore())  # the machine's keyring: there is none
    assert w.server_dock.panel.key_note.text() == NO_KEYRING
    rec = patch_dialogs(monkeypatch)
    shown: list[ConnectDialog] = []

    def fill(dlg):
        shown.append(dlg)
        assert dlg.key_note.text() == NO_KEYRING  # said before the key is typed
        dlg.url_edit.setText(URL)
        if len(shown) == 1:
            dlg.key_edit.setText(KEY)
        else:
            dlg.url_edit.editingFinished.emit()  # the URL typed again brings its key
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(ConnectDialog, "exec", fill)
    with qtbot.waitSignal(w.bridge.loadFailed, timeout=60_000):
        w.connect_dialog()
    assert rec.errors()  # the connection failed (nothing listens); the key stays for this run
    with qtbot.waitSignal(w.bridge.loadFailed, timeout=60_000):
        w.connect_dialog()  # the second time, the same run: the URL and the key are filled in
    assert shown[1].url() == URL and shown[1].api_key() == KEY
    panel = w.server_dock.panel
    panel.key.setText(KEY + "-local")
    panel.port.setValue(1)
    panel.switch.setChecked(True)
    w.ctx.server.stop()
    assert w.ctx.keys.get(LOCAL_SERVER) == KEY + "-local" and panel.key_note.text() == NO_KEYRING
    w.settings.sync()
    assert _files_holding(tmp_path, KEY) == []
    assert KeyStore().get(remote_entry(URL)) == "" and KeyStore().get(LOCAL_SERVER) == ""  # gone with the run
