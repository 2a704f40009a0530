"""A child interpreter started with tests.triton_data's die_with_parent dies with the pytest process that
started it, so a pytest stopped by `timeout` leaves nothing running (on the GPU machine one such orphan — a
test script then run in a child interpreter — once slowed the next benchmark)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARENT = r"""
import subprocess, sys, time
from tests.triton_data import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a killed child not yet reaped by init is a zombie: dead


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_test_script_dies_with_its_pytest():
    with subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True) as parent:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        parent.kill()
    deadline = time.time() + 60  # a bound for the wait; the kernel kills it at once
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        subprocess.run(["kill", "-9", str(pid)], check=False)
        pytest.fail("the child interpreter outlived its parent")
