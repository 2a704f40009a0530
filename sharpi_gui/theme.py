"""A theme that follows the system's light/dark setting: Fusion style, a palette, chart colours.

``ThemeManager.changed`` fires when the system switches; views restyle from ``theme.colors``.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

# Colours shared by both themes: placement segments and layer states (colour-blind-safe Okabe-Ito).
SEGMENT_COLORS = {
    "reserve": "#8c8c8c",
    "scratch": "#b4b4b4",
    "trunk": "#0072B2",
    "kv": "#E69F00",
    "globals": "#CC79A7",
    "experts": "#009E73",
    "stream": "#F0E442",
    "free": None,  # drawn as the background with an outline
}
DEVICE_COLORS = {"gpu": "#0072B2", "cpu": "#8c7a5b"}
EXPERT_COLORS = {"cpu": "#D55E00", "cache": "#009E73", "resident": "#56B4E9", "none": "#b4b4b4"}


@dataclass(frozen=True)
class Theme:
    dark: bool
    background: str
    foreground: str
    muted: str  # secondary text
    panel: str  # backgrounds of chat bubbles, plot areas
    user_bubble: str
    error: str
    plot_pens: tuple[str, str, str]  # tok/s, hit rate, upload MB/s


LIGHT = Theme(
    dark=False,
    background="#ffffff",
    foreground="#1f1f1f",
    muted="#6b6b6b",
    panel="#f4f5f7",
    user_bubble="#e4eefb",
    error="#b00020",
    plot_pens=("#0072B2", "#009E73", "#D55E00"),
)
DARK = Theme(
    dark=True,
    background="#1e1f22",
    foreground="#e6e6e6",
    muted="#9a9a9a",
    panel="#2b2d31",
    user_bubble="#233246",
    error="#ff6b6b",
    plot_pens=("#56B4E9", "#3fd4a2", "#f0a35e"),
)


def system_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hints is not None and hints.colorScheme() == Qt.ColorScheme.Dark


def _dark_palette() -> QPalette:
    p = QPalette()
    c = DARK
    base, alt, text = QColor(c.background), QColor(c.panel), QColor(c.foreground)
    for role, color in (
        (QPalette.ColorRole.Window, alt),
        (QPalette.ColorRole.WindowText, text),
        (QPalette.ColorRole.Base, base),
        (QPalette.ColorRole.AlternateBase, alt),
        (QPalette.ColorRole.ToolTipBase, alt),
        (QPalette.ColorRole.ToolTipText, text),
        (QPalette.ColorRole.Text, text),
        (QPalette.ColorRole.Button, alt),
        (QPalette.ColorRole.ButtonText, text),
        (QPalette.ColorRole.BrightText, QColor("#ff5555")),
        (QPalette.ColorRole.Link, QColor("#56B4E9")),
        (QPalette.ColorRole.Highlight, QColor("#2f6fb3")),
        (QPalette.ColorRole.HighlightedText, QColor("#ffffff")),
        (QPalette.ColorRole.PlaceholderText, QColor(c.muted)),
    ):
        p.setColor(role, color)
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6f6f6f"))
    return p


class ThemeManager(QObject):
    """Applies the theme to the application and re-applies it when the system scheme changes."""

    changed = Signal(object)  # Theme

    def __init__(self, app: QApplication, dark: bool | None = None):
        super().__init__(app)
        self._app = app
        self._forced = dark
        self.theme = LIGHT
        app.setStyle("Fusion")
        self._light_palette = app.style().standardPalette()
        hints = QGuiApplication.styleHints()
        if hints is not None and dark is None:
            hints.colorSchemeChanged.connect(lambda _scheme: self.apply())
        self.apply()

    def apply(self) -> None:
        dark = system_is_dark() if self._forced is None else self._forced
        self.theme = DARK if dark else LIGHT
        self._app.setPalette(_dark_palette() if dark else self._light_palette)
        self.changed.emit(self.theme)
