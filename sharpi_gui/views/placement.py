"""The placement dock: VRAM and context sliders, KV-type and expert-mode selectors, the live layout
preview with the planner's summary, and Apply. Renders a PlacementModel; every control change goes
to the model, which re-plans (throttled) and hands back a preview to draw."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDockWidget,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSlider,
    QSpinBox,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui import data as D
from sharpi_gui.theme import LIGHT, Theme
from sharpi_gui.views.layout_view import LayoutView
from sharpi_gui.views.remote import RemoteNote

NO_GPU_TEXT = (
    "<b>No GPU found — experts and trunk on the CPU.</b><br>"
    "<span style='font-size:11px'>PyTorch sees no CUDA device here, so the whole model runs on the CPU. "
    "The context and the KV type below still apply.</span>"
)
MODE_NAMES = {"cpu": "CPU experts", "cache": "GPU expert cache", "resident": "all experts resident", "none": "dense"}
MOE_ITEMS = {"auto": "auto", "cpu": "CPU", "cache": "GPU cache", "resident": "resident"}
KV_TIPS = {"f32": "4 bytes per value", "bf16": "2 bytes per value", "q8_0": "≈1.06 bytes per value (8-bit blocks)"}


def _slider() -> QSlider:
    s = QSlider(Qt.Orientation.Horizontal)
    s.setTracking(True)
    s.setEnabled(False)
    return s


class PlacementPanel(QWidget):
    """The dock's contents (usable on its own, e.g. for screenshots and tests)."""

    def __init__(self, model, theme: Theme = LIGHT, parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.theme = theme
        self.vram = _slider()
        self.vram_label = QLabel("—")
        self.ctx = _slider()
        self.ctx_label = QLabel("—")
        self.kv = QComboBox()
        for k in D.KV_TYPES:
            self.kv.addItem(k, k)
            self.kv.setItemData(self.kv.count() - 1, KV_TIPS[k], Qt.ItemDataRole.ToolTipRole)
        self.moe = QComboBox()
        self.moe.setToolTip("where routed experts of GPU layers run (auto = the fastest predicted)")
        for m in D.MOE_CHOICES:
            self.moe.addItem(MOE_ITEMS[m], m)
        self.gpu_layers = QSpinBox()
        self.gpu_layers.setRange(-1, 0)
        self.gpu_layers.setSpecialValueText("auto")
        self.gpu_layers.setToolTip("trunk layers on the device, a prefix (auto = as many as fit)")
        self.layout_view = LayoutView(None, theme)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.apply_button = QPushButton("Apply")
        self.apply_button.setToolTip("Re-place the loaded model as previewed (the file is not read again)")
        self.reset_button = QPushButton("Reset")
        self.reset_button.setToolTip("Back to the placement in force")
        self.state_label = QLabel()
        self.no_gpu = QLabel(NO_GPU_TEXT)  # shown instead of the device controls when there is no GPU
        self.no_gpu.setWordWrap(True)
        self.no_gpu.setVisible(False)
        self.whatif = QCheckBox("What if this machine had a GPU? (a plan only: it cannot be applied here)")
        self.whatif.setToolTip("Plan for a hypothetical GPU with default speeds; this machine keeps running on the CPU")
        self.whatif.setVisible(False)
        self.history = QCheckBox("Use my routing history")
        self.history.setToolTip(
            "Predict the expert cache's hit rates from the routing you recorded (the experts dock's Record "
            "routing) instead of a generic guess; auto then picks the mode for your use"
        )
        self.history.setEnabled(False)
        self.vram_title = QLabel("VRAM budget")
        self.moe_title = QLabel("Experts")
        self.layers_title = QLabel("GPU layers")

        grid = QGridLayout()
        grid.setVerticalSpacing(2)
        grid.addWidget(self.vram_title, 0, 0)
        grid.addWidget(self.vram, 0, 1, 1, 5)
        grid.addWidget(self.vram_label, 1, 1, 1, 5)
        grid.addWidget(QLabel("Context"), 2, 0)
        grid.addWidget(self.ctx, 2, 1, 1, 5)
        grid.addWidget(self.ctx_label, 3, 1, 1, 5)
        grid.setRowMinimumHeight(4, 6)
        grid.addWidget(QLabel("KV"), 5, 0)
        grid.addWidget(self.kv, 5, 1)
        grid.addWidget(self.moe_title, 5, 2, Qt.AlignmentFlag.AlignRight)
        grid.addWidget(self.moe, 5, 3)
        grid.addWidget(self.layers_title, 5, 4, Qt.AlignmentFlag.AlignRight)
        grid.addWidget(self.gpu_layers, 5, 5)
        grid.setColumnStretch(3, 1)
        for label in (self.vram_label, self.ctx_label):
            label.setStyleSheet("font-size: 11px;")
        buttons = QHBoxLayout()
        buttons.addWidget(self.history)
        buttons.addWidget(self.state_label, 1)
        buttons.addWidget(self.reset_button)
        buttons.addWidget(self.apply_button)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 6, 8, 6)
        lay.addWidget(self.no_gpu)
        lay.addWidget(self.whatif)
        lay.addLayout(grid)
        lay.addWidget(self.layout_view)
        lay.addWidget(self.summary)
        lay.addLayout(buttons)
        lay.addStretch(1)
        for w in (self.kv, self.moe, self.gpu_layers, self.apply_button, self.reset_button):
            w.setEnabled(False)

        # intents -> model
        self.vram.valueChanged.connect(self._on_vram)
        self.ctx.valueChanged.connect(self._on_ctx)
        self.kv.currentIndexChanged.connect(lambda _i: model.set_kv_type(self.kv.currentData()))
        self.moe.currentIndexChanged.connect(lambda _i: model.set_moe(self.moe.currentData()))
        self.gpu_layers.valueChanged.connect(model.set_gpu_layers)
        self.apply_button.clicked.connect(model.apply)
        self.whatif.toggled.connect(model.set_whatif)
        self.history.toggled.connect(self._on_history)
        model.whatifChanged.connect(self._render_whatif)
        self.reset_button.clicked.connect(model.reset)
        # model -> rendering
        model.limitsChanged.connect(self._render_limits)
        model.settingsChanged.connect(self._render_settings)
        model.previewChanged.connect(self._render_preview)
        model.appliedChanged.connect(lambda _s: self._render_buttons())
        self._busy = False

    # -- rendering ------------------------------------------------------------------------------------
    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._render_buttons()

    def set_theme(self, theme: Theme) -> None:
        self.theme = theme
        self.layout_view.set_theme(theme)
        if self.model.preview is not None:
            self._render_preview(self.model.preview)

    def _render_limits(self, limits: D.PlacementLimits) -> None:
        self.vram.blockSignals(True)
        self.vram.setRange(0, limits.vram_max_bytes // limits.vram_step_bytes)
        self.vram.setPageStep(max(1, self.vram.maximum() // 16))
        self.vram.blockSignals(False)
        self.ctx.blockSignals(True)
        self.ctx.setRange(0, len(limits.ctx_values) - 1)
        self.ctx.setPageStep(1)
        self.ctx.blockSignals(False)
        self.gpu_layers.blockSignals(True)
        self.gpu_layers.setRange(-1, limits.n_layer)
        self.gpu_layers.blockSignals(False)
        self.moe.setEnabled(limits.is_moe)
        for w in (self.vram, self.ctx, self.kv, self.gpu_layers):
            w.setEnabled(True)
        self.ctx.setEnabled(len(limits.ctx_values) > 1)
        self.ctx.setToolTip(ctx_limit_text(limits))
        self.vram.setToolTip(f"{limits.device_name}: {D.human_bytes(limits.device_vram_bytes)}")
        # Without a GPU there is nothing to place on a device: no budget, expert modes or layers —
        # unless the user asks what a GPU would do (what-if: planned, never applied).
        machine = self.model.machine or limits
        self.no_gpu.setVisible(not machine.has_gpu)
        self.whatif.setVisible(not machine.has_gpu and machine.whatif is not None)
        for w in (self.vram_title, self.vram, self.vram_label, self.moe_title, self.moe, self.layers_title):
            w.setVisible(limits.has_gpu)
        self.gpu_layers.setVisible(limits.has_gpu)
        self.layout_view.setVisible(limits.has_gpu)
        self.history.setVisible(limits.has_gpu and limits.is_moe)  # the cache's hit rates matter only there
        self._show_history(limits)
        self._render_whatif(self.model.whatif)

    def _render_settings(self, s: D.PlanSettings) -> None:
        limits = self.model.limits
        if limits is None:
            return
        for w in (self.vram, self.ctx, self.kv, self.moe, self.gpu_layers):
            w.blockSignals(True)
        self.vram.setValue(round(s.vram_bytes / limits.vram_step_bytes))
        ctx_index = min(range(len(limits.ctx_values)), key=lambda i: abs(limits.ctx_values[i] - s.ctx))
        self.ctx.setValue(ctx_index)
        self.kv.setCurrentIndex(max(0, self.kv.findData(s.kv_type)))
        self.moe.setCurrentIndex(max(0, self.moe.findData(s.moe)))
        self.gpu_layers.setValue(s.n_gpu_layers)
        for w in (self.vram, self.ctx, self.kv, self.moe, self.gpu_layers):
            w.blockSignals(False)
        device = D.human_bytes(limits.device_vram_bytes)
        self.vram_label.setText(f"{D.human_bytes(s.vram_bytes)}  ·  device {device} ({limits.device_name})")
        self.ctx_label.setText(f"{s.ctx:,} tokens · {ctx_limit_text(limits)}")
        self._render_buttons()

    def _render_whatif(self, on: bool) -> None:
        self.whatif.blockSignals(True)
        self.whatif.setChecked(on)
        self.whatif.blockSignals(False)
        limits = self.model.limits
        self.no_gpu.setText(whatif_text(limits) if on and limits is not None else NO_GPU_TEXT)
        self.apply_button.setVisible(not on)
        self.reset_button.setVisible(not on)
        self._render_buttons()

    def _render_buttons(self) -> None:
        m = self.model
        loaded = m.limits is not None
        self.apply_button.setEnabled(
            loaded and not m.whatif and m.dirty and not self._busy and bool(m.preview and m.preview.ok)
        )
        self.reset_button.setEnabled(loaded and m.settings != (m.applied or m.limits.current))
        if not loaded:
            text = ""
        elif m.whatif:
            text = "what-if plan: this machine has no GPU, so it cannot be applied"
        elif m.dirty and self._busy:
            text = "preview (apply when the engine is idle)"
        elif not m.limits.has_gpu:
            text = "in force" if not m.dirty else "preview (not applied)"
        elif m.applied is None and m.settings == m.limits.current:
            text = "the model runs on the CPU: Apply places it as shown"
        elif m.dirty:
            text = "preview (not applied)"
        else:
            text = "in force"
        self.state_label.setText(text)

    def _render_preview(self, pv: D.PlanPreview) -> None:
        self.layout_view.set_preview(pv)
        t = self.theme
        if not pv.ok:
            self.summary.setText(f"<span style='color:{t.error}'>{html.escape(pv.error)}</span>")
            self._render_buttons()
            return
        limits = self.model.limits
        if limits is not None and not limits.has_gpu:
            self.summary.setText(cpu_summary(pv, limits, t))
            self._render_buttons()
            return
        rows = []
        for mode, tok_s in pv.predicted_tok_s:
            name = MODE_NAMES.get(mode, mode)
            if mode == "resident" and pv.resident_split:
                name = f"experts resident from layer {pv.resident_split}"
            value = "does not fit" if tok_s is None else f"{tok_s:,.1f} tok/s"
            mark, b0, b1 = ("▶", "<b>", "</b>") if mode == pv.moe_mode else ("", "", "")
            rows.append(
                f"<tr><td width=14>{mark}</td><td width=170>{b0}{name}{b1}</td>"
                f"<td align=right width=110>{b0}{value}{b1}</td></tr>"
            )
        small = f"<span style='color:{t.muted}; font-size:11px'>"
        parts = [
            "<b>Predicted decode speed</b><table cellspacing=0 cellpadding=1>" + "".join(rows) + "</table>",
            f"{small}{html.escape(speeds_note(pv))}</span>",
            f"{small}{html.escape(pv.moe_reason)}</span>",
            f"{small}{html.escape(pv.layer_reason)}</span>",
        ]
        facts = []
        if pv.expert_slots_needed:
            hit = "" if pv.predicted_hit_rate is None else f", hit rate ≈ {pv.predicted_hit_rate:.0%}"
            facts.append(f"expert slots {pv.expert_slots}/{pv.expert_slots_needed}{hit}")
        if pv.hit_curve_source:
            facts.append(f"cache hit rates from {pv.hit_curve_source}")
        kv = f"KV {D.human_bytes(pv.kv_bytes)} on device"
        if pv.host_kv_bytes:
            kv += f" + {D.human_bytes(pv.host_kv_bytes)} on host"
        facts.append(kv)
        if pv.recommended_ctx:
            facts.append(f"all layers fit up to {pv.recommended_ctx:,} tokens")
        parts.append(small + html.escape(" · ".join(facts)) + "</span>")
        parts += [f"{small}<i>{html.escape(n)}</i></span>" for n in pv.notes]
        self.summary.setText("<br>".join(parts))
        self._render_buttons()

    # -- intents --------------------------------------------------------------------------------------
    def _on_history(self, on: bool) -> None:
        if not self.model.set_routing_history(on) and self.model.limits is not None:
            self._show_history(self.model.limits)  # busy: the box shows the choice in force

    def _show_history(self, limits: D.PlacementLimits) -> None:
        self.history.blockSignals(True)
        self.history.setChecked(limits.routing_history)
        self.history.blockSignals(False)
        self.history.setEnabled(limits.is_moe)

    def _on_vram(self, value: int) -> None:
        if self.model.limits is not None:
            self.model.set_vram(value * self.model.limits.vram_step_bytes)

    def _on_ctx(self, index: int) -> None:
        if self.model.limits is not None:
            self.model.set_ctx(self.model.limits.ctx_values[index])


def whatif_text(limits: D.PlacementLimits) -> str:
    return (
        f"<b>What-if: planning for a {D.human_bytes(limits.device_vram_bytes)} GPU with default speeds.</b><br>"
        "<span style='font-size:11px'>This machine has no GPU: the plan below shows what one would do "
        "and cannot be applied here. The model keeps running on the CPU.</span>"
    )


def ctx_limit_text(limits: D.PlacementLimits) -> str:
    """Why the context slider stops where it does."""
    top = limits.ctx_values[-1]
    if limits.n_ctx_train and top <= limits.n_ctx_train:
        return f"at most {limits.n_ctx_train:,}: the context this model was trained for"
    return f"at most {top:,}"


def cpu_summary(pv: D.PlanPreview, limits: D.PlacementLimits, t: Theme) -> str:
    """The summary without a GPU: the CPU's decode speed (measured at load, else predicted) and
    what the chosen context costs in memory."""
    small = f"<span style='color:{t.muted}; font-size:11px'>"
    predicted = dict(pv.predicted_tok_s).get("cpu")
    rows = []
    if limits.measured_tok_s:
        rows.append(f"<b>Decode speed on this CPU: {limits.measured_tok_s:,.1f} tok/s</b>")
        rows.append(f"{small}measured when the model loaded (the warm-up's last tokens)</span>")
        if predicted is not None:
            rows.append(f"{small}predicted {predicted:,.1f} tok/s — {html.escape(speeds_note(pv))}</span>")
    elif predicted is not None:
        rows.append(f"<b>Predicted decode speed on this CPU: {predicted:,.1f} tok/s</b>")
        rows.append(f"{small}{html.escape(speeds_note(pv))}</span>")
    kv = f"KV cache {D.human_bytes(pv.kv_bytes + pv.host_kv_bytes)} in RAM for {pv.settings.ctx:,} tokens"
    rows.append(small + html.escape(kv) + "</span>")
    return "<br>".join(rows)


def speeds_note(pv: D.PlanPreview) -> str:
    """Says whether the predicted speeds rest on this machine's measurements or on defaults."""
    where = f" ({pv.speeds_device})" if pv.speeds_device else ""
    if pv.speeds_source == "measured":
        return f"from speeds measured on this machine{where}"
    if pv.speeds_source == "partly measured":
        return f"partly calibrated: from speeds partly measured on this machine{where}, partly default"
    return "uncalibrated: from default speeds, not measured on this machine (a rough guide)"


class PlacementDock(QDockWidget):
    def __init__(self, model, theme: Theme = LIGHT, parent: QWidget | None = None):
        super().__init__("Placement", parent)
        self.setObjectName("placement-dock")
        self.panel = PlacementPanel(model, theme)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.panel)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.remote_note = RemoteNote(
            "Placement does not apply to a remote model.", "Open a local model (File → Open) to place it here."
        )
        self.pages = QStackedWidget()
        self.pages.addWidget(scroll)
        self.pages.addWidget(self.remote_note)
        self.setWidget(self.pages)

    def set_remote(self, info: D.RemoteInfo | None, decode_tok_s: float = 0.0) -> None:
        """Show the note that placement does not apply (``info``: the endpoint), or the controls (None)."""
        if info is not None:
            self.remote_note.show_info(info, decode_tok_s)
        self.pages.setCurrentWidget(self.remote_note if info is not None else self.pages.widget(0))
