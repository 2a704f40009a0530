"""The VRAM layout: a device-memory bar (reserve, scratch, trunk, KV, output, expert cache, free) and
a layer map (each layer's trunk on GPU or CPU, and where its routed experts run). Paints a
:class:`~sharpi_gui.data.PlanPreview`; computes nothing."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from sharpi_gui.data import SEGMENTS, PlanPreview, human_bytes, segment_label
from sharpi_gui.theme import DEVICE_COLORS, EXPERT_COLORS, LIGHT, SEGMENT_COLORS, Theme

_PAD = 6
_BAR_H = 22
_CELL_H = 15
_LEGEND_ROW = 17
_LEGEND_COLS = 3
OVERHEAD = ("reserve", "scratch")  # fixed costs of using the device at all
OVERHEAD_MAX_SHARE = 0.3  # above this share of the budget, the overhead is drawn shortened ...
OVERHEAD_DRAWN_SHARE = 0.18  # ... to this share of the bar, behind an axis break


def bar_spans(segments, budget: int, width: float) -> tuple[list[tuple[str, float, float]], float | None]:
    """Pixel spans [(key, x0, x1)] of the budget bar, and the x of an axis break (None if to scale).

    Linear in bytes, except that a reserve + scratch larger than OVERHEAD_MAX_SHARE of the budget
    (a small model on a big device) is squeezed into OVERHEAD_DRAWN_SHARE of the bar, so the
    model's own bytes stay visible. Non-empty segments are at least 2 px wide.
    """
    overhead = sum(b for k, b in segments if k in OVERHEAD)
    squeeze = budget > 0 and overhead / budget > OVERHEAD_MAX_SHARE and overhead < budget
    if squeeze:
        head_w = width * OVERHEAD_DRAWN_SHARE
        head_scale, rest_scale = head_w / overhead, (width - head_w) / (budget - overhead)
    else:
        head_scale = rest_scale = width / budget if budget > 0 else 0.0
    spans, x, cut = [], 0.0, None
    for key, nbytes in segments:
        if nbytes <= 0:
            continue
        if squeeze and cut is None and key not in OVERHEAD:
            cut = x
        seg = max(2.0, nbytes * (head_scale if key in OVERHEAD else rest_scale))
        seg = min(seg, width - x)
        spans.append((key, x, x + seg))
        x += seg
    return spans, cut


EXPERT_LABELS = {"cpu": "CPU experts", "cache": "GPU cache", "resident": "resident", "none": "dense"}


class LayoutView(QWidget):
    def __init__(self, preview: PlanPreview | None = None, theme: Theme = LIGHT, parent: QWidget | None = None):
        super().__init__(parent)
        self.preview = preview
        self.theme = theme
        self.renders = 0  # paint count (tests: the view really redrew)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(260)
        self._layer_rects: list[tuple[QRectF, int]] = []
        self.setFixedHeight(self._height())

    def set_preview(self, preview: PlanPreview | None) -> None:
        self.preview = preview
        self.setFixedHeight(self._height())
        self.update()

    def set_theme(self, theme: Theme) -> None:
        self.theme = theme
        self.update()

    def sizeHint(self) -> QSize:
        return QSize(360, self._height())

    def _height(self) -> int:
        legend_rows = -(-(len(SEGMENTS) + 1) // _LEGEND_COLS)
        return _PAD * 2 + 18 + _BAR_H + 4 + legend_rows * _LEGEND_ROW + 8 + 18 + 2 * _CELL_H + 14 + 2 * _LEGEND_ROW

    # -- painting -------------------------------------------------------------------------------------
    def paintEvent(self, _e) -> None:
        self.renders += 1
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        t = self.theme
        fg, muted = QColor(t.foreground), QColor(t.muted)
        fm = QFontMetrics(self.font())
        w = self.width() - 2 * _PAD
        y = _PAD
        pv = self.preview
        if pv is None:
            p.setPen(muted)
            p.drawText(QRectF(_PAD, y, w, 40), Qt.AlignmentFlag.AlignLeft, "Load a model to see its placement.")
            return
        # Title
        p.setPen(fg)
        if pv.ok:
            title = (
                f"Device: {human_bytes(pv.allocated_bytes)} of {human_bytes(pv.budget_bytes)}"
                f" · free {human_bytes(pv.free_bytes)}"
            )
            if bar_spans(pv.segments, pv.budget_bytes, 100)[1] is not None:
                title += "  (reserve + scratch not to scale)"
        else:
            title = f"Budget {human_bytes(pv.settings.vram_bytes)}: no placement"
        p.drawText(QRectF(_PAD, y, w, 18), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, title)
        y += 18

        # Budget bar
        bar = QRectF(_PAD, y, w, _BAR_H)
        p.setPen(QPen(muted, 1))
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawRoundedRect(bar, 4, 4)
        if pv.ok and pv.budget_bytes > 0:
            spans, cut = bar_spans(pv.segments, pv.budget_bytes, w)
            p.setPen(Qt.PenStyle.NoPen)
            for key, x0, x1 in spans:
                p.setBrush(QColor(self._segment_color(key)))
                p.drawRect(QRectF(bar.left() + x0, bar.top() + 1, x1 - x0, _BAR_H - 2))
            if cut is not None:  # an axis break: the fixed overhead is drawn shorter than to scale
                p.setPen(QPen(QColor(t.background), 3))
                cx = bar.left() + cut
                for dx in (-3, 3):
                    p.drawLine(QPointF(cx + dx - 3, bar.bottom() + 1), QPointF(cx + dx + 3, bar.top() - 1))
        y += _BAR_H + 4

        # Legend: colour, name, bytes
        col_w = w / _LEGEND_COLS
        amounts = dict(pv.segments)
        items = [
            (self._segment_color(k), segment_label(k, label, pv.moe_mode), amounts.get(k, 0)) for k, label in SEGMENTS
        ]
        items.append((None, "free", pv.free_bytes if pv.ok else 0))
        for i, (color, label, nbytes) in enumerate(items):
            cx = _PAD + (i % _LEGEND_COLS) * col_w
            cy = y + (i // _LEGEND_COLS) * _LEGEND_ROW
            self._swatch(p, cx, cy + 3, color)
            p.setPen(fg)
            text = fm.elidedText(f"{label} {human_bytes(nbytes)}", Qt.TextElideMode.ElideRight, int(col_w - 18))
            p.drawText(QRectF(cx + 16, cy, col_w - 16, _LEGEND_ROW), Qt.AlignmentFlag.AlignVCenter, text)
        y += -(-len(items) // _LEGEND_COLS) * _LEGEND_ROW + 8

        # Layer map
        self._layer_rects = []
        if not pv.ok:
            p.setPen(QColor(t.error))
            p.drawText(
                QRectF(_PAD, y, w, 3 * _LEGEND_ROW + 2 * _CELL_H),
                Qt.AlignmentFlag.AlignLeft | Qt.TextFlag.TextWordWrap,
                pv.error,
            )
            return
        n_gpu = pv.n_gpu_layers
        p.setPen(fg)
        p.drawText(
            QRectF(_PAD, y, w, 18),
            Qt.AlignmentFlag.AlignVCenter,
            f"Layers: {n_gpu} on GPU, {pv.n_layer - n_gpu} on CPU · experts: {pv.moe_mode}",
        )
        y += 18
        n = max(1, len(pv.layers))
        label_w = fm.horizontalAdvance("experts") + 8
        cell_w = (w - label_w) / n
        p.setPen(muted)
        p.drawText(QRectF(_PAD, y, label_w, _CELL_H), Qt.AlignmentFlag.AlignVCenter, "trunk")
        p.drawText(QRectF(_PAD, y + _CELL_H, label_w, _CELL_H), Qt.AlignmentFlag.AlignVCenter, "experts")
        gap = 1.0 if cell_w > 4 else 0.0
        for i, lay in enumerate(pv.layers):
            x = _PAD + label_w + i * cell_w
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(QColor(DEVICE_COLORS.get(lay.device, "#888888")))
            top = QRectF(x, y, cell_w - gap, _CELL_H - 1)
            p.drawRect(top)
            p.setBrush(QColor(EXPERT_COLORS.get(lay.experts, "#888888")))
            p.drawRect(QRectF(x, y + _CELL_H, cell_w - gap, _CELL_H - 1))
            self._layer_rects.append((QRectF(x, y, cell_w, 2 * _CELL_H), i))
        # layer indices at the ends
        p.setPen(muted)
        y += 2 * _CELL_H
        p.drawText(QRectF(_PAD + label_w, y, 40, 14), Qt.AlignmentFlag.AlignLeft, "0")
        p.drawText(QRectF(_PAD + w - 40, y, 40, 14), Qt.AlignmentFlag.AlignRight, str(pv.n_layer - 1))
        y += 14
        legend = [(DEVICE_COLORS["gpu"], "trunk on GPU"), (DEVICE_COLORS["cpu"], "trunk on CPU")]
        legend += [(EXPERT_COLORS[k], EXPERT_LABELS[k]) for k in ("cpu", "cache", "resident")]
        x = _PAD
        row = 0
        for color, label in legend:
            tw = fm.horizontalAdvance(label) + 28
            if x + tw > _PAD + w and x > _PAD:
                x, row = _PAD, row + 1
            cy = y + row * _LEGEND_ROW
            self._swatch(p, x, cy + 3, color)
            p.setPen(fg)
            p.drawText(QRectF(x + 16, cy, tw, _LEGEND_ROW), Qt.AlignmentFlag.AlignVCenter, label)
            x += tw

    def _segment_color(self, key: str) -> str:
        """The expert pool takes its mode's colour (as in the layer strip): cache or resident."""
        if key == "experts" and self.preview is not None and self.preview.moe_mode == "resident":
            return EXPERT_COLORS["resident"]
        return SEGMENT_COLORS[key]

    def _swatch(self, p: QPainter, x: float, y: float, color: str | None) -> None:
        r = QRectF(x, y, 11, 11)
        if color is None:
            p.setPen(QPen(QColor(self.theme.muted), 1))
            p.setBrush(Qt.BrushStyle.NoBrush)
        else:
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(QColor(color))
        p.drawRoundedRect(r, 2, 2)

    # -- tooltips -------------------------------------------------------------------------------------
    def layer_tooltip(self, index: int) -> str:
        pv = self.preview
        lay = pv.layers[index]
        return (
            f"layer {lay.index}: trunk {human_bytes(lay.trunk_bytes)} on {lay.device.upper()}, "
            f"KV {human_bytes(lay.kv_bytes)}, experts: {EXPERT_LABELS.get(lay.experts, lay.experts)}"
        )

    def mouseMoveEvent(self, e) -> None:
        pos = e.position()
        for rect, i in self._layer_rects:
            if rect.contains(pos):
                QToolTip.showText(self.mapToGlobal(QPoint(int(pos.x()), int(pos.y()))), self.layer_tooltip(i), self)
                return
        QToolTip.hideText()
