"""The Triton kernel tests' collection rules and launch-table fixture (see ``__init__.py``).

The whole directory is skipped at collection unless Triton imports and either TRITON_INTERPRET=1 is set
(the interpreter, on the CPU) or torch sees a CUDA device; every module here is marked ``slow``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.triton import BIG, DEVICE, INTERPRET

HOW = "TRITON_INTERPRET=1 python -m pytest tests/triton"


def _why_not() -> str | None:
    """Why these tests cannot run in this process, or None."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton kernels: Triton is not importable ({e}); with it installed, run them with `{HOW}`"
    if not INTERPRET and not torch.cuda.is_available():
        return f"Triton kernels: no CUDA and TRITON_INTERPRET unset; run them in the interpreter: `{HOW}`"
    return None


WHY_NOT = _why_not()


class _Unrunnable(pytest.Module):
    """A test module of this directory that is not imported (it imports Triton): skipped, saying why."""

    def collect(self):
        pytest.skip(WHY_NOT)


def pytest_pycollect_makemodule(module_path, parent):
    """Every module here is ``slow``; where the kernels cannot run, skipped at collection (not imported)."""
    module = (_Unrunnable if WHY_NOT else pytest.Module).from_parent(parent, path=module_path)
    module.add_marker(pytest.mark.slow)
    if INTERPRET:
        # The interpreter runs every lane in numpy, including rows the kernels compute and then drop on
        # purpose (a skipped pair's h rows are left unwritten, torch.empty, and the down kernel skips
        # them): quantizing that garbage can hit NaN, which numpy reports and pytest would make an error.
        module.add_marker(pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"))
    return module


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernels run: "cpu" under Triton's interpreter, "cuda" compiled."""
    return DEVICE


@pytest.fixture(scope="session")
def big() -> bool:
    """Trunk-sized shapes (compiled on CUDA) rather than the interpreter's small, awkward ones."""
    return BIG


class LaunchLog:
    """The launches of one test that ran with a launch table of its own (the ``launch_table`` fixture)."""

    def __init__(self, table: dict):
        assert all(key.endswith(":*:*") for key in table), "whole-kernel entries ('<kernel>:*:*') only"
        self.table = {key.split(":")[0]: dict(settings) for key, settings in table.items()}
        self.launches: list[tuple[str, dict]] = []  # (kernel, settings) of each kernel_select.launch

    def kernels(self) -> set[str]:
        """The table's kernels this test launched — each time with exactly the table's settings (asserted)."""
        wrong = [(k, s) for k, s in self.launches if k in self.table and s != self.table[k]]
        assert not wrong, f"launches that did not take the test's launch table: {wrong}"
        return {k for k, _ in self.launches if k in self.table}


@pytest.fixture
def launch_table(monkeypatch) -> Iterator[Callable[[dict], LaunchLog]]:
    """Factory ``launch_table(table) -> LaunchLog``: for this test, launches take ``table``'s settings
    ({"<kernel>:*:*": settings}) before the packaged tables' — ``EngineOptions.launch_table``, what
    SHARPI_LAUNCH_TABLE sets, through ``engine.config.overriding`` — and every ``kernel_select.launch``
    is recorded, so the test can check its kernels got them (:meth:`LaunchLog.kernels`)."""
    from engine import config
    from engine.runtime import kernel_select as ks

    logs: list[LaunchLog] = []
    real = ks.launch

    def spy(kernel, *args, **kwargs):
        settings = real(kernel, *args, **kwargs)
        for log in logs:
            log.launches.append((kernel, dict(settings)))
        return settings

    monkeypatch.setattr(ks, "launch", spy)
    with contextlib.ExitStack() as stack:

        def use(table: dict) -> LaunchLog:
            stack.enter_context(config.overriding(launch_table=table))
            logs.append(LaunchLog(table))
            return logs[-1]

        yield use
