"""``sharpi-gui --ask``: the scripted question the packaged app's smoke test relies on answers, prints
the answer and says 0, and says 1 when the model cannot load (pytest-qt, offscreen)."""

from __future__ import annotations

import io
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("pytestqt")

from sharpi_gui.app import _parser  # noqa: E402
from sharpi_gui.scripted import EXIT_FAILED, EXIT_OK, ScriptedQuestion  # noqa: E402
from sharpi_gui.testing import GEN_TIMEOUT_MS, LOAD_TIMEOUT_MS, make_window  # noqa: E402


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("qwen3moe", "Q8_0", vocab=1024).path


def test_ask_flag_parses():
    args = _parser().parse_args(["--ask", "What is 2+2?", "--timeout", "30", "--screenshot", "a.png"])
    assert args.ask == "What is 2+2?" and args.timeout == 30.0 and args.screenshot == "a.png"


def test_scripted_question_prints_the_answer(qtbot, tmp_path, model_path):
    w = make_window(qtbot, tmp_path, simulate_device=False)
    w.settings.sampling = {"temperature": 0.0, "max_tokens": 6}
    out, err = io.StringIO(), io.StringIO()
    shot = tmp_path / "answered.png"
    limit_s = (LOAD_TIMEOUT_MS + GEN_TIMEOUT_MS) / 1000
    q = ScriptedQuestion(w, "What is a generator?", timeout_s=limit_s, out=out, err=err, screenshot=str(shot))
    with qtbot.waitSignal(q.done, timeout=LOAD_TIMEOUT_MS + GEN_TIMEOUT_MS + 10_000) as done:
        w.open_model(str(model_path))
    assert done.args == [EXIT_OK], err.getvalue()
    saved = w.ctx.chat.messages
    assert [m.role for m in saved] == ["user", "assistant"] and saved[0].content == "What is a generator?"
    assert out.getvalue() == saved[1].content + "\n" and saved[1].content.strip()
    assert shot.stat().st_size > 1000  # the window, once answered


def test_scripted_question_fails_when_the_model_cannot_load(qtbot, tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"this is not a GGUF file" * 10)
    w = make_window(qtbot, tmp_path, simulate_device=False)
    out, err = io.StringIO(), io.StringIO()
    q = ScriptedQuestion(w, "Hello?", timeout_s=60, out=out, err=err)
    with qtbot.waitSignal(q.done, timeout=LOAD_TIMEOUT_MS) as done:
        w.open_model(str(bad))
    assert done.args == [EXIT_FAILED] and out.getvalue() == ""
    assert "did not load" in err.getvalue()
