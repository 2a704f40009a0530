"""What a new user without a GPU meets (pytest-qt, offscreen): an honest placement dock (no simulated
device, no device modes to apply, the CPU's speed), a model warmed up on load, a context that never
dead-ends, its limit explained, and a context setting that stays with its model."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")
torch = pytest.importorskip("torch")

from sharpi_gui import data as D  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, patch_dialogs, session_of  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="shows what a machine without a GPU shows")


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen3moe", "Q8_0", vocab=1024).path


@pytest.fixture(scope="module")
def short_model(synth_model):
    """Trained for 96 tokens: a handful of turns fill its context."""
    return synth_model("qwen3moe", "Q8_0", vocab=1024, ctx=96, seed=3).path


@no_gpu
def test_without_a_gpu_the_dock_offers_only_the_cpu(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path, simulate_device=False)
    # A device placement saved on a machine with a GPU is not applied here.
    w.settings.placement = D.PlanSettings(vram_bytes=1 << 30, ctx=0, moe="cache", n_gpu_layers=-1)
    _card, limits = load(qtbot, w, model_path)
    panel = w.placement_dock.panel
    assert not limits.has_gpu and session_of(w).placement is None
    assert panel.no_gpu.isVisibleTo(panel) and "No GPU found" in panel.no_gpu.text()
    for hidden in (panel.vram, panel.moe, panel.gpu_layers, panel.layout_view):
        assert not hidden.isVisibleTo(panel)
    qtbot.waitUntil(lambda: "this CPU" in panel.summary.text(), timeout=GEN_TIMEOUT_MS)
    summary = panel.summary.text()
    assert "GPU" not in summary and "simulated" not in summary and "resident" not in summary
    assert f"{limits.measured_tok_s:,.1f} tok/s" in summary and limits.measured_tok_s > 0
    assert not panel.apply_button.isEnabled() and panel.state_label.text() == "in force"
    assert w.status["placement"].text() == "placement: CPU only (no GPU found)"
    # What can change on the CPU (the context) previews and applies, on the CPU.
    panel.ctx.setValue(panel.ctx.value() - 1)
    assert panel.apply_button.isEnabled()
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS) as applied:
        panel.apply_button.click()
    assert session_of(w).placement is None or session_of(w).placement.n_gpu_layers == 0
    assert applied.args[1].current.ctx == session_of(w).n_ctx < limits.current.ctx


@no_gpu
def test_what_if_plans_a_gpu_and_can_never_apply_it(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path, simulate_device=False)
    load(qtbot, w, model_path)
    panel, model = w.placement_dock.panel, w.ctx.placement
    assert panel.whatif.isVisibleTo(panel) and not panel.whatif.isChecked()
    panel.whatif.setChecked(True)  # "What if this machine had a GPU?"
    assert model.whatif and model.limits.has_gpu and "hypothetical" in model.limits.device_name
    for shown in (panel.vram, panel.moe, panel.layout_view):
        assert shown.isVisibleTo(panel)
    assert "What-if" in panel.no_gpu.text() and "cannot be applied" in panel.no_gpu.text()
    assert not panel.apply_button.isVisibleTo(panel) and not panel.apply_button.isEnabled()
    qtbot.waitUntil(lambda: "Predicted decode speed" in panel.summary.text(), timeout=GEN_TIMEOUT_MS)
    panel.vram.setValue(panel.vram.maximum() // 2)
    assert model.apply() is False and w.bridge.state == "idle" and session_of(w).placement is None
    panel.whatif.setChecked(False)  # back to this machine: the CPU, as it was
    assert not model.whatif and not model.limits.has_gpu and not panel.vram.isVisibleTo(panel)
    assert "No GPU found" in panel.no_gpu.text() and panel.apply_button.isVisibleTo(panel)


def test_load_warms_up_and_forgets_the_warm_up(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    _card, limits = load(qtbot, w, model_path)
    sess = session_of(w)
    assert sess.state.tokens == [] and sess.stats().tokens_total == 0  # nothing of the warm-up is left
    assert limits.measured_tok_s > 0
    assert not w.chat.status_line.isVisible() and w.chat.send_button.isEnabled()


def test_context_is_per_model_and_its_limit_explained(qtbot, tmp_path, model_path, short_model):
    from engine.plan import default_ctx

    w = make_window(qtbot, tmp_path, simulate_device=False)
    card, _ = load(qtbot, w, short_model)
    panel = w.placement_dock.panel
    assert card.n_ctx == default_ctx(96) == 96  # the model's own default, as `sharpi run` gives it
    # Its slider cannot move (nothing below 256 is offered, nothing above what it was trained for): it says so.
    assert not panel.ctx.isEnabled() and "trained for" in panel.ctx_label.text() and "96" in panel.ctx.toolTip()
    card, limits = load(qtbot, w, model_path)
    assert card.n_ctx == default_ctx(card.n_ctx_train) and limits.ctx_values[-1] == card.n_ctx_train
    # A context applied to one model does not carry over to the next.
    panel.ctx.setValue(0)
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        panel.apply_button.click()
    small = session_of(w).n_ctx
    assert small == limits.ctx_values[0] < card.n_ctx and w.settings.ctx_for(str(model_path)) == small
    card2, _ = load(qtbot, w, short_model)
    assert card2.n_ctx == 96
    card3, _ = load(qtbot, w, model_path)  # and the first model keeps its own
    assert card3.n_ctx == small


def test_a_full_context_drops_old_turns_and_says_so_once(qtbot, tmp_path, short_model):
    w = make_window(qtbot, tmp_path, simulate_device=False)
    load(qtbot, w, short_model)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 12}
    trims = []
    w.bridge.trimmed.connect(lambda rid, dropped, n_ctx: trims.append(dropped))
    for i in range(8):
        with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
            assert w.ctx.chat.send(f"question number {i} about loops")
        assert done.args[1].finish_reason != "error"
    roles = [b.role for b in w.chat.transcript.bubbles]
    assert trims and "notice" not in roles  # old turns left, no dead end
    infos = [b for b in w.chat.transcript.bubbles if b.role == "info"]
    assert len(infos) == 1 and "oldest turns" in infos[0].text  # said once per conversation
    assert roles.count("user") == 8 and roles.count("assistant") == 8  # the transcript keeps every turn


def test_a_weightless_file_is_refused_before_loading_and_not_reopened(
    qtbot, tmp_path, monkeypatch, model_path, synth_geometry
):
    rec = patch_dialogs(monkeypatch)
    geometry = synth_geometry("qwen3-30b-a3b").path  # 17 GiB of shapes, a hole where the weights would be
    w = make_window(qtbot, tmp_path, simulate_device=False)
    stages = []
    w.bridge.loadProgress.connect(lambda d, t, what: stages.append(what))
    with qtbot.waitSignal(w.bridge.loadFailed, timeout=GEN_TIMEOUT_MS) as failed:
        w.open_model(str(geometry))
    assert failed.args[0].kind == D.ERR_CANNOT_RUN and "no weights" in failed.args[0].message
    assert stages == ["checking the file"]  # refused before the model was built
    assert rec.errors()[-1].objectName() == f"error-{D.ERR_CANNOT_RUN}"
    assert str(geometry) not in w.settings.recent_models and not w.bridge.has_model


def test_a_load_that_never_ended_is_not_reopened(qtbot, tmp_path, monkeypatch, model_path, short_model):
    w = make_window(qtbot, tmp_path)
    w.settings.add_recent_model(str(short_model))
    w.settings.loading_model = str(short_model)  # the previous start died while loading it
    monkeypatch.setattr(w.bridge, "demo_model_path", lambda: str(model_path))
    with qtbot.waitSignal(w.bridge.loaded, timeout=GEN_TIMEOUT_MS) as loaded:
        assert w.open_initial() == str(model_path)
    assert loaded.args[0].path == str(model_path) and str(short_model) not in w.settings.recent_models[1:]
    assert "did not finish loading" in w.statusBar().currentMessage()


def test_cancel_stops_a_load_and_keeps_the_model_open_before(qtbot, tmp_path, monkeypatch, model_path, short_model):
    rec = patch_dialogs(monkeypatch)
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    w.bridge.loadStarted.connect(lambda _p: w.cancel_button.click())  # Cancel as soon as it shows
    with qtbot.waitSignal(w.bridge.loadFailed, timeout=GEN_TIMEOUT_MS) as failed:
        w.open_model(str(short_model))
    assert failed.args[0].kind == D.ERR_CANCELLED and not rec.errors()  # no error dialog
    assert str(session_of(w).info.path) == str(model_path) and w.bridge.state == "idle"
    assert not w.cancel_button.isVisible() and w.chat.send_button.isEnabled()
    assert w.settings.recent_models[0] == str(model_path)


def test_no_display_is_said_plainly():
    from sharpi_gui.app import no_display_reason

    reason = no_display_reason({})
    if not reason:
        pytest.skip("not Linux: Qt's platforms there need no DISPLAY")
    assert "no display" in reason and "xvfb-run" in reason
    assert no_display_reason({"DISPLAY": ":0"}) == "" and no_display_reason({"QT_QPA_PLATFORM": "offscreen"}) == ""


def test_sharpi_gui_without_a_display_says_so_and_exits(tmp_path):
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("Linux: Qt's platforms elsewhere need no DISPLAY")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    cmd = [sys.executable, "-m", "sharpi_gui.app", "--data-dir", str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no display to open a window on" in r.stderr, r.stderr
    assert "libxcb-cursor0" not in r.stderr and "Traceback" not in r.stderr


_TITLE_CHILD = """
import subprocess, sys
from PySide6.QtWidgets import QApplication, QWidget
from sharpi_gui.app import configure_application
from sharpi_gui.views.main_window import APP_NAME
app = configure_application(QApplication([sys.argv[0]]))
if sys.argv[1] == "display-name":
    app.setApplicationDisplayName(APP_NAME)  # what the app must not do
