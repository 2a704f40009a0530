"""The app measures this CPU itself (pytest-qt, offscreen): on the first launch without a GPU, after the
model is warmed up, the CPU calibration runs in the background with a visible progress line; asking a
question pauses it (the chat never waits for it) and it resumes after the answer; once done the placement
dock's and the library's predictions are measured ones (labelled uncalibrated before); a restart does not
measure again; Skip stops it and nothing is cached."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")
torch = pytest.importorskip("torch")

from sharpi_gui import data as D  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU calibration runs without a GPU")
CALIBRATION_MS = 240_000
SHOTS = Path(os.environ.get("SHARPI_SCREENSHOTS", "")) if os.environ.get("SHARPI_SCREENSHOTS") else None


@pytest.fixture
def demo():
    from engine.demo import demo_model_path

    return str(demo_model_path())


@pytest.fixture
def cal_dir(tmp_path, engine_env):
    engine_env({"SHARPI_CALIBRATION_DIR": str(tmp_path / "cal"), "SHARPI_NO_CALIBRATE": None})
    return tmp_path / "cal"


def _library(qtbot, w, path: str) -> D.LibraryEntry:
    """The library's entry for the model file ``path``, from a scan of its folder (which holds other models too)."""
    got: list[D.LibraryEntry] = []
    w.bridge.libraryEntry.connect(got.append)
    try:
        with qtbot.waitSignal(w.bridge.libraryDone, timeout=60_000):
            w.bridge.scan_library([str(Path(path).parent)])
    finally:
        w.bridge.libraryEntry.disconnect(got.append)
    (entry,) = [e for e in got if e.path == str(path)]
    return entry


def _shot(qtbot, w, name: str) -> None:
    if SHOTS is not None:
        qtbot.wait(300)  # layouts settle (a label that grew) before the grab
        SHOTS.mkdir(parents=True, exist_ok=True)
        w.grab().save(str(SHOTS / name))


def test_first_launch_calibrates_in_the_background_and_a_restart_does_not(qtbot, tmp_path, cal_dir, demo):
    w = make_window(qtbot, tmp_path / "one", simulate_device=False, calibrate_cpu=True)
    # Before: the library's prediction for the demo is labelled uncalibrated.
    assert not _library(qtbot, w, demo).calibrated
    with qtbot.waitSignal(w.bridge.calibrationProgress, timeout=GEN_TIMEOUT_MS):
        load(qtbot, w, demo)  # the calibration starts once the model is warmed up
    assert w.bridge.calibration_state == "running"
    assert w.calib_label.isVisible() and w.calib_label.text().startswith(D.CALIBRATING)
    assert w.calib_cancel.isVisible()
    qtbot.waitUntil(lambda: w.ctx.placement.preview is not None, timeout=10_000)
    assert w.ctx.placement.preview.speeds_source == "defaults"
    summary = w.placement_dock.panel.summary
    qtbot.waitUntil(lambda: "uncalibrated" in summary.text(), timeout=10_000)  # the dock says so
    qtbot.waitUntil(lambda: " of " in w.calib_label.text(), timeout=60_000)  # "— k of N"
    _shot(qtbot, w, "calibration-running.png")
    # A question pauses it: the answer comes, then the measuring starts again.
    with qtbot.waitSignal(w.bridge.calibrationEnded, timeout=10_000) as paused:
        assert w.ctx.chat.send("What is a decorator?")
    assert paused.args[0] == "paused"
    assert "paused" in w.calib_label.text()
    with qtbot.waitSignal(w.bridge.calibrated, timeout=CALIBRATION_MS):
        pass  # the answer finishes, the calibration resumes and completes
    assert w.bridge.calibration_state == "done" and not w.calib_label.isVisible()
    answers = [b for b in w.chat.transcript.bubbles if b.role == "assistant"]
    assert len(answers) == 1 and answers[0].text.strip()  # the chat answered while it was paused
    qtbot.waitUntil(lambda: w.ctx.placement.preview.speeds_source == "measured", timeout=10_000)
    qtbot.waitUntil(lambda: "from speeds measured on this machine" in summary.text(), timeout=10_000)
    assert "uncalibrated" not in summary.text()
    assert _library(qtbot, w, demo).calibrated
    _shot(qtbot, w, "calibration-done.png")
    assert list(cal_dir.glob("*.json"))
    w.close()

    # A restart finds it cached: nothing runs, and the predictions are measured at once.
    w2 = make_window(qtbot, tmp_path / "two", simulate_device=False, calibrate_cpu=True)
    load(qtbot, w2, demo)
    assert not w2.bridge.calibration_needed() and w2.bridge.calibration_state == ""
    assert not w2.bridge.start_calibration() and not w2.calib_label.isVisible()
    qtbot.waitUntil(lambda: w2.ctx.placement.preview is not None, timeout=10_000)
    assert w2.ctx.placement.preview.speeds_source == "measured"


def test_skip_stops_the_calibration_and_caches_nothing(qtbot, tmp_path, cal_dir, demo):
    w = make_window(qtbot, tmp_path, simulate_device=False, calibrate_cpu=True)
    with qtbot.waitSignal(w.bridge.calibrationProgress, timeout=GEN_TIMEOUT_MS):
        load(qtbot, w, demo)
    with qtbot.waitSignal(w.bridge.calibrationEnded, timeout=30_000) as ended:
        w.calib_cancel.click()
    assert ended.args[0] == "cancelled" and w.bridge.calibration_state == "cancelled"
    assert not w.calib_label.isVisible() and "skipped" in w.statusBar().currentMessage()
    assert not list(cal_dir.glob("*.json")) and w.bridge.calibration_needed()
    assert not w.bridge.start_calibration()  # not again until the next launch
