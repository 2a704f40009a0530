"""Screenshots of the desktop app for the README, taken on a real X server (Xvfb, Qt's xcb platform).

    python packaging/screenshots.py                  # re-runs itself under xvfb-run
    python packaging/screenshots.py --model M.gguf   # another model (default: the demo model)
    python packaging/screenshots.py --dark           # the dark theme

Drives the app as a user would: opens the model, places it with a small expert cache on the
(simulated) device, asks a question, and while the answer streams saves

    docs/screenshots/main-window.png      the whole window, mid-generation
    docs/screenshots/placement-dock.png   the placement dock, with a slider moved to a preview
    docs/screenshots/experts-dock.png     the experts dock: live heatmap and plots

Without the demo model it writes a synthetic one (random weights: the text is noise, the
placement and expert views are real). On a machine without a GPU the app itself offers no device
(its dock says so); these screenshots ask for the engine's simulated device to show the device
placement views, as a machine with a GPU shows them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
SIZE = (1600, 1000)
QUESTIONS = (
    "What does the with statement do?",
    "Tell me about list comprehensions.",
    "What is a generator?",
    "Explain the for statement.",
    "What are decorators?",
)


def _under_xvfb(argv: list[str]) -> int:
    """Run this script again inside a fresh Xvfb server (1920x1200, 24-bit)."""
    if shutil.which("xvfb-run") is None:
        sys.exit("xvfb-run not found: apt-get install xvfb xauth (see .ci/run)")
    env = dict(os.environ, QT_QPA_PLATFORM="xcb", SHARPI_SCREENSHOTS_CHILD="1")
    cmd = ["xvfb-run", "-a", "-s", "-screen 0 1920x1200x24", sys.executable, __file__, *argv]
    return subprocess.call(cmd, env=env)


def _model(path: str | None, tmp: Path) -> str:
    if path:
        return path
    from engine.demo import demo_model_path

    try:
        return str(demo_model_path())
    except FileNotFoundError:
        from engine.synth import write_model

        print("demo model not found: using a synthetic qwen3moe (random weights)", file=sys.stderr)
        m = write_model(
            tmp / "synthetic-qwen3moe.gguf", "qwen3moe", weight_type="Q8_0", layers=8, experts=32,
            experts_used=4, hidden=512, vocab=4096, name="synthetic qwen3moe 8x32",
        )  # fmt: skip
        return str(m.path)


def run(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from sharpi_gui.app import create_window
    from sharpi_gui.data import PlanSettings
    from sharpi_gui.keys import KeyStore
    from sharpi_gui.testing import isolate_application, memory_keyring, settings_file
    from sharpi_gui.theme import ThemeManager

    app = QApplication([sys.argv[0]])
    isolate_application()  # never the user's settings or conversations
    themes = ThemeManager(app, dark=args.dark)
    tmp = Path(tempfile.mkdtemp(prefix="sharpi-shots-"))
    window = create_window(
        str(tmp / "data"), settings_file(tmp), themes, simulate_device=True, keys=KeyStore(memory_keyring())
    )
    window.resize(*SIZE)
    window.show()
    s = window.settings
    s.sampling = {"temperature": 0.7, "seed": 11, "max_tokens": args.tokens}
    model_file = _model(args.model, tmp)
    OUT.mkdir(parents=True, exist_ok=True)
    state = {"question": 0, "shot": False, "rc": 1}
    bridge, chat, placement = window.bridge, window.ctx.chat, window.ctx.placement

    def fail(msg: str) -> None:
        print("screenshots:", msg, file=sys.stderr)
        app.exit(1)

    def on_loaded(_card, limits) -> None:
        if bridge.limits is None or placement.settings is None:
            return
        # A budget that holds the trunk, the KV cache and about 40 % of the experts: the cache mode.
        ctx = limits.current.ctx
        cpu = bridge.preview(PlanSettings(vram_bytes=limits.vram_max_bytes, ctx=ctx, moe="cpu"))
        full = bridge.preview(PlanSettings(vram_bytes=limits.vram_max_bytes, ctx=ctx, moe="resident"))
        if not (cpu.ok and full.ok):
            return fail(f"cannot plan: {cpu.error or full.error}")
        expert_bytes = dict(full.segments)["experts"]
        budget = cpu.allocated_bytes + int(0.4 * expert_bytes)
        bridge.apply(PlanSettings(vram_bytes=budget, ctx=ctx, moe="cache"))

    def on_applied(*_a) -> None:
        if state["question"] == 0:
            ask()

    def ask() -> None:
        chat.send(QUESTIONS[state["question"]])
        state["question"] += 1

    def on_finished(*_a) -> None:
        if state["shot"]:
            app.exit(state["rc"])
        elif state["question"] < len(QUESTIONS):
            QTimer.singleShot(300, ask)
        else:
            fail("the reply ended before the screenshots (raise --tokens)")

    def on_token(_rid, _text, stats) -> None:
        # Mid-generation of the second answer or a later one (the first stays in the transcript).
        if state["question"] >= 2 and stats.n_generated == args.at_token and not state["shot"]:
            QTimer.singleShot(2 * 200 + 50, shoot)  # two live refreshes of the experts dock

    def shoot() -> None:
        state["shot"] = True
        window.grab().save(str(OUT / "main-window.png"))
        window.experts_dock.grab().save(str(OUT / "experts-dock.png"))
        # The placement dock with the VRAM slider dragged to a preview (not applied).
        panel = window.placement_dock.panel
        panel.vram.setValue(int(panel.vram.value() * 1.15))
        QTimer.singleShot(250, shoot_placement)

    def shoot_placement() -> None:
        window.placement_dock.grab().save(str(OUT / "placement-dock.png"))
        state["rc"] = 0
        for name in ("main-window", "placement-dock", "experts-dock"):
            print(OUT / f"{name}.png")
        chat.stop()

    bridge.loaded.connect(on_loaded)
    bridge.loadFailed.connect(lambda f: fail(f.message))
    bridge.applied.connect(on_applied)
    bridge.applyFailed.connect(lambda f: fail(f.message))
    bridge.failed.connect(lambda _rid, f: fail(f.message))
    bridge.finished.connect(on_finished)
    bridge.token.connect(on_token)
    QTimer.singleShot(300, lambda: window.open_model(model_file))
    QTimer.singleShot(args.timeout * 1000, lambda: fail(f"timed out after {args.timeout} s"))
    rc = app.exec()
    window.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF to show (default: the demo model, else a synthetic one)")
    p.add_argument("--dark", action="store_true", help="dark theme")
    p.add_argument("--tokens", type=int, default=90, help="max tokens of each reply")
    p.add_argument("--at-token", type=int, default=12, help="take the screenshots after this many tokens")
    p.add_argument("--timeout", type=int, default=300, help="give up after this many seconds")
    args = p.parse_args(argv)
    if os.environ.get("SHARPI_SCREENSHOTS_CHILD") != "1":
        return _under_xvfb(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
