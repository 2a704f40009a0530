"""The bridge's worker: a QObject on the engine thread that loads, generates and applies placements, and
reports through queued signals (the facade, :class:`sharpi_gui.bridge.EngineBridge`, owns it)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from engine import config
from engine.api import AUTO_CTX, LoadOptions, Progress, Session
from engine.errors import SharpIError
from engine.generate import SamplingParams
from engine.plan import DeviceProfile
from engine.preflight import refusal
from engine.remote import RemoteSession
from engine.warmup import WarmUp, warm_up
from sharpi_gui import data as D
from sharpi_gui.bridge import convert as C

log = logging.getLogger("sharpi_gui.bridge")


def _lower_engine_priority() -> None:
    """Renice the calling thread (the worker) and start numba's pool from it, so the pool's threads
    inherit the lower priority. Linux only: elsewhere setpriority would renice the whole process."""
    import numba

    nice = config.current().engine_nice
    if sys.platform.startswith("linux") and nice > 0:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), min(nice, 19)))
        except OSError as e:  # a sandbox may forbid it: responsiveness then rests on the GIL alone
            log.info("could not lower the engine thread's priority: %s", e)
    numba.get_num_threads()  # starts numba's thread pool here (a no-op if it already runs)


REMOTE_TIMEOUT_S = 600.0  # the longest a remote reply may go without a byte (a long prompt on a busy server)


# -- the worker (lives on the engine thread) ---------------------------------------------------------


class _LoadCancelled(Exception):
    """Raised from a load's progress callback once the user pressed Cancel."""


def _cancelled(path: str) -> D.Failure:
    return D.Failure(D.ERR_CANCELLED, "Loading cancelled", f"{Path(path).name} was not opened.")


