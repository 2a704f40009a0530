"""A screenshot of the "Local server" dock serving the demo model after a few API requests.

    QT_QPA_PLATFORM=offscreen python packaging/server_screenshot.py   # or under xvfb-run

Writes docs/screenshots/server-dock.png (the dock) and server-window.png (the whole window). The
requests go through the official ``openai`` client when it is installed, else plain httpx.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
QUESTIONS = ("What is a decorator?", "Explain the for statement.", "What is None?")


def main() -> int:
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from engine.demo import demo_model_path
    from sharpi_gui.app import create_window
    from sharpi_gui.keys import KeyStore
    from sharpi_gui.testing import memory_keyring

    app = QApplication.instance() or QApplication(sys.argv[:1])
    tmp = Path(tempfile.mkdtemp())
    keys = KeyStore(memory_keyring())  # never the user's keyring
    window = create_window(str(tmp / "data"), QSettings(str(tmp / "s.ini"), QSettings.Format.IniFormat), keys=keys)
    window.resize(1500, 900)
    window.show()
    window.server_dock.show()
    bridge, server = window.bridge, window.ctx.server
    done = {"n": 0}

    def requests(url: str, model: str) -> None:
        import httpx

        for q in QUESTIONS:
            body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 48, "temperature": 0}
            httpx.post(f"{url}/chat/completions", json=body, timeout=120)
        httpx.post(f"{url}/chat/completions", json={"model": "gpt-4o", "messages": []}, timeout=30)  # a 400

    def on_loaded(*_a) -> None:
        status = server.start("127.0.0.1", 8080)
        if not status.running:
            status = server.start("127.0.0.1", 0)
        threading.Thread(target=requests, args=(status.url, status.model_id), daemon=True).start()

    def on_request(_rec) -> None:
        done["n"] += 1
        if done["n"] == len(QUESTIONS) + 1:
            QTimer.singleShot(200, shoot)

    def shoot() -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        window.server_dock.grab().save(str(OUT / "server-dock.png"))
        window.grab().save(str(OUT / "server-window.png"))
        print(OUT / "server-dock.png")
        app.exit(0)

    bridge.loaded.connect(on_loaded)
    server.requestLogged.connect(on_request)
    QTimer.singleShot(200, lambda: window.open_model(str(demo_model_path())))
    QTimer.singleShot(300_000, lambda: app.exit(1))
    rc = app.exec()
    window.ctx.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
