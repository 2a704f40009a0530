"""The desktop app as a whole (pytest-qt, offscreen): every window and dialog opens, every menu
action runs, the UI thread leaves loading and generating to the engine thread, the theme
follows the system, settings persist, and the PySide6 6.12.0 refcount guard holds."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QObject, Qt, Signal  # noqa: E402
from PySide6.QtGui import QGuiApplication, QPalette  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from sharpi_gui import data as D  # noqa: E402
from sharpi_gui.app import _parser  # noqa: E402
from sharpi_gui.settings import Settings  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, patch_dialogs, settings_file  # noqa: E402
from sharpi_gui.theme import DARK, LIGHT, ThemeManager  # noqa: E402
from sharpi_gui.views import dialogs  # noqa: E402
from sharpi_gui.views.model_card import ModelCardDialog  # noqa: E402


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen3moe", "Q8_0", vocab=1024).path


@pytest.fixture(scope="module")
def big_model_path(synth_model):
    """Big enough that loading and a reply take a noticeable time (~40 MB, 8 layers x 32 experts)."""
    return synth_model("qwen3moe", "Q8_0", layers=8, experts=32, experts_used=4, hidden=512, vocab=4096).path


def test_every_window_and_dialog_opens(qtbot, tmp_path, model_path, monkeypatch):
    w = make_window(qtbot, tmp_path)
    assert "No model is loaded" in w.chat.transcript.placeholder.text()
    card, _ = load(qtbot, w, model_path)
    assert w.placement_dock.isVisible() and w.experts_dock.isVisible()
    opened = [
        ModelCardDialog(card, w),
        dialogs.SamplingDialog({"temperature": 0.3}, w.bridge.default_sampling, w),
        dialogs.ShortcutsDialog(w),
        dialogs.about_box(w),
        dialogs.rename_dialog(w, "Rename conversation", "Title:", "x"),
        w.file_dialog("Open a GGUF model", False, "GGUF models (*.gguf)"),
        w.file_dialog("Export", True, "Profiler stats (*.json)"),
    ]
    opened += [dialogs.error_box(w, D.Failure(kind, "Title", "message")) for kind in dialogs._TITLES]
    for dlg in opened:
        dlg.show()
        qtbot.waitExposed(dlg)
        assert dlg.isVisible() and dlg.windowTitle()
        dlg.close()
    card_dlg = opened[0]
    assert card_dlg.fields["Architecture"].text() == "qwen3moe"
    assert card_dlg.fields["Chat template"].text() in ("present", "none (ChatML fallback)")
    assert card_dlg.quant_table.rowCount() == len(card.quant_mix)
    # Docks float and come back.
    for dock in (w.placement_dock, w.experts_dock):
        dock.setFloating(True)
        qtbot.waitExposed(dock)
        dock.setFloating(False)
    # Every menu action runs with its dialogs answered at once (no modal loop blocks the test).
    rec = patch_dialogs(monkeypatch)
    for name, act in w.actions_by_name.items():
        if name != "quit":
            act.trigger()
    titles = {d.windowTitle() for d in rec.shown}
    assert {"Sampling settings", "Keyboard shortcuts", "About SharpI", f"Model card — {card.name}"} <= titles
    assert any(t.startswith("Open a GGUF") for t in titles) and any(t.startswith("Export") for t in titles)
    assert w.bridge.state == "idle" and w.isVisible()


def test_sampling_dialog_round_trip(qtbot):
    defaults = {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "repeat_penalty": 1.0,
        "max_tokens": 256,
        "seed": None,
    }
    dlg = dialogs.SamplingDialog({"temperature": 0.2, "seed": 7}, defaults)
    qtbot.addWidget(dlg)
    assert dlg.values() == {"temperature": 0.2, "seed": 7}
    dlg.max_tokens.setValue(64)
    dlg.random_seed.setChecked(True)
    assert dlg.values() == {"temperature": 0.2, "max_tokens": 64}
    dlg._restore()
    assert dlg.values() == {}


def test_settings_persist(tmp_path):
    s = Settings(settings_file(tmp_path))
    s.add_recent_model("/a.gguf")
    s.add_recent_model("/b.gguf")
    s.add_recent_model("/a.gguf")
    s.sampling = {"temperature": 0.1}
    s.placement = D.PlanSettings(vram_bytes=123 << 20, ctx=2048, kv_type="q8_0", moe="cache", n_gpu_layers=3)
    s.sync()
    t = Settings(settings_file(tmp_path))
    assert t.recent_models == ["/a.gguf", "/b.gguf"] and t.last_model == "/a.gguf"
    assert t.sampling == {"temperature": 0.1}
    # The placement is the machine's; the context is each model's own (ctx_for), 0 = the model's default.
    assert t.placement == D.PlanSettings(vram_bytes=123 << 20, ctx=0, kv_type="q8_0", moe="cache", n_gpu_layers=3)
    t.set_ctx_for("/a.gguf", 2048)
    assert Settings(settings_file(tmp_path)).ctx_for("/a.gguf") == 2048 and t.ctx_for("/b.gguf") == 0
    t.q.setValue("models/placement", "{broken json")
    assert t.placement is None  # a damaged value falls back to the default


# What the UI thread may call on a Session (cheap and thread-safe, see sharpi_gui/bridge); every
# other Session method (loading, tokenizing, generating, applying a placement, calibrating) runs on
# the engine's worker thread, so the window keeps painting whatever the engine is doing.
UI_THREAD_CALLS = {"cancel", "stats", "plan"}
SESSION_CALLS = (
    "load", "tokenize", "detokenize", "render_chat", "generate", "cancel", "reset", "device_profile",
    "plan", "apply", "stats", "export_stats", "reset_stats", "logits", "close",
)  # fmt: skip


def test_engine_work_stays_off_the_ui_thread(qtbot, tmp_path, big_model_path, monkeypatch):
    """While a model loads and a reply streams, the UI thread calls only the cheap Session methods;
    everything else runs on the engine thread (counted per call, not timed)."""
    import threading

    from engine.api import Session

    calls: list[tuple[str, bool]] = []  # (method, on the UI thread)
    ui = threading.main_thread()
    for name in SESSION_CALLS:
        orig = Session.__dict__[name]
        fn = orig.__func__ if isinstance(orig, classmethod) else orig

        def wrapped(*a, _fn=fn, _name=name, **k):
            calls.append((_name, threading.current_thread() is ui))
            return _fn(*a, **k)

        monkeypatch.setattr(Session, name, classmethod(wrapped) if isinstance(orig, classmethod) else wrapped)
    w = make_window(qtbot, tmp_path)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 32}
    load(qtbot, w, big_model_path)
    qtbot.waitUntil(
        lambda: w.ctx.placement.preview is not None and w.ctx.experts.frame is not None, timeout=GEN_TIMEOUT_MS
    )
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        assert w.ctx.chat.send("Write a long answer please")
    assert done.args[1].n_generated > 0 and w.ctx.experts.frames >= 1
    w.close()
    on_ui = {name for name, ui_thread in calls if ui_thread}
    off_ui = {name for name, ui_thread in calls if not ui_thread}
    assert {"load", "generate"} <= off_ui, calls
    assert on_ui <= UI_THREAD_CALLS, sorted(on_ui - UI_THREAD_CALLS)


def test_theme_follows_the_system(qtbot, monkeypatch):
    import sharpi_gui.theme as theme_module

    app = QApplication.instance()
    hints = QGuiApplication.styleHints()
    old_palette, old_style = app.palette(), app.style().name()
    themes = ThemeManager(app)
    seen = []
    themes.changed.connect(seen.append)
    try:
        # The offscreen platform has no system scheme to switch: play the platform's part.
        for scheme, dark, want in ((Qt.ColorScheme.Dark, True, DARK), (Qt.ColorScheme.Light, False, LIGHT)):
            monkeypatch.setattr(theme_module, "system_is_dark", lambda d=dark: d)
            hints.colorSchemeChanged.emit(scheme)
            assert themes.theme is want
        assert seen[-2:] == [DARK, LIGHT]
        monkeypatch.setattr(theme_module, "system_is_dark", lambda: True)
        hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)
        assert app.palette().color(QPalette.ColorRole.Window).lightness() < 80
    finally:
        themes.deleteLater()
        app.setStyle(old_style)
        app.setPalette(old_palette)


def test_window_restyles_on_theme_change(qtbot, tmp_path):
    w = make_window(qtbot, tmp_path)
    w.chat.transcript.add_message("user", "hi")
    w.restyle(DARK)
    assert DARK.user_bubble in w.chat.transcript.bubbles[0].styleSheet()
    assert w.placement_dock.panel.layout_view.theme is DARK


def test_open_initial_prefers_argument_then_last_then_demo(qtbot, tmp_path, model_path, monkeypatch):
    w = make_window(qtbot, tmp_path)
    monkeypatch.setattr(w.bridge, "demo_model_path", lambda: None)
    assert w.open_initial() is None  # nothing to open: the empty window with its hint
    assert "File → Open" in w.chat.transcript.placeholder.text()
    monkeypatch.setattr(w.bridge, "demo_model_path", lambda: str(model_path))
    with qtbot.waitSignal(w.bridge.loaded, timeout=GEN_TIMEOUT_MS):
        assert w.open_initial() == str(model_path)
    assert _parser().parse_args(["m.gguf", "--data-dir", "d"]).model == "m.gguf"


class _Emitter(QObject):
    ping = Signal(object)


def test_qt_singleton_refcounts_survive_many_signals(qtbot):
    """PySide6 6.12.0 leaks references to True/None per signal; sharpi_gui guards against it."""
    e = _Emitter()
    e.ping.connect(lambda _x: None)
    for _ in range(5000):  # far more than True's count (~600) on an unguarded CPython 3.11
        e.ping.emit(None)
    assert sys.getrefcount(True) > 0 and sys.getrefcount(None) > 0


def test_demo_model_card_is_shown(qtbot, tmp_path):
    """The shipped demo model's MODEL_CARD.md appears in the app's model card; its name is the window's title."""
    from engine.demo import demo_model_path

    w = make_window(qtbot, tmp_path)
    card, _ = load(qtbot, w, demo_model_path())
    assert "SharpI" in card.name and w.windowTitle() == card.name  # SharpI once in the title, not "SharpI — SharpI …"
    dlg = ModelCardDialog(card, w)
    dlg.show()
    qtbot.waitExposed(dlg)
    assert dlg.notes is not None and "pydoc_data" in dlg.notes.toPlainText()
    dlg.close()
