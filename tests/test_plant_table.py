"""tests/plant.py's table follows the code: each planted bug's text is in its file exactly once
(a refactor that moves it leaves the bug unplantable, silently), and each test named to catch it
exists (a renamed test would make the planted bug "caught" by nothing). Planting itself is slow and
stays outside CI: `python tests/plant.py`."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plant", ROOT / "tests" / "plant.py")
plant = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plant)


@pytest.mark.parametrize("bug", plant.BUGS, ids=[b[0] for b in plant.BUGS])
def test_each_planted_bug_is_plantable_and_its_tests_exist(bug):
    name, file, old, new, tests = bug
    assert old != new, name
    assert (ROOT / file).read_text().count(old) == 1, f"{name}: the replaced text is not in {file} exactly once"
    for node in tests:
        path, _, test = node.partition("::")
        assert (ROOT / path).is_file(), f"{name}: {path} does not exist"
        if test:
            defined = {n.name for n in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(n, ast.FunctionDef)}
            assert test.split("[")[0] in defined, f"{name}: {node} is not a test of {path}"


def test_the_table_names_each_bug_once():
    names = [b[0] for b in plant.BUGS]
    assert len(names) == len(set(names)) and len(names) >= 31
