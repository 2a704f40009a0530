"""One generation at a time on the one loaded model, a bounded first-come queue in front of it, cancellation.

A request becomes a :class:`Job`: admitted if fewer than ``1 + max_queue`` jobs are in the house (else
:class:`QueueFull`, the server's 429) and queued. One worker thread takes the jobs in arrival order and
runs each while holding the model lock — the lock the session's other user takes around its own
generations (the desktop app's chat worker), so an API request and a GUI chat never run at once. A job's
events cross into asyncio through a queue; :meth:`Job.cancel` (a client that went away) stops the
generation after the token in progress, or takes the job out of the queue before it starts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
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
    cancelled: int = 0  # ended because their client went away (running or queued)
    failed: int = 0
    running: int = 0
    waiting: int = 0
    queue_s: list[float] = field(default_factory=list)  # time each job waited for the model (last 256)


class Job:
    """A generation waiting for, holding or done with the model. Iterate its events with ``async for``."""

    def __init__(self, runner: ModelRunner, start: Callable[[], Iterator[GenerationEvent]]):
        self._runner = runner
        self._start = start  # called on the worker thread while it holds the model lock
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.running = False
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None

    def cancel(self) -> None:
        """Stop the generation after the current token, or drop the job if it has not started. Any thread."""
        self._cancelled.set()
        self._runner._cancel(self)

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


class ModelRunner:
    """Admits, queues and runs generations on one session (``cancel``: the session's cancel)."""

    def __init__(self, cancel: Callable[[], None], max_queue: int = 8, lock: threading.Lock | None = None):
        if max_queue < 0:
            raise ValueError("max_queue must be ≥ 0")
        self.cancel_current = cancel
        self.max_queue = max_queue
        self.lock = lock if lock is not None else threading.Lock()  # held while a generation runs
        self.stats = RunnerStats()
        self._mutex = threading.Condition()  # guards the queue and the counters
        self._queue: deque[Job] = deque()
        self._current: Job | None = None
        self._worker: threading.Thread | None = None
        self._closed = False

    @property
    def in_house(self) -> int:
        """Jobs running or queued."""
        return len(self._queue) + (self._current is not None)

    def submit(self, start: Callable[[], Iterator[GenerationEvent]]) -> Job:
        """A job that runs ``start()``'s events once the jobs before it are done; :class:`QueueFull` when
        ``1 + max_queue`` jobs are already running or waiting. Call from the event loop."""
        with self._mutex:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if self.in_house >= 1 + self.max_queue:
                self.stats.rejected += 1
                raise QueueFull(f"the server is busy: {self.in_house} requests are running or queued")
            job = Job(self, start)
            self._queue.append(job)
            self.stats.admitted += 1
            self.stats.waiting += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="sharpi-server-runner", daemon=True)
                self._worker.start()
            self._mutex.notify()
        return job

    def _cancel(self, job: Job) -> None:
        with self._mutex:
            if job is self._current:  # a job that has just ended is no longer current: the next is safe
                self.cancel_current()
            elif job in self._queue:
                self._queue.remove(job)
                self.stats.waiting -= 1
                self.stats.cancelled += 1
                job._put(_END)

    def close(self) -> None:
        """End the worker thread once the queue is empty (the server stopped); later submits are refused."""
        with self._mutex:
            self._closed = True
            self._mutex.notify_all()

    def _work(self) -> None:
        while True:
            with self._mutex:
                while not self._queue and not self._closed:
                    self._mutex.wait()
                if not self._queue:
                    self._worker = None
                    return
                job = self._queue[0]  # stays queued (cancellable) until it holds the model
            with self.lock:
                with self._mutex:
                    if not self._queue or self._queue[0] is not job:  # dropped while waiting for the lock
                        continue
                    self._queue.popleft()
                    self.stats.waiting -= 1
                    self.stats.running += 1
                    self._current = job
                    job.running = True
                    job.started_at = time.perf_counter()
                    self.stats.queue_s = [*self.stats.queue_s[-255:], job.started_at - job.queued_at]
                outcome = self._run(job)
                with self._mutex:
                    self._current = None
                    job.running = False
                    self.stats.running -= 1
                    setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            job._put(_END)

    def _run(self, job: Job) -> str:
        try:
            for ev in job._start():
                job._put(ev)
                if job.cancelled:
                    self.cancel_current()  # covers a cancel that came before generate() cleared the flag
            return "cancelled" if job.cancelled else "completed"
        except BaseException as e:  # handed to the request, which turns it into an HTTP error
            job._put(e)
            return "failed"
