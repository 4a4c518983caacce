"""`results --since` and `audit --since` read a date the same way (core/dates.py)."""

import pytest


@pytest.fixture
def empty_db(packbench_cli, tmp_path):
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    assert packbench_cli("db", "upgrade", "--db", url, cwd=tmp_path).returncode == 0
    return url


def test_results_and_audit_take_and_refuse_the_same_dates(packbench_cli, tmp_path, empty_db):
    """Bug caught: `audit --since ' 2026-01-31'` was refused while `results --since` took it, and
    the two refused a bad date in different words."""
    took = [packbench_cli(*command, "--since", " 2026-01-31T12:00+02:00 ", "--db", empty_db, cwd=tmp_path)
            for command in (("results",), ("audit",))]
    assert [r.returncode for r in took] == [0, 0], [r.stderr for r in took]
    refused = [packbench_cli(*command, "--since", "31/01/2026", "--db", empty_db, cwd=tmp_path)
               for command in (("results",), ("audit",))]
    assert [r.returncode for r in refused] == [2, 2]
    assert refused[0].stderr == refused[1].stderr and len(refused[0].stderr.splitlines()) == 1, refused
    assert "--since '31/01/2026' is not an ISO date" in refused[0].stderr


def test_a_megabyte_date_is_quoted_short(packbench_cli, tmp_path, empty_db):
    """A megabyte `--since` was quoted in its refusal up to the 1,000-character line limit; the
    refusal quotes 60 characters of it, then names the fix."""
    for command in (("results",), ("audit", "screen")):
        r = packbench_cli(*command, "--since", "9" * (1 << 20), "--db", empty_db, cwd=tmp_path)
        assert r.returncode == 2 and len(r.stderr) < 250, r.stderr
        assert r.stderr.startswith("error: --since '999") and "is not an ISO date" in r.stderr, r.stderr
