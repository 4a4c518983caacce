"""Dependence points one way: `cli -> service -> cluster -> engine / core` (docs/architecture.md,
"Layers"), all under one import name, `packbench`. Every module's imports are read with `ast`,
imports inside functions included (a lazy import is still a dependence), and checked against the
table below. Nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = "packbench"
# The layers: the subpackages of packbench. `api` is the Python API, a facade beside the CLI;
# packbench/__init__.py belongs to it (it re-exports the API's names).
PACKAGES = ("api", "cli", "service", "cluster", "engine", "core", "db", "migrations")

# Which layers each layer may import (its own always).
MAY_IMPORT = {
    "api": {"service", "cluster", "core", "db"},
    "cli": {"service", "cluster", "engine", "core", "db"},
    "service": {"cluster", "engine", "core", "db"},
    "cluster": {"engine", "core"},
    "engine": {"core"},
    "core": set(),
    "db": {"migrations", "core"},  # db and migrations are one layer: db/migrate.py locates the revisions
    "migrations": {"db", "core"},
}
# Third-party packages only some layers may import.
ONLY_IN = {
    "ray": {"cluster"},
    "sqlalchemy": {"db", "migrations"},
    "alembic": {"db", "migrations"},
    "torch": {"engine", "cluster", "cli"},  # cluster: inside the actor; cli: `model stats` only
}
# The one place for exceptions to the tables, each with its reason: {(module, imported name): why}.
# None are needed: cluster imports neither service nor db (the dispatcher, which catches
# db.errors, lives in service). bench/ and tests/ are harnesses over every layer and not checked
# for layers, only for the import name (test_nothing_imports_a_layer_by_a_bare_name).
ALLOWED: dict[tuple[str, str], str] = {}


def modules(root: Path) -> list[Path]:
    return sorted((root / TOP).rglob("*.py"))


def layer_of(path: Path, root: Path = ROOT) -> str:
    """The layer of a module file: its first folder under packbench/ (the API for the top files)."""
    parts = path.relative_to(root / TOP).parts
    if parts == ("__main__.py",):
        return "cli"  # `python -m packbench` runs the command line
    return parts[0] if len(parts) > 1 and parts[0] in PACKAGES else "api"


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import in the module, wherever it stands;
    `from packbench import core` reads as packbench.core."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == TOP:
                out += [(node.lineno, f"{TOP}.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def layer_imported(name: str) -> str | None:
    """The packbench layer a dotted import names (packbench.core.gates -> core), else None."""
    parts = name.split(".")
    if parts[0] != TOP or len(parts) == 1:
        return None
    return parts[1] if parts[1] in PACKAGES else "api"


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in modules(root):
        rel = path.relative_to(root)
        mine = layer_of(path, root)
        module = ".".join(rel.with_suffix("").parts)
        for line, name in imported(path):
            top = name.split(".")[0]
            theirs = layer_imported(name)
            if (module, top) in ALLOWED or (module, name) in ALLOWED:
                continue
            if top in PACKAGES:
                out.append(f"{rel}:{line} imports {name}: write {TOP}.{name} (one import name)")
            elif theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                out.append(f"{rel}:{line} imports {name}: {mine} may import only {sorted(MAY_IMPORT[mine])}")
            elif top in ONLY_IN and mine not in ONLY_IN[top]:
                out.append(f"{rel}:{line} imports {name}: only {sorted(ONLY_IN[top])} may import {top}")
    return out


def test_no_package_imports_a_package_above_it():
    assert violations() == []


def test_db_is_imported_by_service_only_for_its_errors():
    """service reaches the database through a Store it is given: of db it imports the errors."""
    names = {name for path in (ROOT / TOP / "service").rglob("*.py") for _, name in imported(path)
             if layer_imported(name) == "db"}
    assert names <= {"packbench.db.errors"}


@pytest.mark.parametrize("source, offence", [
    ("import ray\n", "only ['cluster'] may import ray"),
    ("def f():\n    from packbench.cluster.pool import RayPool\n", "core may import only []"),
    ("def f():\n    import sqlalchemy.orm\n", "only ['db', 'migrations'] may import sqlalchemy"),
])
def test_the_check_sees_top_level_and_lazy_imports(tmp_path, source, offence):
    """The check itself: a core module importing ray, cluster or sqlalchemy (lazily too) is named."""
    (tmp_path / TOP / "core").mkdir(parents=True)
    (tmp_path / TOP / "core" / "bad.py").write_text(source)
    (problem,) = violations(tmp_path)
    assert problem.startswith("packbench/core/bad.py:") and offence in problem


def test_service_imports_cluster_and_engine_only_inside_functions():
    """`packbench submit` imports neither ray nor torch: service reaches cluster and engine only
    inside the functions that need them."""
    eager = []
    for path in sorted((ROOT / TOP / "service").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            eager += [f"{path.name}:{node.lineno} {n}" for n in names if layer_imported(n) in ("cluster", "engine")]
    assert eager == []


def test_nothing_imports_a_layer_by_a_bare_name():
    """Tests and bench/ too: `import core` would work from the repository root (the current
    folder is on sys.path) while an installed packbench has no top-level `core`."""
    bare = []
    for path in sorted([*ROOT.joinpath("tests").rglob("*.py"), *ROOT.joinpath("bench").rglob("*.py")]):
        bare += [f"{path.relative_to(ROOT)}:{line} {name}" for line, name in imported(path)
                 if name.split(".")[0] in PACKAGES]
    assert bare == []
