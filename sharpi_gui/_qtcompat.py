"""Work around PySide6 6.12.0's reference-count leak on CPython < 3.12.

PySide6 6.12.0 drops one reference to ``True`` on every Python-side ``Signal.emit()`` and one to
``None`` on every C++ signal delivered to a Python slot. On CPython 3.12+ these singletons are
immortal and nothing happens; on 3.10/3.11 their counts reach zero after a few hundred emits
(``True`` starts near 600) and the interpreter aborts with "Fatal Python error: bool_dealloc" /
"none_dealloc". 6.11.x is not affected (measured: ``tests/test_gui_app.py::test_qt_singleton_refcounts``).

The fix here gives the three singletons the effectively infinite count they have on 3.12, which
is what the leaking code already assumes; nothing else changes. Prefer ``PySide6-Essentials
!= 6.12.0`` in the dependencies; this guard keeps an environment that has 6.12.0 alive.
"""

from __future__ import annotations

import ctypes
import sys

import PySide6

_BOOST = 1 << 40  # ~10^12 leaked references before trouble: never, in practice


def _affected() -> bool:
    return PySide6.__version__ == "6.12.0" and sys.implementation.name == "cpython" and sys.version_info < (3, 12)


def protect_singletons() -> bool:
    """Raise the reference counts of True, False and None out of the leak's reach; True if applied."""
    if not _affected():
        return False
    for obj in (True, False, None):
        refcnt = ctypes.c_ssize_t.from_address(id(obj))  # ob_refcnt: PyObject's first field
        if refcnt.value < _BOOST:
            refcnt.value += _BOOST
    return True
