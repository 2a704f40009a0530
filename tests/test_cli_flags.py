"""The CLI follows llama.cpp's spellings where it has them: --version, -f, -ctk/-ctv (f16 too), -t, -m for inspect."""

from __future__ import annotations

import pytest

import engine
from engine.cli.main import main


@pytest.fixture(scope="module")
def model(synth_model):
    return str(synth_model("qwen3moe", "Q8_0", vocab=1024).path)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"sharpi {engine.__version__}"


def test_inspect_takes_m_like_the_other_commands(model, capsys):
    assert main(["inspect", "-m", model]) == 0
    by_m = capsys.readouterr().out
    assert main(["inspect", model]) == 0
    assert capsys.readouterr().out == by_m and "qwen3moe" in by_m
    assert main(["inspect", model, "-m", model]) == 2  # once, not twice


def test_prompt_from_a_file_and_llama_cpp_cache_types(model, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time", encoding="utf-8")
    assert main(["run", "-m", model, "-f", str(prompt), "-n", "2", "-ctk", "q8_0", "-ctv", "q8_0", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "KV q8_0" in err and "] prompt " in err
    assert main(["run", "-m", model, "-p", "x", "-n", "1", "-ctk", "q8_0", "-ctv", "f32"]) == 2
    assert "share one cache type" in capsys.readouterr().err
    assert main(["run", "-m", model, "-f", str(tmp_path / "missing.txt"), "-n", "1"]) == 2


def test_threads_and_f16_cache_types(model, capsys):
    import numba
    import torch

    before = numba.get_num_threads(), torch.get_num_threads()
    try:
        assert (
            main(["run", "-m", model, "-p", "x", "-n", "1", "-t", "1", "-ctk", "f16", "-ctv", "f16", "--temp", "0"])
            == 0
        )
        assert numba.get_num_threads() == 1 and torch.get_num_threads() == 1  # run generates on this thread
    finally:
        numba.set_num_threads(before[0])
        torch.set_num_threads(before[1])
    err = capsys.readouterr().err
    assert "KV cache type f16 is kept as bf16" in err and "KV bf16" in err
    assert main(["run", "-m", model, "-p", "x", "-n", "1", "-ctk", "f16", "-ctv", "bf16"]) == 0  # the same type
    capsys.readouterr()
    assert main(["run", "-m", model, "-p", "x", "-n", "1", "-t", "0"]) == 2
    assert "-t/--threads 0" in capsys.readouterr().err
    for cmd in (["logits", "--tokens", "1", "--out", "x.npy"], ["bench", "kernels"]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "-t", "1", "--help"])
        assert e.value.code == 0 and "-t THREADS, --threads THREADS" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["run", "bench", "serve"])
def test_cache_policy_flag_on_run_bench_and_serve(cmd):
    from engine.cli.main import build_parser

    extra = ["-p", "x"] if cmd == "run" else []
    a = build_parser().parse_args([cmd, *extra, "--cache-policy", "lru"])
    assert a.cache_policy == "lru"
    assert build_parser().parse_args([cmd, *extra]).cache_policy is None  # unset: SHARPI_CACHE_POLICY or the default


def test_cache_policy_reaches_the_cache(model, capsys):
    argv = ["run", "-m", model, "-p", "x", "-n", "2", "--temp", "0", "--device", "cpu", "--vram", "1GiB"]
    assert main([*argv, "--moe", "cache", "--cache-policy", "lru"]) == 0
    assert "cache policy lru" in capsys.readouterr().err
    assert main([*argv, "--moe", "cache"]) == 0
    assert "cache policy dlfu" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*argv, "--cache-policy", "belady"])  # offline only: no runtime policy
    assert e.value.code == 2


def test_one_spelling_for_the_model_and_the_context_in_every_command():
    """-m/--model wherever a command reads a model; -c/--ctx-size wherever it takes a context size (llama.cpp's)."""
    import argparse

    from engine.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("inspect", "run", "serve", "logits", "tokenize", "plan", "bench"):
        opts = {o for a in sub.choices[name]._actions for o in a.option_strings}
        assert {"-m", "--model"} <= opts, name
    for name in ("run", "serve", "logits", "plan"):
        p = sub.choices[name]
        opts = {o for a in p._actions for o in a.option_strings}
        assert {"-c", "--ctx-size"} <= opts, name
        need = ["-p", "x"] if name == "run" else ["--tokens", "1", "--out", "x.npy"] if name == "logits" else []
        by_c = p.parse_args(["-m", "x.gguf", *need, "-c", "512"])
        by_long = p.parse_args(["-m", "x.gguf", *need, "--ctx-size", "512"])
        assert vars(by_c) == vars(by_long) and 512 in vars(by_c).values(), name


def test_serve_takes_threads_for_every_generation(model, monkeypatch, capsys):
    """``sharpi serve -t N``: the session's generations run on N threads (EngineOptions.host_threads, set in the
    thread that serves each request); -t 0 is refused before anything loads."""
    import threading
    import time

    import engine.server
    from engine.generate import SamplingParams

    seen = []

    def fake_serve(host, bind, port, options, on_listening=None):
        deadline = time.monotonic() + 120
        while host.session is None and not host.error and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.session is not None, host.error

        def request():  # a request's thread: numba's count is per thread
            events = host.session.generate(prompt="x", params=SamplingParams(temperature=0, max_tokens=1))
            for _ in events:
                seen.append(numba.get_num_threads())

        t = threading.Thread(target=request)
        t.start()
        t.join()

    import numba
    import torch

    monkeypatch.setattr(engine.server, "serve", fake_serve)
    before = numba.get_num_threads(), torch.get_num_threads()
    try:
        assert main(["serve", "-m", model, "--port", "0", "-t", "1"]) == 0
    finally:
        numba.set_num_threads(before[0])
        torch.set_num_threads(before[1])
    assert seen and set(seen) == {1}
    capsys.readouterr()
    assert main(["serve", "-m", model, "--port", "0", "-t", "0"]) == 2
    assert "-t/--threads 0" in capsys.readouterr().err
