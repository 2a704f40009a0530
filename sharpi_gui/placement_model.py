"""The placement dock's state: the requested settings, the latest preview, and Apply.

Control changes are throttled into re-plans: the first change plans at once, further changes within
:data:`REPLAN_MS` coalesce into one trailing re-plan of the latest settings (latest request wins),
so a dragging slider re-plans at most every ~150 ms and the view is never more than that behind.
"""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import QObject, QTimer, Signal

from sharpi_gui import data as D

REPLAN_MS = 150


class PlacementModel(QObject):
    limitsChanged = Signal(object)  # PlacementLimits (a model was loaded or a placement applied)
    settingsChanged = Signal(object)  # PlanSettings (the controls' values)
    previewChanged = Signal(object)  # PlanPreview
    applyFailed = Signal(object)  # Failure
    appliedChanged = Signal(object)  # PlanSettings now in force (None: the CPU)
    whatifChanged = Signal(bool)  # planning for a GPU this machine does not have (never applied)

    def __init__(self, bridge, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.limits: D.PlacementLimits | None = None
        self.settings: D.PlanSettings | None = None
        self.applied: D.PlanSettings | None = None
        self.preview: D.PlanPreview | None = None
        self.machine: D.PlacementLimits | None = None  # this machine's limits (self.limits in what-if mode)
        self.whatif = False
        self.replans = 0  # how many plans were computed (tests check the throttle with it)
        self._pending = False
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(REPLAN_MS)
        self._timer.timeout.connect(self._on_timer)
        bridge.loaded.connect(self._on_loaded)
        bridge.applied.connect(self._on_applied)
        bridge.calibrated.connect(self._on_calibrated)
        bridge.applyFailed.connect(self.applyFailed)

    @property
    def dirty(self) -> bool:
        """The controls differ from the placement in force (without a GPU: the CPU's context and KV)."""
        if self.settings is None:
            return False
        if self.limits is not None and not self.limits.has_gpu:
            return self.settings != self.limits.current
        return self.settings != self.applied

    # -- control changes ----------------------------------------------------------------------------
    def set_vram(self, vram_bytes: int) -> None:
        self._change(vram_bytes=int(vram_bytes))

    def set_ctx(self, ctx: int) -> None:
        self._change(ctx=int(ctx))

    def set_kv_type(self, kv_type: str) -> None:
        self._change(kv_type=kv_type)

    def set_moe(self, moe: str) -> None:
        self._change(moe=moe)

    def set_gpu_layers(self, n: int) -> None:
        self._change(n_gpu_layers=int(n))

    def set_routing_history(self, use: bool) -> bool:
        """ "Use my routing history" for the cache's hit rates (re-plans when the bridge has re-priced)."""
        if self.limits is None or bool(use) == self.limits.routing_history:
            return False
        return self.bridge.set_routing_history(bool(use))

    def reset(self) -> None:
        """Back to the placement in force (or, on the CPU, to the proposal the controls began with)."""
        if self.limits is not None:
            self._set(self.applied or self.limits.current)

    def apply(self) -> bool:
        if self.whatif:
            return False  # a plan for a GPU this machine does not have is never applied
        return self.settings is not None and self.bridge.apply(self.settings)

    def set_whatif(self, on: bool) -> None:
        """Plan for a hypothetical GPU (the machine has none; nothing can be applied), or back."""
        on = bool(on) and self.machine is not None and self.machine.whatif is not None
        if on == self.whatif:
            return
        self.whatif = on
        self.whatifChanged.emit(on)
        self._show(self.machine.whatif if on else self.machine)

    # -- plumbing -----------------------------------------------------------------------------------
    def _change(self, **kw) -> None:
        if self.settings is None:
            return
        new = replace(self.settings, **kw)
        if new != self.settings:
            self._set(new)

    def _set(self, settings: D.PlanSettings) -> None:
        self.settings = settings
        self.settingsChanged.emit(settings)
        if self._timer.isActive():
            self._pending = True  # the trailing re-plan will take the latest settings
        else:
            self._replan()
            self._timer.start()

    def _on_timer(self) -> None:
        if self._pending:
            self._pending = False
            self._replan()
            self._timer.start()

    def _replan(self) -> None:
        self.replans += 1
        self.preview = self.bridge.preview(self.settings)
        self.previewChanged.emit(self.preview)

    def _on_loaded(self, _card, limits: D.PlacementLimits) -> None:
        self.machine = limits
        if self.whatif:
            self.whatif = False
            self.whatifChanged.emit(False)
        self._show(limits)

    def _show(self, limits: D.PlacementLimits) -> None:
        self.limits = limits
        self.applied = limits.applied  # None: the model runs on the CPU; the controls propose a plan
        self.limitsChanged.emit(limits)
        self._timer.stop()
        self._pending = False
        self.settings = limits.current
        self.settingsChanged.emit(self.settings)
        self.appliedChanged.emit(self.applied)
        QTimer.singleShot(0, self._replan)  # its own event-loop pass: each pass stays short

    def _on_applied(self, card, limits: D.PlacementLimits) -> None:
        self._on_loaded(card, limits)

    def _on_calibrated(self, _card, limits: D.PlacementLimits) -> None:
        """This CPU's calibration arrived: the same limits, predictions from measured speeds (what-if kept)."""
        self.machine = limits
        if not self.whatif:
            self._show(limits)
