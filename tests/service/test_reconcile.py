"""After a one-shot `dispatch` dies in a database outage: its attempt is still `running` (its
lease has not run out) and its archive holds episodes without rows. `db reconcile`
(service/reconcile.py) inserts them at once, since the dispatcher's process on this host is gone,
and the audit calls the attempt unfinished (PARTIAL), never DISAGREE."""

from __future__ import annotations

from pathlib import Path

import pytest

from packbench.db.errors import DatabaseUnavailable
from packbench.service.audit import audit_screens
from packbench.service.reconcile import reconcile
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool
from tests.service.screens import dispatcher, process_gone, protocol_file, rows


def died_in_an_outage(store, tmp_path, monkeypatch, *, gone: bool):
    """A one-shot dispatcher whose database goes away after two rows; `gone`: its process has
    ended since (else it lives on, as this test's process)."""
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=3))  # 8 episodes
    real, written = store.put_episode, []

    def put_episode(attempt_id, record):
        if len(written) == 2:
            raise DatabaseUnavailable("connection refused")
        written.append(record["plan_index"])
        return real(attempt_id, record)

    monkeypatch.setattr(store, "put_episode", put_episode)
    monkeypatch.setattr(store, "release", lambda *a, **k: None)  # the database is gone: nothing is given back
    d = dispatcher(store, tmp_path, FakePool(episode_s=0.01), workers=1)
    d.run()
    monkeypatch.undo()
    assert d.stopping == "database" and d.fatal
    if gone:
        process_gone(tmp_path / "packbench.db", d.state.id)
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "running" and rows(store, attempt.id) == [0, 1]
    return screen_id, attempt


def test_db_reconcile_finds_the_rows_of_a_dead_dispatchers_running_attempt(store, tmp_path, monkeypatch):
    screen_id, attempt = died_in_an_outage(store, tmp_path, monkeypatch, gone=True)
    (before,) = audit_screens(store, [screen_id])
    assert before.unfinished and before.result == "partial" and before.report.rows_pending  # not DISAGREE
    report = reconcile(store)
    assert report.inserted >= 1  # said "reconciled 0" while a row was missing
    (done,) = report.attempts
    assert done.attempt_id == attempt.id and done.check == "crc32"
    archived = rows(store, attempt.id)
    assert archived[:2] == [0, 1] and len(archived) == 2 + report.inserted
    (after,) = audit_screens(store, [screen_id])
    assert after.result == "partial" and not after.report.rows_pending


def test_the_commands_say_partial_and_reconcile_the_rows(store, tmp_path, monkeypatch):
    """`packbench audit --all` said DISAGREE for the attempt until its lease ran out, and
    `packbench db reconcile` said "reconciled 0" while a row was missing."""
    from typer.testing import CliRunner

    from packbench.cli.main import app

    screen_id, attempt = died_in_an_outage(store, tmp_path, monkeypatch, gone=True)
    url = f"sqlite:///{tmp_path / 'packbench.db'}"
    audit = CliRunner().invoke(app, ["audit", "--all", "--db", url])
    assert audit.exit_code == 0, audit.output
    assert audit.output.startswith(f"audit of screen {screen_id}: PARTIAL (attempt 1 running: ")
    assert "some without a row yet (`packbench db reconcile` inserts them)" in audit.output
    fixed = CliRunner().invoke(app, ["db", "reconcile", "--db", url])
    assert fixed.exit_code == 0 and "reconciled 0" not in fixed.output, fixed.output
    assert len(rows(store, attempt.id)) > 2


def test_a_live_dispatchers_running_attempt_is_left_to_it(store, tmp_path, monkeypatch):
    """Its archive is still being written: it reconciles its own rows when the database is back."""
    screen_id, attempt = died_in_an_outage(store, tmp_path, monkeypatch, gone=False)
    assert reconcile(store).inserted == 0 and rows(store, attempt.id) == [0, 1]


@pytest.mark.ray
def test_an_audit_on_ray_calls_rows_pending_partial_not_disagree(store, tmp_path, monkeypatch, ray_address):
    """`audit --all --ray` said DISAGREE for the attempt a local audit calls PARTIAL (README: an
    audit calls it PARTIAL, rows pending, not DISAGREE): the report a Ray task sent back dropped
    its rows_pending flag."""
    import ray

    from packbench.core.settings import Settings

    screen_id, attempt = died_in_an_outage(store, tmp_path, monkeypatch, gone=True)
    ray.shutdown()  # an embedded Ray an earlier test left in this process
    try:
        (on_ray,) = audit_screens(store, [screen_id], on_ray=True, settings=Settings(address=ray_address))
    finally:
        ray.shutdown()
    assert on_ray.report.rows_pending and on_ray.unfinished and on_ray.result == "partial", on_ray.report.record


