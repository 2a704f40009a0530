"""A screenshot of branching chats on the demo model: a reply regenerated (← 2/2 → on it), its
question edited and resent (← 1/2 → on the question), a preset saved for the model, the conversation
list searched.

    xvfb-run -a python packaging/branches_screenshot.py   # or QT_QPA_PLATFORM=offscreen

Writes docs/screenshots/branches.png.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"


def main() -> int:
    sys.path.insert(0, str(ROOT))  # this checkout's engine and app, whatever is installed
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from engine.demo import demo_model_path
    from sharpi_gui.app import create_window

    app = QApplication.instance() or QApplication(sys.argv[:1])
    tmp = Path(tempfile.mkdtemp())
    window = create_window(str(tmp / "data"), QSettings(str(tmp / "s.ini"), QSettings.Format.IniFormat))
    window.resize(1500, 900)
    window.show()
    chat, view = window.ctx.chat, window.chat
    steps = []  # what to do after each answer

    def ask(text: str) -> None:
        chat.send(text)

    def regenerate() -> None:
        window.settings.sampling = {"temperature": 0.9, "seed": 7, "max_tokens": 60}
        chat.regenerate()

    def edit() -> None:
        view.edit_message(chat.messages[0].id)
        view.input.setPlainText("What does the yield statement do?")
        view.send()

    def back_and_shoot() -> None:
        view.transcript.bubbles[0].prev_button.click()  # the first question again, its newest reply
        chat.set_system_prompt("You are a concise Python tutor.")
        chat.save_preset("Python tutor")
        view.conversations.search.setText("generator")
        QTimer.singleShot(300, shoot)

    def shoot() -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        window.grab().save(str(OUT / "branches.png"))
        print(OUT / "branches.png")
        app.exit(0)

    def next_step(*_a) -> None:
        if steps:
            QTimer.singleShot(100, steps.pop(0))

    steps += [regenerate, edit, back_and_shoot]
    chat.streamEnded.connect(next_step)

    def on_loaded(*_a) -> None:
        window.settings.sampling = {"temperature": 0.0, "max_tokens": 60}
        chat.new_conversation()
        ask("What is a generator?")

    window.bridge.loaded.connect(on_loaded)
    window.open_model(str(demo_model_path()))
    QTimer.singleShot(600_000, lambda: app.exit(1))
    rc = app.exec()
    window.ctx.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
