"""``sharpi-gui --ask TEXT``: the app answers one question and exits (the packaged app's smoke test).

The window opens as usual (the model given, else the last one, else the demo); once the model is
loaded, TEXT is sent in a new conversation, the answer is printed on stdout and the app quits with
0. Anything else — the model does not load, the reply fails, is empty or is cut by Stop, the time
runs out — is said on stderr and quits with 1 (2 for the time limit).
"""

from __future__ import annotations

import sys
from typing import TextIO

from PySide6.QtCore import QObject, QTimer, Signal

from sharpi_gui import data as D

ANSWERED = ("eos", "stop", "length")  # the finish reasons of an answer (engine.generate.events FINISH_*)
EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 2
SETTLE_MS = 300  # --screenshot: time for the last bubble to take its final height


class ScriptedQuestion(QObject):
    """Sends ``text`` in ``window`` once a model is loaded; :attr:`done` carries the exit status."""

    done = Signal(int)

    def __init__(
        self,
        window,
        text: str,
        timeout_s: float = 600.0,
        out: TextIO | None = None,
        err: TextIO | None = None,
        screenshot: str | None = None,
    ):
        super().__init__(window)
        self.window, self.text = window, text
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.screenshot = screenshot  # where to save the window once answered (None: nowhere)
        self.answer: str | None = None
        self.status: int | None = None
        self._sent = False
        window.interactive = False  # a failure must end the run, not wait on a dialog
        chat, bridge = window.ctx.chat, window.ctx.bridge
        bridge.loaded.connect(self._on_loaded)
        bridge.loadFailed.connect(self._on_load_failed)
        chat.streamEnded.connect(self._on_ended)
        chat.notice.connect(self._on_notice)
        self._timer = QTimer(self, singleShot=True, interval=int(timeout_s * 1000))
        self._timer.timeout.connect(lambda: self._finish(EXIT_TIMEOUT, f"no answer within {timeout_s:g} s"))
        self._timer.start()

    def _on_loaded(self, card, _limits) -> None:
        if self._sent or self.status is not None:
            return
        self._sent = True
        print(f"sharpi-gui: {card.name} loaded; asking: {self.text}", file=self.err, flush=True)
        chat = self.window.ctx.chat
        chat.new_conversation()
        if not chat.send(self.text):
            self._finish(EXIT_FAILED, "the question could not be sent")

    def _on_load_failed(self, failure: D.Failure) -> None:
        self._finish(EXIT_FAILED, f"the model did not load: {failure.title}: {failure.message}")

    def _on_notice(self, failure: D.Failure) -> None:
        if self._sent:
            self._finish(EXIT_FAILED, f"{failure.title}: {failure.message}")

    def _on_ended(self, msg: D.Message | None) -> None:
        if not self._sent or self.status is not None:
            return
        reason = msg.meta.get("finish_reason") if msg is not None else None
        if msg is None or not msg.content.strip():
            return self._finish(EXIT_FAILED, "the model produced no answer")
        if reason not in ANSWERED:
            return self._finish(EXIT_FAILED, f"the answer did not finish (finish reason {reason!r})")
        self.answer = msg.content
        print(msg.content, file=self.out, flush=True)
        if self.screenshot:  # after the transcript has laid out the finished reply
            QTimer.singleShot(SETTLE_MS, self._shoot)
        else:
            self._finish(EXIT_OK, "")

    def _shoot(self) -> None:
        if self.window.grab().save(self.screenshot):
            self._finish(EXIT_OK, "")
        else:
            self._finish(EXIT_FAILED, f"the screenshot could not be written to {self.screenshot}")

    def _finish(self, status: int, why: str) -> None:
        if self.status is not None:
            return
        self.status = status
        self._timer.stop()
        if why:
            print(f"sharpi-gui --ask: {why}", file=self.err, flush=True)
        self.done.emit(status)