w = QWidget()
w.setWindowTitle(APP_NAME + " \u2014 sharpi-demo")
w.show()
for _ in range(50):
    app.processEvents()
out = subprocess.run(["xprop", "-id", str(int(w.winId())), "_NET_WM_NAME"], capture_output=True, text=True)
print(out.stdout)
"""


def _title_on_x(tmp_path, mode: str) -> str:
    import shutil
    import subprocess
    import sys

    if not (sys.platform.startswith("linux") and shutil.which("xvfb-run") and shutil.which("xprop")):
        pytest.skip("needs xvfb-run and xprop (apt-get install xvfb xauth x11-utils)")
    env = dict(os.environ, QT_QPA_PLATFORM="xcb", HOME=str(tmp_path))
    cmd = ["xvfb-run", "-a", sys.executable, "-c", _TITLE_CHILD, mode]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "_NET_WM_NAME" in r.stdout, r.stderr
    return r.stdout.split("=", 1)[1].strip().strip('"')


def test_the_title_bar_names_the_app_once(tmp_path):
    """The title the X server shows (not only QWidget.windowTitle): "SharpI — model", never "… — SharpI" again."""
    assert _title_on_x(tmp_path, "app") == "SharpI — sharpi-demo"
    # The check sees the repetition Qt makes when an application display name is set.
    assert _title_on_x(tmp_path, "display-name") == "SharpI — sharpi-demo — SharpI"


def test_export_a_conversation_and_copy_a_message(qtbot, tmp_path, monkeypatch, model_path):
    import json

    from PySide6.QtGui import QGuiApplication

    rec = patch_dialogs(monkeypatch)
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, model_path)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 6}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        assert w.ctx.chat.send("What is __import__?")
    reply = w.ctx.chat.messages[-1].content
    rec.files += [str(tmp_path / "chat.json"), str(tmp_path / "chat")]
    w.export_conversation_dialog()
    doc = json.loads((tmp_path / "chat.json").read_text(encoding="utf-8"))
    assert [(m["role"], m["content"]) for m in doc["messages"]] == [
        ("user", "What is __import__?"),
        ("assistant", reply),
    ]
    assert doc["title"] == "What is __import__?" and "decode_tok_s" in doc["messages"][1]
    w.export_conversation_dialog()  # no suffix: Markdown, named so
    md = (tmp_path / "chat.md").read_text(encoding="utf-8")
    assert "## You\n\nWhat is __import__?" in md and "## Assistant" in md
    w.chat.transcript.bubbles[-1].copy()
    assert QGuiApplication.clipboard().text() == reply
