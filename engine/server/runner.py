"""One generation at a time on the one loaded model, a bounded queue in front of it, and cancellation.

A request becomes a :class:`Job`: admitted if fewer than ``1 + max_queue`` jobs are in the house
(else :class:`QueueFull`, the server's 429), then run on its own thread once it holds the model lock.
The lock is the one the owner of the session uses for its own generations (the desktop app's chat
worker), so an API request and a GUI chat never run at once. The job's events cross into asyncio
through a queue; :meth:`Job.cancel` (a client that went away) stops the generation after the token in
progress, or drops the job before it starts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.generate import GenerationEvent

_END = object()


class QueueFull(Exception):
    """Every slot of the queue is taken (the server answers 429 with Retry-After)."""


@dataclass
class RunnerStats:
    """Counters of the runner (read by /metrics)."""

    admitted: int = 0
    rejected: int = 0  # refused: the queue was full
    completed: int = 0
    cancelled: int = 0  # ended because their client went away
    failed: int = 0
    running: int = 0
    waiting: int = 0
    queue_s: list[float] = field(default_factory=list)  # time each job waited for the model (last 256)


class Job:
    """A generation waiting for, holding or done with the model. Iterate its events with ``async for``."""

    def __init__(self, runner: ModelRunner, start: Callable[[], Iterator[GenerationEvent]]):
        self._runner = runner
        self._start = start  # called on the job's thread while it holds the model lock
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.running = False
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None

    def cancel(self) -> None:
        """Stop the generation after the current token (or before it starts). Any thread."""
        self._cancelled.set()
        with self._runner._mutex:  # a job that has just ended must not cancel the next one
            if self.running:
                self._runner.cancel_current()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerationEvent:
        item = await self._events.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shutting down): nobody is listening
            self._cancelled.set()

    def _run(self) -> None:
        r = self._runner
        outcome = "completed"
        try:
            while not r.lock.acquire(timeout=0.05):  # a job dropped while queued leaves at once
                if self.cancelled:
                    with r._mutex:
                        r.stats.waiting -= 1
                    outcome = "cancelled"
                    return
            try:
                with r._mutex:
                    r.stats.waiting -= 1
                    if self.cancelled:
                        outcome = "cancelled"
                        return
                    r.stats.running += 1
                    self.running = True
                    self.started_at = time.perf_counter()
                    r.stats.queue_s = [*r.stats.queue_s[-255:], self.started_at - self.queued_at]
                try:
                    for ev in self._start():
                        self._put(ev)
                        if self.cancelled:
                            r.cancel_current()  # covers a cancel that came before generate() cleared the flag
                    if self.cancelled:
                        outcome = "cancelled"
                finally:
                    with r._mutex:
                        self.running = False
                        r.stats.running -= 1
            finally:
                r.lock.release()
        except BaseException as e:  # handed to the request, which turns it into an HTTP error
            outcome = "failed"
            self._put(e)
        finally:
            with r._mutex:
                r._in_house -= 1
                setattr(r.stats, outcome, getattr(r.stats, outcome) + 1)
            self._put(_END)


class ModelRunner:
    """Admits, queues and runs generations on one session (``cancel``: the session's cancel)."""

    def __init__(self, cancel: Callable[[], None], max_queue: int = 8, lock: threading.Lock | None = None):
        if max_queue < 0:
            raise ValueError("max_queue must be ≥ 0")
        self.cancel_current = cancel
        self.max_queue = max_queue
        self.lock = lock if lock is not None else threading.Lock()  # held while a generation runs
        self.stats = RunnerStats()
        self._mutex = threading.Lock()  # guards the counters
        self._in_house = 0

    def submit(self, start: Callable[[], Iterator[GenerationEvent]]) -> Job:
        """A job that runs ``start()``'s events once the model is free; :class:`QueueFull` when
        ``1 + max_queue`` jobs are already running or waiting. Call from the event loop."""
        with self._mutex:
            if self._in_house >= 1 + self.max_queue:
                self.stats.rejected += 1
                raise QueueFull(f"the server is busy: {self._in_house} requests are running or queued")
            self._in_house += 1
            self.stats.admitted += 1
            self.stats.waiting += 1
        job = Job(self, start)
        threading.Thread(target=job._run, name="sharpi-server-job", daemon=True).start()
        return job

    @property
    def in_house(self) -> int:
        return self._in_house
