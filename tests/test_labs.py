"""Labs stay out of the product (labs/README.md): nothing in the engine, the app or the tests imports them,
and they import only public engine names, so an engine refactor never has to edit an experiment."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"


def _import_nodes(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _modules(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module] if node.level == 0 and node.module else []


def test_nothing_imports_labs():
    files = [f for d in ("engine", "sharpi_gui", "tests") for f in sorted((ROOT / d).rglob("*.py"))]
    bad = {
        str(f.relative_to(ROOT)): m
        for f in files
        for node in _import_nodes(f)
        for m in _modules(node)
        if m.split(".")[0] == "labs"
    }
    assert bad == {}


def test_labs_import_only_public_engine_names():
    files = sorted(LABS.glob("*.py"))
    assert files, "labs/ holds no Python labs"
    bad = []
    for f in files:
        for node in _import_nodes(f):
            mods = _modules(node)
            for m in mods:
                if m.split(".")[0] == "engine" and any(part.startswith("_") for part in m.split(".")):
                    bad.append(f"{f.name}: module {m}")
            if isinstance(node, ast.ImportFrom) and mods and mods[0].split(".")[0] == "engine":
                bad += [f"{f.name}: {mods[0]}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []
