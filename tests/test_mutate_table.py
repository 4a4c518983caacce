"""`make mutate`'s module table and its PostgreSQL stage stay true to the checkout (tests/mutate.py)."""

import subprocess
import sys

from tests.mutate import MODULES, POSTGRESQL_STAGE, ROOT, _settings


def test_every_module_and_test_file_of_the_table_exists():
    # Would catch a module moved or a test file renamed: mutmut would mutate nothing, or select no
    # test and count every mutant as not killed.
    for module, tests in MODULES.items():
        assert (ROOT / "packbench" / module).exists(), module
        assert tests and all((ROOT / t).is_file() for t in tests), (module, tests)
    assert set(POSTGRESQL_STAGE) <= set(MODULES)


def test_the_postgresql_stage_selects_the_postgresql_cases_and_the_first_run_none():
    # Would catch the stages' marker expressions swapped or lost (the SQLite run paying 2 s a
    # PostgreSQL case per mutant, or the PostgreSQL stage running the SQLite cases again).
    assert "'-m', 'not gpu and not ray'" in _settings("db/queue.py", MODULES["db/queue.py"]).replace('"', "'")
    pg = _settings("db/queue.py", MODULES["db/queue.py"], postgresql=True).replace('"', "'")
    assert "'-m', 'postgresql and not gpu and not ray'" in pg


def test_the_postgresql_marker_is_on_every_postgresql_case_and_no_other():
    # Would catch the marker missing the pg_url tests, or a database fixture's sqlite case marked.
    def collected(marks: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", marks, "tests/db/test_db_queue.py", "tests/db/test_db_queries.py"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if "::" in line]

    marked, unmarked = collected("postgresql"), collected("not postgresql")
    source = "".join((ROOT / f).read_text() for f in ("tests/db/test_db_queue.py", "tests/db/test_db_queries.py"))
    pg_only = {line.split("::")[1].split("[")[0] for line in marked if "postgresql" not in line}
    assert pg_only and all(f"def {name}(pg_url" in source for name in pg_only)
    assert all("[postgresql" in line for line in marked if line.split("::")[1].split("[")[0] not in pg_only)
    assert any("[postgresql" in line for line in marked) and any("[sqlite" in line for line in unmarked)
    assert not any("postgresql" in line for line in unmarked)
