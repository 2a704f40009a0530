"""Ctrl+C in `sharpi run --chat` stops the reply in progress (within a token) and the chat goes on; no
traceback (a KeyboardInterrupt raised inside a numba kernel used to surface as a SystemError)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _read_until(proc, buf: bytearray, pred, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while not pred(bytes(buf)):
        left = end - time.monotonic()
        assert left > 0, f"timed out; output so far: {bytes(buf)[-400:]!r}"
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"the program ended early: {bytes(buf)[-400:]!r}"
            buf += chunk


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(synth_model):
    path = synth_model("qwen3moe", "Q8_0", vocab=1024).path
    cmd = [sys.executable, "-m", "engine.cli.main", "run", "-m", str(path), "--chat", "-n", "100000"]
    with subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        out = bytearray()
        try:
            for question in (b"go on for a long time\n", b"and again\n"):
                _read_until(proc, out, lambda b: b.rstrip().endswith(b">"))
                mark = len(out)
                proc.stdin.write(question)
                proc.stdin.flush()
                _read_until(proc, out, lambda b, m=mark: len(b) > m + 20)  # tokens are streaming
                proc.send_signal(signal.SIGINT)
            _read_until(proc, out, lambda b: b.count(b">") >= 3)  # back at the prompt after the second stop
            proc.stdin.close()
            rc = proc.wait(timeout=120)
            err = proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, err
    assert "Traceback" not in err and "SystemError" not in err
    assert err.count("[cancelled") == 2