class _Worker(QObject):
    progress = Signal(int, int, str)
    loaded = Signal(object)  # C.Loaded
    warning = Signal(str)  # something the user should know that is not an error
    replanned = Signal(str, str)  # `auto` re-planned on the conversation's routing: (headline, the full note)
    loadFailed = Signal(object)  # Failure
    token = Signal(int, str, object)  # request id, text delta, GenStats
    thought = Signal(int, str)  # request id, reasoning delta (emitted before the event's token)
    trimmed = Signal(int, int, int)  # request id, messages left out of the prompt, context size
    finished = Signal(int, object)  # request id, final GenStats
    failed = Signal(int, object)  # request id, Failure
    applied = Signal(object)  # C.Loaded (with the new placement's limits)
    applyFailed = Signal(object)  # Failure
    applyProgress = Signal(int, int, str)  # done, total, what: the slow part of a re-placement (the host copy)
    waiting = Signal(int)  # request id: the chat waits for an API request to finish (the local server)
    connected = Signal(object)  # C.Remote

    def __init__(self, model_lock: threading.Lock, simulate_device: bool = False) -> None:
        super().__init__()
        self.simulate_device = simulate_device  # without a GPU, offer the simulated device (tests)
        self.cancel_load = threading.Event()  # set by the UI thread: the load in progress stops
        self.current: C.Loaded | C.Remote | None = None  # replaced whole, so a reader sees one consistent value
        self.n_generated = 0  # tokens of the generation in progress (read by Stop)
        # Held around everything that uses or replaces the session; the local server's requests take it
        # too, so a chat and an API request never run at once.
        self.model_lock = model_lock
        self.holding = False  # a chat generation holds the lock (Stop may cancel the session)
        self.stop_waiting = threading.Event()  # Stop while the chat waits for the lock
        self.on_replaced = None  # called (holding the lock) with the new C.Loaded or None: the server follows

    @Slot()
    def start(self) -> None:
        _lower_engine_priority()

    @Slot(str, int, str, object)
    def load(self, path: str, n_ctx: int, kv_type: str, placement: D.PlanSettings | None) -> None:
        """Open ``path`` with ``n_ctx`` tokens of context (0 = the model's default, as ``sharpi run``:
        engine.plan.default_ctx); place it as ``placement`` asks (vram_bytes, moe, n_gpu_layers), else on the
        GPU when there is one (as ``sharpi run``), else everything on the CPU."""
        title = f"Could not open {Path(path).name}"
        try:
            # A file that cannot run here (no weights, more than RAM + GPU memory) is refused before
            # any weight is read, with the reason.
            self.progress.emit(0, 4, "checking the file")
            reason = refusal(path)
        except Exception as e:  # every failure becomes a dialog, never a crash
            self._log(e)
            self.loadFailed.emit(C.failure(e, title))
            return
        if reason:
            self.loadFailed.emit(D.Failure(D.ERR_CANNOT_RUN, f"{Path(path).name} cannot run here", reason))
            return

        def report(done: int, total: int, what: str) -> None:
            if self.cancel_load.is_set():
                raise _LoadCancelled
            self.progress.emit(done, total, what)

        try:
            session = Session.load(
                path, LoadOptions(n_ctx=n_ctx if n_ctx > 0 else AUTO_CTX, kv_type=kv_type or None), progress=report
            )
        except _LoadCancelled:
            self.loadFailed.emit(_cancelled(path))
            return
        except Exception as e:  # every failure becomes a dialog, never a crash
            self._log(e)
            self.loadFailed.emit(C.failure(e, title))
            return
        try:
            spec = session.spec
            if session.device.type == "cuda":
                self.progress.emit(3, 4, "measuring the device (once per machine)")
            profile = C.device_profile(session)
            ctx = session.n_ctx
            requested = self._initial_placement(session, profile, placement, ctx, report)
            warm = self._warm_up(session, report)
            limits = C.limits(
                session, spec, profile, requested, warm.decode_tok_s if warm else 0.0, self.offers_device(session)
            )
            loaded = C.Loaded(session, spec, profile, C.card(session, spec), limits)
        except _LoadCancelled:
            session.close()
            self.loadFailed.emit(_cancelled(path))
            return
        except Exception as e:
            session.close()
            self._log(e)
            self.loadFailed.emit(C.failure(e, title))
            return
        self._replace(loaded)
        self.loaded.emit(loaded)

    @Slot(str, str, str)
    def connect_remote(self, base_url: str, api_key: str, model: str) -> None:
        """Chat through the OpenAI-compatible endpoint at ``base_url`` (ending in /v1) with ``model``
        (empty: the first it lists) in place of the loaded model, which is closed."""
        try:
            session = RemoteSession(base_url, api_key=api_key or None, model=model or None, timeout=REMOTE_TIMEOUT_S)
        except Exception as e:
            self._log(e)
            self.loadFailed.emit(C.failure(e, f"Could not connect to {base_url}"))
            return
        remote = C.Remote(session, D.RemoteInfo(session.base_url, session.model, tuple(session.models)))
        self._replace(remote)
        self.connected.emit(remote)

    def _replace(self, new: C.Loaded | C.Remote) -> None:
        with self.model_lock:
            old, self.current = self.current, new
            if self.on_replaced is not None:
                self.on_replaced(new)
            if old is not None:
                old.session.close()

    def _warm_up(self, session: Session, report) -> WarmUp | None:
        """Run the model once so the first question finds its kernels ready (engine.warmup): on a
        machine that never compiled them, this is where they compile, with "k of N" on screen.
        ``report``: the load's progress (raises _LoadCancelled when Cancel was pressed)."""
        report(4, 4, "warming up")

        def kernels(k: int, n: int, estimated: bool) -> None:
            report(k, n, f"{D.PREPARING} — {k} of {'about ' if estimated else ''}{n}")

        try:
            return warm_up(session, kernels)
        except SharpIError as e:  # a model that cannot run a short prompt says so on the first question
            log.info("warm-up skipped: %s", e)
            return None

    def offers_device(self, session: Session) -> bool:
        """Whether the placement controls offer a device: a GPU, or the simulated one when asked."""
        return session.device.type == "cuda" or self.simulate_device

    def _initial_placement(
        self,
        session: Session,
        profile: DeviceProfile,
        saved: D.PlanSettings | None,
        ctx: int,
        report: Progress | None = None,
    ) -> D.PlanSettings | None:
        """Place a freshly loaded session; returns the settings in force (None: the CPU). ``report``: the load's
        progress (the expert cache's host copy is told layer by layer)."""
        cpu_only = D.PlanSettings(vram_bytes=0, ctx=ctx, kv_type=session.kv_type, n_gpu_layers=0)
        if not self.offers_device(session):
            saved = None  # a placement saved on a machine with a GPU: here there is none to use
        if saved is not None:
            wanted = replace(saved, ctx=ctx, kv_type=session.kv_type)
        elif session.device.type == "cuda":
            wanted = D.PlanSettings(vram_bytes=profile.vram_bytes, ctx=ctx, kv_type=session.kv_type)
        elif ctx != session.n_ctx:
            wanted = cpu_only  # only the context changes
        else:
            return None
        try:
            session.apply(session.plan(C.plan_request(wanted), profile.with_budget(wanted.vram_bytes)), progress=report)
            return None if wanted is cpu_only else wanted
        except SharpIError as e:
            self.warning.emit(f"The saved placement could not be applied ({e}); the model runs on the CPU.")
            if ctx != session.n_ctx:
                session.apply(session.plan(C.plan_request(cpu_only), profile.with_budget(0)))
            return None

    @Slot(int, object, object, object)
    def generate(self, rid: int, messages: list, sampling: dict, cancel: threading.Event | None = None) -> None:
        cur = self.current
        if cur is None:
            self.failed.emit(rid, D.Failure(D.ERR_NO_MODEL, "No model", "Open a model first (File → Open)."))
            return
        self.n_generated = 0
        if not self.model_lock.acquire(blocking=False):
            self.waiting.emit(rid)
            self.model_lock.acquire()
        try:
            self.holding = True  # before looking at stop_waiting: Stop sets that flag, then reads this one
            cur = self.current  # the model may have changed while the chat waited
            if self.stop_waiting.is_set() or cur is None:  # stopped while it waited: nothing ran
                self.finished.emit(rid, D.GenStats(finish_reason="cancelled" if cur is not None else None))
                return
            params = SamplingParams(**sampling)
            # A conversation longer than the context loses its oldest turns, never the reply.
            messages, dropped = cur.session.fit_messages(messages, params.max_tokens)
            if dropped:
                self.trimmed.emit(rid, dropped, cur.session.n_ctx)
            final = D.GenStats()
            local = isinstance(cur, C.Loaded)  # a remote endpoint's session is placed by its server
            replans = len(cur.session.replans) if local else 0
            events = cur.session.generate(messages=messages, params=params, cancel=cancel)
            if local and len(cur.session.replans) > replans:  # `auto` planned again on the conversation's routing
                try:
                    self._republish(cur)
                except Exception as e:  # the reply goes on; the placement view catches up on the next change
                    self._log(e)
                self.replanned.emit(cur.session.replans[-1].headline, cur.session.replans[-1].note)
            for ev in events:
                final = C.gen_stats(ev)
                self.n_generated = ev.n_generated
                if self.stop_waiting.is_set():  # a Stop that came while generate() started
                    cur.session.cancel()
                if ev.reasoning:
                    self.thought.emit(rid, ev.reasoning)
                if ev.text or not ev.done:
                    self.token.emit(rid, ev.text, final)
        except Exception as e:
            self._log(e)
            self.failed.emit(rid, C.failure(e, "Generation failed"))
            return
        finally:
            self.holding = False
            self.model_lock.release()
        self.finished.emit(rid, final)

    @Slot(object)
    def apply(self, settings: D.PlanSettings) -> None:
        cur = self.current
        title = "Could not apply the placement"
        if not isinstance(cur, C.Loaded):
            why = "A remote model is placed by its server." if cur else "Open a model first (File → Open)."
            self.applyFailed.emit(D.Failure(D.ERR_NO_MODEL, title, why))
            return
        try:
            placement = C.plan_for(cur, settings)
            with self.model_lock:  # not while an API request generates
                cur.session.apply(placement, progress=lambda k, n, what: self.applyProgress.emit(k, n, what))
            card = C.card(cur.session, cur.spec)
            limits = C.limits(
                cur.session,
                cur.spec,
                cur.profile,
                settings if placement.n_gpu_layers else None,
                cur.limits.measured_tok_s,
                self.offers_device(cur.session),
            )
            loaded = replace(cur, card=card, limits=limits)
        except Exception as e:  # the previous placement stays
            self._log(e)
            self.applyFailed.emit(C.failure(e, title))
            return
        self.current = loaded
        self.applied.emit(loaded)

    @Slot(str)
    def set_cache_policy(self, name: str) -> None:
        self._changed(lambda s: s.set_cache_policy(name), "Could not change the cache policy")

    @Slot(bool)
    def set_routing_history(self, use: bool) -> None:
        self._changed(lambda s: s.set_routing_history(use), "Could not read the routing history")

    def _changed(self, change, title: str) -> None:
        """Change the loaded session (``change(session)``) and publish it as an apply does: the placement in
        force (re-applied if the change did), the profile's hit-rate curve, the limits."""
        cur = self.current
        if not isinstance(cur, C.Loaded):
            why = "A remote model is placed by its server." if cur else "Open a model first (File → Open)."
            self.applyFailed.emit(D.Failure(D.ERR_NO_MODEL, title, why))
            return
        try:
            with self.model_lock:
                change(cur.session)
            self._republish(cur)
        except Exception as e:
            self._log(e)
            self.applyFailed.emit(C.failure(e, title))

    def _republish(self, cur: C.Loaded) -> None:
        """Publish the loaded session as an apply does after the session changed itself: the placement in force,
        the profile's hit-rate curve, the limits."""
        curve = cur.session.hit_curve()
        profile = replace(cur.profile, hit_curve=curve.points, hit_curve_source=curve.detail)
        limits = C.limits(
            cur.session,
            cur.spec,
            profile,
            cur.limits.applied,
            cur.limits.measured_tok_s,
            self.offers_device(cur.session),
        )
        self.current = loaded = replace(cur, profile=profile, card=C.card(cur.session, cur.spec), limits=limits)
        self.applied.emit(loaded)

    @Slot()
    def close(self) -> None:
        with self.model_lock:
            cur, self.current = self.current, None
            if self.on_replaced is not None:
                self.on_replaced(None)
            if cur is not None:
                cur.session.close()

    @staticmethod
    def _log(e: BaseException) -> None:
        if isinstance(e, SharpIError):
            log.info("engine error: %s", e)
        else:
            log.exception("unexpected error in the engine worker", exc_info=e)
