"""Running the ASGI app with uvicorn: in the foreground (``sharpi serve``) or on a thread (the app)."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

from engine.server.app import ServerOptions, asgi_app
from engine.server.host import ModelHost

log = logging.getLogger("sharpi.server")

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _config(host: ModelHost, bind: str, port: int, options: ServerOptions):
    import uvicorn

    if not is_loopback(bind):
        log.warning(
            "serving on %s: other machines can reach this server%s",
            bind,
            "" if options.api_key else " and no API key is set (--api-key)",
        )
    return uvicorn.Config(
        asgi_app(host, options), host=bind, port=port, log_level="warning", access_log=False, lifespan="off"
    )


def listen(bind: str, port: int) -> socket.socket:
    """A listening socket on ``bind:port`` (port 0: any free one); OSError if the address is taken."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    return socket.create_server((bind, port), family=family)


def serve(
    host: ModelHost,
    bind: str = LOOPBACK,
    port: int = 8080,
    options: ServerOptions | None = None,
    on_listening=None,
) -> None:
    """Serve until interrupted (Ctrl-C). ``on_listening(url)`` once the socket is bound (port 0 resolved)."""
    import uvicorn

    sock = listen(bind, port)
    try:
        if on_listening is not None:
            on_listening(f"http://{bind}:{sock.getsockname()[1]}/v1")
        uvicorn.Server(_config(host, bind, port, options or ServerOptions())).run(sockets=[sock])
    finally:
        sock.close()


class UvicornServer:
    """The server on a background thread: ``start()`` returns once it listens; ``stop()`` ends it."""

    def __init__(self, host: ModelHost, bind: str = LOOPBACK, port: int = 8080, options: ServerOptions | None = None):
        import uvicorn

        self.host, self.bind, self.options = host, bind, options or ServerOptions()
        self._server = uvicorn.Server(_config(host, bind, port, self.options))
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Bind (here, so a port in use is an OSError to the caller) and serve on a thread."""
        self._sock = listen(self.bind, self._server.config.port)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="sharpi-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and not self._server.started and time.monotonic() < deadline:
            self._thread.join(0.02)
        if not self._server.started:
            self.stop()
            raise OSError(f"the server did not start on {self.bind}:{self.port}")

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS chose when asked for port 0)."""
        return self._sock.getsockname()[1] if self._sock is not None else self._server.config.port

    @property
    def url(self) -> str:
        return f"http://{self.bind}:{self.port}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
