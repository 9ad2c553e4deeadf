"""The boundaries (DESIGN.md): platform/eyas never imports ray; only track.py imports mlflow; jobs/, tune/ and
serving/ never import each other (nor does platform/eyas_ray import them); first-party imports sit at module top
unless a comment says why; no module is past ~400 lines.

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
FIRST_PARTY = {"eyas", "eyas_ray", *APPS}
MAX_MODULE_LINES = 400


def app_imports() -> set[tuple[str, str]]:
    """(file, app) for every import of an app by another app or by the shared glue (platform/eyas_ray)."""
    found = set()
    for folder, own in [(REPO / app, app) for app in APPS] + [(PLATFORM / "eyas_ray", None)]:
        for path in sorted(folder.rglob("*.py")):
            for _, name in imported_modules(path):
                if name in APPS and name != own:
                    found.add((str(path.relative_to(REPO)), name))
    return found


def test_apps_never_import_each_other():
    assert app_imports() == set(), \
        "jobs/, tune/ and serving/ import only the library and eyas_ray (shared Ray glue), never each other"


def first_party_files() -> list[Path]:
    return sorted(p for folder in [LIBRARY, PLATFORM / "eyas_ray", *(REPO / app for app in APPS)]
                  for p in folder.rglob("*.py"))


def local_imports(path: Path, root: Path = REPO) -> list[str]:
    """``file:line`` of each first-party import inside a function body with no ``# why`` comment on its lines or on
    the line above."""
    source = path.read_text()
    lines = source.splitlines()
    found = set()
    for function in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["eyas" if node.level else node.module or ""]
            else:
                continue
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            commented = above.startswith("#") or any("#" in line for line in lines[node.lineno - 1:node.end_lineno])
            if not commented and any(name.split(".")[0] in FIRST_PARTY for name in names):
                found.add(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(found)


def test_first_party_imports_sit_at_module_top_unless_a_comment_says_why():
    missing = [entry for path in first_party_files() for entry in local_imports(path)]
    assert missing == [], (f"{', '.join(missing)}: move these imports to the top of their module, or say on the "
                           "line (or the line above) why one must stay local (an import cycle, Ray only where a "
                           "command runs without it)")


def test_the_local_import_scan_sees_uncommented_ones(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import eyas\ndef f():\n    import os\n    from eyas import corpus\n"
                      "    from . import x\n    from jobs import load  # cycle\n    from tune.config import (\n"
                      "        SweepConfig)\n    # Ray only here\n    from jobs import train\n")
    assert local_imports(sample, tmp_path) == ["sample.py:4", "sample.py:5", "sample.py:7"]


def test_no_module_is_past_the_size_where_it_asks_to_be_split():
    long = [f"{path.relative_to(REPO)}: {n} lines" for path in first_party_files()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == [], f"{', '.join(long)}: split by responsibility (STYLE.md: past ~{MAX_MODULE_LINES} lines)"


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


def test_no_two_test_files_share_a_name():
    """pytest imports test files by basename (no __init__.py in tests/): two of one name fail collection."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
