"""A file that cannot run here is refused before loading, with the reason: a geometry-only file
(no weights: its data region is a hole on disk) or one larger than RAM + GPU memory."""

from __future__ import annotations

from engine.preflight import is_weightless, refusal


def test_geometry_file_has_no_weights(synth_geometry, synth_model):
    g = synth_geometry("qwen3-30b-a3b")
    reason = refusal(g.path)
    assert "no weights" in reason and "geometry-only" in reason
    assert is_weightless(g.path, g.tensor_bytes)
    real = synth_model("qwen3moe", "Q8_0", vocab=1024).path
    assert refusal(real) == ""


def test_too_large_for_ram_and_gpu(synth_model):
    real = synth_model("qwen3moe", "Q8_0", vocab=1024).path
    reason = refusal(real, ram=1 << 20, vram=0)
    assert "needs" in reason and "RAM" in reason and "no GPU" in reason
    assert refusal(real, ram=1 << 20, vram=1 << 40) == ""  # RAM and GPU memory together suffice


def test_sharpi_run_refuses_a_geometry_file_and_inspect_says_why(synth_geometry, capsys):
    from engine.cli.main import main

    path = str(synth_geometry("qwen3-30b-a3b").path)
    assert main(["run", "-m", path, "-p", "hi", "-n", "1"]) != 0
    assert "no weights" in capsys.readouterr().err
    assert main(["inspect", path]) == 0
    assert "geometry-only" in capsys.readouterr().out
