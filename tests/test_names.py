"""One concept, one name: a class name is defined in one module of packbench's packages, so
`Protocol` or `Episode` means one thing wherever it is read (the ORM's rows are `Sql*`, the CLI's
and service's views carry their own names). Read with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from test_layers import ROOT, modules


def class_homes(root: Path = ROOT) -> dict[str, list[str]]:
    """class name -> the modules (relative paths) that define it at module level."""
    homes: dict[str, list[str]] = defaultdict(list)
    for path in modules(root):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.ClassDef):
                homes[node.name].append(str(path.relative_to(root)))
    return homes


def test_every_class_name_has_one_home():
    twice = {name: paths for name, paths in class_homes().items() if len(paths) > 1}
    assert twice == {}, f"class names defined in more than one module (rename one): {twice}"


def test_the_check_sees_a_name_defined_twice(tmp_path):
    for package in ("core", "service"):
        (tmp_path / "packbench" / package).mkdir(parents=True)
        (tmp_path / "packbench" / package / "m.py").write_text("class Point:\n    pass\n")
    assert class_homes(tmp_path)["Point"] == ["packbench/core/m.py", "packbench/service/m.py"]


def test_every_test_file_name_is_unique():
    # tests/ has no __init__.py: pytest imports each test file by its base name, so two files of one
    # name in different folders stop the whole run at collection ("import file mismatch"), which a
    # run of either file alone never shows.
    homes: dict[str, list[str]] = defaultdict(list)
    for path in (ROOT / "tests").rglob("test_*.py"):
        homes[path.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in homes.items() if len(paths) > 1} == {}
