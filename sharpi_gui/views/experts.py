"""The experts dock: a layers × experts heatmap (heat, residency or hit ratio) with a colour bar,
live plots of decode tok/s, cache hit rate and upload MB/s, export (JSON + CSV + PNG), the expert cache's
policy, and recording the routing into the user's routing history (which the planner learns from).
Renders an ExpertsModel's frames; the plots write into preallocated numpy buffers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QComboBox,
    QDockWidget,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui import data as D
from sharpi_gui.experts_model import MODE_LABELS, MODES
from sharpi_gui.theme import LIGHT, Theme
from sharpi_gui.views.remote import RemoteNote

HISTORY = 512  # plotted forward passes (the profiler keeps as many)
_MIN_X = 32  # the plots' x axis spans at least this many passes
_COLORMAPS = {"heat": "inferno", "residency": "viridis", "hit": "viridis"}
_SERIES = (("tok_s", "decode tok/s"), ("hit_rate", "hit rate"), ("upload_mb_s", "upload MB/s"))


_NICE = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0)


def _nice_ceiling(x: float) -> float:
    """The smallest 1, 1.5, 2, 3, 4, 5 or 7.5 x 10^k that is >= x (and >= 1): a scale that moves
    rarely yet never leaves the data in less than ~2/3 of it."""
    if x <= 1.0:
        return 1.0
    k = 10.0 ** np.floor(np.log10(x))
    for m in _NICE:
        if m * k >= x:
            return m * k
    return 10.0 * k


def decode_text(tok_s: float, hit_rate: float | None) -> str:
    """A reply's decode speed (and cache hit rate) as the status bar and the experts dock both write it."""
    return f"{tok_s:.1f} tok/s" + ("" if hit_rate is None else f" · hit rate {hit_rate:.0%}")


