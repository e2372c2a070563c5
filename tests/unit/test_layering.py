"""DESIGN.md §2: a module imports only from layers below it (checked on the source)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"

LAYERS = {"common": 0, "protocol": 1, "text": 1, "engine": 2, "transfer": 3, "worker": 4, "prefill": 4,
          "decode": 4,
          "router": 5, "gateway": 6, "cluster": 7, "bench": 7}
# bench drives clusters the way users do (start, stream, shut down): the one importer of cluster.
ALLOWED_SAME_LAYER = {("cluster", "bench"), ("bench", "cluster")}
# worker/ holds the base both worker actors build on (engine loop, threads, metrics, health).
ALLOWED_SAME_LAYER |= {("prefill", "worker"), ("decode", "worker")}
# Third-party imports a package may not make at all (besides what the layers forbid).
FORBIDDEN = {"router": {"torch", "cupy"}, "gateway": {"torch", "cupy"},
             "common": {"torch", "ray", "fastapi", "pydantic", "cupy"},
             "protocol": {"torch", "cupy"}, "text": {"torch", "cupy", "ray"}}
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _violations() -> list[str]:
    bad = []
    for path in sorted(SERVICES.rglob("*.py")):
        rel = path.relative_to(SERVICES)
        if len(rel.parts) < 2:
            continue  # services/__init__.py
        pkg = rel.parts[0]
        assert pkg in LAYERS, f"services/{pkg} has no layer in DESIGN.md §2; add it to LAYERS"
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "services":
                parts = name.split(".")
                if len(parts) < 2:
                    continue
                dep = parts[1]
                if dep == pkg:
                    continue
                if (pkg, dep) not in ALLOWED_SAME_LAYER and (
                        dep == "cluster" or LAYERS[dep] >= LAYERS[pkg]):
                    bad.append(f"{rel}: imports services.{dep} (layer {LAYERS[dep]}) "
                               f"from layer {LAYERS[pkg]}")
            elif top in FORBIDDEN.get(pkg, ()):
                bad.append(f"{rel}: imports {top}")
            elif pkg == "common" and top not in STDLIB and top != "prometheus_client":
                bad.append(f"{rel}: common/ may use the standard library and prometheus_client only")
    return bad


def test_every_import_respects_the_layers():
    assert _violations() == []


def test_check_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "services"
    (fake / "engine").mkdir(parents=True)
    (fake / "engine" / "x.py").write_text("from services.gateway import app\nimport fastapi\n")
    (fake / "common").mkdir()
    (fake / "common" / "y.py").write_text("import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "SERVICES", fake)
    found = _violations()
    assert any("engine/x.py: imports services.gateway" in v for v in found)
    assert any("common/y.py: imports torch" in v for v in found)
