"""The one module that talks to the engine: a long-lived worker on a QThread behind a small facade.

Views and models never import the engine; they call :class:`EngineBridge` and receive the plain
records of :mod:`sharpi_gui.data` through its signals. Loading, generating and applying a
placement run on the worker thread; three cheap, thread-safe engine calls run on the caller's
(UI) thread: ``Session.cancel`` (Stop), ``Session.stats`` (the experts dock's poll) and the pure
planner (the placement preview, < 1 ms).

    bridge = EngineBridge()
    bridge.loaded.connect(...); bridge.token.connect(...)
    bridge.load("model.gguf")
    rid = bridge.generate([{"role": "user", "content": "hi"}], {"temperature": 0.7})
    bridge.stop()
    bridge.connect_remote("http://gpu-box:8000/v1", api_key, model)  # chat through an OpenAI endpoint instead
    bridge.shutdown()  # before the application quits
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QObject, QThread, Signal

from engine import config
from engine.errors import SharpIError
from engine.generate import SamplingParams
from engine.library import default_folders
from engine.library import scan as library_scan
from engine.plan import PlanError
from engine.profiler import export as export_profile
from engine.remote import RemoteSession
from sharpi_gui import data as D
from sharpi_gui.bridge import convert as C
from sharpi_gui.bridge.worker import _Worker

log = logging.getLogger(__name__)


def preload_engine() -> None:
    """Import on the calling (UI) thread, at start-up, what the engine would otherwise import lazily
    on the worker during the first load and generation: the model and tokenizer modules, numba's
    typing registries and its thread pool. Imports on the worker held the GIL and froze the
    window for up to ~280 ms (measured with py-spy); here they cost ~250 ms once, before the
    window shows. (numba's thread pool starts on the worker, see worker._lower_engine_priority.)"""

    from numba.core.registry import cpu_target

    import engine.models
    import engine.tokenizer
    import engine.tokenizer.chat  # noqa: F401

    for arch in engine.models.SUPPORTED_ARCHITECTURES:
        engine.models.arch_module(arch)  # its module (gpt-oss: engine.models.gpt_oss)
    cpu_target.target_context.refresh()  # numba's lazy registry import (~70 modules)
    # Everything imported so far lives as long as the process. A full garbage collection scans it
    # all while holding the GIL (128 ms measured, triggered on the worker during a load); frozen
    # objects are left out of every later collection.
    gc.freeze()


# The engine's threads run this much nicer than the UI thread (Linux, where nice is per thread):
# when the cores are busy, the window still gets the CPU it needs to stay responsive. The price:
# against other busy programs the engine gets less CPU too. $SHARPI_ENGINE_NICE overrides (0 = off;
# engine.config's EngineOptions.engine_nice).


LIST_TIMEOUT_S = 10.0  # listing an endpoint's models for the connect dialog
SAMPLING_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "repeat_last_n",
    "seed",
    "max_tokens",
)
DEFAULT_SAMPLING = {k: getattr(SamplingParams(), k) for k in SAMPLING_KEYS}


# -- the facade (lives on the UI thread) -------------------------------------------------------------

IDLE, LOADING, GENERATING, APPLYING = "idle", "loading", "generating", "applying"
CAL_RUNNING, CAL_DONE, CAL_PAUSED, CAL_CANCELLED, CAL_FAILED = "running", "done", "paused", "cancelled", "failed"


