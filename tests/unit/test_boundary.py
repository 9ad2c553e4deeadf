"""The library boundary (DESIGN.md): platform/eyas never imports ray; only track.py imports mlflow.

Checked statically with ``ast`` so the rule holds for every module, imported by a test or not, including
imports inside functions and ``importlib.import_module("ray...")`` / ``__import__`` with a literal name.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLATFORM = REPO / "platform"
LIBRARY = PLATFORM / "eyas"
MLFLOW_ALLOWED = {LIBRARY / "track.py"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module name) for every absolute import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value.split(".")[0]))
    return sorted(found)


def library_files() -> list[Path]:
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 10, f"expected the eyas package under {LIBRARY}"
    return files


def violations(module: str, allowed: set[Path] = frozenset()) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line} imports {module}"
            for path in library_files() if path not in allowed
            for line, name in imported_modules(path) if name == module]


def test_library_never_imports_ray():
    assert violations("ray") == [], "Ray code belongs in jobs/, tune/ or serving/, never in platform/eyas"


def test_only_track_imports_mlflow():
    assert violations("mlflow", MLFLOW_ALLOWED) == [], "MLflow is imported only in platform/eyas/track.py"


def test_platform_is_not_a_package():
    # a package named `platform` would shadow Python's stdlib module of that name
    assert not (PLATFORM / "__init__.py").exists()


def test_the_scan_sees_every_import_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os, ray.train\nfrom ray import tune\nfrom . import ray\n"
                      "def f():\n    import mlflow\n    importlib.import_module('ray.serve')\n")
    assert imported_modules(sample) == [(1, "os"), (1, "ray"), (2, "ray"), (5, "mlflow"), (6, "ray")]
