"""The experts dock (pytest-qt, offscreen): the heatmap shows exactly the profiler snapshot in each
mode, refreshes at >= 4 Hz while tokens stream, and export (button and menu) writes JSON + CSV
equal to the engine's snapshot plus a PNG of the heatmap."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402

from engine.plan import PlanRequest  # noqa: E402
from sharpi_gui.data import PlanSettings  # noqa: E402
from sharpi_gui.experts_model import POLL_MS  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, patch_dialogs, session_of  # noqa: E402


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen3moe", "Q8_0", vocab=1024).path


@pytest.fixture
def cached(qtbot, tmp_path, model_path):
    """A window whose model runs its experts through a small device cache, after one reply."""
    w = make_window(qtbot, tmp_path)
    w.settings.set_ctx_for(str(model_path), 2048)
    load(qtbot, w, model_path)
    sess = session_of(w)
    probe = sess.plan(PlanRequest(ctx=2048, moe="cpu"), sess.device_profile())
    budget = probe.device.total + 5 * probe.expert_slot_bytes
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        w.bridge.apply(PlanSettings(vram_bytes=budget, ctx=2048, kv_type=sess.kv_type, moe="cache"))
    w.settings.sampling = {"max_tokens": 8, "seed": 5}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.send("Name three rivers")
    return w


def test_heatmap_is_the_snapshot_in_every_mode(qtbot, cached):
    w = cached
    panel, model = w.experts_dock.panel, w.ctx.experts
    qtbot.waitUntil(lambda: model.frame is not None and model.frame.tokens_total > 0, timeout=GEN_TIMEOUT_MS)
    snap = session_of(w).stats()  # idle engine: nothing changes any more
    assert model.frame.tokens_total == snap.tokens_total
    assert snap.resident.any() and (snap.hits.sum() > 0) and (snap.misses.sum() > 0)
    lookups = snap.hits + snap.misses
    expected = {
        "heat": snap.heat,
        "residency": snap.resident.astype(np.float64),
        "hit": np.where(lookups > 0, snap.hits / np.maximum(lookups, 1), 0.0),
    }
    for mode, arr in expected.items():
        panel.mode_box.setCurrentIndex(panel.mode_box.findData(mode))
        assert model.mode == mode
        shown = panel.image.image
        assert shown.shape == (snap.n_layer, snap.n_expert)
        np.testing.assert_array_equal(shown, arr)
    assert "access heat" in panel.mode_box.itemText(0)
    # Labelled axes and a colour bar.
    assert panel.plot.getAxis("left").labelText == "layer"
    assert panel.plot.getAxis("bottom").labelText == "expert"
    assert panel.colorbar.levels()[1] == 1.0  # hit ratio: 0..1


def test_live_refresh_while_streaming(qtbot, cached):
    """While a reply streams, a steady timer (every POLL_MS, i.e. at least 4 Hz) pulls frames and the
    panel draws each one once; the timer stops with the generation (counted, not timed)."""
    w = cached
    model = w.ctx.experts
    frames = []
    panel = w.experts_dock.panel
    model.frameChanged.connect(lambda _f: frames.append(panel.renders))
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 1800}
    assert w.ctx.chat.send("Go on for a while")
    assert model.live and model._timer.interval() == POLL_MS <= 250  # polling starts with the generation
    qtbot.waitUntil(lambda: len(frames) >= 6, timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.stop()
    assert not model.live
    assert frames[5] - frames[0] == 5  # each frame was drawn


def _check_export(prefix, session, panel):
    snap = session.stats()
    data = json.loads(Path(f"{prefix}.json").read_text())
    assert data == json.loads(json.dumps(snap.to_dict()))
    with open(f"{prefix}.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:3] == ["layer", "expert", "calls"]
    body = [
        [int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), float(r[6]), int(r[7])] for r in rows[1:]
    ]
    want = [
        [
            lay,
            e,
            snap.calls[lay, e],
            snap.hits[lay, e],
            snap.misses[lay, e],
            snap.uploaded_bytes[lay, e],
            None,
            int(snap.resident[lay, e]),
        ]
        for lay in range(snap.n_layer)
        for e in range(snap.n_expert)
    ]
    assert [r[:6] + r[7:] for r in body] == [r[:6] + r[7:] for r in want]
    np.testing.assert_allclose([r[6] for r in body], snap.heat.reshape(-1), rtol=1e-5)
    png = QImage(f"{prefix}.png")
    assert not png.isNull() and png.width() == panel.heatmap.width()


def test_export_from_the_button_and_the_menu(qtbot, cached, tmp_path, monkeypatch):
    rec = patch_dialogs(monkeypatch)
    w = cached
    panel = w.experts_dock.panel
    sess = session_of(w)
    assert panel.export_button.isEnabled()
    rec.files.append(str(tmp_path / "button.json"))
    qtbot.mouseClick(panel.export_button, Qt.MouseButton.LeftButton)
    _check_export(tmp_path / "button", sess, panel)
    rec.files.append(str(tmp_path / "menu"))
    w.actions_by_name["export"].trigger()
    _check_export(tmp_path / "menu", sess, panel)
    assert w.settings.export_dir == str(tmp_path)
    assert "menu.png" in w.statusBar().currentMessage()
    # Cancelling the dialog writes nothing.
    w.actions_by_name["export"].trigger()
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["button.json", "menu.json"]


def test_dock_and_status_bar_report_one_decode_window(qtbot, cached):
    """The experts dock and the status bar show the same decode tok/s and hit rate over the same tokens:
    both read the profiler's decode window; the dock's per-token plot is 1 ÷ the intervals that window sums."""
    from sharpi_gui.views.experts import decode_text

    w = cached
    w.settings.sampling = {"max_tokens": 16, "seed": 7}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS) as done:
        w.ctx.chat.send("Name three mountains")
    final = done.args[1]
    frame = w.bridge.poll_stats(force=True)
    assert final.n_generated > 2 and frame.decode_tokens == final.n_generated - 1
    assert frame.decode_tok_s == final.decode_tok_s > 0
    assert frame.decode_hit_rate == final.decode_hit_rate is not None  # a cache placement: it has lookups
    shown = decode_text(final.decode_tok_s, final.decode_hit_rate)
    assert w.status["decode"].text() == f"decode {shown}"
    assert f"last reply: decode {shown}" in w.experts_dock.panel.info.text()
    # The plotted per-token speeds are the window's: their count over the sum of their intervals.
    per_token = frame.tok_s[np.isfinite(frame.tok_s)][-frame.decode_tokens :]
    assert len(per_token) == frame.decode_tokens
    assert frame.decode_tokens / float(np.sum(1.0 / per_token)) == pytest.approx(frame.decode_tok_s, rel=1e-9)
    # The plots mark the window's figures: dashed lines at the status bar's tok/s and hit rate.
    tok_line, hit_line = w.experts_dock.panel.window_lines
    assert tok_line.isVisible() and tok_line.value() == frame.decode_tok_s
    assert hit_line.isVisible() and hit_line.value() == frame.decode_hit_rate
    assert f"{frame.decode_tok_s:.1f}" in tok_line.label.toPlainText()
    # The window's hit rate is the plotted per-pass rates' lookups over those same passes.
    snap = session_of(w).stats()
    assert snap.decode.hits + snap.decode.misses > 0
    export = snap.to_dict()["decode"]
    assert export["tok_s"] == frame.decode_tok_s and export["hit_rate"] == frame.decode_hit_rate
    if os.environ.get("SHARPI_SCREENSHOTS"):
        qtbot.wait(300)
        w.grab().save(os.path.join(os.environ["SHARPI_SCREENSHOTS"], "decode-window.png"))


def test_prefetch_hits_beside_demand_hits(qtbot, tmp_path, model_path, engine_env):
    """With predictive prefetch on (SHARPI_CACHE_PREFETCH), the dock's line splits the cache's hits into
    demand and prefetched ones, as the engine's snapshot counts them, with the prediction's recall."""
    engine_env({"SHARPI_CACHE_PREFETCH": "2"})
    w = make_window(qtbot, tmp_path)
    w.settings.set_ctx_for(str(model_path), 2048)
    load(qtbot, w, model_path)
    sess = session_of(w)
    probe = sess.plan(PlanRequest(ctx=2048, moe="cpu"), sess.device_profile())

    def slots(budget):
        p = sess.plan(PlanRequest(ctx=2048, moe="cache"), sess.device_profile().with_budget(budget))
        return p.expert_slots_allocated if p.moe_mode == "cache" else 0

    # a cache of a few slots (of the model's 16 experts), where predictions have something to upload
    budget = next(b for n in range(16) if 3 <= slots(b := probe.device.total - n * probe.expert_slot_bytes) <= 8)
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        w.bridge.apply(PlanSettings(vram_bytes=budget, ctx=2048, kv_type=sess.kv_type, moe="cache"))
    w.settings.sampling = {"max_tokens": 12, "seed": 5}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.send("Name three rivers")
    model, panel = w.ctx.experts, w.experts_dock.panel
    model.poll(force=True)
    qtbot.waitUntil(lambda: model.frame is not None and model.frame.tokens_total > 0, timeout=GEN_TIMEOUT_MS)
    snap = session_of(w).stats()
    f = model.frame
    assert f.prefetch_hits == int(snap.prefetch_hits.sum()) > 0
    assert f.demand_hits + f.prefetch_hits == int(snap.hits.sum())
    assert 0 <= f.prefetch_recall <= 1
    assert f"{f.demand_hits:,} demand, {f.prefetch_hits:,} prefetched" in panel.info.text()
    assert "prediction recall" in panel.info.text()
    if os.environ.get("SHARPI_SCREENSHOTS"):
        w.experts_dock.grab().save(os.path.join(os.environ["SHARPI_SCREENSHOTS"], "experts-dock-prefetch.png"))


def test_policy_selector_rebuilds_the_cache_and_recording_feeds_the_routing_history(
    qtbot, cached, engine_env, tmp_path
):
    """The dock's policy selector: the engine's cache runs the policy chosen (the same replies); Record routing
    saves the model's routing into the routing history, and the placement dock then prices the cache with it."""
    w = cached
    panel, model = w.experts_dock.panel, w.ctx.experts
    sess = session_of(w)
    assert panel.policy_box.currentData() == model.policy == "dlfu" == sess.applied.experts.slots.name
    assert panel.policy_box.itemData(panel.policy_box.currentIndex(), Qt.ItemDataRole.ToolTipRole)
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        panel.policy_box.setCurrentIndex(panel.policy_box.findData("lru"))
    sess = session_of(w)
    assert sess.applied.experts.slots.name == "lru" and sess.cache_policy == "lru" and model.policy == "lru"
    assert w.ctx.placement.limits.cache_policy == "lru"
    # Recording: the suite's routing history is empty, so the placement dock names the Zipf guess first.
    placement = w.placement_dock.panel
    qtbot.waitUntil(lambda: w.ctx.placement.preview is not None and w.ctx.placement.preview.ok)
    assert "cache hit rates from the Zipf popularity guess" in placement.summary.text()
    assert placement.history.isChecked() and placement.history.isVisible()
    routes = tmp_path / "my-routes"
    sess.engine_options = replace(sess.engine_options, routes_dir=routes)  # this test's own history
    qtbot.waitUntil(lambda: panel.record_button.isEnabled())
    panel.record_button.click()
    assert w.bridge.recording_routes and panel.record_button.text() == "Stop recording"
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.send("And three mountains")
    saved = []
    panel.recordSaved.connect(saved.append)
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):  # re-priced with the new trace
        panel.record_button.click()
    assert not w.bridge.recording_routes and panel.record_button.text() == "Record routing"
    assert len(saved) == 1 and Path(saved[0]).parent == routes and Path(saved[0]).is_file()
    qtbot.waitUntil(lambda: "your routing history: 1 trace" in placement.summary.text(), timeout=GEN_TIMEOUT_MS)
    assert w.ctx.placement.preview.hit_curve_source.startswith("your routing history: 1 trace, ")
    # "Use my routing history" unchecked: back to the Zipf guess
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        placement.history.setChecked(False)
    qtbot.waitUntil(lambda: "Zipf popularity guess" in placement.summary.text(), timeout=GEN_TIMEOUT_MS)
    assert not session_of(w).routing_history and not placement.history.isChecked()
    if os.environ.get("SHARPI_SCREENSHOTS"):
        w.experts_dock.grab().save(os.path.join(os.environ["SHARPI_SCREENSHOTS"], "experts-dock-policy.png"))
        w.placement_dock.grab().save(os.path.join(os.environ["SHARPI_SCREENSHOTS"], "placement-dock-curve.png"))


def test_cache_policies_agree_with_the_engine():
    from engine import config
    from sharpi_gui import data as D

    assert D.CACHE_POLICIES == config.CACHE_POLICIES and D.DEFAULT_CACHE_POLICY == config.DEFAULT_CACHE_POLICY
    assert set(D.CACHE_POLICY_LABELS) == set(D.CACHE_POLICY_TIPS) == set(D.CACHE_POLICIES)