def stopped_after_the_seal(store, tmp_path, monkeypatch):
    """A one-shot dispatcher whose database goes away as it stores the verdicts of a screen whose
    archive it has just sealed (a kill in the same window leaves the same state); its process has
    ended since."""
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=3))  # 8 episodes

    def put_verdicts(attempt_id, verdicts):
        raise DatabaseUnavailable("connection refused")

    monkeypatch.setattr(store, "put_verdicts", put_verdicts)
    monkeypatch.setattr(store, "release", lambda *a, **k: None)  # the database is gone: nothing is given back
    d = dispatcher(store, tmp_path, FakePool(episode_s=0.01), workers=1)
    d.run()
    monkeypatch.undo()
    assert d.stopping == "database" and d.fatal
    process_gone(tmp_path / "packbench.db", d.state.id)
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "running" and rows(store, attempt.id) == list(range(8))
    assert store.verdicts(attempt.id) == []
    return screen_id, attempt


def test_a_sealed_archive_whose_verdicts_never_reached_the_database(store, tmp_path, monkeypatch):
    """The bug caught: a dispatcher stopped between sealing the archive and storing its verdicts
    (killed, or its database gone) left an attempt whose audit said DISAGREE ("database lacks
    verdict ...", exit 1), as for a tampered database, before and after `db reconcile`, which
    inserted episode rows only and said "reconciled 0". Now the audit calls it PARTIAL (rows
    pending) and reconcile inserts the archive's verdicts, checked against its manifest."""
    from packbench.core.archive import VERDICTS_NAME, ArchiveReader

    screen_id, attempt = stopped_after_the_seal(store, tmp_path, monkeypatch)
    (before,) = audit_screens(store, [screen_id])
    assert before.report.record["complete"] and before.report.record["result"] == "disagree"
    assert before.report.problems and all(p.startswith("database lacks verdict ") for p in before.report.problems)
    assert before.report.rows_pending and not before.report.partial
    assert before.unfinished and before.result == "partial"  # not DISAGREE
    report = reconcile(store)
    (done,) = report.attempts
    with ArchiveReader(attempt.archive_path) as reader:
        archived = reader.read_json(VERDICTS_NAME)
    assert archived and done.verdicts == report.verdicts == len(archived)
    assert (done.attempt_id, done.inserted, done.check, done.refused) == (attempt.id, 0, "manifest", ())
    assert done.line() == (f"screen {screen_id} attempt 1: 0 episode rows and {len(archived)} verdict "
                           f"row{'s' if len(archived) != 1 else ''} inserted from its archive, checked against "
                           f"its manifest's SHA-256")
    stored = store.verdicts(attempt.id)
    assert [(v.gate, v.condition, v.phase, v.passed, v.value, v.threshold, list(v.episodes), v.detail)
            for v in stored] == [(v["gate"], v["condition"], v["phase"], v["passed"], v["value"], v["threshold"],
                                  v["episodes"], v["detail"]) for v in archived]
    (after,) = audit_screens(store, [screen_id])
    assert after.result == "agree" and after.report.problems == [] and not after.report.rows_pending
    again = reconcile(store)
    assert again.attempts == [] and again.verdicts == 0  # idempotent: nothing is inserted twice


@pytest.mark.parametrize("status", ["done", "failed"])
def test_an_attempt_whose_seal_was_recorded_lacking_its_verdicts_still_disagrees(store, tmp_path, status):
    """The boundary: a sealed archive's rows are pending only while the database never recorded
    its seal. An attempt whose seal it recorded (done, or failed with every episode failed, which
    is sealed too) stored its verdicts before, so one without them now disagrees."""
    import sqlite3

    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=3))
    dispatcher(store, tmp_path, FakePool(episode_s=0.01), workers=1).run()
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "done" and attempt.archive_sha256 is not None
    with sqlite3.connect(tmp_path / "packbench.db") as connection:
        connection.execute("DELETE FROM verdicts WHERE attempt_id = ?", (attempt.id,))
        connection.execute("UPDATE attempts SET status = ? WHERE id = ?", (status, attempt.id))
    (audit,) = audit_screens(store, [screen_id])
    assert audit.attempt_status == status
    assert not audit.report.rows_pending and not audit.unfinished and audit.result == "disagree"
    assert audit.report.problems and all(p.startswith("database lacks verdict ") for p in audit.report.problems)
    assert reconcile(store).attempts == [] and store.verdicts(attempt.id) == []  # not restored over the removal


def test_a_verdicts_member_altered_after_the_seal_is_refused_not_inserted(store, tmp_path, monkeypatch):
    """reconcile inserts only verdicts whose bytes match the manifest's SHA-256 entry; altered
    ones are named (exit 1 from `db reconcile`) and nothing is inserted."""
    from packbench.core.canonical import canonical_json
    from tests.core.archive_samples import rewrite

    screen_id, attempt = stopped_after_the_seal(store, tmp_path, monkeypatch)
    forged = [{"gate": "faithfulness", "condition": "packet", "phase": "all", "passed": True, "value": 0.0,
               "threshold": 0.0, "interval": None, "episodes": [], "detail": ""}]
    rewrite(Path(attempt.archive_path), replace={"verdicts.json": canonical_json(forged)})
    report = reconcile(store)
    (done,) = report.attempts
    assert (done.inserted, done.verdicts, report.refused) == (0, 0, 1)
    assert done.refused == ("member verdicts.json does not match its SHA-256 entry (altered after it was written)",)
    assert store.verdicts(attempt.id) == []


