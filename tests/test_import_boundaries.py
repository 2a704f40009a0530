"""Layer boundaries (style rule 10): the engine never imports Qt or the app; the app's views and
state never import torch, numba or the engine; only sharpi_gui.bridge talks to the engine.

Checked twice: statically over every module's import statements, and at run time in a fresh
interpreter (so an indirect import through a third module is caught too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QT = ("PySide6", "shiboken6", "pyqtgraph", "PyQt5", "PyQt6", "sharpi_gui")
HEAVY = ("torch", "numba", "engine")
BRIDGE = "sharpi_gui/bridge.py"
# Modules of the app that compose the window and may import the bridge.
COMPOSERS = ("sharpi_gui/app.py", BRIDGE)


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (absolute imports; relative ones stay inside)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _offenders(files, banned) -> dict[str, list[str]]:
    bad = {}
    for f in files:
        hits = sorted(m for m in _imports(f) if m.split(".")[0] in banned or m in banned)
        if hits:
            bad[str(f.relative_to(ROOT))] = hits
    return bad


def test_engine_never_imports_qt_or_the_app():
    files = sorted((ROOT / "engine").rglob("*.py"))
    assert len(files) > 20
    assert _offenders(files, QT) == {}


def test_only_the_bridge_imports_the_engine():
    files = [f for f in sorted((ROOT / "sharpi_gui").rglob("*.py")) if str(f.relative_to(ROOT)) != BRIDGE]
    assert _offenders(files, HEAVY) == {}
    assert {"engine.api"} <= _imports(ROOT / BRIDGE)


def test_views_and_state_do_not_import_the_bridge():
    files = [f for f in sorted((ROOT / "sharpi_gui").rglob("*.py")) if str(f.relative_to(ROOT)) not in COMPOSERS]
    bad = {str(f.relative_to(ROOT)) for f in files if "sharpi_gui.bridge" in _imports(f)}
    assert bad == set()


def test_at_run_time_views_pull_in_no_engine_torch_or_numba():
    code = (
        "import sys, pkgutil, importlib, sharpi_gui.views as v\n"
        "for m in ['sharpi_gui.context', 'sharpi_gui.testing'] + "
        "[f'sharpi_gui.views.{i.name}' for i in pkgutil.iter_modules(v.__path__)]:\n"
        "    importlib.import_module(m)\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'numba', 'engine'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_engine_runs_without_qt():
    code = "import sys, engine.api, engine.plan, engine.profiler\nprint(sorted(set(sys.modules) & {'PySide6', 'pyqtgraph', 'sharpi_gui'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
