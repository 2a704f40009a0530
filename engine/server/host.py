"""The model a server generates with: loading, ready or failed, its runner, and a log of requests."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.server.runner import ModelRunner

log = logging.getLogger("sharpi.server")

LOADING, READY, FAILED = "loading", "ready", "failed"


@dataclass(frozen=True)
class RequestRecord:
    """One answered request, for the app's request log (plain data)."""

    at: float  # time.time() when it ended
    route: str
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_tok_s: float = 0.0
    duration_s: float = 0.0
    finish_reason: str = ""


class ModelHost:
    """Holds the session (once loaded), the :class:`ModelRunner` in front of it and the request log.

    ``model_id``: the name clients put in ``model`` (default: the file's stem). ``lock``: the lock the
    session's other user takes around its own generations (the desktop app), shared with the runner.
    """

    def __init__(self, model_id: str, max_queue: int = 8, lock: threading.Lock | None = None, log_size: int = 200):
        self.model_id = model_id
        self.state = LOADING
        self.error = ""
        self.session = None
        self.created = int(time.time())
        self.progress = (0, 1, "")
        self.runner = ModelRunner(self._cancel, max_queue=max_queue, lock=lock)
        self.records: deque[RequestRecord] = deque(maxlen=log_size)
        self.n_requests = 0  # every request answered on the generation routes, 2xx or not
        self._listeners: list[Callable[[RequestRecord], None]] = []

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_session(cls, session, model_id: str | None = None, **kw) -> ModelHost:
        host = cls(model_id or Path(session.gf.path).stem, **kw)
        host._ready(session)
        return host

    @classmethod
    def load_in_background(cls, path: str, load: Callable[..., object], model_id: str | None = None, **kw):
        """A host whose session ``load(progress)`` builds on a thread (the server answers 503 meanwhile)."""
        host = cls(model_id or Path(path).stem, **kw)

        def run():
            try:
                host._ready(load(host._progress))
            except BaseException as e:  # reported by /health and every generation route
                host.state, host.error = FAILED, str(e) or type(e).__name__
                log.error("loading %s failed: %s", path, host.error)

        threading.Thread(target=run, name="sharpi-server-load", daemon=True).start()
        return host

    def _ready(self, session) -> None:
        self.session = session
        self.state = READY

    def set_session(self, session, model_id: str | None = None) -> None:
        """Serve ``session`` from now on (the app loaded another model). Call holding the runner's lock."""
        if model_id:
            self.model_id = model_id
        self.error = ""
        self._ready(session)

    def set_unavailable(self, why: str = "") -> None:
        """Answer 503 until :meth:`set_session` (the app is loading a model, or has none)."""
        self.session, self.state, self.error = None, LOADING, why

    def _progress(self, done: int, total: int, what: str) -> None:
        self.progress = (done, total, what)

    def _cancel(self) -> None:
        if self.session is not None:
            self.session.cancel()

    # -- the request log -----------------------------------------------------------------------
    def add_listener(self, fn: Callable[[RequestRecord], None]) -> None:
        """``fn(record)`` after every answered generation request (on the server's thread)."""
        self._listeners.append(fn)

    def record(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        self.n_requests += 1
        for fn in list(self._listeners):
            try:
                fn(rec)
            except Exception:  # a listener's failure is its own
                log.exception("request listener failed")
