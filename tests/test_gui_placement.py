"""The placement dock (pytest-qt, offscreen): sliders re-plan within 200 ms (throttled, latest wins),
the preview is the engine planner's placement, Apply re-places without reloading, and errors
(an impossible request, out of memory on Apply) are shown without harm."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402

from engine.errors import DeviceMemoryError  # noqa: E402
from engine.plan import DeviceProfile, PlanRequest  # noqa: E402
from sharpi_gui import data as D  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, load, make_window, patch_dialogs, session_of  # noqa: E402
from sharpi_gui.views.layout_view import bar_spans  # noqa: E402
from tests.test_replan import BUDGET, CTX, GEOM, PROFILE  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen3moe", "Q8_0", vocab=1024).path


@pytest.fixture
def loaded(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path)
    w.settings.set_ctx_for(str(model_path), 1024)
    load(qtbot, w, model_path)
    return w


def _engine_plan(window, s: D.PlanSettings):
    sess = session_of(window)
    source = "" if s.moe == "auto" else "the expert-mode selector"  # named in the planner's reason
    req = PlanRequest(ctx=s.ctx, kv_type=s.kv_type, n_gpu_layers=s.n_gpu_layers, moe=s.moe, moe_source=source)
    return sess.plan(req, sess.device_profile().with_budget(s.vram_bytes))


def test_slider_updates_the_layout_within_200ms_and_latest_wins(qtbot, loaded):
    w = loaded
    panel, model = w.placement_dock.panel, w.ctx.placement
    view = panel.layout_view
    limits = model.limits
    assert panel.vram.maximum() == limits.vram_max_bytes // limits.vram_step_bytes
    qtbot.waitUntil(lambda: view.renders > 0, timeout=GEN_TIMEOUT_MS)
    renders = view.renders
    target = panel.vram.maximum() // 2
    replans = model.replans
    panel.vram.setValue(target)  # what a slider drag emits
    assert model.replans == replans + 1  # the first value of a drag re-plans at once, not after a delay
    qtbot.waitUntil(
        lambda: view.preview.settings.vram_bytes == target * limits.vram_step_bytes and view.renders > renders,
        timeout=GEN_TIMEOUT_MS,
    )

    # A fast drag: many values within one throttle window make one immediate and one trailing plan.
    replans = model.replans
    for v in range(target, target - 40, -1):
        panel.vram.setValue(v)
    last = (target - 39) * limits.vram_step_bytes
    assert model.replans - replans <= 1  # the rest waits for the trailing re-plan
    qtbot.waitUntil(lambda: view.preview.settings.vram_bytes == last, timeout=GEN_TIMEOUT_MS)
    assert model.replans - replans <= 2
    assert panel.vram_label.text().startswith(D.human_bytes(last))


def test_preview_is_the_engine_plan(qtbot, loaded):
    w = loaded
    panel, model = w.placement_dock.panel, w.ctx.placement
    limits = model.limits
    # Context, KV type and expert mode each re-plan too.
    panel.ctx.setValue(limits.ctx_values.index(512))
    panel.kv.setCurrentIndex(panel.kv.findData("bf16"))
    panel.vram.setValue(panel.vram.maximum())
    qtbot.waitUntil(lambda: model.preview.settings == model.settings, timeout=GEN_TIMEOUT_MS)
    s = model.settings
    assert (s.ctx, s.kv_type, s.vram_bytes) == (512, "bf16", limits.vram_max_bytes)
    for moe in ("auto", "cpu", "cache", "resident"):
        panel.moe.setCurrentIndex(panel.moe.findData(moe))
        qtbot.waitUntil(lambda m=moe: model.preview.settings.moe == m, timeout=GEN_TIMEOUT_MS)
        pv = model.preview
        p = _engine_plan(w, pv.settings)
        assert pv.ok, pv.error
        assert dict(pv.segments) == {k: getattr(p.device, k) for k, _ in D.SEGMENTS}
        assert pv.free_bytes == p.budget_bytes - p.device.total
        assert [(c.device, c.experts, c.trunk_bytes, c.kv_bytes) for c in pv.layers] == [
            (x.device, x.experts, x.trunk_bytes, x.kv_bytes) for x in p.layers
        ]
        assert pv.moe_mode == p.moe_mode and pv.moe_reason == p.moe_reason
        assert dict(pv.predicted_tok_s) == p.predicted_tok_s
        # The summary names the chosen mode's speed; the layout view draws this preview.
        assert panel.layout_view.preview is pv
        chosen = dict(pv.predicted_tok_s)[pv.moe_mode]
        assert f"{chosen:,.1f} tok/s" in panel.summary.text()
        # The simulated device plans with the default speeds, and the summary says so.
        assert pv.speeds_source == "defaults" and p.profile.measured == ()
        assert "default speeds, not measured" in panel.summary.text()


def test_bar_is_linear_unless_the_overhead_dominates():
    segs = (("reserve", 100), ("scratch", 0), ("trunk", 300), ("kv", 100), ("globals", 0), ("experts", 500))
    spans, cut = bar_spans(segs, 2000, 1000.0)
    assert cut is None and [(k, round(a), round(b)) for k, a, b in spans] == [
        ("reserve", 0, 50),
        ("trunk", 50, 200),
        ("kv", 200, 250),
        ("experts", 250, 500),
    ]
    spans, cut = bar_spans((("reserve", 900), ("trunk", 50)), 1000, 1000.0)
    assert cut == pytest.approx(180.0)  # overhead squeezed to 18 % behind a break
    assert spans[1][2] - spans[1][1] == pytest.approx(50 / 100 * 820)


def test_impossible_request_is_inline_and_cannot_be_applied(qtbot, loaded):
    w = loaded
    panel, model = w.placement_dock.panel, w.ctx.placement
    panel.moe.setCurrentIndex(panel.moe.findData("resident"))
    panel.vram.setValue(panel.vram.minimum())
    qtbot.waitUntil(lambda: model.preview.settings == model.settings, timeout=GEN_TIMEOUT_MS)
    assert not model.preview.ok and "resident" in model.preview.error
    assert "resident" in panel.summary.text()
    assert not panel.apply_button.isEnabled()


def test_apply_replaces_the_model_without_reloading(qtbot, loaded):
    w = loaded
    panel, model = w.placement_dock.panel, w.ctx.placement
    before = session_of(w)
    assert before.placement is None and w.status["placement"].text() == "placement: CPU only"
    # On the CPU the dock proposes the automatic plan, ready to apply.
    qtbot.waitUntil(lambda: model.preview is not None, timeout=GEN_TIMEOUT_MS)
    assert model.applied is None and model.settings == model.limits.current
    assert "runs on the CPU" in panel.state_label.text() and panel.apply_button.isEnabled()
    assert model.preview.n_gpu_layers == model.preview.n_layer  # the whole model fits the proposal
    step = model.limits.vram_step_bytes
    # A budget that fits the trunk and a few expert slots; the cache mode.
    probe = _engine_plan(w, D.PlanSettings(vram_bytes=model.limits.vram_max_bytes, ctx=1024, moe="cpu"))
    budget = probe.device.total + 3 * probe.expert_slot_bytes
    panel.vram.setValue(-(-budget // step))
    panel.moe.setCurrentIndex(panel.moe.findData("cache"))
    qtbot.waitUntil(
        lambda: model.preview.settings == model.settings and panel.apply_button.isEnabled(), timeout=GEN_TIMEOUT_MS
    )
    assert panel.state_label.text() == "preview (not applied)"
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        qtbot.mouseClick(panel.apply_button, Qt.MouseButton.LeftButton)
    after = session_of(w)
    assert after is before  # re-placed, not reloaded
    assert after.placement.moe_mode == "cache" and after.placement.budget_bytes == model.settings.vram_bytes
    assert "experts: cache" in w.status["placement"].text()
    assert panel.state_label.text() == "in force" and not panel.apply_button.isEnabled()
    assert w.settings.placement.moe == "cache"
    # It still answers, now through the expert cache.
    w.settings.sampling = {"max_tokens": 8, "seed": 3}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.send("hello")
    snap = after.stats()
    assert snap.hits.sum() + snap.misses.sum() > 0 and snap.resident.any()


def test_apply_shows_the_host_copy_progress_and_hides_it_after(qtbot, loaded, monkeypatch):
    """A re-placement that builds the experts' page-locked host copy (seconds to minutes on a 30B file) shows its
    progress in the status bar's bar and the chat's status line, as a load does, and clears both once applied."""
    from engine.runtime.expert_pool import MIRROR_PROGRESS

    w = loaded
    panel = w.placement_dock.panel
    sess = session_of(w)
    real = sess.apply
    seen = []

    def apply(placement, **kw):
        for k in (1, 2):
            kw["progress"](k, 3, MIRROR_PROGRESS)
        return real(placement, **kw)

    monkeypatch.setattr(sess, "apply", apply)
    w.bridge.applyProgress.connect(
        lambda k, n, what: seen.append((k, n, w.progress.isVisible(), w.progress.format(), w.chat.status_line.text()))
    )
    panel.moe.setCurrentIndex(panel.moe.findData("cpu"))
    qtbot.waitUntil(lambda: panel.apply_button.isEnabled(), timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        panel.apply_button.click()
    assert [(k, n) for k, n, *_ in seen] == [(1, 3), (2, 3)]
    for _, _, visible, fmt, line in seen:
        assert visible and fmt == f"{MIRROR_PROGRESS} (%p%)" and MIRROR_PROGRESS in line
    assert not w.progress.isVisible() and w.chat.status_line.text() == ""
    assert sess.placement is not None and sess.placement.moe_mode == "cpu"


def test_out_of_memory_on_apply_shows_a_dialog_and_keeps_the_placement(qtbot, loaded, monkeypatch):
    rec = patch_dialogs(monkeypatch)
    w = loaded
    panel, model = w.placement_dock.panel, w.ctx.placement
    sess = session_of(w)

    def oom(placement, **kw):
        raise DeviceMemoryError(
            "CUDA out of memory (tried to allocate 2.00 GiB); the previous placement stays in force"
        )

    monkeypatch.setattr(sess, "apply", oom)
    panel.moe.setCurrentIndex(panel.moe.findData("cpu"))
    qtbot.waitUntil(lambda: panel.apply_button.isEnabled(), timeout=GEN_TIMEOUT_MS)
    with qtbot.waitSignal(w.bridge.applyFailed, timeout=GEN_TIMEOUT_MS) as failed:
        panel.apply_button.click()
    assert failed.args[0].kind == D.ERR_OUT_OF_MEMORY
    box = rec.errors()[-1]
    assert box.objectName() == "error-out-of-memory" and "out of memory" in box.informativeText()
    assert sess.placement is None and w.bridge.state == "idle"
    assert model.dirty and panel.state_label.text() == "preview (not applied)"
    w.settings.sampling = {"max_tokens": 2}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        assert w.ctx.chat.send("still here?")


def test_speeds_note_says_where_the_figures_come_from():
    from sharpi_gui.views.placement import speeds_note

    pv = D.PlanPreview(settings=D.PlanSettings(vram_bytes=1, ctx=256), speeds_source="measured", speeds_device="GPU X")
    assert speeds_note(pv) == "from speeds measured on this machine (GPU X)"
    assert "partly default" in speeds_note(replace(pv, speeds_source="partly measured"))
    assert "not measured" in speeds_note(replace(pv, speeds_source="defaults", speeds_device=""))


def test_the_app_shows_an_auto_replan(qtbot, tmp_path, synth_model):
    """In the app: an `auto` placement applied from the dock, two replies; before the second, the session re-plans
    on the first's prompt, and the window says so in its status bar and shows the new placement in force."""
    w = make_window(qtbot, tmp_path)
    load(qtbot, w, synth_model("qwen3moe", "Q8_0", **dict(GEOM, vocab=1024)).path)
    worker, sess = w.bridge._worker, session_of(w)
    # This test's speeds (those of the engine tests above) and a sample of one short chat prompt.
    worker.current = replace(worker.current, profile=replace(worker.current.profile, **_speeds(PROFILE)))
    sess.engine_options = replace(sess.engine_options, replan_tokens=8)
    with qtbot.waitSignal(w.bridge.applied, timeout=GEN_TIMEOUT_MS):
        w.bridge.apply(D.PlanSettings(vram_bytes=BUDGET, ctx=CTX, kv_type=sess.kv_type))
    assert sess.placement.moe_mode == "cache" and "experts: cache" in w.status["placement"].text()
    w.settings.sampling = {"max_tokens": 4, "seed": 3}
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.send("Name three rivers")
    assert sess.replans == []
    notes = []
    w.bridge.replanned.connect(lambda headline, note: notes.append(note))
    with qtbot.waitSignal(w.bridge.finished, timeout=GEN_TIMEOUT_MS):
        w.ctx.chat.send("And three mountains")
    assert len(sess.replans) == 1 and sess.replans[0].changed
    mode = sess.placement.moe_mode
    assert mode != "cache" and notes == [sess.replans[0].note]
    qtbot.waitUntil(lambda: f"experts: {mode}" in w.status["placement"].text(), timeout=GEN_TIMEOUT_MS)
    headline = w.statusBar().currentMessage()
    assert headline == sess.replans[0].headline and headline.startswith("Re-planned on this chat's routing: ")
    assert w.status["placement"].toolTip() == sess.replans[0].note  # the hit rates and predictions in full
    fields = sum(lab.width() for lab in w.status.values() if lab.isVisible())  # the permanent fields on the right
    assert w.statusBar().fontMetrics().horizontalAdvance(headline) < w.statusBar().width() - fields
    if os.environ.get("SHARPI_SCREENSHOTS"):
        w.grab().save(os.path.join(os.environ["SHARPI_SCREENSHOTS"], "replan-status.png"))


def _speeds(p: DeviceProfile) -> dict:
    return {"reserve_bytes": p.reserve_bytes, "miss_us": p.miss_us, "cpu_expert_gbps": p.cpu_expert_gbps}
