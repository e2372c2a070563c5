"""services/ARCHITECTURE.md, "Layers": a package imports only from layers below it, and no
module imports itself back through others (checked on the source, lazy imports included)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "services" / "tandem"

LAYERS = {"common": 0, "protocol": 1, "text": 1, "engine": 2, "transfer": 3, "worker": 4, "prefill": 4,
          "decode": 4, "router": 5, "gateway": 6, "cluster": 7, "bench": 8, "planner": 9, "gpucheck": 8,
          "cli": 10}
# worker/ holds the base both worker actors build on (engine loop, threads, metrics, health).
ALLOWED_SAME_LAYER = {("prefill", "worker"), ("decode", "worker")}
# Rooms inside a package: (importer, imported) pairs that may not meet. The kernels are below
# the model that calls them.
FORBIDDEN_INSIDE = {("engine.kernels", "engine.model")}
# Third-party imports a package may not make at all (besides what the layers forbid).
FORBIDDEN = {"router": {"torch", "cupy"}, "gateway": {"torch", "cupy"},
             "common": {"torch", "ray", "fastapi", "pydantic", "cupy"},
             "protocol": {"torch", "cupy"}, "text": {"torch", "cupy", "ray"}}
STDLIB = set(sys.stdlib_module_names)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of each import the module runs: at its top or inside its functions, not
    under ``if TYPE_CHECKING``. ``import a.b`` gives ("a.b", [])."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, []) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, [a.name for a in child.names]))
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _violations(root: Path) -> list[str]:
    bad = []
    top = root.name
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) < 2 or "gen" in rel.parts:
            continue  # the package's __init__; generated code
        pkg = rel.parts[0]
        assert pkg in LAYERS, f"{top}/{pkg} has no layer; add it to LAYERS and services/ARCHITECTURE.md"
        here = ".".join(rel.with_suffix("").parts)
        for name, _ in _imports(path):
            first = name.split(".")[0]
            if first == top:
                parts = name.split(".")
                if len(parts) < 2:
                    continue
                dep = parts[1]
                inner = ".".join(parts[1:])
                for importer, imported in FORBIDDEN_INSIDE:
                    if here.startswith(importer + ".") and (inner + ".").startswith(imported + "."):
                        bad.append(f"{rel}: imports {name} ({importer} sits below {imported})")
                if dep == pkg:
                    continue
                if (pkg, dep) not in ALLOWED_SAME_LAYER and LAYERS[dep] >= LAYERS[pkg]:
                    bad.append(f"{rel}: imports {top}.{dep} (layer {LAYERS[dep]}) from layer {LAYERS[pkg]}")
            elif first in FORBIDDEN.get(pkg, ()):
                bad.append(f"{rel}: imports {first}")
            elif pkg == "common" and first not in STDLIB and first != "prometheus_client":
                bad.append(f"{rel}: common/ may use the standard library and prometheus_client only")
    return bad


def _graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (``from pkg import mod`` names the module)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py") if "gen" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = graph.setdefault(name, set())
        for module, names in _imports(path):
            if module.split(".")[0] != root.name:
                continue
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            deps.update(subs or ([module] if module in modules else []))
            if len(subs) < len(names) and module in modules:
                deps.add(module)
        deps.discard(name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


def test_every_import_respects_the_layers():
    assert _violations(SOURCE) == []


def test_no_module_imports_itself_back():
    assert _circles(_graph(SOURCE)) == []


def test_check_catches_an_upward_import(tmp_path):
    fake = tmp_path / "tandem"
    for pkg in ("engine", "engine/kernels", "engine/model", "common"):
        (fake / pkg).mkdir(parents=True)
    (fake / "engine" / "x.py").write_text("from tandem.gateway import app\nimport fastapi\n")
    (fake / "engine" / "kernels" / "k.py").write_text("def f():\n    from tandem.engine.model import llama\n")
    (fake / "common" / "y.py").write_text("import torch\n")
    found = _violations(fake)
    assert any("engine/x.py: imports tandem.gateway" in v for v in found)
    assert any("engine/kernels/k.py: imports tandem.engine.model" in v for v in found)
    assert any("common/y.py: imports torch" in v for v in found)


def test_check_catches_a_circle_through_a_lazy_import(tmp_path):
    fake = tmp_path / "tandem"
    (fake / "cluster").mkdir(parents=True)
    (fake / "cluster" / "a.py").write_text("from tandem.cluster import b\n")
    (fake / "cluster" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tandem.cluster import a\n"
        "def f():\n    from tandem.cluster.c import g\n")
    (fake / "cluster" / "c.py").write_text("from tandem.cluster.a import x\n")
    assert _circles(_graph(fake)) == [["tandem.cluster.a", "tandem.cluster.b", "tandem.cluster.c"]]
    (fake / "cluster" / "c.py").write_text("import json\n")  # the TYPE_CHECKING import is no edge
    assert _circles(_graph(fake)) == []
