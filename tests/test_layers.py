"""Dependence points one way: `cli -> service -> cluster -> engine / core` (docs/architecture.md,
"Layers"). Every module's imports are read with `ast`, imports inside functions included (a lazy
import is still a dependence), and checked against the table below. Nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("packbench", "cli", "service", "cluster", "engine", "core", "db", "migrations")

# Which packbench packages each package may import (its own always).
MAY_IMPORT = {
    "packbench": {"service", "cluster", "core", "db"},  # the Python API, a facade beside the CLI
    "cli": {"service", "cluster", "engine", "core", "db"},
    "service": {"cluster", "engine", "core", "db"},
    "cluster": {"engine", "core"},
    "engine": {"core"},
    "core": set(),
    "db": {"migrations", "core"},  # db and migrations are one layer: db/migrate.py locates the revisions
    "migrations": {"db", "core"},
}
# Third-party packages only some packages may import.
ONLY_IN = {
    "ray": {"cluster"},
    "sqlalchemy": {"db", "migrations"},
    "alembic": {"db", "migrations"},
    "torch": {"engine", "cluster", "cli"},  # cluster: inside the actor; cli: `model stats` only
}
# The one place for exceptions to the tables, each with its reason: {(module, imported name): why}.
# None are needed: cluster imports neither service nor db (the scheduler, which catches
# db.errors, lives in service). bench/ and tests/ are harnesses over every layer and not checked.
ALLOWED: dict[tuple[str, str], str] = {}


def modules(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import in the module, wherever it stands."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in modules(root):
        rel = path.relative_to(root)
        mine = rel.parts[0]
        module = ".".join(rel.with_suffix("").parts)
        for line, name in imported(path):
            top = name.split(".")[0]
            if (module, top) in ALLOWED or (module, name) in ALLOWED:
                continue
            if top in PACKAGES and top != mine and top not in MAY_IMPORT[mine]:
                out.append(f"{rel}:{line} imports {name}: {mine} may import only {sorted(MAY_IMPORT[mine])}")
            elif top in ONLY_IN and mine not in ONLY_IN[top]:
                out.append(f"{rel}:{line} imports {name}: only {sorted(ONLY_IN[top])} may import {top}")
    return out


def test_no_package_imports_a_package_above_it():
    assert violations() == []


def test_db_is_imported_by_service_only_for_its_errors():
    """service reaches the database through a Store it is given: of db it imports the errors."""
    names = {name for path in (ROOT / "service").rglob("*.py") for _, name in imported(path)
             if name.split(".")[0] == "db"}
    assert names <= {"db.errors"}


@pytest.mark.parametrize("source, offence", [
    ("import ray\n", "only ['cluster'] may import ray"),
    ("def f():\n    from cluster.pool import RayPool\n", "core may import only []"),
    ("def f():\n    import sqlalchemy.orm\n", "only ['db', 'migrations'] may import sqlalchemy"),
])
def test_the_check_sees_top_level_and_lazy_imports(tmp_path, source, offence):
    """The check itself: a core module importing ray, cluster or sqlalchemy (lazily too) is named."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text(source)
    (problem,) = violations(tmp_path)
    assert problem.startswith("core/bad.py:") and offence in problem


def test_service_imports_cluster_and_engine_only_inside_functions():
    """`packbench submit` imports neither ray nor torch: service reaches cluster and engine only
    inside the functions that need them."""
    eager = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            eager += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("cluster", "engine")]
    assert eager == []
