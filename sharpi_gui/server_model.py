"""The local server's state for its dock: on or off, where, how many requests, the request log.

The bridge runs the server (engine.server on a thread, sharing the loaded model with the chat); this
model turns the switch into bridge calls, remembers the address in the settings and the API key in the
OS keyring (:class:`~sharpi_gui.keys.KeyStore`; for this run only where there is none), and keeps the last :data:`LOG_SIZE` answered requests as plain records.
"""

from __future__ import annotations

from collections import deque

from PySide6.QtCore import QObject, Signal

from sharpi_gui import data as D
from sharpi_gui.keys import LOCAL_SERVER, KeyStore

LOG_SIZE = 200


class ServerModel(QObject):
    statusChanged = Signal(object)  # ServerStatus
    requestLogged = Signal(object)  # ServerRequest

    def __init__(self, bridge, settings, keys: KeyStore | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge, self.settings = bridge, settings
        self.keys = keys if keys is not None else KeyStore()
        self.status = D.ServerStatus(False)
        self.log: deque[D.ServerRequest] = deque(maxlen=LOG_SIZE)
        bridge.serverChanged.connect(self._on_status)
        bridge.serverRequest.connect(self._on_request)

    @property
    def host(self) -> str:
        return self.settings.server_host

    @property
    def port(self) -> int:
        return self.settings.server_port

    @property
    def api_key(self) -> str:
        """The key last used ("" for none): from the keyring, or from this run's memory."""
        return self.keys.get(LOCAL_SERVER)

    @property
    def key_note(self) -> str:
        return self.keys.note

    def start(self, host: str, port: int, api_key: str = "") -> D.ServerStatus:
        """Start serving on ``host:port`` (remembered for next time, the key in the keyring — "" forgets
        it); the status says if it failed."""
        self.settings.server_host, self.settings.server_port = host, port
        self.keys.put(LOCAL_SERVER, api_key)
        return self.bridge.start_server(host, port, api_key)

    def stop(self) -> None:
        self.bridge.stop_server()

    def _on_status(self, status: D.ServerStatus) -> None:
        self.status = status
        self.statusChanged.emit(status)

    def _on_request(self, rec: D.ServerRequest) -> None:
        self.log.append(rec)
        self.bridge.poll_stats()  # the experts dock shows what the request routed (it polls only during chats)
        self.status = self.bridge.server_status()
        self.requestLogged.emit(rec)
        self.statusChanged.emit(self.status)