def test_the_audit_command_says_partial_for_the_sealed_archive(store, tmp_path, monkeypatch):
    """`packbench audit --all` exited 1 with DISAGREE and "database lacks verdict" lines."""
    from typer.testing import CliRunner

    from packbench.cli.main import app

    screen_id, _ = stopped_after_the_seal(store, tmp_path, monkeypatch)
    url = f"sqlite:///{tmp_path / 'packbench.db'}"
    audit = CliRunner().invoke(app, ["audit", "--all", "--db", url])
    assert audit.exit_code == 0, audit.output
    assert audit.output.startswith(f"audit of screen {screen_id}: PARTIAL (attempt 1 running: 8 of 8 planned "
                                   f"episodes archived, the archive sealed, rows of it not in the database yet "
                                   f"(`packbench db reconcile` inserts them); digest ")
    assert "lacks verdict" not in audit.output


def test_an_agreeing_audit_of_an_attempt_not_done_names_its_status(store, tmp_path, monkeypatch):
    """The bug caught: once its verdicts were in (reconciled, or stored before a kill that came
    before the attempt's end), the sealed archive of a lost or running attempt audited "AGREE
    (8 episodes, ...)" under a table of passing verdicts, nothing saying the screen never ended
    done (`screens list` said failed); a done attempt's line is unchanged."""
    from typer.testing import CliRunner

    from packbench.cli.main import app

    screen_id, _ = stopped_after_the_seal(store, tmp_path, monkeypatch)
    reconcile(store)
    url = f"sqlite:///{tmp_path / 'packbench.db'}"
    audit = CliRunner().invoke(app, ["audit", "screen", str(screen_id), "--db", url])
    assert audit.exit_code == 0, audit.output
    last = audit.output.strip().splitlines()[-1]
    assert last.startswith(f"audit of screen {screen_id}: AGREE (attempt 1 running in the database, not done; "
                           f"8 episodes, digest "), last
    (done_id,) = submit(store, protocol_file(tmp_path, prompts=3))
    dispatcher(store, tmp_path, FakePool(episode_s=0.01), workers=1).run()
    audit = CliRunner().invoke(app, ["audit", "screen", str(done_id), "--db", url])
    assert audit.exit_code == 0, audit.output
    assert audit.output.strip().splitlines()[-1].startswith(f"audit of screen {done_id}: AGREE (8 episodes, digest ")


def test_malformed_verdicts_under_a_consistent_manifest_are_refused_in_one_line(store, tmp_path, monkeypatch):
    """A verdicts.json whose manifest entry was rewritten to match it, holding a verdict the
    columns cannot take (an interval that is a number), is refused and named; before the check
    the insert raised a TypeError."""
    import hashlib
    import json
    import zipfile

    from packbench.core.archive import MANIFEST_NAME
    from packbench.core.canonical import canonical_json
    from tests.core.archive_samples import rewrite

    screen_id, attempt = stopped_after_the_seal(store, tmp_path, monkeypatch)
    path = Path(attempt.archive_path)
    bad = canonical_json([{"gate": "faithfulness", "condition": "packet", "phase": "all", "passed": True,
                           "interval": 5}])
    with zipfile.ZipFile(path) as zf:
        manifest = json.loads(zf.read(MANIFEST_NAME))
    manifest["members"]["verdicts.json"] = {"sha256": hashlib.sha256(bad).hexdigest(), "size": len(bad)}
    rewrite(path, replace={"verdicts.json": bad, MANIFEST_NAME: canonical_json(manifest)})
    report = reconcile(store)
    (done,) = report.attempts
    assert (done.inserted, done.verdicts, done.refused) == (0, 0, ("verdicts.json is not a list of verdicts",))
    assert store.verdicts(attempt.id) == []


def test_reconcile_says_an_archive_it_cannot_find_may_never_have_been_written(store, tmp_path, monkeypatch):
    """An attempt claimed by a dispatcher that died before its archive existed was counted as
    "1 archives not on this host": wrong in number, and in meaning where no host holds it."""
    from typer.testing import CliRunner

    from packbench.cli.main import app

    screen_id, attempt = died_in_an_outage(store, tmp_path, monkeypatch, gone=True)
    Path(attempt.archive_path).unlink()
    url = f"sqlite:///{tmp_path / 'packbench.db'}"
    r = CliRunner().invoke(app, ["db", "reconcile", "--db", url])
    assert r.exit_code == 0, r.output
    assert r.output.strip().endswith("; 1 archive not found here (on another host, or never written)"), r.output
