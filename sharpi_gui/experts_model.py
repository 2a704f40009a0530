"""The experts dock's state: the latest profiler frame, the heatmap mode, the live poll, export, the expert
cache's policy and recording the model's routing into the user's routing history.

While tokens stream, a timer pulls a snapshot through the bridge every :data:`POLL_MS` (5 Hz); a
snapshot is a copy of a few small arrays, so polling costs the engine next to nothing.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal

from sharpi_gui import data as D

POLL_MS = 200
AFTER_LOAD_MS = 80
MODES = ("heat", "residency", "hit")
MODE_LABELS = {"heat": "access heat (decayed)", "residency": "cache residency", "hit": "hit ratio"}


class ExpertsModel(QObject):
    frameChanged = Signal(object)  # StatsFrame
    modeChanged = Signal(str)
    policyChanged = Signal(str)  # the cache policy in force (after a load, or a change applied)
    recordingChanged = Signal(bool)

    def __init__(self, bridge, mode: str = "heat", parent: QObject | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.mode = mode if mode in MODES else "heat"
        self.frame: D.StatsFrame | None = None
        self.frames = 0  # frames received (tests and the refresh-rate measurement read it)
        self.policy = D.DEFAULT_CACHE_POLICY
        self.recording = False
        self._timer = QTimer(self)
        self._timer.setInterval(POLL_MS)
        self._timer.timeout.connect(lambda: self.poll(force=True))  # a steady rate, however slow the tokens
        bridge.statsUpdated.connect(self._on_frame)
        bridge.busyChanged.connect(self._on_busy)
        # After a load, draw the new model's first frame a moment later, in a pass of its own: the
        # window repaints its other views first, and no single pass grows long.
        bridge.loaded.connect(lambda *_: QTimer.singleShot(AFTER_LOAD_MS, lambda: self.poll(force=True)))
        bridge.loaded.connect(self._on_limits)
        bridge.applied.connect(self._on_limits)

    @property
    def live(self) -> bool:
        return self._timer.isActive()

    def image(self) -> object | None:
        """The [L, E] float64 array the heatmap shows in the current mode (None before a frame)."""
        f = self.frame
        if f is None:
            return None
        return {"heat": f.heat, "residency": f.residency, "hit": f.hit_ratio}[self.mode]

    def set_mode(self, mode: str) -> None:
        if mode in MODES and mode != self.mode:
            self.mode = mode
            self.modeChanged.emit(mode)

    def poll(self, force: bool = False) -> None:
        self.bridge.poll_stats(force=force)

    def export(self, prefix: str) -> tuple[str, str]:
        """JSON + CSV of one snapshot (which also becomes the frame shown); returns both paths."""
        return self.bridge.export_stats(prefix)

    def set_policy(self, name: str) -> bool:
        """Ask for cache policy ``name`` (the bridge rebuilds a cache in force); False if it cannot now."""
        if name == self.policy:
            return True
        return self.bridge.set_cache_policy(name)

    def set_recording(self, on: bool) -> str:
        """Start recording routing, or stop and save it into the routing history (returns the file, or "")."""
        path = self.bridge.record_routes(on)
        self.recording = self.bridge.recording_routes
        self.recordingChanged.emit(self.recording)
        return path

    def _on_limits(self, _card, limits: D.PlacementLimits) -> None:
        if limits.cache_policy != self.policy:
            self.policy = limits.cache_policy
            self.policyChanged.emit(self.policy)
        if self.recording != self.bridge.recording_routes:  # a new model: nothing recording
            self.recording = self.bridge.recording_routes
            self.recordingChanged.emit(self.recording)

    def _on_frame(self, frame: D.StatsFrame) -> None:
        self.frame = frame
        self.frames += 1
        self.frameChanged.emit(frame)

    def _on_busy(self, state: str) -> None:
        if state == "generating":
            self._timer.start()
        elif self._timer.isActive():
            self._timer.stop()
            self.poll()  # the last tokens of the run
