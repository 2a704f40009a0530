"""Screenshots of the app chatting through a remote OpenAI-compatible endpoint: llama-cpp-python's
``llama_cpp.server`` on the demo model, started here in a child process (any vLLM, SGLang or
llama-server deployment looks the same to the app).

    QT_QPA_PLATFORM=offscreen python packaging/remote_screenshot.py   # or under xvfb-run

Writes docs/screenshots/remote-connect.png (File → Connect to server…, its models listed) and
remote-window.png (the whole window after a reply streamed from the endpoint).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
QUESTION = "What is a decorator?"


def _start_llama_server(model: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port), "--n_ctx", "512"]
    cmd += ["--model_alias", model.stem]  # its model id (else the file's path)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise SystemExit("llama_cpp.server did not start")
        time.sleep(0.1)


def main() -> int:
    sys.path.insert(0, str(ROOT))  # this checkout's engine and app, whatever is installed
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from engine.demo import demo_model_path
    from sharpi_gui.app import create_window
    from sharpi_gui.keys import KeyStore
    from sharpi_gui.testing import memory_keyring
    from sharpi_gui.views.remote import ConnectDialog

    proc, url = _start_llama_server(demo_model_path())
    try:
        app = QApplication.instance() or QApplication(sys.argv[:1])
        tmp = Path(tempfile.mkdtemp())
        keys = KeyStore(memory_keyring())  # never the user's keyring
        window = create_window(str(tmp / "data"), QSettings(str(tmp / "s.ini"), QSettings.Format.IniFormat), keys=keys)
        window.resize(1500, 900)
        window.show()
        bridge = window.bridge
        dialog = ConnectDialog(bridge, url, window, keys)
        dialog.key_edit.setText("secret-key")  # llama_cpp.server without --api_key ignores it
        OUT.mkdir(parents=True, exist_ok=True)

        def on_models(*_a) -> None:
            QTimer.singleShot(100, shoot_dialog)

        def shoot_dialog() -> None:
            dialog.grab().save(str(OUT / "remote-connect.png"))
            print(OUT / "remote-connect.png")
            dialog.accept()
            window.connect_remote(dialog.url(), dialog.api_key(), dialog.model())

        def on_connected(_info) -> None:
            window.settings.sampling = {"temperature": 0.0, "max_tokens": 96}
            window.ctx.chat.send(QUESTION)

        def shoot_window(*_a) -> None:
            window.grab().save(str(OUT / "remote-window.png"))
            print(OUT / "remote-window.png")
            app.exit(0)

        bridge.remoteModels.connect(on_models)
        bridge.remoteConnected.connect(on_connected)
        bridge.finished.connect(lambda *_a: QTimer.singleShot(300, shoot_window))
        dialog.show()
        QTimer.singleShot(200, dialog.list_models)
        QTimer.singleShot(120_000, lambda: app.exit(1))
        rc = app.exec()
        window.ctx.close()
        return rc
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