class EngineBridge(QObject):
    """The app's handle on the engine. Call from the UI thread; signals arrive on the UI thread."""

    busyChanged = Signal(str)  # IDLE | LOADING | GENERATING | APPLYING
    loadStarted = Signal(str)  # path
    loadProgress = Signal(int, int, str)  # done, total, what
    loaded = Signal(object, object)  # ModelCard, PlacementLimits
    warning = Signal(str)  # a note for the status bar (e.g. a saved placement that no longer fits)
    replanned = Signal(str, str)  # the placement re-planned itself: (a status-bar headline, the full note)
    loadFailed = Signal(object)  # Failure
    token = Signal(int, str, object)  # request id, text delta, GenStats
    thought = Signal(int, str)  # request id, reasoning delta (before the same event's token)
    trimmed = Signal(int, int, int)  # request id, oldest messages left out to fit the context, its size
    finished = Signal(int, object)  # request id, final GenStats
    failed = Signal(int, object)  # request id, Failure
    applied = Signal(object, object)  # ModelCard, PlacementLimits
    applyFailed = Signal(object)  # Failure
    applyProgress = Signal(int, int, str)  # done, total, what: a re-placement's slow part (the experts' host copy)
    statsUpdated = Signal(object)  # StatsFrame
    libraryEntry = Signal(object)  # LibraryEntry, one per file found (from a background thread)
    libraryDone = Signal(int)  # files judged

    waiting = Signal(int)  # request id: the chat waits while the local server answers a request
    serverChanged = Signal(object)  # ServerStatus
    serverRequest = Signal(object)  # ServerRequest: one answered API request (any thread emits; queued)
    remoteConnected = Signal(object)  # RemoteInfo: the chat now streams from this endpoint
    remoteModels = Signal(int, object, str)  # ticket, the model ids listed (None on failure), the error
    # The CPU calibration (engine.bench.calibrate_host.calibrate_host) the app runs in the background without a GPU:
    calibrationProgress = Signal(int, int, str)  # step, steps, what is measured
    calibrationEnded = Signal(str, str)  # CAL_DONE | CAL_PAUSED | CAL_CANCELLED | CAL_FAILED, a detail
    calibrated = Signal(object, object)  # ModelCard, PlacementLimits: the loaded model's predictions, now measured
    _calibrationDone = Signal(bool, float, str)  # from the job's reader thread

    _doLoad = Signal(str, int, str, object)
    _doGenerate = Signal(int, object, object, object)
    _doApply = Signal(object)
    _doCachePolicy = Signal(str)
    _doRoutingHistory = Signal(bool)
    _doClose = Signal()
    _doConnect = Signal(str, str, str)

    default_sampling = DEFAULT_SAMPLING  # the engine's sampling defaults (the settings dialog's "restore")

    def __init__(
        self, parent: QObject | None = None, simulate_device: bool = False, calibrate_cpu: bool = False
    ) -> None:
        super().__init__(parent)
        preload_engine()  # once per process; later calls find everything imported
        # Without a GPU, measure this CPU once (in a child process, after the model is warmed up) so that
        # predictions are this machine's; the app does, tests opt in.
        self.calibrate_cpu = calibrate_cpu
        self.calibration_state = ""  # "" (none needed or not yet), CAL_RUNNING, or how it last ended
        self._calib_job = None
        self._calib_user_cancelled = False
        self._calibrationDone.connect(self._on_calibration_done)
        self._state = IDLE
        self._rid = 0
        self._stop_event: threading.Event | None = None  # the generation in progress
        self._last_tokens = -1
        self.loading_path = ""  # the file the latest load opened
        self._thread = QThread()
        self._thread.setObjectName("sharpi-engine")
        self._model_lock = threading.Lock()
        self._host_lock = threading.RLock()  # hands the loaded model to the server's host
        self._server = None  # engine.server.UvicornServer while the local server runs
        self._server_host = None  # its engine.server.ModelHost
        self._worker = _Worker(self._model_lock, simulate_device)
        self._worker.on_replaced = self._follow_model
        self._worker.moveToThread(self._thread)
        self._thread.started.connect(self._worker.start)
        self._doLoad.connect(self._worker.load)
        self._doGenerate.connect(self._worker.generate)
        self._doApply.connect(self._worker.apply)
        self._doCachePolicy.connect(self._worker.set_cache_policy)
        self._doRoutingHistory.connect(self._worker.set_routing_history)
        self._recorder = None  # the route recorder while the experts dock records routing
        self._doClose.connect(self._worker.close)
        self._doConnect.connect(self._worker.connect_remote)
        self._list_ticket = 0
        w = self._worker
        w.progress.connect(self.loadProgress)
        w.loaded.connect(self._on_loaded)
        w.warning.connect(self.warning)
        w.replanned.connect(self.replanned)
        w.loadFailed.connect(self._on_load_failed)
        w.token.connect(self.token)
        w.thought.connect(self.thought)
        w.trimmed.connect(self.trimmed)
        w.finished.connect(self._on_finished)
        w.failed.connect(self._on_failed)
        w.applied.connect(self._on_applied)
        w.applyFailed.connect(self._on_apply_failed)
        w.applyProgress.connect(self.applyProgress)
        w.waiting.connect(self.waiting)
        w.connected.connect(self._on_connected)
        self._thread.start()
        app = QCoreApplication.instance()
        if app is not None:  # however the application ends, the engine thread ends first
            app.aboutToQuit.connect(self.shutdown)

    # -- state ----------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def has_model(self) -> bool:
        return self._worker.current is not None

    @property
    def model_card(self) -> D.ModelCard | None:
        cur = self._worker.current
        return cur.card if isinstance(cur, C.Loaded) else None

    @property
    def limits(self) -> D.PlacementLimits | None:
        cur = self._worker.current
        return cur.limits if isinstance(cur, C.Loaded) else None

    @property
    def remote(self) -> D.RemoteInfo | None:
        """The endpoint the chat streams from, when it is a remote one."""
        cur = self._worker.current
        return cur.info if isinstance(cur, C.Remote) else None

    @property
    def _local(self) -> C.Loaded | None:
        cur = self._worker.current
        return cur if isinstance(cur, C.Loaded) else None

    def _set_state(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self.busyChanged.emit(state)

    # -- requests -------------------------------------------------------------------------------
    def load(self, path: str, n_ctx: int = 0, kv_type: str = "", placement: D.PlanSettings | None = None) -> bool:
        """Start loading ``path`` on the worker; False if the engine is busy. ``placement``: the
        budget, expert mode and GPU layers to place it with (None: the GPU if any, else the CPU)."""
        if self._state != IDLE:
            return False
        self._set_state(LOADING)
        self.loading_path = str(path)
        self._worker.cancel_load.clear()
        self.loadStarted.emit(str(path))
        self._doLoad.emit(str(path), int(n_ctx), kv_type, placement)
        return True

    def connect_remote(self, base_url: str, api_key: str = "", model: str = "") -> bool:
        """Chat through an OpenAI-compatible endpoint (vLLM, SGLang, llama-server, ``sharpi serve``) in place
        of a local model, which is closed; ``remoteConnected`` or ``loadFailed`` follows. The key stays in
        this process's memory. False if the engine is busy."""
        if self._state != IDLE:
            return False
        self._set_state(LOADING)
        self._doConnect.emit(base_url, api_key, model)
        return True

    def list_remote_models(self, base_url: str, api_key: str = "") -> int:
        """List the endpoint's models on a thread of its own (the worker may be generating); returns a
        ticket that ``remoteModels`` carries back with the ids, or None and the error."""
        self._list_ticket += 1
        ticket = self._list_ticket

        def run() -> None:
            try:
                with RemoteSession(base_url, api_key=api_key or None, timeout=LIST_TIMEOUT_S) as r:
                    models, error = r.models, ""
            except Exception as e:  # shown in the dialog, never raised
                models, error = None, C.failure(e, "").message
            self.remoteModels.emit(ticket, models, error)  # queued to the UI thread

        threading.Thread(target=run, name="sharpi-list-models", daemon=True).start()
        return ticket

    def generate(self, messages: list[dict], sampling: dict | None = None) -> int:
        """Start a chat completion; returns its request id (0 if the engine is busy or empty)."""
        if self._state != IDLE or not self.has_model:
            return 0
        self._rid += 1
        self._pause_calibration()  # the chat never waits for it, nor shares the cores with it
        params = {**DEFAULT_SAMPLING, **{k: v for k, v in (sampling or {}).items() if k in SAMPLING_KEYS}}
        self._set_state(GENERATING)
        # made with the request: a Stop before the worker starts it (or while it waits for an API request) is not lost
        self._stop_event = threading.Event()
        self._worker.stop_waiting.clear()
        self._doGenerate.emit(self._rid, [dict(m) for m in messages], params, self._stop_event)
        return self._rid

    def cancel_load(self) -> None:
        """Stop the load in progress at its next step (between loading stages, between kernels while
        they compile); the model loaded before stays."""
        if self._state == LOADING:
            self._worker.cancel_load.set()

    def use_chatml(self) -> bool:
        """Chat with ChatML instead of the model's failing template (until the next load); False if busy."""
        cur = self._local
        if cur is None or self._state != IDLE:
            return False
        cur.session.use_chatml()
        return True

    def stop(self) -> int:
        """Stop the generation in progress within one token (or, while the chat waits for an API
        request, before it starts); returns the tokens made so far."""
        n = self._worker.n_generated
        if self._state == GENERATING:
            self._worker.stop_waiting.set()  # the worker, once it holds the model, starts nothing
            if self._stop_event is not None:
                self._stop_event.set()  # the generation's own event: stops it wherever it is
            cur = self._worker.current
            if isinstance(cur, C.Remote) and self._worker.holding:
                cur.session.cancel()  # cuts the connection: ends at once, even while the server is silent
        return n

    # -- the local server (OpenAI-compatible API over the loaded model) --------------------------
    def start_server(self, host: str = "127.0.0.1", port: int = 8080, api_key: str = "") -> D.ServerStatus:
        """Serve the loaded model (and whatever the app loads later) over HTTP; the chat and the API
        share the model and never generate at once. Returns the status (``error`` set if it failed)."""
        from engine.server import ModelHost, ServerOptions, UvicornServer

        if self._server is not None:
            return self.server_status()
        mh = ModelHost("model", lock=self._model_lock)
        mh.add_listener(self._on_server_request)
        with self._host_lock:  # a load finishing meanwhile sees the new host, or we see its model
            self._server_host = mh
            self._follow_model(self._worker.current)
        server = UvicornServer(mh, host, int(port), ServerOptions(api_key=api_key or None))
        try:
            server.start()
        except OSError as e:
            self._server_host = None
            status = D.ServerStatus(False, host=host, port=int(port), error=f"The server could not start: {e}")
            self.serverChanged.emit(status)
            return status
        self._server = server
        status = self.server_status()
        self.serverChanged.emit(status)
        return status

    def stop_server(self) -> None:
        server, self._server, self._server_host = self._server, None, None
        if server is not None:
            server.stop()
            server.host.runner.close()
            self.serverChanged.emit(self.server_status())

    def server_status(self) -> D.ServerStatus:
        s, mh = self._server, self._server_host
        if s is None or mh is None:
            return D.ServerStatus(False)
        return D.ServerStatus(
            True, url=s.url, host=s.bind, port=s.port, model_id=mh.model_id, n_requests=mh.n_requests,
            queued=mh.runner.stats.waiting, api_key=bool(s.options.api_key),
        )  # fmt: skip

    def _follow_model(self, loaded: C.Loaded | C.Remote | None) -> None:
        """The server serves what the chat has loaded. Called by the worker holding the model lock (no API
        request runs on the session being replaced) and by start_server (a new host runs nothing yet)."""
        with self._host_lock:
            mh = self._server_host
            if mh is None:
                return
            if loaded is None:
                mh.set_unavailable("no model is loaded in the app")
            elif isinstance(loaded, C.Remote):
                mh.set_unavailable("the app chats with a remote endpoint; it serves local models only")
            else:
                mh.set_session(loaded.session, Path(loaded.card.path).stem)

    def _on_server_request(self, rec) -> None:  # on the server's thread: the signal is queued to the UI
        self.serverRequest.emit(
            D.ServerRequest(
                rec.at, rec.route, rec.status, rec.prompt_tokens, rec.completion_tokens, rec.decode_tok_s,
                rec.duration_s, rec.finish_reason,
            )
        )  # fmt: skip

    def preview(self, settings: D.PlanSettings) -> D.PlanPreview:
        """Plan ``settings`` for the loaded model (pure and fast: called on every slider move)."""
        cur = self._worker.current
        if not isinstance(cur, C.Loaded):
            why = "A remote model is placed by its server." if cur else "No model is loaded."
            return D.PlanPreview(settings, error=why)
        try:
            return C.preview(settings, C.plan_for(cur, settings))
        except PlanError as e:
            return D.PlanPreview(settings, error=str(e), budget_bytes=settings.vram_bytes)

    def apply(self, settings: D.PlanSettings) -> bool:
        """Re-place the loaded model as ``settings`` ask (on the worker); False if busy."""
        if self._state != IDLE or self._local is None:
            return False
        self._set_state(APPLYING)
        self._doApply.emit(settings)
        return True

    def set_cache_policy(self, name: str) -> bool:
        """The expert cache's policy from now on (a cache in force is rebuilt with it, on the worker: the
        ``applied`` signal follows); False if busy or no local model."""
        if self._state != IDLE or self._local is None or name not in D.CACHE_POLICIES:
            return False
        self._set_state(APPLYING)
        self._doCachePolicy.emit(name)
        return True

    def set_routing_history(self, use: bool) -> bool:
        """ "Use my routing history": re-price the cache with the user's recorded routing (or the synthetic curve),
        on the worker (replaying a new trace takes seconds); ``applied`` follows. False if busy or no local model."""
        if self._state != IDLE or self._local is None:
            return False
        self._set_state(APPLYING)
        self._doRoutingHistory.emit(bool(use))
        return True

    @property
    def recording_routes(self) -> bool:
        return self._recorder is not None

    def record_routes(self, on: bool) -> str:
        """Start recording the loaded model's routing (tokens then run layer by layer: the same output, slower),
        or stop and save what was recorded into the routing history. Returns the file saved ("" when starting or
        nothing was recorded); raises OSError when there is no local model or it is busy."""
        cur = self._local
        if cur is None:
            raise OSError("a remote model's routing cannot be recorded" if self.has_model else "no model is loaded")
        if self._state != IDLE:
            raise OSError("the model is busy: try again when the reply has finished")
        if on:
            if self._recorder is None:
                self._recorder = cur.session.record_routes()
            return ""
        rec, self._recorder = self._recorder, None
        if rec is None:
            return ""
        cur.session.stop_recording_routes()
        if not rec.n_tokens:
            return ""
        path = cur.session.save_routes_to_history(rec)
        if cur.limits.routing_history:  # the new trace counts at once
            self.set_routing_history(True)
        return path

    def poll_stats(self, force: bool = False) -> D.StatsFrame | None:
        """Emit and return a fresh :class:`StatsFrame` if tokens went through since the last one."""
        cur = self._local
        if cur is None:  # no model, or a remote one: no expert statistics
            return None
        snap = cur.session.stats()
        if not force and snap.tokens_total == self._last_tokens:
            return None
        self._last_tokens = snap.tokens_total
        frame = C.stats_frame(snap)
        self.statsUpdated.emit(frame)
        return frame

    def export_stats(self, prefix: str) -> tuple[str, str]:
        """Write ``PREFIX.json`` and ``PREFIX.csv`` from one snapshot, and show that same snapshot."""
        cur = self._local
        if cur is None:
            raise OSError("a remote model has no profiler stats" if self.has_model else "no model is loaded")
        snap = cur.session.stats()
        j, c = export_profile(snap, prefix)
        self._last_tokens = snap.tokens_total
        self.statsUpdated.emit(C.stats_frame(snap))
        return str(j), str(c)

    def library_folders(self) -> list[str]:
        """The folders models are usually downloaded to that exist here (engine.library), then the folder of
        the bundled demo models (so the library lists each of them)."""
        folders = [str(p) for p in default_folders(os.environ)]
        demo = self.demo_model_path()
        if demo and str(Path(demo).parent) not in folders:
            folders.append(str(Path(demo).parent))
        return folders

    def scan_library(self, folders: list[str]) -> None:
        """Judge every GGUF file under ``folders`` from its header (engine.library: can it run here, how
        it would be placed, its predicted tok/s) on a background thread; entries arrive one by one
        (libraryEntry), then libraryDone. The planner uses the loaded model's device profile (this
        machine's calibrated speeds on CUDA) when there is one; without a GPU, this machine's cached CPU
        calibration for each file (engine.bench.calibrate_host.cached_cpu_profile) where there is one."""
        cur = self._worker.current
        profile = cur.profile if cur is not None and cur.limits.has_gpu else None

        def work() -> None:
            from engine.bench.calibrate_host import cached_cpu_profile

            n = 0
            try:
                for e in library_scan([Path(f) for f in folders], profile=profile, cpu_profile=cached_cpu_profile):
                    self.libraryEntry.emit(D.LibraryEntry(**vars(e)))
                    n += 1
            except Exception:  # a scan never takes the app down; what was found stays
                log.exception("model library scan failed")
            self.libraryDone.emit(n)

        threading.Thread(target=work, name="sharpi-library", daemon=True).start()

    def demo_model_path(self) -> str | None:
        """The bundled demo model, if this install has one."""
        try:
            from engine.demo import demo_model_path
        except ImportError:
            return None
        try:
            p = demo_model_path()
        except (SharpIError, OSError):
            return None
        return str(p) if p and Path(p).is_file() else None

    # -- the CPU calibration (no GPU: the predictions' speeds, measured once per machine) ---------------
    def calibration_needed(self) -> bool:
        """Whether the loaded model runs on the CPU alone and this machine's CPU calibration lacks something
        its predictions need (engine.bench.calibrate_host.host_calibration_needed: cached after the first run)."""
        from engine.bench.calibrate_host import host_calibration_needed

        cur = self._local
        if cur is None or cur.limits.has_gpu or cur.session.device.type == "cuda":
            return False
        return host_calibration_needed(cur.card.path, cur.session.engine_options)

    def start_calibration(self) -> bool:
        """Measure this CPU in the background for the loaded model (a few seconds; a child process), unless
        it is cached, running, cancelled by the user, or the engine is busy; ``calibrationProgress`` and
        ``calibrationEnded`` follow. Returns whether it started."""
        import numba

        from engine.bench.calibrate_host import HostCalibrationJob

        if self._calib_job is not None and self._calib_job.running:
            return False
        if self._calib_user_cancelled or self._state != IDLE or not self.calibration_needed():
            return False
        cur = self._local
        job = HostCalibrationJob(
            cur.card.path,
            on_progress=lambda k, n, what: self.calibrationProgress.emit(k, n, what),
            on_done=lambda ok, secs, msg: self._calibrationDone.emit(ok, secs, msg),
            threads=numba.get_num_threads(),
            options=cur.session.engine_options,
        )
        self._calib_job = job
        self.calibration_state = CAL_RUNNING
        self.calibrationProgress.emit(0, 0, "starting")
        job.start()
        return True

    def cancel_calibration(self) -> None:
        """The user's Cancel: stop measuring, and do not start again until the next launch."""
        self._calib_user_cancelled = True
        job = self._calib_job
        if job is not None and job.running:
            job.cancel()

    def _pause_calibration(self) -> None:
        job = self._calib_job
        if job is not None and job.running:
            self.calibration_state = CAL_PAUSED
            job.cancel()

    def _on_calibration_done(self, ok: bool, seconds: float, message: str) -> None:
        self._calib_job = None
        if ok:
            self.calibration_state = CAL_DONE
            self.calibrationEnded.emit(CAL_DONE, f"{seconds:.1f} s")
            cur = self._local
            if cur is not None and self._state == IDLE:
                self._refresh_cpu_profile(cur)
        elif self._calib_user_cancelled:
            self.calibration_state = CAL_CANCELLED
            self.calibrationEnded.emit(CAL_CANCELLED, message)
        elif self.calibration_state == CAL_PAUSED:
            self.calibrationEnded.emit(CAL_PAUSED, message)  # starts again when the engine is idle
            if self._state == IDLE:
                self.start_calibration()
        else:
            self.calibration_state = CAL_FAILED
            log.warning("CPU calibration failed: %s", message)
            self.calibrationEnded.emit(CAL_FAILED, message)

    def _refresh_cpu_profile(self, cur: C.Loaded) -> None:
        """The loaded CPU model's predictions with the calibration just measured (the placement dock's)."""
        profile = C.device_profile(cur.session)
        limits = C.limits(
            cur.session, cur.spec, profile, None, cur.limits.measured_tok_s, self._worker.offers_device(cur.session)
        )
        loaded = replace(cur, profile=profile, limits=limits)
        if self._worker.current is cur:
            self._worker.current = loaded
            self.calibrated.emit(loaded.card, loaded.limits)

    def shutdown(self) -> None:
        """Stop any generation, close the model and end the worker thread (blocks until it does)."""
        job, self._calib_job = self._calib_job, None
        if job is not None and job.running:
            self._calib_user_cancelled = True
            job.cancel()
        if not self._thread.isRunning():
            return
        self.stop_server()
        self.stop()
        self._doClose.emit()
        self._thread.quit()
        self._thread.wait()
        gc.unfreeze()  # let the interpreter's exit free what preload_engine froze (else nanobind reports leaks)

    # -- worker results -------------------------------------------------------------------------
    def _on_loaded(self, loaded: C.Loaded) -> None:
        self._last_tokens = -1
        self._recorder = None  # it recorded the model closed now
        self._set_state(IDLE)
        self.loaded.emit(loaded.card, loaded.limits)
        self._resume_calibration()

    def _resume_calibration(self) -> None:
        if self.calibrate_cpu and self._state == IDLE:
            self.start_calibration()

    def _on_connected(self, remote: C.Remote) -> None:
        self._last_tokens = -1
        self._recorder = None
        self._set_state(IDLE)
        self.remoteConnected.emit(remote.info)

    def _on_load_failed(self, failure: D.Failure) -> None:
        self._set_state(IDLE)
        self.loadFailed.emit(failure)

    def _on_finished(self, rid: int, stats: D.GenStats) -> None:
        self._set_state(IDLE)
        self.finished.emit(rid, stats)
        self._resume_calibration()

    def _on_failed(self, rid: int, failure: D.Failure) -> None:
        self._set_state(IDLE)
        self.failed.emit(rid, failure)
        self._resume_calibration()

    def _on_applied(self, loaded: C.Loaded) -> None:
        self._set_state(IDLE)
        self.applied.emit(loaded.card, loaded.limits)

    def _on_apply_failed(self, failure: D.Failure) -> None:
        self._set_state(IDLE)
        self.applyFailed.emit(failure)


def app_data_dir() -> str | None:
    """Where the app keeps conversations when ``$SHARPI_DATA_DIR`` says (``EngineOptions.data_dir``), else
    None: the store's platform default."""
    d = config.current().data_dir
    return None if d is None else str(d)