def _ticks(n: int, most: int = 12) -> list[tuple[int, str]]:
    """Integer tick positions 0..n-1, at most ~``most`` of them."""
    step = max(1, -(-n // most))
    return [(i, str(i)) for i in range(0, n, step)]


class ExpertsPanel(QWidget):
    exportRequested = Signal()
    recordFailed = Signal(str)  # why recording could not start or stop
    recordSaved = Signal(str)  # the routing trace saved into the history

    def __init__(self, model, theme: Theme = LIGHT, parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.theme = theme
        self.renders = 0
        self.mode_box = QComboBox()
        for m in MODES:
            self.mode_box.addItem(MODE_LABELS[m], m)
        self.mode_box.setCurrentIndex(MODES.index(model.mode))
        self.export_button = QPushButton("Export…")
        self.export_button.setToolTip("Save the profiler snapshot as JSON + CSV, and this heatmap as PNG (Ctrl+E)")
        self.export_button.setEnabled(False)
        self.policy_box = QComboBox()
        for p in D.CACHE_POLICIES:
            self.policy_box.addItem(D.CACHE_POLICY_LABELS[p], p)
            self.policy_box.setItemData(
                self.policy_box.count() - 1, D.CACHE_POLICY_TIPS[p], Qt.ItemDataRole.ToolTipRole
            )
        self.policy_box.setCurrentIndex(D.CACHE_POLICIES.index(model.policy))
        self.policy_box.setToolTip(
            "Which experts the GPU expert cache keeps (changing it rebuilds a cache in force; never the output)"
        )
        self.record_button = QPushButton("Record routing")
        self.record_button.setCheckable(True)
        self.record_button.setToolTip(
            "Record which experts each token uses into your routing history, which the planner's cache hit rates "
            "learn from (while recording, tokens run layer by layer: the same output, slower)"
        )
        self.record_button.setEnabled(False)
        self.info = QLabel("No model loaded.")
        # Its text changes with every frame: it must never resize the plots (a full repaint).
        self.info.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.info.setWordWrap(False)
        top = QHBoxLayout()
        top.addWidget(QLabel("Show"))
        top.addWidget(self.mode_box)
        top.addStretch(1)
        top.addWidget(QLabel("Cache policy"))
        top.addWidget(self.policy_box)
        top.addWidget(self.record_button)
        top.addWidget(self.export_button)

        # Heatmap: rows = layers (0 at the top), columns = experts.
        self.heatmap = pg.GraphicsLayoutWidget()
        self.heatmap.setMinimumHeight(180)
        self.plot = self.heatmap.addPlot(row=0, col=0)
        self.plot.setLabel("left", "layer")
        self.plot.setLabel("bottom", "expert")
        for side in ("left", "bottom"):  # layers and experts are counts: no "(x0.001)" scale on an empty plot,
            self.plot.getAxis(side).enableAutoSIPrefix(False)
            self.plot.getAxis(side).setTicks([[]])  # and no numbers until a model's frame sets them
        self.plot.invertY(True)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        self.plot.setMenuEnabled(False)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        self.colorbar = pg.ColorBarItem(
            values=(0.0, 1.0), colorMap=pg.colormap.get(_COLORMAPS[model.mode]), interactive=False, width=14
        )
        self.colorbar.setImageItem(self.image, insert_in=self.plot)

        # Live plots over the last HISTORY forward passes, side by side.
        self.live = pg.GraphicsLayoutWidget()
        self.live.setMinimumHeight(150)
        self._x = np.arange(HISTORY, dtype=np.float64)
        self._xbuf = np.zeros((len(_SERIES), HISTORY))
        self._ybuf = np.zeros((len(_SERIES), HISTORY))
        self.curves = []
        self.series_plots = []
        self._ranges: list[tuple[float, float] | None] = [None] * len(_SERIES)
        self._shape: tuple[int, int] | None = None
        for i, (_key, label) in enumerate(_SERIES):
            p = self.live.addPlot(row=0, col=i)
            p.setTitle(label, size="9pt")
            p.getAxis("left").setWidth(34)
            p.getAxis("left").enableAutoSIPrefix(False)
            p.setLabel("bottom", "forward pass")
            p.setMouseEnabled(x=False, y=False)
            p.hideButtons()
            p.setMenuEnabled(False)
            p.showGrid(x=True, y=True, alpha=0.2)
            self.series_plots.append(p)
            self.curves.append(p.plot(pen=pg.mkPen(theme.plot_pens[i], width=1.5)))
        # The last reply's decode tok/s and hit rate (the status bar's figures) as dashed lines across their
        # plots: single tokens run far faster than a reply's average when a few stall (another program on the
        # cores), and the line shows where the average the status bar quotes sits among them.
        self.window_lines = []
        label_fill = QColor(theme.background)
        label_fill.setAlpha(210)
        for i in (0, 1):
            line = pg.InfiniteLine(
                angle=0,
                movable=False,
                pen=pg.mkPen(theme.muted, width=1, style=Qt.PenStyle.DashLine),
                label="last reply {value:.1f}" if i == 0 else "last reply {value:.0%}",
                # at the right end, above the line, on the plot's background: legible over the curve
                labelOpts={"position": 0.98, "color": theme.muted, "anchors": [(1, 1), (1, 1)], "fill": label_fill},
            )
            line.setVisible(False)
            self.series_plots[i].addItem(line, ignoreBounds=True)
            self.window_lines.append(line)
        self.plot.getAxis("left").setWidth(34)

        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.heatmap, 3)
        lay.addWidget(self.info)
        lay.addWidget(self.live, 2)
        lay.setContentsMargins(8, 6, 8, 6)

        self.mode_box.currentIndexChanged.connect(lambda _i: model.set_mode(self.mode_box.currentData()))
        self.export_button.clicked.connect(self.exportRequested)
        self.policy_box.currentIndexChanged.connect(self._on_policy_box)
        self.record_button.toggled.connect(self._on_record)
        model.frameChanged.connect(self.render)
        model.modeChanged.connect(self._on_mode)
        model.policyChanged.connect(self._show_policy)
        model.recordingChanged.connect(self._show_recording)
        self.set_theme(theme)

    # -- rendering ------------------------------------------------------------------------------------
    def render(self, frame: D.StatsFrame | None = None) -> None:
        frame = frame if frame is not None else self.model.frame
        if frame is None:
            return
        self.renders += 1
        img = self.model.image()
        # Heat has no fixed top: the scale steps through 1-2-5 values, so it (and its axis) stays put.
        top = _nice_ceiling(float(img.max()) if img.size else 0.0) if self.model.mode == "heat" else 1.0
        levels = (0.0, top)
        self.image.setImage(img, autoLevels=False, levels=levels)
        if self.colorbar.levels() != levels:
            self.colorbar.setLevels(levels)
        shape = (frame.n_layer, frame.n_expert)
        if shape != self._shape:  # axes are redrawn only when the model changes
            self._shape = shape
            self.image.setRect(-0.5, -0.5, frame.n_expert, frame.n_layer)
            self.plot.getAxis("bottom").setTicks([_ticks(frame.n_expert)])
            self.plot.getAxis("left").setTicks([_ticks(frame.n_layer)])
            self.plot.setXRange(-0.5, frame.n_expert - 0.5, padding=0)
            self.plot.setYRange(-0.5, frame.n_layer - 0.5, padding=0)
        for i, (key, _label) in enumerate(_SERIES):
            y = getattr(frame, key)[-HISTORY:]  # oldest first; x counts passes from the oldest shown
            valid = np.isfinite(y)
            m = int(valid.sum())
            self._xbuf[i, :m] = self._x[: len(y)][valid]
            self._ybuf[i, :m] = y[valid]
            self.curves[i].setData(self._xbuf[i, :m], self._ybuf[i, :m])
            # Ranges move in coarse steps, so the axes (the costly part of a repaint) rarely change.
            top = 1.0 if i == 1 else _nice_ceiling(float(self._ybuf[i, :m].max()) if m else 0.0)
            xr = _nice_ceiling(max(len(y), _MIN_X))
            if self._ranges[i] != (xr, top):
                self._ranges[i] = (xr, top)
                self.series_plots[i].setRange(xRange=(0, xr), yRange=(0, top), padding=0.02)
        for line, value in zip(self.window_lines, (frame.decode_tok_s, frame.decode_hit_rate), strict=True):
            shown = bool(frame.decode_tokens) and value is not None and value == value
            line.setVisible(shown)
            if shown:
                line.setValue(value)
        note = f"{frame.tokens_total:,} tokens profiled · {frame.n_layer} layers × {frame.n_expert} experts"
        if frame.decode_tokens:  # the status bar's figures: the same window
            note += f" · last reply: decode {decode_text(frame.decode_tok_s, frame.decode_hit_rate)}"
        if not frame.has_cache:
            note += " · no cache lookups (experts on the CPU)"
        else:
            note += f"\ncache hits: {frame.demand_hits:,} demand, {frame.prefetch_hits:,} prefetched"
            if frame.prefetch_recall == frame.prefetch_recall:  # not nan: predictions were made
                note += f" (prediction recall {frame.prefetch_recall:.0%})"
        self.info.setText(note)
        self.export_button.setEnabled(True)
        self.record_button.setEnabled(True)

    def _on_policy_box(self, _index: int) -> None:
        if not self.model.set_policy(self.policy_box.currentData()):
            self._show_policy(self.model.policy)  # busy or no model: the selector shows the policy in force

    def _show_policy(self, policy: str) -> None:
        self.policy_box.blockSignals(True)
        self.policy_box.setCurrentIndex(D.CACHE_POLICIES.index(policy))
        self.policy_box.blockSignals(False)

    def _on_record(self, on: bool) -> None:
        try:
            path = self.model.set_recording(on)
        except OSError as e:
            self._show_recording(self.model.recording)
            self.recordFailed.emit(str(e))
            return
        if path:
            self.recordSaved.emit(path)

    def _show_recording(self, on: bool) -> None:
        self.record_button.blockSignals(True)
        self.record_button.setChecked(on)
        self.record_button.setText("Stop recording" if on else "Record routing")
        self.record_button.blockSignals(False)

    def _on_mode(self, mode: str) -> None:
        self.mode_box.blockSignals(True)
        self.mode_box.setCurrentIndex(MODES.index(mode))
        self.mode_box.blockSignals(False)
        self.colorbar.setColorMap(pg.colormap.get(_COLORMAPS[mode]))
        self.colorbar.setLabel("right", MODE_LABELS[mode])
        self.render()

    def set_theme(self, theme: Theme) -> None:
        self.theme = theme
        for w in (self.heatmap, self.live):
            w.setBackground(theme.background)
        for p in [self.plot, *self.series_plots]:
            for side in ("left", "bottom"):
                ax = p.getAxis(side)
                ax.setPen(pg.mkPen(theme.muted))
                ax.setTextPen(pg.mkPen(theme.foreground))
        cb_axis = self.colorbar.getAxis("right")
        cb_axis.setPen(pg.mkPen(theme.muted))
        cb_axis.setTextPen(pg.mkPen(theme.foreground))
        self.colorbar.setLabel("right", MODE_LABELS[self.model.mode])
        for i, c in enumerate(self.curves):
            c.setPen(pg.mkPen(theme.plot_pens[i], width=1.5))
        for line in self.window_lines:
            line.setPen(pg.mkPen(theme.muted, width=1, style=Qt.PenStyle.DashLine))
            line.label.setColor(theme.muted)

    # -- export ---------------------------------------------------------------------------------------
    def export_to(self, prefix: str) -> tuple[str, str, str]:
        """Write PREFIX.json + PREFIX.csv (one snapshot) and PREFIX.png (this heatmap showing it)."""
        j, c = self.model.export(prefix)  # the same snapshot arrives as a frame and is drawn first
        png = str(Path(prefix).with_suffix(".png"))
        if not self.heatmap.grab().save(png):
            raise OSError(f"could not write {png}")
        return j, c, png


class ExpertsDock(QDockWidget):
    def __init__(self, model, theme: Theme = LIGHT, parent: QWidget | None = None):
        super().__init__("Experts", parent)
        self.setObjectName("experts-dock")
        self.panel = ExpertsPanel(model, theme)
        self.remote_note = RemoteNote(
            "Expert statistics do not apply to a remote model.",
            "Open a local model (File → Open) to see its experts here.",
        )
        self.pages = QStackedWidget()
        self.pages.addWidget(self.panel)
        self.pages.addWidget(self.remote_note)
        self.setWidget(self.pages)
        self.setAllowedAreas(Qt.DockWidgetArea.AllDockWidgetAreas)

    def set_remote(self, info: D.RemoteInfo | None, decode_tok_s: float = 0.0) -> None:
        """Show the note that expert statistics do not apply (``info``: the endpoint), or the panel (None)."""
        if info is not None:
            self.remote_note.show_info(info, decode_tok_s)
        self.pages.setCurrentWidget(self.remote_note if info is not None else self.panel)
