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
BRIDGE = "sharpi_gui/bridge"  # the package: EngineBridge (__init__), its worker (worker), the conversions to plain data (convert)
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


def _in_bridge(f: Path) -> bool:
    return str(f.relative_to(ROOT)).startswith(BRIDGE + "/")


def test_only_the_bridge_imports_the_engine():
    files = [f for f in sorted((ROOT / "sharpi_gui").rglob("*.py")) if not _in_bridge(f)]
    assert _offenders(files, HEAVY) == {}
    assert {"engine.api"} <= set().union(*(_imports(f) for f in (ROOT / BRIDGE).glob("*.py")))  # the bridge does


def test_views_and_state_do_not_import_the_bridge():
    files = [f for f in sorted((ROOT / "sharpi_gui").rglob("*.py")) if str(f.relative_to(ROOT)) not in COMPOSERS
             and not _in_bridge(f)]  # fmt: skip
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


# -- inside the engine: layers and cycles ----------------------------------------------------------
# Each engine package (or top-level module) may import only packages of a lower rank: the
# dependency order gguf/quant ← kernels ← models ← runtime ← api ← bench/server ← cli, with the pure planner
# (plan) beside the runtime, importing only what models a model (PLAN_MAY_IMPORT). Every import
# counts, also one inside a function (a lazy import is still a dependency).
RANK = {
    "errors": 0,
    "config": 1,
    "quant": 2,
    "demo": 2,
    "gguf": 3,
    "generate": 3,
    "kernels": 4,
    "kv_layout": 4,
    "profiler": 4,
    "routes": 4,
    "synth": 4,
    "tokenizer": 4,
    "ops": 5,
    "kv_cache": 5,
    "experts": 6,
    "models": 7,
    "modelinfo": 8,
    "plan": 8,
    "runtime": 9,
    "preflight": 9,
    "api": 10,
    "remote": 10,
    "warmup": 10,
    "library": 10,
    "bench": 11,
    "server": 11,
    "cli": 12,
}
PLAN_MAY_IMPORT = {"models", "quant", "gguf", "kv_layout", "config", "errors"}


def _engine_modules() -> dict[str, Path]:
    mods = {}
    for f in sorted((ROOT / "engine").rglob("*.py")):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _engine_edges() -> dict[str, set[str]]:
    """module -> the engine modules it imports (``from a import b`` names module a.b where it is one)."""
    mods = _engine_modules()

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods), None)

    edges = {}
    for name, f in mods.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                out.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.update(resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names)
        edges[name] = {m for m in out if m and m != name}
    return edges


def _package(module: str) -> str:
    return module.split(".")[1] if module != "engine" else "engine"


def test_every_engine_package_has_a_rank():
    packages = {_package(m) for m in _engine_modules()} - {"engine"}
    assert packages == set(RANK), packages ^ set(RANK)


def test_engine_imports_go_down_the_layers():
    bad = []
    for a, bs in _engine_edges().items():
        pa = _package(a)
        for b in bs:
            pb = _package(b)
            if pa == pb or pb == "engine":
                continue
            if RANK[pb] >= RANK[pa] or (pa == "plan" and pb not in PLAN_MAY_IMPORT):
                bad.append(f"{a} -> {b}")
    assert bad == []


def test_no_import_cycles_inside_the_engine():
    """Tarjan's strongly connected components over the module graph: every one a single module."""
    edges = _engine_edges()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert cycles == []
