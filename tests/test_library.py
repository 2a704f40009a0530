"""The model library: GGUF files found on this machine, each judged from its header before loading —
runs or not (and why), how it would be placed, its predicted decode speed — and opened from the list."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine.library import default_folders, find_files, judge  # noqa: E402
from engine.preflight import NO_WEIGHTS  # noqa: E402


@pytest.fixture(scope="module")
def shelf(tmp_path_factory, synth_model, synth_geometry):
    """A folder as users have them: a model, a geometry-only file, a link to the model (the Hugging Face
    cache's snapshots), an Ollama-style blob with no .gguf name, and a file that is not a GGUF."""
    d = tmp_path_factory.mktemp("shelf")
    model = synth_model("qwen3moe", "Q8_0", vocab=1024).path
    os.symlink(model, d / "model.gguf")
    os.symlink(synth_geometry("qwen3-30b-a3b").path, d / "qwen3-30b-geometry.gguf")
    (d / "snapshots").mkdir()
    os.symlink(model, d / "snapshots" / "same-model.gguf")
    (d / "blobs").mkdir()
    (d / "blobs" / "sha256-abc").write_bytes(Path(synth_model("olmoe", "Q8_0", vocab=1024).path).read_bytes())
    (d / "notes.gguf").write_bytes(b"not a model")
    return d


def test_find_files_takes_each_model_once_and_blobs_by_magic(shelf):
    found = sorted(p.name for p in find_files([shelf]))
    assert found == ["model.gguf", "notes.gguf", "qwen3-30b-geometry.gguf", "sha256-abc"]


def test_verdicts(shelf, engine_env, tmp_path):
    engine_env({"SHARPI_CALIBRATION_DIR": str(tmp_path / "no-calibration")})  # not this machine's cache
    ok = judge(shelf / "model.gguf", ram=64 << 30, vram=0)
    assert ok.runnable and ok.architecture == "qwen3moe" and ok.quant == "Q8_0"
    assert "everything on the CPU" in ok.verdict and ok.predicted_tok_s > 0 and "default speeds" in ok.speeds
    geo = judge(shelf / "qwen3-30b-geometry.gguf", ram=64 << 30, vram=0)
    assert not geo.runnable and geo.verdict == f"cannot run: {NO_WEIGHTS}" and "hole on disk" in geo.detail
    small = judge(shelf / "model.gguf", ram=1 << 20, vram=0)
    assert not small.runnable and "RAM" in small.detail
    bad = judge(shelf / "notes.gguf")
    assert not bad.runnable and "not a usable GGUF" in bad.verdict
    gpu = judge(shelf / "model.gguf", ram=64 << 30, vram=8 << 30)
    assert gpu.runnable and "on the GPU" in gpu.verdict


def test_cpu_verdicts_use_this_machines_cpu_calibration(shelf, engine_env, tmp_path):
    """Without a GPU, the prediction uses the CPU calibration cached on this machine (`sharpi bench calibrate
    --device host`, which the app runs on its first launch): its fixed costs, and the rates measured for this
    file's shapes — else those rates' defaults, the verdict then "partly calibrated"; nothing with calibration
    off, and never for a GPU verdict. Without any, the prediction is labelled uncalibrated."""
    from engine.bench import calibrate as cal
    from engine.bench import calibrate_host as hc

    engine_env({"SHARPI_CALIBRATION_DIR": str(tmp_path)})
    model = shelf / "model.gguf"
    cached = hc.cached_cpu_profile
    assert cached(model) is None  # nothing cached here
    default = judge(model, ram=64 << 30, vram=0, cpu_profile=cached)
    assert default.speeds.startswith("uncalibrated") and not default.calibrated
    shape, trunk = hc._model_shapes(model)
    fixed = {"token_us": 2000.0, "host_layer_us": 900.0}
    cal._write(hc.host_key(), {"profile": fixed, "cpu_expert_gbps": {"other": 1.0}, "cpu_trunk_gbps": {}})
    partly = judge(model, ram=64 << 30, vram=0, cpu_profile=cached)
    assert partly.speeds.startswith("partly calibrated") and not partly.calibrated
    assert partly.predicted_tok_s < default.predicted_tok_s / 3  # the slow machine's fixed costs
    rates = {"cpu_expert_gbps": {shape.key: 2.0}, "cpu_trunk_gbps": {trunk.key: 2.0}}
    cal._write(hc.host_key(), {"profile": fixed, **rates})
    got = judge(model, ram=64 << 30, vram=0, cpu_profile=cached)
    assert got.speeds == "measured speeds" and got.calibrated and got.predicted_tok_s < partly.predicted_tok_s
    gpu = judge(model, ram=64 << 30, vram=8 << 30, cpu_profile=cached)  # a GPU verdict
    assert "default speeds" in gpu.speeds and not gpu.calibrated
    engine_env({"SHARPI_CALIBRATION_DIR": str(tmp_path), "SHARPI_NO_CALIBRATE": "1"})
    assert cached(model) is None


def test_default_folders_are_the_usual_download_places(tmp_path):
    (tmp_path / ".cache" / "huggingface" / "hub").mkdir(parents=True)
    (tmp_path / "models").mkdir()
    assert default_folders({}, tmp_path) == [tmp_path / ".cache/huggingface/hub", tmp_path / "models"]
    (tmp_path / "hf").mkdir()
    assert default_folders({"HF_HOME": str(tmp_path / "hf")}, tmp_path)[0] == tmp_path / "models"


def test_library_dialog_judges_and_opens(qtbot, tmp_path, monkeypatch, shelf, synth_model):
    pytest.importorskip("pytestqt")
    from sharpi_gui.testing import GEN_TIMEOUT_MS, make_window
    from sharpi_gui.views.library import LibraryDialog

    w = make_window(qtbot, tmp_path)
    monkeypatch.setattr(w.bridge, "library_folders", lambda: [])
    w.settings.library_folders = [str(shelf)]
    dlg = LibraryDialog(w.bridge, w.settings, w)
    qtbot.addWidget(dlg)
    with qtbot.waitSignal(w.bridge.libraryDone, timeout=GEN_TIMEOUT_MS):
        dlg.rescan()
    rows = {dlg.table.item(r, 0).toolTip(): r for r in range(dlg.table.rowCount())}
    assert len(rows) == 4 and "4 GGUF files, 2 can run here" in dlg.status.text()
    geo = rows[str(shelf / "qwen3-30b-geometry.gguf")]
    assert dlg.table.item(geo, 5).text() == f"cannot run: {NO_WEIGHTS}"
    dlg.table.selectRow(geo)
    assert not dlg.open_button.isEnabled()  # a refused file cannot be opened from here
    dlg.table.selectRow(rows[str(shelf / "model.gguf")])
    assert dlg.open_button.isEnabled() and "tok/s" in dlg.table.item(rows[str(shelf / "model.gguf")], 6).text()
    dlg.openRequested.connect(w.open_model)
    with qtbot.waitSignal(w.bridge.loaded, timeout=GEN_TIMEOUT_MS) as loaded:
        dlg.open_button.click()
    assert loaded.args[0].path == str(shelf / "model.gguf")


def test_library_lists_the_bundled_demo_models(qtbot, tmp_path):
    """The library's folders end with the bundled models' folder, so every demo model shipped beside the default
    one (the Gated-DeltaNet demo with its MTP head too) is listed and can be opened."""
    pytest.importorskip("pytestqt")
    from sharpi_gui.testing import make_window

    w = make_window(qtbot, tmp_path)
    demo = w.bridge.demo_model_path()
    assert demo is not None
    folders = w.bridge.library_folders()
    assert folders[-1] == str(Path(demo).parent) and folders.count(folders[-1]) == 1
    found = {p.name for p in find_files([Path(folders[-1])])}
    assert {"sharpi-demo-q8_0.gguf", "sharpi-demo-gdn-q8_0.gguf"} <= found
