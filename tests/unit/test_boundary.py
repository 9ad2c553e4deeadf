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


# ---------------------------------------------------------------- the apps and the library's layers

APPS = ("jobs", "tune", "serving")
# jobs.load deploys the Serve app and sizes its reservation with serving.config.ServeArgs; it goes once the Serve
# config (ServeArgs) lives in the library or eyas_ray (serving/ is being reworked by its owner). Nothing may join it.
PENDING_APP_IMPORTS = {("jobs/load.py", "serving")}


def app_imports() -> set[tuple[str, str]]:
    """(file, other app) for every import of one app by another (jobs, tune, serving; eyas_ray is shared)."""
    found = set()
    for app in APPS:
        for path in sorted((REPO / app).rglob("*.py")):
            for _, name in imported_modules(path):
                if name in APPS and name != app:
                    found.add((str(path.relative_to(REPO)), name))
    return found


def test_apps_never_import_each_other():
    assert app_imports() - PENDING_APP_IMPORTS == set(), \
        "jobs/, tune/ and serving/ import only the library and eyas_ray (shared Ray glue), never each other"


def test_pending_app_imports_are_still_there():
    # a pending entry that was fixed must leave the list, so the list never hides a new import of the same kind
    assert PENDING_APP_IMPORTS <= app_imports()


def package_imports(package: str) -> list[str]:
    """The first-party ``eyas.*`` subpackages each module of ``platform/eyas/<package>`` imports, as file:line."""
    found = []
    for path in sorted((LIBRARY / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "eyas"
                                         else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno} {name}" for name in names]
    return found


def imports_of(package: str, other: str) -> list[str]:
    return [entry for entry in package_imports(package)
            if entry.split(" ")[1] == f"eyas.{other}" or entry.split(" ")[1].startswith(f"eyas.{other}.")]


def test_drafters_never_import_train():
    assert imports_of("drafters", "train") == [], "shared training types live in eyas.models.features"


def test_train_uses_drafters_only_through_the_registry_and_methods():
    # train/ uses drafters (one way: DESIGN.md); what it needs from them is the registry and the method table
    allowed = ("eyas.drafters", "eyas.drafters.registry")
    assert [e for e in imports_of("train", "drafters") if e.split(" ")[1] not in allowed] == []
