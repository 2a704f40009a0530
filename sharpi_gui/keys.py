"""API keys the app remembers — a remote endpoint's, the local server's — kept in the OS keyring
(Secret Service or KWallet on Linux, the macOS Keychain, the Windows Credential Locker) through the
``keyring`` library, never in the settings file.

Where no usable keyring exists (a headless machine without a Secret Service, CI), or the keyring refuses
an operation, :class:`KeyStore` says so (:attr:`KeyStore.note`, shown beside the key fields) and keeps
the keys in this process's memory for the run only: nothing is written to disk. keyring's own
"no backend" and "null" backends, and keyrings.alt's file backends (plain or weakly protected files), do
not count as usable. Plain Python, no Qt.
"""

from __future__ import annotations

import logging

log = logging.getLogger("sharpi.gui")

SERVICE = "SharpI"  # the keyring's service name for every entry
LOCAL_SERVER = "local-server"  # the entry of the app's local server's key

NO_KEYRING = (
    "No system keyring is available here, so the key is kept in memory for this run only and never "
    "written to disk: enter it again after a restart."
)


def remote_entry(url: str) -> str:
    """The keyring entry (the "username" under :data:`SERVICE`) of a remote endpoint's key."""
    return f"remote {url}"


def usable(backend) -> bool:
    """Whether ``backend`` keeps secrets in an OS keyring: not keyring's fail or null backend, not a
    keyrings.alt file backend, and (for keyring's chainer) every backend it chains is usable."""
    from keyring.backends import chainer, fail, null

    if isinstance(backend, chainer.ChainerBackend):
        chained = list(backend.backends)
        return bool(chained) and all(usable(b) for b in chained)
    if isinstance(backend, (fail.Keyring, null.Keyring)):
        return False
    if type(backend).__module__.startswith("keyrings.alt"):
        return False
    try:
        return float(backend.priority) >= 1
    except Exception:  # a backend whose priority check fails is not viable
        return False


class KeyStore:
    """Keys by entry name. ``backend``: a keyring backend (tests pass an in-memory one); None: the one
    ``keyring`` picks for this machine (looked up on first use)."""

    def __init__(self, backend=None):
        self._backend = backend
        self._resolved = backend is not None
        self._memory: dict[str, str] = {}  # this run's keys (the only copy when there is no keyring)
        self.problem = ""  # why the keyring is not used ("" while it is)

    def _keyring(self):
        """The usable backend, or None (then :attr:`problem` says why)."""
        if not self._resolved:
            self._resolved = True
            try:
                import keyring

                self._backend = keyring.get_keyring()
            except Exception as e:  # keyring's discovery failed: no keyring
                self._backend = None
                self.problem = f"the keyring could not be opened ({type(e).__name__}: {e})"
        if self._backend is not None and not self.problem and not usable(self._backend):
            self.problem = f"no usable keyring backend ({getattr(self._backend, 'name', type(self._backend).__name__)})"
        return None if self.problem else self._backend

    @property
    def persistent(self) -> bool:
        """True when keys go to the OS keyring (and outlive the run)."""
        return self._keyring() is not None

    @property
    def note(self) -> str:
        """One sentence for the user: where a key entered here is kept."""
        backend = self._keyring()
        if backend is None:
            return NO_KEYRING
        name = getattr(backend, "name", type(backend).__name__)
        return f"Stored in the system keyring ({name}), never in the settings file."

    def _failed(self, what: str, e: Exception) -> None:
        self.problem = f"the keyring refused to {what} ({type(e).__name__}: {e})"
        log.warning("%s; API keys are kept in memory for this run only", self.problem)

    def get(self, entry: str) -> str:
        """The key stored under ``entry`` ("" if none)."""
        if entry in self._memory:
            return self._memory[entry]
        backend = self._keyring()
        if backend is None:
            return ""
        try:
            key = backend.get_password(SERVICE, entry) or ""
        except Exception as e:
            self._failed("read a key", e)
            return ""
        self._memory[entry] = key
        return key

    def put(self, entry: str, key: str) -> bool:
        """Remember ``key`` under ``entry`` ("" forgets it). True when it is in the OS keyring (or, for
        "", gone from it); False when it is kept for this run only (:attr:`note` says so)."""
        key = key.strip()
        if self._memory.get(entry, None) == key and key:
            return self.persistent
        self._memory[entry] = key
        backend = self._keyring()
        if backend is None:
            return False
        try:
            if key:
                backend.set_password(SERVICE, entry, key)
            else:
                self._delete(backend, entry)
        except Exception as e:
            self._failed("store a key" if key else "delete a key", e)
            return False
        return True

    @staticmethod
    def _delete(backend, entry: str) -> None:
        from keyring.errors import PasswordDeleteError

        try:
            if backend.get_password(SERVICE, entry) is not None:
                backend.delete_password(SERVICE, entry)
        except PasswordDeleteError:  # already gone
            pass
