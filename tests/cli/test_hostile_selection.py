"""A selection that matches nothing says so, not that the database is empty, and a mistyped
protocol given to `audit` is refused instead of auditing nothing with exit 0."""

import json

import pytest

from packbench.db.store import Store


@pytest.fixture
def one_screen(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()
        protocol = store.put_protocol(sha256="ab" * 32, name="quickstart",
                                      canonical_json=json.dumps({"name": "quickstart"}))
        store.create_screen(protocol_id=protocol, submitter="alice")
    return url


def test_screens_list_with_filters_that_match_nothing(packbench_cli, tmp_path, one_screen):
    """Bug caught: `screens list --protocol typo` (or --status cancelled) said "no screens; submit
    one with `packbench submit`", as if the database held none."""
    for filters in (("--protocol", "typo"), ("--status", "cancelled"), ("--name", "nightly")):
        r = packbench_cli("screens", "list", *filters, "--db", one_screen, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("no screen matches"), (filters, r.stdout)
    r = packbench_cli("screens", "list", "--db", one_screen, cwd=tmp_path)
    assert "quickstart" in r.stdout


def test_audit_of_an_unknown_protocol_is_refused(packbench_cli, tmp_path, one_screen):
    """Bug caught: `audit --protocol typo` printed "no screens to audit" and exited 0: a CI step
    auditing a mistyped protocol passed having audited nothing."""
    r = packbench_cli("audit", "--protocol", "typo", "--db", one_screen, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == ("error: no screen of protocol 'typo' (a name or SHA-256 prefix); "
                                              "`packbench screens list` shows each screen's protocol\n"), r.stderr
    r = packbench_cli("audit", "--protocol", "quickstart", "--db", one_screen, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "no screens to audit\n"  # it exists, and has not run


def test_results_screen_view_says_why_its_attempt_failed(packbench_cli, tmp_path, one_screen):
    """Bug caught: `results --screen N` of a screen whose attempt died printed its (empty) tables and
    "no verdicts", but not the attempt's stored error, which its --json and `screens show` give."""
    with Store(one_screen) as store:
        [screen] = store.list_screens()
        attempt = store.start_attempt(screen_id=screen.id, worker="w", node="n", gpu_name="cpu", gpu_index=0,
                                      machine_id=None, source_freeze={}, archive_path="gone.zip")
        store.finish_attempt(attempt.id, status="interrupted", error="the worker's process died (exit 137)")
    r = packbench_cli("results", "--screen", str(screen.id), "--db", one_screen, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[1] == "attempt 1 error: the worker's process died (exit 137)", \
        r.stdout
